"""Properties of KV-event reconciliation (umbp.core.kv_events).

A random sequence of stores, residency checks (answered at once, late, or not at
all), invalidations and clears runs against the tracker while a model of what
subscribers have been told checks every event. The invariants are in the names of
the checks below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from umbp.core.identity import ObjectId
from umbp.core.kv_events import (
    BlockRemovedEvent,
    BlockStoredEvent,
    EventTracker,
    KvEvent,
    ResidencyCandidate,
    StoredObject,
    apply_residency,
    clear,
    fold_residency,
    has_pending,
    new_event_tracker,
    residency_batch,
    sweep_due,
    track_stored,
)
from umbp.core.rank_keys import KeyLayout

GROUPS = (0, 1)
HASHES = tuple(bytes([index]) * 8 for index in range(6))
identities = st.tuples(st.sampled_from(GROUPS), st.sampled_from(HASHES))


def _stored(
    identity: ObjectId, parent: bytes | None, tokens: tuple[int, ...], size: int, medium: str
) -> StoredObject:
    return StoredObject(identity[0], identity[1], parent, tokens, size, medium)


stored_objects = st.builds(
    _stored,
    identities,
    st.none() | st.sampled_from(HASHES),
    st.lists(st.integers(0, 50_000), max_size=4).map(tuple),
    st.sampled_from([16, 32]),
    st.sampled_from(["CPU", "DISK"]),
)


def event_identity(event: KvEvent) -> ObjectId:
    assert len(event.block_hashes) == 1
    return (event.group_id, event.block_hashes[0])


def check_structure(state: EventTracker) -> None:
    """The tracker's own invariants: queues and records agree."""
    records = dict(state.objects.items())
    assert len(records) <= state.max_objects
    assert len(state.objects) == len(records)
    pending = {record.serial: identity for identity, record in records.items() if record.pending}
    assert dict(state.pending_queue.items()) == pending
    rotation = {record.turn: identity for identity, record in records.items() if record.published}
    assert dict(state.rotation.items()) == rotation
    assert has_pending(state) == bool(pending)
    assert sweep_due(state) == any(
        record.turn < state.sweep_before for record in records.values() if record.published
    ), "a sweep is due exactly while a published object was last checked before a store"
    for record in records.values():
        assert record.published or record.pending, "an unpublished object awaits its check"
        assert (record.stored is None) == record.published
        assert record.published or record.turn == -1
    serials = [record.serial for record in records.values()]
    turns = [record.turn for record in records.values() if record.published]
    assert len(set(serials + turns)) == len(serials) + len(turns), "tickets are unique"
    assert all(ticket < state.next_ticket for ticket in serials + turns)
    assert state.pending_head == (min(pending) if pending else state.next_ticket)
    assert state.rotation_head == (min(rotation) if rotation else state.next_ticket)


