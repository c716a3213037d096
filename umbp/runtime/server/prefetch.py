"""SSD hits brought into DRAM as soon as a lookup finds them, before the load asks.

An engine's lookup (`LOOKUP`, its admission) that finds objects only on the SSD tier hands
them here, and `readers` threads read them into DRAM, first asked first started first, so
that the load that follows finds them in DRAM: a synchronous restore then never reads the
disk inside an engine step, and an asynchronous one waits less. Several at once (the SSD
tier's reads overlap): one thread's `preadv` and checksum leave copy speed unused (a
64 MiB prefix in 0.6x the time with two, `benchmarks/prefetch_bench.py`), and an NVMe
drive wants more than one read in flight. Bounded: at most `limit_bytes` queued or
being read; keys past that are not prefetched (their load reads them, as before).
Cancelled: each key is queued for an owner (the connection and the engine's request id);
`FORGET` of the request, or the connection closing, drops its keys not yet read. A key
asked for again (another request, the same request asking again) keeps its place.

A get never reads a key twice: one that asks for a key still queued here takes it over
(`claim`), one being read is waited for (then found in DRAM). Its own lock, never held
during a read and never while the server's index lock is waited for.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

__all__ = ["MAX_PREFETCH_READERS", "PREFETCH_READERS", "Owner", "PrefetchFigures", "Prefetcher"]

logger = logging.getLogger("umbp.serve")

PREFETCH_READERS = 2
"""Threads reading at once by default (`umbp serve --prefetch-readers`)."""
MAX_PREFETCH_READERS = 64
"""The most `umbp serve --prefetch-readers` takes."""

Owner: TypeAlias = tuple[int | None, str | None]
"""Whose prefetch: (the connection's id, the engine's request id)."""


@dataclass(frozen=True, slots=True)
class PrefetchFigures:
    """Since the server started (`promoted`: counted by the tiering, under its lock)."""

    queued_bytes: int
    skipped: int
    """Keys not queued: the bound was reached."""
    cancelled: int
    """Keys dropped before their read: their request went away."""
    claimed: int
    """Keys a get took over before their read."""


class Prefetcher:
    """Keys to bring into DRAM, and the threads that read them (`promote(key, nbytes)`)."""

    def __init__(
        self, promote: Callable[[str, int], object], limit_bytes: int,
        readers: int = PREFETCH_READERS,
    ) -> None:
        if readers < 1:  # none would leave every key queued, and the write-ahead waiting
            raise ValueError(f"readers must be at least 1, got {readers}")
        self._promote = promote
        self._limit_bytes = limit_bytes
        self._lock = threading.Condition(threading.Lock())
        self._queue: OrderedDict[str, tuple[Owner, int]] = OrderedDict()
        self._queued_bytes = 0
        self._reading: dict[str, int] = {}
        """Keys being read now, with their bytes."""
        self._closed = False
        self._skipped = self._cancelled = self._claimed = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"umbp-prefetch-{n}", daemon=True)
            for n in range(readers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, owner: Owner, sized_keys: Iterable[tuple[str, int]]) -> None:
        """Queue each (key, bytes) for `owner` within the bound; a key queued or being
        read already is left where it is."""
        with self._lock:
            if self._closed:
                return
            room = self._limit_bytes - self._queued_bytes - sum(self._reading.values())
            added = False
            for key, nbytes in sized_keys:
                if key in self._queue or key in self._reading:
                    continue
                if nbytes > room:
                    self._skipped += 1
                    continue
                self._queue[key] = (owner, nbytes)
                self._queued_bytes += nbytes
                room -= nbytes
                added = True
            if added:
                self._lock.notify_all()

    def cancel(self, matches: Callable[[Owner], bool]) -> int:
        """Drop the queued keys whose owner `matches`; how many."""
        with self._lock:
            gone = [key for key, (owner, _) in self._queue.items() if matches(owner)]
            for key in gone:
                self._queued_bytes -= self._queue.pop(key)[1]
            self._cancelled += len(gone)
            return len(gone)

    def claim(self, keys: Sequence[str], timeout_s: float) -> None:
        """Before a get of `keys` looks in DRAM: the queued ones are its to read, and those
        being read now are waited for (at most `timeout_s` in all), so that none is read
        twice."""
        with self._lock:
            if not self._queue and not self._reading:
                return
            for key in keys:
                entry = self._queue.pop(key, None)
                if entry is not None:
                    self._queued_bytes -= entry[1]
                    self._claimed += 1
            awaited = [key for key in keys if key in self._reading]
            if awaited:
                self._lock.wait_for(
                    lambda: not any(key in self._reading for key in awaited), timeout_s)

    def busy(self) -> bool:
        """Keys are queued or being read."""
        with self._lock:
            return bool(self._queue or self._reading)

    def figures(self) -> PrefetchFigures:
        with self._lock:
            return PrefetchFigures(self._queued_bytes + sum(self._reading.values()), self._skipped,
                                   self._cancelled, self._claimed)

    def close(self) -> None:
        """Stop after the reads in progress; the queue is dropped."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._queued_bytes = 0
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=60.0)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closed or bool(self._queue))
                if self._closed:
                    return
                key, (_, nbytes) = self._queue.popitem(last=False)
                self._queued_bytes -= nbytes
                self._reading[key] = nbytes
            try:
                self._promote(key, nbytes)
            except Exception:  # the thread must go on: the load reads it instead
                logger.exception("umbp serve: prefetching %r failed", key)
            finally:
                with self._lock:
                    del self._reading[key]
                    self._lock.notify_all()
