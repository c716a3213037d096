"""umbp's KV-connector stats reach Prometheus as ``umbp_*`` counters with vLLM's labels."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from umbp.runtime.contract import LoadStatus
from umbp.shell.connector import UMBPStoreConnector
from umbp.shell.scheduler import SchedulerCounters
from umbp.shell.stats import COUNTER_DOCS, GAUGE_DOCS, LOAD_FAILURE_REASONS, flat_counters
from umbp.shell.worker import WorkerCounters

LABELS = ["model_name", "engine"]


def _metric_types(registry: CollectorRegistry) -> dict[type[Any], type[Any]]:
    class RegisteredCounter(Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    class RegisteredGauge(Gauge):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    return {Gauge: RegisteredGauge, Counter: RegisteredCounter, Histogram: Histogram}


def _metrics(registry: CollectorRegistry) -> Any:
    config = SimpleNamespace(kv_transfer_config=None)
    return UMBPStoreConnector.build_prom_metrics(
        config, _metric_types(registry), LABELS, {0: ["m", "0"], 1: ["m", "1"]}
    )


def test_every_counter_has_a_metric() -> None:
    keys = {f"worker_{k}" for k in flat_counters(WorkerCounters())}
    keys |= {f"scheduler_{k}" for k in flat_counters(SchedulerCounters())}
    assert keys == set(COUNTER_DOCS) | set(GAUGE_DOCS)
    assert not set(COUNTER_DOCS) & set(GAUGE_DOCS)
    assert set(LOAD_FAILURE_REASONS) == {s.name.lower() for s in LoadStatus if s is not LoadStatus.HIT}


def test_observe_adds_deltas_per_engine_with_vllm_labels() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    metrics.observe({"worker_loaded_blocks": 3.0, "scheduler_hit_tokens": 96.0}, engine_idx=0)
    metrics.observe({"worker_loaded_blocks": 2.0, "worker_load_failures_corrupt": 1.0}, 0)
    metrics.observe({"worker_loaded_blocks": 7.0, "unknown_key": 5.0}, engine_idx=1)

    def value(name: str, engine: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": engine, **extra})

    assert value("umbp_worker_loaded_blocks_total", "0") == 5.0
    assert value("umbp_worker_loaded_blocks_total", "1") == 7.0
    assert value("umbp_scheduler_hit_tokens_total", "0") == 96.0
    assert value("umbp_worker_load_failures_total", "0", reason="corrupt") == 1.0
    assert value("umbp_worker_load_failures_total", "0", reason="missing") == 0.0
    assert value("umbp_worker_stored_blocks_total", "1") == 0.0


def test_pool_levels_follow_their_deltas_up_and_down() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    metrics.observe({"worker_pool_used_bytes": 4096.0, "worker_pool_objects": 2.0}, 0)
    metrics.observe({"worker_pool_used_bytes": -1024.0, "worker_pool_objects": -1.0}, 0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("umbp_worker_pool_used_bytes", labels) == 3072.0
    assert registry.get_sample_value("umbp_worker_pool_objects", labels) == 1.0


def test_stores_skipped_as_resident_reach_prometheus_apart_from_bytes_written() -> None:
    registry = CollectorRegistry()
    metrics = _metrics(registry)
    counters = SchedulerCounters(planned_store_blocks=3, store_skipped_resident_blocks=10,
                                 residency_lookups=1)
    metrics.observe({f"scheduler_{k}": v for k, v in flat_counters(counters).items()}, 0)
    metrics.observe({"worker_stored_blocks": 3.0, "worker_stored_bytes": 3 * 32768.0}, 0)
    labels = {"model_name": "m", "engine": "0"}
    sample = registry.get_sample_value
    assert sample("umbp_scheduler_store_skipped_resident_blocks_total", labels) == 10.0
    assert sample("umbp_scheduler_residency_lookups_total", labels) == 1.0
    assert sample("umbp_scheduler_planned_store_blocks_total", labels) == 3.0
    assert sample("umbp_worker_stored_bytes_total", labels) == 3 * 32768.0