class EventReconciliation(RuleBasedStateMachine):
    batches = Bundle("batches")

    def __init__(self) -> None:
        super().__init__()
        self.state = new_event_tracker(4)
        self.told_stored: set[ObjectId] = set()  # announced and not since removed
        self.forgotten: set[ObjectId] = set()  # cleared, not stored since
        self.latest: dict[ObjectId, StoredObject] = {}
        self.medium_told: dict[ObjectId, str] = {}

    # -------------------------------------------------------------- rules

    @initialize(max_objects=st.integers(1, 8))
    def choose_limit(self, max_objects: int) -> None:
        self.state = new_event_tracker(max_objects)

    @rule(
        objects=st.lists(stored_objects, max_size=8), failed=st.frozensets(identities, max_size=3)
    )
    def store(self, objects: list[StoredObject], failed: frozenset[ObjectId]) -> None:
        before = self.state
        after = track_stored(before, objects, failed)
        tracked = set(before.objects.keys())
        rejected = 0
        seen: set[ObjectId] = set()
        for stored in objects:
            identity = stored.identity
            if identity in seen or identity in failed:
                continue
            seen.add(identity)
            if identity not in tracked:
                if len(tracked) >= before.max_objects:
                    rejected += 1
                    continue
                tracked.add(identity)
            self.forgotten.discard(identity)
            record = after.objects[identity]
            assert record.pending, "a stored object is (re)checked"
            was = before.objects.get(identity)
            assert record.published == (was is not None and was.published), "published flag kept"
            if not record.published:
                self.latest[identity] = stored
        # Tracked objects never exceed max_objects; each rejected new identity is counted.
        assert set(after.objects.keys()) == tracked
        assert len(tracked) <= after.max_objects
        assert after.suppressed == before.suppressed + rejected
        # A store may have evicted anything published before it: all of it is due.
        assert all(record.turn < after.sweep_before
                   for record in after.objects.values() if record.published)
        self.state = after

    @rule(target=batches, size=st.integers(1, 6), recheck=st.booleans())
    def draw_batch(self, size: int, recheck: bool) -> tuple[ResidencyCandidate, ...]:
        batch = residency_batch(self.state, size, recheck)
        self._check_batch(batch, size, recheck)
        return batch

    @rule(batch=batches, data=st.data())
    def answer_late(self, batch: tuple[ResidencyCandidate, ...], data: st.DataObject) -> None:
        """An answer to a batch drawn earlier; the tracker may have moved on since."""
        self._answer(batch, data)

    @rule(size=st.integers(1, 6), recheck=st.booleans(), data=st.data())
    def draw_and_answer(self, size: int, recheck: bool, data: st.DataObject) -> None:
        batch = residency_batch(self.state, size, recheck)
        self._check_batch(batch, size, recheck)
        self._answer(batch, data)

    @rule()
    def pool_cleared(self) -> None:
        before = self.state
        self.state = clear(before)
        assert len(self.state.objects) == 0 and not has_pending(self.state)
        assert self.state.suppressed == before.suppressed
        # The shell announces the clear as a whole (AllBlocksCleared).
        self.forgotten |= set(before.objects.keys())
        self.told_stored.clear()

    @rule(size=st.integers(1, 6), data=st.data())
    def sweep_with_a_fixed_oracle(self, size: int, data: st.DataObject) -> None:
        """With fixed residency answers, every tracked object is visited within
        ceil(n / batch) rounds."""
        tracked = sorted(self.state.objects.keys())
        oracle = {identity: data.draw(st.booleans()) for identity in tracked}
        visited: set[ObjectId] = set()
        for _ in range(math.ceil(len(tracked) / size)):
            batch = residency_batch(self.state, size, True)
            self._check_batch(batch, size, True)
            visited |= {identity for identity, _ in batch}
            self._apply(batch, [oracle[identity] for identity, _ in batch])
        assert set(tracked) <= visited
        assert not sweep_due(self.state), "the sweep a store made due ends"

    # -------------------------------------------------------------- checks

    def _check_batch(self, batch: Sequence[ResidencyCandidate], size: int, recheck: bool) -> None:
        assert len(batch) <= size
        assert len({identity for identity, _ in batch}) == len(batch)
        for identity, serial in batch:
            record = self.state.objects[identity]
            assert record.serial == serial
            assert recheck or record.pending, "published objects wait for a recheck round"
        pending = [identity for identity, record in self.state.objects.items() if record.pending]
        if not recheck:
            assert len(batch) == min(size, len(pending))

    def _answer(self, batch: tuple[ResidencyCandidate, ...], data: st.DataObject) -> None:
        answer = data.draw(
            st.none() | st.lists(st.booleans(), min_size=len(batch), max_size=len(batch)),
            label="resident",
        )
        self._apply(batch, answer)

    def _apply(self, batch: Sequence[ResidencyCandidate], answer: Sequence[bool] | None) -> None:
        before = self.state
        after, events = apply_residency(before, batch, answer)
        expected: list[tuple[type, ObjectId]] = []
        for index, (identity, serial) in enumerate(batch):
            was = before.objects.get(identity)
            now = after.objects.get(identity)
            if was is None or was.serial != serial:
                # Stored again or forgotten since the batch was drawn: untouched.
                assert now == was
                continue
            if answer is None:
                # A failed check keeps published objects and drops unpublished ones.
                if was.published:
                    assert now is not None and now.published and not now.pending
                else:
                    assert now is None
            elif not answer[index]:
                assert now is None
                if was.published:
                    expected.append((BlockRemovedEvent, identity))
            else:
                assert now is not None and now.published and not now.pending
                if not was.published:
                    expected.append((BlockStoredEvent, identity))
        assert [(type(event), event_identity(event)) for event in events] == expected
        self._observe(events)
        self.state = after

    def _observe(self, events: Sequence[KvEvent]) -> None:
        for event in events:
            identity = event_identity(event)
            assert identity not in self.forgotten, (
                "invalidated objects are never reported later unless stored again"
            )
            if isinstance(event, BlockStoredEvent):
                assert identity not in self.told_stored, (
                    "never publishes an object twice without a removal between"
                )
                stored = self.latest[identity]
                assert event == BlockStoredEvent(
                    stored.group_id,
                    (stored.block_hash,),
                    stored.parent_block_hash,
                    stored.token_ids,
                    stored.block_size,
                    stored.medium,
                ), "the announcement carries the latest store's payload"
                self.told_stored.add(identity)
                self.medium_told[identity] = stored.medium
            else:
                assert identity in self.told_stored, "never removes an object it never published"
                assert event.medium == self.medium_told[identity]
                self.told_stored.discard(identity)

    @invariant()
    def tracker_structure_is_consistent(self) -> None:
        check_structure(self.state)

    @invariant()
    def published_objects_are_exactly_those_announced_and_not_removed(self) -> None:
        published = {
            identity for identity, record in self.state.objects.items() if record.published
        }
        assert published == self.told_stored


