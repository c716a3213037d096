"""A worker's loads: stored objects into the KV blocks vLLM allocated for them.

Two kinds, both enqueued as copies on the device after the step's forward mark
(:mod:`umbp.shell.transfer_context`), so no load lands before what vLLM's stream did
to those blocks earlier:

* :class:`AsyncLoad`, one request waiting outside the batch: its copy runs on the
  asynchronous load stream; a host job beside it waits for the copy's event, verifies,
  lets the store's rows go and reports the outcome, which vLLM hears through
  ``get_transfer_results``.
* :class:`LayerwiseLoad`, a step's synchronous loads: one copy per layer on the layer
  load stream, each followed by its event; the forward pass's stream waits for a
  layer's event in ``wait_for_layer_load`` (on a GPU the GPU waits, the host does not),
  so later layers' copies overlap earlier layers' attention. The checksums are
  verified beside the copies; the step's outcome (which blocks failed) is known when
  vLLM asks for it, and the store's rows go once the last copy completed
  (:meth:`LayerwiseLoad.poll`).

Objects that copy in place are borrowed from the store on the model thread (an
in-process index operation), so their copies are enqueued before ``start_load_kv``
returns. Objects read through staging are read on the I/O lane, a piece at a time when
the staging area has no room for all, and enqueued from there: an asynchronous load
simply finishes later; a synchronous one makes ``wait_for_layer_load`` wait on the host
until the whole read is enqueued (the cost of ``load_async: false`` with a store that
cannot lend).

Whatever goes wrong, every block of a plan ends loaded or reported failed, a failed
block's bytes are never reported loaded, and no borrowed row or staging slot is kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from umbp.core.loads.outcomes import (
    LoadStatus,
    RequestLoadOutcome,
    group_load_outcome,
    merged_groups,
    plan_load_outcome,
    split_statuses,
)
from umbp.core.plans import GroupBlocks, LoadPlan
from umbp.gpu.copier import BlockCopy
from umbp.gpu.device import Event, Stream
from umbp.gpu.staging import StagingSlot
from umbp.runtime.paged_copy import Hashes
from umbp.shell.store_io import GroupSource, copied_checksums, unread
from umbp.shell.transfer_context import MAX_PIECE_OBJECTS, STAGING_WAIT_S, TransferContext

logger = logging.getLogger("umbp")

__all__ = ["AsyncLoad", "LayerwiseLoad"]

LAYER_ENQUEUE_WAIT_S = 120.0
"""How long ``wait_for_layer_load`` waits for a staged read to be enqueued before the
step's loads are given up (their blocks reported failed, recomputed)."""


@dataclass(slots=True, eq=False)
class _Read:
    """One group's objects as read (a piece of the group, when staging had no room for
    all of it) and the staging slot holding them until their copy finished."""

    group: GroupBlocks
    source: GroupSource
    slot: StagingSlot | None = None
    hashes: Hashes | None = None
    """Where the copy of a loan hashes what it moves: its objects' checksums, in the
    order of ``hashed_rows`` (the read's positions it copies)."""
    hashed_rows: tuple[int, ...] = ()


def _copies(ctx: TransferContext, read: _Read) -> list[BlockCopy]:
    """The copy of a read's loaded rows (those answered HIT), every layer (a layer's
    copy is :meth:`BlockCopy.of_layer`, checked once here); raises when the plan breaks
    the copier's contract (a block out of range). A loan's copy hashes the objects as it
    moves them (where this host's copies can), the read keeping the hash states for
    ``verify``: the lender's pages are then read once, not a second time to verify; so
    does the copy out of staging rows read unchecked (`ChecksumsFromCopy`)."""
    group, source = read.group, read.source
    outcome = group_load_outcome(group.group_id, group.block_ids, source.statuses)
    if outcome.problem is not None:
        logger.error("umbp load: %s", outcome.problem)
    copier = ctx.copiers.get(group.group_id)
    if not outcome.loaded_rows or source.memory is None or copier is None:
        return []
    pages = [source.pages[index] for index in outcome.loaded_rows]
    if any(owned is None for owned in pages):
        raise ValueError("a store answered HIT for an object it gave no pages")
    if source.hashed_by_copy:
        read.hashes = ctx.hashes(copier, len(pages))
        read.hashed_rows = tuple(outcome.loaded_rows)
    return [copier.copy(outcome.loaded_block_ids, source.memory, to_kv=True,
                        pages=[owned for owned in pages if owned is not None],
                        hashes=read.hashes)]


def _verified(reads: Sequence[_Read], copied: bool) -> list[tuple[LoadStatus, ...] | None]:
    """Every read's final statuses (each verified even when the copy failed, so the
    store counts what it lent); none counts when the copy failed."""
    statuses = [
        read.source.verify(copied_checksums(len(read.group), read.hashed_rows, read.hashes))
        for read in reads
    ]
    return statuses if copied else [None] * len(reads)


