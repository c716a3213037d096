"""Counters reach vLLM's KV-connector stats as deltas that add up across workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from umbp.core.loads.outcomes import LoadStatus
from umbp.runtime.pool import SlabPool
from umbp.shell.stats import PoolFigures, StatsDelta, UMBPConnectorStats, WorkerCounters


@dataclass
class _Counters:
    loaded_blocks: int = 0
    load_failures: dict[str, int] = field(default_factory=dict)


def test_each_report_carries_only_what_changed_since_the_last() -> None:
    counters = _Counters()
    delta = StatsDelta("worker_")
    assert delta.take(counters) is None
    counters.loaded_blocks = 5
    counters.load_failures["corrupt"] = 1
    first = delta.take(counters)
    assert first is not None
    assert first.data == {"worker_loaded_blocks": 5.0, "worker_load_failures_corrupt": 1.0}
    counters.loaded_blocks = 7
    second = delta.take(counters)
    assert second is not None and second.data == {"worker_loaded_blocks": 2.0}
    assert delta.take(counters) is None


def test_reports_of_several_workers_add_up() -> None:
    total = UMBPConnectorStats(data={"worker_loaded_blocks": 2.0})
    total.aggregate(UMBPConnectorStats(data={"worker_loaded_blocks": 3.0, "worker_stored_blocks": 1.0}))
    assert total.reduce() == {"worker_loaded_blocks": 5.0, "worker_stored_blocks": 1.0}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()


def test_load_failures_are_counted_by_kind_under_the_status_value() -> None:
    counters = WorkerCounters()
    counters.count_load_failures([LoadStatus.CORRUPT, LoadStatus.MISSING, LoadStatus.CORRUPT])
    assert counters.load_failures == {"corrupt": 2, "missing": 1}
    first = StatsDelta("worker_").take(counters)
    assert first is not None
    assert first.data == {"worker_load_failures_corrupt": 2.0, "worker_load_failures_missing": 1.0}


def test_pool_figures_are_read_from_the_store_at_most_once_per_interval() -> None:
    pool = SlabPool(1 << 20, page_bytes=4096)
    counters = WorkerCounters()
    figures = PoolFigures()
    assert pool.put_batch(["k"], [memoryview(bytes(5000))]) == (True,)
    assert figures.due()
    figures.read(pool, counters)
    assert (counters.pool_objects, counters.pool_used_bytes) == (1, 2 * 4096)
    assert pool.put_batch(["j"], [memoryview(bytes(10))]) == (True,)
    assert not figures.due()  # within the interval: the last figures stay
    assert counters.pool_objects == 1
    pool.close()


def test_the_store_is_asked_for_its_figures_off_the_model_thread(make_driver: Any) -> None:
    """vLLM asks for stats on the model thread every step; a store's ``stats`` may wait
    for a lock a long put holds (Mooncake, MORI) or for a stalled server: it is asked on
    the store I/O lane, and the step reads counters only."""
    import threading

    driver = make_driver()
    worker = driver.worker.worker
    pool = worker.pool
    asked_on: list[str] = []
    gate = threading.Event()
    original = pool.stats

    def slow_stats() -> Any:
        asked_on.append(threading.current_thread().name)
        gate.wait(10.0)
        return original()

    pool.stats = slow_stats  # type: ignore[method-assign]
    try:
        driver.worker.get_kv_connector_stats()  # returns while stats() is blocked
        assert worker._store_io.drain(0.05) is False  # the read still waits on the lane
    finally:
        gate.set()
    assert worker._store_io.drain(10.0)
    assert asked_on == ["umbp-store-io"]
    assert worker.counters.pool_objects == 0
