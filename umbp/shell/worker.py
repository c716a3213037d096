"""The worker role: moves blocks between vLLM's paged KV tensors and the pool.

Loads run in ``start_load_kv`` (before the forward pass for synchronous loads,
after it for asynchronous ones, as vLLM orders them); stores run in
``wait_for_save``, after the forward pass has written the blocks. A load that
fails for any reason is reported, so vLLM recomputes those tokens: a failed
load is never served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from umbp.core.config import ConnectorConfig
from umbp.core.identity import KeySpace, RankCoord, resolve_namespace
from umbp.core.plans import BlockLoadBatch, StoreBatch
from umbp.core.store_events import StoreEventResult
from umbp.gpu.copier import BlockCopier
from umbp.gpu.staging import allocate_staging
from umbp.runtime.backends import WorkerBackend, open_worker_backend
from umbp.runtime.contract import (
    MEDIUM_DISK,
    LoadStatus,
    RegistersHostMemory,
    ReportsTiers,
    WorkerStore,
)
from umbp.runtime.pool import SlabPool
from umbp.shell import vllm_compat
from umbp.shell.metadata import UMBPConnectorMetadata, UMBPHandshake, UMBPWorkerMetadata

logger = logging.getLogger("umbp")

POOL_STATS_EVERY_S = 1.0


@dataclass(slots=True)
class WorkerCounters:
    """Counted where the copies happen, so the figures can be trusted."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_failures: dict[str, int] = field(default_factory=dict)
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_failures: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    # The pool's own figures, refreshed when stats are reported.
    pool_evictions: int = 0
    pool_used_bytes: int = 0
    pool_objects: int = 0
    pool_disk_used_bytes: int = 0
    pool_disk_objects: int = 0

    def count_load_failure(self, status: LoadStatus) -> None:
        name = status.name.lower()
        self.load_failures[name] = self.load_failures.get(name, 0) + 1