def _let_go(ctx: TransferContext, reads: Sequence[_Read]) -> None:
    """The store's rows and the staging slots of ``reads`` go back (their copies have
    finished reading them)."""
    for read in reads:
        try:
            read.source.release()
        finally:
            if read.slot is not None and ctx.ring is not None:
                ctx.ring.give_back(read.slot)
                read.slot = None


def _group_statuses(
    reads: Sequence[_Read], statuses: Sequence[tuple[LoadStatus, ...] | None], group_id: int
) -> tuple[LoadStatus, ...] | None:
    """A group's statuses from its pieces, in order (None when a piece was not read)."""
    pieces = [answer for read, answer in zip(reads, statuses) if read.group.group_id == group_id]
    if not pieces or any(answer is None for answer in pieces):
        return None
    return tuple(status for answer in pieces if answer is not None for status in answer)


def _read_in_place(ctx: TransferContext, group: GroupBlocks) -> list[_Read]:
    """The group's objects borrowed where the store keeps them, a piece of at most
    ``MAX_PIECE_OBJECTS`` at a time (a server's request takes at most 65,536 keys)."""
    copier = ctx.copiers.get(group.group_id)
    if copier is None:  # asleep: no KV memory to copy into
        return [_Read(group, unread(len(group)))]
    pieces = [_piece(group, start, min(start + MAX_PIECE_OBJECTS, len(group)))
              for start in range(0, len(group), MAX_PIECE_OBJECTS)] or [group]
    return [_Read(piece, ctx.access.lend(piece, copier.object_bytes)) for piece in pieces]


def _read_all(
    ctx: TransferContext, groups: Sequence[GroupBlocks], enqueue: Callable[[_Read], Event | None]
) -> list[_Read]:
    """Every group read, and each read handed to ``enqueue`` (which enqueues its copies
    and answers an event after them) as soon as it is read: in place at once; through
    staging a piece at a time, a piece waiting for room by finishing the oldest piece
    this call still holds (on this host thread), else for room others give back."""
    reads: list[_Read] = []
    held: list[tuple[_Read, Event | None]] = []

    def finish_oldest() -> None:
        read, event = held.pop(0)
        if event is not None:
            try:
                event.synchronize()
            except Exception:  # noqa: BLE001 - the load's own event reports it failed
                logger.warning("umbp load: a staged copy failed")
        if read.slot is not None and ctx.ring is not None:
            ctx.ring.give_back(read.slot)
            read.slot = None

    try:
        for group in groups:
            copier, ring = ctx.copiers.get(group.group_id), ctx.ring
            if ctx.in_place or copier is None or ring is None:
                for read in _read_in_place(ctx, group):  # (asleep: unread)
                    reads.append(read)
                    enqueue(read)
                continue
            start = 0
            while start < len(group):
                slot = ring.take(copier.object_bytes, len(group) - start)
                while slot is None and held:
                    finish_oldest()
                    slot = ring.take(copier.object_bytes, len(group) - start)
                if slot is None:
                    slot = ring.take_waiting(copier.object_bytes, len(group) - start,
                                             STAGING_WAIT_S)
                if slot is None:
                    logger.warning("umbp load: no staging room within %.0f s; %d blocks "
                                   "are recomputed", STAGING_WAIT_S, len(group) - start)
                    piece = _piece(group, start, len(group))
                    reads.append(_Read(piece, unread(len(piece))))
                    break
                piece = _piece(group, start, start + slot.rows)
                read = _Read(piece, ctx.access.read_into(
                    piece, slot.memory, range(slot.rows), ctx.copies_hash(copier)), slot)
                reads.append(read)
                held.append((read, enqueue(read)))
                start += slot.rows
    except BaseException:
        _let_go(ctx, reads)
        raise
    return reads


def _piece(group: GroupBlocks, start: int, stop: int) -> GroupBlocks:
    if start == 0 and stop == len(group):
        return group
    return GroupBlocks(group.group_id, group.block_size, group.block_ids[start:stop],
                       group.block_hashes[start:stop])


def _on_lane(ctx: TransferContext) -> bool:
    """Reads that ask the store over I/O (staging, a server's loans) run on the I/O lane."""
    return not ctx.in_place or ctx.borrow_on_lane


