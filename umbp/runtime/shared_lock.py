"""`SharedLock`: many holders at once, or one alone (a readers-writer lock).

The SSD tier's reads hold it shared while their `preadv` runs, so that prefetches read
several objects at once (one thread cannot fill a core's worth of copy, and an NVMe
drive wants more than one request in flight); whatever writes the slot file or frees
slots holds it alone. A holder alone that is waiting bars new shared holders, so a steady
stream of reads never starves a write.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SharedLock"]


class SharedLock:
    """Not reentrant in either mode: a holder that asks again waits for itself."""

    def __init__(self) -> None:
        self._state = threading.Condition(threading.Lock())
        self._shared = 0
        self._alone = False
        self._waiting_alone = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._state:
            self._state.wait_for(lambda: not self._alone and not self._waiting_alone)
            self._shared += 1
        try:
            yield
        finally:
            with self._state:
                self._shared -= 1
                if not self._shared:
                    self._state.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._state:
            self._waiting_alone += 1
            try:
                self._state.wait_for(lambda: not self._alone and not self._shared)
            finally:
                self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._state:
                self._alone = False
                self._state.notify_all()
