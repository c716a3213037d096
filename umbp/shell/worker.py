"""The worker role: moves blocks between vLLM's paged KV tensors and the pool, on
background lanes (:mod:`umbp.shell.transfers`), never inside the forward pass.

* ``start_load_kv`` hands the step's loads to the lanes and returns. An
  asynchronous load (its request waits outside the batch) completes on the async
  lane and is reported through ``get_transfer_results``; vLLM schedules the request
  only then. The step's synchronous loads are read and scattered layer by layer on
  the sync lane (:mod:`umbp.shell.layer_loads`); ``wait_for_layer_load`` waits for
  its own layer's copies only.
* ``wait_for_save`` hands the step's stores to the store lane and returns; their
  results reach the scheduler as worker metadata once stored, and the scheduler
  keeps the source blocks pinned until then. :class:`~umbp.shell.transfers.InFlightBudget`
  bounds what is handed over and not yet stored.

A load that fails for any reason is reported, so vLLM recomputes those tokens: a
failed load is never served. Each transfer is read -> core -> apply: the store's
per-object answers go to :mod:`umbp.core.loads.outcomes`, which decides which rows
reach the KV cache, which blocks failed and how vLLM hears of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from umbp.core.config import ConnectorConfig
from umbp.core.identity import KeySpace, ObjectId, RankCoord
from umbp.core.loads.failures import computed_over_failed_loads, still_computing_over_failures
from umbp.core.loads.outcomes import (
    LoadReport,
    RequestLoadOutcome,
    failure_reporting,
    failure_unreportable,
    plan_load_outcome,
    report_load,
    unplanned_load_outcome,
)
from umbp.core.plans import GroupBlocks, LoadPlan, StorePlan
from umbp.core.pool_pages import pool_page_bytes
from umbp.core.replicas import stores_rank_writes
from umbp.core.stores.acks import StoreEventResult
from umbp.core.stores.results import failed_store_identities, stores_past_failed_loads
from umbp.gpu.copier import BlockCopier, ForwardMark, mark_forward_end
from umbp.runtime.backends import WorkerBackend, open_worker_backend
from umbp.runtime.contract import LabelsNamespaces, RegistersHostMemory, WorkerStore
from umbp.runtime.pool import SlabPool
from umbp.shell import vllm_compat
from umbp.shell.group_io import GroupIO, GroupRead, settle_reads
from umbp.shell.layer_loads import LayerwiseLoads
from umbp.shell.metadata import UMBPConnectorMetadata, UMBPHandshake, UMBPWorkerMetadata
from umbp.shell.stats import PoolFigures, WorkerCounters
from umbp.shell.transfers import InFlightBudget, Lane

logger = logging.getLogger("umbp")

DRAIN_TIMEOUT_S = 60.0
"""How long sleep mode and shutdown wait for transfers in flight."""

LANES = ("umbp-sync-load", "umbp-async-load", "umbp-store")

IDLE_STEP_WAIT_S = 0.005
"""How long a step that computes nothing waits for an asynchronous load or a store in
flight to finish. vLLM's engine loop runs such steps back to back in Python while
transfers are pending, holding the GIL that the transfer threads need between their
copies: a 64 MiB restore took ~1 s on an otherwise idle engine. Waiting here releases
it; a transfer that finishes ends the wait at once."""


class UMBPWorker:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, *,
        active: bool = True,
    ) -> None:
        self._active = active  # inactive: no pool, no handshake; the scheduler sends nothing
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._config = config
        # The override was validated with the config; a fingerprint reads the weights
        # (inactive: no namespace is needed, so none are read).
        namespace, self._label = vllm_compat.namespace_and_label(
            vllm_config, kv_cache_config, config.namespace
        ) if active else ("", "")
        self._keyspace = KeySpace(namespace, vllm_compat.topology_of(vllm_config),
                                  vllm_compat.replicated_group_runs(
                                      vllm_config, kv_cache_config, config) if active else ())
        self._rank: RankCoord = vllm_compat.this_worker_rank(vllm_config)
        self._group_ids = vllm_compat.prefix_cacheable_group_ids(kv_cache_config)
        # vLLM's one way to hear of failed loads for this model, decided once.
        self._reporting = failure_reporting(len(kv_cache_config.kv_cache_groups))
        # The tensors vLLM registered, kept for sleep mode's restore (vLLM 0.33).
        self._kv_caches: dict[str, Any] | None = None
        self._object_bytes: dict[int, int] = {}
        self._layers: dict[int, int] = {}
        self._layer_of: dict[str, tuple[int, int]] = {}
        self._device = torch.device("cpu")
        self._asleep = False
        self._backend: WorkerBackend | None = None
        self._lanes: dict[str, Lane] = {}
        self._io: dict[str, GroupIO] = {}
        self._budget = InFlightBudget(config.store_inflight_bytes)
        self._report = LoadReport()
        # Requests computing over a failed synchronous load (this step's or one the
        # scheduler has not settled yet): save() stores none of theirs.
        self._computed_over_failures: frozenset[str] = frozenset()
        self._step_loads: LayerwiseLoads | None = None
        self._step_meta: UMBPConnectorMetadata | None = None
        self._store_results: dict[int, StoreEventResult] = {}
        self._lock = threading.Lock()
        self._transfer_done = threading.Condition(self._lock)
        self._transfers_in_flight = 0  # asynchronous loads and store events
        self._idle_step = False
        self._pool_figures = PoolFigures()
        self.counters = WorkerCounters()

    @property
    def namespace(self) -> str:
        return self._keyspace.namespace

    @property
    def _store(self) -> WorkerStore | None:
        return None if self._backend is None else self._backend.store

    @property
    def pool(self) -> SlabPool | None:
        """The embedded pool (None in the shared modes)."""
        if self._backend is None or self._backend.embedded is None:
            return None
        return self._backend.embedded.pool

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not self._active:
            return
        self._kv_caches = kv_caches
        copiers = self._copiers_for(kv_caches)
        self._object_bytes = {g: copier.object_bytes for g, copier in copiers.items()}
        self._layers = {g: copier.num_layers for g, copier in copiers.items()}
        self._layer_of = self._layer_positions(kv_caches)
        self._device = next(iter(copiers.values())).device if copiers else torch.device("cpu")
        object_sizes = list(self._object_bytes.values())
        page_bytes = pool_page_bytes(self._config.page_bytes, object_sizes)
        self._backend = open_worker_backend(
            self._config,
            page_bytes,
            serve_other_processes=not vllm_compat.runs_in_one_process(self._vllm_config),
        )
        if isinstance(self._backend.store, LabelsNamespaces):  # `umbp ls` names the model
            self._backend.store.register_namespace(self.namespace, self._label)
        on_staging = (self._register, self._unregister)
        for name in LANES:
            lane_copiers = copiers if name == LANES[0] else self._copiers_for(kv_caches)
            self._io[name] = GroupIO(
                lane_copiers, lambda: self._store, self._keyspace, self._rank, on_staging
            )
            self._lanes[name] = Lane(name)
        # A server this worker did not start has its own capacity (`umbp stats`).
        capacity = (
            "capacity the server's"
            if self._config.mode == "server" and not self._config.auto_start
            else f"capacity {self._config.capacity_bytes >> 20} MiB"
        )
        logger.info(
            "umbp worker rank %s: namespace %s, %d cache group(s), object bytes %s, "
            "mode %s, %s",
            self._rank, self.namespace, len(copiers), object_sizes, self._config.mode,
            capacity,
        )

    def _copiers_for(self, kv_caches: dict[str, Any]) -> dict[int, BlockCopier]:
        num_blocks = int(self._kv_cache_config.num_blocks)
        copiers: dict[int, BlockCopier] = {}
        for group_id in self._group_ids:
            group = self._kv_cache_config.kv_cache_groups[group_id]
            layers = [kv_caches[name] for name in group.layer_names if name in kv_caches]
            if layers:
                copiers[group_id] = BlockCopier(layers, num_blocks)
        return copiers

    def _layer_positions(self, kv_caches: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """vLLM's layer name -> (cache group, the layer's place in the group's objects),
        as :meth:`_copiers_for` orders the layers."""
        positions: dict[str, tuple[int, int]] = {}
        for group_id in self._group_ids:
            names = self._kv_cache_config.kv_cache_groups[group_id].layer_names
            for index, name in enumerate(n for n in names if n in kv_caches):
                positions[name] = (group_id, index)
        return positions

    @property
    def asleep(self) -> bool:
        """Between ``unregister_kv_caches`` and ``restore_kv_caches``."""
        return self._asleep

    def unregister_kv_caches(self) -> None:
        """Sleep mode (vLLM 0.33): the KV tensors' device memory is about to be
        released. Transfers in flight finish first (they read or write that memory);
        then every copier (views into it, device bounce buffers, streams) is
        dropped, so no load or store can touch it until restore: a load asked for
        meanwhile reports its blocks failed (vLLM recomputes) and a store stores
        nothing. The pool and the host staging buffers stay: sleep loses no stored
        block. Idempotent."""
        if not self._active or self._kv_caches is None:
            return
        self._drain("sleep mode")
        for io in self._io.values():
            io.drop_copiers()
        self._asleep = True

    def restore_kv_caches(self, kv_caches: dict[str, Any] | None = None) -> None:
        """After wake-up: copiers are rebuilt from the KV tensors as they are now
        (the ones vLLM registered, or ``kv_caches`` if given), so no pointer
        derived before the sleep is used. Idempotent."""
        if not self._active or self._kv_caches is None or not (
            self._asleep or kv_caches is not None
        ):
            return
        caches = self._kv_caches if kv_caches is None else kv_caches
        lane_copiers = {name: self._copiers_for(caches) for name in self._io}
        sizes = {g: c.object_bytes for g, c in next(iter(lane_copiers.values()), {}).items()}
        if sizes != self._object_bytes:
            raise RuntimeError(
                f"umbp: the KV caches restored after sleep have other object sizes "
                f"{sizes} than those registered {self._object_bytes}"
            )
        self._drain("restoring the KV caches")
        for name, io in self._io.items():
            io.use_copiers(lane_copiers[name])
        self._kv_caches, self._asleep = caches, False

    def refresh_pool_counters(self) -> None:
        if self._store is not None:
            self._pool_figures.refresh(self._store, self.counters)
        waits = self._budget.waits
        self.counters.store_waits, self.counters.store_wait_seconds = waits.count, waits.seconds

    def handshake(self) -> UMBPHandshake | None:
        if self._backend is None:
            return None
        embedded = self._backend.embedded
        return UMBPHandshake(self.namespace, self._rank,
                             None if embedded is None else embedded.address,
                             self._keyspace.replicated)

    # -- loads -------------------------------------------------------------------

    def start_loads(self, meta: UMBPConnectorMetadata) -> None:
        """Hand the step's loads to the lanes and return. vLLM calls this on every
        step, even without a forward pass; a step whose forward pass never saved
        is settled here."""
        self._settle_step_loads()
        self._step_meta = meta
        self._idle_step = meta.idle_step
        # Settled by the scheduler before this step (vLLM cut their computed tokens,
        # or they finished or were preempted): what they compute now is the recompute.
        self._computed_over_failures -= meta.settled_load_failures
        for request_id, block_ids in meta.unplanned_loads.items():
            self._report_load(
                unplanned_load_outcome(request_id, block_ids, request_id in meta.async_loads)
            )
        if not self._lanes:  # no KV memory registered: nothing can be read, all recomputed
            for plan in meta.loads:
                self._report_load(plan_load_outcome(
                    plan, (), plan.request_id in meta.async_loads
                ))
            return
        sync = [plan for plan in meta.loads if plan.request_id not in meta.async_loads]
        for plan in meta.loads:
            if plan.request_id in meta.async_loads:
                self._submit_counted(LANES[1], partial(self._async_load, plan))
        if sync:
            loads = LayerwiseLoads(sync, self._io[LANES[0]], self._layers)
            self._step_loads = loads
            self._submit(LANES[0], loads.run)
            if any(plan.ends_mid_block for plan in sync):
                # vLLM writes the step's new tokens into that block before the
                # layer's attention (and its wait) runs: the whole load lands first.
                started = time.perf_counter()
                loads.outcomes()
                self._count_wait("load_wait_seconds", time.perf_counter() - started)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Only this layer's copies of this step's synchronous loads."""
        loads, position = self._step_loads, self._layer_of.get(layer_name)
        if loads is None or position is None:
            return
        started = time.perf_counter()
        loads.wait_layer(*position)
        self._count_wait("load_wait_seconds", time.perf_counter() - started)

    def _settle_step_loads(self) -> None:
        """The step's synchronous loads have run: report them, and leave out the
        stores of the requests that computed over a failure (vLLM plans a step
        before the last one's failures are known, so such a step may still compute
        over stale blocks: :func:`still_computing_over_failures`)."""
        loads, meta = self._step_loads, self._step_meta
        self._step_loads = None
        outcomes: tuple[RequestLoadOutcome, ...] = ()
        if loads is not None:
            started = time.perf_counter()
            outcomes = loads.outcomes()
            self._count_wait("load_wait_seconds", time.perf_counter() - started)
            for index, outcome in enumerate(outcomes):
                self._count_loaded(outcome, loads.seconds if index == 0 else 0.0)
                self._report_load(outcome)
        if meta is not None:
            self._computed_over_failures = still_computing_over_failures(
                self._computed_over_failures, frozenset(),
                computed_over_failed_loads(outcomes), meta.stores_over_loads,
            )
            self._step_meta = None

    def _async_load(self, plan: LoadPlan) -> None:
        """On the async lane: read, scatter what core says loaded, settle the reads
        (a lent object is verified after its copy), report."""
        started = time.perf_counter()
        io = self._io[LANES[1]]
        reads: list[GroupRead] = []
        scattered = False
        try:
            reads = [io.read(group) for group in plan.groups]
            provisional = plan_load_outcome(plan, [read.statuses for read in reads], True)
            for group, read in zip(provisional.groups, reads):
                source = io.source(group, read)
                if source is not None:
                    io.scatter(group, source).wait()
            scattered = True
        finally:
            # Whatever happened, vLLM hears of the request (it waits for it).
            outcome = plan_load_outcome(plan, settle_reads(reads, scattered), True)
            self._count_loaded(outcome, time.perf_counter() - started)
            self._report_load(outcome)
            self._count_done()

    def _count_loaded(self, outcome: RequestLoadOutcome, seconds: float = 0.0) -> None:
        loaded = sum(len(group.loaded_rows) for group in outcome.groups)
        nbytes = sum(
            len(group.loaded_rows) * self._object_bytes.get(group.group_id, 0)
            for group in outcome.groups
        )
        with self._lock:
            self.counters.loaded_blocks += loaded
            self.counters.loaded_bytes += nbytes
            self.counters.load_seconds += seconds

    def _report_load(self, outcome: RequestLoadOutcome) -> None:
        if outcome.failed:
            logger.warning(
                "umbp load for request %s: %d of %d blocks failed (%s); vLLM recomputes them",
                outcome.request_id, len(outcome.failed_block_ids), outcome.planned_blocks,
                ", ".join(sorted({s.value for s in outcome.failures})) or "not planned",
            )
        if failure_unreportable(outcome, self._reporting):
            logger.error(
                "umbp: the failed synchronous load of request %s cannot be reported to "
                "vLLM, which takes only request-level failures of asynchronous loads here",
                outcome.request_id,
            )
        with self._lock:
            self.counters.count_load_failures(outcome.failures)
            self._report = report_load(self._report, outcome, self._reporting)

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids of asynchronous loads: failed ones are also
        finished, as vLLM requires, and are recomputed."""
        with self._lock:
            if self._idle_step and self._transfers_in_flight and not (
                self._report.finished_requests or self._store_results
            ):
                self._transfer_done.wait(IDLE_STEP_WAIT_S)
            report, self._report = self._report, self._report.without_requests()
        return set(report.finished_requests), set(report.failed_requests)

    def take_load_error_blocks(self) -> set[int]:
        """Block-level failures (only where vLLM takes them: one cache group)."""
        self._settle_step_loads()
        with self._lock:
            report, self._report = self._report, self._report.without_blocks()
        return set(report.failed_block_ids)

    # -- stores ---------------------------------------------------------------------

    def save(self, meta: UMBPConnectorMetadata) -> None:
        """Hand the step's stores to the store lane (after the step's synchronous
        loads are known: nothing computed over a failed one is stored)."""
        self._settle_step_loads()
        if meta.store_event is None:
            return
        stores, not_stored = stores_past_failed_loads(
            stores_rank_writes(meta.stores, self._keyspace, self._rank),
            self._computed_over_failures,
        )
        if not_stored:
            logger.warning("umbp: %d blocks computed over a failed load this step are not "
                           "stored; what vLLM recomputes is stored when computed",
                           len(not_stored))
        if not self._lanes:  # no KV memory registered: nothing can be stored
            failed = not_stored.union(*(plan.identities() for plan in stores))
            with self._lock:
                self._store_results[meta.store_event] = StoreEventResult(1, failed)
            return
        mark = mark_forward_end(self._device)
        nbytes = sum(
            len(group) * self._object_bytes.get(group.group_id, 0)
            for plan in stores for group in plan.groups
        )
        self._budget.take(nbytes)
        self._submit_counted(LANES[2], partial(
            self._store_event, meta.store_event, stores, not_stored, mark, nbytes
        ))

    def _store_event(
        self, event: int, stores: Sequence[StorePlan], not_stored: frozenset[ObjectId],
        mark: ForwardMark, nbytes: int,
    ) -> None:
        """On the store lane: every plan's groups gathered and put; the event's result
        (with what failed) goes to the scheduler with the next worker metadata."""
        started = time.perf_counter()
        failed: frozenset[ObjectId] = not_stored
        try:
            for plan in stores:
                for group in plan.groups:
                    failed |= self._store_group(group, mark)
        finally:
            self._budget.release(nbytes)
            with self._lock:
                self.counters.store_seconds += time.perf_counter() - started
                self._store_results[event] = StoreEventResult(1, failed)
            self._count_done()

    def _store_group(self, group: GroupBlocks, mark: ForwardMark) -> frozenset[ObjectId]:
        identities = tuple(group.identities())
        try:
            stored = self._io[LANES[2]].write(group, mark)
        except Exception as error:  # noqa: BLE001 - a copy that raised stores nothing
            logger.warning("umbp store of cache group %d failed: %s", group.group_id, error)
            stored = None
        group_failed = failed_store_identities(identities, stored)
        written = len(group) - len(group_failed)
        with self._lock:
            self.counters.stored_blocks += written
            self.counters.stored_bytes += written * self._object_bytes.get(group.group_id, 0)
            self.counters.store_failures += len(group_failed)
        return group_failed

    def take_worker_metadata(self) -> UMBPWorkerMetadata | None:
        with self._lock:
            results, self._store_results = self._store_results, {}
        return UMBPWorkerMetadata(results) if results else None

    # -- the lanes ------------------------------------------------------------------

    def _submit(self, lane: str, job: Any) -> None:
        self._lanes[lane].submit(job)

    def _submit_counted(self, lane: str, job: Any) -> None:
        """Submit a job that calls :meth:`_count_done` when it ends: idle steps wait for
        it (:data:`IDLE_STEP_WAIT_S`)."""
        with self._lock:
            self._transfers_in_flight += 1
        try:
            self._submit(lane, job)
        except BaseException:
            self._count_done()
            raise

    def _count_done(self) -> None:
        with self._lock:
            self._transfers_in_flight -= 1
            self._transfer_done.notify_all()

    def _count_wait(self, counter: str, seconds: float) -> None:
        with self._lock:
            setattr(self.counters, counter, getattr(self.counters, counter) + seconds)

    def wait_idle(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Until every transfer handed to the lanes so far has finished (their
        results wait for vLLM's next calls, as always); False on timeout. Not a vLLM
        hook: sleep mode and shutdown drain this way, and tests that check the pool
        between two engine steps."""
        return all(lane.drain(timeout_s) for lane in self._lanes.values())

    def _drain(self, why: str) -> None:
        """Wait for every transfer in flight (they touch the KV memory)."""
        self._settle_step_loads()
        for lane in self._lanes.values():
            if not lane.drain(DRAIN_TIMEOUT_S):
                logger.error("umbp: %s did not finish its transfers within %.0f s before %s",
                             lane.name, DRAIN_TIMEOUT_S, why)

    def shutdown(self) -> None:
        """Run what is queued (stores land, loads are reported), then stop."""
        if self._backend is None:
            return
        self._settle_step_loads()
        for lane in self._lanes.values():
            if not lane.close(DRAIN_TIMEOUT_S):
                logger.error("umbp: %s did not stop within %.0f s at shutdown",
                             lane.name, DRAIN_TIMEOUT_S)
        for io in self._io.values():
            io.release()
        self._backend.close()
        self._backend = None

    def _register(self, staging: torch.Tensor) -> None:
        """Let a transport that moves bytes only from registered memory (Mooncake,
        MORI) use the staging buffer directly. A refusal costs a bounce copy, not
        correctness."""
        if isinstance(self._store, RegistersHostMemory):
            try:
                self._store.register_host_memory(
                    staging.data_ptr(), staging.numel() * staging.element_size()
                )
            except OSError as error:
                logger.warning("umbp: could not register the staging buffer: %s", error)

    def _unregister(self, staging: torch.Tensor) -> None:
        if isinstance(self._store, RegistersHostMemory):
            try:
                self._store.unregister_host_memory(staging.data_ptr())
            except OSError as error:
                logger.debug("umbp: unregistering the staging buffer: %s", error)
