"""Properties of one scheduler step's store pass (umbp.core.stores.step): several
requests sharing prefixes, blocks that came from a cache checked in one lookup,
and the batches that leave out what every rank already holds."""

from __future__ import annotations

from dataclasses import dataclass, replace
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from tests.property.strategies import (
    ObjectId,
    Pool,
    block_tables,
    geometries,
    keyspaces,
    request_hashes,
)
from umbp.core.geometry import NULL_BLOCK_ID, CacheGeometry
from umbp.core.identity import KeySpace
from umbp.core.plans import StorePlan
from umbp.core.stores.request_store import _contiguous_group_stores, store_plan, whole_run_plan
from umbp.core.stores.reservations import Reservations
from umbp.core.stores.residency import residency_check, resident_blocks_from_hits
from umbp.core.stores.step import plan_stores
from umbp.core.stores.windows import StoreCandidates, StoreWindow, store_candidates


def identities_of(plan: StorePlan) -> list[ObjectId]:
    """The ``(group_id, block_hash)`` of every block of a plan, in order."""
    return list(plan.identities())


@dataclass(frozen=True)
class StoreStep:
    geometry: CacheGeometry
    keyspace: KeySpace
    candidates: tuple[StoreCandidates, ...]
    reserved: frozenset[ObjectId]
    pool: Pool


