"""Properties of the worker's load outcomes (umbp.core.loads.outcomes): what a load's
statuses mean for the KV cache and for vLLM.

* Every block a load plan names is exactly one of loaded or failed; no outcome
  names a block the plan did not own; only intact (`HIT`) rows are loaded.
* A request is failed iff any of its blocks failed (the request-level rule), and
  vLLM hears of it in one form only: block ids with one cache group, the request
  id (asynchronous loads) with several; finished asynchronous loads include the
  failed ones.
* Nothing a synchronous load's failure left wrong is stored: the requests whose
  sync load failed store nothing that step, and their rows are reported not stored.
* The pool's automatic page holds one object of the smallest group exactly, on
  4 KiB pages: page = max(4 KiB, smallest object rounded up to 4 KiB). It is not
  sized for the largest object, which spans ceil(size / page) pages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from umbp.core.loads.failures import computed_over_failed_loads, still_computing_over_failures
from umbp.core.loads.outcomes import (
    LOAD_FAILURES,
    FailureReporting,
    LoadReport,
    LoadStatus,
    RequestLoadOutcome,
    failure_reporting,
    failure_unreportable,
    group_load_outcome,
    plan_load_outcome,
    report_load,
    unplanned_load_outcome,
)
from umbp.core.plans import GroupBlocks, LoadPlan, StorePlan, plan_block_ids
from umbp.core.pool_pages import (
    DEFAULT_AUTO_PAGE_BYTES,
    PAGE_ALIGN_BYTES,
    auto_page_bytes,
    pool_page_bytes,
)
from umbp.core.stores.results import failed_store_identities, stores_past_failed_loads

statuses = st.sampled_from(list(LoadStatus))


@st.composite
def load_plans(draw: st.DrawFn, request_id: str = "r") -> LoadPlan:
    """1-3 groups of 1-6 blocks each (a plan holds no empty group); block ids distinct within a group (vLLM's
    block table), possibly equal across groups."""
    groups = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True))
    next_hash = 0
    parts = []
    for group_id in groups:
        block_ids = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6, unique=True))
        hashes = tuple((next_hash + i).to_bytes(4, "big") for i in range(len(block_ids)))
        next_hash += len(block_ids)
        parts.append(GroupBlocks(group_id, 16, tuple(block_ids), hashes))
    return LoadPlan(request_id, tuple(parts))


@dataclass(frozen=True)
class ReadLoad:
    plan: LoadPlan
    answers: tuple[tuple[LoadStatus, ...] | None, ...]


@st.composite
def read_loads(draw: st.DrawFn, request_id: str = "r") -> ReadLoad:
    """A plan and what each group's read answered: a status per block, no answer
    (unreadable), or occasionally a store breaking its contract (wrong count)."""
    plan = draw(load_plans(request_id))
    answers: list[tuple[LoadStatus, ...] | None] = []
    for group in plan.groups:
        kind = draw(st.sampled_from(["statuses", "statuses", "statuses", "none", "short"]))
        if kind == "none":
            answers.append(None)
        elif kind == "short":
            size = draw(st.sampled_from([n for n in range(len(group) + 3) if n != len(group)]))
            answers.append(tuple(draw(st.lists(statuses, min_size=size, max_size=size))))
        else:
            answers.append(tuple(draw(st.lists(statuses, min_size=len(group),
                                               max_size=len(group)))))
    return ReadLoad(plan, tuple(answers))


def planned_pairs(plan: LoadPlan) -> Counter[tuple[int, int]]:
    return Counter((g.group_id, b) for g in plan.groups for b in g.block_ids)


@given(read_loads(), st.booleans())
def test_every_planned_block_is_loaded_or_failed_and_nothing_else(
    read: ReadLoad, is_async: bool
) -> None:
    outcome = plan_load_outcome(read.plan, read.answers, is_async)
    reported: Counter[tuple[int, int]] = Counter()
    for group in outcome.groups:
        assert not set(group.loaded_block_ids) & set(group.failed_block_ids)
        assert len(group.loaded_rows) == len(group.loaded_block_ids)
        assert len(group.failures) == len(group.failed_block_ids)
        assert LoadStatus.HIT not in group.failures
        reported.update((group.group_id, b) for b in group.loaded_block_ids)
        reported.update((group.group_id, b) for b in group.failed_block_ids)
    assert reported == planned_pairs(read.plan)
    assert outcome.failed_block_ids <= set(plan_block_ids(read.plan))
    assert outcome.planned_blocks == len(read.plan)


@given(read_loads())
def test_only_rows_read_intact_are_loaded_in_their_read_order(read: ReadLoad) -> None:
    outcome = plan_load_outcome(read.plan, read.answers, False)
    assert len(outcome.groups) == len(read.plan.groups)
    for planned, answer, group in zip(read.plan.groups, read.answers, outcome.groups):
        assert group.group_id == planned.group_id
        if answer is None or len(answer) != len(planned):
            # Unreadable or a broken answer: nothing is guessed, all fail.
            assert group.loaded_rows == ()
            assert set(group.failures) == {LoadStatus.UNAVAILABLE}
            assert (group.problem is not None) == (answer is not None)
            continue
        assert group.problem is None
        assert group.loaded_rows == tuple(i for i, s in enumerate(answer) if s is LoadStatus.HIT)
        assert group.loaded_block_ids == tuple(planned.block_ids[i] for i in group.loaded_rows)
        assert Counter(group.failures) == Counter(s for s in answer if s is not LoadStatus.HIT)


@given(read_loads(), st.booleans())
def test_a_request_failed_iff_any_block_failed(read: ReadLoad, is_async: bool) -> None:
    outcome = plan_load_outcome(read.plan, read.answers, is_async)
    any_block_failed = any(group.failed_block_ids for group in outcome.groups)
    assert outcome.failed is any_block_failed
    assert outcome.failed is bool(outcome.failed_block_ids)


@given(st.lists(st.integers(1, 40), max_size=8, unique=True), st.booleans())
def test_an_unplanned_load_fails_every_block_without_a_read(
    block_ids: list[int], is_async: bool
) -> None:
    outcome = unplanned_load_outcome("r", block_ids, is_async)
    assert outcome.failed_block_ids == frozenset(block_ids)
    assert outcome.failed is bool(block_ids)
    assert outcome.failures == ()  # nothing was read, no failure kind is counted


@given(st.integers(0, 6))
def test_block_level_reporting_only_for_one_cache_group(num_groups: int) -> None:
    expected = FailureReporting.BLOCK_IDS if num_groups <= 1 else FailureReporting.REQUEST_IDS
    assert failure_reporting(num_groups) is expected


@st.composite
def steps_of_outcomes(draw: st.DrawFn) -> list[RequestLoadOutcome]:
    outcomes = []
    for index in range(draw(st.integers(0, 5))):
        request_id = f"req-{index}"
        is_async = draw(st.booleans())
        if draw(st.integers(0, 4)) == 0:
            blocks = draw(st.lists(st.integers(1, 40), max_size=4, unique=True))
            outcomes.append(unplanned_load_outcome(request_id, blocks, is_async))
        else:
            read = draw(read_loads(request_id))
            outcomes.append(plan_load_outcome(read.plan, read.answers, is_async))
    return outcomes


@given(steps_of_outcomes(), st.sampled_from(list(FailureReporting)))
def test_vllm_hears_of_each_failure_in_the_models_one_form(
    outcomes: list[RequestLoadOutcome], reporting: FailureReporting
) -> None:
    report = LoadReport()
    for outcome in outcomes:
        report = report_load(report, outcome, reporting)
    assert report.finished_requests == {o.request_id for o in outcomes if o.is_async}
    assert report.failed_requests <= report.finished_requests
    failed = [o for o in outcomes if o.failed]
    if reporting is FailureReporting.BLOCK_IDS:
        assert report.failed_requests == frozenset()
        # A synchronous load's failed blocks are due at once; an asynchronous
        # load's with its finish (vLLM takes the finished requests first).
        assert report.failed_block_ids == frozenset().union(
            *(o.failed_block_ids for o in failed if not o.is_async))
        assert report.without_requests().failed_block_ids == frozenset().union(
            *(o.failed_block_ids for o in failed))
    else:
        assert report.failed_block_ids == frozenset()
        assert report.without_requests().failed_block_ids == frozenset()
        assert report.failed_requests == {o.request_id for o in failed if o.is_async}
    # What cannot be reported is exactly what neither form carries.
    for outcome in outcomes:
        carried = outcome.request_id in report.failed_requests or (
            reporting is FailureReporting.BLOCK_IDS and outcome.failed)
        assert failure_unreportable(outcome, reporting) is (outcome.failed and not carried)


@given(steps_of_outcomes(), st.sampled_from(list(FailureReporting)))
def test_taking_requests_and_blocks_splits_the_report(
    outcomes: list[RequestLoadOutcome], reporting: FailureReporting
) -> None:
    report = LoadReport()
    for outcome in outcomes:
        report = report_load(report, outcome, reporting)
    after_requests = report.without_requests()
    assert after_requests.failed_block_ids == report.failed_block_ids.union(
        *report.finishing_block_ids.values())
    assert not after_requests.finished_requests and not after_requests.failed_requests
    after_blocks = report.without_blocks()
    assert after_blocks.finished_requests == report.finished_requests
    assert after_blocks.failed_requests == report.failed_requests
    assert not after_blocks.failed_block_ids
    # Blocks taken before the requests: an asynchronous load's blocks still wait for
    # its finish, and come with it.
    assert after_blocks.finishing_block_ids == report.finishing_block_ids
    assert set(report.finishing_block_ids) <= report.finished_requests
    assert after_requests.without_blocks() == LoadReport()


@given(st.lists(st.tuples(st.integers(0, 3), st.binary(min_size=1, max_size=3)),
                max_size=8, unique=True), st.data())
def test_a_store_reports_failed_exactly_what_it_did_not_write(
    identities: list[tuple[int, bytes]], data: st.DataObject
) -> None:
    stored = data.draw(st.one_of(st.none(), st.lists(st.booleans(), max_size=10)))
    failed = failed_store_identities(identities, stored)
    assert failed <= set(identities)
    if stored is None or len(stored) != len(identities):
        assert failed == set(identities)
    else:
        assert failed == {i for i, ok in zip(identities, stored) if not ok}


@given(steps_of_outcomes(), st.data())
def test_nothing_computed_over_a_failed_sync_load_is_stored_that_step(
    outcomes: list[RequestLoadOutcome], data: st.DataObject
) -> None:
    """Exactly the requests whose synchronous load failed, and those that read
    blocks such a load filled, are left out (an asynchronous load's request is not
    computed in its step); every row of theirs is reported not stored, every other
    plan goes out untouched, in order."""
    failed_sync = computed_over_failed_loads(outcomes)
    assert failed_sync == {o.request_id for o in outcomes if o.failed and not o.is_async}
    request_ids = [o.request_id for o in outcomes] + ["no-load", "follower"]
    read_over = data.draw(st.dictionaries(
        st.sampled_from(request_ids), st.frozensets(st.sampled_from(request_ids), max_size=3),
        max_size=4,
    ))
    stores = []
    for request_id in data.draw(st.lists(st.sampled_from(request_ids), max_size=6)):
        groups = data.draw(st.dictionaries(
            st.integers(0, 2), st.lists(st.binary(min_size=1, max_size=2), max_size=3),
            max_size=2,
        ))
        stores.append(StorePlan(request_id, tuple(
            GroupBlocks(g, 16, tuple(range(1, len(hashes) + 1)), tuple(hashes))
            for g, hashes in groups.items()
        )))
    previous = data.draw(st.frozensets(st.sampled_from(request_ids), max_size=3))
    settled = data.draw(st.frozensets(st.sampled_from(request_ids), max_size=3))
    excluded = still_computing_over_failures(previous, settled, failed_sync, read_over)
    kept, not_stored = stores_past_failed_loads(stores, excluded)

    # Failed this step, or earlier and not settled by the scheduler (a step planned
    # before the failure was known); or it read blocks one of those loads filled.
    unsettled = set(failed_sync) | (set(previous) - set(settled))

    def computed_over_failure(request_id: str) -> bool:
        return request_id in unsettled or bool(read_over.get(request_id, set()) & unsettled)

    assert excluded == {r for r in request_ids if computed_over_failure(r)}
    assert list(kept) == [b for b in stores if not computed_over_failure(b.request_id)]
    assert not_stored == {
        (g, h) for b in stores if computed_over_failure(b.request_id)
        for g, h in b.identities()
    }


@given(st.lists(st.integers(0, 8 << 20), min_size=1, max_size=5))
def test_the_auto_page_holds_one_object_of_the_smallest_group(sizes: list[int]) -> None:
    page = auto_page_bytes(sizes)
    smallest = min(sizes)
    assert page % PAGE_ALIGN_BYTES == 0
    # The smallest object fills one page, short only of the rounding to 4 KiB.
    assert smallest <= page < max(smallest, 1) + PAGE_ALIGN_BYTES
    assert page >= PAGE_ALIGN_BYTES


@given(st.lists(st.integers(0, 8 << 20), max_size=5),
       st.one_of(st.none(), st.sampled_from([4096, 1 << 16, 1 << 20])))
def test_a_configured_page_size_wins(sizes: list[int], configured: int | None) -> None:
    page = pool_page_bytes(configured, sizes)
    if configured is not None:
        assert page == configured
    elif not sizes:
        assert page == DEFAULT_AUTO_PAGE_BYTES
    else:
        assert page == auto_page_bytes(sizes)


def test_failure_kinds_are_every_status_but_hit() -> None:
    assert set(LOAD_FAILURES) == set(LoadStatus) - {LoadStatus.HIT}
    assert all(group_load_outcome(0, [1], [s]).failures == (s,) for s in LOAD_FAILURES)
