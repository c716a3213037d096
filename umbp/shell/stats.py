"""umbp's counters in vLLM's KV-connector stats: workers and the scheduler report
what changed since their last report; vLLM sums the reports and logs them."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from umbp.core.loads.outcomes import LOAD_FAILURES, LoadStatus
from umbp.runtime.contract import Medium, ReportsTiers, WorkerStore

logger = logging.getLogger("umbp")

POOL_STATS_EVERY_S = 1.0


@dataclasses.dataclass(slots=True)
class WorkerCounters:
    """Counted where the copies happen, so the figures can be trusted."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_failures: dict[str, int] = dataclasses.field(default_factory=dict)
    """Failed block loads by kind, keyed by the `LoadStatus` value (plain strings:
    the counters travel as JSON and as metric names)."""
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_failures: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    # What the model thread waited for: its synchronous loads (on the host device, the
    # layers' copies; on a GPU, their checksums); and how often stores were left for a
    # later step because the in-flight budget or the staging area was full.
    load_wait_seconds: float = 0.0
    store_deferrals: int = 0
    # The pool's own figures, refreshed when stats are reported.
    pool_evictions: int = 0
    pool_used_bytes: int = 0
    pool_objects: int = 0
    pool_disk_used_bytes: int = 0
    pool_disk_objects: int = 0

    def count_load_failures(self, failures: Iterable[LoadStatus]) -> None:
        for status in failures:
            self.load_failures[status.value] = self.load_failures.get(status.value, 0) + 1


@dataclasses.dataclass
class UMBPConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PoolFigures:
    """The store's own figures in the worker's counters (in the shared modes, the
    whole store's, which other engines fill too), read at most once per
    `POOL_STATS_EVERY_S` and never on the model thread: vLLM asks every step, and
    asking a store can wait for a lock a long put holds (Mooncake, MORI) or for a
    stalled server's `io_timeout_s`. :meth:`due` says when to read again (on the
    model thread, a clock read); :meth:`read` runs on a lane. A store that cannot
    answer keeps the last figures."""

    def __init__(self) -> None:
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + POOL_STATS_EVERY_S
        return True

    def read(self, store: WorkerStore, counters: WorkerCounters) -> None:
        try:
            stats = store.stats()
        except Exception as error:  # noqa: BLE001 - stats must never fail an engine step
            logger.debug("umbp store stats unavailable: %s", error)
            return
        counters.pool_evictions = stats.evictions
        counters.pool_used_bytes = stats.used_bytes
        counters.pool_objects = stats.objects
        if isinstance(store, ReportsTiers):
            try:
                usage = store.tier_usage()
            except Exception as error:  # noqa: BLE001 - as for stats() above
                logger.debug("umbp store tier usage unavailable: %s", error)
                return
            counters.pool_disk_used_bytes, counters.pool_disk_objects = usage.get(
                Medium.DISK, (0, 0)
            )


