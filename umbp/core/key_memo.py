"""A request's object key strings, built once and kept with the request.

Only a store asked by key string needs them: the embedded pool answers a query's
prefixes and raw hashes (:class:`~umbp.core.rank_keys.HashRuns`) and is never given
a string, so its requests' memos stay empty. For the others (the server, Mooncake
and MORI clients), a key string costs more than anything else a lookup does (a hex
digest and a ~110-character concatenation; docs/performance.md, admission CPU time),
and the same keys
are asked for again: vLLM asks for a waiting request's external hits on every
step until it is scheduled, and a preempted request is looked up again on
resume. (The store step's residency check builds its own keys for now: it asks
only about blocks vLLM reports cached, which a new request's lookup does not
name.) A :class:`KeyMemo` is an immutable value the shell keeps in the
request's state; :func:`group_keys` answers from it and returns the memo with any
keys it had to build added, so each key of a request is built once.

Object ``j`` of a group probed every ``unit`` tokens ends at token ``(j + 1) * unit``
and is identified by the hash ending there. A memo entry covers one run
``start <= j < stop`` of one ``(group, unit)``; it is used only while every hash
it was built from is still the request's hash at that position (a reused request
id, or a different keyspace, rebuilds it), so an answer from the memo is always
the key :class:`~umbp.core.identity.KeySpace` would build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from umbp.core.identity import KeySpace, RankTopology, ReplicatedGroups
from umbp.core.rank_keys import glued_keys, rank_prefixes

__all__ = ["EMPTY_KEY_MEMO", "GroupKeys", "KeyMemo", "group_keys", "keys_per_rank"]


@dataclass(frozen=True, slots=True)
class GroupKeys:
    """Every rank's key of objects ``start <= j < stop`` of one group.

    ``hashes[j - start]`` is object ``j``'s hash and ``per_rank[r][j - start]`` its
    key on rank ``r`` (``topology.coords()`` order).
    """

    group_id: int
    unit: int
    start: int
    hashes: tuple[bytes, ...]
    per_rank: tuple[tuple[str, ...], ...]

    @property
    def stop(self) -> int:
        return self.start + len(self.hashes)

    def object_hashes(self, first: int, stop: int) -> tuple[bytes, ...]:
        """Objects ``first <= j < stop`` (which this entry must cover)."""
        return self.hashes[first - self.start : stop - self.start]

    def rank_keys(self, rank: int, first: int, stop: int) -> tuple[str, ...]:
        """Rank ``rank``'s keys of objects ``first <= j < stop``: a slice."""
        return self.per_rank[rank][first - self.start : stop - self.start]


@dataclass(frozen=True, slots=True)
class KeyMemo:
    """One request's memoised keys: for the keyspace they were built in, one
    :class:`GroupKeys` per ``(group, unit)`` (a model has a handful of groups)."""

    namespace: str | None = None
    topology: RankTopology | None = None
    entries: tuple[GroupKeys, ...] = ()
    replicated: ReplicatedGroups = ()

    def entry(self, keyspace: KeySpace, group_id: int, unit: int) -> GroupKeys | None:
        if not self._built_in(keyspace):
            return None
        for entry in self.entries:
            if entry.group_id == group_id and entry.unit == unit:
                return entry
        return None

    def with_entry(self, keyspace: KeySpace, new: GroupKeys) -> KeyMemo:
        kept = (
            tuple(e for e in self.entries if (e.group_id, e.unit) != (new.group_id, new.unit))
            if self._built_in(keyspace)
            else ()
        )
        return KeyMemo(keyspace.namespace, keyspace.topology, (*kept, new), keyspace.replicated)

    def _built_in(self, keyspace: KeySpace) -> bool:
        return (
            self.namespace == keyspace.namespace
            and self.topology == keyspace.topology
            and self.replicated == keyspace.replicated
        )


EMPTY_KEY_MEMO: Final = KeyMemo()
"""A request whose keys were never built."""


def group_keys(
    memo: KeyMemo,
    keyspace: KeySpace,
    group_id: int,
    unit: int,
    hash_block_size: int,
    request_hashes: tuple[bytes, ...],
    first: int,
    stop: int,
) -> tuple[GroupKeys, KeyMemo]:
    """Keys covering objects ``first <= j < stop`` of ``group_id`` probed every
    ``unit`` tokens, and the memo with them: only objects the memo lacks (or all,
    when its entry no longer matches ``request_hashes``) get new strings.

    ``unit`` must be a multiple of ``hash_block_size`` and object ``stop - 1`` must
    have a hash (``stop * unit <= len(request_hashes) * hash_block_size``).
    """
    if unit <= 0 or unit % hash_block_size:
        raise ValueError(f"unit {unit} is not a multiple of hash_block_size {hash_block_size}")
    stride = unit // hash_block_size
    if stop <= first:  # nothing asked (e.g. the local tokens reach past the hashes)
        return _build(keyspace, group_id, unit, stride, request_hashes, first, first), memo
    if first < 0 or stop * stride > len(request_hashes):
        raise ValueError(
            f"objects {first}..{stop - 1} every {unit} tokens need "
            f"{stop * stride} hashes, the request has {len(request_hashes)}"
        )
    entry = memo.entry(keyspace, group_id, unit)
    if entry is not None and not _still_describes(entry, stride, request_hashes):
        entry = None
    if entry is not None and entry.start <= first and stop <= entry.stop:
        return entry, memo
    if entry is None or stop < entry.start or first > entry.stop:
        # Nothing to keep (or a gap between): just this run.
        fresh = _build(keyspace, group_id, unit, stride, request_hashes, first, stop)
        return fresh, memo.with_entry(keyspace, fresh)
    before = _build(keyspace, group_id, unit, stride, request_hashes, first, entry.start)
    after = _build(keyspace, group_id, unit, stride, request_hashes, entry.stop, stop)
    merged = GroupKeys(
        group_id,
        unit,
        min(first, entry.start),
        before.hashes + entry.hashes + after.hashes,
        tuple(
            head + keys + tail
            for head, keys, tail in zip(before.per_rank, entry.per_rank, after.per_rank)
        ),
    )
    return merged, memo.with_entry(keyspace, merged)


def _still_describes(entry: GroupKeys, stride: int, request_hashes: tuple[bytes, ...]) -> bool:
    """Every hash the entry was built from is still the request's (one C-level
    tuple comparison: the same bytes objects compare by identity)."""
    end = entry.stop * stride
    if end > len(request_hashes):
        return False
    return request_hashes[entry.start * stride + stride - 1 : end : stride] == entry.hashes


def _build(
    keyspace: KeySpace,
    group_id: int,
    unit: int,
    stride: int,
    request_hashes: tuple[bytes, ...],
    first: int,
    stop: int,
) -> GroupKeys:
    objects = request_hashes[first * stride + stride - 1 : stop * stride : stride]
    return GroupKeys(group_id, unit, first, objects, keys_per_rank(keyspace, group_id, objects))


def keys_per_rank(
    keyspace: KeySpace, group_id: int, objects: tuple[bytes, ...]
) -> tuple[tuple[str, ...], ...]:
    """Every rank's key of each of ``objects`` (``topology.coords()`` order)."""
    return glued_keys(rank_prefixes(keyspace, group_id), objects)