class UMBPWorker:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, *,
        active: bool = True,
    ) -> None:
        self._active = active  # inactive: no pool, no handshake; the scheduler sends nothing
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._config = config
        namespace = resolve_namespace(
            vllm_compat.namespace_inputs(vllm_config, kv_cache_config), config.namespace
        ).unwrap()  # the override was validated with the config
        self._keyspace = KeySpace(namespace, vllm_compat.topology_of(vllm_config))
        self._rank: RankCoord = vllm_compat.this_worker_rank(vllm_config)
        self._group_ids = vllm_compat.prefix_cacheable_group_ids(kv_cache_config)
        self._single_group = len(kv_cache_config.kv_cache_groups) == 1
        self._copiers: dict[int, BlockCopier] = {}
        # The tensors vLLM registered, kept for sleep mode's restore (vLLM 0.33).
        self._kv_caches: dict[str, Any] | None = None
        self._object_bytes: dict[int, int] = {}
        self._asleep = False
        self._staging: dict[int, torch.Tensor] = {}
        self._backend: WorkerBackend | None = None
        self._load_error_blocks: set[int] = set()
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._store_results: dict[int, StoreEventResult] = {}
        self._lock = threading.Lock()
        self._next_pool_stats = 0.0
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
        page_bytes = self._config.page_bytes or auto_page_bytes(object_sizes)
        executor = getattr(self._vllm_config.parallel_config, "distributed_executor_backend", None)
        self._backend = open_worker_backend(
            self._config, page_bytes, serve_other_processes=executor != "uni"
        )
        logger.info(
            "umbp worker rank %s: namespace %s, %d cache group(s), object bytes %s, "
            "mode %s, capacity %d MiB",
            self._rank, self.namespace, len(self._copiers), object_sizes,
            self._config.mode, self._config.capacity_bytes >> 20,
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
        """The store's own figures (in the shared modes, the whole store's, which other
        engines fill too), at most once per `POOL_STATS_EVERY_S`: vLLM asks every step,
        and asking a stalled server costs up to `io_timeout_s`. A store that cannot
        answer keeps the last figures."""
        now = time.monotonic()
        if self._store is None or now < self._next_pool_stats:
            return
        self._next_pool_stats = now + POOL_STATS_EVERY_S
        try:
            stats = self._store.stats()
        except Exception as error:
            logger.debug("umbp store stats unavailable: %s", error)
            return
        self.counters.pool_evictions = stats.evictions
        self.counters.pool_used_bytes = stats.used_bytes
        self.counters.pool_objects = stats.objects
        if isinstance(self._store, ReportsTiers):
            try:
                usage = self._store.tier_usage()
            except Exception as error:
                logger.debug("umbp store tier usage unavailable: %s", error)
                return
            disk = usage.get(MEDIUM_DISK, (0, 0))
            self.counters.pool_disk_used_bytes, self.counters.pool_disk_objects = disk

    def handshake(self) -> UMBPHandshake | None:
        if self._backend is None:
            return None
        embedded = self._backend.embedded
        return UMBPHandshake(self.namespace, self._rank,
                             None if embedded is None else embedded.address)

    def start_loads(self, meta: UMBPConnectorMetadata) -> None:
        for request_id, block_ids in meta.unplanned_loads.items():
            self._record_load(request_id, set(block_ids), request_id in meta.async_loads)
        for transfer in meta.loads:
            started = time.perf_counter()
            failed_blocks = self._load(transfer)
            self.counters.load_seconds += time.perf_counter() - started
            self._record_load(
                transfer.request_id, failed_blocks, transfer.request_id in meta.async_loads
            )

    def _record_load(self, request_id: str, failed_blocks: set[int], is_async: bool) -> None:
        with self._lock:
            self._load_error_blocks.update(failed_blocks)
            if is_async:
                self._finished_loads.add(request_id)
                if failed_blocks:
                    self._failed_loads.add(request_id)

    def save(self, meta: UMBPConnectorMetadata) -> None:
        if meta.store_event is None:
            return
        failed: set[tuple[int, bytes]] = set()
        started = time.perf_counter()
        for transfer in meta.stores:
            failed.update(self._store_objects(transfer))
        self.counters.store_seconds += time.perf_counter() - started
        with self._lock:
            self._store_results[meta.store_event] = StoreEventResult(1, frozenset(failed))

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids; failed ones are also finished, as vLLM
        requires, and recompute from their first failed block."""
        with self._lock:
            finished, failed = self._finished_loads, self._failed_loads
            self._finished_loads, self._failed_loads = set(), set()
        return finished, failed

    def take_load_error_blocks(self) -> set[int]:
        # Block ids are unique only within a group; with several groups vLLM takes
        # request-level failures instead (failed_recving), and loads are async.
        if not self._single_group:
            with self._lock:
                self._load_error_blocks.clear()
            return set()
        with self._lock:
            blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def take_worker_metadata(self) -> UMBPWorkerMetadata | None:
        with self._lock:
            results, self._store_results = self._store_results, {}
        return UMBPWorkerMetadata(results) if results else None

    def shutdown(self) -> None:
        if self._backend is not None:
            for staging in self._staging.values():
                self._unregister(staging)
            self._backend.close()
            self._backend = None

    def _keys(self, transfer: BlockLoadBatch | StoreBatch, rows: Iterable[int]) -> list[str]:
        return [
            self._keyspace.key(self._rank, transfer.group_ids[row], transfer.block_hashes[row])
            for row in rows
        ]

    def _rows_by_group(self, transfer: BlockLoadBatch | StoreBatch) -> dict[int, list[int]]:
        rows: dict[int, list[int]] = {}
        for row, group_id in enumerate(transfer.group_ids):
            rows.setdefault(group_id, []).append(row)
        return rows

    def _load(self, transfer: BlockLoadBatch | StoreBatch) -> set[int]:
        """Load every object of the transfer; returns the block ids that failed."""
        failed: set[int] = set()
        for group_id, rows in self._rows_by_group(transfer).items():
            block_ids = [transfer.block_ids[row] for row in rows]
            copier = self._copiers.get(group_id)
            if copier is None or self._store is None:
                failed.update(block_ids)
                continue
            staging = self._staging_rows(group_id, copier, len(rows))
            statuses = self._read_objects(self._keys(transfer, rows), staging)
            good = [index for index, status in enumerate(statuses) if status is LoadStatus.HIT]
            for status in statuses:
                if status is not LoadStatus.HIT:
                    self.counters.count_load_failure(status)
            failed.update(block_ids[index] for index, status in enumerate(statuses)
                          if status is not LoadStatus.HIT)
            if len(good) == len(block_ids):
                copier.scatter(block_ids, staging)
            elif good:  # rare: only the objects that loaded intact reach the KV cache
                index = torch.tensor(good, dtype=torch.long)
                copier.scatter([block_ids[i] for i in good], staging.index_select(0, index))
            self.counters.loaded_blocks += len(good)
            self.counters.loaded_bytes += len(good) * copier.object_bytes
        if failed:
            logger.warning(
                "umbp load for request %s: %d of %d blocks failed; vLLM recomputes them",
                transfer.request_id, len(failed), len(transfer),
            )
        return failed

    def _staging_rows(self, group_id: int, copier: BlockCopier, rows: int) -> torch.Tensor:
        """A reused host buffer: fresh memory costs a page fault per 4 KiB, which
        is slower than the copy itself."""
        staging = self._staging.get(group_id)
        if staging is None or staging.shape[0] < rows:
            capacity = max(rows, 2 * (0 if staging is None else staging.shape[0]))
            if staging is not None:
                self._unregister(staging)
            staging = allocate_staging(capacity, copier.object_bytes, copier.device)
            self._register(staging)
            self._staging[group_id] = staging
        return staging[:rows]

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

    def _read_objects(
        self, keys: Sequence[str], staging: torch.Tensor
    ) -> tuple[LoadStatus, ...]:
        assert self._store is not None
        rows = staging.numpy()
        try:
            return self._store.get_batch_into(keys, [rows[i] for i in range(len(keys))])
        except Exception as error:  # the store failing must never fail the request
            logger.warning("umbp load failed: %s", error)
            return tuple(LoadStatus.UNAVAILABLE for _ in keys)

    def _store_objects(self, transfer: BlockLoadBatch | StoreBatch) -> set[tuple[int, bytes]]:
        """Store every object of the transfer; returns the identities that failed."""
        failed: set[tuple[int, bytes]] = set()
        for group_id, rows in self._rows_by_group(transfer).items():
            identities = [(group_id, transfer.block_hashes[row]) for row in rows]
            copier = self._copiers.get(group_id)
            if copier is None or self._store is None:
                failed.update(identities)
                continue
            block_ids = [transfer.block_ids[row] for row in rows]
            staging = self._staging_rows(group_id, copier, len(rows))
            copier.gather(block_ids, staging)
            payload = staging.numpy()
            try:
                stored = self._store.put_batch(
                    self._keys(transfer, rows), [payload[i] for i in range(len(rows))]
                )
            except Exception as error:
                logger.warning("umbp store failed: %s", error)
                stored = tuple(False for _ in rows)
            failed.update(identity for identity, ok in zip(identities, stored) if not ok)
            written = sum(stored)
            self.counters.stored_blocks += written
            self.counters.stored_bytes += written * copier.object_bytes
            self.counters.store_failures += len(rows) - written
        return failed


def auto_page_bytes(object_sizes: Sequence[int]) -> int:
    """One page per object of the smallest group, rounded up to 4 KiB: its objects
    waste no page space, larger groups' objects span several pages."""
    smallest = min(object_sizes) if object_sizes else 256 * 1024
    return max(4096, -(-smallest // 4096) * 4096)
