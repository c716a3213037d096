"""Host memory for the embedded tier: one prefaulted slab, and flat byte views of buffers.

Why a prefaulted slab: copying into memory that was never touched runs at ~0.43 GB/s on
these machines because every 4 KiB page faults on first write, while a prefaulted buffer
takes copies at the memcpy limit (~12 GB/s; see docs/backends.md). So the pool pays the
faults once, at construction, and never again.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from umbp.runtime.population import Progress, populate

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["allocate_prefaulted_slab", "byte_view", "byte_views", "populate_threads"]

logger = logging.getLogger("umbp")

# Linux's MADV_POPULATE_WRITE (5.14+): fault every page in one syscall. Python exposes the
# constant only from 3.13, so the Linux value is spelled out for older interpreters.
_MADV_POPULATE_WRITE: int | None = getattr(
    mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None
)
_OS_PAGE_BYTES = mmap.PAGESIZE
_POPULATE_STEP_BYTES = 256 << 20
_REPORT_INTERVAL_S = 2.0


def allocate_prefaulted_slab(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` whose pages are all resident and writable.

    Private (not the shared default of `mmap.mmap(-1, n)`) so that a forked child gets a
    copy-on-write image instead of silently sharing pages with a parent that keeps its own
    index, and so that transparent huge pages apply (shared anonymous memory is shmem,
    governed by a different THP switch). Pages are faulted in by several threads
    (`umbp.runtime.population`); a population that lasts logs its progress.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    slab = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _advise_huge_pages(slab)
    if not _populate_in_kernel(slab):
        _touch_every_page(slab)
    return slab


def populate_threads() -> int:
    """Threads that fault a pool in: the CPUs this process may run on, at most 8 (page
    faults of one process contend beyond that)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def _advise_huge_pages(slab: mmap.mmap) -> None:
    """Ask for transparent huge pages: 512x fewer faults to prefault and fewer TLB misses
    while copying. Best effort; a kernel without THP simply keeps 4 KiB pages."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        slab.madvise(advice)
    except OSError:
        pass


def _populate_in_kernel(slab: mmap.mmap) -> bool:
    """Prefault with MADV_POPULATE_WRITE, a range per thread (through libc, which lets go
    of the GIL; `mmap.madvise` holds it); False when the kernel or platform lacks it."""
    madvise = _libc_madvise()
    if _MADV_POPULATE_WRITE is None or madvise is None:
        return False
    anchor = ctypes.c_char.from_buffer(slab)
    base = ctypes.addressof(anchor)
    advice = _MADV_POPULATE_WRITE

    def fill(offset: int, length: int) -> None:
        if madvise(ctypes.c_void_p(base + offset), ctypes.c_size_t(length), advice) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"madvise(MADV_POPULATE_WRITE): {os.strerror(error)}")

    try:
        populate(
            len(slab), fill, threads=populate_threads(), step_bytes=_POPULATE_STEP_BYTES,
            report=_log_progress, interval_s=_REPORT_INTERVAL_S,
        )
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.ENOSYS):  # a kernel before 5.14
            return False
        raise
    finally:
        del anchor  # the slab can be closed again once no ctypes object exports it
    return True


def _libc_madvise() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function: Callable[..., int] | None = getattr(libc, "madvise", None)
    return function


def _log_progress(progress: Progress) -> None:
    logger.info("umbp: prefaulting the pool: %s", progress.describe())


def _touch_every_page(slab: mmap.mmap) -> None:
    """Fallback prefault: write one zero byte per OS page (the mapping is zero already, so
    contents do not change; the write is what makes the kernel back the page)."""
    view = memoryview(slab)
    try:
        touched = view[::_OS_PAGE_BYTES]
        touched[:] = bytes(len(touched))
        touched.release()
    finally:
        view.release()


def byte_view(buffer: Buffer, *, writable: bool) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (memoryview, bytearray, numpy
    array of any dtype and shape), so that copies are plain `memoryview` slice assignments.

    Raises TypeError when `buffer` does not export the buffer protocol and ValueError when
    it is not C-contiguous or, for `writable`, is read-only: those are caller bugs, not
    store failures.
    """
    view = memoryview(buffer)
    if writable and view.readonly:
        raise ValueError("output buffer is read-only; pass a writable buffer")
    if not view.c_contiguous:
        raise ValueError(
            "buffer must be C-contiguous; pass a contiguous copy (e.g. tensor.contiguous())"
        )
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except TypeError as error:
        raise ValueError(f"cannot view buffer of format {view.format!r} as bytes") from error


def byte_views(
    keys: Sequence[str], buffers: Sequence[Buffer], *, writable: bool
) -> list[memoryview]:
    """`byte_view` of each buffer of a batch (payloads to put, or `writable` outs to load
    into), after checking there is one per key: every store validates a whole batch
    before it touches anything, so a caller bug never leaves a batch half done."""
    if len(keys) != len(buffers):
        name = "outs" if writable else "payloads"
        raise ValueError(f"keys and {name} differ in length: {len(keys)} != {len(buffers)}")
    return [byte_view(buffer, writable=writable) for buffer in buffers]
