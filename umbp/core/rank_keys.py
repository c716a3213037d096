"""Which positions of a batch of keys belong to which rank, and what every rank holds.

Each rank stores its own shard of a block under its own key, so asking the pool
about ``n`` objects asks ``n * R`` keys (``R`` ranks) and an object is held only
when every rank holds it. Core builds those keys in a known order, so the rank of
every position is known where the keys are made: a :class:`KeyLayout` records it
and :class:`RankedKeys` carries it beside the keys. Readers fold the answers with
it (:func:`fold_ranks`), and a router that keeps one store per rank sends each rank
its keys and puts the answers back by position (:meth:`RankedKeys.keys_of_rank`,
:func:`merge_rank_answers`), so no key string is ever parsed to find its rank.

A lookup query's keys also exist without strings, as :class:`HashRuns`: per
segment, each rank's key prefix and the objects' raw hashes (every key of one
(segment, rank) run is that prefix plus a hash in hex). A store that indexes its
keys by prefix and hash answers from them (``HashLookup`` in
:mod:`umbp.runtime.contract`); :meth:`HashRuns.key_strings` builds the strings for a
store that needs them.

Two orders exist:

* rank-major segments (a lookup query): segment ``s`` (one cache group) holds
  ``segment_sizes[s]`` objects; its keys are rank 0's for every object, then
  rank 1's, and so on, so each rank's keys of a segment are one contiguous run;
* object-major (residency and event checks): the ``R`` keys of each object sit
  together, so rank ``r``'s keys are every ``R``-th key from position ``r``.

A group a replica run of TP ranks shares (:mod:`umbp.core.replicas`) keeps this shape:
every rank of the run has the run's one key in its place, so ``all`` over the ranks
(:func:`fold_ranks`) is that one object's answer, and a hit needs it. Keys are still
asked once per rank: the layout, the routing and every store stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from typing import Any, Self

from umbp.core.identity import KeySpace, RankTopology, key_prefix, replica_writer

__all__ = [
    "HashRuns",
    "KeyLayout",
    "RankedKeys",
    "fold_ranks",
    "glued_keys",
    "merge_rank_answers",
    "object_major_keys",
    "rank_prefixes",
    "rank_tags",
]


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """The rank of every position of a key batch (see the module docstring).

    ``segment_sizes`` counts objects, not keys: segment ``s`` holds
    ``segment_sizes[s] * rank_count`` keys.
    """

    rank_count: int
    segment_sizes: tuple[int, ...]
    object_major: bool = False

    def __post_init__(self) -> None:
        if self.rank_count < 1:
            raise ValueError(f"a key layout needs at least one rank, got {self.rank_count}")
        if any(size < 0 for size in self.segment_sizes):
            raise ValueError(f"segment sizes must not be negative: {self.segment_sizes}")

    @classmethod
    def rank_major(cls, segment_sizes: Sequence[int], rank_count: int) -> KeyLayout:
        return _rank_major_layout(tuple(segment_sizes), rank_count)

    @classmethod
    def objects(cls, count: int, rank_count: int) -> KeyLayout:
        """``count`` objects, each object's rank keys together (object-major)."""
        return cls(rank_count, (count,), object_major=True)

    @property
    def key_count(self) -> int:
        return self.rank_count * sum(self.segment_sizes)

    def rank_slices(self, rank: int) -> tuple[slice, ...]:
        """Per segment, the positions of ``rank``'s keys (``segment_sizes[s]`` each)."""
        if not 0 <= rank < self.rank_count:
            raise ValueError(f"rank {rank} is not one of {self.rank_count} ranks")
        ranks = self.rank_count
        slices: list[slice] = []
        offset = 0
        for count in self.segment_sizes:
            if self.object_major:
                slices.append(slice(offset + rank, offset + count * ranks, ranks))
            else:
                start = offset + rank * count
                slices.append(slice(start, start + count))
            offset += count * ranks
        return tuple(slices)


@lru_cache(maxsize=1024)
def _rank_major_layout(segment_sizes: tuple[int, ...], rank_count: int) -> KeyLayout:
    # A memo of an immutable value: every lookup makes one, and a frozen
    # dataclass's construction costs more than the rest of a repeated lookup's keys.
    return KeyLayout(rank_count, segment_sizes)


