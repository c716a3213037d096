"""KV cache events: which BlockStored / BlockRemoved to publish for pooled objects.

An object (one KV block of one cache group) is *tracked* once all workers stored
it, and *published* (one ``BlockStoredEvent``) only after a residency check finds
it in the pool on every rank: a store may have failed on one rank or the object
may already have been evicted. Published objects are re-checked in rotation and a
``BlockRemovedEvent`` follows once one is gone. The shell draws a batch with
:func:`residency_batch`, looks the batch's keys up (off the scheduler thread),
folds the answers over ranks (:func:`fold_residency`) and
hands them to :func:`apply_residency`; state may change in between, so every
candidate carries the serial it was drawn with and is skipped if the object was
stored again or forgotten meanwhile.

Ordering is kept with tickets from one clock instead of an ordered dict. A tracked
object gets a new ticket, its *serial*, on every store; pending objects queue by
serial. A published object holds a second ticket, its rotation *turn*, renewed
whenever it is checked. Both queues are ``pmap``s from ticket to identity plus a
head ticket that skips the holes left by objects that moved on, so drawing a batch
costs O(batch log n) amortised, with n up to ``max_objects``. Because serials and
turns share one clock, "checked longer ago than the oldest pending object was
stored" is a comparison of two tickets, and so is "checked before the last store"
(:func:`sweep_due`): a store may evict published objects to make room, so after one
every published object is due for a check, and the shell keeps checking until none
is, even when the engine has nothing else to do.

A round's cost and the cyclic GC's share of it are in docs/performance.md (KV
events); a sharded map (many small pmaps) was tried there and was slower.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Final, TypeAlias, TypeVar

from pyrsistent import pmap
from pyrsistent.typing import PMap, PMapEvolver

from umbp.core.identity import ObjectId
from umbp.core.plans import StorePlan
from umbp.core.rank_keys import KeyLayout, fold_ranks

__all__ = [
    "DEFAULT_MAX_OBJECTS",
    "BlockRemovedEvent",
    "BlockStoredEvent",
    "EventTracker",
    "KvEvent",
    "ResidencyCandidate",
    "StoredObject",
    "TrackedObject",
    "apply_residency",
    "clear",
    "fold_residency",
    "has_pending",
    "new_event_tracker",
    "residency_batch",
    "stored_objects",
    "sweep_due",
    "track_stored",
]

DEFAULT_MAX_OBJECTS: Final = 65536

ResidencyCandidate: TypeAlias = tuple[ObjectId, int]
"""An object to check and the serial it had when the batch was drawn."""


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object all workers stored, with what its BlockStored event needs."""

    group_id: int
    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str

    @property
    def identity(self) -> ObjectId:
        return (self.group_id, self.block_hash)


def stored_objects(plan: StorePlan, medium: str) -> tuple[StoredObject, ...]:
    """The objects a store plan wrote, with what their BlockStored events need (the
    plan's facts; a plan built without them announces no parent and no tokens)."""
    objects: list[StoredObject] = []
    for index, group in enumerate(plan.groups):
        facts = None if plan.facts is None else plan.facts[index]
        for row, block_hash in enumerate(group.block_hashes):
            objects.append(StoredObject(
                group.group_id, block_hash,
                None if facts is None else facts.parent_hashes[row],
                () if facts is None else facts.token_ids[row],
                group.block_size, medium,
            ))
    return tuple(objects)


@dataclass(frozen=True, slots=True)
class BlockStoredEvent:
    group_id: int
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str


@dataclass(frozen=True, slots=True)
class BlockRemovedEvent:
    group_id: int
    block_hashes: tuple[bytes, ...]
    medium: str


KvEvent: TypeAlias = BlockStoredEvent | BlockRemovedEvent


@dataclass(frozen=True, slots=True)
class TrackedObject:
    """What is known about one tracked object.

    Invariants: an unpublished object is pending; ``stored`` is kept only until
    the object is published; ``turn`` is its rotation ticket while published.
    """

    serial: int
    published: bool
    pending: bool
    stored: StoredObject | None
    medium: str
    turn: int = -1


@dataclass(frozen=True, slots=True)
class EventTracker:
    """Tracked objects and the two check queues (pending by serial, published by turn)."""

    max_objects: int
    objects: PMap[ObjectId, TrackedObject]
    pending_queue: PMap[int, ObjectId]
    pending_head: int
    rotation: PMap[int, ObjectId]
    rotation_head: int
    next_ticket: int
    suppressed: int = 0
    """New objects not tracked because ``max_objects`` were tracked already."""
    sweep_before: int = 0
    """Published objects whose turn is older than this ticket were last checked
    before the latest store, which may have evicted them."""


_EMPTY_OBJECTS: Final[PMap[ObjectId, TrackedObject]] = pmap()
_EMPTY_QUEUE: Final[PMap[int, ObjectId]] = pmap()


def new_event_tracker(max_objects: int = DEFAULT_MAX_OBJECTS) -> EventTracker:
    if max_objects < 1:
        raise ValueError(f"max_objects must be >= 1, got {max_objects}")
    return EventTracker(max_objects, _EMPTY_OBJECTS, _EMPTY_QUEUE, 1, _EMPTY_QUEUE, 1, 1)


