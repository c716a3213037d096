"""Sleep mode (vLLM 0.33's ``unregister_kv_caches`` / ``restore_kv_caches``):
the pool survives a sleep intact, nothing touches the KV memory while it is
released, and after wake-up loads land in the KV tensors as they are then, never
at an address from before the sleep.

Driven through vLLM's real scheduler and umbp's two connector roles
(``vllm_driver``); on 0.32 vLLM never calls these hooks, the behaviour is the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.vllm_driver import Driver

pytestmark = pytest.mark.vllm_versions

BLOCK = 32


@pytest.fixture
def driver(model_dir: Path) -> Iterator[Driver]:
    driver = Driver(model_dir, extra={"load_async": False})
    yield driver
    driver.close()


def prompt(blocks: int, seed: int = 3) -> list[int]:
    return [(seed * 17 + i * 11) % 500 + 1 for i in range(blocks * BLOCK + 3)]


def worker_counters(driver: Driver) -> Any:
    return driver.worker.worker.counters


def test_umbp_declares_sleep_mode_support() -> None:
    import umbp

    assert umbp.UMBPStoreConnector.supports_sleep_mode(None) is True


def test_restore_with_new_tensors_loads_into_them(driver: Driver) -> None:
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    old = dict(driver.kv)
    old_bytes = {name: tensor.clone() for name, tensor in old.items()}

    driver.worker.unregister_kv_caches()
    driver.worker.unregister_kv_caches()  # idempotent
    # The engine's KV tensors after wake-up: other memory, other addresses.
    driver.kv.update(driver.new_kv_tensors())
    assert all(driver.kv[n].data_ptr() != old[n].data_ptr() for n in old)
    driver.worker.restore_kv_caches()
    driver.worker.restore_kv_caches()  # idempotent

    driver.add("b", tokens, max_tokens=3)
    record = driver.step()
    table = driver.block_ids("b")[0]
    assert sorted(record.loads["b"]) == sorted((0, b) for b in table[:4])
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    # Nothing was written through a pointer from before the sleep.
    for name, tensor in old.items():
        assert torch.equal(tensor, old_bytes[name])


def test_nothing_moves_while_asleep_and_the_pool_survives(driver: Driver) -> None:
    tokens = prompt(3)
    driver.fill_pool("a", tokens)
    stored_before = worker_counters(driver).stored_blocks
    driver.worker.unregister_kv_caches()

    # A hit while asleep: the load reports its blocks failed, vLLM recomputes.
    driver.add("b", tokens, max_tokens=3)
    first = driver.step()
    assert first.loads.get("b", []) == []
    assert len(first.kv_output.invalid_block_ids) == 3
    assert worker_counters(driver).loaded_blocks == 0
    # A prompt that is not in the pool: its store stores nothing.
    other = prompt(2, seed=9)
    driver.add("c", other)
    driver.run(["b", "c"])
    driver.drain()
    assert worker_counters(driver).stored_blocks == stored_before
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    published = {h for e in driver.stored_events() for h in e.block_hashes}
    assert not published & {maybe_convert_block_hash(bytes(h))
                            for h in driver.requests["c"].block_hashes}

    driver.worker.restore_kv_caches()
    assert driver.scheduler.reset_prefix_cache()
    driver.add("d", tokens, max_tokens=3)
    driver.step()
    assert driver.assert_blocks_hold("d", tokens, range(3)) == 3 * 2
    driver.run(["d"])
    assert driver.cached_tokens("d") == 3 * BLOCK
    # What was asked to be stored while asleep is not in the pool.
    driver.add("e", other)
    driver.run(["e"])
    assert driver.cached_tokens("e") == 0


def test_restore_with_other_shapes_is_refused(driver: Driver) -> None:
    driver.worker.unregister_kv_caches()
    smaller = {name: tensor[:, :1] for name, tensor in driver.new_kv_tensors().items()}
    with pytest.raises(RuntimeError, match="other object sizes"):
        driver.worker.worker.restore_kv_caches(smaller)
