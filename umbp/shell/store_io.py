"""A cache group's objects on the store's side of a copy: where a load's copy reads them
and where a store's copy writes them.

Where the store lends and reserves pages of its own memory (the embedded pool's slab,
the node-local server's shared memory: `LendsObjects` / `ReservesObjects`;
:func:`umbp.core.config.copies_in_place` decides), the copy runs straight between the
KV blocks and those pages: one copy per byte. Every other store is read into staging
rows (`get_batch_into`) before the copy, and written from them (`put_batch`) after it;
where such a store keeps checksums the caller may compute (`ChecksumsFromCopy`: Mooncake
Store) and this host's copies hash as they move, the copies between KV blocks and staging
compute them, and the store does not read the rows a second time.

Either way a load gets a :class:`GroupSource` (pages to copy from, one per object for
staging rows; ``verify`` after or beside the copy gives the final statuses,
``release`` after it lets them go) and a store a :class:`GroupTarget` (pages to copy
into; ``finish`` after the copy says what is stored). A store answers failures as values; one that raises breaks the contract (a
binding's own error, unknown here), and umbp must never be the reason a request fails:
the group counts as unread (recomputed) or unwritten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from umbp.core.identity import KeySpace, RankCoord
from umbp.core.loads.outcomes import LoadStatus
from umbp.core.plans import GroupBlocks
from umbp.runtime.contract import (
    ChecksumsFromCopy,
    LendsObjects,
    ReservesObjects,
    WorkerStore,
)
from umbp.runtime.paged_copy import Hashes

logger = logging.getLogger("umbp")

__all__ = ["GroupSource", "GroupTarget", "StoreAccess", "copied_checksums"]


def _nothing() -> None:
    return None


def copied_checksums(
    keys: int, positions: Sequence[int], hashes: Hashes | None
) -> list[int | None] | None:
    """Per key of a group of ``keys``, the xxh3-64 that a copy of the objects at
    ``positions`` (in order) computed as it moved them; None: the copy did not hash."""
    if hashes is None:
        return None
    checksums: list[int | None] = [None] * keys
    for position, digest in zip(positions, hashes.digests(), strict=True):
        checksums[position] = digest
    return checksums


@dataclass(frozen=True, slots=True, eq=False)
class GroupSource:
    """One group's objects as a load copies them. ``statuses``: per key, what is known
    before the copy (a lent object counts as HIT until verified; None: the group could
    not be read). Key ``i`` is in pages ``pages[i]`` of ``memory`` (None: nothing to
    copy). ``verify`` gives the final statuses (once; given per key the xxh3-64 the copy
    computed of what it read, where it hashed); ``release`` lets the pages go (once,
    after the copy finished reading them)."""

    statuses: tuple[LoadStatus, ...] | None
    memory: npt.NDArray[np.uint8] | None
    pages: tuple[tuple[int, ...] | None, ...]
    verify: Callable[[Sequence[int | None] | None], tuple[LoadStatus, ...] | None]
    release: Callable[[], None] = _nothing
    hashed_by_copy: bool = False
    """The copy out hashes what it reads, for ``verify``: a loan's lender then reads
    nothing twice; an unchecked read (`ChecksumsFromCopy`) is verified by nothing else."""


def unread(keys: int) -> GroupSource:
    """A group that could not be read: every block fails as UNAVAILABLE."""
    return GroupSource(None, None, (None,) * keys, lambda _: None)


@dataclass(frozen=True, slots=True, eq=False)
class GroupTarget:
    """Where one group's objects go: key ``i`` into pages ``pages[i]`` of ``memory``
    (None: nothing to copy). ``finish(copied, checksums)`` after the copy (once;
    ``copied`` False when it failed; ``checksums`` per key the xxh3-64 the copy computed
    of what it wrote, None where it did not hash) says per key whether the object is
    stored (None: the group was not written at all)."""

    memory: npt.NDArray[np.uint8]
    pages: tuple[tuple[int, ...] | None, ...]
    finish: Callable[[bool, Sequence[int | None] | None], tuple[bool, ...] | None]


class StoreAccess:
    """The store a worker moves one rank's objects through, a group at a time."""

    def __init__(
        self, store: Callable[[], WorkerStore | None], keyspace: KeySpace, rank: RankCoord
    ) -> None:
        self._store = store
        self._keyspace = keyspace
        self._rank = rank

    def keys(self, group: GroupBlocks) -> list[str]:
        keyspace, rank, group_id = self._keyspace, self._rank, group.group_id
        return [keyspace.key(rank, group_id, block_hash) for block_hash in group.block_hashes]

    # -- loads --------------------------------------------------------------------------

    def lend(self, group: GroupBlocks, object_bytes: int) -> GroupSource:
        """The group's objects where the store keeps them (a loan)."""
        store = self._store()
        if not isinstance(store, LendsObjects):
            return unread(len(group))
        try:
            loan = store.lend(self.keys(group), object_bytes)
        except Exception as error:  # noqa: BLE001 (see the module docstring)
            logger.warning("umbp load failed: %s", error)
            return unread(len(group))
        statuses = tuple(
            LoadStatus.HIT if pages is not None else LoadStatus.MISSING for pages in loan.pages
        )
        return GroupSource(statuses, loan.memory, loan.pages, loan.verify, loan.release,
                           hashed_by_copy=True)

    def read_into(
        self, group: GroupBlocks, memory: npt.NDArray[np.uint8], rows: Sequence[int],
        copy_hashes: bool = False,
    ) -> GroupSource:
        """The group's objects copied into ``rows`` of ``memory`` (staging); where the
        copy out of them hashes (``copy_hashes``) and the store takes its checksums, read
        unchecked, for that copy's checksums to verify."""
        store = self._store()
        if store is None:
            return unread(len(group))
        rows_of = tuple((row,) for row in rows)
        try:
            buffers = [memory[row] for row in rows]
            if copy_hashes and isinstance(store, ChecksumsFromCopy):
                unchecked = store.get_batch_unchecked(self.keys(group), buffers)
                return GroupSource(unchecked.statuses, memory, rows_of, unchecked.verify,
                                   hashed_by_copy=True)
            statuses = store.get_batch_into(self.keys(group), buffers)
        except Exception as error:  # noqa: BLE001 (see the module docstring)
            logger.warning("umbp load failed: %s", error)
            return unread(len(group))
        read = tuple(statuses)  # verified as they were read
        return GroupSource(read, memory, rows_of, lambda _: read)

    # -- stores -------------------------------------------------------------------------

    def reserve(self, group: GroupBlocks, object_bytes: int) -> GroupTarget | None:
        """Pages the store reserves for the group's objects; None: not written at all."""
        store = self._store()
        if not isinstance(store, ReservesObjects):
            return None
        try:
            reserved = store.reserve(self.keys(group), object_bytes)
        except Exception as error:  # noqa: BLE001 (see the module docstring)
            logger.warning("umbp store failed: %s", error)
            return None
        pages, commit = reserved.pages, reserved.commit

        def finish(
            copied: bool, checksums: Sequence[int | None] | None
        ) -> tuple[bool, ...] | None:
            try:
                return commit([copied and owned is not None for owned in pages], checksums)
            except Exception as error:  # noqa: BLE001 (see the module docstring)
                logger.warning("umbp store failed: %s", error)
                return None

        return GroupTarget(reserved.memory, pages, finish)

    @property
    def takes_checksums(self) -> bool:
        """Whether the store takes the checksums of a copy into staging (`write_from`)."""
        return isinstance(self._store(), ChecksumsFromCopy)

    def write_from(
        self, group: GroupBlocks, memory: npt.NDArray[np.uint8], rows: Sequence[int],
        checksums: Sequence[int | None] | None = None,
    ) -> tuple[bool, ...] | None:
        """Put the group's objects from ``rows`` of ``memory`` (staging), with the
        checksums the copy into them computed where it hashed every one; None: the
        group was not written."""
        store = self._store()
        if store is None:
            return None
        try:
            keys, payloads = self.keys(group), [memory[row] for row in rows]
            hashed = [digest for digest in checksums or () if digest is not None]
            if len(hashed) == len(keys) and isinstance(store, ChecksumsFromCopy):
                return store.put_batch_checksummed(keys, payloads, hashed)
            return store.put_batch(keys, payloads)
        except Exception as error:  # noqa: BLE001 (see the module docstring)
            logger.warning("umbp store failed: %s", error)
            return None