def fold_ranks(
    layout: KeyLayout,
    answers: Sequence[bool],
    every: Callable[[Iterable[bool]], bool] = all,
) -> tuple[tuple[bool, ...], ...] | None:
    """Per segment, per object: ``every`` over the object's per-rank answers (``all``:
    does every rank hold it; ``any``: does some rank). None for an answer of the wrong
    length, which a caller treats as knowing nothing, never as an exception.

    ``answers`` are bools, as every store's ``lookup`` returns them; with one rank
    a tuple's slices are the answer itself, without a per-object call.
    """
    if len(answers) != layout.key_count:
        return None
    ranks = layout.rank_count
    folded: list[tuple[bool, ...]] = []
    offset = 0
    for count in layout.segment_sizes:
        size = count * ranks
        if ranks == 1:
            part = answers[offset : offset + count]
            folded.append(part if isinstance(part, tuple) else tuple(part))
        elif not count:
            folded.append(())
        elif every is all and all(
            answers if size == len(answers) else answers[offset : offset + size]
        ):
            # Every rank holds every object (a whole-prompt hit): one C-level scan,
            # not one all() per object.
            folded.append((True,) * count)
        else:
            if layout.object_major:
                per_rank = [answers[offset + rank : offset + size : ranks] for rank in range(ranks)]
            else:
                per_rank = [answers[start : start + count] for start in range(offset, offset + size, count)]
            folded.append(tuple(map(every, zip(*per_rank))))
        offset += size
    return tuple(folded)


def merge_rank_answers(
    layout: KeyLayout, per_rank: Sequence[Sequence[bool] | None]
) -> tuple[bool, ...]:
    """One answer per position from each rank's answers to its
    :meth:`RankedKeys.keys_of_rank`; None for a rank nobody serves (it holds nothing)."""
    if len(per_rank) != layout.rank_count:
        raise ValueError(f"{len(per_rank)} rank answers for {layout.rank_count} ranks")
    merged: list[bool] = [False] * layout.key_count
    for rank, answer in enumerate(per_rank):
        if answer is None:
            continue
        if len(answer) != sum(layout.segment_sizes):
            raise ValueError(
                f"rank {rank} answered {len(answer)} keys, was asked {sum(layout.segment_sizes)}"
            )
        start = 0
        for positions, count in zip(layout.rank_slices(rank), layout.segment_sizes):
            merged[positions] = answer[start : start + count]
            start += count
    return tuple(merged)


class RankedKeys(tuple[str, ...]):
    """A batch of keys that carries its :class:`KeyLayout` and each rank's tag.

    It is a tuple of strings, so it passes unchanged through every store's
    ``lookup(keys)``, and only a router that keeps one store per rank reads the
    layout (``rank_tags[r]`` names rank ``r`` as :func:`rank_tags` does). Immutable
    like the tuple it is; equal to a plain tuple of the same keys.
    """

    layout: KeyLayout
    rank_tags: tuple[str, ...]

    def __new__(
        cls, keys: Iterable[str], layout: KeyLayout, tags: Sequence[str]
    ) -> Self:
        self = super().__new__(cls, keys)
        if len(self) != layout.key_count:
            raise ValueError(f"{len(self)} keys for a layout of {layout.key_count}")
        if len(tags) != layout.rank_count:
            raise ValueError(f"{len(tags)} rank tags for {layout.rank_count} ranks")
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "rank_tags", tuple(tags))
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"RankedKeys is immutable: cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"RankedKeys is immutable: cannot delete {name}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankedKeys, (tuple(self), self.layout, self.rank_tags))

    def keys_of_rank(self, rank: int) -> tuple[str, ...]:
        """The keys of ``rank``, in position order: slices, no string is read."""
        slices = self.layout.rank_slices(rank)
        if len(slices) == 1:
            return self[slices[0]]
        return tuple(chain.from_iterable(self[part] for part in slices))


