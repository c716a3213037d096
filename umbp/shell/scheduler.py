"""The scheduler role: what to look up, load and store, for every request.

One :class:`~umbp.shell.request_state.RequestState` per request; every hook is
"read vLLM's objects (through :mod:`umbp.shell.vllm_compat`) -> ask core
(:mod:`umbp.core.lookup`, :mod:`umbp.core.requests`, :mod:`umbp.core.stores`, :mod:`umbp.core.loads`) -> apply": store
the new state, count, log, pin or unpin. Admission (lookups, hit windows, load
plans) is :mod:`umbp.shell.admission`, a step's stores :mod:`umbp.shell.store_step`.
Beside the per-request states the role keeps only what spans requests: the pinned
stores (:mod:`umbp.shell.pinned_stores`: the store events in flight, the finished
requests' tails waiting for the next step), the requests with a planned load not
yet sent, the last step's synchronous loads, and the bound store and block pool.
A step visits only the requests it concerns: those vLLM scheduled that may store,
finished or preempted ones, and those with a load to send.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from returns.result import Failure, Success

from umbp.core.config import ConnectorConfig
from umbp.core.geometry import BlockTable, block_table_of
from umbp.core.identity import KeySpace, bound_keyspace
from umbp.core.loads.failures import (
    NO_SYNC_LOADS,
    after_failed_load,
    hit_by_failed_load,
    loads_in_reach,
    stores_over_sync_loads,
    sync_loads_of,
)
from umbp.core.plans import StorePlan
from umbp.core.rank_keys import rank_tags
from umbp.core.request_params import announcement
from umbp.core.requests import (
    RequestLifecycle,
    after_cache_reset,
    after_preemption,
    cache_reset_allowed,
    registers_finished_tail,
    take_step_loads,
)
from umbp.core.stores.handoffs import finished_partial_tail_plans, transfer_store_plan
from umbp.core.stores.tracking import (
    announces_under_role,
    eagle_store_groups,
    stored_prompt_tokens,
    stores_under_role,
)
from umbp.runtime.backends import open_scheduler_store
from umbp.runtime.contract import PrefetchesOnLookup, SchedulerStore
from umbp.shell import vllm_compat
from umbp.shell.admission import Admission
from umbp.shell.hybrid_lookup import HybridLookup
from umbp.shell.kv_events import KVEventPublisher
from umbp.shell.metadata import UMBPConnectorMetadata, UMBPHandshake, UMBPWorkerMetadata
from umbp.shell.pinned_stores import PinnedStores
from umbp.shell.request_state import UNKNOWN, RequestState
from umbp.shell.retention import RequestRetention
from umbp.shell.store_step import StoreStep
from umbp.shell.vllm_compat.objects import (
    BlockPoolLike,
    ConnectorOutputLike,
    KVCacheBlocksLike,
    RequestLike,
    SchedulerOutputLike,
)

logger = logging.getLogger("umbp")


@dataclass(slots=True)
class SchedulerCounters:
    lookups: int = 0
    lookup_failures: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    planned_load_blocks: int = 0
    planned_store_blocks: int = 0
    # Distinct objects not stored because every rank already held them, and the
    # batched residency lookups (one per step at most) that found them.
    store_skipped_resident_blocks: int = 0
    residency_lookups: int = 0
    kv_events_suppressed: int = 0
    kv_events_published: int = 0
    # Requests that waited for blocks their prefill engine announced, the seconds
    # they waited in all, and those that went on short of them.
    announced_waits: int = 0
    announced_wait_seconds: float = 0.0
    announced_short: int = 0
    # Requests whose synchronous load waited for hits the server brought in from its SSD
    # tier (prefetched at lookup), and the seconds they waited in all.
    prefetch_waits: int = 0
    prefetch_wait_seconds: float = 0.0


class UMBPScheduler:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, *,
        active: bool = True,
    ) -> None:
        # Inactive (vLLM switched prefix caching off for the model): no worker has a
        # pool, so nothing is looked up, and nothing is stored.
        self._active = active
        self._config = config
        geometry = vllm_compat.lookup_geometry(
            vllm_config, kv_cache_config, config.enable_partial_hash_hits
        )
        hybrid = (
            HybridLookup(vllm_config, kv_cache_config, geometry, config.enable_partial_hash_hits)
            if geometry.coordinated else None
        )
        self._geometry = geometry if hybrid is None else hybrid.geometry
        # The drafter recomputes the last block of its groups: their masks drop it.
        self._eagle_store_groups = eagle_store_groups(
            vllm_compat.eagle_group_ids(kv_cache_config),
            self._geometry.group_ids, self._geometry.use_eagle,
        )
        self._full_attention_groups = vllm_compat.full_attention_group_ids(
            kv_cache_config, self._geometry.group_ids
        )
        self._store_enabled = stores_under_role(active, vllm_compat.kv_role(vllm_config))
        self._announces = announces_under_role(active, vllm_compat.kv_role(vllm_config))
        self._num_workers = vllm_compat.world_size(vllm_config)
        self._topology = vllm_compat.topology_of(vllm_config)
        self._lookup_executor = ThreadPoolExecutor(
            max_workers=config.lookup_workers, thread_name_prefix="umbp-lookup"
        )
        self._store: SchedulerStore | None = None
        self._keyspace: KeySpace | None = None
        self._gpu_block_pool: BlockPoolLike | None = None
        self._requests: dict[str, RequestState] = {}
        # Finished requests that asked to retain their blocks, waiting for their last
        # stores to land: (their block hashes, the seconds asked).
        self._retain_after_stores: dict[str, tuple[tuple[bytes, ...], float]] = {}
        # Requests whose allocation planned a load (or blocks to recompute) that the
        # next step's metadata carries, in allocation order.
        self._loads_to_send: dict[str, None] = {}
        self._pinned = PinnedStores()
        # Requests whose failed load was acted on since the last step's metadata.
        self._resolved_load_failures: set[str] = set()
        # The last step's synchronous loads (its failures may not be known yet).
        self._previous_sync_loads = NO_SYNC_LOADS
        self._events_enabled = vllm_compat.kv_events_enabled(vllm_config)
        self._kv_events = (
            KVEventPublisher(config.kv_event_max_objects, self._lookup_executor)
            if self._events_enabled else None
        )
        self.counters = SchedulerCounters()
        self.retention = RequestRetention(self._geometry, self._lookup_executor)
        self._admission = Admission(
            config, kv_cache_config, self._geometry, hybrid, self._lookup_executor, self.counters
        )
        self._store_step = StoreStep(
            kv_cache_config, self._geometry, save_decode_cache=config.save_decode_cache,
            events_enabled=self._events_enabled, eagle_store_groups=self._eagle_store_groups,
            dcp_size=self._topology.dcp_size, counters=self.counters,
        )

    # -- start-up -----------------------------------------------------------

    def bind_gpu_block_pool(self, pool: BlockPoolLike) -> None:
        self._gpu_block_pool = pool
        self._pinned.bind_pool(pool)
        self._admission.bind_gpu_block_pool(pool)

    def bind_workers(self, handshakes: Mapping[int, UMBPHandshake]) -> None:
        """Workers report their namespace and pool; lookups start only then."""
        if not self._active:
            return
        by_rank = {meta.rank: meta for meta in handshakes.values()}
        bound = bound_keyspace(
            self._topology, {rank: meta.namespace for rank, meta in by_rank.items()},
            {rank: meta.replicated for rank, meta in by_rank.items()},
        )
        if isinstance(bound, Failure):  # a start-up error: these workers cannot serve
            raise RuntimeError(bound.failure())  # noqa: TRY004 - a Result
        keyspace: KeySpace = bound.unwrap()
        self._admission.bind_load_mode(
            all(meta.restores_layer_by_layer for meta in by_rank.values())
        )
        for group_id, run in keyspace.replicated:
            logger.info("umbp stores cache group %d once per %d TP ranks (they hold its "
                        "bytes alike): the first of them writes it, all of them read it",
                        group_id, run)
        self._store = open_scheduler_store(self._config, {
            tag: address  # each rank's store named as core's keys name that rank
            for tag, rank in zip(rank_tags(keyspace), self._topology.coords(), strict=True)
            if (address := by_rank[rank].pool) is not None
        })
        self._keyspace = keyspace

    # -- lookup ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, local_tokens: int
    ) -> tuple[int | None, bool]:
        store, keyspace = self._store, self._keyspace
        if store is None or keyspace is None:  # no worker bound yet: nothing to ask
            return 0, False
        request_id = request.request_id
        tokens, load_async, self._requests[request_id] = self._admission.matched_tokens(
            store, keyspace, request, local_tokens, self._requests.get(request_id, UNKNOWN)
        )
        return tokens, load_async

    # -- allocation and per-step metadata ----------------------------------------

    def update_state_after_alloc(
        self, request: RequestLike, blocks: KVCacheBlocksLike, num_external_tokens: int
    ) -> None:
        request_id = request.request_id
        state = self._admission.allocated(
            request, blocks, num_external_tokens, self._requests.get(request_id, UNKNOWN)
        )
        self._requests[request_id] = state
        if state.life.load is not None or state.life.unplanned_load is not None:
            self._loads_to_send[request_id] = None

    def build_connector_meta(self, scheduler_output: SchedulerOutputLike) -> UMBPConnectorMetadata:
        meta = UMBPConnectorMetadata()
        # In-flight events' objects and this step's plans: stored once.
        reserved = self._pinned.reserved()
        for request_id in scheduler_output.finished_req_ids:
            self._forget(request_id)
        preempted = frozenset(scheduler_output.preempted_req_ids or ())
        # A consumer stores nothing (core.stores.tracking.stores_under_role).
        stores = self._store_step.plan(
            scheduler_output, self._requests, reserved, preempted, self._store, self._keyspace
        ) if self._store_enabled else ()
        loads = take_step_loads({
            r: self._requests[r].life for r in self._loads_to_send if r in self._requests
        })
        self._loads_to_send.clear()
        self._apply(loads.states)
        meta.loads = list(loads.loads)
        meta.unplanned_loads = dict(loads.unplanned)
        meta.async_loads = loads.async_loads
        sync_loads = sync_loads_of(loads)
        in_reach = loads_in_reach(self._previous_sync_loads, sync_loads)
        if stores and in_reach is not None:
            meta.stores_over_loads = stores_over_sync_loads(in_reach, self._tables_of(stores))
        self._previous_sync_loads = sync_loads
        self._apply({r: after_preemption(self._requests[r].life)
                     for r in preempted if r in self._requests})
        meta.preempted_request_ids = preempted
        meta.idle_step = not scheduler_output.num_scheduled_tokens
        # The worker stores for these again (core.loads.failures.still_computing_over_failures).
        meta.resolved_load_failures = frozenset(self._resolved_load_failures).union(
            scheduler_output.finished_req_ids, preempted
        )
        self._resolved_load_failures.clear()
        # The finished requests' tails join the step's stores in its one event.
        meta.stores, meta.store_event = self._pinned.open_event(stores)
        return meta

    def _tables_of(self, stores: tuple[StorePlan, ...]) -> dict[str, BlockTable]:
        """The block tables the storing requests read from this step."""
        tables: dict[str, BlockTable] = {}
        for plan in stores:
            tracker = self._requests.get(plan.request_id, UNKNOWN).life.tracker
            if tracker is not None:
                tables[plan.request_id] = tracker.block_table
        return tables

    def _apply(self, lives: Mapping[str, RequestLifecycle]) -> None:
        for request_id, life in lives.items():
            self._requests[request_id] = self._requests[request_id].with_life(life)

    # -- the workers' reports ---------------------------------------------------------

    def update_connector_output(self, output: ConnectorOutputLike) -> None:
        if output.invalid_block_ids or output.failed_recving:
            self._after_failed_loads(output.invalid_block_ids, output.failed_recving)
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, UMBPWorkerMetadata):  # another connector's, or none
            return
        acknowledged = self._pinned.acknowledge(meta.store_results, self._num_workers)
        if self._kv_events is not None:
            for event, result in acknowledged:
                self._kv_events.track(event, result)
        if not (acknowledged and self._retain_after_stores):
            return  # a request's stores end only when an event is acknowledged
        for request_id, (hashes, seconds) in list(self._retain_after_stores.items()):
            if not self._pinned.stores_for(request_id, hashes):
                del self._retain_after_stores[request_id]
                self.retention.ask(request_id, hashes, seconds, self._store, self._keyspace)

    def _after_failed_loads(self, failed_blocks: set[int], failed_requests: set[str]) -> None:
        """vLLM has cut the failed requests' computed tokens by now; their
        watermarks follow, so what vLLM recomputes is stored again."""
        hash_block_size = self._geometry.hash_block_size
        rewound: set[str] = set()
        for request_id, state in list(self._requests.items()):
            request, failed = state.request, request_id in failed_requests
            if request is None or not hit_by_failed_load(state.life, failed_blocks, failed):
                continue
            self._requests[request_id] = state.with_life(after_failed_load(
                state.life, failed_blocks, failed, request.num_computed_tokens, hash_block_size,
            ))
            rewound.add(request_id)
        self._resolved_load_failures |= rewound
        self._store_step.may_store_again(rewound)
        self._pinned.unreserve(rewound)

    # -- request lifecycle --------------------------------------------------------

    def register_finished_partial_tail(
        self, request: RequestLike, block_ids: tuple[list[int], ...],
        offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Pin a finished request's last boundary pages for next step's store.
        Returns False: vLLM may clean the request up now, the pins keep the pages."""
        pool, request_id = self._gpu_block_pool, request.request_id
        if not registers_finished_tail(
            self._store_enabled, pool is not None, bool(offloads),
            self._pinned.has_tail(request_id),
            self._requests.get(request_id, UNKNOWN).life.tracker is not None,
        ):
            return False
        assert pool is not None  # registers_finished_tail requires a bound pool
        geometry = self._geometry
        plans = finished_partial_tail_plans(
            request_id, geometry, offloads, block_table_of(block_ids, geometry.group_ids),
            tuple(request.block_hashes), request.num_computed_tokens,
            request.num_in_flight_tokens, self._full_attention_groups,
            len(pool.blocks), frozenset({pool.null_block.block_id}), self._events_enabled,
        )
        match plans:
            case Success(tail):
                self._pinned.hold_finished_tail(
                    request_id, transfer_store_plan(request_id, tail, self._events_enabled)
                )
            case Failure(reason):
                logger.debug("umbp partial tail of request %s not stored: %s", request_id, reason)
        return False

    def request_finished(self, request: RequestLike) -> tuple[bool, dict[str, Any] | None]:
        """Never delays vLLM's freeing (the pins keep a store's blocks). A prefill
        engine (``kv_producer``) announces the prompt tokens whose blocks it stores,
        for the decode engine's lookup to wait for (vLLM puts them in the response's
        ``kv_transfer_params``)."""
        self._forget_prefetch(request.request_id)
        self._forget(request.request_id)
        seconds = self.retention.wanted(request)
        if seconds is not None:
            hashes = tuple(request.block_hashes)
            if self._pinned.stores_for(request.request_id, hashes):
                self._retain_after_stores[request.request_id] = (hashes, seconds)
            else:
                self.retention.ask(request.request_id, hashes, seconds, self._store,
                                   self._keyspace)
        if not self._announces:
            return False, None
        return False, announcement(stored_prompt_tokens(
            self._geometry, request.num_prompt_tokens, len(request.block_hashes)
        ))

    def take_events(self) -> list[Any]:
        if self._kv_events is None:
            return []
        events = self._kv_events.take(self._store, self._keyspace, engine_busy=bool(self._requests))
        self.counters.kv_events_suppressed = self._kv_events.suppressed
        self.counters.kv_events_published += len(events)
        return events

    def has_pending_push_work(self) -> bool:
        return self._pinned.events_in_flight or self._pinned.tails_waiting or (
            self._kv_events is not None and self._kv_events.has_pending()
        )

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: empty the pool too."""
        if not cache_reset_allowed(self._pinned.events_in_flight,
                                             self._pinned.tails_waiting):
            return False
        for request_id, state in list(self._requests.items()):
            self._requests[request_id] = state.without_lookup().with_life(
                after_cache_reset(state.life)
            )
        cleared = True if self._store is None else self._store.clear()
        if cleared and self._kv_events is not None:
            self._kv_events.clear()
        return cleared

    def close(self) -> None:
        self._lookup_executor.shutdown(wait=False, cancel_futures=True)
        for request_id, state in list(self._requests.items()):
            self._requests[request_id] = state.without_lookup()
        if self._store is not None:
            self._store.close()
            self._store = None

    def _forget_prefetch(self, request_id: str) -> None:
        """A request that started prefetches and went away (finished, aborted): the
        store drops those not begun."""
        store = self._store
        if self._requests.get(request_id, UNKNOWN).prefetching and isinstance(
            store, PrefetchesOnLookup
        ):
            store.forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, UNKNOWN).without_lookup()
        self._loads_to_send.pop(request_id, None)
        self._store_step.forget(request_id)
