"""The server's DRAM tier as a shared-memory file that clients map.

The file is created and opened with `os.open` + `mmap`, not `multiprocessing.shared_memory`:
a process that attaches through the latter registers the segment with its own resource
tracker, which unlinks it when that process exits (docs/backends.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from umbp.runtime.population import Progress, populate
from umbp.runtime.private_files import check_private_descriptor
from umbp.runtime.server.page_tables import fill_in_background

__all__ = [
    "SHM_DIRECTORY",
    "SharedPool",
    "create_shared_pool",
    "map_shared_pool",
    "release_shared_pool",
    "remove_shared_pool",
    "remove_stale_pool",
]

SHM_DIRECTORY = Path("/dev/shm")
_ALLOCATION_STEP_BYTES = 1 << 30


@dataclass(frozen=True)
class SharedPool:
    """A mapped shared-memory file: `view` is the whole of it, writable."""

    path: str
    nbytes: int
    mapping: mmap.mmap
    view: memoryview
    lock_fd: int | None = None
    """The creator's descriptor, flocked for the pool's life: how a later server tells a
    live pool (locked) from one a killed server left behind (`remove_stale_pool`)."""


def create_shared_pool(
    nbytes: int,
    directory: Path = SHM_DIRECTORY,
    *,
    report: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> SharedPool:
    """A new owner-only file of `nbytes` in `directory`, its pages allocated up front
    (tmpfs answers ENOSPC now instead of SIGBUS on some later write) and mapped.

    Allocation runs in 1 GiB steps, `report`ed at most every second while it lasts
    (docs/performance.md, "Start-up": about 0.3 s per GiB here), and ends early with
    `PopulationStopped` when `should_stop` says so. One thread: tmpfs allocates a file's
    pages under that file's lock, so more threads on one file measured no faster."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    _require_room(directory, nbytes)
    path = str(directory / f"umbp-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask must not loosen or tighten it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, nbytes)

        def allocate(offset: int, length: int) -> None:
            os.posix_fallocate(fd, offset, length)

        try:
            populate(nbytes, allocate, step_bytes=_ALLOCATION_STEP_BYTES, report=report,
                     should_stop=should_stop)
        except OSError as error:
            raise OSError(
                error.errno,
                f"cannot allocate the {nbytes}-byte DRAM tier in {directory} "
                f"({os.strerror(error.errno or errno.ENOSPC)}); lower --capacity or enlarge "
                f"{directory}",
            ) from None
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    _advise(mapping)
    return SharedPool(path, nbytes, mapping, memoryview(mapping), lock_fd=fd)


def _require_room(directory: Path, nbytes: int) -> None:
    """Refuse at once, with the figures, a pool the filesystem cannot hold (rather than
    after a long posix_fallocate that fails anyway)."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return  # posix_fallocate will say
    free = info.f_bavail * info.f_frsize
    if nbytes > free:
        raise OSError(
            errno.ENOSPC,
            f"the DRAM tier needs {nbytes} bytes but {directory} has {free} free; "
            f"lower --capacity or enlarge {directory}",
        )


def map_shared_pool(path: str, nbytes: int) -> SharedPool:
    """Map a file another process created; raises OSError when it is missing or is not
    `nbytes` long (a server restarted under the same name must never be mistaken for the
    one whose geometry the caller was told)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual != nbytes:
            raise OSError(f"{path} holds {actual} bytes, the server announced {nbytes}")
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    _advise(mapping)
    fill_in_background(mapping, nbytes)
    return SharedPool(path, nbytes, mapping, memoryview(mapping))


def remove_shared_pool(path: str) -> None:
    _unlink_quietly(path)


def release_shared_pool(pool: SharedPool) -> None:
    """The creator's end: remove the file, then drop the lock that marked it live."""
    remove_shared_pool(pool.path)
    if pool.lock_fd is not None:
        with contextlib.suppress(OSError):
            os.close(pool.lock_fd)


def remove_stale_pool(path: str) -> bool:
    """Remove the pool file at `path` only when it is provably a dead server's of this
    user: a regular file of ours that no live server holds locked. True when removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # gone already, or a symlink: not ours to touch
    try:
        check_private_descriptor(fd, path, "pool file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # UnsafePath, or BlockingIOError: a live server holds it
        return False
    else:
        _unlink_quietly(path)
        return True
    finally:
        os.close(fd)


def _advise(mapping: mmap.mmap) -> None:
    """Ask for transparent huge pages (fewer faults and TLB misses while copying); honoured
    only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows, harmless elsewhere.

    No prefault (MADV_POPULATE_WRITE) here: filling a process's page tables costs ~0.2 s
    per GiB, which would make connecting to a large pool outlast any sensible I/O
    timeout; `page_tables` does it in the background."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        mapping.madvise(advice)
    except OSError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
