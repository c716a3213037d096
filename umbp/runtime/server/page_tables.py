"""A mapping of the server's DRAM tier with its pages made present in the background.

`umbp serve` allocates the pool with `posix_fallocate`, which reserves tmpfs pages but
leaves them to be zeroed on their first touch; and each process that maps the pool gets
a page-table entry for a page only when it first touches it. Both costs fell inside
requests: copying 64 MiB out of never-touched pages took 91.5 ms against 10.6 ms once
present (this VM: ~5 us per 4 KiB), and ~13.5 ms from pages zeroed before but new to the
copying process (docs/performance.md, "Pages present before the first copy"). So the
server, once its pool exists, and every engine, once it has mapped it, run a thread that
touches every page once with `MADV_POPULATE_WRITE` (no byte changes: pages are zeroed
or mapped, never rewritten), a step at a time, at idle priority, while requests go on.
Not before serving or connecting: it takes ~0.2 s per GiB. Kernels before 5.14 lack
the advice: pages then become present on first touch, as before (logged at INFO).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

__all__ = ["STEP_BYTES", "fill_in_background"]

logger = logging.getLogger("umbp")

MADV_POPULATE_WRITE = 23
STEP_BYTES = 2 << 20
"""Made present per call: short, because the kernel holds the process's memory-map lock
(shared) meanwhile, and an `mmap` of the engine (a tensor allocation) waits for it."""


def fill_in_background(
    mapping: mmap.mmap,
    nbytes: int,
    done: Callable[[int, float], None] | None = None,
    stop: threading.Event | None = None,
) -> threading.Thread:
    """Start the thread that makes every page of `mapping` (`nbytes`) present in this
    process, step by step until `stop` is set; `done(nbytes, seconds)` when it has (not
    when the kernel refused, nor when stopped)."""
    thread = threading.Thread(target=_fill, args=(mapping, nbytes, done, stop or threading.Event()),
                              name="umbp-page-tables", daemon=True)
    thread.start()
    return thread


def _fill(
    mapping: mmap.mmap,
    nbytes: int,
    done: Callable[[int, float], None] | None,
    stop: threading.Event,
) -> None:
    _run_when_idle()
    started = time.monotonic()
    try:
        # An export of the mapping keeps it open (mmap.close refuses) while we advise.
        anchor = ctypes.c_char.from_buffer(mapping)
    except (TypeError, ValueError, BufferError):
        return  # closed already
    base = ctypes.addressof(anchor)
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    for offset in range(0, nbytes, STEP_BYTES):
        if stop.is_set():
            return
        # A foreign call: the GIL is released while the kernel works.
        if madvise(base + offset, min(STEP_BYTES, nbytes - offset), MADV_POPULATE_WRITE):
            error = ctypes.get_errno()
            logger.info("umbp: the DRAM tier's pages become present on first touch here "
                        "(MADV_POPULATE_WRITE: %s)", os.strerror(error))
            return
    del anchor
    if done is not None:
        done(nbytes, time.monotonic() - started)


def _run_when_idle() -> None:
    """Linux SCHED_IDLE: only CPU time nothing else wants (elsewhere: normal priority)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass
