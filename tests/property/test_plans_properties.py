"""Properties of the load, store and transfer plans (``umbp.core.*_plans``) and
``umbp.core.stores.acks``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from returns.result import Failure, Result, Success

from tests.property.strategies import (
    LookupScenario,
    StoreScenario,
    block_tables,
    coordinated_geometries,
    geometries,
    identities_from,
    lookup_scenarios,
    plan_rows,
    request_hashes,
    single_group_geometries,
    store_scenarios,
)
from umbp.core.geometry import NULL_BLOCK_ID, CacheGeometry
from umbp.core.loads.allocation import load_plan, plan_allocated_load
from umbp.core.lookup.query import build_lookup_query
from umbp.core.lookup.windows import (
    LoadSpec,
    coordinator_hit_sets,
    fold_rank_hits,
    single_group_load_spec,
)
from umbp.core.plans import GroupBlocks, LoadPlan, StorePlan, plan_block_ids
from umbp.core.requests import RequestLifecycle
from umbp.core.stores.acks import (
    StoreEvent,
    StoreEventResult,
    event_acknowledged,
    merge_store_results,
    pinned_block_ids,
    reserved_identities,
)
from umbp.core.stores.handoffs import (
    BlockTransferPlan,
    DropReason,
    boundary_state_plans,
    finished_partial_tail_plans,
    transfer_store_plan,
)
from umbp.core.stores.request_store import apply_store_masks, store_plan
from umbp.core.stores.step import (
    StoreCandidates,
    plan_stores,
    residency_check,
    resident_blocks_from_hits,
)
from umbp.core.stores.tracking import (
    StoreTracker,
    _candidate_ranges_per_group,
    eagle_store_groups,
    is_prefill,
    save_watermark,
    storable_tokens,
    store_candidate_ranges,
    store_token_limit,
    stores_this_step,
    stores_under_role,
)
from umbp.core.stores.windows import (
    cached_request_store_window,
    cached_request_stores,
    store_candidates,
)


def identities_of(plan: LoadPlan | StorePlan) -> list[tuple[int, bytes]]:
    """The ``(group_id, block_hash)`` of every block of a plan, in order."""
    return [(group_id, block_hash) for group_id, _, block_hash in plan_rows(plan)]


def well_grouped(plan: LoadPlan | StorePlan, geometry: CacheGeometry) -> bool:
    """Each group at most once, none empty, each with its geometry's block size."""
    group_ids = [group.group_id for group in plan.groups]
    return len(set(group_ids)) == len(group_ids) and all(
        len(group) and group.block_size == geometry.group_block_sizes[geometry.position(
            group.group_id)]
        for group in plan.groups
    )


# ------------------------------------------------------------------------- loads


@dataclass(frozen=True)
class PlannedLoad:
    scenario: LookupScenario
    spec: LoadSpec
    table: tuple[tuple[int, ...], ...]
    reported: tuple[frozenset[bytes], ...]
    batch: LoadPlan


@st.composite
def single_group_loads(draw: st.DrawFn) -> PlannedLoad | None:
    scenario = draw(lookup_scenarios(single_group_geometries()))
    geometry = scenario.geometry
    query = build_lookup_query(
        geometry, scenario.keyspace, scenario.hashes, scenario.local_tokens, scenario.num_tokens
    )
    folded = fold_rank_hits(query, scenario.pool.answers(query.runs.key_strings()))
    assert folded is not None
    spec = single_group_load_spec(geometry, query, folded)
    if spec is None:
        return None
    table = draw(block_tables(geometry, scenario.num_tokens))
    batch = load_plan(
        "r", geometry, spec, table, scenario.hashes, spec.num_tokens_to_load
    ).unwrap()
    reported = coordinator_hit_sets(query, folded)
    return PlannedLoad(scenario, spec, table, reported, batch)


