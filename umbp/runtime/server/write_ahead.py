"""DRAM objects copied to the SSD tier before they are evicted, so that making room
writes nothing.

Tiers are inclusive (`tiering`): a victim whose SSD copy exists leaves DRAM without a
write. Without this, every room-making pays for its victims' writes while it holds up
the put or the prefetch that needed the room (a 64 MiB prefix prefetched into a full
256 MiB DRAM tier waited ~140 ms on them: `docs/performance.md`). One thread keeps the
least recently used objects, as many pages as `ahead_pages` less what is free below the
high watermark, copied to the SSD tier; they stay in DRAM and keep serving hits. Woken by
every put and promotion; a batch at a time (the index lock is held only to choose it);
after the SSD tier refuses a write it rests before trying again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["WriteAhead"]

logger = logging.getLogger("umbp.serve")

BATCH_OBJECTS = 32
"""Objects chosen per hold of the index lock."""
REST_AFTER_FAILURE_S = 1.0
"""How long the thread rests after the SSD tier refused a write (disk full)."""


class WriteAhead:
    """The thread; `write_batch(limit)` (`Tiering.write_ahead`) takes at most `limit`
    objects and says (how many it took, whether the SSD tier refused one)."""

    def __init__(self, write_batch: Callable[[int], tuple[int, bool]]) -> None:
        self._write_batch = write_batch
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
            try:
                taken, refused = self._write_batch(BATCH_OBJECTS)
            except Exception:
                logger.exception("umbp serve: writing DRAM objects ahead to the SSD tier failed")
                return True
            if refused:
                return True
            if not taken:
                return False
        return False
