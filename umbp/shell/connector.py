"""``UMBPStoreConnector``: the class vLLM loads
(``kv_connector_module_path: "umbp"``). A thin facade: the scheduler role and
the worker role live in their own modules; this class only routes vLLM's hooks
to them."""

from __future__ import annotations

import logging
from typing import Any

from returns.result import Failure, Success
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from umbp.core.config import ConnectorConfig, format_config_errors, parse_connector_config
from umbp.core.support import Support, check_support
from umbp.gpu.device import Device
from umbp.shell import vllm_compat
from umbp.shell.logs import route_to_vllm_logging
from umbp.shell.metadata import UMBPConnectorMetadata, UMBPHandshake
from umbp.shell.scheduler import UMBPScheduler
from umbp.shell.stats import StatsDelta, UMBPConnectorStats, UMBPPromMetrics
from umbp.shell.worker import UMBPWorker

logger = logging.getLogger("umbp")
route_to_vllm_logging()  # vLLM configured its logging when it was imported above


def connector_config(vllm_config: Any) -> ConnectorConfig:
    """The validated options, or a ValueError that names every bad entry."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    parsed = parse_connector_config(extra)
    if isinstance(parsed, Failure):
        raise ValueError(format_config_errors(parsed.failure()))  # noqa: TRY004 - a Result
    return parsed.unwrap()


def engine_support(vllm_config: Any, kv_cache_config: Any) -> Support:
    """Whether umbp serves this engine; a ValueError saying what to change if the
    set-up is unsupported (both roles check, so every process fails alike)."""
    decision = check_support(vllm_compat.support_inputs(vllm_config, kv_cache_config))
    if isinstance(decision, Failure):
        raise ValueError(decision.failure())  # noqa: TRY004 - a Result
    support: Support = decision.unwrap()
    return support


def _recompute_failed_loads(vllm_config: Any) -> None:
    """umbp is a cache: a failed load must cost a recompute, never the request."""
    transfer = vllm_config.kv_transfer_config
    if transfer.kv_load_failure_policy != "recompute":
        logger.info("umbp sets kv_load_failure_policy=recompute: a failed load is recomputed")
        transfer.kv_load_failure_policy = "recompute"


class UMBPStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None, *,
        device: Device | None = None,
    ) -> None:
        """``device``: what the worker's copies run on; vLLM never passes it (the KV
        tensors decide: :func:`umbp.gpu.device.device_for`). The conformance harness
        passes its recording fake of a GPU."""
        super().__init__(vllm_config, role, kv_cache_config)
        config = connector_config(vllm_config)
        support = engine_support(vllm_config, kv_cache_config)
        if support.warning is not None:  # once per engine: the scheduler's process
            log = logger.warning if role == KVConnectorRole.SCHEDULER else logger.debug
            log("%s", support.warning)
        self._scheduler: UMBPScheduler | None = None
        self._worker: UMBPWorker | None = None
        self._stats = StatsDelta("worker_" if role == KVConnectorRole.WORKER else "scheduler_")
        if role == KVConnectorRole.SCHEDULER:
            _recompute_failed_loads(vllm_config)
            self._scheduler = UMBPScheduler(
                vllm_config, kv_cache_config, config, active=support.active
            )
        else:
            self._worker = UMBPWorker(vllm_config, kv_cache_config, config,
                                      active=support.active, device=device)

    @property
    def scheduler(self) -> UMBPScheduler:
        assert self._scheduler is not None, "scheduler hook called on a worker-role connector"
        return self._scheduler

    @property
    def worker(self) -> UMBPWorker:
        assert self._worker is not None, "worker hook called on a scheduler-role connector"
        return self._worker

    # -- worker role ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Synchronous loads (``load_async: false``) are waited for layer by layer in
        ``wait_for_layer_load``, which a full CUDA graph's replay never calls: vLLM
        then captures piecewise graphs, whose attention runs eagerly. Asynchronous
        loads need no layer hook; unset, loads are asynchronous wherever KV is on a
        GPU (``restores_layer_by_layer``)."""
        parsed = parse_connector_config(dict(extra_config or {}))
        return isinstance(parsed, Success) and parsed.unwrap().load_async is False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33: the worker follows sleep mode's KV cache remap."""
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def get_handshake_metadata(self) -> UMBPHandshake | None:
        return None if self._worker is None else self._worker.handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole blocks are handed to the store thread in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # vLLM 0.32 and 0.33 ask this (not get_finished, whose two sets cannot carry
        # request-level failures). The worker decided which failures go here.
        finished, failed = self.worker.take_transfer_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_error_blocks()

    def get_kv_connector_stats(self) -> UMBPConnectorStats | None:
        if self._worker is not None:
            self._worker.refresh_pool_counters()
            return self._stats.take(self._worker.counters)
        return self._stats.take(self.scheduler.counters)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UMBPConnectorStats:
        return UMBPConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> UMBPPromMetrics:
        return UMBPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_worker_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A store in flight reads blocks the scheduler keeps pinned until it is
        # reported, so a preempted request's blocks are never reused under it.
        return None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    def _meta(self) -> UMBPConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UMBPConnectorMetadata)
        return meta

    # -- scheduler role -----------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.scheduler.bind_workers(
            {rank: meta for rank, meta in metadata.items() if isinstance(meta, UMBPHandshake)}
        )

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.scheduler.bind_workers(
            {index: meta for index, meta in enumerate(metadata.values())
             if isinstance(meta, UMBPHandshake)}
        )

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.scheduler.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def register_finished_partial_tail(
        self, request: Any, block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return self.scheduler.register_finished_partial_tail(
            request, block_ids, partial_tail_offloads
        )

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def take_events(self) -> list[Any]:
        return [] if self._scheduler is None else self._scheduler.take_events()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache()
