"""`SsdTier`: the disk tier of the node-local server, a preallocated slot file with LRU.

The disk-side sibling of `SlabPool`: fixed-size slots from a free list, LRU eviction, an
xxh3-64 checksum per object verified on every read. docs/backends.md measured the designs:
one slot file driven by `pwrite`/`preadv` beats one file per key and LMDB, so that is the
design here. Bytes move straight between the caller's buffer and the file (no
intermediate `bytes`).

On-disk format (one file, `<directory>/ssd-tier.slots`, mode 0600; little-endian):

* superblock, bytes [0, 4096): magic ``UMBP-SSD``, format version, header-record size,
  `slot_bytes`, slot count, data-area offset, and an xxh3-64 of those fields. A file whose
  superblock is damaged or whose geometry differs from the one asked for is reset (emptied).
* header area, from byte 4096: one `RECORD_BYTES` (1024-byte) record per slot, in slot
  order. A free slot's record is all zeros. An occupied slot's record holds magic
  ``UMBP-HDR``, format version, key length, the slot's own index (catches a misdirected
  write), part index and part count, object size, generation, payload checksum (xxh3-64 of
  the whole object), the UTF-8 key (at most `MAX_KEY_BYTES`), and in its last 8 bytes an
  xxh3-64 of the rest of the record.
* data area, from the first 4 KiB boundary after the header area: `slot_count` slots of
  `slot_bytes`. An object of n bytes occupies max(1, ceil(n / slot_bytes)) slots, not
  necessarily contiguous; part i holds bytes [i * slot_bytes, (i + 1) * slot_bytes).

Every put draws a fresh generation (greater than any found on disk at open), so records
of different objects never mix even when a stale one survives somewhere.

Write ordering and what a crash leaves behind. A put writes (1) zeros over the records of
any objects it evicts, (2) the payload into its slots, (3) its header records, last. A
remove, eviction or corrupt-drop zeros the object's records before its slots can be
reused. So at every instant the records on disk describe only objects whose bytes are
fully in place, and when a process dies at any point (kill -9; the page cache survives)
the reopened tier holds every object that was resident at that moment, nothing whose put
had not returned, and serves each bit-identically (an object caught with only some
records written, or some zeroed, is incomplete and dropped at open). On open the header area is scanned and only complete,
self-consistent objects are kept: every part present once, one generation, matching key,
size, part count and checksum, valid record checksums, data inside the file; anything else
is zeroed and counted in `dropped_at_open`. When two complete objects claim one key (only
possible after a lost write), the newer generation wins.

No fsync per put: this is a cache. After a power loss or kernel crash the page cache may
reach the disk in any order, so recent objects may be lost or a stale record may describe
slots that now hold other bytes. That can cost objects but never serves wrong bytes: the
payload checksum is verified on every read, a mismatch answers CORRUPT and drops the
object (its records zeroed, its slots freed). `flush()` is there for a caller that wants
the current state on stable storage (e.g. at shutdown).

Preallocation: `os.posix_fallocate` reserves the whole file at open, for real, so that
writes cannot hit ENOSPC later. When the space cannot be had (filesystem too small,
RLIMIT_FSIZE, no fallocate support) the tier does not open: the constructor raises an
OSError saying how many bytes it needs and what to do (a tier that grows as it goes
collapses the day another file takes the disk). The free space is checked before any
memory is allocated for the index, so an absurd capacity is refused, not a MemoryError.
A write that still fails (EIO; ENOSPC or EFBIG when the file was cut short underneath)
makes that put answer False (nothing of the object is readable: its records were never
written) and retires only the slot the write failed in, so that later puts do not fail
there again; `stats().capacity_bytes` shrinks by that slot.

Files: the directory must be this user's (or root's) and not writable by others unless
sticky; the slot file is opened without following symlinks and must be a regular file of
this user's with mode 0600 (created so); anything else is refused with an `UnsafePath`
naming the fix (`umbp.runtime.private_files`).

Recency is kept in memory only: after a reopen, LRU order is put order (refreshing it on
disk would cost a write per read).

Concurrency: one `threading.Lock` guards the index, the free list, the counters *and* the
I/O, taken once per call. `pread`/`pwrite` release the GIL, so I/O outside the lock could
overlap, but it would need slot pinning against concurrent eviction, remove, clear and
corrupt-drops (a reader must never read a slot that a writer is refilling). With the page
cache warm one object's I/O takes tens of microseconds, so a caller waits for at most that
long; the simple, obviously correct scheme is the one here. One process at a time: the slot file is `flock`ed; a second opener gets EBUSY.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import xxhash

from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import LoadStatus, StoreUnavailable
from umbp.runtime.host_memory import byte_view
from umbp.runtime.paging import PagedLru, Resident, pages_for
from umbp.runtime.private_files import open_private_file, prepare_directory

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["MAX_KEY_BYTES", "RECORD_BYTES", "SLOT_FILE_NAME", "SsdStats", "SsdTier"]

logger = logging.getLogger("umbp")

SLOT_FILE_NAME = "ssd-tier.slots"
DEFAULT_SLOT_BYTES = 64 * 1024
FORMAT_VERSION = 1

SUPERBLOCK_BYTES = 4096
_SUPERBLOCK_MAGIC = b"UMBP-SSD"
# magic, version, record bytes, slot bytes, slot count, data offset; then its checksum.
_SUPERBLOCK = struct.Struct("<8sIIQQQ")
_CHECKSUM = struct.Struct("<Q")

RECORD_BYTES = 1024
"""Size of one slot's header record."""
_RECORD_MAGIC = b"UMBP-HDR"
# magic, version, key length, slot, part index, part count, object size, generation,
# payload checksum. The key follows; the record's own checksum takes the last 8 bytes.
_RECORD_HEAD = struct.Struct("<8sHHIIIQQQ")
_RECORD_CHECKED_BYTES = RECORD_BYTES - _CHECKSUM.size
MAX_KEY_BYTES = 960
"""Longest key, in UTF-8 bytes, a header record holds (umbp keys are ~110 bytes)."""
assert _RECORD_HEAD.size + MAX_KEY_BYTES <= _RECORD_CHECKED_BYTES