@dataclass(frozen=True, slots=True)
class HashRuns:
    """A rank-major batch of keys as prefixes and raw hashes: segment ``s``'s keys on
    rank ``r`` are ``prefixes[s][r]`` plus each of ``hashes[s]`` in hex, in that order,
    so position ``i`` of ``key_strings()`` is position ``i`` of any answer to them.

    Every prefix ends with ``:`` (as :func:`rank_prefixes` builds them): a key is then
    its prefix and hex digest split at its last colon, which is how a store indexes
    its keys by hash (the split is unambiguous, so an answer by hash is the answer
    for the key string).
    """

    layout: KeyLayout
    rank_tags: tuple[str, ...]
    prefixes: tuple[tuple[str, ...], ...]
    hashes: tuple[tuple[bytes, ...], ...]

    def __post_init__(self) -> None:
        layout = self.layout
        if layout.object_major or tuple(map(len, self.hashes)) != layout.segment_sizes:
            raise ValueError(
                f"hash runs of {tuple(map(len, self.hashes))} objects for a layout of "
                f"{layout.segment_sizes} (rank-major)"
            )
        if len(self.rank_tags) != layout.rank_count or len(self.prefixes) != len(self.hashes):
            raise ValueError(
                f"{len(self.rank_tags)} rank tags and {len(self.prefixes)} prefix runs for "
                f"{layout.rank_count} ranks and {len(self.hashes)} segments"
            )
        for prefixes in self.prefixes:
            if len(prefixes) != layout.rank_count or not all(p.endswith(":") for p in prefixes):
                raise ValueError(
                    f"each segment needs {layout.rank_count} key prefixes ending with ':', "
                    f"got {prefixes}"
                )

    @classmethod
    def of_segments(
        cls,
        rank_tags: tuple[str, ...],
        prefixes: tuple[tuple[str, ...], ...],
        hashes: tuple[tuple[bytes, ...], ...],
    ) -> HashRuns:
        return cls(
            KeyLayout.rank_major(tuple(map(len, hashes)), len(rank_tags)),
            rank_tags, prefixes, hashes,
        )

    @property
    def key_count(self) -> int:
        return self.layout.key_count

    def key_strings(self) -> RankedKeys:
        """The key strings, in position order (built here: a store that answers by
        hash never needs them)."""
        keys: list[str] = []
        for prefixes, hashes in zip(self.prefixes, self.hashes):
            for rank_keys in glued_keys(prefixes, hashes):
                keys += rank_keys
        return RankedKeys(keys, self.layout, self.rank_tags)

    def of_rank(self, rank: int) -> HashRuns:
        """Rank ``rank``'s runs alone (what a router asks that rank's store); its
        answers go back with :func:`merge_rank_answers`, as keys of that rank do."""
        if not 0 <= rank < self.layout.rank_count:
            raise ValueError(f"rank {rank} is not one of {self.layout.rank_count} ranks")
        return HashRuns(
            KeyLayout.rank_major(self.layout.segment_sizes, 1),
            (self.rank_tags[rank],),
            tuple((prefixes[rank],) for prefixes in self.prefixes),
            self.hashes,
        )


def glued_keys(
    prefixes: Sequence[str], hashes: Sequence[bytes]
) -> tuple[tuple[str, ...], ...]:
    """Per prefix (one per rank), the key of each hash: the prefix glued to its hex digest."""
    # The key strings are the floor of a lookup by string: a comprehension per rank
    # glues them faster than map(prefix.__add__, ...), and with several ranks each
    # hex digest is made once.
    if len(prefixes) == 1:
        prefix = prefixes[0]
        return (tuple([prefix + block_hash.hex() for block_hash in hashes]),)
    digests = list(map(bytes.hex, hashes))
    return tuple(tuple([prefix + digest for digest in digests]) for prefix in prefixes)


def rank_tags(keyspace: KeySpace) -> tuple[str, ...]:
    """Per rank (``topology.coords()`` order), the part of every one of its keys
    before the group: the namespace and the rank's coordinates."""
    return _rank_tags(keyspace.namespace, keyspace.topology)


def rank_prefixes(keyspace: KeySpace, group_id: int) -> tuple[str, ...]:
    """Per rank (``topology.coords()`` order), the key of ``group_id``'s objects up
    to the hash: a key is its rank's prefix plus the hash in hex (the ranks of a
    replica run have its writer's prefix)."""
    return _rank_prefixes(
        keyspace.namespace, keyspace.topology, group_id, keyspace.replica_run(group_id)
    )


# Memos of pure functions: every lookup needs these strings, and building them
# (rank coordinates, f-strings) costs more than looking them up.
@lru_cache(maxsize=64)
def _rank_tags(namespace: str, topology: RankTopology) -> tuple[str, ...]:
    group_suffix = ":g0:"
    return tuple(
        key_prefix(namespace, rank, 0).removesuffix(group_suffix) for rank in topology.coords()
    )


@lru_cache(maxsize=256)
def _rank_prefixes(
    namespace: str, topology: RankTopology, group_id: int, run: int
) -> tuple[str, ...]:
    return tuple(
        key_prefix(namespace, replica_writer(topology, rank, run), group_id)
        for rank in topology.coords()
    )


def object_major_keys(
    keyspace: KeySpace, identities: Iterable[tuple[int, bytes]]
) -> RankedKeys:
    """Every rank's key of each ``(group_id, block_hash)``, object-major."""
    identities = tuple(identities)
    keys = [key for group_id, block_hash in identities for key in keyspace.rank_keys(group_id, block_hash)]
    layout = KeyLayout.objects(len(identities), keyspace.topology.rank_count)
    return RankedKeys(keys, layout, rank_tags(keyspace))