@st.composite
def store_steps(draw: st.DrawFn) -> StoreStep:
    """Requests whose hashes share a prefix of one chain (so identities collide
    across requests), each with random selections, null blocks and a cached
    count; a pool holding a random set of the step's objects, with per-rank holes."""
    geometry = draw(geometries())
    keyspace = draw(keyspaces())
    hbs = geometry.hash_block_size
    shared = draw(request_hashes(draw(st.integers(0, geometry.block_size * 4 // hbs + 2))))
    candidates: list[StoreCandidates] = []
    every_identity: set[ObjectId] = set()
    for number in range(draw(st.integers(1, 4))):
        own = draw(request_hashes(draw(st.integers(0, 6))))
        own = tuple(bytes([number + 1]) + h for h in own)  # never another request's
        hashes = shared[: draw(st.integers(0, len(shared)))] + own
        num_tokens = len(hashes) * hbs + draw(st.integers(0, hbs - 1))
        table = draw(block_tables(geometry, max(num_tokens, 1), null_probability_one_in=5))
        selected = []
        for group_id, block_size, group_table in zip(
            geometry.group_ids, geometry.group_block_sizes, table
        ):
            full = min(len(hashes) * hbs // block_size, len(group_table))
            selected.append(
                (group_id, tuple(sorted(draw(st.sets(st.integers(0, max(full - 1, 0)))))))
            )
            per_block = block_size // hbs
            every_identity.update(
                (group_id, hashes[index * per_block + per_block - 1]) for index in range(full)
            )
        cached = draw(st.just(0) | st.just(num_tokens) | st.integers(0, num_tokens))
        candidates.append(StoreCandidates(f"r{number}", tuple(selected), table, hashes, cached))
    universe = sorted(every_identity)
    held = draw(st.sets(st.sampled_from(universe))) if universe else set()
    coords = keyspace.topology.coords()
    keys = {
        keyspace.key(rank, group_id, block_hash)
        for group_id, block_hash in held
        for rank in coords
        if draw(st.integers(0, 7))  # now and then a rank lost the object
    }
    reserved = frozenset(draw(st.sets(st.sampled_from(universe), max_size=3))) if universe else frozenset()
    return StoreStep(geometry, keyspace, tuple(candidates), reserved, Pool(keyspace, frozenset(keys)))


def selected_identities(step: StoreStep) -> list[tuple[StoreCandidates, int, int, ObjectId]]:
    """(candidates, group block size, block index, identity) of every selected,
    non-null block within its request's hashes, in request order."""
    geometry = step.geometry
    out = []
    for candidate in step.candidates:
        covered = len(candidate.block_hashes) * geometry.hash_block_size
        for group_id, indices in candidate.selected:
            position = geometry.position(group_id)
            size = geometry.group_block_sizes[position]
            table = candidate.block_table[position]
            per_block = size // geometry.hash_block_size
            for index in indices:
                if index >= len(table) or (index + 1) * size > covered:
                    continue
                if table[index] == NULL_BLOCK_ID:
                    continue
                identity = (group_id, candidate.block_hashes[index * per_block + per_block - 1])
                out.append((candidate, size, index, identity))
    return out


def run_pass(step: StoreStep, answers: tuple[bool, ...] | None = None) -> tuple[set[ObjectId], list[ObjectId], int]:
    check = residency_check(step.geometry, step.keyspace, step.candidates, step.reserved)
    if answers is None:
        answers = step.pool.answers(check.keys)
    planned = plan_stores(step.geometry, step.candidates, check, answers, step.reserved)
    flat = [identity for batch in planned.plans for identity in identities_of(batch)]
    return set(flat), flat, planned.skipped_resident


@given(store_steps())
def test_a_store_plan_never_contains_a_block_every_rank_already_holds(step: StoreStep) -> None:
    planned, _, _ = run_pass(step)
    check = residency_check(step.geometry, step.keyspace, step.candidates, step.reserved)
    resident = resident_blocks_from_hits(check, step.pool.answers(check.keys))
    assert not planned & resident
    assert not planned & step.reserved


@given(store_steps())
def test_nothing_that_is_not_resident_is_dropped_and_each_object_is_stored_once(
    step: StoreStep,
) -> None:
    """An object is left out only when reserved, or when some request had its
    block from a cache and every rank holds it (then no request stores it: the
    same identity names the same bytes, whoever computed them)."""
    planned, flat, skipped = run_pass(step)
    assert len(flat) == len(planned), "an object planned twice in one step"
    selected = selected_identities(step)
    checked = {
        identity for candidate, size, index, identity in selected
        if (index + 1) * size <= candidate.cached_tokens and identity not in step.reserved
    }
    resident = {identity for identity in checked if step.pool.held_by_every_rank(*identity)}
    for _, _, _, identity in selected:
        if identity in step.reserved or identity in resident:
            assert identity not in planned
        else:
            assert identity in planned, f"{identity} was dropped without a reason"
    assert skipped == len(resident)


@given(store_steps())
def test_one_lookup_asks_about_each_cached_block_once_and_nothing_else(step: StoreStep) -> None:
    check = residency_check(step.geometry, step.keyspace, step.candidates, step.reserved)
    ranks = step.keyspace.topology.coords()
    assert len(check.identities) == len(set(check.identities))
    assert len(check.keys) == len(check.identities) * len(ranks)
    cached = {
        identity
        for candidate, size, index, identity in selected_identities(step)
        if (index + 1) * size <= candidate.cached_tokens and identity not in step.reserved
    }
    assert set(check.identities) == cached
    for position, (group_id, block_hash) in enumerate(check.identities):
        rows = check.keys[position * len(ranks) : (position + 1) * len(ranks)]
        assert list(rows) == [step.keyspace.key(rank, group_id, block_hash) for rank in ranks]


@given(store_steps(), st.sampled_from(["failed", "short", "long"]))
def test_a_lookup_that_fails_or_answers_the_wrong_length_stores_everything(
    step: StoreStep, how: str
) -> None:
    check = residency_check(step.geometry, step.keyspace, step.candidates, step.reserved)
    answers = {
        "failed": None,
        "short": (True,) * max(len(check.keys) - 1, 0),
        "long": (True,) * (len(check.keys) + 1),
    }[how]
    if how == "short" and not check.keys:
        answers = (True,)
    planned = plan_stores(step.geometry, step.candidates, check, answers, step.reserved)
    flat = {identity for batch in planned.plans for identity in identities_of(batch)}
    expected = {i for _, _, _, i in selected_identities(step) if i not in step.reserved}
    assert flat == expected
    assert planned.skipped_resident == 0


@given(store_steps(), st.data())
def test_an_object_evicted_after_a_check_is_stored_by_the_next_step_that_selects_it(
    step: StoreStep, data: st.DataObject
) -> None:
    """Nothing survives a step: the next pass asks again and stores what went."""
    _, _, _ = run_pass(step)
    check = residency_check(step.geometry, step.keyspace, step.candidates, step.reserved)
    resident = resident_blocks_from_hits(check, step.pool.answers(check.keys))
    evicted = data.draw(st.sets(st.sampled_from(sorted(resident)))) if resident else set()
    survivors = frozenset(
        key for key in step.pool.keys
        if not any(
            key == step.keyspace.key(rank, *identity)
            for identity in evicted for rank in step.keyspace.topology.coords()
        )
    )
    later = StoreStep(step.geometry, step.keyspace, step.candidates, step.reserved,
                      Pool(step.keyspace, survivors))
    planned, _, _ = run_pass(later)
    assert evicted <= planned


def as_ranges(step: StoreStep) -> StoreStep:
    """The same step with every consecutive selection passed as a ``range``, as
    apply_store_masks passes a group whose candidates are all kept."""
    def run(indices: tuple[int, ...]) -> range | tuple[int, ...]:
        if indices and indices == tuple(range(indices[0], indices[-1] + 1)):
            return range(indices[0], indices[-1] + 1)
        return indices

    return replace(step, candidates=tuple(
        replace(c, selected=tuple((g, run(tuple(i))) for g, i in c.selected))
        for c in step.candidates
    ))


@given(store_steps(), st.booleans(), st.booleans())
def test_a_pass_with_contiguous_runs_plans_exactly_as_the_block_by_block_scan(
    step: StoreStep, whole_ranges: bool, events_enabled: bool
) -> None:
    """Several requests sharing objects, some resident, some reserved: the fast
    case gives the same batches and the same skipped count as the scan."""
    if whole_ranges:
        step = as_ranges(step)

    def plan() -> tuple[tuple[StorePlan, ...], int]:
        check = residency_check(step.geometry, step.keyspace, step.candidates, step.reserved)
        planned = plan_stores(
            step.geometry, step.candidates, check, step.pool.answers(check.keys), step.reserved,
            events_enabled=events_enabled,
        )
        return planned.plans, planned.skipped_resident

    fast = plan()
    with mock.patch("umbp.core.stores.request_store._contiguous_group_stores", lambda *_: None):
        scanned = plan()
    assert fast == scanned


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 8), st.integers(0, 8)), max_size=3
    ),
    st.integers(0, 64),
    request_hashes(6),
)
def test_a_window_without_masks_is_its_own_selection(
    spans: list[tuple[int, int, int]], cached_tokens: int, hashes: tuple[bytes, ...]
) -> None:
    """The scheduler's store step builds a request's candidates straight from its
    window when no group has a mask (umbp.shell.store_step): that is what the core
    rule (store_windows.store_candidates) gives for no masks."""
    window = StoreWindow(
        tuple((group, range(start, start + length)) for group, start, length in spans),
        tuple(tuple(range(1, 9)) for _ in spans), cached_tokens,
    )
    direct = StoreCandidates(
        "r", window.ranges, window.block_table, hashes, window.cached_tokens, (),
    )
    assert store_candidates("r", window, {}, hashes, ()).unwrap() == direct


def as_reservations(identities: frozenset[ObjectId], events: int) -> Reservations:
    """The same identities as in-flight events hold them: spread over ``events``
    events, per group a frozenset of hashes each."""
    held: list[dict[int, set[bytes]]] = [{} for _ in range(events)]
    for number, (group_id, block_hash) in enumerate(sorted(identities)):
        held[number % events].setdefault(group_id, set()).add(block_hash)
    return Reservations(tuple(
        {group_id: frozenset(hashes) for group_id, hashes in event.items()}
        for event in held if event
    ))


@given(store_steps(), st.integers(1, 3), st.booleans(), st.booleans())
def test_reservations_per_event_plan_exactly_as_one_set_of_identities(
    step: StoreStep, events: int, whole_ranges: bool, scanned: bool
) -> None:
    """What the scheduler passes (in-flight events' hashes per group,
    core.stores.acks.reserved_identities) plans the same batches, skips and
    residency keys as the plain set of the same identities, on the contiguous
    path and on the block-by-block scan."""
    if whole_ranges:
        step = as_ranges(step)
    reservations = as_reservations(step.reserved, events)
    assert set(reservations) == step.reserved and len(reservations) == len(step.reserved)
    assert bool(reservations) == bool(step.reserved)

    def plan(reserved: frozenset[ObjectId] | Reservations) -> tuple[object, ...]:
        check = residency_check(step.geometry, step.keyspace, step.candidates, reserved)
        planned = plan_stores(
            step.geometry, step.candidates, check, step.pool.answers(check.keys), reserved
        )
        return tuple(check.keys), check.identities, planned.plans, planned.skipped_resident

    with mock.patch(
        "umbp.core.stores.request_store._contiguous_group_stores",
        (lambda *_: None) if scanned else _contiguous_group_stores,
    ):
        assert plan(reservations) == plan(step.reserved)


@given(store_steps(), st.booleans())
def test_a_pass_with_nothing_resident_or_reserved_plans_whole_runs_as_store_batch_does(
    step: StoreStep, whole_ranges: bool
) -> None:
    """plan_stores takes a one-group request's whole run by whole_run_plan when
    nothing is resident, reserved or evented (the usual step): the same batches as
    store_plan for every request, requests sharing objects included."""
    if whole_ranges:
        step = as_ranges(step)
    check = residency_check(step.geometry, step.keyspace, step.candidates)

    def plan() -> tuple[tuple[StorePlan, ...], int]:
        planned = plan_stores(step.geometry, step.candidates, check, None)
        return planned.plans, planned.skipped_resident

    fast = plan()
    with mock.patch("umbp.core.stores.step.whole_run_plan", lambda *_: None):
        assert fast == plan()


@given(store_steps(), st.booleans())
def test_a_whole_run_batch_is_store_batchs_batch_and_record_or_nothing(
    step: StoreStep, whole_ranges: bool
) -> None:
    """Request by request through one pass's record: whenever whole_run_plan
    answers, store_plan (with nothing resident or reserved) gives the same batch
    and the same record; when it does not, the record is unchanged."""
    if whole_ranges:
        step = as_ranges(step)
    record: dict[int, set[bytes]] = {}
    for candidate in step.candidates:
        before = {group_id: set(hashes) for group_id, hashes in record.items()}
        fast = whole_run_plan(
            candidate.request_id, step.geometry, candidate.selected, candidate.block_table,
            candidate.block_hashes, record,
        )
        after = {group_id: set(hashes) for group_id, hashes in record.items()}
        plain_record = {group_id: set(hashes) for group_id, hashes in before.items()}
        plain = store_plan(
            candidate.request_id, step.geometry, candidate.selected, candidate.block_table,
            candidate.block_hashes, planned=plain_record,
        )
        if fast is None:
            assert {g: h for g, h in after.items() if h} == {g: h for g, h in before.items() if h}
            record = plain_record  # the pass goes on as store_plan left it
        else:
            assert fast == plain
            assert {g: h for g, h in after.items() if h} == {
                g: h for g, h in plain_record.items() if h
            }


@given(st.lists(st.lists(st.integers(0, 99), max_size=5), min_size=1, max_size=4), st.data())
def test_a_block_table_is_a_copy_of_vllms_lists_of_umbps_groups(
    block_ids: list[list[int]], data: st.DataObject
) -> None:
    """core.geometry.block_table_of copies one group's list directly (the fast path
    the shell's admission, store step and tails take): the same table as the
    per-group copy, for one group or several, and vLLM appending to its lists
    later does not change it."""
    from umbp.core.geometry import block_table_of

    group_ids = tuple(data.draw(
        st.lists(st.sampled_from(range(len(block_ids))), unique=True, min_size=1)
    ))
    expected = tuple(tuple(block_ids[g]) for g in group_ids)
    table = block_table_of(block_ids, group_ids)
    assert table == expected
    for group in block_ids:
        group.append(7)
    assert table == expected