_ALIGNMENT = 4096
_SCAN_CHUNK_RECORDS = 4096  # 4 MiB of header records per read while rebuilding
_ZEROS = bytes(64 * RECORD_BYTES)
_NO_SPACE = (errno.ENOSPC, errno.EFBIG)
_xxh3_64 = xxhash.xxh3_64_intdigest
_PADDING = bytes(_RECORD_CHECKED_BYTES - _RECORD_HEAD.size)  # sliced after the key


class _StoredObject(Resident):
    """Where one object lives and what it must hash to. Its `pages` are its slots, in
    object order."""

    __slots__ = ("checksum", "extents", "generation", "nbytes")

    def __init__(
        self,
        key: str,
        slots: tuple[int, ...],
        extents: tuple[tuple[int, int, int], ...],
        nbytes: int,
        checksum: int,
        generation: int,
    ) -> None:
        super().__init__(key, slots)
        self.extents = extents
        """(file offset, offset in the object, length) of each run of consecutive slots,
        so a read or write is one syscall per run rather than per slot."""
        self.nbytes = nbytes
        self.checksum = checksum
        self.generation = generation


class _Record(NamedTuple):
    """A header record that passed its own checks while rebuilding the index."""

    slot: int
    key: str
    part_index: int
    part_count: int
    nbytes: int
    generation: int
    checksum: int


@dataclass(frozen=True, slots=True)
class SsdStats:
    """A snapshot of the tier's occupancy and counters (counters are since open)."""

    capacity_bytes: int
    """Bytes of slots the tier can use (less than configured after ENOSPC/EFBIG)."""
    used_bytes: int
    """Bytes of slots taken by resident objects (whole slots)."""
    slot_bytes: int
    """Allocation granule; an object occupies max(1, ceil(size / slot_bytes)) slots."""
    objects: int
    """Resident objects."""
    hits: int
    """Reads that returned HIT."""
    misses: int
    """Reads that returned MISSING."""
    puts: int
    """Objects written (a put of a resident key writes nothing and is not counted)."""
    put_failures: int
    """Puts that failed on an I/O error (ENOSPC, EFBIG, EIO)."""
    put_rejects: int
    """Puts refused without I/O: larger than the tier, key too long, tier closed."""
    evictions: int
    """Objects evicted to make room (LRU)."""
    corrupt_reads: int
    """Reads that found a checksum mismatch or missing data (the object was dropped)."""
    read_errors: int
    """Reads that failed on an I/O error (answered UNAVAILABLE, object kept)."""
    dropped_at_open: int
    """Damaged header records, incomplete or inconsistent objects, and reset files
    (damaged superblock, other geometry) found while opening; each counts once."""
    bytes_written: int
    """Payload bytes written by successful puts."""
    bytes_read: int
    """Payload bytes delivered by reads that hit."""


