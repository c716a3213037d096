"""Properties of one request's life in the scheduler role.

The first group states rules of ``umbp.core.requests`` (and the lookup, store and load rules it sequences) for any input.
The last property drives the real ``UMBPScheduler`` (and a real worker) through
vLLM's real ``Scheduler`` on generated workloads: what it restores is byte-exact,
every full prompt block it was given can be restored later, and every pin it took
in vLLM's block pool is released.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from tests.property.strategies import (
    block_tables,
    one_group_load,
    request_hashes,
    single_group_geometries,
)
from umbp.core.geometry import CacheGeometry
from umbp.core.loads.failures import (
    SyncLoads,
    after_failed_load,
    loads_in_reach,
    stores_over_sync_loads,
    sync_loads_of,
)
from umbp.core.lookup.admission import LookupAction, LookupProgress, next_lookup_action
from umbp.core.lookup.guards import LookupSkip
from umbp.core.lookup.windows import LoadSpec
from umbp.core.plans import plan_block_ids
from umbp.core.requests import RequestLifecycle, StepLoads, after_allocation, take_step_loads
from umbp.core.stores.acks import StoreEvent, StoreEventResult, acknowledge_reports
from umbp.core.stores.tracking import StoreTracker
from umbp.core.stores.windows import (
    cached_request_store_window,
    cached_request_stores,
    new_request_store_window,
)

# ----------------------------------------------------------------- lookup steps


@given(
    st.one_of(st.none(), st.sampled_from(list(LookupSkip))),
    st.sampled_from(list(LookupProgress)),
    st.booleans(),
)
def test_a_skip_wins_and_a_running_lookup_is_waited_for(
    skip: LookupSkip | None, progress: LookupProgress, lookup_async: bool
) -> None:
    action = next_lookup_action(skip, progress, lookup_async)
    if skip is not None:
        assert action is LookupAction.ANSWER_NOTHING
    elif progress is LookupProgress.RUNNING:
        assert action is LookupAction.WAIT
    elif progress is LookupProgress.ANSWERED:
        assert action is LookupAction.READ_ANSWER
    else:
        assert action is (LookupAction.SUBMIT if lookup_async else LookupAction.LOOKUP_NOW)


# ------------------------------------------------------------------- allocation


@st.composite
def allocations(draw: st.DrawFn) -> tuple[CacheGeometry, LoadSpec | None, tuple[tuple[int, ...], ...], tuple[bytes, ...], int]:
    """A single-group match (or none) and any external count vLLM may allocate."""
    geometry = draw(single_group_geometries())
    block = geometry.block_size
    num_blocks = draw(st.integers(1, 8))
    num_tokens = num_blocks * block + draw(st.integers(1, block))
    hashes = draw(request_hashes(num_tokens // geometry.hash_block_size))
    table = draw(block_tables(geometry, num_tokens))
    local = draw(st.integers(0, num_blocks - 1)) * block
    end = draw(st.integers(local + 1, num_tokens - 1))
    spec = draw(st.one_of(st.none(), st.just(LoadSpec(local, end))))
    external = draw(st.integers(-1, num_tokens))
    return geometry, spec, table, hashes, external


@given(allocations())
def test_an_allocation_never_raises_and_loads_only_what_vllm_allocated(
    case: tuple[CacheGeometry, LoadSpec | None, tuple[tuple[int, ...], ...], tuple[bytes, ...], int],
) -> None:
    """Whatever vLLM allocates, umbp plans a load inside the allocated window, or
    names blocks of the table to recompute, or (no external tokens) nothing."""
    geometry, spec, table, hashes, external = case
    state = RequestLifecycle(load_spec=spec, load_async=True)
    after, outcome = after_allocation(state, "r", geometry, table, hashes, external)
    assert after.tracker is not None and after.tracker.block_table == table
    if external <= 0:
        assert outcome is None
        assert after.load is None and after.load_spec is None and not after.load_async
        return
    match outcome:
        case Success(batch):
            assert spec is not None and external <= spec.num_tokens_to_load
            first = spec.local_tokens // geometry.block_size
            last = -(-(spec.local_tokens + external) // geometry.block_size)
            assert set(plan_block_ids(batch)) <= set(table[0][first:last])
            assert after.load == batch
        case Failure(unplanned):
            assert set(unplanned.block_ids) <= set(table[0])
            assert after.unplanned_load == unplanned.block_ids
        case _:
            raise AssertionError(f"no outcome for {external} external tokens")


# ------------------------------------------------------------------- step loads


@st.composite
def step_states(draw: st.DrawFn) -> dict[str, RequestLifecycle]:
    states = {}
    for index in range(draw(st.integers(0, 6))):
        request_id = f"r{index}"
        load = draw(st.one_of(st.none(), st.just(one_group_load(request_id, (index,), (b"h",)))))
        unplanned = draw(st.one_of(st.none(), st.just((index + 100,))))
        states[request_id] = RequestLifecycle(
            load_spec=draw(st.one_of(st.none(), st.just(LoadSpec(0, 4)))),
            load_async=draw(st.booleans()), load=load, unplanned_load=unplanned,
            tracker=draw(st.one_of(st.none(), st.just(StoreTracker(4)))),
        )
    return states


@given(step_states())
def test_every_planned_load_goes_out_once(states: dict[str, RequestLifecycle]) -> None:
    step = take_step_loads(states)
    loading = {r for r, s in states.items() if s.load is not None or s.unplanned_load is not None}
    assert [batch.request_id for batch in step.loads] == [
        r for r, s in states.items() if s.load is not None
    ]
    assert dict(step.unplanned) == {
        r: s.unplanned_load for r, s in states.items() if s.unplanned_load is not None
    }
    assert step.async_loads == {r for r in loading if states[r].load_async}
    assert set(step.states) == loading
    merged = {**states, **step.states}
    again = take_step_loads(merged)
    assert not again.loads and not again.unplanned and not again.async_loads
    for request_id, state in step.states.items():  # the spec went with the load
        assert state.load_spec is None and state.tracker == states[request_id].tracker


# ------------------------------------------------------------------ store windows


@st.composite
def chunked_prefills(draw: st.DrawFn) -> tuple[CacheGeometry, int, int, list[int], bool]:
    geometry = draw(single_group_geometries())
    prompt = draw(st.integers(geometry.block_size, 10 * geometry.block_size))
    cached = draw(st.integers(0, prompt - 1)) // geometry.block_size * geometry.block_size
    chunks = draw(st.lists(st.integers(1, 3 * geometry.block_size), min_size=1, max_size=12))
    return geometry, prompt, cached, chunks, draw(st.booleans())


@given(chunked_prefills())
def test_chunks_make_every_full_block_a_candidate_exactly_once(
    case: tuple[CacheGeometry, int, int, list[int], bool],
) -> None:
    """Chunked prefill then decode through the store-window entry points the
    shell's ``StoreStep`` calls, in its order (``new_request_store_window`` on the
    first step, then ``cached_request_stores`` -> ``cached_request_store_window``),
    with vLLM's current block table each step as vLLM 0.32/0.33 hand it over; the
    chunk sizes stand for vLLM's scheduling. Each full hashed block is a store
    candidate once and in order (what came from a cache too: the residency check
    decides those), and without ``save_decode_cache`` nothing after the prompt.
    Through vLLM's real Scheduler: test_scheduler_lifecycle.py's chunked-prefill
    tests and :func:`test_the_scheduler_restores_exact_bytes_and_releases_every_pin`."""
    geometry, prompt, cached, chunks, save_decode = case
    block = geometry.block_size
    total_tokens = prompt + 4 * block
    table = (tuple(range(1, total_tokens // block + 2)),)
    hashes = tuple(i.to_bytes(4, "big") for i in range(total_tokens // geometry.hash_block_size))
    first = min(chunks[0], prompt - cached)  # a new request schedules only its prompt
    state, window = new_request_store_window(
        RequestLifecycle(tracker=StoreTracker().with_blocks_replaced(table)), geometry,
        frozenset(), cached, first, table, len(hashes),
    )
    assert window.cached_tokens == cached
    seen = [i for _, r in window.ranges for i in r]
    computed = cached + first
    for chunk in chunks[1:]:
        scheduled = min(chunk, total_tokens - computed)
        state, stores = cached_request_stores(state, computed, False, prompt, save_decode)
        if not stores:
            assert not save_decode and computed >= prompt
        else:
            state, window = cached_request_store_window(
                state, geometry, frozenset(), computed, scheduled, table, prompt,
                len(hashes), save_decode,
            )
            seen += [i for _, r in window.ranges for i in r]
        computed += scheduled
    limit = computed if save_decode else min(computed, prompt)
    assert sorted(seen) == seen and len(set(seen)) == len(seen)
    assert seen == list(range(limit // block))


# ------------------------------------------------------------ failed loads


@given(
    st.integers(0, 40), st.lists(st.integers(1, 60), max_size=12, unique=True),
    st.sets(st.integers(0, 80), max_size=6), st.booleans(), st.integers(0, 2000),
    st.sampled_from([16, 32]), st.integers(0, 200),
)
def test_only_a_request_vllm_failed_moves_its_watermark_and_only_back(
    saved_blocks: int, table: list[int], failed: set[int], request_failed: bool,
    num_computed: int, hash_block_size: int, cached: int,
) -> None:
    tracker = StoreTracker(saved_blocks * hash_block_size, (tuple(table),), cached)
    state = RequestLifecycle(tracker=tracker)
    after = after_failed_load(
        state, failed, request_failed, num_computed, hash_block_size
    )
    assert after.tracker is not None
    saved = after.tracker.saved_tokens
    # The table and what came from a cache are vLLM's facts: never touched.
    assert (after.tracker.block_table, after.tracker.cached_tokens) == (tracker.block_table, cached)
    if not request_failed and not failed & set(table):
        assert after is state
    else:
        recompute_from = num_computed - num_computed % hash_block_size
        assert saved == min(tracker.saved_tokens, recompute_from)
        # Every token vLLM recomputes is at or past the watermark: a candidate again.
        assert saved <= num_computed and saved % hash_block_size == 0
    assert saved <= tracker.saved_tokens
    untracked = RequestLifecycle()
    assert after_failed_load(untracked, failed, True, num_computed, hash_block_size) is untracked


@given(st.data())
def test_a_storing_request_depends_on_exactly_the_sync_loads_whose_blocks_it_holds(
    data: st.DataObject,
) -> None:
    ids = ["r0", "r1", "r2", "r3"]
    blocks = st.lists(st.integers(1, 30), max_size=5, unique=True)
    loads = [
        one_group_load(r, b, [bytes([i]) for i in range(len(b))])
        for r, b in data.draw(st.dictionaries(st.sampled_from(ids), blocks, max_size=3)).items()
    ]
    unplanned = {r: tuple(b) for r, b in
                 data.draw(st.dictionaries(st.sampled_from(ids), blocks, max_size=2)).items()
                 if r not in {load.request_id for load in loads}}
    async_loads = data.draw(st.frozensets(st.sampled_from(ids)))
    storing = {r: (tuple(t),) for r, t in
               data.draw(st.dictionaries(st.sampled_from(ids + ["s"]), blocks)).items()}
    step = StepLoads(tuple(loads), unplanned, async_loads, {})
    # What the scheduler keeps of a step: the synchronous loads only.
    kept = sync_loads_of(step)
    assert [load.request_id for load in kept.loads] == [
        load.request_id for load in loads if load.request_id not in async_loads]
    assert kept.unplanned == {r: b for r, b in unplanned.items() if r not in async_loads}
    got = stores_over_sync_loads(kept, storing)
    sync_blocks = [(load.request_id, set(plan_block_ids(load))) for load in loads
                   if load.request_id not in async_loads]
    sync_blocks += [(r, set(b)) for r, b in unplanned.items() if r not in async_loads]
    expected = {
        r: frozenset(loader for loader, filled in sync_blocks if filled & set(table[0]))
        for r, table in storing.items()
    }
    assert got == {r: deps for r, deps in expected.items() if deps}


LOADING = ["r0", "r1", "r2", "r3"]
BLOCKS = st.lists(st.integers(1, 12), max_size=5, unique=True)


@st.composite
def step_loads(draw: st.DrawFn) -> StepLoads:
    """One step's loads as take_step_loads returns them: planned, unplanned (a
    request is one or the other) and which of them run asynchronously."""
    loads = tuple(
        one_group_load(r, b, [bytes([i]) for i in range(len(b))])
        for r, b in draw(st.dictionaries(st.sampled_from(LOADING), BLOCKS, max_size=3)).items()
    )
    unplanned = {r: tuple(b) for r, b in
                 draw(st.dictionaries(st.sampled_from(LOADING), BLOCKS, max_size=2)).items()
                 if r not in {load.request_id for load in loads}}
    return StepLoads(loads, unplanned, draw(st.frozensets(st.sampled_from(LOADING))), {})


@given(step_loads(), step_loads(), st.dictionaries(st.sampled_from([*LOADING, "s"]), BLOCKS))
# One request's loads in both steps: unplanned twice, or synchronous then asynchronous.
@example(StepLoads((), {"r0": (1,)}, frozenset(), {}),
         StepLoads((), {"r0": (2,)}, frozenset(), {}), {"s": [1]})
@example(StepLoads((one_group_load("r0", (1,), (b"a",)),), {}, frozenset(), {}),
         StepLoads((one_group_load("r0", (2,), (b"b",)),), {}, frozenset({"r0"}), {}),
         {"s": [1]})
def test_a_steps_stores_depend_on_its_own_and_the_last_steps_sync_loads_exactly(
    last: StepLoads, step: StepLoads, tables: dict[str, list[int]],
) -> None:
    """What the scheduler tells the workers: a store depends on a synchronous load
    of this step or of the last one (whose failure vLLM's async scheduling may not
    have reported yet), exactly as if each step were asked alone; and the tables
    are skipped (None) exactly when neither step has a synchronous load."""
    previous, current = sync_loads_of(last), sync_loads_of(step)
    storing = {r: (tuple(t),) for r, t in tables.items()}

    def depends(loads: SyncLoads) -> dict[str, frozenset[str]]:
        return stores_over_sync_loads(loads, storing)

    alone = [depends(previous), depends(current)]
    expected = {r: deps for r in storing
                if (deps := frozenset().union(*(d.get(r, frozenset()) for d in alone)))}
    in_reach = loads_in_reach(previous, current)
    sync_now = [r for r in (*(b.request_id for b in step.loads), *step.unplanned)
                if r not in step.async_loads]
    assert (in_reach is None) == (not previous.loads and not previous.unplanned and not sync_now)
    if in_reach is None:
        assert expected == {}
    else:
        assert depends(in_reach) == expected


@st.composite
def failed_sync_loads(draw: st.DrawFn) -> tuple[CacheGeometry, int, int, int, list[int]]:
    """A prompt with a hit window of ``external`` tokens loaded synchronously in
    its first step, one of whose blocks fails; then vLLM's recompute in chunks."""
    geometry = draw(single_group_geometries())
    block = geometry.block_size
    external_blocks = draw(st.integers(1, 8))
    prompt = draw(st.integers(external_blocks * block + 1, (external_blocks + 6) * block))
    failed_index = draw(st.integers(0, external_blocks - 1))
    chunks = draw(st.lists(st.integers(1, 3 * block), min_size=1, max_size=12))
    return geometry, prompt, external_blocks * block, failed_index, chunks


