"""The SSD tier's slot file as an open descriptor: opening it safely, reserving its space,
and whole reads and writes (an object's payload, then its header records).

Files: the directory must be this user's (or root's) and not writable by others unless
sticky; the slot file is opened without following symlinks and must be a regular file of
this user's with mode 0600 (created so); anything else is refused with an `UnsafePath`
naming the fix (`umbp.runtime.private_files`). One process at a time: the file is
`flock`ed, and a second opener gets EBUSY.

Preallocation: `os.posix_fallocate` reserves the whole file at open, for real, so that
writes cannot hit ENOSPC later. When the space cannot be had (filesystem too small,
RLIMIT_FSIZE, no fallocate support) the tier does not open: `preallocate` raises an
OSError saying how many bytes it needs and what to do (a tier that grows as it goes
collapses the day another file takes the disk). `require_room` checks the free space
first, so that an absurd capacity is refused before any memory is allocated for the index.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

import xxhash

from umbp.runtime.paged_copy import CHUNK_BYTES
from umbp.runtime.private_files import open_private_file, prepare_directory
from umbp.runtime.ssd.format import (
    RECORD_BYTES,
    Extents,
    SlotGeometry,
    build_records,
    consecutive_runs,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "WriteFailed",
    "open_slot_file",
    "preallocate",
    "pwrite_all",
    "read_extents",
    "require_room",
    "write_object",
    "zero_records",
]

logger = logging.getLogger("umbp")

# The most buffers one preadv/pwritev takes (Linux: 1024); a chunk over pages of a few
# hundred bytes has more, and goes in several calls.
_IOV_MAX: Final = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

_ZEROS = bytes(64 * RECORD_BYTES)


class WriteFailed(Exception):
    """An OSError from a write, with the file offset it failed at (to retire slots)."""

    def __init__(self, error: OSError, offset: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.offset = offset


def open_slot_file(path: Path) -> int:
    """Create `path`'s directory (0700) or check it, and open (or create, 0600) the slot
    file without following a symlink, refusing one another user owns or can read; hold
    an exclusive flock so that two tiers never share a file."""
    prepare_directory(path.parent, "SSD directory")
    fd = open_private_file(path, os.O_RDWR | os.O_CREAT, "SSD slot file")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(errno.EBUSY, f"{path} is in use by another SsdTier", str(path)) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def require_room(fd: int, file_bytes: int, path: Path) -> None:
    """Refuse, before anything is allocated, a file the filesystem cannot hold."""
    info = os.fstat(fd)
    try:
        vfs = os.fstatvfs(fd)
    except OSError:
        return  # posix_fallocate will say
    have = info.st_blocks * 512 + vfs.f_bavail * vfs.f_frsize
    if file_bytes > have:
        raise OSError(
            errno.ENOSPC,
            f"the SSD tier needs {file_bytes} bytes for {path} but its "
            f"filesystem has {have} available; lower --ssd-capacity or free space",
        )


def preallocate(fd: int, file_bytes: int, path: Path) -> None:
    """Reserve the whole file for real, or refuse to open (see the module docstring)."""
    try:
        os.posix_fallocate(fd, 0, file_bytes)
    except OSError as error:
        raise OSError(
            error.errno,
            f"cannot reserve {file_bytes} bytes for the SSD slot file {path} "
            f"({os.strerror(error.errno or errno.ENOSPC)}); lower --ssd-capacity, free "
            "space, or raise the file size limit",
        ) from None


def pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    """`pwritev_all` of one buffer."""
    pwritev_all(fd, [memoryview(data)], offset)


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write `views` in turn at `offset`, in one call while the kernel takes it all,
    until done (a short write is legal, e.g. at a file size limit); raise `WriteFailed`
    with the offset reached when the kernel refuses the rest."""
    try:
        while views:
            written = os.pwritev(fd, views[:_IOV_MAX], offset)
            offset += written
            views = _after(views, written)
    except OSError as error:
        raise WriteFailed(error, offset) from error


