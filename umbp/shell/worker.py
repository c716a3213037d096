"""The worker role: moves blocks between vLLM's paged KV tensors and the store, as
copies enqueued on a device (:mod:`umbp.gpu.device`), never inside the forward pass.

On the model thread, in each step:

* ``start_load_kv`` records the step's forward mark on vLLM's stream, submits the
  stores handed over in earlier steps (:mod:`umbp.shell.stores`) and the step's loads
  (:mod:`umbp.shell.loads`), all ordered after the mark, and returns. An asynchronous
  load (its request waits outside the batch) finishes beside the steps and is reported
  through ``get_transfer_results``; vLLM schedules the request only then. The step's
  synchronous loads are copied layer by layer, and ``wait_for_layer_load`` orders each
  layer's attention after its own layer's copies (on a GPU the GPU waits, not the host).
* ``wait_for_save`` hands the step's stores over; they are submitted with the next
  step's mark. Their results reach the scheduler as worker metadata once stored, and the
  scheduler keeps the source blocks pinned until then.
* Nothing a step calls waits for the device on the host: completions are polled
  (events queried) or waited for on host lanes. What the model thread may wait for is a
  synchronous load's checksums, verified on a host thread beside its copies, at the end
  of the step (vLLM must hear of a failed block in the step that loaded it).

A load that fails for any reason is reported, so vLLM recomputes those tokens: a failed
load is never served. Each transfer is read -> core -> apply: the store's per-object
answers go to :mod:`umbp.core.loads.outcomes`, which decides which rows reach the KV
cache, which blocks failed and how vLLM hears of it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from umbp.core.config import (
    ConnectorConfig,
    borrows_on_model_thread,
    copies_in_place,
    restores_layer_by_layer,
)
from umbp.core.identity import KeySpace, RankCoord
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
from umbp.core.pool_pages import pool_page_bytes
from umbp.core.replicas import stores_rank_writes
from umbp.core.stores.acks import StoreEventResult
from umbp.core.stores.results import stores_past_failed_loads
from umbp.gpu.copier import BlockCopier
from umbp.gpu.device import Device, HostDevice, device_for
from umbp.gpu.lanes import Lane
from umbp.gpu.registrations import HostRegistrations
from umbp.gpu.staging import StagingRing
from umbp.runtime.backends import WorkerBackend, open_worker_backend
from umbp.runtime.contract import (
    LabelsNamespaces,
    LendsObjects,
    RegistersHostMemory,
    WorkerStore,
)
from umbp.runtime.pool import SlabPool
from umbp.shell import vllm_compat
from umbp.shell.loads import AsyncLoad, LayerwiseLoad
from umbp.shell.metadata import UMBPConnectorMetadata, UMBPHandshake, UMBPWorkerMetadata
from umbp.shell.stats import PoolFigures, WorkerCounters
from umbp.shell.store_io import StoreAccess
from umbp.shell.stores import StoreQueue
from umbp.shell.transfer_context import TransferContext

logger = logging.getLogger("umbp")

DRAIN_TIMEOUT_S = 60.0
"""How long sleep mode and shutdown wait for transfers in flight."""

IDLE_STEP_WAIT_S = 0.005
"""How long a step that computes nothing waits for an asynchronous load or a store in
flight to finish. vLLM's engine loop runs such steps back to back in Python while
transfers are pending, holding the GIL that the transfer threads need between their
copies: a 64 MiB restore took ~1 s on an otherwise idle engine. Waiting here releases
it; a transfer that finishes ends the wait at once."""


class UMBPWorker:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, *,
        active: bool = True, device: Device | None = None,
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
        self._device_given = device
        # The tensors vLLM registered, kept for sleep mode's restore (vLLM 0.33).
        self._kv_caches: dict[str, Any] | None = None
        self._object_bytes: dict[int, int] = {}
        self._layers: dict[int, int] = {}
        self._layer_of: dict[str, tuple[int, int]] = {}
        self._asleep = False
        self._backend: WorkerBackend | None = None
        self._ctx: TransferContext | None = None
        self._stores: StoreQueue | None = None
        self._lanes: tuple[Lane, ...] = ()  # store I/O: the load lane's, the store lane's
        self._registrations: HostRegistrations | None = None
        self._report = LoadReport()
        # Requests computing over a failed synchronous load (this step's or one the
        # scheduler has not resolved yet): save() stores none of theirs.
        self._computed_over_failures: frozenset[str] = frozenset()
        self._step_loads: LayerwiseLoad | None = None
        self._releasing: list[LayerwiseLoad] = []  # reported, rows not let go yet
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

    @property
    def device(self) -> Device | None:
        """What the copies run on (None before the KV caches are registered)."""
        return None if self._ctx is None else self._ctx.device

    # -- start-up -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not self._active:
            return
        self._kv_caches = kv_caches
        copiers = self._copiers_for(kv_caches)
        self._object_bytes = {g: copier.object_bytes for g, copier in copiers.items()}
        self._layers = {g: copier.num_layers for g, copier in copiers.items()}
        self._layer_of = self._layer_positions(kv_caches)
        kv_device = next(iter(copiers.values())).device if copiers else torch.device("cpu")
        device = self._device_given or device_for(kv_device)
        object_sizes = list(self._object_bytes.values())
        page_bytes = pool_page_bytes(self._config.page_bytes, object_sizes)
        self._backend = open_worker_backend(
            self._config,
            page_bytes,
            serve_other_processes=not vllm_compat.runs_in_one_process(self._vllm_config),
        )
        if isinstance(self._backend.store, LabelsNamespaces):  # `umbp ls` names the model
            self._backend.store.register_namespace(self.namespace, self._label)
        in_place = copies_in_place(self._config.mode)
        registrations = self._registrations = HostRegistrations(device)
        ring = None if in_place else self._staging(registrations)
        if isinstance(self._backend.store, LendsObjects):
            self._backend.store.watch_lent_memory(registrations)
        load_io = Lane("umbp-load-io", on_start=device.bind_thread)
        self._store_io = store_io = Lane("umbp-store-io", on_start=device.bind_thread)
        self._lanes = (load_io, store_io)
        self._ctx = TransferContext(
            device=device,
            access=StoreAccess(lambda: self._store, self._keyspace, self._rank),
            ring=ring,
            layer_load_stream=device.new_stream("umbp-layer-load"),
            async_load_stream=device.new_stream("umbp-async-load"),
            store_stream=device.new_stream("umbp-store"),
            io_lane=load_io,
            store_lane=store_io,
            in_place=in_place,
            borrow_on_lane=not borrows_on_model_thread(self._config.mode),
            copiers=copiers,
        )
        self._stores = StoreQueue(self._ctx, self._config.store_inflight_bytes, store_io,
                                  self._store_finished)
        # A server this worker did not start has its own capacity (`umbp stats`).
        capacity = (
            "capacity the server's"
            if self._config.mode == "server" and not self._config.auto_start
            else f"capacity {self._config.capacity_bytes >> 20} MiB"
        )
        logger.info(
            "umbp worker rank %s: namespace %s, %d cache group(s), object bytes %s, "
            "mode %s, %s, KV on %s, %s",
            self._rank, self.namespace, len(copiers), object_sizes, self._config.mode,
            capacity, device.name,
            "copies straight between the KV cache and the store's pages"
            if in_place else
            f"staging {self._config.staging_bytes >> 20} MiB",
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

    def _staging(self, registrations: HostRegistrations) -> StagingRing:
        """The staging area, for a store whose objects do not copy in place: registered
        with the device and with a transport that moves only registered memory."""
        largest = max(self._object_bytes.values())
        if self._config.staging_bytes < largest:
            raise ValueError(
                f"umbp: staging_bytes ({self._config.staging_bytes}) must hold at least one "
                f"stored object ({largest} bytes); raise it in kv_connector_extra_config"
            )
        ring = StagingRing(self._config.staging_bytes)
        registrations.mapped(ring.address, ring.nbytes)
        store = self._store
        if isinstance(store, RegistersHostMemory):
            try:
                store.register_host_memory(ring.address, ring.nbytes)
            except OSError as error:  # a bounce copy per transfer, not a failure
                logger.warning("umbp: the store's transport refused the staging area: %s",
                               error)
        return ring

    def handshake(self) -> UMBPHandshake | None:
        if self._backend is None or self._ctx is None:
            return None
        embedded = self._backend.embedded
        return UMBPHandshake(
            self.namespace, self._rank, None if embedded is None else embedded.address,
            self._keyspace.replicated,
            restores_layer_by_layer(self._ctx.in_place, isinstance(self._ctx.device, HostDevice)),
        )

    # -- sleep mode (vLLM 0.33) ---------------------------------------------------------

    @property
    def asleep(self) -> bool:
        """Between ``unregister_kv_caches`` and ``restore_kv_caches``."""
        return self._asleep

    def unregister_kv_caches(self) -> None:
        """Sleep mode: the KV tensors' device memory is about to be released. Stores
        queued are submitted and every transfer in flight finishes first (they read or
        write that memory); then the copiers (views into it) go, so no load or store
        can touch it until restore: a load asked for meanwhile reports its blocks failed
        (vLLM recomputes) and a store stores nothing. The pool and the staging area
        stay: sleep loses no stored block. Idempotent."""
        if not self._active or self._kv_caches is None or self._ctx is None:
            return
        self._drain("sleep mode")
        self._ctx.copiers = {}
        self._asleep = True

    def restore_kv_caches(self, kv_caches: dict[str, Any] | None = None) -> None:
        """After wake-up: copiers are rebuilt from the KV tensors as they are now
        (the ones vLLM registered, or ``kv_caches`` if given), so no pointer
        derived before the sleep is used. Idempotent."""
        if not self._active or self._kv_caches is None or self._ctx is None or not (
            self._asleep or kv_caches is not None
        ):
            return
        caches = self._kv_caches if kv_caches is None else kv_caches
        copiers = self._copiers_for(caches)
        sizes = {g: c.object_bytes for g, c in copiers.items()}
        if sizes != self._object_bytes:
            raise RuntimeError(
                f"umbp: the KV caches restored after sleep have other object sizes "
                f"{sizes} than those registered {self._object_bytes}"
            )
        self._drain("restoring the KV caches")
        self._ctx.copiers = copiers
        self._kv_caches, self._asleep = caches, False

    # -- counters -------------------------------------------------------------------------

    def refresh_pool_counters(self) -> None:
        """Counters as the transfers left them; the store's own figures are read on
        the store I/O lane now and then (:class:`~umbp.shell.stats.PoolFigures`), never
        here: this runs on the model thread every step."""
        store, stores = self._store, self._stores
        if stores is None:
            return
        if store is not None and self._pool_figures.due():
            self._store_io.submit(lambda: self._pool_figures.read(store, self.counters))
        tally = stores.tally
        counters = self.counters
        counters.stored_blocks, counters.stored_bytes = tally.stored_blocks, tally.stored_bytes
        counters.store_failures, counters.store_seconds = tally.failures, tally.seconds
        counters.store_deferrals = tally.deferrals

    # -- loads ---------------------------------------------------------------------------

    def start_loads(self, meta: UMBPConnectorMetadata) -> None:
        """The step's forward mark, the stores handed over before, the step's loads;
        returns at once. vLLM calls this on every step, even without a forward pass; a
        step whose forward pass never saved is reported here."""
        self._report_step_loads()
        self._let_go_of_finished_loads()
        self._step_meta = meta
        self._idle_step = meta.idle_step
        # Resolved by the scheduler before this step (vLLM cut their computed tokens,
        # or they finished or were preempted): what they compute now is the recompute.
        self._computed_over_failures -= meta.resolved_load_failures
        for request_id, block_ids in meta.unplanned_loads.items():
            self._report_load(
                unplanned_load_outcome(request_id, block_ids, request_id in meta.async_loads)
            )
        ctx, stores = self._ctx, self._stores
        if ctx is None or stores is None:  # no KV memory registered: all recomputed
            for plan in meta.loads:
                self._report_load(plan_load_outcome(
                    plan, (), plan.request_id in meta.async_loads
                ))
            return
        mark = ctx.forward_mark()
        stores.submit(mark)
        sync = [plan for plan in meta.loads if plan.request_id not in meta.async_loads]
        for plan in meta.loads:
            if plan.request_id in meta.async_loads:
                self._count_started()
                AsyncLoad(plan, ctx, mark, self._async_loaded).start()
        if sync:
            loads = LayerwiseLoad(sync, ctx, mark, self._layers,
                                  any(plan.ends_mid_block for plan in sync))
            self._step_loads = loads
            started = time.perf_counter()
            loads.start()
            self._count_wait(time.perf_counter() - started)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Only this layer's copies of this step's synchronous loads."""
        loads, position = self._step_loads, self._layer_of.get(layer_name)
        if loads is None or position is None:
            return
        started = time.perf_counter()
        loads.wait_layer(*position)
        self._count_wait(time.perf_counter() - started)

    def _report_step_loads(self) -> None:
        """The step's synchronous loads are copied: report them, and leave out the
        stores of the requests that computed over a failure (vLLM plans a step
        before the last one's failures are known, so such a step may still compute
        over stale blocks: :func:`still_computing_over_failures`)."""
        loads, meta = self._step_loads, self._step_meta
        self._step_loads = None
        outcomes: tuple[RequestLoadOutcome, ...] = ()
        if loads is not None:
            started = time.perf_counter()
            outcomes = loads.outcomes()
            self._count_wait(time.perf_counter() - started)
            for index, outcome in enumerate(outcomes):
                self._count_loaded(outcome, loads.seconds if index == 0 else 0.0)
                self._report_load(outcome)
            self._releasing.append(loads)
            # Loans whose copies completed end now, before this step's stores reserve:
            # a pool full of what the step restored can then evict it for what it computed.
            self._let_go_of_finished_loads()
        if meta is not None:
            self._computed_over_failures = still_computing_over_failures(
                self._computed_over_failures, frozenset(),
                computed_over_failed_loads(outcomes), meta.stores_over_loads,
            )
            self._step_meta = None

    def _let_go_of_finished_loads(self, wait: bool = False) -> None:
        """The store's rows of synchronous loads whose copies completed go back."""
        self._releasing = [loads for loads in self._releasing if not loads.poll(wait)]

    def _async_loaded(self, outcome: RequestLoadOutcome, seconds: float) -> None:
        """An asynchronous load finished (on a host thread)."""
        try:
            self._count_loaded(outcome, seconds)
            self._report_load(outcome)
        finally:
            self._count_done()

    def _count_loaded(self, outcome: RequestLoadOutcome, seconds: float) -> None:
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
        self._let_go_of_finished_loads()
        with self._lock:
            if self._idle_step and self._transfers_in_flight and not (
                self._report.finished_requests or self._store_results
            ):
                self._transfer_done.wait(IDLE_STEP_WAIT_S)
            report, self._report = self._report, self._report.without_requests()
        return set(report.finished_requests), set(report.failed_requests)

    def take_load_error_blocks(self) -> set[int]:
        """Block-level failures (only where vLLM takes them: one cache group)."""
        self._report_step_loads()
        with self._lock:
            report, self._report = self._report, self._report.without_blocks()
        return set(report.failed_block_ids)

    # -- stores ---------------------------------------------------------------------------

    def save(self, meta: UMBPConnectorMetadata) -> None:
        """Hand the step's stores over (once the step's synchronous loads are known:
        nothing computed over a failed one is stored). On a GPU the next step submits
        them (after this step's sampled tokens); with KV in host memory the forward pass
        is over when this runs, so they start now, between the steps."""
        self._report_step_loads()
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
        if self._stores is None:  # no KV memory registered: nothing can be stored
            failed = not_stored.union(*(plan.identities() for plan in stores))
            with self._lock:
                self._store_results[meta.store_event] = StoreEventResult(1, failed)
            return
        self._count_started()
        self._stores.add(meta.store_event, stores, not_stored)
        ctx = self._ctx
        if ctx is not None and ctx.device.stores_start_at_save:
            self._stores.submit(ctx.forward_mark())

    def _store_finished(self, event: int, result: StoreEventResult) -> None:
        with self._lock:
            self._store_results[event] = result
        self._count_done()

    def take_worker_metadata(self) -> UMBPWorkerMetadata | None:
        with self._lock:
            results, self._store_results = self._store_results, {}
        return UMBPWorkerMetadata(results) if results else None

    # -- in flight --------------------------------------------------------------------------

    def _count_started(self) -> None:
        with self._lock:
            self._transfers_in_flight += 1

    def _count_done(self) -> None:
        with self._lock:
            self._transfers_in_flight -= 1
            self._transfer_done.notify_all()

    def _count_wait(self, seconds: float) -> None:
        with self._lock:
            self.counters.load_wait_seconds += seconds

    def wait_idle(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Until every transfer handed over so far has finished, stores still queued
        submitted first (their results wait for vLLM's next calls, as always); False on
        timeout. Not a vLLM hook and never called in a step: sleep mode and shutdown
        drain this way, and tests that check the pool between two engine steps."""
        self._report_step_loads()
        ctx, stores = self._ctx, self._stores
        if ctx is None or stores is None:
            return True
        deadline = time.monotonic() + timeout_s
        if not stores.submit_all(ctx.forward_mark(), timeout_s):
            return False
        with self._lock:
            if not self._transfer_done.wait_for(
                lambda: self._transfers_in_flight == 0, max(0.0, deadline - time.monotonic())
            ):
                return False
        self._let_go_of_finished_loads(wait=True)
        left = max(0.0, deadline - time.monotonic())
        return all(lane.drain(left) for lane in self._lanes) and (
            not isinstance(ctx.device, HostDevice) or ctx.device.drain(left)
        )

    def _drain(self, why: str) -> None:
        """Wait for every transfer in flight (they touch the KV memory)."""
        if not self.wait_idle(DRAIN_TIMEOUT_S):
            logger.error("umbp: transfers did not finish within %.0f s before %s",
                         DRAIN_TIMEOUT_S, why)

    def shutdown(self) -> None:
        """Submit what is queued, let every transfer finish (stores land, loads are
        reported), then stop."""
        if self._backend is None:
            return
        self._drain("shutdown")
        for lane in self._lanes:
            if not lane.close(DRAIN_TIMEOUT_S):
                logger.error("umbp: %s did not stop within %.0f s at shutdown",
                             lane.name, DRAIN_TIMEOUT_S)
        ctx = self._ctx
        if ctx is not None:
            ctx.device.close()
            if self._registrations is not None:
                self._registrations.close()
            if ctx.ring is not None:
                store = self._store
                if isinstance(store, RegistersHostMemory):
                    try:
                        store.unregister_host_memory(ctx.ring.address)
                    except OSError as error:
                        logger.debug("umbp: unregistering the staging area: %s", error)
                ctx.ring.close()
        self._backend.close()
        self._backend = None