@given(failed_sync_loads())
def test_a_failed_sync_load_makes_every_recomputed_block_a_candidate_again(
    case: tuple[CacheGeometry, int, int, int, list[int]],
) -> None:
    """The scheduler's sequence around a failed synchronous load: the first step
    plans stores from its window, vLLM reports the failed block and cuts the
    computed tokens to it, the shell applies :func:`after_failed_load`, and the
    recompute's steps (the same, cached request) make every block from the failed
    one on a candidate again, each once and in order, and none before it."""
    geometry, prompt, external, failed_index, chunks = case
    block = geometry.block_size
    table = (tuple(range(1, prompt // block + 2)),)
    hashes = tuple(i.to_bytes(4, "big") for i in range(prompt // geometry.hash_block_size))
    first = prompt - external  # the load lands before the step's forward pass
    state, _ = new_request_store_window(
        RequestLifecycle(tracker=StoreTracker().with_blocks_replaced(table)), geometry,
        frozenset(), external, first, table, len(hashes),
    )
    computed = failed_index * block  # vLLM: truncate at the first failed block
    state = after_failed_load(
        state, {table[0][failed_index]}, False, computed, geometry.hash_block_size
    )
    seen: list[int] = []
    for chunk in chunks:
        if computed >= prompt:
            break
        scheduled = min(chunk, prompt - computed)
        state, stores = cached_request_stores(state, computed, False, prompt, False)
        assert stores
        state, window = cached_request_store_window(
            state, geometry, frozenset(), computed, scheduled, table, prompt,
            len(hashes), False,
        )
        seen += [i for _, r in window.ranges for i in r]
        computed += scheduled
    assert sorted(seen) == seen and len(set(seen)) == len(seen)
    assert seen == list(range(failed_index, computed // block))


# ------------------------------------------------------------ acknowledgements


@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_an_event_is_acknowledged_once_after_every_worker_reported(
    num_workers: int, num_events: int, data: st.DataObject
) -> None:
    events = {e: (StoreEvent(e), StoreEventResult()) for e in range(num_events)}
    reports = [(e, w) for e in range(num_events) for w in range(num_workers)]
    order = data.draw(st.permutations(reports))
    steps = data.draw(st.lists(st.integers(1, 3), min_size=len(order), max_size=len(order)))
    failed = data.draw(st.sets(st.sampled_from(reports)))
    acknowledged: list[tuple[StoreEvent, StoreEventResult]] = []
    open_events = dict(events)
    position = 0
    for size in steps:
        batch: dict[int, StoreEventResult] = {}
        for event_id, worker in order[position:position + size]:
            mine = frozenset({(worker, b"x")}) if (event_id, worker) in failed else frozenset()
            previous = batch.get(event_id, StoreEventResult())
            batch[event_id] = StoreEventResult(previous.completed_workers + 1, previous.failed | mine)
        position += size
        open_events, done = acknowledge_reports(open_events, batch, num_workers)
        acknowledged.extend(done)
        # Reports of an acknowledged event (a late duplicate) change nothing.
        assert acknowledge_reports(open_events, {e.event_id: r for e, r in done},
                                             num_workers)[1] == ()
    assert not open_events
    assert sorted(event.event_id for event, _ in acknowledged) == list(range(num_events))
    for event, result in acknowledged:
        assert result.completed_workers == num_workers
        assert result.failed == {(w, b"x") for e, w in failed if e == event.event_id}


# -------------------------------------------- the shell's sequence, through vLLM

BLOCK = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.unit.vllm_driver import write_model_config

    return write_model_config(tmp_path_factory.mktemp("tiny-llama-lifecycle"))


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, object], list[list[int]], list[list[int]]]:
    """Prompts sharing prefixes, computed once, then asked again (with or without
    a common prefix of the first round) after vLLM's own cache was emptied."""
    extra = {
        "load_async": draw(st.booleans()),
        "lookup_async": draw(st.booleans()),
    }
    base = [draw(st.integers(1, 499)) for _ in range(6 * BLOCK)]

    def prompts() -> list[list[int]]:
        out = []
        for _ in range(draw(st.integers(1, 3))):
            shared = draw(st.integers(0, 4)) * BLOCK
            own = draw(st.lists(st.integers(1, 499), min_size=1, max_size=3 * BLOCK))
            out.append(base[:shared] + own)
        return out

    return extra, prompts(), prompts()


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow])
@given(workloads(), st.sampled_from([64, 512]))
def test_the_scheduler_restores_exact_bytes_and_releases_every_pin(
    model_dir: Path,
    workload: tuple[dict[str, object], list[list[int]], list[list[int]]], batch_tokens: int,
) -> None:
    from tests.unit.vllm_driver import Driver

    extra, first, second = workload
    driver = Driver(model_dir, num_blocks=64, max_num_batched_tokens=batch_tokens,
                    extra=extra)
    try:
        _restores_exactly(driver, first, second)
    finally:
        driver.close()


def _restores_exactly(driver: object, first: list[list[int]], second: list[list[int]]) -> None:
    pool = driver.scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    checked: set[str] = set()

    def run(round_name: str, prompts: list[list[int]]) -> list[str]:
        names = [f"{round_name}{i}" for i in range(len(prompts))]
        for name, tokens in zip(names, prompts):
            driver.add(name, tokens, max_tokens=2)
        for _ in range(300):
            driver.step()
            for name, tokens in zip(names, prompts):
                request = driver.requests[name]
                # Once the prompt is computed (loaded or not), every full block
                # holds what a recompute writes.
                if name not in checked and name in driver.scheduler.requests and (
                    request.num_computed_tokens >= len(tokens)
                ):
                    full = len(tokens) // BLOCK
                    assert driver.assert_blocks_hold(name, tokens, range(full)) == 2 * full
                    checked.add(name)
            if not set(names) & set(driver.scheduler.requests):
                break
        else:
            raise AssertionError("requests did not finish")
        driver.drain()
        assert driver.scheduler.reset_prefix_cache()
        return names

    run("a", first)
    run("b", second)
    # Every pin umbp took in vLLM's pool was released, nothing leaked.
    assert pool.get_num_free_blocks() == free_at_start
    # Every full block of every prompt was stored: asked again, each restores all.
    for index, tokens in enumerate(first + second):
        name = f"again{index}"
        driver.add(name, tokens + [7], max_tokens=1)
        driver.run([name])
        assert driver.cached_tokens(name) == len(tokens) // BLOCK * BLOCK
    assert checked == {f"{r}{i}" for r, p in (("a", first), ("b", second)) for i in range(len(p))}