def flat_counters(counters: Any) -> dict[str, float]:
    """A counters dataclass as flat numbers (nested dicts become name_key).

    Runs every engine step for each role: reads the fields directly rather than
    through ``dataclasses.asdict``, which deep-copies."""
    flat: dict[str, float] = {}
    for name in _field_names(type(counters)):
        value = getattr(counters, name)
        if isinstance(value, dict):
            flat.update({f"{name}_{key}": float(v) for key, v in value.items()})
        else:
            flat[name] = float(value)
    return flat


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class StatsDelta:
    """What changed in a set of counters since the previous call."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._previous: dict[str, float] = {}

    def take(self, counters: Any) -> UMBPConnectorStats | None:
        current = flat_counters(counters)
        if current == self._previous:
            return None
        delta = {
            f"{self._prefix}{name}": value - self._previous.get(name, 0.0)
            for name, value in current.items()
            if value != self._previous.get(name, 0.0)
        }
        self._previous = current
        return UMBPConnectorStats(data=delta) if delta else None


# -- Prometheus -------------------------------------------------------------------

# What the counters mean, by the key they carry in the stats (role prefix + field).
COUNTER_DOCS: dict[str, str] = {
    "worker_loaded_blocks": "KV blocks restored from the umbp pool into vLLM's KV cache",
    "worker_loaded_bytes": "bytes restored from the umbp pool",
    "worker_stored_blocks": "KV blocks copied from vLLM's KV cache into the umbp pool",
    "worker_stored_bytes": "bytes copied from vLLM's KV cache into the umbp pool",
    "worker_store_failures": "KV blocks the umbp pool did not accept",
    "worker_load_seconds": "seconds umbp's loads took, from start to verified (summed)",
    "worker_store_seconds": "seconds umbp's stores took, from submitted to stored (summed)",
    "worker_load_wait_seconds": "seconds the model thread waited for umbp's synchronous "
    "loads (on CPU their layers' copies, on a GPU their checksums)",
    "worker_store_deferrals": "steps whose queued stores waited for a later step: umbp's "
    "in-flight store budget (store_inflight_bytes) or staging area (staging_bytes) was "
    "full",
    "scheduler_lookups": "requests looked up in the umbp pool",
    "scheduler_lookup_failures": "umbp lookups that failed and counted as a miss",
    "scheduler_hit_tokens": "prompt tokens umbp offered to restore",
    "scheduler_queried_tokens": "prompt tokens looked up in umbp (beyond vLLM's own hits)",
    "scheduler_planned_load_blocks": "KV blocks umbp planned to restore",
    "scheduler_planned_store_blocks": "KV blocks umbp planned to store",
    "scheduler_store_skipped_resident_blocks": "KV blocks not stored because the umbp pool "
    "already held them (vLLM's prefix-cache hits and restored blocks, checked each step)",
    "scheduler_residency_lookups": "batched lookups (at most one per step) checking whether "
    "blocks to store are already in the umbp pool",
    "scheduler_kv_events_suppressed": "umbp KV events not published (tracking bound reached)",
    "scheduler_kv_events_published": "BlockStored/BlockRemoved events umbp published",
    "scheduler_announced_waits": "requests that waited for blocks their prefill engine "
    "announced (disaggregated prefill) to reach the pool",
    "scheduler_announced_wait_seconds": "seconds requests waited for announced blocks",
    "scheduler_announced_short": "requests that went on without every announced block "
    "(announced_wait_s passed): vLLM computed the rest",
    "scheduler_prefetch_waits": "requests whose synchronous restore waited for hits the "
    "server was bringing from its SSD tier into DRAM (prefetched at lookup)",
    "scheduler_prefetch_wait_seconds": "seconds requests waited for hits prefetched from SSD",
    "worker_pool_evictions": "objects the umbp pool evicted to make room",
}
# Levels rather than counts: their reported deltas move a Prometheus gauge up and down.
GAUGE_DOCS: dict[str, str] = {
    "worker_pool_used_bytes": "bytes of the umbp DRAM pool in use (summed over workers)",
    "worker_pool_objects": "objects held in the umbp DRAM pool (summed over workers)",
    "worker_pool_disk_used_bytes": "bytes of the umbp server's SSD tier in use "
    "(summed over workers)",
    "worker_pool_disk_objects": "objects held in the umbp server's SSD tier "
    "(summed over workers)",
}
LOAD_FAILURES_KEY = "worker_load_failures_"
LOAD_FAILURE_REASONS = tuple(status.value for status in LOAD_FAILURES)


class UMBPPromMetrics(KVConnectorPromMetrics):
    """umbp's counters as Prometheus counters ``umbp_<role>_<counter>_total`` with
    vLLM's label names (failed loads also by ``reason``). ``observe`` receives the
    summed deltas the workers and the scheduler reported."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, documentation in COUNTER_DOCS.items():
            metric = self._counter_cls(name=f"umbp_{key}", documentation=documentation,
                                       labelnames=labelnames)
            self._counters[key] = {
                engine: metric.labels(*values)
                for engine, values in per_engine_labelvalues.items()
            }
        failures = self._counter_cls(
            name="umbp_worker_load_failures",
            documentation="KV blocks whose restore failed (vLLM recomputed them), by reason",
            labelnames=[*labelnames, "reason"],
        )
        self._gauges: dict[str, dict[int, Any]] = {}
        for key, documentation in GAUGE_DOCS.items():
            gauge = self._gauge_cls(name=f"umbp_{key}", documentation=documentation,
                                    labelnames=labelnames)
            self._gauges[key] = {
                engine: gauge.labels(*values) for engine, values in per_engine_labelvalues.items()
            }
        for reason in LOAD_FAILURE_REASONS:
            self._counters[LOAD_FAILURES_KEY + reason] = {
                engine: failures.labels(*values, reason)
                for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            counter = self._counters.get(key, {}).get(engine_idx)
            if counter is not None and value > 0:
                counter.inc(value)
            gauge = self._gauges.get(key, {}).get(engine_idx)
            if gauge is not None:
                gauge.inc(value)