@st.composite
def coordinated_loads(draw: st.DrawFn) -> PlannedLoad | None:
    """A stand-in for vLLM's coordinator: any hit end past the local tokens, each
    block named only if its object was reported (None otherwise)."""
    scenario = draw(lookup_scenarios(coordinated_geometries()))
    geometry = scenario.geometry
    query = build_lookup_query(
        geometry, scenario.keyspace, scenario.hashes, scenario.local_tokens, scenario.num_tokens
    )
    folded = fold_rank_hits(query, scenario.pool.answers(query.runs.key_strings()))
    assert folded is not None
    reported = coordinator_hit_sets(query, folded)
    hit_end = draw(st.integers(scenario.local_tokens + 1, scenario.num_tokens - 1))
    hashes_by_group = tuple(
        tuple(
            h if h in hit_set else None
            for block in range(hit_end // size)
            for h in (scenario.hashes[(block + 1) * size // geometry.hash_block_size - 1],)
        )
        for size, hit_set in zip(geometry.group_block_sizes, reported)
    )
    spec = LoadSpec(scenario.local_tokens, hit_end, hashes_by_group)
    table = draw(block_tables(geometry, scenario.num_tokens))
    batch = load_plan(
        "r", geometry, spec, table, scenario.hashes, spec.num_tokens_to_load
    ).unwrap()
    return PlannedLoad(scenario, spec, table, reported, batch)


@given(st.one_of(single_group_loads(), coordinated_loads()))
def test_load_plans_write_only_blocks_of_the_request_table_never_null_each_at_most_once(
    planned: PlannedLoad | None,
) -> None:
    if planned is None:
        return
    geometry, batch = planned.scenario.geometry, planned.batch
    assert NULL_BLOCK_ID not in plan_block_ids(batch)
    assert len(set(plan_block_ids(batch))) == len(batch)
    assert well_grouped(batch, geometry)
    for group_id, block_id, _ in plan_rows(batch):
        position = geometry.position(group_id)
        table = planned.table[position]
        assert block_id in table
        # Blocks under the local tokens are vLLM's and never overwritten.
        local_blocks = planned.spec.local_tokens // geometry.group_block_sizes[position]
        assert table.index(block_id) >= local_blocks


@given(st.one_of(single_group_loads(), coordinated_loads()))
def test_every_identity_a_load_plan_reads_was_reported_as_a_hit(
    planned: PlannedLoad | None,
) -> None:
    if planned is None:
        return
    geometry = planned.scenario.geometry
    for group_id, block_hash in identities_of(planned.batch):
        assert block_hash in planned.reported[geometry.position(group_id)]
        assert planned.scenario.pool.held_by_every_rank(group_id, block_hash)


@given(single_group_loads(), st.data())
def test_a_null_destination_is_an_error_value(
    planned: PlannedLoad | None, data: st.DataObject
) -> None:
    assume(planned is not None and len(planned.batch) > 0)
    assert planned is not None
    victim = data.draw(st.sampled_from(plan_block_ids(planned.batch)))
    table = tuple(
        tuple(NULL_BLOCK_ID if block == victim else block for block in group)
        for group in planned.table
    )
    result = load_plan(
        "r",
        planned.scenario.geometry,
        planned.spec,
        table,
        planned.scenario.hashes,
        planned.spec.num_tokens_to_load,
    )
    assert isinstance(result, Failure)


def test_a_load_allocated_with_another_token_count_is_an_error_value() -> None:
    geometry = CacheGeometry((0,), (4,), (4,), block_size=4, hash_block_size=4)
    spec = LoadSpec(0, 8)
    hashes = (b"a", b"b", b"c")
    table = ((5, 6, 7),)
    assert load_plan("r", geometry, spec, table, hashes, 8).unwrap() == LoadPlan(
        "r", (GroupBlocks(0, 4, (5, 6), (b"a", b"b")),)
    )
    assert isinstance(load_plan("r", geometry, spec, table, hashes, 4), Failure)
    assert isinstance(load_plan("r", geometry, spec, ((5,),), hashes, 8), Failure)


def test_a_partial_tail_loads_the_hash_at_the_window_end_into_the_split_block() -> None:
    geometry = CacheGeometry(
        (0,), (16,), (4,), block_size=16, hash_block_size=4, partial_hash_hits=True
    )
    hashes = tuple(bytes([index]) for index in range(10))
    batch = load_plan("r", geometry, LoadSpec(0, 24), ((3, 9),), hashes, 24).unwrap()
    assert batch.groups == (GroupBlocks(0, 16, (3, 9), (hashes[3], hashes[5])),)
    # The step that loads it computes the rest of block 9: it must land whole first.
    assert batch.ends_mid_block
    assert not load_plan("r", geometry, LoadSpec(0, 32), ((3, 9),), hashes, 32).unwrap(
    ).ends_mid_block
    without_partial = CacheGeometry((0,), (16,), (16,), block_size=16, hash_block_size=4)
    assert isinstance(
        load_plan("r", without_partial, LoadSpec(0, 24), ((3, 9),), hashes, 24), Failure
    )


@given(st.one_of(single_group_loads(), coordinated_loads()), st.data())
def test_a_load_is_planned_for_what_vllm_allocated_or_its_window_is_recomputed(
    planned: PlannedLoad | None, data: st.DataObject
) -> None:
    """vLLM may lower (or, misbehaving, raise) the external count umbp matched:
    never an exception; a plan never writes past what vLLM allocated; otherwise
    every non-null block of the allocated window is handed back for recompute."""
    if planned is None:
        return
    geometry, spec, table = planned.scenario.geometry, planned.spec, planned.table
    matched = spec.num_tokens_to_load
    allocated = data.draw(st.integers(1, matched + 2))
    end = spec.local_tokens + allocated
    result = plan_allocated_load("r", geometry, spec, table, planned.scenario.hashes, allocated)
    if allocated == matched:
        assert result.unwrap() == planned.batch
    if isinstance(result, Success):
        batch = result.unwrap()
        assert allocated <= matched
        assert set(identities_of(batch)) <= set(identities_of(planned.batch))
        for group_id, block_id, _ in plan_rows(batch):
            position = geometry.position(group_id)
            index = table[position].index(block_id)
            assert index * geometry.group_block_sizes[position] < end
        if not spec.block_hashes_by_group and end % geometry.block_size == 0:
            # A block-aligned lower count (vLLM's own trim) always loads.
            assert len(batch) == (end - spec.local_tokens) // geometry.block_size
    else:
        assert allocated > matched or allocated < matched
        window = {
            block
            for size, group in zip(geometry.group_block_sizes, table)
            for block in group[spec.local_tokens // size : -(-end // size)]
            if block != NULL_BLOCK_ID
        }
        assert set(result.failure().block_ids) == window
    unmatched = plan_allocated_load("r", geometry, None, table, planned.scenario.hashes, allocated)
    assert set(unmatched.failure().block_ids) == {
        block for group in table for block in group if block != NULL_BLOCK_ID
    }


# ----------------------------------------------------------------------- storing


@dataclass(frozen=True)
class PlannedStore:
    scenario: StoreScenario
    save_to: int
    candidates: dict[int, range]
    selected: dict[int, Sequence[int]]
    resident: frozenset[tuple[int, bytes]]
    batch: StorePlan


def plan_store(
    scenario: StoreScenario, data: st.DataObject, events_enabled: bool = False
) -> PlannedStore:
    """One scheduled request's store step through the core entry points the
    shell's ``StoreStep`` calls, in its order: ``cached_request_stores`` ->
    ``cached_request_store_window`` (with vLLM's current block table, which vLLM
    0.32/0.33 hand over every step) -> ``store_candidates`` with vLLM's masks ->
    ``residency_check`` -> the store's answers -> ``plan_stores``. vLLM's side
    (table, masks, what the pool holds) is generated; the shell itself, through
    vLLM's real Scheduler, is
    test_request_lifecycle_properties.py::test_the_scheduler_restores_exact_bytes_and_releases_every_pin.
    """
    geometry = scenario.geometry
    # Tracked since an earlier step: watermark, table and what came from a cache.
    state = RequestLifecycle(tracker=StoreTracker(
        scenario.previous_saved, scenario.block_table, scenario.restored_tokens or 0
    ))
    # The step ends at total_tokens; with save_decode_cache on, nothing cuts it short.
    computed = min(scenario.previous_saved, scenario.total_tokens)
    state, stores = cached_request_stores(state, computed, False, scenario.total_tokens, True)
    assert stores
    state, window = cached_request_store_window(
        state, geometry, scenario.boundary_groups, computed, scenario.total_tokens - computed,
        scenario.block_table, scenario.total_tokens, len(scenario.hashes), True,
    )
    assert state.tracker is not None
    save_to = state.tracker.saved_tokens
    masks = {
        group_id: data.draw(
            st.none() | st.lists(st.booleans(), min_size=len(indices), max_size=len(indices))
        )
        for group_id, indices in window.ranges
    }
    token_ids = tuple(range(1000, 1000 + scenario.num_tokens))
    candidates = store_candidates("r", window, masks, scenario.hashes, token_ids).unwrap()
    selected = candidates.selected
    check = residency_check(geometry, scenario.keyspace, [candidates], scenario.reserved)
    answers = scenario.pool.answers(check.keys)
    resident = resident_blocks_from_hits(check, answers)
    planned = plan_stores(
        geometry, [candidates], check, answers, scenario.reserved, events_enabled=events_enabled
    )
    (batch,) = planned.plans or (StorePlan("r", ()),)
    return PlannedStore(scenario, save_to, dict(window.ranges), dict(selected), resident, batch)


def planned_blocks(planned: PlannedStore) -> list[tuple[int, int, bytes]]:
    """(group_id, block index, hash) of every planned block."""
    geometry = planned.scenario.geometry
    out = []
    for group_id, block_id, block_hash in plan_rows(planned.batch):
        table = planned.scenario.block_table[geometry.position(group_id)]
        out.append((group_id, table.index(block_id), block_hash))
    return out


@given(store_scenarios(), st.data())
def test_store_plans_never_include_blocks_past_the_hash_coverage(
    scenario: StoreScenario, data: st.DataObject
) -> None:
    planned = plan_store(scenario, data)
    geometry = scenario.geometry
    covered = len(scenario.hashes) * geometry.hash_block_size
    for group_id, index, block_hash in planned_blocks(planned):
        size = geometry.group_block_sizes[geometry.position(group_id)]
        token_end = (index + 1) * size
        assert token_end <= covered
        assert token_end <= planned.save_to
        assert block_hash == scenario.hashes[token_end // geometry.hash_block_size - 1]


@given(store_scenarios(), st.data())
def test_store_plans_never_include_an_identity_reserved_by_an_in_flight_event(
    scenario: StoreScenario, data: st.DataObject
) -> None:
    planned = plan_store(scenario, data)
    assert not set(identities_of(planned.batch)) & scenario.reserved
    assert len(set(identities_of(planned.batch))) == len(planned.batch)


@given(store_scenarios(), st.data())
def test_store_plans_never_include_a_restored_block_still_resident(
    scenario: StoreScenario, data: st.DataObject
) -> None:
    planned = plan_store(scenario, data)
    geometry = scenario.geometry
    for group_id, index, block_hash in planned_blocks(planned):
        if scenario.restored_tokens is None:
            break
        size = geometry.group_block_sizes[geometry.position(group_id)]
        if index < scenario.restored_tokens // size:
            assert not scenario.pool.held_by_every_rank(group_id, block_hash)


@given(store_scenarios(), st.data())
def test_store_plans_take_only_masked_non_null_blocks_new_since_the_watermark(
    scenario: StoreScenario, data: st.DataObject
) -> None:
    planned = plan_store(scenario, data)
    geometry = scenario.geometry
    assert NULL_BLOCK_ID not in plan_block_ids(planned.batch)
    assert well_grouped(planned.batch, geometry)
    assert not set(planned.candidates) & scenario.boundary_groups
    for group_id, index, _ in planned_blocks(planned):
        size = geometry.group_block_sizes[geometry.position(group_id)]
        assert index in planned.selected[group_id]
        assert scenario.previous_saved // size <= index < planned.save_to // size


@given(store_scenarios(), st.data())
def test_store_plans_skip_only_for_a_reason(scenario: StoreScenario, data: st.DataObject) -> None:
    """A selected, non-null, hashed block is planned unless reserved or resident."""
    planned = plan_store(scenario, data)
    geometry = scenario.geometry
    planned_identities = set(identities_of(planned.batch))
    for group_id, indices in planned.selected.items():
        position = geometry.position(group_id)
        size = geometry.group_block_sizes[position]
        table = scenario.block_table[position]
        for index in indices:
            if table[index] == NULL_BLOCK_ID:
                continue
            identity = (
                group_id,
                scenario.hashes[(index + 1) * size // geometry.hash_block_size - 1],
            )
            assert (
                identity in planned_identities
                or identity in scenario.reserved
                or identity in planned.resident
            )


@given(store_scenarios(), st.data())
def test_event_fields_name_each_blocks_parent_and_tokens_only_when_events_are_on(
    scenario: StoreScenario, data: st.DataObject
) -> None:
    planned = plan_store(scenario, data, events_enabled=True)
    geometry = scenario.geometry
    facts = planned.batch.facts if planned.batch.groups else ()
    assert facts is not None and len(facts) == len(planned.batch.groups)
    for (group_id, index, _), parent, tokens, size in zip(
        planned_blocks(planned),
        [parent for fact in facts for parent in fact.parent_hashes],
        [tokens for fact in facts for tokens in fact.token_ids],
        [group.block_size for group in planned.batch.groups for _ in group.block_ids],
        strict=True,
    ):
        assert size == geometry.group_block_sizes[geometry.position(group_id)]
        assert tokens == tuple(range(1000 + index * size, 1000 + (index + 1) * size))
        if index == 0:
            assert parent is None
        else:
            assert parent == scenario.hashes[index * size // geometry.hash_block_size - 1]
    quiet = store_plan(
        "r",
        geometry,
        tuple(planned.selected.items()),
        scenario.block_table,
        scenario.hashes,
        planned={},
        resident=planned.resident,
        reserved=scenario.reserved,
    )
    assert quiet.groups == planned.batch.groups
    assert quiet.facts is None


@st.composite
def index_selections(draw: st.DrawFn, count: int) -> Sequence[int]:
    """Block indices as the shell may pass them: a whole range (vLLM kept every
    candidate), a tuple of one (consecutive, maybe past the table), a masked
    subset, or any order with repeats."""
    start = draw(st.integers(0, max(count - 1, 0)))
    stop = draw(st.integers(start, count + 2))
    return draw(st.sampled_from([
        range(start, stop),
        range(start, stop),
        tuple(range(start, stop)),
        tuple(index for index in range(start, stop) if draw(st.booleans())),
        tuple(draw(st.lists(st.integers(0, count + 1), max_size=8))),
    ]))


@dataclass(frozen=True)
class StoreBatchInput:
    scenario: StoreScenario
    hashes: tuple[bytes, ...]
    selected: tuple[tuple[int, Sequence[int]], ...]
    resident: frozenset[tuple[int, bytes]]
    planned: dict[int, frozenset[bytes]]


@st.composite
def store_batch_inputs(draw: st.DrawFn) -> StoreBatchInput:
    """Any input store_plan may get: hashes that repeat now and then (one object
    under two blocks), any selection per group (each group once, as the store
    windows select), and
    resident, reserved and already-planned identities among the request's."""
    scenario = draw(store_scenarios())
    geometry = scenario.geometry
    hashes = scenario.hashes
    if hashes and draw(st.booleans()):
        distinct = draw(st.integers(1, 3))
        hashes = tuple(hashes[index % distinct] for index in range(len(hashes)))
    groups = list(geometry.group_ids)
    picked = draw(st.lists(st.sampled_from(groups), min_size=1, max_size=len(groups),
                           unique=True))
    selected = tuple(
        (group_id, draw(index_selections(len(scenario.block_table[geometry.position(group_id)]))))
        for group_id in picked
    )
    resident = draw(identities_from(hashes, groups))
    planned = {
        group_id: frozenset(draw(st.sets(st.sampled_from(hashes), max_size=3)) if hashes else ())
        for group_id in groups
        if draw(st.booleans())
    }
    return StoreBatchInput(scenario, hashes, selected, resident, planned)


def no_contiguous_runs(*_: object) -> None:
    return None


@given(store_batch_inputs(), st.booleans())
def test_a_contiguous_run_is_planned_exactly_as_the_block_by_block_scan_plans_it(
    given_input: StoreBatchInput, events_enabled: bool
) -> None:
    """The fast case (a group's consecutive indices taken as slices) gives the
    same plan, group for group, as scanning every block, on every input."""
    scenario = given_input.scenario

    def plan() -> tuple[StorePlan, dict[int, set[bytes]]]:
        record = {group_id: set(hashes) for group_id, hashes in given_input.planned.items()}
        batch = store_plan(
            "r", scenario.geometry, given_input.selected, scenario.block_table,
            given_input.hashes, planned=record, resident=given_input.resident,
            reserved=scenario.reserved,
            events_enabled=events_enabled,
            token_ids=tuple(range(1000, 1000 + scenario.num_tokens)),
        )
        return batch, record

    fast, fast_record = plan()
    with mock.patch("umbp.core.stores.request_store._contiguous_group_stores", no_contiguous_runs):
        scanned, scanned_record = plan()
    assert fast == scanned
    assert fast_record == scanned_record
    assert not set(identities_of(fast)) & (given_input.resident | scenario.reserved)
    for group_id, block_hash in identities_of(fast):
        assert block_hash not in given_input.planned.get(group_id, ())
        assert block_hash in fast_record[group_id]


@given(st.integers(0, 64), st.lists(st.integers(0, 200), max_size=12), st.sampled_from([1, 4, 16]))
def test_save_watermarks_only_grow_and_stay_hash_aligned(
    start: int, token_counts: list[int], hash_block_size: int
) -> None:
    watermark = start * hash_block_size
    for token_count in token_counts:
        new = save_watermark(watermark, token_count, hash_block_size)
        assert new >= watermark
        assert new % hash_block_size == 0
        assert new <= max(watermark, token_count)
        watermark = new


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), max_size=4, unique_by=lambda t: t[0]),
    st.data(),
)
def test_a_store_mask_of_the_wrong_length_is_an_error_value(
    spans: list[tuple[int, int]], data: st.DataObject
) -> None:
    ranges = tuple((group_id, range(2, 2 + length)) for group_id, length in spans)
    assume(ranges)
    victim = data.draw(st.sampled_from([group_id for group_id, _ in ranges]))
    masks = {
        group_id: [True] * (len(indices) + (1 if group_id == victim else 0))
        for group_id, indices in ranges
    }
    assert isinstance(apply_store_masks(ranges, masks), Failure)
    masks[victim] = None  # type: ignore[assignment]
    assert isinstance(apply_store_masks(ranges, masks), Success)


@given(store_scenarios(), st.integers(-2, 2).filter(bool))
def test_a_residency_answer_of_the_wrong_length_marks_nothing_resident(
    scenario: StoreScenario, delta: int
) -> None:
    geometry = scenario.geometry
    selected = tuple(
        (group_id, tuple(range(len(table))))
        for group_id, table in zip(geometry.group_ids, scenario.block_table)
    )
    candidates = StoreCandidates(
        "r", selected, scenario.block_table, scenario.hashes, scenario.num_tokens
    )
    check = residency_check(geometry, scenario.keyspace, [candidates])
    assume(len(check.keys) + delta >= 0)
    assert resident_blocks_from_hits(check, [True] * (len(check.keys) + delta)) == frozenset()
    assert resident_blocks_from_hits(check, [True] * len(check.keys)) == frozenset(check.identities)


def test_store_token_limits() -> None:
    assert storable_tokens(100, 3, 16) == 48
    assert storable_tokens(40, 3, 16) == 40
    assert store_token_limit(120, 100, save_decode_cache=False) == 100
    assert store_token_limit(120, 100, save_decode_cache=True) == 120
    assert is_prefill(99, 100) and not is_prefill(100, 100)
    assert stores_this_step(100, 100, True) and not stores_this_step(100, 100, False)
    assert stores_under_role(True, "kv_both") and stores_under_role(True, "kv_producer")
    assert stores_under_role(True, None)
    assert not stores_under_role(True, "kv_consumer") and not stores_under_role(False, "kv_both")


def test_eagle_store_groups_are_vllms_marked_groups_else_every_group_with_eagle() -> None:
    assert eagle_store_groups({2}, (0, 1, 2), use_eagle=True) == {2}
    assert eagle_store_groups(set(), (0, 1), use_eagle=True) == {0, 1}
    assert eagle_store_groups(set(), (0, 1), use_eagle=False) == frozenset()


@given(store_scenarios(), st.data())
def test_masked_out_blocks_are_never_candidates_again(
    scenario: StoreScenario, data: st.DataObject
) -> None:
    """The rule apply_store_masks names: the watermark passes masked blocks too."""
    planned = plan_store(scenario, data)
    geometry = scenario.geometry
    masked = {
        (group_id, index)
        for group_id, indices in planned.candidates.items()
        for index in indices
        if index not in planned.selected[group_id]
    }
    later = store_candidate_ranges(
        geometry, planned.save_to, planned.save_to + 4 * geometry.block_size,
        scenario.block_table, scenario.boundary_groups,
    )
    assert not masked & {(g, i) for g, indices in later for i in indices}


@given(
    st.lists(st.lists(st.integers(1, 99), max_size=4), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(1, 99), max_size=4), min_size=1, max_size=3),
)
def test_tracker_replaces_its_table_whole_keeps_its_watermark_and_resets_to_nothing(
    first: list[list[int]], current: list[list[int]]
) -> None:
    tracker = StoreTracker().with_blocks_replaced(first).with_saved_tokens(32)
    assert tracker.block_table == tuple(tuple(group) for group in first)
    replaced = tracker.with_blocks_replaced(current)  # vLLM's current table, each step
    assert replaced.block_table == tuple(map(tuple, current))
    assert replaced.saved_tokens == 32
    assert tracker.with_saved_tokens(16).saved_tokens == 32
    assert tracker.with_cached_tokens(8).cached_tokens == 8
    assert tracker.with_cached_tokens(8).with_saved_tokens(40).cached_tokens == 8
    assert tracker.reset() == StoreTracker()


# ------------------------------------------------------------ boundary transfers


@dataclass(frozen=True)
class BoundaryCase:
    offloads: dict[str, list[tuple[int, int, int]]]
    finished: frozenset[str]
    preempted: frozenset[str]
    hashes: dict[str, tuple[bytes, ...]]
    prefix_groups: frozenset[int]
    hash_block_size: int
    block_sizes: dict[int, int]


@st.composite
def boundary_cases(draw: st.DrawFn) -> BoundaryCase:
    hbs = draw(st.sampled_from([1, 4]))
    request_ids = draw(st.lists(st.sampled_from("abcdef"), unique=True, max_size=5))
    entry = st.tuples(st.integers(0, 4), st.integers(0, 9), st.integers(-2, 40))
    tracked = draw(st.sets(st.sampled_from("abcdef")))
    return BoundaryCase(
        offloads={rid: draw(st.lists(entry, max_size=5)) for rid in request_ids},
        finished=frozenset(draw(st.sets(st.sampled_from("abcdef")))),
        preempted=frozenset(draw(st.sets(st.sampled_from("abcdef")))),
        hashes={rid: draw(request_hashes(draw(st.integers(0, 40 // hbs)))) for rid in tracked},
        prefix_groups=frozenset(draw(st.sets(st.integers(0, 3), min_size=1))),
        hash_block_size=hbs,
        block_sizes={group: hbs * draw(st.integers(1, 4)) for group in range(5)},
    )


@given(boundary_cases(), st.booleans())
def test_boundary_plans_store_only_handed_off_boundaries_of_live_tracked_requests(
    case: BoundaryCase, events_enabled: bool
) -> None:
    hbs, hashes = case.hash_block_size, case.hashes
    plans, dropped = boundary_state_plans(
        case.offloads,
        case.finished,
        case.preempted,
        hashes,
        case.prefix_groups,
        hbs,
        case.block_sizes,
        events_enabled,
    )
    for plan in plans:
        request_hashes = hashes[plan.request_id]
        assert plan.request_id not in case.finished | case.preempted
        assert plan.group_id in case.prefix_groups and plan.block_id != NULL_BLOCK_ID
        boundary = next(
            b
            for g, block, b in case.offloads[plan.request_id]
            if (g, block) == (plan.group_id, plan.block_id)
            and b > 0
            and b % hbs == 0
            and b // hbs <= len(request_hashes)
            and request_hashes[b // hbs - 1] == plan.block_hash
        )
        index = boundary // hbs - 1
        assert plan.block_size == case.block_sizes[plan.group_id]
        assert plan.parent_hash == (request_hashes[index - 1] if events_enabled and index else None)
    reasons = {d.request_id: d.reason for d in dropped}
    for request_id, entries in case.offloads.items():
        if request_id in case.finished:
            assert reasons[request_id] is DropReason.FINISHED
        elif request_id in case.preempted:
            assert reasons[request_id] is DropReason.PREEMPTED
        elif request_id not in hashes:
            assert reasons[request_id] is DropReason.UNTRACKED
        else:
            assert request_id not in reasons
        if request_id in reasons:
            assert next(d.entries for d in dropped if d.request_id == request_id) == len(entries)


TAIL_GEOMETRY = CacheGeometry(
    group_ids=(0, 1),
    group_block_sizes=(16, 64),
    lookup_units=(16, 16),
    block_size=64,
    hash_block_size=16,
    partial_hash_hits=True,
    coordinated=True,
)
TAIL_HASHES = tuple(bytes([i]) for i in range(8))


def tail(
    entries: list[tuple[int, int, int]],
    computed: int = 48,
    in_flight: int = 0,
    table: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4), (7,)),
    pool_size: int = 100,
) -> Result[tuple[BlockTransferPlan, ...], str]:
    return finished_partial_tail_plans(
        "r",
        TAIL_GEOMETRY,
        entries,
        table,
        TAIL_HASHES,
        computed,
        in_flight,
        full_attention_groups=frozenset({0, 1}),
        pool_size=pool_size,
    )


def test_a_finished_tail_stores_the_state_page_and_the_split_attention_page() -> None:
    # Group 1 (64-token blocks) is split by boundary 48; group 0 (16) is not.
    plans = tail([(1, 7, 48)]).unwrap()
    assert plans == (BlockTransferPlan("r", 1, 7, TAIL_HASHES[2], None, 64),)
    plans = tail([(0, 3, 40 + 8)], computed=48).unwrap()
    assert {plan.group_id for plan in plans} == {0, 1}
    assert {plan.block_hash for plan in plans} == {TAIL_HASHES[2]}


@pytest.mark.parametrize(
    ("entries", "kwargs"),
    [
        ([], {}),
        ([(1, 7, 48), (0, 3, 32)], {}),
        ([(1, 7, 40)], {"computed": 40}),
        ([(1, 7, 48)], {"computed": 64}),
        ([(1, 7, 48)], {"in_flight": 1}),
        ([(1, 7, 48 + 128)], {"computed": 48 + 128}),
        ([(5, 7, 48)], {}),
        ([(0, 3, 80)], {"computed": 80, "table": ((1, 2, 3, 4, 5), (7,))}),
        ([(1, NULL_BLOCK_ID, 48)], {}),
        ([(1, 700, 48)], {}),
    ],
)
def test_a_finished_tail_that_breaks_a_rule_stores_nothing(
    entries: list[tuple[int, int, int]], kwargs: dict[str, object]
) -> None:
    assert isinstance(tail(entries, **kwargs), Failure)  # type: ignore[arg-type]


# ------------------------------------------------------------------ store events


@st.composite
def store_events(draw: st.DrawFn) -> StoreEvent:
    block = st.integers(1, 30)
    identity_hash = st.sampled_from([b"a", b"b", b"c", b"d"])
    plans = []
    for _ in range(draw(st.integers(0, 3))):
        groups = []
        for group_id in draw(st.lists(st.integers(0, 2), max_size=3, unique=True)):
            count = draw(st.integers(1, 5))
            groups.append(GroupBlocks(
                group_id, 16, tuple(draw(st.lists(block, min_size=count, max_size=count))),
                tuple(draw(st.lists(identity_hash, min_size=count, max_size=count))),
            ))
        plans.append(StorePlan("r", tuple(groups)))
    transfers = tuple(
        BlockTransferPlan("r", draw(st.integers(0, 2)), draw(block), draw(identity_hash), None, 16)
        for _ in range(draw(st.integers(0, 4)))
    )
    if transfers:  # boundary states and partial tails travel as plans too
        plans.append(transfer_store_plan("r", transfers, draw(st.booleans())))
    return StoreEvent(draw(st.integers(0, 9)), tuple(plans))


@given(store_events())
def test_pinned_block_ids_cover_every_block_of_every_plan_exactly_once(event: StoreEvent) -> None:
    pinned = pinned_block_ids(event)
    every = [b for plan in event.plans for b in plan_block_ids(plan)]
    assert len(pinned) == len(set(pinned))
    assert set(pinned) == set(every)
    assert list(pinned) == list(dict.fromkeys(every))
    for plan in event.plans:  # a plan pinned alone (a finished tail) is pinned alike
        assert pinned_block_ids(plan) == tuple(dict.fromkeys(plan_block_ids(plan)))


@given(store_events(), st.lists(store_events(), max_size=3))
def test_reserved_identities_are_every_identity_of_every_in_flight_event(
    event: StoreEvent, others: list[StoreEvent]
) -> None:
    reserved = reserved_identities([event, *others])
    for e in (event, *others):
        for plan in e.plans:
            assert set(identities_of(plan)) <= reserved
    every = {identity for e in (event, *others) for p in e.plans for identity in identities_of(p)}
    assert set(reserved) == every and bool(reserved) == bool(every)
    assert (9, b"never planned") not in reserved
    assert event.hashes_by_group() is event.hashes_by_group()  # built once per event


@given(
    st.integers(1, 8),
    st.lists(
        st.frozensets(st.tuples(st.integers(0, 2), st.sampled_from([b"a", b"b"]))), max_size=10
    ),
)
def test_an_event_is_acknowledged_only_when_every_worker_reported(
    num_workers: int, failures: list[frozenset[tuple[int, bytes]]]
) -> None:
    result = StoreEventResult()
    for reported, failed in enumerate(failures, start=1):
        result = merge_store_results(result, StoreEventResult(1, failed))
        assert event_acknowledged(result, num_workers) == (reported >= num_workers)
        assert result.failed == frozenset().union(*failures[:reported])
    if not failures:
        assert not event_acknowledged(result, num_workers)


@given(
    st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=30),
    st.integers(min_value=0, max_value=40 * 32),
    st.integers(min_value=0, max_value=40 * 32),
)
def test_window_block_ids_are_the_non_null_blocks_of_the_window_each_once(
    table: list[int], start: int, length: int
) -> None:
    from umbp.core.geometry import NULL_BLOCK_ID, CacheGeometry
    from umbp.core.loads.allocation import window_block_ids

    geometry = CacheGeometry((0,), (32,), (32,), 32, 32)
    end = start + length
    blocks = window_block_ids(geometry, start, end, (tuple(table),))
    expected = {b for b in table[start // 32 : -(-end // 32)] if b != NULL_BLOCK_ID}
    assert set(blocks) == expected
    assert len(blocks) == len(set(blocks))
    assert NULL_BLOCK_ID not in blocks


@given(geometries(), st.data())
def test_one_groups_candidate_ranges_are_the_per_group_rules(
    geometry: CacheGeometry, data: st.DataObject
) -> None:
    """store_candidate_ranges builds a one-group model's ranges directly (the fast
    path); for every geometry, table, watermark pair and boundary set it gives what
    the per-group rule gives."""
    table = data.draw(block_tables(geometry, data.draw(st.integers(1, 6 * geometry.block_size))))
    table = table[: data.draw(st.integers(0, len(table)))]  # vLLM may report fewer groups
    previous = data.draw(st.integers(0, 8 * geometry.block_size))
    save_to = previous + data.draw(st.integers(0, 8 * geometry.block_size))
    boundary = frozenset(data.draw(st.sets(st.sampled_from(geometry.group_ids))))
    assert store_candidate_ranges(geometry, previous, save_to, table, boundary) == (
        _candidate_ranges_per_group(geometry, previous, save_to, table, boundary)
    )