def has_pending(state: EventTracker) -> bool:
    """Whether some tracked object still awaits its first (or a repeated) check."""
    return len(state.pending_queue) > 0


def sweep_due(state: EventTracker) -> bool:
    """Whether some published object was last checked before the latest store."""
    return len(state.rotation) > 0 and state.rotation_head < state.sweep_before


def clear(state: EventTracker) -> EventTracker:
    """Forget every object (the pool was cleared); the suppression count is kept."""
    return replace(new_event_tracker(state.max_objects), suppressed=state.suppressed)


def track_stored(
    state: EventTracker,
    objects: Sequence[StoredObject],
    failed: frozenset[ObjectId] = frozenset(),
) -> EventTracker:
    """Track the objects of one completed store event; each becomes pending.

    Objects some worker failed to store are skipped. A new identity is not tracked
    once ``max_objects`` are (counted in ``suppressed``); an identity already
    tracked is stored again: new serial, pending, published flag kept. Every
    object published before it is due for a check (:func:`sweep_due`).
    """
    edit = _Edit(state)
    # A ticket of its own: a batch drawn before this store (at a ticket <= it) is stale.
    edit.sweep_before = edit.take_ticket()
    seen: set[ObjectId] = set()
    for stored in objects:
        identity = stored.identity
        if identity in seen or identity in failed:
            continue
        seen.add(identity)
        previous = _get(edit.objects, identity)
        if previous is None and len(edit.objects) >= state.max_objects:
            edit.suppressed += 1
            continue
        if previous is not None and previous.pending:
            edit.unqueue_pending(previous.serial)
        serial = edit.take_ticket()
        if previous is not None and previous.published:
            # Published already: keep its rotation turn; its event payload is spent.
            record = replace(previous, serial=serial, pending=True)
        else:
            record = TrackedObject(serial, False, True, stored, stored.medium)
        edit.objects[identity] = record
        edit.pending_queue[serial] = identity
    return edit.finish()


def residency_batch(
    state: EventTracker, batch_size: int, recheck_published: bool
) -> tuple[ResidencyCandidate, ...]:
    """The next objects to check: pending ones in store order and, when
    ``recheck_published``, published ones, least recently checked first.

    Up to half the batch goes first to published objects checked longer ago than
    the oldest pending object was stored, so neither queue starves the other;
    pending objects fill the rest, and published ones take what pending ones leave
    free (the reference left those slots idle). Hence, with a fixed residency
    answer and ``recheck_published`` every round, no object is checked twice
    before every other has been checked once: each of n tracked objects is in some
    batch within ceil(n / batch_size) rounds.
    """
    if batch_size < 1 or not state.objects:
        return ()
    objects = state.objects
    chosen: dict[ObjectId, int] = {}
    oldest_pending = state.pending_head if state.pending_queue else state.next_ticket
    if recheck_published:
        for turn, identity in _queued(state.rotation, state.rotation_head, state.next_ticket):
            if len(chosen) >= batch_size // 2 or turn > oldest_pending:
                break
            chosen[identity] = objects[identity].serial
    for _, identity in _queued(state.pending_queue, state.pending_head, state.next_ticket):
        if len(chosen) >= batch_size:
            break
        if identity not in chosen:
            chosen[identity] = objects[identity].serial
    if recheck_published:
        for _, identity in _queued(state.rotation, state.rotation_head, state.next_ticket):
            if len(chosen) >= batch_size:
                break
            if identity not in chosen:
                chosen[identity] = objects[identity].serial
    return tuple(chosen.items())


def apply_residency(
    state: EventTracker,
    batch: Sequence[ResidencyCandidate],
    resident: Sequence[bool] | None,
    media: Sequence[str] | None = None,
    drawn_at: int | None = None,
) -> tuple[EventTracker, tuple[KvEvent, ...]]:
    """Fold one residency answer (per object, all ranks folded) into the tracker.

    ``media``, from a store with several tiers, says where each resident object is
    now: BlockStored names that medium, and BlockRemoved the last one seen (a move
    between tiers is not an event: the object is still resident). Without it, the
    medium recorded at store time is used.

    ``resident`` is None when the check failed; an answer of the wrong length
    counts as failed. A failed check keeps published objects (checked again later)
    and drops unpublished ones, which are never announced. Objects stored again or
    forgotten since the batch was drawn are skipped.

    ``drawn_at``: the tracker's ``next_ticket`` when the batch was drawn. An answer
    drawn before a store tracked since (which may have evicted what it calls resident)
    does not end that store's sweep: the objects it rotates stay due for a check.
    """
    if resident is not None and len(resident) != len(batch):
        resident = None
    if media is not None and len(media) != len(batch):
        media = None
    edit = _Edit(state)
    events: list[KvEvent] = []
    for index, (identity, serial) in enumerate(batch):
        record = _get(edit.objects, identity)
        if record is None or record.serial != serial:
            continue
        if resident is None:
            if record.published:
                edit.rotate(identity, record, record.medium)
            else:
                edit.forget(identity, record)
            continue
        group_id, block_hash = identity
        if not resident[index]:
            if record.published:
                events.append(BlockRemovedEvent(group_id, (block_hash,), record.medium))
            edit.forget(identity, record)
            continue
        medium = record.medium if media is None else media[index]
        if not record.published:
            stored = record.stored
            assert stored is not None, "an unpublished object keeps its payload"
            events.append(
                BlockStoredEvent(
                    group_id,
                    (block_hash,),
                    stored.parent_block_hash,
                    stored.token_ids,
                    stored.block_size,
                    medium,
                )
            )
        edit.rotate(identity, record, medium)
    if drawn_at is not None and drawn_at <= state.sweep_before:
        edit.sweep_before = edit.take_ticket()
    return edit.finish(), tuple(events)


