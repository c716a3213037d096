"""vLLM allocating a different external token count than umbp matched, through
vLLM's real scheduler (see ``vllm_driver``).

vLLM lowers the count itself (its bounded-replay path trims external tokens to a
block boundary); here its scheduler is handed a count different from umbp's
answer, so everything after that (allocation, ``update_state_after_alloc``,
loads, failed-load recovery) is vLLM's and umbp's real code. umbp must plan the
load for what vLLM allocated, and recompute what it cannot load: never raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.test_scheduler_lifecycle import BLOCK, prompt
from tests.unit.vllm_driver import Driver

pytestmark = pytest.mark.vllm_versions


def vllm_allocates(driver: Driver, change: Callable[[int], int], times: int = 1 << 30) -> None:
    """vLLM's scheduler sees ``change(umbp's count)`` for the first ``times`` hits
    umbp reports."""
    original = driver.connector.get_num_new_matched_tokens
    left = [times]

    def answer(request: Any, local_tokens: int) -> tuple[int | None, bool]:
        external, load_async = original(request, local_tokens)
        if not external or not left[0]:
            return external, load_async
        left[0] -= 1
        return change(external), load_async

    driver.connector.get_num_new_matched_tokens = answer


@pytest.mark.parametrize("load_async", [True, False])
def test_a_lowered_external_count_loads_what_vllm_allocated(
    make_driver: Any, load_async: bool
) -> None:
    driver = make_driver(extra={"load_async": load_async})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    vllm_allocates(driver, lambda external: external - BLOCK)  # 4 blocks matched, 3 taken

    driver.add("b", tokens + [9, 9], max_tokens=4)
    records = driver.until_scheduled("b")
    table = driver.block_ids("b")[0]
    assert sorted(driver.loads_of(records, "b")) == sorted((0, b) for b in table[:3])
    driver.prefill("b")
    # Three blocks restored, the fourth computed by the forward pass: all exact.
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    driver.run(["b"])
    assert driver.cached_tokens("b") == 3 * BLOCK
    stats = driver.connector_stats()
    assert stats["worker_loaded_blocks"] == 3
    assert stats["scheduler_planned_load_blocks"] == 3
    assert not any(name.startswith("worker_load_failures") for name in stats)


@pytest.mark.parametrize("load_async", [True, False])
def test_more_external_tokens_than_umbp_matched_are_recomputed(
    make_driver: Any, load_async: bool
) -> None:
    driver = make_driver(extra={"load_async": load_async})
    tokens = prompt(6)
    driver.fill_pool("a", tokens[: 4 * BLOCK + 5])  # the pool holds 4 blocks
    # vLLM takes 5 once (asking again after the failed load, it takes umbp's 4).
    vllm_allocates(driver, lambda external: external + BLOCK, times=1)

    driver.add("b", tokens, max_tokens=4)
    driver.prefill("b")
    # The misallocated window was handed back and recomputed (a synchronous load
    # as failed blocks, an asynchronous one as a failed receive, then loaded
    # again for umbp's own count): every block holds what the forward pass writes.
    assert driver.assert_blocks_hold("b", tokens, range(6)) == 6 * 2
    loaded = driver.connector_stats().get("worker_loaded_blocks", 0)
    assert loaded == (4 if load_async else 0)
    driver.run(["b"])
    driver.drain()
