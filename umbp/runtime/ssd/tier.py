"""`SsdTier`: the disk tier of the node-local server, a preallocated slot file with LRU.

The disk-side sibling of `SlabPool`: fixed-size slots from a free list, LRU eviction, an
xxh3-64 checksum per object verified on every read. docs/backends.md measured the designs:
one slot file driven by `pwrite`/`preadv` beats one file per key and LMDB, so that is the
design here. Bytes move straight between the caller's buffer and the file (no
intermediate `bytes`).

On-disk format: `umbp.runtime.ssd.format` (superblock, one checksummed header record per
slot, data slots). The slot file's I/O, its safe opening and its preallocation:
`umbp.runtime.ssd.file`.

Write ordering and what a crash leaves behind (kill -9, power loss): `umbp.runtime.ssd.index`,
which opens the file again. A put writes over the records of the objects it evicts, then
`umbp.runtime.ssd.file.write_object` writes its payload and its header records, last.

Preallocation: the whole file is reserved at open, for real, or the tier does not open
(`umbp.runtime.ssd.file.preallocate` says what it needs). A write that still fails (EIO; ENOSPC or
EFBIG when the file was cut short underneath) makes that put answer False (nothing of
the object is readable: its records were never written) and retires only the slot the
write failed in, so that later puts do not fail there again; `stats().capacity_bytes`
shrinks by that slot.

Recency is kept in memory only: after a reopen, LRU order is put order (refreshing it on
disk would cost a write per read).

Concurrency: one `threading.Lock` guards the index, the free list and the counters, held
briefly. The slot file's bytes have a `SharedLock`: a read holds it shared while its
`preadv` runs outside the index lock (reads of several objects overlap: the server's
prefetch reads with several threads), and whatever writes the file or frees slots (put,
remove, clear, close) holds it alone, so a read never sees a slot that a writer is
refilling. A read that finds its object corrupt drops it under the index lock while still
holding its share: the dropped slots reach the free list but no put can refill them
before the read lets go. Always the shared lock first, then the index lock. One process
at a time: the slot file is `flock`ed; a second opener gets EBUSY.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import LoadStatus, StoreUnavailable
from umbp.runtime.host_memory import byte_view
from umbp.runtime.paging import PagedLru, pages_for
from umbp.runtime.shared_lock import SharedLock
from umbp.runtime.ssd.file import (
    WriteFailed,
    open_slot_file,
    preallocate,
    read_extents,
    require_room,
    write_object,
    zero_records,
)
from umbp.runtime.ssd.format import SLOT_FILE_NAME, SlotGeometry, encode_key
from umbp.runtime.ssd.index import OpenedFile, StoredObject, load_or_format
from umbp.runtime.ssd.stats import SsdCounters, SsdStats

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["SsdTier"]

logger = logging.getLogger("umbp")

DEFAULT_SLOT_BYTES = 64 * 1024
_NO_SPACE = (errno.ENOSPC, errno.EFBIG)


class SsdTier(ClosesOnExit):
    """The disk tier: objects (key -> bytes) in a preallocated file of fixed-size slots.

    `capacity_bytes` is rounded down to whole slots and counts payload slots only; the
    file is larger by one 1 KiB header record per slot plus 4 KiB (header overhead 1/64 at
    the default 64 KiB slots). Keep `slot_bytes` a multiple of 4096 so that slots are
    page-aligned in the file. Opening an existing directory rebuilds the index from the
    file (see the module docstring); a different `slot_bytes` or capacity resets it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
    ) -> None:
        _validate_geometry(capacity_bytes, slot_bytes)
        self._slot_bytes = slot_bytes
        self._total_slots = capacity_bytes // slot_bytes
        self._geometry = SlotGeometry(slot_bytes, self._total_slots)
        self._file_bytes = self._geometry.file_bytes
        self._path = Path(directory) / SLOT_FILE_NAME
        # Slots and LRU order, made once the filesystem is known to hold the file.
        self._slots: PagedLru[StoredObject]
        self._evicted: dict[str, None] = {}  # insertion-ordered set
        self._next_generation = 1
        self._counters = SsdCounters()
        self._lock = threading.Lock()
        self._io = SharedLock()
        self._closed = False
        self._resets = 0  # clears and closes: each forgets every object, holds included
        self._fd = open_slot_file(self._path)
        try:
            require_room(self._fd, self._file_bytes, self._path)
            # A slot where a write failed with ENOSPC/EFBIG is retired (never handed out
            # again). Both watermarks are the whole file: evict only what a put needs.
            self._slots = PagedLru(self._total_slots, self._total_slots, self._total_slots)
            with _no_cyclic_collection():
                self._restore(load_or_format(self._fd, self._geometry, self._path))
            preallocate(self._fd, self._file_bytes, self._path)
        except BaseException:
            os.close(self._fd)
            raise

    # ----------------------------------------------------------------- the API

    def put(self, key: str, payload: Buffer, checksum: int | None = None) -> bool:
        """`put_pieces` of one C-contiguous buffer."""
        return self.put_pieces(key, [payload], checksum)

    def put_pieces(self, key: str, pieces: Sequence[Buffer], checksum: int | None = None) -> bool:
        """Store under `key` the object whose bytes `pieces` (C-contiguous buffers) hold in
        order; `checksum`: its xxh3-64 when the caller has it (the server demoting an
        object it just verified), else computed while the payload is written.

        True: the object is readable now (not fsynced: see the module docstring). A
        resident key answers True without rewriting (a key names its content) and becomes
        most recently used. LRU objects are evicted to make room. False: the object is
        larger than the tier, the key is longer than `MAX_KEY_BYTES` in UTF-8 (or not
        encodable), the tier is closed, or a write failed (ENOSPC, EFBIG, EIO); nothing of
        the object is readable then. Raises ValueError for an unusable buffer.
        """
        source = [byte_view(piece, writable=False) for piece in pieces]
        nbytes = sum(piece.nbytes for piece in source)
        encoded_key = encode_key(key)
        with self._io.alone(), self._lock:
            if self._closed or encoded_key is None:
                self._counters.put_rejects += 1
                return False
            slots = self._slots
            resident = slots.get(key)
            if resident is not None:
                slots.touch(resident)
                return True
            needed = pages_for(nbytes, self._slot_bytes)
            if not slots.fits(needed):
                self._counters.put_rejects += 1
                return False
            for victim in slots.evict(needed):
                self._invalidate_records(victim.pages)
                self._evicted[victim.key] = None
                self._counters.evictions += 1
            taken = slots.take_pages(needed)
            if taken is None:
                self._counters.put_rejects += 1
                return False
            return self._write_object(key, encoded_key, source, nbytes, taken, checksum)

    def get_into(self, key: str, out: Buffer) -> LoadStatus:
        """`read_into` without the checksum."""
        return self.read_into(key, out)[0]

    def read_into(self, key: str, out: Buffer) -> tuple[LoadStatus, int]:
        """`read_pieces_into` one writable, C-contiguous buffer."""
        return self.read_pieces_into(key, [out])

    def read_pieces_into(self, key: str, pieces: Sequence[Buffer]) -> tuple[LoadStatus, int]:
        """Read the object stored under `key` into `pieces`: writable, C-contiguous
        buffers that hold its bytes in order, whose lengths must add up to the object's.

        HIT refreshes LRU order; with it the object's xxh3-64, which the bytes in the
        pieces were verified to have (hashed as they were read), 0 otherwise. CORRUPT
        (checksum mismatch or data missing from the file) drops the object for good; the
        pieces then hold garbage. SIZE_MISMATCH copies nothing. UNAVAILABLE when closed
        or on a read I/O error (the object is kept: the error may be transient). Raises
        ValueError for an unusable buffer.
        """
        destination = [byte_view(piece, writable=True) for piece in pieces]
        with self._io.shared():
            with self._lock:
                if self._closed:
                    return LoadStatus.UNAVAILABLE, 0
                stored = self._slots.get(key)
                if stored is None:
                    self._counters.misses += 1
                    return LoadStatus.MISSING, 0
                if sum(piece.nbytes for piece in destination) != stored.nbytes:
                    return LoadStatus.SIZE_MISMATCH, 0
            try:
                arrived = read_extents(self._fd, stored.extents, destination)
            except OSError as error:
                logger.warning("ssd tier: reading %r failed: %s", key, error)
                with self._lock:
                    self._counters.read_errors += 1
                return LoadStatus.UNAVAILABLE, 0
            with self._lock:
                # Another read of the same object may have found it corrupt first.
                still = self._slots.get(key) is stored
                if arrived != stored.checksum:
                    if still:
                        self._drop(stored)
                    self._counters.corrupt_reads += 1
                    return LoadStatus.CORRUPT, 0
                if still:
                    self._slots.touch(stored)
                self._counters.hits += 1
                self._counters.bytes_read += stored.nbytes
                return LoadStatus.HIT, stored.checksum

    @contextlib.contextmanager
    def held(self, key: str) -> Iterator[bool]:
        """Keep the object under `key` from being evicted while the block runs (room is
        being made for it elsewhere, and those writes must not push it out); yields
        whether it is resident. A remove, a corrupt read or a clear still drops it: its
        slots then come back when the block ends."""
        with self._lock:
            stored = None if self._closed else self._slots.get(key)
            if stored is not None:
                self._slots.pin(stored)
            resets = self._resets
        try:
            yield stored is not None
        finally:
            if stored is not None:
                with self._lock:
                    if self._resets == resets:
                        self._slots.unpin(stored)

    def size_of(self, key: str) -> int | None:
        """Size of the object under `key`, None when not resident or closed. Does not
        refresh LRU order."""
        with self._lock:
            stored = None if self._closed else self._slots.get(key)
            return None if stored is None else stored.nbytes

    def remove(self, key: str) -> bool:
        """Drop the object under `key` (on disk too: it does not come back on reopen).
        False when it was not resident or the tier is closed."""
        with self._io.alone(), self._lock:
            if self._closed:
                return False
            stored = self._slots.get(key)
            if stored is None:
                return False
            self._invalidate_records(stored.pages)
            self._slots.retire(stored)
            return True

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        """Residency of each key. Does not refresh LRU order: asking is not using. Raises
        `StoreUnavailable` once closed, like every store's lookup."""
        with self._lock:
            self._require_open()
            slots = self._slots
            return tuple([key in slots for key in keys])

    def keys(self) -> tuple[str, ...]:
        """Resident keys, least recently used first; () once closed."""
        with self._lock:
            return () if self._closed else self._slots.keys()

    def sizes(self) -> tuple[tuple[str, int], ...]:
        """(key, payload bytes) of every resident object, least recently used first; ()
        once closed."""
        with self._lock:
            if self._closed:
                return ()
            return tuple((stored.key, stored.nbytes) for stored in self._slots.entries())

    def take_evicted_keys(self) -> tuple[str, ...]:
        """Keys evicted or dropped as corrupt since the last call, oldest first, that are
        not resident now: what the server reports as removed from this tier. (Removed
        keys are not reported: the caller asked for that.)"""
        with self._lock:
            evicted = tuple(self._evicted)
            self._evicted.clear()
            return evicted

    def stats(self) -> SsdStats:
        """A consistent snapshot (taken under the lock); works after close."""
        with self._lock:
            return self._counters.snapshot(
                capacity_bytes=self._slots.usable_pages * self._slot_bytes,
                used_bytes=self._slots.used_pages * self._slot_bytes,
                slot_bytes=self._slot_bytes,
                objects=len(self._slots),
            )

    def clear(self) -> bool:
        """Drop every object, on disk too (not reported as evicted). False once closed."""
        with self._io.alone(), self._lock:
            if self._closed:
                return False
            owned = sorted(slot for stored in self._slots.entries() for slot in stored.pages)
            self._invalidate_records(owned)
            self._slots.reset()
            self._resets += 1
            self._evicted.clear()
            return True

    def flush(self) -> None:
        """Push everything written so far to stable storage (fdatasync). Never needed for
        correctness; a shutdown that wants its objects to survive a power loss calls it."""
        with self._lock:
            self._require_open()
            os.fdatasync(self._fd)

    def close(self) -> None:
        """Release the file (idempotent). Objects stay on disk for the next open; reads
        answer UNAVAILABLE, puts False, lookups raise `StoreUnavailable`."""
        with self._io.alone(), self._lock:
            if self._closed:
                return
            self._closed = True
            self._slots.reset()
            self._resets += 1
            self._evicted.clear()
            os.close(self._fd)

    # ------------------------------------------------- geometry and fault injection

    @property
    def path(self) -> Path:
        """The slot file."""
        return self._path

    @property
    def slot_bytes(self) -> int:
        """Allocation granule in bytes."""
        return self._slot_bytes

    @property
    def total_slots(self) -> int:
        """Slots in the file."""
        return self._total_slots

    def usable_slot_count(self) -> int:
        """Slots free or owned (total minus retired ones): free + owned == this."""
        with self._lock:
            return self._slots.usable_pages

    def free_slot_count(self) -> int:
        """Slots on the free list."""
        with self._lock:
            return self._slots.free_page_count

    def object_slots(self, key: str) -> tuple[int, ...]:
        """Slot of each part of the object under `key`, in object order. Raises KeyError
        when not resident."""
        with self._lock:
            stored = self._slots.get(key)
            if stored is None:
                raise KeyError(key)
            return stored.pages

    def slot_data_offset(self, slot: int) -> int:
        """File offset of a slot's payload bytes (for fault injection)."""
        return self._geometry.slot_offset(slot)

    def slot_record_offset(self, slot: int) -> int:
        """File offset of a slot's header record (for fault injection)."""
        return self._geometry.record_offset(slot)

    # ------------------------------------------------------------ the write path

    def _write_object(
        self, key: str, encoded_key: bytes, source: Sequence[memoryview], nbytes: int,
        slots: tuple[int, ...], checksum: int | None,
    ) -> bool:
        """Write the object (`umbp.runtime.ssd.file.write_object`: payload first, header records last)
        and admit it; on a failed write nothing of it stays readable."""
        generation = self._next_generation
        self._next_generation += 1
        try:
            extents, checksum = write_object(
                self._fd, self._geometry, slots, encoded_key, source, checksum, generation
            )
        except WriteFailed as failure:
            self._after_failed_write(key, failure, slots)
            self._slots.return_pages(slots)
            self._counters.put_failures += 1
            return False
        self._slots.admit(StoredObject(key, slots, extents, nbytes, checksum, generation))
        self._evicted.pop(key, None)
        self._counters.puts += 1
        self._counters.bytes_written += nbytes
        return True

    def _after_failed_write(
        self, key: str, failure: WriteFailed, slots: tuple[int, ...]
    ) -> None:
        """Log the failure; on ENOSPC/EFBIG retire the one slot of this write that failed
        (the others go back to the free list), so that later puts do not fail there."""
        error = failure.error
        if error.errno not in _NO_SPACE:
            logger.warning("ssd tier: writing %r failed: %s", key, error)
            return
        failed_slot = self._geometry.slot_at(failure.offset)
        if failed_slot not in slots:
            return
        self._slots.retire_page(failed_slot)
        logger.warning(
            "ssd tier: %s writing slot %d of %s; retired it (%d of %d slots retired)",
            errno.errorcode.get(error.errno or 0, error.errno),
            failed_slot,
            self._path,
            self._total_slots - self._slots.usable_pages,
            self._total_slots,
        )

    def _drop(self, stored: StoredObject) -> None:
        """Remove an object that can no longer be trusted; report it as evicted."""
        self._invalidate_records(stored.pages)
        self._slots.retire(stored)
        self._evicted[stored.key] = None

    def _invalidate_records(self, slots: Sequence[int]) -> None:
        zero_records(self._fd, self._geometry, slots)

    def _restore(self, opened: OpenedFile) -> None:
        """Index the objects the file held whole when it was opened."""
        self._next_generation = opened.next_generation
        self._counters.dropped_at_open += opened.dropped
        self._slots.restore(opened.objects)

    def _require_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("SsdTier is closed")


@contextlib.contextmanager
def _no_cyclic_collection() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a reopen builds one index entry per
    object: the entries form no cycles, and each collection the allocations trigger
    would rescan all that were built so far (a third of a 1M-object reopen)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _validate_geometry(capacity_bytes: int, slot_bytes: int) -> None:
    """Reject sizes that would make a tier with no slots, naming the argument."""
    for name, value in (("capacity_bytes", capacity_bytes), ("slot_bytes", slot_bytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if capacity_bytes < slot_bytes:
        raise ValueError(
            f"capacity_bytes ({capacity_bytes}) is smaller than one slot "
            f"(slot_bytes={slot_bytes}); raise capacity_bytes or lower slot_bytes"
        )

