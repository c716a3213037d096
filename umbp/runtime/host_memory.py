"""Host memory for the embedded tier: one prefaulted slab, and flat byte views of buffers.

Why a prefaulted slab: copying into memory that was never touched runs at ~0.43 GB/s on
these machines because every 4 KiB page faults on first write, while a prefaulted buffer
takes copies at the memcpy limit (~12 GB/s; see docs/backends.md). So the pool pays the
faults once, at construction, and never again.
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["allocate_prefaulted_slab", "byte_view", "byte_views"]

# Linux's MADV_POPULATE_WRITE (5.14+): fault every page in one syscall. Python exposes the
# constant only from 3.13, so the Linux value is spelled out for older interpreters.
_MADV_POPULATE_WRITE: int | None = getattr(
    mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None
)
_OS_PAGE_BYTES = mmap.PAGESIZE


def allocate_prefaulted_slab(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` whose pages are all resident and writable.

    Private (not the shared default of `mmap.mmap(-1, n)`) so that a forked child gets a
    copy-on-write image instead of silently sharing pages with a parent that keeps its own
    index, and so that transparent huge pages apply (shared anonymous memory is shmem,
    governed by a different THP switch).
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    slab = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _advise_huge_pages(slab)
    if not _populate_in_kernel(slab):
        _touch_every_page(slab)
    return slab


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
    """Prefault with one madvise call; False when the kernel or platform lacks it."""
    if _MADV_POPULATE_WRITE is None:
        return False
    try:
        slab.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        return False
    return True


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
