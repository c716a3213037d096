"""Hit windows: how far the pool's answers to a lookup query reach.

The window ``[local_tokens, external_tokens)`` never starts before the local tokens,
never reaches the last prompt token, covers only objects every rank holds, and with
EAGLE ends one block earlier. One plain full-attention group is decided here
(:func:`single_group_hit_tokens`); several groups, or one that is not plain full
attention, are decided by vLLM's own coordinator from :func:`coordinator_hit_sets`,
whose answer becomes a :class:`LoadSpec` through :func:`load_spec_from_hits`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, count
from operator import not_

from umbp.core.geometry import CacheGeometry, hashes_at_token_ends
from umbp.core.lookup.query import LookupQuery
from umbp.core.rank_keys import fold_ranks

__all__ = [
    "LoadSpec",
    "coordinator_hit_sets",
    "fold_rank_hits",
    "hit_window",
    "load_runs_async",
    "load_spec_from_hits",
    "local_object_hashes",
    "single_group_hit_tokens",
    "single_group_load_spec",
]


def fold_rank_hits(
    query: LookupQuery, answers: Sequence[bool]
) -> tuple[tuple[bool, ...], ...] | None:
    """Per group, per object: did every rank hit? None for an answer of the wrong
    length (the caller treats it as a miss, never as an exception)."""
    return fold_ranks(query.runs.layout, answers)


def single_group_hit_tokens(
    geometry: CacheGeometry, query: LookupQuery, folded: Sequence[Sequence[bool]]
) -> int:
    """Tokens past ``local_tokens`` the pool can supply for one full-attention group.

    Whole blocks count while they hit contiguously (hashes are chained: a missing
    block means every later block misses). With partial hash hits, interior hashes
    are sparse, since only a saved tail exists, so the first block that does not
    fully hit is scanned from its end for the longest hit. EAGLE drops one block; if
    that leaves the window inside a block on an object that was not reported, the
    window falls back to that block's start, so that a load reads only reported hits.
    """
    if geometry.coordinated or len(geometry.group_ids) != 1 or len(folded) != 1:
        raise ValueError("single_group_hit_tokens needs one uncoordinated group")
    hits = folded[0]
    unit = geometry.lookup_units[0]
    units_per_block = geometry.group_block_sizes[0] // unit
    block_end_hits = hits if units_per_block == 1 else hits[units_per_block - 1 :: units_per_block]
    # all() tests a bool by identity, cheaper than index()'s comparisons, and a
    # prompt whose every block hits is the longest scan.
    if all(block_end_hits):
        full_blocks = len(block_end_hits)
    else:
        full_blocks = next(compress(count(), map(not_, block_end_hits)))
    matched = full_blocks * units_per_block
    if units_per_block > 1:
        interior = list(hits[matched : min(matched + units_per_block - 1, len(hits))])
        if True in interior:
            interior.reverse()
            matched += len(interior) - interior.index(True)
    if geometry.use_eagle and matched:
        matched = max(0, matched - units_per_block)
        inside = matched % units_per_block
        if inside and not hits[matched - 1]:
            matched -= inside
    return matched * unit


def local_object_hashes(
    geometry: CacheGeometry, hashes: Sequence[bytes], local_tokens: int
) -> tuple[tuple[bytes, ...], ...]:
    """Per group, the objects inside the local tokens. The coordinator must see
    vLLM's own cached blocks there too; the caller asks vLLM which of these it has."""
    return tuple(
        hashes_at_token_ends(hashes, unit, local_tokens, unit, geometry.hash_block_size)
        for unit in geometry.lookup_units
    )


def coordinator_hit_sets(
    query: LookupQuery,
    folded: Sequence[Sequence[bool]],
    local_hits: Sequence[Iterable[bytes]] = (),
) -> tuple[frozenset[bytes], ...]:
    """Per group, the hashes every rank holds (plus ``local_hits``, per group, if
    given): what vLLM's coordinator may treat as cached."""
    if len(folded) != len(query.object_hashes):
        raise ValueError("folded hits do not match the query's groups")
    if local_hits and len(local_hits) != len(query.object_hashes):
        raise ValueError("local hits do not match the query's groups")
    sets = [
        frozenset(compress(objects, hits)) for objects, hits in zip(query.object_hashes, folded)
    ]
    if local_hits:
        sets = [hit_set.union(local) for hit_set, local in zip(sets, local_hits)]
    return tuple(sets)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """A hit window: tokens ``[local_tokens, external_tokens)`` come from the pool.

    ``block_hashes_by_group`` is the coordinator's answer (one entry per block of
    each group from block 0, None for a block that is skipped or null); empty on
    the single-group path, where loads follow from the window alone.
    """

    local_tokens: int
    external_tokens: int
    block_hashes_by_group: tuple[tuple[bytes | None, ...], ...] = ()

    @property
    def num_tokens_to_load(self) -> int:
        return self.external_tokens - self.local_tokens


def hit_window(local_tokens: int, num_tokens: int, hit_end: int) -> range:
    """Tokens to load: from the local tokens up to ``hit_end``, never the last token."""
    end = min(hit_end, num_tokens - 1)
    return range(local_tokens, max(local_tokens, end))


def load_spec_from_hits(
    query: LookupQuery,
    hit_end: int,
    block_hashes_by_group: Sequence[Sequence[bytes | None]] = (),
) -> LoadSpec | None:
    """The load spec for a hit reaching token ``hit_end``, or None if nothing loads.

    Both paths end here: the single-group path with ``local_tokens + hit tokens``,
    the coordinated path with the coordinator's hit length and its block hashes.
    """
    window = hit_window(query.local_tokens, query.num_tokens, hit_end)
    if not window:
        return None
    return LoadSpec(
        local_tokens=window.start,
        external_tokens=window.stop,
        block_hashes_by_group=tuple(tuple(group) for group in block_hashes_by_group),
    )


def single_group_load_spec(
    geometry: CacheGeometry, query: LookupQuery, folded: Sequence[Sequence[bool]]
) -> LoadSpec | None:
    """:func:`single_group_hit_tokens` as a load spec."""
    return load_spec_from_hits(
        query, query.local_tokens + single_group_hit_tokens(geometry, query, folded)
    )


def load_runs_async(requested_async: bool, spec: LoadSpec, geometry: CacheGeometry) -> bool:
    """Whether the load may run asynchronously.

    When the coordinator's hit names no pool object past the local blocks, there
    is nothing to transfer and so nothing to wait for: the load is synchronous.
    """
    if not requested_async or not spec.block_hashes_by_group:
        return requested_async
    for block_size, group_hashes in zip(geometry.group_block_sizes, spec.block_hashes_by_group):
        start_block = spec.local_tokens // block_size
        if any(block_hash is not None for block_hash in group_hashes[start_block:]):
            return True
    return False