class AsyncLoad:
    """One request's asynchronous load. :meth:`start` on the model thread; ``report``
    gets the outcome exactly once, on a host thread."""

    def __init__(
        self, plan: LoadPlan, ctx: TransferContext, mark: Event,
        report: Callable[[RequestLoadOutcome, float], None],
    ) -> None:
        self._plan = plan
        self._ctx = ctx
        self._mark = mark
        self._report = report
        self._started = time.perf_counter()

    def start(self) -> None:
        if _on_lane(self._ctx):
            self._ctx.io_lane.submit(self._run)
        else:
            self._run()

    def _run(self) -> None:
        ctx = self._ctx
        stream = ctx.async_load_stream
        reads: list[_Read] = []
        end: Event | None = None
        copied = True
        try:
            stream.wait_event(self._mark)
            reads = _read_all(ctx, self._plan.groups, lambda read: self._enqueue(stream, read))
        except Exception as error:  # noqa: BLE001 - reported as a failed load
            logger.warning("umbp load of request %s failed: %s", self._plan.request_id, error)
            copied = False
        # Reported only after whatever was enqueued ran, so vLLM's recompute of a failed
        # load never races a copy still landing.
        end = ctx.record(stream)
        ctx.device.run_beside(stream, lambda: self._finish(reads, end, copied))

    def _enqueue(self, stream: Stream, read: _Read) -> Event:
        for copy in _copies(self._ctx, read):
            self._ctx.device.copy(stream, copy)
        return self._ctx.record(stream)

    def _finish(self, reads: list[_Read], end: Event, copied: bool) -> None:
        """After the copy (``copied`` False: it was not enqueued whole): verify, let go,
        report."""
        try:
            end.synchronize()
        except Exception as error:  # noqa: BLE001 - reported as a failed load
            logger.warning("umbp load of request %s: the copy failed: %s",
                           self._plan.request_id, error)
            copied = False
        statuses: list[tuple[LoadStatus, ...] | None] = [None] * len(reads)
        try:
            statuses = _verified(reads, copied)
        finally:
            _let_go(self._ctx, reads)
            self._report(plan_load_outcome(self._plan, [
                _group_statuses(reads, statuses, group.group_id) for group in self._plan.groups
            ], True), time.perf_counter() - self._started)