def fold_residency(
    layout: KeyLayout,
    per_key: Sequence[bool | str | None],
    *,
    disk_medium: str,
    memory_medium: str,
) -> tuple[list[bool], list[str] | None] | None:
    """One residency batch's per-key answers (object-major, every rank's key of an
    object together: ``layout``) as :func:`apply_residency` takes them.

    An object is resident only when every rank's shard is; an answer is a bool
    (``lookup``) or the medium holding the shard, None for missing (a tiered
    store's ``where``). With media, an object's medium is ``disk_medium`` when any
    rank's shard is there (its load would read from disk), else ``memory_medium``;
    plain answers name no medium. None when the answer does not fit the layout:
    nothing is known, as after a failed check.
    """
    resident = fold_ranks(layout, [value is not None and value is not False for value in per_key])
    if resident is None:
        return None
    if not any(isinstance(value, str) for value in per_key):
        return list(resident[0]), None
    on_disk = fold_ranks(layout, [value == disk_medium for value in per_key], any)
    assert on_disk is not None  # the same length as the resident fold's
    return list(resident[0]), [disk_medium if disk else memory_medium for disk in on_disk[0]]


# ---------------------------------------------------------------------------

_K = TypeVar("_K")
_V = TypeVar("_V")


def _get(evolver: PMapEvolver[_K, _V], key: _K) -> _V | None:
    try:
        return evolver[key]
    except KeyError:
        return None


def _queued(
    queue: PMap[int, ObjectId], head: int, end: int
) -> Iterator[tuple[int, ObjectId]]:
    """(ticket, identity) of a ticket queue in ticket order, skipping holes."""
    remaining = len(queue)
    ticket = head
    while remaining and ticket < end:
        identity = queue.get(ticket)
        if identity is not None:
            remaining -= 1
            yield ticket, identity
        ticket += 1


class _Edit:
    """Batched changes to one tracker, producing the next one. Local mutation of
    evolvers only; nothing is shared with the caller's value."""

    __slots__ = ("_state", "next_ticket", "objects", "pending_queue", "rotation", "suppressed",
                 "sweep_before")

    def __init__(self, state: EventTracker) -> None:
        self._state = state
        self.objects = state.objects.evolver()
        self.pending_queue = state.pending_queue.evolver()
        self.rotation = state.rotation.evolver()
        self.next_ticket = state.next_ticket
        self.suppressed = state.suppressed
        self.sweep_before = state.sweep_before

    def take_ticket(self) -> int:
        ticket = self.next_ticket
        self.next_ticket += 1
        return ticket

    def unqueue_pending(self, serial: int) -> None:
        del self.pending_queue[serial]

    def rotate(self, identity: ObjectId, record: TrackedObject, medium: str) -> None:
        """Checked and resident (or published and the check failed): published, not
        pending, at the back of the rotation."""
        if record.pending:
            self.unqueue_pending(record.serial)
        if record.turn >= 0:
            del self.rotation[record.turn]
        turn = self.take_ticket()
        self.rotation[turn] = identity
        self.objects[identity] = TrackedObject(
            record.serial, True, False, None, medium, turn
        )

    def forget(self, identity: ObjectId, record: TrackedObject) -> None:
        if record.pending:
            self.unqueue_pending(record.serial)
        if record.turn >= 0:
            del self.rotation[record.turn]
        del self.objects[identity]

    def finish(self) -> EventTracker:
        pending_queue = self.pending_queue.persistent()
        rotation = self.rotation.persistent()
        state = self._state
        return EventTracker(
            max_objects=state.max_objects,
            objects=self.objects.persistent(),
            pending_queue=pending_queue,
            pending_head=_advance(pending_queue, state.pending_head, self.next_ticket),
            rotation=rotation,
            rotation_head=_advance(rotation, state.rotation_head, self.next_ticket),
            next_ticket=self.next_ticket,
            suppressed=self.suppressed,
            sweep_before=self.sweep_before,
        )


def _advance(queue: PMap[int, ObjectId], head: int, end: int) -> int:
    """Move a queue's head past tickets that left it. Each ticket is passed once
    over the tracker's life, so this is amortised O(1) per ticket issued."""
    if not queue:
        return end
    while head < end and head not in queue:
        head += 1
    return head