TestEventReconciliation = EventReconciliation.TestCase
TestEventReconciliation.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------ larger sweeps


@st.composite
def busy_trackers(draw: st.DrawFn) -> EventTracker:
    """A tracker with up to a few hundred objects after a random history: some
    published, some pending, some both, with holes in both queues."""
    state = new_event_tracker(draw(st.integers(1, 400)))
    universe = draw(st.integers(1, 500))
    for _ in range(draw(st.integers(1, 8))):
        keys = draw(st.lists(st.integers(0, universe), max_size=120))
        state = track_stored(
            state,
            [StoredObject(key % 3, key.to_bytes(4, "big"), None, (), 16, "CPU") for key in keys],
        )
        batch = residency_batch(state, draw(st.integers(1, 64)), draw(st.booleans()))
        answer = draw(st.none() | st.lists(st.booleans(), min_size=len(batch), max_size=len(batch)))
        state, _ = apply_residency(state, batch, answer)
    check_structure(state)
    return state


@settings(max_examples=60, deadline=None)
@given(busy_trackers(), st.integers(1, 64), st.randoms(use_true_random=False))
def test_with_a_fixed_residency_oracle_every_tracked_object_is_visited_within_ceil_n_over_batch_rounds(
    state: EventTracker, batch_size: int, random: object
) -> None:
    tracked = set(state.objects.keys())
    oracle = {identity: random.random() < 0.8 for identity in sorted(tracked)}  # type: ignore[attr-defined]
    visited: set[ObjectId] = set()
    for _ in range(math.ceil(len(tracked) / batch_size)):
        batch = residency_batch(state, batch_size, True)
        assert len(batch) == min(batch_size, len(state.objects))
        visited |= {identity for identity, _ in batch}
        state, _ = apply_residency(state, batch, [oracle[identity] for identity, _ in batch])
        check_structure(state)
    assert tracked <= visited