class LayerwiseLoad:
    """A step's synchronous loads. :meth:`start`, :meth:`wait_layer` and
    :meth:`outcomes` on the model thread; ``layers``: per cache group, how many layers
    its objects hold; ``mid_block``: a plan ends inside a block the step writes."""

    def __init__(
        self, plans: Sequence[LoadPlan], ctx: TransferContext, mark: Event,
        layers: dict[int, int], mid_block: bool,
    ) -> None:
        self._plans = tuple(plans)
        self._ctx = ctx
        self._mark = mark
        self._layers = layers
        self._mid_block = mid_block
        self._groups = merged_groups(self._plans)
        self._events: dict[tuple[int, int], Event] = {}
        self._last: Event | None = None
        self._reads: list[_Read] = []
        self._statuses: list[tuple[LoadStatus, ...] | None] = []
        self._copied = False
        self._enqueued = threading.Event()
        self._verified = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._outcomes: tuple[RequestLoadOutcome, ...] | None = None
        self._released = False
        self._started = time.perf_counter()
        self.seconds = 0.0
        """From start to verified (read after :meth:`outcomes`)."""

    @property
    def plans(self) -> tuple[LoadPlan, ...]:
        return self._plans

    def start(self) -> None:
        ctx = self._ctx
        if _on_lane(ctx):
            ctx.io_lane.submit(self._run_in_place if ctx.in_place else self._run_staged)
            if not self._mid_block or not self._wait_enqueued():
                return
        else:
            self._run_in_place()
        if self._mid_block and self._last is not None:
            # vLLM writes the step's new tokens into the last, partial block before
            # that layer's wait: the whole load lands before the forward pass runs.
            ctx.device.current_stream().wait_event(self._last)

    def _run_in_place(self) -> None:
        """Borrow, then one copy per layer of every group, each followed by its event
        (on the model thread, or on the I/O lane for a server)."""
        ctx = self._ctx
        stream = ctx.layer_load_stream
        try:
            self._reads = [read for group in self._groups for read in _read_in_place(ctx, group)]
            whole = [(read.group.group_id, copy) for read in self._reads
                     for copy in _copies(ctx, read)]
            copies = {
                (group_id, layer): [copy.of_layer(layer) for group, copy in whole
                                    if group == group_id]
                for group_id, count in self._layers.items() for layer in range(count)
            }
            with self._lock:
                if self._abandoned:
                    raise _GivenUp
                stream.wait_event(self._mark)
                for key, layer_copies in copies.items():
                    for copy in layer_copies:
                        ctx.device.copy(stream, copy)
                    self._events[key] = self._last = ctx.record(stream)
                self._copied = True
                self._enqueued.set()
        except Exception as error:  # noqa: BLE001 - every block then fails
            self._not_copied(error)
        self._verify_beside(stream)

    def _run_staged(self) -> None:
        """On the I/O lane: read (a piece at a time), each piece's every layer copied as
        it is read; the layers' events follow the last piece."""
        ctx = self._ctx
        stream = ctx.layer_load_stream
        try:
            stream.wait_event(self._mark)
            self._reads = _read_all(ctx, self._groups, lambda read: self._enqueue_piece(read))
            with self._lock:
                if self._abandoned:
                    raise _GivenUp
                last = self._last = ctx.record(stream)
                self._events = {(g, layer): last for g, count in self._layers.items()
                                for layer in range(count)}
                self._copied = True
                self._enqueued.set()
        except Exception as error:  # noqa: BLE001 - every block then fails
            self._not_copied(error)
        self._verify_beside(stream)

    def _not_copied(self, error: Exception) -> None:
        """Every block fails; a layer's attention still waits for whatever was enqueued
        (so no copy can land after the recompute that follows)."""
        if not isinstance(error, _GivenUp):
            logger.warning("umbp: the step's synchronous loads were not copied: %s", error)
        with self._lock:
            self._copied = False
            if not self._abandoned:
                last = self._last = self._ctx.record(self._ctx.layer_load_stream)
                self._events = {(g, layer): last for g, count in self._layers.items()
                                for layer in range(count)}
            self._enqueued.set()

    def _enqueue_piece(self, read: _Read) -> Event:
        ctx = self._ctx
        with self._lock:
            if self._abandoned:  # the step went on without it: nothing may land now
                raise _GivenUp
            whole = _copies(ctx, read)
            for layer in range(self._layers.get(read.group.group_id, 0)):
                for copy in whole:
                    ctx.device.copy(ctx.layer_load_stream, copy.of_layer(layer))
        return ctx.record(ctx.layer_load_stream)

    def _verify_beside(self, stream: Stream) -> None:
        if self._copied:
            self._ctx.device.run_beside(stream, self._verify)
        else:
            self._verify()

    def _verify(self) -> None:
        try:
            self._statuses = _verified(self._reads, self._copied)
        except Exception as error:  # noqa: BLE001 - every block then fails
            logger.warning("umbp: verifying the step's loads failed: %s", error)
            self._statuses = [None] * len(self._reads)
        finally:
            self.seconds = time.perf_counter() - self._started
            self._verified.set()

    def _wait_enqueued(self) -> bool:
        """Until a read on the I/O lane is enqueued (a host wait); False when it was given
        up: then nothing more is enqueued, and the forward stream waits for what was."""
        if self._enqueued.wait(LAYER_ENQUEUE_WAIT_S):
            return not self._abandoned
        with self._lock:
            if not self._enqueued.is_set():
                self._abandoned = True
                self._ctx.device.current_stream().wait_event(
                    self._ctx.record(self._ctx.layer_load_stream))
        if self._abandoned:
            logger.error("umbp: the step's synchronous loads were not read within %.0f s; "
                         "their blocks are recomputed", LAYER_ENQUEUE_WAIT_S)
        return not self._abandoned

    def wait_layer(self, group_id: int, layer: int) -> None:
        """Order the forward pass after this layer's copies: the GPU waits, not the host
        (the host device's forward pass runs on this thread, so it waits here)."""
        if not self._enqueued.is_set() and not self._wait_enqueued():
            return
        event = self._events.get((group_id, layer))
        if event is not None:
            self._ctx.device.current_stream().wait_event(event)

    def outcomes(self) -> tuple[RequestLoadOutcome, ...]:
        """Every plan's outcome, once the checksums verified beside the copies are in."""
        if self._outcomes is not None:
            return self._outcomes
        if (not self._enqueued.is_set() and not self._wait_enqueued()) or self._abandoned:
            by_group: dict[int, tuple[LoadStatus, ...] | None] = {}
        else:
            self._verified.wait()
            by_group = {
                group.group_id: _group_statuses(self._reads, self._statuses, group.group_id)
                for group in self._groups
            }
        self._outcomes = tuple(
            plan_load_outcome(plan, shares, False)
            for plan, shares in zip(self._plans, split_statuses(self._plans, by_group))
        )
        return self._outcomes

    def poll(self, wait: bool = False) -> bool:
        """Let the store's rows go once the copies finished reading them; True once
        done. ``wait``: synchronize first (sleep mode, shutdown; never in a step)."""
        if self._released:
            return True
        if not (self._enqueued.is_set() and self._verified.is_set()):
            if not wait:
                return False
            self._enqueued.wait()
            self._verified.wait()
        last = self._last
        if last is not None:
            try:
                if wait:
                    last.synchronize()
                elif not last.query():
                    return False
            except Exception:  # noqa: BLE001 - the outcome failed these blocks already
                logger.warning("umbp: a synchronous load's copy failed")
        self._released = True
        _let_go(self._ctx, self._reads)
        return True


class _GivenUp(Exception):
    """The step went on without these loads (``LAYER_ENQUEUE_WAIT_S``)."""
