"""The server's DRAM tier as a shared-memory file that clients map.

The file is created and opened with `os.open` + `mmap`, not `multiprocessing.shared_memory`:
a process that attaches through the latter registers the segment with its own resource
tracker, which unlinks it when that process exits (docs/backends.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from umbp.runtime.population import Progress, populate
from umbp.runtime.private_files import check_private_descriptor
from umbp.runtime.server.page_tables import fill_in_background

__all__ = [
    "SHM_DIRECTORY",
    "SharedPool",
    "create_shared_pool",
    "detach_shared_pool",
    "map_shared_pool",
    "release_shared_pool",
    "remove_shared_pool",
    "remove_stale_pool",
]

SHM_DIRECTORY = Path("/dev/shm")
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_LIBC = ctypes.CDLL(None, use_errno=True)
_MMAP = _LIBC.mmap
_MMAP.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long)
_MMAP.restype = ctypes.c_void_p
_ALLOCATION_STEP_BYTES = 1 << 30
_MAPPING = threading.Lock()


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
    filler: threading.Thread | None = None
    """A client's thread making the pages present (`page_tables`), stopped by
    `detach_shared_pool` through `stop_filling`."""
    stop_filling: threading.Event = field(default_factory=threading.Event)
    mapping_fd: tuple[int, tuple[int, int]] | None = None
    """The descriptor of the file CPython's `mmap` keeps open (a duplicate of the one it
    was given) until the mapping is collected, and the file's identity (device, inode):
    that descriptor too holds the file's pages."""


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
        identity = _file_identity(fd)
        with _MAPPING:  # no other mapping of ours opens a descriptor of it meanwhile
            already = _descriptors_of(identity)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            kept = _descriptors_of(identity) - already
    finally:
        os.close(fd)
    _advise(mapping)
    stop = threading.Event()
    filler = fill_in_background(mapping, nbytes, stop=stop)
    return SharedPool(path, nbytes, mapping, memoryview(mapping), filler=filler,
                      stop_filling=stop,
                      mapping_fd=(kept.pop(), identity) if len(kept) == 1 else None)


def detach_shared_pool(pool: SharedPool) -> None:
    """A client's end of a pool it will copy nothing more to or from: the file's pages
    leave this process now, not when the last view of them is collected (a view of the
    pool can outlive its use by much: a loan's array kept until the worker's next
    restore). The range is mapped anew to anonymous memory that holds nothing until
    written, so a tmpfs frees the pool's pages once its file is removed and nothing else
    maps it, and a stale view reads zeros rather than faulting."""
    # Not waited for (at idle priority it may wait long for a CPU): a step it began
    # before it saw the stop makes at most `STEP_BYTES` of the empty memory present.
    pool.stop_filling.set()
    try:
        anchor = ctypes.c_char.from_buffer(pool.mapping)
    except (TypeError, ValueError, BufferError):
        return  # unmapped already: there is nothing of it left here
    # The export (`anchor`) keeps the mmap open meanwhile: its range and its descriptor
    # are still its own, not another mapping's or file's.
    address = ctypes.addressof(anchor)
    placed = _MMAP(address, pool.nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0)
    if placed != address:
        raise OSError(ctypes.get_errno(), f"could not let go of the pool {pool.path}")
    if pool.mapping_fd is not None and _is_open_on(*pool.mapping_fd):
        # /dev/null in its place, for the mmap to close when it is collected.
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.dup2(null, pool.mapping_fd[0], inheritable=False)
        finally:
            os.close(null)
    del anchor


def _descriptors_of(identity: tuple[int, int]) -> set[int]:
    """This process's descriptors open on the file of `identity` (device, inode)."""
    return {int(name) for name in os.listdir("/proc/self/fd")
            if _is_open_on(int(name), identity)}


def _is_open_on(fd: int, identity: tuple[int, int]) -> bool:
    try:
        return _file_identity(fd) == identity
    except OSError:
        return False


def _file_identity(fd: int) -> tuple[int, int]:
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


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