@dataclass(slots=True)
class _Counters:
    """Monotonic counters behind `SsdStats`; mutated only under the tier lock."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    put_rejects: int = 0
    evictions: int = 0
    corrupt_reads: int = 0
    read_errors: int = 0
    dropped_at_open: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class _WriteFailed(Exception):
    """An OSError from a write, with the file offset it failed at (to retire slots)."""

    def __init__(self, error: OSError, offset: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.offset = offset


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
        self._header_offset = SUPERBLOCK_BYTES
        self._data_offset = _align_up(
            self._header_offset + self._total_slots * RECORD_BYTES, _ALIGNMENT
        )
        self._file_bytes = self._data_offset + self._total_slots * slot_bytes
        self._path = Path(directory) / SLOT_FILE_NAME
        # Slots and LRU order, made once the filesystem is known to hold the file.
        self._slots: PagedLru[_StoredObject]
        self._evicted: dict[str, None] = {}  # insertion-ordered set
        self._next_generation = 1
        self._counters = _Counters()
        self._lock = threading.Lock()
        self._closed = False
        self._fd = self._open_locked(Path(directory))
        try:
            self._require_room()
            # A slot where a write failed with ENOSPC/EFBIG is retired (never handed out
            # again). Both watermarks are the whole file: evict only what a put needs.
            self._slots = PagedLru(self._total_slots, self._total_slots, self._total_slots)
            self._load_or_format()
            self._preallocate()
        except BaseException:
            os.close(self._fd)
            raise

    # ----------------------------------------------------------------- the API

    def put(self, key: str, payload: Buffer) -> bool:
        """Store `payload` (any C-contiguous buffer) under `key`.

        True: the object is readable now (not fsynced: see the module docstring). A
        resident key answers True without rewriting (a key names its content) and becomes
        most recently used. LRU objects are evicted to make room. False: the object is
        larger than the tier, the key is longer than `MAX_KEY_BYTES` in UTF-8 (or not
        encodable), the tier is closed, or a write failed (ENOSPC, EFBIG, EIO); nothing of
        the object is readable then. Raises ValueError for an unusable buffer.
        """
        source = byte_view(payload, writable=False)
        encoded_key = _encode_key(key)
        with self._lock:
            if self._closed or encoded_key is None:
                self._counters.put_rejects += 1
                return False
            slots = self._slots
            resident = slots.get(key)
            if resident is not None:
                slots.touch(resident)
                return True
            needed = pages_for(source.nbytes, self._slot_bytes)
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
            return self._write_object(key, encoded_key, source, taken)

    def get_into(self, key: str, out: Buffer) -> LoadStatus:
        """Read the object stored under `key` into the writable, C-contiguous `out`, whose
        length must equal the object's.

        HIT refreshes LRU order. CORRUPT (checksum mismatch or data missing from the file)
        drops the object for good; `out` then holds garbage. SIZE_MISMATCH copies nothing.
        UNAVAILABLE when closed or on a read I/O error (the object is kept: the error may
        be transient). Raises ValueError for an unusable buffer.
        """
        destination = byte_view(out, writable=True)
        with self._lock:
            if self._closed:
                return LoadStatus.UNAVAILABLE
            stored = self._slots.get(key)
            if stored is None:
                self._counters.misses += 1
                return LoadStatus.MISSING
            if destination.nbytes != stored.nbytes:
                return LoadStatus.SIZE_MISMATCH
            try:
                complete = self._read_extents(stored.extents, destination)
            except OSError as error:
                logger.warning("ssd tier: reading %r failed: %s", key, error)
                self._counters.read_errors += 1
                return LoadStatus.UNAVAILABLE
            if not complete or xxhash.xxh3_64_intdigest(destination) != stored.checksum:
                self._drop(stored)
                self._counters.corrupt_reads += 1
                return LoadStatus.CORRUPT
            self._slots.touch(stored)
            self._counters.hits += 1
            self._counters.bytes_read += stored.nbytes
            return LoadStatus.HIT

    def size_of(self, key: str) -> int | None:
        """Size of the object under `key`, None when not resident or closed. Does not
        refresh LRU order."""
        with self._lock:
            stored = None if self._closed else self._slots.get(key)
            return None if stored is None else stored.nbytes

    def remove(self, key: str) -> bool:
        """Drop the object under `key` (on disk too: it does not come back on reopen).
        False when it was not resident or the tier is closed."""
        with self._lock:
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
            counters = self._counters
            return SsdStats(
                capacity_bytes=self._slots.usable_pages * self._slot_bytes,
                used_bytes=self._slots.used_pages * self._slot_bytes,
                slot_bytes=self._slot_bytes,
                objects=len(self._slots),
                hits=counters.hits,
                misses=counters.misses,
                puts=counters.puts,
                put_failures=counters.put_failures,
                put_rejects=counters.put_rejects,
                evictions=counters.evictions,
                corrupt_reads=counters.corrupt_reads,
                read_errors=counters.read_errors,
                dropped_at_open=counters.dropped_at_open,
                bytes_written=counters.bytes_written,
                bytes_read=counters.bytes_read,
            )

    def clear(self) -> bool:
        """Drop every object, on disk too (not reported as evicted). False once closed."""
        with self._lock:
            if self._closed:
                return False
            owned = sorted(slot for stored in self._slots.entries() for slot in stored.pages)
            self._invalidate_records(owned)
            self._slots.reset()
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
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._slots.reset()
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
        return self._data_offset + slot * self._slot_bytes

    def slot_record_offset(self, slot: int) -> int:
        """File offset of a slot's header record (for fault injection)."""
        return self._header_offset + slot * RECORD_BYTES

    # ------------------------------------------------------------ the write path

    def _write_object(
        self, key: str, encoded_key: bytes, source: memoryview, slots: tuple[int, ...]
    ) -> bool:
        """Payload first, header records last, so that a record on disk always describes
        bytes that are fully in place. On failure nothing of the object stays readable."""
        nbytes = source.nbytes
        checksum = xxhash.xxh3_64_intdigest(source)
        generation = self._next_generation
        self._next_generation += 1
        extents = self._extents(slots, nbytes)
        written_records: list[int] = []
        try:
            for file_offset, start, length in extents:
                self._pwrite_all(source[start : start + length], file_offset)
            for run in _consecutive_runs(slots):
                records = self._build_records(
                    run, slots, encoded_key, nbytes, generation, checksum
                )
                written_records.extend(run)  # before: a short write may leave some whole
                self._pwrite_all(records, self.slot_record_offset(run[0]))
        except _WriteFailed as failure:
            self._invalidate_records(written_records)
            self._after_failed_write(key, failure, slots)
            self._slots.return_pages(slots)
            self._counters.put_failures += 1
            return False
        self._slots.admit(_StoredObject(key, slots, extents, nbytes, checksum, generation))
        self._evicted.pop(key, None)
        self._counters.puts += 1
        self._counters.bytes_written += nbytes
        return True

    def _build_records(
        self,
        run: tuple[int, ...],
        slots: tuple[int, ...],
        encoded_key: bytes,
        nbytes: int,
        generation: int,
        checksum: int,
    ) -> bytes:
        """The header records of one run of consecutive slots, back to back. Built by
        concatenating bytes: faster in CPython than packing into a bytearray."""
        key_and_padding = encoded_key + _PADDING[len(encoded_key) :]
        part_count = len(slots)
        first_part = 0 if part_count == 1 else slots.index(run[0])
        pack_head, pack_checksum, digest = _RECORD_HEAD.pack, _CHECKSUM.pack, _xxh3_64
        records = []
        for position, slot in enumerate(run):
            body = (
                pack_head(
                    _RECORD_MAGIC,
                    FORMAT_VERSION,
                    len(encoded_key),
                    slot,
                    first_part + position,
                    part_count,
                    nbytes,
                    generation,
                    checksum,
                )
                + key_and_padding
            )
            records.append(body + pack_checksum(digest(body)))
        return records[0] if len(records) == 1 else b"".join(records)

    def _after_failed_write(
        self, key: str, failure: _WriteFailed, slots: tuple[int, ...]
    ) -> None:
        """Log the failure; on ENOSPC/EFBIG retire the one slot of this write that failed
        (the others go back to the free list), so that later puts do not fail there."""
        error = failure.error
        if error.errno not in _NO_SPACE:
            logger.warning("ssd tier: writing %r failed: %s", key, error)
            return
        if failure.offset >= self._data_offset:
            failed_slot = (failure.offset - self._data_offset) // self._slot_bytes
        else:
            failed_slot = max(0, failure.offset - self._header_offset) // RECORD_BYTES
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

    def _drop(self, stored: _StoredObject) -> None:
        """Remove an object that can no longer be trusted; report it as evicted."""
        self._invalidate_records(stored.pages)
        self._slots.retire(stored)
        self._evicted[stored.key] = None

    def _invalidate_records(self, slots: Sequence[int]) -> None:
        """Zero the header records of `slots` (before they can be reused). Best effort: a
        record that stays stale describes slots whose new bytes fail its payload checksum,
        so it can cost an object later but never serve a wrong one."""
        for run in _consecutive_runs(sorted(slots)):
            offset = self.slot_record_offset(run[0])
            remaining = len(run) * RECORD_BYTES
            try:
                while remaining:
                    chunk = min(remaining, len(_ZEROS))
                    self._pwrite_all(memoryview(_ZEROS)[:chunk], offset)
                    offset += chunk
                    remaining -= chunk
            except _WriteFailed as failure:
                logger.warning("ssd tier: zeroing header records failed: %s", failure.error)

    def _extents(self, slots: tuple[int, ...], nbytes: int) -> tuple[tuple[int, int, int], ...]:
        """(file offset, object offset, length) per run of consecutive slots."""
        slot_bytes = self._slot_bytes
        if len(slots) == 1:  # the common case for KV blocks, kept off the generic path
            return ((self._data_offset + slots[0] * slot_bytes, 0, nbytes),) if nbytes else ()
        extents: list[tuple[int, int, int]] = []
        part = 0
        for run in _consecutive_runs(slots):
            start = part * slot_bytes
            length = min(len(run) * slot_bytes, nbytes - start)
            if length > 0:
                extents.append((self.slot_data_offset(run[0]), start, length))
            part += len(run)
        return tuple(extents)

    def _pwrite_all(self, data: Buffer, offset: int) -> None:
        """pwrite until done (a short write is legal, e.g. at a file size limit); raise
        `_WriteFailed` with the offset reached when the kernel refuses the rest."""
        written = 0
        try:
            written = os.pwrite(self._fd, data, offset)
            view = memoryview(data)
            while written < view.nbytes:
                written += os.pwrite(self._fd, view[written:], offset + written)
        except OSError as error:
            raise _WriteFailed(error, offset + written) from error

    # ------------------------------------------------------------- the read path

    def _read_extents(
        self, extents: tuple[tuple[int, int, int], ...], destination: memoryview
    ) -> bool:
        """Read every extent into its place in `destination`; False when the file ends
        before the object does (truncated underneath us). OSError on I/O errors."""
        fd = self._fd
        whole = destination.nbytes
        for file_offset, start, length in extents:
            target = destination if length == whole else destination[start : start + length]
            done = os.preadv(fd, [target], file_offset)
            while done < length:  # short reads are legal; zero means the file ended
                count = os.preadv(fd, [target[done:]], file_offset + done)
                if count == 0:
                    return False
                done += count
        return True

    # ------------------------------------------------------- opening and rebuilding

    def _open_locked(self, directory: Path) -> int:
        """Create the directory (0700) or check it, and open (or create, 0600) the slot
        file without following a symlink, refusing one another user owns or can read;
        hold an exclusive flock so that two tiers never share a file."""
        prepare_directory(directory, "SSD directory")
        fd = open_private_file(self._path, os.O_RDWR | os.O_CREAT, "SSD slot file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(
                errno.EBUSY, f"{self._path} is in use by another SsdTier", str(self._path)
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _superblock(self) -> bytes:
        fields = _SUPERBLOCK.pack(
            _SUPERBLOCK_MAGIC,
            FORMAT_VERSION,
            RECORD_BYTES,
            self._slot_bytes,
            self._total_slots,
            self._data_offset,
        )
        return fields + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))

    def _load_or_format(self) -> None:
        file_bytes = os.fstat(self._fd).st_size
        expected = self._superblock()
        found = os.pread(self._fd, len(expected), 0) if file_bytes else b""
        if found == expected:
            if file_bytes < self._file_bytes:
                # Cut short (the superblock survived, records and data past the cut did not):
                # what was recorded there is lost, and says so rather than vanishing.
                logger.warning(
                    "ssd tier: %s was truncated to %d of its %d bytes; the objects recorded "
                    "past that are lost",
                    self._path,
                    file_bytes,
                    self._file_bytes,
                )
                self._counters.dropped_at_open += 1
            self._rebuild_index(file_bytes)
        else:
            if file_bytes:
                lost = self._count_objects_in_place(file_bytes)
                logger.warning(
                    "ssd tier: %s has a damaged or truncated superblock or another geometry; "
                    "emptying it (%s)",
                    self._path,
                    f"{lost} objects lost" if lost else "the objects it held are lost",
                )
                self._counters.dropped_at_open += max(1, lost)
            self._format()

    def _format(self) -> None:
        """Start an empty file. The superblock goes in last so that a crash while
        formatting leaves a file the next open formats again."""
        self._slots.reset()
        try:
            os.ftruncate(self._fd, 0)
            self._pwrite_all(self._superblock(), 0)
        except (OSError, _WriteFailed) as error:
            raise OSError(
                getattr(error, "errno", None) or errno.EIO,
                f"cannot format the SSD slot file {self._path}: {error}; check the disk",
            ) from None

    def _require_room(self) -> None:
        """Refuse, before anything is allocated, a file the filesystem cannot hold."""
        info = os.fstat(self._fd)
        try:
            vfs = os.fstatvfs(self._fd)
        except OSError:
            return  # posix_fallocate will say
        have = info.st_blocks * 512 + vfs.f_bavail * vfs.f_frsize
        if self._file_bytes > have:
            raise OSError(
                errno.ENOSPC,
                f"the SSD tier needs {self._file_bytes} bytes for {self._path} but its "
                f"filesystem has {have} available; lower --ssd-capacity or free space",
            )

    def _preallocate(self) -> None:
        """Reserve the whole file for real, or refuse to open (see the module docstring)."""
        try:
            os.posix_fallocate(self._fd, 0, self._file_bytes)
        except OSError as error:
            raise OSError(
                error.errno,
                f"cannot reserve {self._file_bytes} bytes for the SSD slot file {self._path} "
                f"({os.strerror(error.errno or errno.ENOSPC)}); lower --ssd-capacity, free "
                "space, or raise the file size limit",
            ) from None

    def _count_objects_in_place(self, file_bytes: int) -> int:
        """Objects whose records, read with this geometry, are intact: what a reset of a
        file with a damaged superblock loses (0 when nothing readable is left)."""
        if file_bytes <= self._header_offset:
            return 0
        generations = set()
        try:
            for slot, record in self._scan_records():
                parsed = self._parse_record(slot, record)
                if parsed is not None:
                    generations.add(parsed.generation)
        except OSError:
            return 0
        return len(generations)

    def _rebuild_index(self, file_bytes: int) -> None:
        """Keep every complete, self-consistent object described by the header area; zero
        the records of everything else and count it in `dropped_at_open`."""
        groups: dict[int, list[_Record]] = {}
        damaged: list[int] = []
        highest_generation = 0
        for slot, record in self._scan_records():
            parsed = self._parse_record(slot, record)
            if parsed is None:
                damaged.append(slot)
                continue
            groups.setdefault(parsed.generation, []).append(parsed)
            highest_generation = max(highest_generation, parsed.generation)
        self._next_generation = highest_generation + 1
        dropped = len(damaged)
        to_zero = damaged
        newest: dict[str, tuple[int, tuple[int, ...], _Record]] = {}
        for generation in sorted(groups):
            records = groups[generation]
            slots = self._complete_object_slots(records, file_bytes)
            if slots is None:
                dropped += 1
                to_zero.extend(record.slot for record in records)
                continue
            key = records[0].key
            previous = newest.get(key)
            if previous is not None:  # a lost write left two copies; the newer one wins
                dropped += 1
                to_zero.extend(previous[1])
            newest[key] = (generation, slots, records[0])
        self._slots.restore(
            _StoredObject(
                first.key,
                slots,
                self._extents(slots, first.nbytes),
                first.nbytes,
                first.checksum,
                generation,
            )
            for generation, slots, first in sorted(newest.values(), key=lambda item: item[0])
        )
        self._invalidate_records(to_zero)
        self._counters.dropped_at_open += dropped
        if dropped:
            logger.warning(
                "ssd tier: dropped %d damaged or incomplete entries while opening %s",
                dropped,
                self._path,
            )

    def _scan_records(self) -> Iterator[tuple[int, bytes]]:
        """(slot, record) for every record that is not all zeros (a free slot's): records
        with the magic and garbage alike, so that garbage is counted as damage rather than
        silently taken for free slots. All-zero chunks are skipped at C speed."""
        chunk_slots = _SCAN_CHUNK_RECORDS
        for first in range(0, self._total_slots, chunk_slots):
            count = min(chunk_slots, self._total_slots - first)
            chunk = os.pread(self._fd, count * RECORD_BYTES, self.slot_record_offset(first))
            if not chunk.strip(b"\0"):
                continue
            for index in range(count):
                record = chunk[index * RECORD_BYTES : (index + 1) * RECORD_BYTES]
                if record.startswith(_RECORD_MAGIC) or record.strip(b"\0"):
                    yield first + index, record

    def _parse_record(self, slot: int, record: bytes) -> _Record | None:
        """The record's fields when it is whole and self-consistent, else None."""
        if len(record) != RECORD_BYTES:
            return None
        (stored_checksum,) = _CHECKSUM.unpack_from(record, _RECORD_CHECKED_BYTES)
        if xxhash.xxh3_64_intdigest(record[:_RECORD_CHECKED_BYTES]) != stored_checksum:
            return None
        (_, version, key_bytes, own_slot, part_index, part_count, nbytes, generation,
         checksum) = _RECORD_HEAD.unpack_from(record)  # fmt: skip
        if (
            version != FORMAT_VERSION
            or own_slot != slot
            or key_bytes > MAX_KEY_BYTES
            or part_count != pages_for(nbytes, self._slot_bytes)
            or part_index >= part_count
            or generation == 0
        ):
            return None
        start = _RECORD_HEAD.size
        try:
            key = record[start : start + key_bytes].decode("utf-8")
        except UnicodeDecodeError:
            return None
        return _Record(slot, key, part_index, part_count, nbytes, generation, checksum)

    def _complete_object_slots(
        self, records: list[_Record], file_bytes: int
    ) -> tuple[int, ...] | None:
        """Slots in part order when `records` (one generation) form a whole object whose
        bytes lie inside the file, else None."""
        first = records[0]
        identity = (first.key, first.part_count, first.nbytes, first.checksum)
        if len(records) != first.part_count or any(
            (record.key, record.part_count, record.nbytes, record.checksum) != identity
            for record in records
        ):
            return None
        by_part = sorted(records, key=lambda record: record.part_index)
        if [record.part_index for record in by_part] != list(range(first.part_count)):
            return None
        slots = tuple(record.slot for record in by_part)
        extents = self._extents(slots, first.nbytes)
        if any(offset + length > file_bytes for offset, _, length in extents):
            return None
        return slots

    # ------------------------------------------------------------------ helpers

    def _require_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("SsdTier is closed")


