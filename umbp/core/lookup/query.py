"""A lookup query: which objects to ask the pool for, on every rank, as key prefixes
and raw hashes (:class:`~umbp.core.rank_keys.HashRuns`), and, for a store asked by
string, the key strings built once per request through its memo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from umbp.core.geometry import CacheGeometry, hashes_at_token_ends
from umbp.core.identity import KeySpace
from umbp.core.key_memo import EMPTY_KEY_MEMO, KeyMemo, group_keys, keys_per_rank
from umbp.core.lookup.guards import lookup_limit
from umbp.core.rank_keys import HashRuns, KeyLayout, RankedKeys, rank_prefixes, rank_tags

__all__ = [
    "EMPTY_LOOKUP_MEMO",
    "LookupMemo",
    "LookupQuery",
    "build_lookup_query",
    "lookup_keys",
    "request_lookup_keys",
    "request_lookup_query",
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
    geometry: CacheGeometry,
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
    geometry: CacheGeometry, keyspace: KeySpace, query: LookupQuery, memo: KeyMemo
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
    geometry: CacheGeometry | None = None
    keyspace: KeySpace | None = None
    last_keys: RankedKeys | None = None


EMPTY_LOOKUP_MEMO: Final = LookupMemo()
"""A request never looked up."""


def request_lookup_query(
    geometry: CacheGeometry,
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
    geometry: CacheGeometry, keyspace: KeySpace, query: LookupQuery, memo: LookupMemo
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
    # is; several runs are joined with list += (cheaper than chain()).
    if len(runs) == 1:
        return runs[0]
    joined: list[str] = []
    for run in runs:
        joined += run
    return joined

