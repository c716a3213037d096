"""One lane's copies of one cache group at a time: the store's reads into staging
rows, scatters of the rows core says loaded intact, gathers and puts.

Each transfer lane (:mod:`umbp.shell.transfers`) owns one :class:`GroupIO`: copiers
of its own (a CUDA stream and bounce buffer each) and staging rows of its own, used
by that lane's thread only. A store answers failures as values; one that raises
breaks the contract (a binding's own error, unknown here), and umbp must never be
the reason a request fails: the group counts as unread (recomputed) or unwritten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from umbp.core.identity import KeySpace, RankCoord
from umbp.core.loads.outcomes import GroupLoadOutcome, LoadStatus
from umbp.core.plans import GroupBlocks
from umbp.gpu.copier import BlockCopier, ForwardMark
from umbp.gpu.handle import CopyHandle
from umbp.gpu.staging import StagingRows
from umbp.runtime.contract import WorkerStore

logger = logging.getLogger("umbp")

__all__ = ["GroupIO"]


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

    def read(self, group: GroupBlocks) -> tuple[tuple[LoadStatus, ...] | None, torch.Tensor | None]:
        """The statuses of reading the group's objects into staging rows, and the rows;
        (None, None) when the group cannot be read (no store, or no KV memory while
        asleep)."""
        copier, store = self._copiers.get(group.group_id), self._store()
        if copier is None or store is None:
            return None, None
        rows = self._staging.rows(group.group_id, len(group), copier.object_bytes, copier.device)
        payload = rows.numpy()
        try:
            statuses = store.get_batch_into(
                self._keys(group), [payload[i] for i in range(len(group))]
            )
        except Exception as error:  # noqa: BLE001 (see the module docstring)
            logger.warning("umbp load failed: %s", error)
            return None, None
        return statuses, rows

    def loaded_rows(self, group: GroupLoadOutcome, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The staging rows core says loaded intact, in block order (None: nothing to
        scatter)."""
        if group.problem is not None:
            logger.error("umbp load: %s", group.problem)
        if not group.loaded_rows or rows is None:
            return None
        if group.all_loaded:
            return rows
        return rows.index_select(0, torch.tensor(group.loaded_rows, dtype=torch.long))

    def scatter(self, group: GroupLoadOutcome, rows: torch.Tensor) -> CopyHandle:
        return self._copiers[group.group_id].scatter_async(group.loaded_block_ids, rows)

    def scatter_layer(self, group: GroupLoadOutcome, layer: int, rows: torch.Tensor) -> CopyHandle:
        return self._copiers[group.group_id].scatter_layer_async(
            layer, group.loaded_block_ids, rows
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
