"""DRAM objects copied to the SSD tier before they are evicted, so that making room
writes nothing.

Tiers are inclusive (`tiering`): a victim whose SSD copy exists leaves DRAM without a
write. Without this, every room-making pays for its victims' writes while it holds up
the put or the prefetch that needed the room (a 64 MiB prefix prefetched into a full
256 MiB DRAM tier waited ~140 ms on them: `docs/performance.md`). One thread keeps the
least recently used objects, as many pages as `ahead_pages` less what is free below the
high watermark, copied to the SSD tier; they stay in DRAM and keep serving hits. Woken by
every put and promotion; a batch at a time (the index lock is held only to choose it);
after the SSD tier refuses a write it rests before trying again. It gives way to reads of
the SSD tier (prefetches, gets promoting): the tier holds its lock through each write,
so a read queued behind the writer would wait for the disk, which is what writing ahead
is for sparing it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

__all__ = ["WriteAhead"]

logger = logging.getLogger("umbp.serve")

BATCH_OBJECTS = 32
"""Objects chosen per hold of the index lock."""
REST_AFTER_FAILURE_S = 1.0
"""How long the thread rests after the SSD tier refused a write (disk full)."""
GIVE_WAY_POLL_S = 0.002
"""How often the thread looks again whether the SSD tier's readers are done."""


class WriteAhead:
    """The thread; `write_batch(limit, give_way)` (`Tiering.write_ahead`) takes at most
    `limit` objects, stopping early once `give_way()`, and says (how many it took,
    whether the SSD tier refused one); `give_way()`: the SSD tier is being read."""

    def __init__(
        self, write_batch: Callable[[int, Callable[[], bool]], tuple[int, bool]],
        give_way: Callable[[], bool],
    ) -> None:
        self._write_batch = write_batch
        self._give_way = give_way
        self._wake = threading.Condition(threading.Lock())
        self._poked = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="umbp-write-ahead", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """DRAM gained objects: there may be more to write."""
        with self._wake:
            if not self._poked:
                self._poked = True
                self._wake.notify()

    def close(self) -> None:
        """Stop after the batch in progress."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=60.0)

    def _run(self) -> None:
        _run_when_idle()
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._poked or self._closed)
                if self._closed:
                    return
                self._poked = False
            refused = self._write_until_done()
            if refused:
                with self._wake:
                    self._wake.wait_for(lambda: self._closed, REST_AFTER_FAILURE_S)

    def _write_until_done(self) -> bool:
        """Batches until nothing is left to write; True when the SSD tier refused one."""
        while not self._closed:
            self._wait_for_readers()
            try:
                taken, refused = self._write_batch(BATCH_OBJECTS, self._give_way)
            except Exception:
                logger.exception("umbp serve: writing DRAM objects ahead to the SSD tier failed")
                return True
            if refused:
                return True
            if not taken and not self._give_way():
                return False
        return False

    def _wait_for_readers(self) -> None:
        with self._wake:
            while not self._closed and self._give_way():
                self._wake.wait(GIVE_WAY_POLL_S)


def _run_when_idle() -> None:
    """Schedule the calling thread only on CPU time nothing else wants (Linux SCHED_IDLE):
    writing ahead is housekeeping, and must not take a core from the model's forward
    pass or from the server's answers; elsewhere the thread keeps its priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as error:
        logger.info("umbp serve: writing ahead at normal priority (%s)", error)
