"""Lookup: which objects to ask the pool for, and how far its answers reach.

A request's prefix is addressed by ``Request.block_hashes``, one chained hash per
``hash_block_size`` tokens; the hash ending at token ``t`` fingerprints the whole
prefix ``[0, t)``. One stored object is one KV block of one cache group on one
rank, identified by ``(group_id, block_hash)`` and keyed per rank by
:class:`~umbp.core.identity.KeySpace`.

The scheduler asks, for a request with ``local_tokens`` already cached by vLLM,
how many further tokens the pool can supply. The answer is a *hit window*
``[local_tokens, external_tokens)`` that

* never starts before the local tokens (they are already on the device),
* never reaches the last prompt token (vLLM must run at least one token to produce
  logits; a hit covering the whole prompt would leave it nothing to schedule),
* covers only objects that *every* rank holds (each rank stores its own shard, so a
  block missing on one rank is missing),
* with EAGLE, ends one block earlier (the drafter needs the last block's hidden
  states recomputed).

Two paths decide the window. A single plain full-attention group is decided here
(:func:`single_group_hit_tokens`). Several groups, or a single group that is not
plain full attention, need vLLM's own KV cache coordinator (sliding windows, Mamba
states, common prefix of all groups); for those this module supplies the hit sets
(:func:`coordinator_hit_sets`) and turns the coordinator's answer into a
:class:`LoadSpec` (:func:`load_spec_from_hits`).

The geometry, the lookup guards and the hash helpers live in
:mod:`umbp.core.lookup_geometry` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, count
from operator import not_
from typing import Final

from umbp.core.identity import KeySpace
from umbp.core.key_memo import EMPTY_KEY_MEMO, KeyMemo, group_keys, keys_per_rank
from umbp.core.lookup_geometry import (
    NULL_BLOCK_ID,
    BlockTable,
    LookupGeometry,
    LookupSkip,
    block_table_of,
    hashes_at_token_ends,
    lookup_limit,
    lookup_skip_reason,
    lookup_unit,
)
from umbp.core.rank_keys import (
    HashRuns,
    KeyLayout,
    RankedKeys,
    fold_ranks,
    rank_prefixes,
    rank_tags,
)

__all__ = [
    "EMPTY_LOOKUP_MEMO",
    "NULL_BLOCK_ID",
    "BlockTable",
    "LoadSpec",
    "LookupGeometry",
    "LookupMemo",
    "LookupQuery",
    "LookupSkip",
    "block_table_of",
    "build_lookup_query",
    "coordinator_hit_sets",
    "fold_rank_hits",
    "hashes_at_token_ends",
    "hit_window",
    "load_runs_async",
    "load_spec_from_hits",
    "local_object_hashes",
    "lookup_keys",
    "lookup_limit",
    "lookup_skip_reason",
    "lookup_unit",
    "request_lookup_keys",
    "request_lookup_query",
    "single_group_hit_tokens",
    "single_group_load_spec",
]

@dataclass(frozen=True, slots=True)
class LookupQuery:
    """What one lookup asks the pool, and what it needs to read the answer.

    ``object_hashes[g][i]`` is group ``g``'s object ending at token
    ``local_tokens + units[g] * (i + 1)``. ``runs`` are the keys to ask, without
    strings (:class:`~umbp.core.rank_keys.HashRuns`): group-major, then rank
    (``topology.coords()`` order), then object, each (group, rank) run one prefix
    and every object's hash. A store that answers by hash reads them as they are;
    for one that needs strings, :func:`lookup_keys` builds them (through the
    request's memo), in the same order. Their
    :class:`~umbp.core.rank_keys.KeyLayout` (one rank-major segment per group) folds
    the answers and routes keys to ranks by position. ``request_hashes`` lets the
    caller tell whether an asynchronous lookup still describes the request.
    """

    local_tokens: int
    num_tokens: int
    request_hashes: tuple[bytes, ...]
    units: tuple[int, ...]
    object_hashes: tuple[tuple[bytes, ...], ...]
    runs: HashRuns

    @property
    def layout(self) -> KeyLayout:
        return self.runs.layout

    @property
    def rank_count(self) -> int:
        return self.runs.layout.rank_count

    @property
    def key_count(self) -> int:
        """Keys asked (objects times ranks): the length of every answer."""
        return self.runs.layout.key_count

    @property
    def max_hit_end(self) -> int:
        """The furthest token a hit may reach (the coordinator's max length)."""
        return self.num_tokens - 1

    def describes(self, local_tokens: int, num_tokens: int, hashes: Sequence[bytes]) -> bool:
        """Whether this query still matches the request's current state."""
        return (
            self.local_tokens == local_tokens
            and self.num_tokens == num_tokens
            and len(self.request_hashes) == len(hashes)
            and self.request_hashes == tuple(hashes)
        )


def build_lookup_query(
    geometry: LookupGeometry,
    keyspace: KeySpace,
    hashes: Sequence[bytes],
    local_tokens: int,
    num_tokens: int,
) -> LookupQuery:
    """Every object past the local tokens, up to :func:`lookup_limit`, for every rank:
    strided slices of the hashes and each group's cached rank prefixes, no key string.

    Call only when :func:`lookup_skip_reason` is None.
    """
    request_hashes = tuple(hashes)
    limit = lookup_limit(geometry, num_tokens, len(request_hashes))
    hash_block_size = geometry.hash_block_size
    objects = tuple([
        hashes_at_token_ends(request_hashes, local_tokens + unit, limit, unit, hash_block_size)
        for unit in geometry.lookup_units
    ])
    prefixes = tuple([rank_prefixes(keyspace, group_id) for group_id in geometry.group_ids])
    layout = KeyLayout.rank_major(tuple(map(len, objects)), keyspace.topology.rank_count)
    return LookupQuery(
        local_tokens=local_tokens,
        num_tokens=num_tokens,
        request_hashes=request_hashes,
        units=geometry.lookup_units,
        object_hashes=objects,
        runs=HashRuns(layout, rank_tags(keyspace), prefixes, objects),
    )


def lookup_keys(
    geometry: LookupGeometry, keyspace: KeySpace, query: LookupQuery, memo: KeyMemo
) -> tuple[RankedKeys, KeyMemo]:
    """The query's key strings (equal to ``query.runs.key_strings()``) for a store that asks
    by string, and the request's :class:`~umbp.core.key_memo.KeyMemo` holding them:
    keys the memo already has are sliced out of it, not built again.

    ``geometry`` and ``keyspace`` must be the ones the query was built with.
    """
    if query.units != geometry.lookup_units or query.runs.rank_tags != rank_tags(keyspace):
        raise ValueError("lookup_keys needs the geometry and keyspace the query was built with")
    request_hashes = query.request_hashes
    local_tokens = query.local_tokens
    runs: list[Sequence[str]] = []  # group-major, then rank: the query's key order
    for group_id, unit, objects in zip(geometry.group_ids, geometry.lookup_units, query.object_hashes):
        if local_tokens % unit:
            # Only a coordinated group can start between its objects: no memo run.
            runs.extend(keys_per_rank(keyspace, group_id, objects))
            continue
        first = local_tokens // unit
        stop = first + len(objects)
        entry, memo = group_keys(
            memo, keyspace, group_id, unit, geometry.hash_block_size, request_hashes, first, stop
        )
        runs.extend(entry.rank_keys(rank, first, stop) for rank in range(len(entry.per_rank)))
    return RankedKeys(_concatenated(runs), query.layout, query.runs.rank_tags), memo


@dataclass(frozen=True, slots=True)
class LookupMemo:
    """What one request's lookups keep between calls: its last query, which a lookup
    of the same request state (vLLM asking again for a waiting request) reuses whole,
    for the same geometry and keyspace; and, only for a store that asks by string,
    its key strings (``keys``) and the last query's keys (``last_keys``)."""

    keys: KeyMemo = EMPTY_KEY_MEMO
    last: LookupQuery | None = None
    geometry: LookupGeometry | None = None
    keyspace: KeySpace | None = None
    last_keys: RankedKeys | None = None


EMPTY_LOOKUP_MEMO: Final = LookupMemo()
"""A request never looked up."""


def request_lookup_query(
    geometry: LookupGeometry,
    keyspace: KeySpace,
    hashes: Sequence[bytes],
    local_tokens: int,
    num_tokens: int,
    memo: LookupMemo,
) -> tuple[LookupQuery, LookupMemo]:
    """The request's lookup query (equal to :func:`build_lookup_query`'s) and its new
    memo: the last query while it still describes the request, else a new one (its
    key strings, if a store needs them, come from :func:`request_lookup_keys`)."""
    last = memo.last
    if (
        last is not None
        and memo.geometry == geometry
        and memo.keyspace == keyspace
        and last.describes(local_tokens, num_tokens, hashes)
    ):
        return last, memo
    query = build_lookup_query(geometry, keyspace, hashes, local_tokens, num_tokens)
    return query, LookupMemo(memo.keys, query, geometry, keyspace)


def request_lookup_keys(
    geometry: LookupGeometry, keyspace: KeySpace, query: LookupQuery, memo: LookupMemo
) -> tuple[RankedKeys, LookupMemo]:
    """The key strings of the request's ``query`` for a store that asks by string,
    and the memo that keeps them: the last query's keys when it is that query, else
    built through the memo's :class:`~umbp.core.key_memo.KeyMemo` (:func:`lookup_keys`)."""
    if memo.last is query and memo.last_keys is not None:
        return memo.last_keys, memo
    keys, key_memo = lookup_keys(geometry, keyspace, query, memo.keys)
    return keys, LookupMemo(key_memo, query, geometry, keyspace, keys)


def _concatenated(runs: Sequence[Sequence[str]]) -> Sequence[str]:
    # One group on one rank (the common case) is one memo slice, passed on as it
    # is; several runs are joined with list +=, twice as fast as chain().
    if len(runs) == 1:
        return runs[0]
    joined: list[str] = []
    for run in runs:
        joined += run
    return joined


def fold_rank_hits(
    query: LookupQuery, answers: Sequence[bool]
) -> tuple[tuple[bool, ...], ...] | None:
    """Per group, per object: did every rank hit? None for an answer of the wrong
    length (the caller treats it as a miss, never as an exception)."""
    return fold_ranks(query.runs.layout, answers)


def single_group_hit_tokens(
    geometry: LookupGeometry, query: LookupQuery, folded: Sequence[Sequence[bool]]
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
    # all() tests a bool by identity, about twice as fast as index()'s comparisons,
    # and a prompt whose every block hits is the longest scan.
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
    geometry: LookupGeometry, hashes: Sequence[bytes], local_tokens: int
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
    geometry: LookupGeometry, query: LookupQuery, folded: Sequence[Sequence[bool]]
) -> LoadSpec | None:
    """:func:`single_group_hit_tokens` as a load spec."""
    return load_spec_from_hits(
        query, query.local_tokens + single_group_hit_tokens(geometry, query, folded)
    )


def load_runs_async(requested_async: bool, spec: LoadSpec, geometry: LookupGeometry) -> bool:
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
