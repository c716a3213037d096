"""The scheduler role: decides what to look up, load and store, by calling
umbp.core for every decision, and keeps the mutable per-request state.

Each public method is a short "read vLLM state -> ask core -> apply" sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from returns.result import Failure, Success

from umbp.core import lookup as core_lookup
from umbp.core import plans as core_plans
from umbp.core import store_pass as core_store_pass
from umbp.core.config import ConnectorConfig, effective_load_async
from umbp.core.identity import KeySpace
from umbp.core.lookup import LookupGeometry, LookupQuery, LoadSpec
from umbp.runtime.contract import SchedulerStore, StoreUnavailable
from umbp.runtime.backends import open_scheduler_store
from umbp.runtime.lookup_service import rank_tag
from umbp.shell import vllm_compat
from umbp.shell.vllm_compat import RequestLike
from umbp.core.plans import BlockLoadBatch, StoreBatch
from umbp.core.store_pass import ResidencyCheck, StoreCandidates
from umbp.core.store_events import (
    StoreEvent,
    StoreEventResult,
    event_acknowledged,
    merge_store_results,
    pinned_block_ids,
    reserved_identities,
)
from umbp.shell.hybrid_lookup import HybridLookup
from umbp.shell.kv_events import KVEventPublisher
from umbp.shell.metadata import UMBPConnectorMetadata, UMBPHandshake, UMBPWorkerMetadata

logger = logging.getLogger("umbp")


@dataclass(slots=True)
class _PendingLookup:
    """A lookup running off the scheduler thread, for the request it was built for."""

    request: object
    query: LookupQuery
    answer: Future[tuple[bool, ...]]


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


class UMBPScheduler:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, *,
        active: bool = True,
    ) -> None:
        # Inactive (vLLM switched prefix caching off for the model): no worker has a
        # pool, so nothing is looked up, and nothing is stored.
        self._active = active
        self._config = config
        self._kv_cache_config = kv_cache_config
        geometry = _geometry(vllm_config, kv_cache_config, config)
        # Several cache groups (or one that is not plain full attention): vLLM's own
        # coordinator decides the hit window from umbp's answers.
        self._hybrid = (
            HybridLookup(vllm_config, kv_cache_config, geometry, config.enable_partial_hash_hits)
            if geometry.coordinated else None
        )
        self._geometry = geometry if self._hybrid is None else self._hybrid.geometry
        groups = kv_cache_config.kv_cache_groups
        # The drafter recomputes the last block of its groups: their masks drop it.
        self._eagle_store_groups = core_plans.eagle_store_groups(
            frozenset(g for g, group in enumerate(groups)
                      if getattr(group, "is_eagle_group", False)),
            self._geometry.group_ids, self._geometry.use_eagle,
        )
        self._boundary_groups = frozenset(
            group_id for group_id, group in enumerate(groups)
            if vllm_compat.is_align_mamba(group.kv_cache_spec)
        )
        specs = [s for g in groups for s in vllm_compat.layer_specs(g.kv_cache_spec)]
        self._load_async, warning = effective_load_async(
            config.load_async,
            len(groups),
            any(vllm_compat.is_mamba(s) for s in specs),
            any(vllm_compat.is_sparse_indexer(s) for s in specs),
        )
        if warning is not None:
            logger.warning("umbp: %s", warning)
        transfer_config = vllm_config.kv_transfer_config
        self._store_enabled = core_plans.stores_under_role(
            active, getattr(transfer_config, "kv_role", None)
        )
        self._num_workers = int(getattr(vllm_config.parallel_config, "world_size", 1))
        self._topology = vllm_compat.topology_of(vllm_config)
        self._lookup_executor = ThreadPoolExecutor(
            max_workers=config.lookup_workers, thread_name_prefix="umbp-lookup"
        )
        self._store: SchedulerStore | None = None
        self._keyspace: KeySpace | None = None
        self._pending_lookups: dict[str, _PendingLookup] = {}
        self._load_specs: dict[str, LoadSpec] = {}
        self._async_loads: set[str] = set()
        self._pending_loads: dict[str, BlockLoadBatch] = {}
        self._unplanned_loads: dict[str, tuple[int, ...]] = {}
        self._requests: dict[str, Any] = {}
        self._trackers: dict[str, core_plans.StoreTracker] = {}
        self._store_events: dict[int, tuple[StoreEvent, StoreEventResult]] = {}
        self._events_enabled = vllm_compat.kv_events_enabled(vllm_config)
        self._kv_events = (
            KVEventPublisher(config.kv_event_max_objects, self._lookup_executor)
            if self._events_enabled else None
        )
        self._next_store_event = 0
        self._gpu_block_pool: Any = None
        # Finished requests' last boundary pages, pinned until the next step's event.
        self._pending_finished_stores: dict[str, StoreBatch] = {}
        self._full_attention_groups = frozenset(
            group_id for group_id in self._geometry.group_ids
            if vllm_compat.is_plain_full_attention(groups[group_id].kv_cache_spec)
        )
        self.counters = SchedulerCounters()

    # -- start-up -----------------------------------------------------------

    def bind_gpu_block_pool(self, pool: Any) -> None:
        self._gpu_block_pool = pool

    def bind_workers(self, handshakes: Mapping[int, UMBPHandshake]) -> None:
        """Workers report their namespace and pool; lookups start only then."""
        if not self._active:
            return
        by_rank = {meta.rank: meta for meta in handshakes.values()}
        namespaces = {meta.namespace for meta in by_rank.values()}
        if len(namespaces) != 1:
            raise RuntimeError(f"umbp workers disagree on the namespace: {sorted(namespaces)}")
        missing = [rank for rank in self._topology.coords() if rank not in by_rank]
        if missing:
            raise RuntimeError(f"umbp: no worker reported for ranks {missing}")
        keyspace = KeySpace(namespaces.pop(), self._topology)
        self._store = open_scheduler_store(self._config, {
            rank_tag(keyspace.key(rank, 0, b"")): address
            for rank in self._topology.coords()
            if (address := by_rank[rank].pool) is not None
        })
        self._keyspace = keyspace

    # -- lookup ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: RequestLike, local_tokens: int) -> tuple[int | None, bool]:
        request_id = request.request_id
        store, keyspace = self._store, self._keyspace
        if store is None or keyspace is None:
            return 0, False
        hashes = request.block_hashes
        pending = self._pending_lookups.get(request_id)
        if pending is not None and (
            pending.request is not request
            or not pending.query.describes(local_tokens, request.num_tokens, hashes)
        ):
            self._drop_pending_lookup(request_id)
            pending = None
        skip = core_lookup.lookup_skip_reason(
            self._geometry, self._config.enable_lookup, len(hashes), request.num_tokens,
            local_tokens,
        )
        if skip is not None:
            self._load_specs.pop(request_id, None)
            return 0, False
        if pending is not None and not pending.answer.done():
            return None, False
        if pending is None:
            query = core_lookup.build_lookup_query(
                self._geometry, keyspace, hashes, local_tokens, request.num_tokens
            )
            if self._config.lookup_async:
                answer = self._lookup_executor.submit(store.lookup, query.keys)
                self._pending_lookups[request_id] = _PendingLookup(request, query, answer)
                return None, False
            answers = self._lookup(store, query)
        else:
            del self._pending_lookups[request_id]
            query = pending.query
            answers = self._answer_of(pending.answer)
        return self._match(request_id, query, answers, request.num_tokens)

    def _lookup(self, store: SchedulerStore, query: LookupQuery) -> tuple[bool, ...] | None:
        try:
            return store.lookup(query.keys)
        except (StoreUnavailable, OSError) as error:
            self.counters.lookup_failures += 1
            logger.debug("umbp lookup failed: %s", error)
            return None

    def _answer_of(self, answer: Future[tuple[bool, ...]]) -> tuple[bool, ...] | None:
        try:
            return answer.result()
        except Exception as error:
            self.counters.lookup_failures += 1
            logger.debug("umbp lookup failed: %s", error)
            return None

    def _match(
        self, request_id: str, query: LookupQuery, answers: tuple[bool, ...] | None,
        num_tokens: int,
    ) -> tuple[int, bool]:
        self.counters.lookups += 1
        self.counters.queried_tokens += num_tokens - query.local_tokens
        folded = None if answers is None else core_lookup.fold_rank_hits(query, answers)
        if folded is None:
            return 0, False
        spec = self._hit_window(query, folded)
        if spec is None:
            return 0, False
        self._load_specs[request_id] = spec
        self.counters.hit_tokens += spec.num_tokens_to_load
        load_async = core_lookup.load_runs_async(self._load_async, spec, self._geometry)
        if load_async:
            self._async_loads.add(request_id)
        else:
            self._async_loads.discard(request_id)
        return spec.num_tokens_to_load, load_async

    def _hit_window(self, query: LookupQuery, folded: Any) -> LoadSpec | None:
        if self._hybrid is None:
            return core_lookup.single_group_load_spec(self._geometry, query, folded)
        try:
            return self._hybrid.window(query, folded, query.request_hashes, self._has_local_block)
        except Exception as error:  # vLLM's coordinator refusing must not fail the request
            self.counters.lookup_failures += 1
            logger.warning("umbp hybrid hit window failed, counted as a miss: %s", error)
            return None

    def _has_local_block(self, group_id: int, block_hash: bytes) -> bool:
        pool = self._gpu_block_pool
        return pool is not None and pool.get_cached_block(block_hash, [group_id]) is not None

    # -- allocation and per-step metadata ----------------------------------------

    def update_state_after_alloc(self, request: RequestLike, blocks: Any, num_external_tokens: int) -> None:
        request_id = request.request_id
        self._requests[request_id] = request
        block_table = _table(blocks.get_block_ids(group_ids=self._geometry.group_ids))
        if not block_table:
            return
        tracker = self._trackers.get(request_id, core_plans.StoreTracker())
        tracker = tracker.with_blocks_replaced(block_table)
        if num_external_tokens <= 0:
            self._trackers[request_id] = tracker
            self._pending_loads.pop(request_id, None)
            self._load_specs.pop(request_id, None)
            self._async_loads.discard(request_id)
            return
        self._trackers[request_id] = tracker
        # vLLM may allocate fewer external tokens than umbp matched: the load is
        # planned for what it allocated, and what cannot be loaded is recomputed.
        match core_plans.plan_allocated_load(
            request_id, self._geometry, self._load_specs.get(request_id), block_table,
            tuple(request.block_hashes), num_external_tokens,
        ):
            case Success(batch):
                self._pending_loads[request_id] = batch
                self.counters.planned_load_blocks += len(batch.block_ids)
            case Failure(unplanned):
                logger.warning("umbp load plan: %s; vLLM recomputes those tokens",
                               unplanned.reason)
                self._unplanned_loads[request_id] = unplanned.block_ids

    def build_connector_meta(self, scheduler_output: Any) -> UMBPConnectorMetadata:
        meta = UMBPConnectorMetadata()
        # In-flight events' objects and this step's plans: stored once.
        reserved = reserved_identities(event for event, _ in self._store_events.values())
        for request_id in scheduler_output.finished_req_ids:
            self._forget(request_id)
        stores = list(
            self._store_pass(self._step_candidates(scheduler_output), reserved)
            if self._store_enabled else ()
        )
        # Async loads are admitted without scheduled tokens: forward every plan.
        meta.loads = list(self._pending_loads.values())
        meta.unplanned_loads, self._unplanned_loads = self._unplanned_loads, {}
        loading = [batch.request_id for batch in meta.loads] + list(meta.unplanned_loads)
        meta.async_loads = frozenset(r for r in loading if r in self._async_loads)
        self._pending_loads.clear()
        for request_id in loading:
            self._load_specs.pop(request_id, None)
            self._async_loads.discard(request_id)
        preempted = frozenset(scheduler_output.preempted_req_ids or ())
        for request_id in preempted:
            self._load_specs.pop(request_id, None)
            if request_id in self._trackers:
                self._trackers[request_id] = self._trackers[request_id].reset()
        meta.preempted_request_ids = preempted
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None)
        if self._store_enabled and offloads:
            stores.extend(self._boundary_stores(
                offloads, set(scheduler_output.finished_req_ids), set(preempted)
            ))
        finished, self._pending_finished_stores = self._pending_finished_stores, {}
        stores.extend(finished.values())
        if stores:
            meta.stores = stores
            meta.store_event = self._open_store_event(stores)
        if finished and self._gpu_block_pool is not None:
            # The event pins them now; release the pins taken at request finish.
            pool = self._gpu_block_pool
            for batch in finished.values():  # the ids pinned at finish, once each
                pool.free_blocks(pool.blocks[b] for b in reversed(pinned_block_ids(batch)))
        return meta

    def _boundary_stores(
        self, offloads: Mapping[str, Any], finished: set[str], preempted: set[str]
    ) -> tuple[StoreBatch, ...]:
        """Mamba "align" groups: store only the boundary states vLLM handed off."""
        tracked = {
            request_id: tuple(request.block_hashes)
            for request_id in offloads
            if request_id in self._trackers
            and (request := self._requests.get(request_id)) is not None
        }
        geometry = self._geometry
        plans, dropped = core_plans.boundary_state_plans(
            offloads, finished, preempted, tracked, frozenset(geometry.group_ids),
            geometry.hash_block_size, dict(zip(geometry.group_ids, geometry.group_block_sizes)),
            self._events_enabled,
        )
        for drop in dropped:
            logger.debug("umbp boundary offloads dropped request=%s entries=%d: %s",
                         drop.request_id, drop.entries, drop.reason.value)
        return core_plans.transfer_batches(plans)

    def _step_candidates(self, scheduler_output: Any) -> list[StoreCandidates]:
        candidates: list[StoreCandidates] = []
        for new in scheduler_output.scheduled_new_reqs:
            candidate = self._new_request_candidates(new, scheduler_output)
            if candidate is not None:
                candidates.append(candidate)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()))
        for index, request_id in enumerate(cached.req_ids):
            candidate = self._cached_request_candidates(
                request_id, index, cached, request_id in resumed, scheduler_output
            )
            if candidate is not None:
                candidates.append(candidate)
        return candidates

    def _new_request_candidates(self, new: Any, scheduler_output: Any) -> StoreCandidates | None:
        # A request loading synchronously this step is planned too: the load lands
        # before the forward pass, the store reads after it. Its computed tokens
        # (vLLM's prefix-cache hits and umbp's window) are checked for residency.
        request_id = new.req_id
        request = self._requests.get(request_id)
        if request is None:
            return None
        tracker = self._trackers.get(request_id, core_plans.StoreTracker())
        self._trackers[request_id] = tracker.with_cached_tokens(new.num_computed_tokens)
        total = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[request_id]
        table = _table(tuple(new.block_ids[g] for g in self._geometry.group_ids))
        return self._store_candidates(request, table, total)

    def _cached_request_candidates(
        self, request_id: str, index: int, cached: Any, resumed: bool, scheduler_output: Any,
    ) -> StoreCandidates | None:
        request = self._requests.get(request_id)
        tracker = self._trackers.get(request_id)
        if request is None or tracker is None:
            return None
        computed = cached.num_computed_tokens[index]
        if resumed:  # started over: what it has again came from a cache
            tracker = tracker.with_cached_tokens(computed)
            self._trackers[request_id] = tracker
        if not core_plans.stores_this_step(
            computed, request.num_prompt_tokens, self._config.save_decode_cache
        ):
            return None
        group_ids = self._geometry.group_ids
        new_blocks = cached.new_block_ids[index]
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        current = None if block_state is None else block_state.get_block_ids(request_id)
        tracker = tracker.with_step_blocks(
            None if not new_blocks else _table(tuple(new_blocks[g] for g in group_ids)),
            resumed,
            None if current is None else _table(tuple(current[g] for g in group_ids)),
        )
        self._trackers[request_id] = tracker
        total = core_plans.store_token_limit(
            computed + scheduler_output.num_scheduled_tokens[request_id],
            request.num_prompt_tokens,
            self._config.save_decode_cache,
        )
        return self._store_candidates(request, tracker.block_table, total)

    def _store_candidates(
        self, request: RequestLike, table: tuple[tuple[int, ...], ...], total_tokens: int,
    ) -> StoreCandidates | None:
        request_id = request.request_id
        tracker = self._trackers.get(request_id, core_plans.StoreTracker())
        hashes = tuple(request.block_hashes)
        geometry = self._geometry
        storable = core_plans.storable_tokens(total_tokens, len(hashes), geometry.hash_block_size)
        save_to = core_plans.save_watermark(tracker.saved_tokens, storable, geometry.hash_block_size)
        ranges = core_plans.store_candidate_ranges(
            geometry, tracker.saved_tokens, save_to, table, self._boundary_groups
        )
        self._trackers[request_id] = tracker.with_saved_tokens(save_to)
        masks = {group_id: self._store_mask(request, group_id, r) for group_id, r in ranges}
        match core_plans.apply_store_masks(ranges, masks):
            case Success(block_ranges):
                pass
            case Failure(reason):
                logger.warning("umbp store mask for request %s: %s", request_id, reason)
                return None
        return StoreCandidates(
            request_id, block_ranges, table, hashes, tracker.cached_tokens,
            request.all_token_ids if self._events_enabled else (),
        )

    def _store_pass(
        self, candidates: list[StoreCandidates], reserved: AbstractSet[tuple[int, bytes]]
    ) -> tuple[StoreBatch, ...]:
        """Every request's candidates at once: one residency lookup for the blocks
        that came from a cache, then the batches without what the pool holds."""
        if not candidates:
            return ()
        keyspace = self._keyspace
        check = (
            ResidencyCheck((), (), 1) if keyspace is None
            else core_store_pass.residency_check(self._geometry, keyspace, candidates, reserved)
        )
        planned = core_store_pass.plan_stores(
            self._geometry, candidates, check, self._residency_answers(check), reserved,
            events_enabled=self._events_enabled,
        )
        self.counters.planned_store_blocks += sum(len(batch) for batch in planned.batches)
        self.counters.store_skipped_resident_blocks += planned.skipped_resident
        return planned.batches

    def _residency_answers(self, check: ResidencyCheck) -> tuple[bool, ...] | None:
        """None (nothing known resident, so everything is stored) when there is
        nothing to ask or the store cannot answer."""
        if not check.keys or self._store is None:
            return None
        self.counters.residency_lookups += 1
        try:
            return self._store.lookup(check.keys)
        except (StoreUnavailable, OSError) as error:
            self.counters.lookup_failures += 1
            logger.debug("umbp residency lookup failed: %s", error)
            return None

    def _store_mask(self, request: RequestLike, group_id: int, indices: range) -> tuple[bool, ...] | None:
        """vLLM's own rule for which blocks it can later reuse (sliding windows),
        with the boundaries vLLM's ``cache_blocks`` passes it."""
        if not indices:
            return ()
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

        spec = vllm_compat.unwrap_spec(self._kv_cache_config.kv_cache_groups[group_id].kv_cache_spec)
        manager = KVCacheSpecRegistry.get_manager_class(spec)
        if manager is None:
            return None
        mask = manager.reachable_block_mask(
            start_block=indices.start,
            end_block=indices.stop,
            alignment_tokens=self._geometry.block_size,
            kv_cache_spec=spec,
            use_eagle=group_id in self._eagle_store_groups,
            retention_interval=self._kv_cache_config.prefix_cache_retention_interval,
            # Without them a sparse-retention group (sliding window, retention
            # interval 0) keeps no block at all, so nothing it stores can hit.
            reachable_boundaries=vllm_compat.reachable_boundaries(
                request, self._geometry.block_size, self._geometry.use_eagle
            ),
            dcp_world_size=self._topology.dcp_size,
        )
        return None if mask is None else tuple(bool(m) for m in mask)

    def _open_store_event(self, stores: list[StoreBatch]) -> int:
        event_id = self._next_store_event
        self._next_store_event += 1
        event = StoreEvent(event_id, batches=tuple(stores))
        self._store_events[event_id] = (event, StoreEventResult())
        if self._gpu_block_pool is not None:
            # Pinned until every worker has copied them out.
            pool = self._gpu_block_pool
            pool.touch([pool.blocks[b] for b in pinned_block_ids(event)])
        return event_id

    # -- worker results ---------------------------------------------------------

    def update_connector_output(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(meta, UMBPWorkerMetadata):
            return
        for event_id, reported in meta.store_results.items():
            entry = self._store_events.get(event_id)
            if entry is None:
                continue
            event, result = entry[0], merge_store_results(entry[1], reported)
            if not event_acknowledged(result, self._num_workers):
                self._store_events[event_id] = (event, result)
                continue
            del self._store_events[event_id]
            if self._gpu_block_pool is not None:
                pool = self._gpu_block_pool
                pool.free_blocks(pool.blocks[b] for b in reversed(pinned_block_ids(event)))
            if self._kv_events is not None:
                self._kv_events.track(event, result)

    # -- request lifecycle --------------------------------------------------------

    def register_finished_partial_tail(
        self, request: RequestLike, block_ids: tuple[list[int], ...],
        offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Pin a finished request's last boundary pages for next step's store.
        Returns False: vLLM may clean the request up now, the pins keep the pages."""
        pool = self._gpu_block_pool
        request_id = request.request_id
        if (not self._store_enabled or pool is None or not offloads
                or request_id in self._pending_finished_stores
                or request_id not in self._trackers):
            return False
        geometry = self._geometry
        plans = core_plans.finished_partial_tail_plans(
            request_id, geometry, offloads, _table(block_ids[g] for g in geometry.group_ids),
            tuple(request.block_hashes), request.num_computed_tokens,
            int(getattr(request, "num_in_flight_tokens", 0)), self._full_attention_groups,
            len(pool.blocks), frozenset({pool.null_block.block_id}), self._events_enabled,
        )
        if isinstance(plans, Failure):
            logger.debug("umbp partial tail of request %s not stored: %s", request_id,
                         plans.failure())
            return False
        batch = core_plans.transfer_batch(request_id, plans.unwrap())
        pool.touch([pool.blocks[b] for b in pinned_block_ids(batch)])
        self._pending_finished_stores[request_id] = batch
        return False

    def request_finished(self, request: RequestLike) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def take_events(self) -> list[Any]:
        if self._kv_events is None:
            return []
        events = self._kv_events.take(self._store, self._keyspace)
        self.counters.kv_events_suppressed = self._kv_events.suppressed
        self.counters.kv_events_published += len(events)
        return events

    def has_pending_push_work(self) -> bool:
        return bool(self._store_events) or bool(self._pending_finished_stores) or (
            self._kv_events is not None and self._kv_events.has_pending()
        )

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: empty the pool too."""
        if self._store_events or self._pending_finished_stores:
            return False
        for request_id in list(self._pending_lookups):
            self._drop_pending_lookup(request_id)
        self._load_specs.clear()
        self._pending_loads.clear()
        cleared = True if self._store is None else self._store.clear()
        if cleared and self._kv_events is not None:
            self._kv_events.clear()
        return cleared

    def close(self) -> None:
        self._lookup_executor.shutdown(wait=False, cancel_futures=True)
        self._pending_lookups.clear()
        if self._store is not None:
            self._store.close()
            self._store = None

    def _forget(self, request_id: str) -> None:
        self._async_loads.discard(request_id)
        self._unplanned_loads.pop(request_id, None)
        self._pending_loads.pop(request_id, None)
        self._load_specs.pop(request_id, None)
        self._trackers.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._drop_pending_lookup(request_id)

    def _drop_pending_lookup(self, request_id: str) -> None:
        pending = self._pending_lookups.pop(request_id, None)
        if pending is not None:
            pending.answer.cancel()


def _table(groups: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in groups)


def _geometry(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> LookupGeometry:
    block_size, hash_block_size = vllm_compat.block_sizes(vllm_config, kv_cache_config)
    group_ids = vllm_compat.prefix_cacheable_group_ids(kv_cache_config)
    dcp = vllm_compat.parallel_sizes(vllm_config)[2]
    groups = kv_cache_config.kv_cache_groups
    sizes = tuple(vllm_compat.group_block_size(groups[g].kv_cache_spec, dcp) for g in group_ids)
    coordinated = len(group_ids) > 1 or (
        len(group_ids) == 1 and not vllm_compat.is_plain_full_attention(groups[group_ids[0]].kv_cache_spec)
    )
    units = tuple(
        core_lookup.lookup_unit(size, hash_block_size, config.enable_partial_hash_hits, False)
        for size in sizes
    )
    return LookupGeometry(
        group_ids=group_ids,
        group_block_sizes=sizes,
        lookup_units=units,
        block_size=block_size,
        hash_block_size=hash_block_size,
        partial_hash_hits=config.enable_partial_hash_hits,
        use_eagle=vllm_compat.uses_eagle_block_drop(vllm_config),
        coordinated=coordinated,
    )
