"""The SSD tier's index: one `StoredObject` per resident object (its slots, extents and
checksum), and the index rebuilt from the slot file when it is opened: keep what the
file holds whole, or start it empty.

A file that does not start with the superblock's magic is not umbp's: it is refused with a
`ForeignSlotFile` naming the path and the fix, and nothing is written to it. A file whose
superblock matches the tier's geometry is kept: every complete,
self-consistent object its header records describe is recovered
(`umbp.runtime.ssd.format.recover`), the records of everything else are zeroed, and each damaged
record, incomplete or inconsistent object and lost tail counts in `dropped_at_open`. A
file cut short keeps what lies before the cut. Any other file (a damaged superblock,
another slot size or capacity) is emptied and formatted, its objects counted as lost.

Write ordering and what a crash leaves behind. A put writes (1) zeros over the records of
any objects it evicts, (2) the payload into its slots, (3) its header records, last. A
remove, eviction or corrupt-drop zeros the object's records before its slots can be
reused. So at every instant the records on disk describe only objects whose bytes are
fully in place, and when a process dies at any point (kill -9; the page cache survives)
the reopened tier holds every object that was resident at that moment, nothing whose put
had not returned, and serves each bit-identically (an object caught with only some
records written, or some zeroed, is incomplete and dropped at open).

No fsync per put: this is a cache. After a power loss or kernel crash the page cache may
reach the disk in any order, so recent objects may be lost or a stale record may describe
slots that now hold other bytes. That can cost objects but never serves wrong bytes: the
payload checksum is verified on every read, a mismatch answers CORRUPT and drops the
object (its records zeroed, its slots freed). `SsdTier.flush()` is there for a caller
that wants the current state on stable storage (e.g. at shutdown).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from umbp.runtime.paging import Resident
from umbp.runtime.ssd.file import WriteFailed, pwrite_all, zero_records
from umbp.runtime.ssd.format import (
    SUPERBLOCK_MAGIC,
    Extents,
    SlotGeometry,
    count_objects_in_place,
    recover,
)

__all__ = ["ForeignSlotFile", "OpenedFile", "StoredObject", "load_or_format"]

logger = logging.getLogger("umbp")


class StoredObject(Resident):
    """Where one object lives and what it must hash to. Its `pages` are its slots, in
    object order."""

    __slots__ = ("checksum", "extents", "generation", "nbytes")

    def __init__(
        self,
        key: str,
        slots: tuple[int, ...],
        extents: Extents,
        nbytes: int,
        checksum: int,
        generation: int,
    ) -> None:
        # Every field set here, Resident's too: a reopen builds one per object.
        self.key = key
        self.pages = slots
        self.pins = 0
        self.leaving = False
        self.retired = False
        self.extents = extents
        """(file offset, offset in the object, length) of each run of consecutive slots,
        so a read or write is one syscall per run rather than per slot."""
        self.nbytes = nbytes
        self.checksum = checksum
        self.generation = generation


@dataclass(frozen=True, slots=True)
class OpenedFile:
    """What an opened slot file holds, for the tier to index."""

    objects: tuple[StoredObject, ...]
    """Complete objects, oldest generation first (the LRU order to rebuild)."""
    next_generation: int
    dropped: int
    """Entries dropped while opening (`SsdStats.dropped_at_open`)."""


class ForeignSlotFile(OSError):
    """The file at the slot file's path is not an umbp SSD slot file; it was not touched."""


def load_or_format(fd: int, geometry: SlotGeometry, path: Path) -> OpenedFile:
    """Recover the objects of the slot file open as `fd` at `path`, or format it when
    its superblock does not match `geometry`. Raises `ForeignSlotFile` for a file that
    is not umbp's, before writing anything."""
    file_bytes = os.fstat(fd).st_size
    expected = geometry.superblock()
    found = os.pread(fd, len(expected), 0) if file_bytes else b""
    if file_bytes and not SUPERBLOCK_MAGIC.startswith(found[: len(SUPERBLOCK_MAGIC)]):
        raise ForeignSlotFile(
            f"{path} is not an umbp SSD slot file (it does not start with "
            f"{SUPERBLOCK_MAGIC.decode()}; {file_bytes} bytes left untouched); move it away "
            "or choose another --ssd-dir"
        )
    if found == expected:
        dropped = 0
        if file_bytes < geometry.file_bytes:
            # Cut short (the superblock survived, records and data past the cut did not):
            # what was recorded there is lost, and says so rather than vanishing.
            logger.warning(
                "ssd tier: %s was truncated to %d of its %d bytes; the objects recorded "
                "past that are lost",
                path,
                file_bytes,
                geometry.file_bytes,
            )
            dropped += 1
        return _rebuild_index(fd, geometry, path, file_bytes, dropped)
    dropped = 0
    if file_bytes:
        lost = count_objects_in_place(fd, geometry, file_bytes)
        logger.warning(
            "ssd tier: %s has a damaged or truncated superblock or another geometry; "
            "emptying it (%s)",
            path,
            f"{lost} objects lost" if lost else "the objects it held are lost",
        )
        dropped += max(1, lost)
    _format(fd, geometry, path)
    return OpenedFile(objects=(), next_generation=1, dropped=dropped)


def _format(fd: int, geometry: SlotGeometry, path: Path) -> None:
    """Start an empty file. The superblock goes in last so that a crash while
    formatting leaves a file the next open formats again."""
    try:
        os.ftruncate(fd, 0)
        pwrite_all(fd, geometry.superblock(), 0)
    except (OSError, WriteFailed) as error:
        raise OSError(
            getattr(error, "errno", None) or errno.EIO,
            f"cannot format the SSD slot file {path}: {error}; check the disk",
        ) from None


def _rebuild_index(
    fd: int, geometry: SlotGeometry, path: Path, file_bytes: int, dropped: int
) -> OpenedFile:
    """Keep every complete, self-consistent object the header area describes; zero
    the records of everything else and count it as dropped."""
    found = recover(fd, geometry, file_bytes)
    zero_records(fd, geometry, found.slots_to_zero)
    if found.dropped:
        logger.warning(
            "ssd tier: dropped %d damaged or incomplete entries while opening %s",
            found.dropped,
            path,
        )
    objects = tuple(
        StoredObject(
            found_object.key,
            found_object.slots,
            geometry.extents(found_object.slots, found_object.nbytes),
            found_object.nbytes,
            found_object.checksum,
            found_object.generation,
        )
        for found_object in found.objects
    )
    return OpenedFile(
        objects=objects,
        next_generation=found.next_generation,
        dropped=dropped + found.dropped,
    )