@settings(max_examples=60, deadline=None)
@given(busy_trackers(), st.integers(2, 64))
def test_a_recheck_round_gives_published_objects_up_to_half_the_batch_before_fresher_pending_ones(
    state: EventTracker, batch_size: int
) -> None:
    batch = residency_batch(state, batch_size, True)
    published = [identity for identity, _ in batch if state.objects[identity].published]
    pending = [identity for identity, record in state.objects.items() if record.pending]
    overdue = [
        identity
        for identity, record in state.objects.items()
        if record.published and (not pending or record.turn < state.pending_head)
    ]
    # Published objects checked longer ago than the oldest pending object was stored
    # are never crowded out by pending ones.
    assert len(published) >= min(batch_size // 2, len(overdue))


@given(st.integers(1, 6), st.lists(stored_objects, max_size=8))
def test_an_answer_of_the_wrong_length_counts_as_a_failed_check(
    size: int, objects: list[StoredObject]
) -> None:
    state = track_stored(new_event_tracker(8), objects)
    batch = residency_batch(state, size, True)
    short = [True] * max(0, len(batch) - 1)
    assert apply_residency(state, batch, short) == apply_residency(state, batch, None)


def test_an_empty_tracker_draws_an_empty_batch() -> None:
    assert residency_batch(new_event_tracker(), 256, True) == ()
    assert residency_batch(new_event_tracker(), 0, True) == ()


@given(stored_objects, st.lists(st.sampled_from(["CPU", "DISK"]), min_size=1, max_size=5))
def test_with_tier_media_stored_names_where_the_object_is_and_removed_the_last_tier_seen(
    stored: StoredObject, seen: list[str]
) -> None:
    state = track_stored(new_event_tracker(8), [stored], frozenset())
    announced: list[KvEvent] = []
    for medium in seen:  # the object moves between tiers: never an event of its own
        batch = residency_batch(state, 8, True)
        state, events = apply_residency(state, batch, [True], [medium])
        announced.extend(events)
    state, events = apply_residency(state, residency_batch(state, 8, True), [False], ["CPU"])
    announced.extend(events)
    assert [type(event) for event in announced] == [BlockStoredEvent, BlockRemovedEvent]
    assert announced[0].medium == seen[0]
    assert announced[1].medium == seen[-1]
    assert len(state.objects) == 0


# ------------------------------------------------------ folding a residency answer


@st.composite
def residency_answers(
    draw: st.DrawFn,
) -> tuple[int, int, list[bool | str | None]]:
    """(objects, ranks, object-major per-key answers): all bools (a lookup) or all
    media / None (a tiered store's ``where``)."""
    objects, ranks = draw(st.integers(0, 6)), draw(st.integers(1, 4))
    cell = st.booleans() if draw(st.booleans()) else st.sampled_from(["CPU", "DISK", None])
    return objects, ranks, draw(st.lists(cell, min_size=objects * ranks, max_size=objects * ranks))


@given(residency_answers())
def test_an_object_is_resident_on_every_rank_and_on_disk_when_any_shard_is(
    case: tuple[int, int, list[bool | str | None]],
) -> None:
    objects, ranks, per_key = case
    folded = fold_residency(
        KeyLayout.objects(objects, ranks), per_key, disk_medium="DISK", memory_medium="CPU"
    )
    assert folded is not None
    resident, media = folded
    shards = [per_key[i * ranks:(i + 1) * ranks] for i in range(objects)]
    assert resident == [all(v is not None and v is not False for v in s) for s in shards]
    if not any(isinstance(value, str) for value in per_key):
        assert media is None
    else:
        assert media == ["DISK" if "DISK" in s else "CPU" for s in shards]


@given(residency_answers(), st.integers(1, 3))
def test_an_answer_that_does_not_fit_the_batch_knows_nothing(
    case: tuple[int, int, list[bool | str | None]], missing: int,
) -> None:
    objects, ranks, per_key = case
    layout = KeyLayout.objects(objects, ranks)
    for wrong in (per_key[missing:], [*per_key, *[True] * missing]):
        if len(wrong) != len(per_key):
            assert fold_residency(layout, wrong, disk_medium="DISK", memory_medium="CPU") is None


# ------------------------------------------------------------------ a check older than a store


@given(size=st.integers(1, 8), evicted=st.booleans())
def test_an_answer_drawn_before_a_store_does_not_end_its_sweep(size: int, evicted: bool) -> None:
    """A residency check drawn before a store can answer resident for an object the
    store then evicted (the lookup ran first). Applied after the store was tracked, it
    must leave the object due for a check, so the sweep asks again and the eviction is
    announced; a check drawn after the store ends the sweep."""
    published = (0, b"\x01")
    state = track_stored(new_event_tracker(), [_stored(published, None, (), 16, "CPU")])
    state, _ = apply_residency(state, residency_batch(state, size, True), [True])
    stale = residency_batch(state, size, True)
    drawn_at = state.next_ticket
    state = track_stored(state, [_stored((0, b"\x02"), None, (), 16, "CPU")])
    assert sweep_due(state)
    state, _ = apply_residency(state, stale, [True] * len(stale), drawn_at=drawn_at)
    assert sweep_due(state), "a check older than the store ended its sweep"
    fresh = residency_batch(state, 8, True)
    answer = [not (evicted and identity == published) for identity, _ in fresh]
    drawn_at = state.next_ticket
    state, events = apply_residency(state, fresh, answer, drawn_at=drawn_at)
    assert not sweep_due(state)
    removed = [e for e in events if isinstance(e, BlockRemovedEvent)]
    assert [e.block_hashes for e in removed] == ([(published[1],)] if evicted else [])
