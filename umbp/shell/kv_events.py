"""KV cache events for routers: BlockStored when an object became resident in
the pool on every rank, BlockRemoved when a published object left it.

umbp.core.kv_events decides; this module only draws residency batches, asks the
pool off the scheduler thread, and turns core's event values into vLLM's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

from umbp.core import kv_events as core_events
from umbp.core.identity import KeySpace
from umbp.core.rank_keys import KeyLayout, object_major_keys
from umbp.core.stores.acks import StoreEvent, StoreEventResult
from umbp.runtime.contract import Medium, SchedulerStore, TierAware
from umbp.shell.vllm_compat.versions import block_stored_takes_lookahead

CHECK_BATCH = 256
RECHECK_PUBLISHED_EVERY_S = 1.0
POOL_MEDIUM = Medium.CPU

# Per key: resident or not (`lookup`), or the medium holding it (`TierAware.where`).
_Answer = tuple[bool, ...] | tuple[Medium | None, ...]


class KVEventPublisher:
    def __init__(self, max_objects: int, executor: Executor,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._state = core_events.new_event_tracker(max_objects)
        self._executor = executor
        self._clock = clock
        self._next_recheck = 0.0
        # The batch, its answer to come, the keys' layout, the tracker's ticket at drawing.
        self._inflight: tuple[tuple[core_events.ResidencyCandidate, ...],
                              Future[_Answer], KeyLayout, int] | None = None

    @property
    def suppressed(self) -> int:
        return self._state.suppressed

    def track(self, event: StoreEvent, result: StoreEventResult) -> None:
        """Every worker stored ``event``: its objects become candidates for BlockStored."""
        objects = [obj for plan in event.plans
                   for obj in core_events.stored_objects(plan, POOL_MEDIUM)]
        self._state = core_events.track_stored(self._state, objects, result.failed)

    def take(self, store: SchedulerStore | None, keyspace: KeySpace | None,
             engine_busy: bool) -> list[Any]:
        """Events decided since the last call; starts the next residency check.

        Published objects are checked at most once a second while the engine is
        busy (each check competes with its steps); once it is idle, the sweep a
        store made due runs check after check, so the engine can go quiet soon."""
        decided: list[Any] = []
        if self._inflight is not None and self._inflight[1].done():
            batch, answer, layout, drawn_at = self._inflight
            self._inflight = None
            resident, media = _fold(answer, layout)
            self._state, events = core_events.apply_residency(
                self._state, batch, resident, media, drawn_at
            )
            decided = [_to_vllm(event) for event in events]
        if self._inflight is None and store is not None and keyspace is not None:
            self._start_check(store, keyspace, engine_busy)
        return decided

    def has_pending(self) -> bool:
        """Whether checks remain: the engine must keep stepping to run them."""
        return self._inflight is not None or core_events.has_pending(self._state) or (
            core_events.sweep_due(self._state)
        )

    def clear(self) -> None:
        if self._inflight is not None:
            self._inflight[1].cancel()
            self._inflight = None
        self._state = core_events.clear(self._state)

    def _start_check(self, store: SchedulerStore, keyspace: KeySpace, engine_busy: bool) -> None:
        now = self._clock()
        recheck = now >= self._next_recheck or (
            not engine_busy and core_events.sweep_due(self._state)
        )
        if recheck:
            self._next_recheck = now + RECHECK_PUBLISHED_EVERY_S
        batch = core_events.residency_batch(self._state, CHECK_BATCH, recheck)
        if not batch:
            return
        keys = object_major_keys(keyspace, (identity for identity, _ in batch))
        ask: Callable[[Sequence[str]], _Answer] = (
            store.where if isinstance(store, TierAware) else store.lookup
        )
        self._inflight = (batch, self._executor.submit(ask, keys), keys.layout,
                          self._state.next_ticket)


def _fold(
    answer: Future[_Answer], layout: KeyLayout
) -> tuple[list[bool] | None, list[str] | None]:
    """The check's answer folded by core (:func:`umbp.core.kv_events.fold_residency`);
    (None, None) when the check failed or its answer does not fit."""
    try:
        per_key = answer.result()
    except Exception:  # noqa: BLE001 - a failed check publishes nothing this time
        return None, None
    folded = core_events.fold_residency(
        layout, per_key, disk_medium=Medium.DISK, memory_medium=Medium.CPU
    )
    return (None, None) if folded is None else folded


def _to_vllm(event: core_events.KvEvent) -> Any:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]
    if isinstance(event, core_events.BlockRemovedEvent):
        return BlockRemoved(block_hashes=hashes, medium=event.medium, group_idx=event.group_id,
                            locality="LOCAL")
    parent = event.parent_block_hash
    fields: dict[str, Any] = {
        "block_hashes": hashes,
        "parent_block_hash": None if parent is None else maybe_convert_block_hash(parent),
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
        "lora_id": None,
        "medium": event.medium,
        "lora_name": None,
        "group_idx": event.group_id,
        "locality": "LOCAL",
    }
    if block_stored_takes_lookahead(BlockStored):
        fields["lookahead_token_ids"] = []  # vLLM 0.33: a stored block has no lookahead
    return BlockStored(**fields)
