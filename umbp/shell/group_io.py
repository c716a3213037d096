"""One lane's copies of one cache group at a time: the store's reads, scatters of
the rows core says loaded, gathers and puts.

A read either copies the objects into the lane's staging rows (every store), or,
when the store lends its objects in place (the embedded pool, `LendsObjects`) and
the KV is in host memory, borrows them: the scatter then copies straight from the
pool's pages, one copy instead of two, and the checksums are verified when the read
is settled, after the scatter. Either way :meth:`GroupRead.settle` gives the final
statuses, and a block they do not answer HIT is reported failed in the step that
read it (vLLM discards what that step computed for the request and recomputes it).

Each transfer lane (:mod:`umbp.shell.transfers`) owns one :class:`GroupIO`: copiers
of its own (a CUDA stream and bounce buffer each) and staging rows of its own, used
by that lane's thread only. A store answers failures as values; one that raises
breaks the contract (a binding's own error, unknown here), and umbp must never be
the reason a request fails: the group counts as unread (recomputed) or unwritten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from umbp.core.identity import KeySpace, RankCoord
from umbp.core.loads.outcomes import GroupLoadOutcome, LoadStatus
from umbp.core.plans import GroupBlocks
from umbp.gpu.copier import BlockCopier, ForwardMark
from umbp.gpu.handle import CopyHandle
from umbp.gpu.staging import StagingRows
from umbp.runtime.contract import LendsObjects, LentObjects, WorkerStore

logger = logging.getLogger("umbp")

__all__ = ["GroupIO", "GroupRead", "ScatterSource", "settle_reads"]


@dataclass(frozen=True, slots=True, eq=False)
class GroupRead:
    """One group's objects as read for a scatter. ``statuses``: per key, what is known
    before the copy (a lent object counts as HIT and one not lent as MISSING until
    settled, which says why; None: the group could not be read); ``rows``: staging rows (row i is key i) or the lender's memory,
    where key i is row ``lent_rows[i]``. :meth:`settle` is called once, after the
    scatter: the final statuses, and a loan's pins released."""

    statuses: tuple[LoadStatus, ...] | None
    rows: torch.Tensor | None
    lent_rows: tuple[int | None, ...] | None = None
    settle_loan: Callable[[], tuple[LoadStatus, ...]] | None = None

    def settle(self) -> tuple[LoadStatus, ...] | None:
        return self.statuses if self.settle_loan is None else self.settle_loan()


ScatterSource = tuple[torch.Tensor, tuple[int, ...] | None]
"""Rows to scatter from and, for lent memory, the row of each block."""


def settle_reads(
    reads: Sequence[GroupRead], scattered: bool
) -> list[tuple[LoadStatus, ...] | None]:
    """Every read's final statuses, in order. Each is settled even when the scatter
    raised (a loan's pins go); then none counts: every block of the reads failed."""
    statuses = [read.settle() for read in reads]
    return statuses if scattered else [None] * len(reads)


def _unread() -> GroupRead:
    return GroupRead(None, None)


class GroupIO:
    """The copiers and staging rows of one lane, and the store they move bytes to."""

    def __init__(
        self,
        copiers: Mapping[int, BlockCopier],
        store: Callable[[], WorkerStore | None],
        keyspace: KeySpace,
        rank: RankCoord,
        on_staging: tuple[Callable[[torch.Tensor], None], Callable[[torch.Tensor], None]],
    ) -> None:
        self._copiers = dict(copiers)
        self._store = store
        self._keyspace = keyspace
        self._rank = rank
        self._staging = StagingRows(*on_staging)

    def copier(self, group_id: int) -> BlockCopier | None:
        return self._copiers.get(group_id)

    def drop_copiers(self) -> None:
        """Sleep mode: the KV memory is about to go; nothing may copy into it."""
        self._copiers = {}

    def use_copiers(self, copiers: Mapping[int, BlockCopier]) -> None:
        self._copiers = dict(copiers)

    def release(self) -> None:
        self._staging.release()

    def read(self, group: GroupBlocks) -> GroupRead:
        """The group's objects, borrowed where the store lends them to host KV, else
        copied into staging rows; unread (statuses None) when there is no store, or no
        KV memory while asleep, or the store raised."""
        copier, store = self._copiers.get(group.group_id), self._store()
        if copier is None or store is None:
            return _unread()
        try:
            if isinstance(store, LendsObjects) and copier.device.type == "cpu":
                loan = store.lend(self._keys(group), copier.object_bytes)
                if loan is not None:
                    return _borrowed(loan)
            rows = self._staging.rows(
                group.group_id, len(group), copier.object_bytes, copier.device
            )
            payload = rows.numpy()
            statuses = store.get_batch_into(
                self._keys(group), [payload[i] for i in range(len(group))]
            )
        except Exception as error:  # noqa: BLE001 (see the module docstring)
            logger.warning("umbp load failed: %s", error)
            return _unread()
        return GroupRead(statuses, rows)

    def source(self, group: GroupLoadOutcome, read: GroupRead) -> ScatterSource | None:
        """What to scatter the rows core says loaded from, in block order (None:
        nothing to scatter)."""
        if group.problem is not None:
            logger.error("umbp load: %s", group.problem)
        rows = read.rows
        if not group.loaded_rows or rows is None:
            return None
        if read.lent_rows is not None:
            lent = read.lent_rows
            return rows, tuple(row for row in (lent[i] for i in group.loaded_rows)
                               if row is not None)
        if group.all_loaded:
            return rows, None
        return rows.index_select(0, torch.tensor(group.loaded_rows, dtype=torch.long)), None

    def scatter(self, group: GroupLoadOutcome, source: ScatterSource) -> CopyHandle:
        rows, lent_rows = source
        return self._copiers[group.group_id].scatter_async(
            group.loaded_block_ids, rows, src_rows=lent_rows
        )

    def scatter_layer(
        self, group: GroupLoadOutcome, layer: int, source: ScatterSource
    ) -> CopyHandle:
        rows, lent_rows = source
        return self._copiers[group.group_id].scatter_layer_async(
            layer, group.loaded_block_ids, rows, src_rows=lent_rows
        )

    def write(self, group: GroupBlocks, after: ForwardMark) -> tuple[bool, ...] | None:
        """Gather the group's blocks (ordered after ``after``) and put them; None when
        the group cannot be written (no store, or no KV memory while asleep)."""
        copier, store = self._copiers.get(group.group_id), self._store()
        if copier is None or store is None:
            return None
        rows = self._staging.rows(group.group_id, len(group), copier.object_bytes, copier.device)
        copier.gather_async(group.block_ids, rows, after).wait()
        payload = rows.numpy()
        try:
            return store.put_batch(self._keys(group), [payload[i] for i in range(len(group))])
        except Exception as error:  # noqa: BLE001 (see the module docstring)
            logger.warning("umbp store failed: %s", error)
            return None

    def _keys(self, group: GroupBlocks) -> list[str]:
        keyspace, rank, group_id = self._keyspace, self._rank, group.group_id
        return [keyspace.key(rank, group_id, block_hash) for block_hash in group.block_hashes]


def _borrowed(loan: LentObjects) -> GroupRead:
    statuses = tuple(
        LoadStatus.HIT if row is not None else LoadStatus.MISSING for row in loan.rows
    )
    return GroupRead(statuses, torch.from_numpy(loan.memory), loan.rows, loan.settle)
