"""The worker role: moves blocks between vLLM's paged KV tensors and the pool.

Loads run in ``start_load_kv`` (before the forward pass for synchronous loads,
after it for asynchronous ones, as vLLM orders them); stores run in
``wait_for_save``, after the forward pass has written the blocks. A load that
fails for any reason is reported, so vLLM recomputes those tokens: a failed
load is never served.

Each transfer is read -> core -> apply: the store's per-object answers go to
``umbp.core.loads.outcomes``, which decides which rows reach the KV cache, which
blocks failed and how vLLM hears of it; this module copies, counts and reports.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from umbp.core.config import ConnectorConfig
from umbp.core.identity import KeySpace, ObjectId, RankCoord
from umbp.core.loads.failures import computed_over_failed_loads, still_computing_over_failures
from umbp.core.loads.outcomes import (
    GroupLoadOutcome,
    LoadReport,
    LoadStatus,
    RequestLoadOutcome,
    failure_reporting,
    failure_unreportable,
    plan_load_outcome,
    report_load,
    unplanned_load_outcome,
)
from umbp.core.plans import GroupBlocks, LoadPlan, StorePlan
from umbp.core.pool_pages import pool_page_bytes
from umbp.core.stores.acks import StoreEventResult
from umbp.core.stores.results import failed_store_identities, stores_past_failed_loads
from umbp.gpu.copier import BlockCopier
from umbp.gpu.staging import StagingRows
from umbp.runtime.backends import WorkerBackend, open_worker_backend
from umbp.runtime.contract import LabelsNamespaces, RegistersHostMemory, WorkerStore
from umbp.runtime.pool import SlabPool
from umbp.shell import vllm_compat
from umbp.shell.metadata import UMBPConnectorMetadata, UMBPHandshake, UMBPWorkerMetadata
from umbp.shell.stats import PoolFigures, WorkerCounters

logger = logging.getLogger("umbp")


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
        self._keyspace = KeySpace(namespace, vllm_compat.topology_of(vllm_config))
        self._rank: RankCoord = vllm_compat.this_worker_rank(vllm_config)
        self._group_ids = vllm_compat.prefix_cacheable_group_ids(kv_cache_config)
        # vLLM's one way to hear of failed loads for this model, decided once.
        self._reporting = failure_reporting(len(kv_cache_config.kv_cache_groups))
        self._copiers: dict[int, BlockCopier] = {}
        # The tensors vLLM registered, kept for sleep mode's restore (vLLM 0.33).
        self._kv_caches: dict[str, Any] | None = None
        self._object_bytes: dict[int, int] = {}
        self._asleep = False
        self._staging = StagingRows(self._register, self._unregister)
        self._backend: WorkerBackend | None = None
        self._report = LoadReport()
        # Requests computing over a failed synchronous load (this step's or one the
        # scheduler has not settled yet): save() stores none of theirs.
        self._computed_over_failures: frozenset[str] = frozenset()
        self._store_results: dict[int, StoreEventResult] = {}
        self._lock = threading.Lock()
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
        self._copiers = self._copiers_for(kv_caches)
        self._object_bytes = {g: copier.object_bytes for g, copier in self._copiers.items()}
        object_sizes = [copier.object_bytes for copier in self._copiers.values()]
        page_bytes = pool_page_bytes(self._config.page_bytes, object_sizes)
        self._backend = open_worker_backend(
            self._config,
            page_bytes,
            serve_other_processes=not vllm_compat.runs_in_one_process(self._vllm_config),
        )
        if isinstance(self._backend.store, LabelsNamespaces):  # `umbp ls` names the model
            self._backend.store.register_namespace(self.namespace, self._label)
        # A server this worker did not start has its own capacity (`umbp stats`).
        capacity = (
            "capacity the server's"
            if self._config.mode == "server" and not self._config.auto_start
            else f"capacity {self._config.capacity_bytes >> 20} MiB"
        )
        logger.info(
            "umbp worker rank %s: namespace %s, %d cache group(s), object bytes %s, "
            "mode %s, %s",
            self._rank, self.namespace, len(self._copiers), object_sizes,
            self._config.mode, capacity,
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

    @property
    def asleep(self) -> bool:
        """Between ``unregister_kv_caches`` and ``restore_kv_caches``."""
        return self._asleep

    def unregister_kv_caches(self) -> None:
        """Sleep mode (vLLM 0.33): the KV tensors' device memory is about to be
        released. Every copier (views into that memory, device bounce buffers,
        streams) is dropped, so no load or store can touch it until restore: a
        load asked for meanwhile reports its blocks failed (vLLM recomputes) and
        a store stores nothing. Copies are synchronous inside vLLM's hooks, so
        none is in flight here. The pool and the host staging buffers stay: sleep
        loses no stored block. Idempotent."""
        if not self._active or self._kv_caches is None:
            return
        self._copiers = {}
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
        copiers = self._copiers_for(caches)
        sizes = {g: copier.object_bytes for g, copier in copiers.items()}
        if sizes != self._object_bytes:
            raise RuntimeError(
                f"umbp: the KV caches restored after sleep have other object sizes "
                f"{sizes} than those registered {self._object_bytes}"
            )
        self._kv_caches, self._copiers, self._asleep = caches, copiers, False

    def refresh_pool_counters(self) -> None:
        if self._store is not None:
            self._pool_figures.refresh(self._store, self.counters)

    def handshake(self) -> UMBPHandshake | None:
        if self._backend is None:
            return None
        embedded = self._backend.embedded
        return UMBPHandshake(self.namespace, self._rank,
                             None if embedded is None else embedded.address)

    # -- loads: read -> core outcome -> scatter and report ------------------------

    def start_loads(self, meta: UMBPConnectorMetadata) -> None:
        outcomes = [
            unplanned_load_outcome(request_id, block_ids, request_id in meta.async_loads)
            for request_id, block_ids in meta.unplanned_loads.items()
        ]
        for batch in meta.loads:
            started = time.perf_counter()
            outcomes.append(self._load(batch, batch.request_id in meta.async_loads))
            self.counters.load_seconds += time.perf_counter() - started
        for outcome in outcomes:
            self._report_load(outcome)
        # Here, not in save(): vLLM calls start_load_kv on every step, even without
        # a forward pass (where wait_for_save is not called).
        self._computed_over_failures = still_computing_over_failures(
            self._computed_over_failures, meta.settled_load_failures,
            computed_over_failed_loads(outcomes), meta.stores_over_loads,
        )

    def _load(self, plan: LoadPlan, is_async: bool) -> RequestLoadOutcome:
        reads = [self._read_group(group) for group in plan.groups]
        outcome = plan_load_outcome(plan, [statuses for statuses, _ in reads], is_async)
        for group, (_, staging) in zip(outcome.groups, reads):
            self._scatter_loaded(group, staging)
        return outcome

    def _read_group(
        self, group: GroupBlocks
    ) -> tuple[tuple[LoadStatus, ...] | None, torch.Tensor | None]:
        """The statuses of reading the group's objects into its staging rows, and
        those rows; (None, None) when the group cannot be read (no store, or no KV
        memory while asleep)."""
        copier = self._copiers.get(group.group_id)
        if copier is None or self._store is None:
            return None, None
        staging = self._staging.rows(group.group_id, len(group), copier.object_bytes,
                                     copier.device)
        payload = staging.numpy()
        try:
            return self._store.get_batch_into(
                self._keys(group), [payload[i] for i in range(len(group))]
            ), staging
        # A store answers its failures as values (umbp.runtime.contract); one that
        # raises breaks it (a binding's own error, unknown here), and umbp must never
        # be the reason a request fails: the group counts as unread and is recomputed.
        except Exception as error:  # noqa: BLE001
            logger.warning("umbp load failed: %s", error)
            return None, None

    def _scatter_loaded(self, group: GroupLoadOutcome, staging: torch.Tensor | None) -> None:
        """Only the rows core says loaded intact reach the KV cache."""
        if group.problem is not None:
            logger.error("umbp load: %s", group.problem)
        if not group.loaded_rows or staging is None:
            return
        copier = self._copiers[group.group_id]
        if not group.all_loaded:  # rare: pick the intact rows
            staging = staging.index_select(0, torch.tensor(group.loaded_rows, dtype=torch.long))
        copier.scatter(group.loaded_block_ids, staging)
        self.counters.loaded_blocks += len(group.loaded_rows)
        self.counters.loaded_bytes += len(group.loaded_rows) * copier.object_bytes

    def _report_load(self, outcome: RequestLoadOutcome) -> None:
        self.counters.count_load_failures(outcome.failures)
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
            self._report = report_load(self._report, outcome, self._reporting)

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids of asynchronous loads: failed ones are also
        finished, as vLLM requires, and are recomputed."""
        with self._lock:
            report, self._report = self._report, self._report.without_requests()
        return set(report.finished_requests), set(report.failed_requests)

    def take_load_error_blocks(self) -> set[int]:
        """Block-level failures (only where vLLM takes them: one cache group)."""
        with self._lock:
            report, self._report = self._report, self._report.without_blocks()
        return set(report.failed_block_ids)

    # -- stores ---------------------------------------------------------------------

    def save(self, meta: UMBPConnectorMetadata) -> None:
        if meta.store_event is None:
            return
        started = time.perf_counter()
        stores, not_stored = stores_past_failed_loads(meta.stores, self._computed_over_failures)
        if not_stored:
            logger.warning("umbp: %d blocks computed over a failed load this step are not "
                           "stored; what vLLM recomputes is stored when computed",
                           len(not_stored))
        failed = not_stored.union(*(self._store_objects(plan) for plan in stores))
        self.counters.store_seconds += time.perf_counter() - started
        with self._lock:
            self._store_results[meta.store_event] = StoreEventResult(1, failed)

    def take_worker_metadata(self) -> UMBPWorkerMetadata | None:
        with self._lock:
            results, self._store_results = self._store_results, {}
        return UMBPWorkerMetadata(results) if results else None

    def shutdown(self) -> None:
        if self._backend is not None:
            self._staging.release()
            self._backend.close()
            self._backend = None

    def _keys(self, group: GroupBlocks) -> list[str]:
        keyspace, rank, group_id = self._keyspace, self._rank, group.group_id
        return [keyspace.key(rank, group_id, block_hash) for block_hash in group.block_hashes]

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

    def _store_objects(self, plan: StorePlan) -> frozenset[ObjectId]:
        """Store every object of the plan; returns the identities that failed."""
        failed: frozenset[ObjectId] = frozenset()
        for group in plan.groups:
            group_failed = failed_store_identities(
                tuple(group.identities()), self._write_group(group)
            )
            written = len(group) - len(group_failed)
            self.counters.stored_blocks += written
            self.counters.stored_bytes += written * self._object_bytes.get(group.group_id, 0)
            self.counters.store_failures += len(group_failed)
            failed |= group_failed
        return failed

    def _write_group(self, group: GroupBlocks) -> tuple[bool, ...] | None:
        """Gather the group's blocks and put them; None when the group cannot be
        written (no store, or no KV memory while asleep)."""
        copier = self._copiers.get(group.group_id)
        if copier is None or self._store is None:
            return None
        staging = self._staging.rows(group.group_id, len(group), copier.object_bytes,
                                     copier.device)
        copier.gather(list(group.block_ids), staging)
        payload = staging.numpy()
        try:
            return self._store.put_batch(
                self._keys(group), [payload[i] for i in range(len(group))]
            )
        # As in _read_group: a store raising breaks its contract, and must not fail
        # the request; the group counts as not stored.
        except Exception as error:  # noqa: BLE001
            logger.warning("umbp store failed: %s", error)
            return None
