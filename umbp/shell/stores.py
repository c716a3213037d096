"""A worker's stores: blocks the steps computed, into the store.

``wait_for_save`` hands a step's stores over (:meth:`StoreQueue.add`). They are
submitted at the start of the next step (:meth:`StoreQueue.submit`, from
``start_load_kv``, after that step's forward mark), as vLLM's own offloading does: the
copy then reads the blocks after the forward pass that wrote them and after the token
sampling vLLM issues at the end of the step, which it does not delay. What is submitted
stays within the in-flight budget (``store_inflight_bytes``) and, through staging,
within the staging area; the rest waits in the queue for a later step. The model thread
never waits for room: the scheduler keeps the source blocks pinned until the store is
reported, so a store submitted later reads the same bytes.

In place (the embedded pool): rows are reserved on the model thread (an in-process
index operation), the copy moves each byte once, from the KV blocks into them, and a host
job beside the copy commits them (checksums, published) once its event completed.
Through staging: the copy fills a slot of the staging area (hashing what it writes,
for a store that takes a copy's checksums), then the put runs on the store I/O lane and
the slot goes back. A store event's result reaches the scheduler once
every piece of it finished.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from umbp.core.identity import ObjectId
from umbp.core.plans import GroupBlocks, StorePlan
from umbp.core.stores.acks import StoreEventResult
from umbp.core.stores.results import failed_store_identities
from umbp.gpu.device import Event
from umbp.gpu.lanes import Lane
from umbp.gpu.staging import StagingSlot
from umbp.runtime.paged_copy import Hashes
from umbp.shell.store_io import GroupTarget, copied_checksums
from umbp.shell.transfer_context import MAX_PIECE_OBJECTS, TransferContext

logger = logging.getLogger("umbp")

__all__ = ["StoreQueue", "StoreTally"]


@dataclass(slots=True, eq=False)
class _Event:
    """One store event: what failed so far, and its pieces not finished."""

    event: int
    failed: set[ObjectId]
    queued: int
    """Groups (or rests of groups) not yet submitted whole."""
    running: int = 0
    """Pieces submitted and not finished."""


@dataclass(slots=True, eq=False)
class _Work:
    """Blocks ``start:`` of one group of a store event, not yet submitted."""

    owner: _Event
    group: GroupBlocks
    start: int = 0


@dataclass(slots=True)
class StoreTally:
    """What the stores did, counted where they finish."""

    stored_blocks: int = 0
    stored_bytes: int = 0
    failures: int = 0
    seconds: float = 0.0
    deferrals: int = 0
    """Times queued stores waited for a later step (budget or staging full)."""
    in_flight_bytes: int = 0


@dataclass(slots=True, eq=False)
class _Piece:
    work: _Work
    group: GroupBlocks
    nbytes: int
    submitted: float
    in_place: bool = False
    target: GroupTarget | None = None
    slot: StagingSlot | None = None
    identities: tuple[ObjectId, ...] = field(default_factory=tuple)
    hashes: Hashes | None = None
    """Where the copy into reserved pages, or into staging rows for a store that takes
    a copy's checksums, hashes what it writes: the checksums of the objects at
    ``hashed``, in order (the store then need not read them back)."""
    hashed: tuple[int, ...] = ()


class StoreQueue:
    """The stores handed over and not yet finished. ``add`` and ``submit`` on the model
    thread; pieces finish on host threads and report through ``on_result``."""

    def __init__(
        self, ctx: TransferContext, budget_bytes: int, store_lane: Lane,
        on_result: Callable[[int, StoreEventResult], None],
    ) -> None:
        self._ctx = ctx
        self._budget = budget_bytes
        self._store_lane = store_lane
        self._on_result = on_result
        self._queue: deque[_Work] = deque()
        self._lock = threading.Condition()
        self.tally = StoreTally()

    def add(self, event: int, stores: Sequence[StorePlan], not_stored: frozenset[ObjectId]) -> None:
        groups = [group for plan in stores for group in plan.groups if len(group)]
        owner = _Event(event, set(not_stored), queued=len(groups))
        if not groups:
            self._on_result(event, StoreEventResult(1, frozenset(owner.failed)))
            return
        with self._lock:
            self._queue.extend(_Work(owner, group) for group in groups)

    def submit(self, mark: Event) -> None:
        """Submit queued stores, oldest first, while they fit (model thread)."""
        deferred = False
        while True:
            with self._lock:
                if not self._queue:
                    break
                work = self._queue[0]
                asleep = work.group.group_id not in self._ctx.copiers
                if asleep:  # no KV memory to read the blocks from: not stored
                    self._queue.popleft()
            if asleep:
                self._finish_work(work, _blocks_from(work.group, work.start), None, True)
                continue
            piece = self._take_room(work)
            if piece is None:
                deferred = True
                break
            self._submit(piece, mark)
        if deferred:
            with self._lock:
                self.tally.deferrals += 1

    def submit_all(self, mark: Event, timeout_s: float) -> bool:
        """Submit every queued store, waiting for room as pieces finish (sleep mode,
        shutdown: never in a step); False when room did not come in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.submit(mark)
            with self._lock:
                if not self._queue:
                    return True
                in_flight = self.tally.in_flight_bytes
                left = deadline - time.monotonic()
                if left <= 0 or not self._lock.wait_for(self._fewer_than(in_flight), left):
                    return False

    def _fewer_than(self, in_flight: int) -> Callable[[], bool]:
        return lambda: self.tally.in_flight_bytes < in_flight

    # -- submitting ---------------------------------------------------------------------

    def _take_room(self, work: _Work) -> _Piece | None:
        """The next piece of ``work`` that fits now (budget, staging), its rows reserved
        or its staging slot taken; None when nothing fits this step."""
        ctx = self._ctx
        group = work.group
        copier = ctx.copiers[group.group_id]
        rest = _blocks_from(group, work.start)
        nbytes = len(rest) * copier.object_bytes
        with self._lock:
            in_flight = self.tally.in_flight_bytes
        if in_flight and in_flight + nbytes > self._budget:
            return None
        if ctx.in_place:  # pages reserved when submitted (on the store lane for a server)
            rest = _blocks_from(group, work.start, work.start + MAX_PIECE_OBJECTS)
            piece = _Piece(work, rest, len(rest) * copier.object_bytes, time.perf_counter(),
                           in_place=True)
        else:
            assert ctx.ring is not None, "a staged group needs the staging area"
            slot = ctx.ring.take(copier.object_bytes, len(rest))
            if slot is None:
                return None
            rest = _blocks_from(group, work.start, work.start + slot.rows)
            piece = _Piece(work, rest, slot.rows * copier.object_bytes, time.perf_counter(),
                           slot=slot)
        with self._lock:
            work.start += len(rest)
            if work.start >= len(group):
                self._queue.popleft()
                work.owner.queued -= 1
            work.owner.running += 1
            self.tally.in_flight_bytes += piece.nbytes
        piece.identities = tuple(rest.identities())
        return piece

    def _submit(self, piece: _Piece, mark: Event) -> None:
        if piece.in_place and self._ctx.borrow_on_lane:
            self._store_lane.submit(lambda: self._reserve_and_copy(piece, mark))
        else:
            self._reserve_and_copy(piece, mark)

    def _reserve_and_copy(self, piece: _Piece, mark: Event) -> None:
        ctx = self._ctx
        stream = ctx.store_stream
        copier = ctx.copiers.get(piece.group.group_id)
        try:
            if copier is None:  # asleep since it was queued
                raise RuntimeError("no KV memory to store from")
            if piece.in_place:
                piece.target = ctx.access.reserve(piece.group, copier.object_bytes)
            if piece.target is not None:
                written = [(position, block, owned) for position, (block, owned)
                           in enumerate(zip(piece.group.block_ids, piece.target.pages))
                           if owned is not None]
                piece.hashes = ctx.hashes(copier, len(written))
                piece.hashed = tuple(position for position, _, _ in written)
                copy = copier.copy([b for _, b, _ in written], piece.target.memory,
                                   to_kv=False, pages=[p for _, _, p in written],
                                   hashes=piece.hashes)
            elif piece.slot is not None:
                if ctx.access.takes_checksums:
                    # Kept in cache: the store's transport copies the slot out next.
                    piece.hashes = ctx.hashes(copier, len(piece.group), stream=False)
                    piece.hashed = tuple(range(len(piece.group)))
                copy = copier.copy(piece.group.block_ids, piece.slot.memory, to_kv=False,
                                   hashes=piece.hashes)
            else:  # the store reserved nothing: not written
                self._piece_done(piece, None)
                return
            stream.wait_event(mark)
            ctx.device.copy(stream, copy)
            end = ctx.record(stream)
        except Exception as error:  # noqa: BLE001 - the piece is not stored
            logger.warning("umbp store of cache group %d failed: %s", piece.group.group_id,
                           error)
            self._after_copy(piece, None)
            return
        if piece.in_place and ctx.borrow_on_lane:
            # On the store lane: committed before the next piece reserves, as a put
            # would, so a server short of DRAM can still demote what the last one wrote.
            self._after_copy(piece, end)
        else:
            ctx.device.run_beside(stream, lambda: self._after_copy(piece, end))

    # -- finishing ------------------------------------------------------------------------

    def _after_copy(self, piece: _Piece, end: Event | None) -> None:
        """Beside the copy: wait for it, then commit in place, or hand the staged bytes
        to the store I/O lane."""
        copied = False
        try:
            if end is not None:
                end.synchronize()
                copied = True
        except Exception as error:  # noqa: BLE001 - the piece is not stored
            logger.warning("umbp store: the copy failed: %s", error)
        checksums = (copied_checksums(len(piece.group), piece.hashed, piece.hashes)
                     if copied else None)
        if piece.target is not None:
            self._piece_done(piece, piece.target.finish(copied, checksums))
        elif copied and piece.slot is not None:
            self._store_lane.submit(lambda: self._put(piece, checksums))
        else:
            self._piece_done(piece, None)

    def _put(self, piece: _Piece, checksums: Sequence[int | None] | None) -> None:
        assert piece.slot is not None
        results: tuple[bool, ...] | None = None
        try:
            results = self._ctx.access.write_from(piece.group, piece.slot.memory,
                                                  range(piece.slot.rows), checksums)
        finally:
            self._piece_done(piece, results)

    def _piece_done(self, piece: _Piece, stored: Sequence[bool] | None) -> None:
        if piece.slot is not None and self._ctx.ring is not None:
            self._ctx.ring.give_back(piece.slot)
            piece.slot = None
        failed = failed_store_identities(piece.identities or tuple(piece.group.identities()),
                                         stored)
        copier = self._ctx.copiers.get(piece.group.group_id)
        object_bytes = 0 if copier is None else copier.object_bytes
        with self._lock:
            written = len(piece.group) - len(failed)
            self.tally.stored_blocks += written
            self.tally.stored_bytes += written * object_bytes
            self.tally.failures += len(failed)
            self.tally.seconds += time.perf_counter() - piece.submitted
            self.tally.in_flight_bytes -= piece.nbytes
            owner = piece.work.owner
            owner.failed |= failed
            owner.running -= 1
            done = owner.queued == 0 and owner.running == 0
            self._lock.notify_all()
        if done:
            self._on_result(owner.event, StoreEventResult(1, frozenset(owner.failed)))

    def _finish_work(
        self, work: _Work, blocks: GroupBlocks, stored: Sequence[bool] | None,
        queued_done: bool,
    ) -> None:
        """A queued rest of a group that will not be submitted: counted as not stored."""
        failed = failed_store_identities(tuple(blocks.identities()), stored)
        with self._lock:
            self.tally.failures += len(failed)
            owner = work.owner
            owner.failed |= failed
            if queued_done:
                owner.queued -= 1
            done = owner.queued == 0 and owner.running == 0
            self._lock.notify_all()
        if done:
            self._on_result(owner.event, StoreEventResult(1, frozenset(owner.failed)))


def _blocks_from(group: GroupBlocks, start: int, stop: int | None = None) -> GroupBlocks:
    stop = len(group) if stop is None else stop
    if start == 0 and stop == len(group):
        return group
    return GroupBlocks(group.group_id, group.block_size, group.block_ids[start:stop],
                       group.block_hashes[start:stop])