def _consecutive_runs(slots: Sequence[int]) -> Sequence[tuple[int, ...]]:
    """Split `slots` (in the given order) into runs of consecutive ascending indices."""
    if len(slots) <= 1:
        return (tuple(slots),) if slots else ()
    runs = []
    start = 0
    for index in range(1, len(slots)):
        if slots[index] != slots[index - 1] + 1:
            runs.append(tuple(slots[start:index]))
            start = index
    runs.append(tuple(slots[start:]))
    return runs


def _encode_key(key: str) -> bytes | None:
    """The key as stored, or None when it cannot be (too long, unencodable)."""
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return encoded if len(encoded) <= MAX_KEY_BYTES else None


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


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


def flip_stored_bytes(directory: str | os.PathLike[str]) -> int:
    """Fault injection from outside the owning process: flip the first payload byte of
    every occupied slot of the slot file in `directory` (read through the superblock,
    without the lock: the owner keeps serving). Returns the number of slots flipped."""
    path = Path(directory) / SLOT_FILE_NAME
    descriptor = os.open(path, os.O_RDWR)
    try:
        superblock = os.pread(descriptor, _SUPERBLOCK.size, 0)
        _, _, _, slot_bytes, total_slots, data_offset = _SUPERBLOCK.unpack(superblock)
        flipped = 0
        for slot in range(total_slots):
            record = os.pread(descriptor, len(_RECORD_MAGIC),
                              SUPERBLOCK_BYTES + slot * RECORD_BYTES)
            if record != _RECORD_MAGIC:
                continue
            offset = data_offset + slot * slot_bytes
            byte = os.pread(descriptor, 1, offset)
            os.pwrite(descriptor, bytes([byte[0] ^ 0xFF]), offset)
            flipped += 1
        return flipped
    finally:
        os.close(descriptor)