def read_extents(fd: int, extents: Extents, destination: Sequence[memoryview]) -> int | None:
    """Read every extent into its place in `destination`, the object's bytes in order
    laid over one or more writable views (the pages a promotion reserved need not be
    contiguous); the xxh3-64 of what arrived, hashed a cache-sized chunk at a time right
    after its read (one pass over the bytes), or None when the file ends before the
    object does (truncated underneath us). OSError on I/O errors."""
    hasher = xxhash.xxh3_64()
    for file_offset, start, length in extents:  # in object order
        for at in range(0, length, CHUNK_BYTES):
            views = _views_of(destination, start + at, start + min(length, at + CHUNK_BYTES))
            if not _read_whole(fd, views, file_offset + at):
                return None
            for view in views:
                hasher.update(view)
    return int(hasher.intdigest())


def _views_of(pieces: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The views of `pieces` (an object's bytes in order) that hold its bytes
    [start, stop)."""
    views: list[memoryview] = []
    base = 0
    for piece in pieces:
        end = base + piece.nbytes
        if end > start and base < stop:
            views.append(piece[max(start, base) - base : min(stop, end) - base])
        if end >= stop:
            break
        base = end
    return views


def _after(views: list[memoryview], count: int) -> list[memoryview]:
    """What of `views` follows their first `count` bytes."""
    while views and count >= views[0].nbytes:
        count -= views[0].nbytes
        views = views[1:]
    if views and count:
        views = [views[0][count:], *views[1:]]
    return views


def _read_whole(fd: int, views: list[memoryview], file_offset: int) -> bool:
    """Fill `views` in turn from `file_offset` (one call while the kernel has it all)."""
    views = [view for view in views if view.nbytes]
    while views:  # short reads are legal; zero means the file ended
        count = os.preadv(fd, views[:_IOV_MAX], file_offset)
        if count == 0:
            return False
        file_offset += count
        views = _after(views, count)
    return True


def write_object(
    fd: int,
    geometry: SlotGeometry,
    slots: tuple[int, ...],
    encoded_key: bytes,
    source: Sequence[memoryview],
    checksum: int | None,
    generation: int,
) -> tuple[Extents, int]:
    """Write one object, its bytes in order over the views of `source` (a DRAM object's
    pages need not be contiguous), into `slots`; its extents and payload checksum
    (`checksum` when the caller knows it, else xxh3-64 computed a cache-sized chunk at a
    time just before that chunk is written, so the write copies bytes the hash brought
    into cache). Payload first, header records last, so that a record on disk always
    describes bytes that are fully in place. On `WriteFailed` the records already
    written are zeroed before it is raised again: nothing of the object stays readable."""
    nbytes = sum(piece.nbytes for piece in source)
    extents = geometry.extents(slots, nbytes)
    written_records: list[int] = []
    try:
        hasher = None if checksum is not None else xxhash.xxh3_64()
        for file_offset, start, length in extents:  # in object order
            for at in range(0, length, CHUNK_BYTES):
                views = _views_of(source, start + at, start + min(length, at + CHUNK_BYTES))
                if hasher is not None:
                    for view in views:
                        hasher.update(view)
                pwritev_all(fd, views, file_offset + at)
        if hasher is not None:
            checksum = int(hasher.intdigest())
        assert checksum is not None
        for run in consecutive_runs(slots):
            records = build_records(run, slots, encoded_key, nbytes, generation, checksum)
            written_records.extend(run)  # before: a short write may leave some whole
            pwrite_all(fd, records, geometry.record_offset(run[0]))
    except WriteFailed:
        zero_records(fd, geometry, written_records)
        raise
    return extents, checksum


def zero_records(fd: int, geometry: SlotGeometry, slots: Sequence[int]) -> None:
    """Zero the header records of `slots` (before they can be reused). Best effort: a
    record that stays stale describes slots whose new bytes fail its payload checksum,
    so it can cost an object later but never serve a wrong one."""
    for run in consecutive_runs(sorted(slots)):
        offset = geometry.record_offset(run[0])
        remaining = len(run) * RECORD_BYTES
        try:
            while remaining:
                chunk = min(remaining, len(_ZEROS))
                pwrite_all(fd, memoryview(_ZEROS)[:chunk], offset)
                offset += chunk
                remaining -= chunk
        except WriteFailed as failure:
            logger.warning("ssd tier: zeroing header records failed: %s", failure.error)
