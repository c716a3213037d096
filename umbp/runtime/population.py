"""Populating a large memory area before it serves: in steps, spread over threads where
the kernel runs them at once, with progress for the operator.

Every page of a pool is allocated and zeroed once, up front (docs/backends.md: a page
first touched by a copy costs that copy 25x). That costs a fixed time per GiB
(docs/performance.md, "Start-up"), minutes for the pools of a GPU host, and a process
silent that long looks hung. `populate` cuts the area into steps that `threads` workers
take in order, reports progress at most every `interval_s` while it lasts, and stops
between steps when asked to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PopulationStopped", "Progress", "populate"]

_GIB = float(1 << 30)


class PopulationStopped(Exception):
    """`should_stop` answered True before the area was whole."""


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a population is."""

    done_bytes: int
    total_bytes: int
    seconds: float

    @property
    def finished(self) -> bool:
        return self.done_bytes == self.total_bytes

    def describe(self) -> str:
        """E.g. ``12.0 of 64.0 GiB in 4.1 s (2.9 GiB/s, about 14 s left)``."""
        done, total = self.done_bytes / _GIB, self.total_bytes / _GIB
        text = f"{done:.1f} of {total:.1f} GiB in {self.seconds:.1f} s"
        if self.done_bytes and self.seconds > 0:
            rate = done / self.seconds
            text += f" ({rate:.1f} GiB/s"
            if not self.finished:
                text += f", about {(total - done) / rate:.0f} s left"
            text += ")"
        return text


def populate(
    total_bytes: int,
    fill: Callable[[int, int], None],
    *,
    threads: int = 1,
    step_bytes: int = 1 << 30,
    report: Callable[[Progress], None] | None = None,
    interval_s: float = 1.0,
    should_stop: Callable[[], bool] | None = None,
) -> Progress:
    """Call `fill(offset, length)` over [0, `total_bytes`) in steps of `step_bytes`,
    taken in order by `threads` workers; `report` gets the progress at most every
    `interval_s` while it lasts, from the calling thread. Returns the final progress.

    The first exception a step raises stops the others (after their current step) and is
    raised here; `should_stop` is asked before every step (from the workers) and True
    ends it with `PopulationStopped` once the steps in flight are done."""
    if total_bytes < 0 or threads < 1 or step_bytes < 1:
        raise ValueError(
            f"populate needs total >= 0, threads >= 1 and steps >= 1 byte, got "
            f"{total_bytes}, {threads}, {step_bytes}"
        )
    lock = threading.Lock()
    state = _Steps(total_bytes, step_bytes)
    stopping = threading.Event()

    def work() -> None:
        while not stopping.is_set():
            if should_stop is not None and should_stop():
                stopping.set()
                return
            with lock:
                step = state.take()
            if step is None:
                return
            try:
                fill(*step)
            except BaseException as error:  # noqa: BLE001 - handed to the caller below
                with lock:
                    state.failures.append(error)
                stopping.set()
                return
            with lock:
                state.done += step[1]

    started = time.monotonic()
    workers = [
        threading.Thread(target=work, name=f"umbp-populate-{index}", daemon=True)
        for index in range(min(threads, max(1, -(-total_bytes // step_bytes))))
    ]
    for worker in workers:
        worker.start()
    last_report = started
    for worker in workers:
        while worker.is_alive():
            worker.join(timeout=min(interval_s, 0.2))
            now = time.monotonic()
            if report is not None and now - last_report >= interval_s and worker.is_alive():
                with lock:
                    done = state.done
                report(Progress(done, total_bytes, now - started))
                last_report = now
    if state.failures:
        raise state.failures[0]
    final = Progress(state.done, total_bytes, time.monotonic() - started)
    if not final.finished:
        raise PopulationStopped(f"stopped after {final.describe()}")
    return final


class _Steps:
    """The next step to hand out, and what the workers did (under the caller's lock)."""

    def __init__(self, total_bytes: int, step_bytes: int) -> None:
        self.total = total_bytes
        self.step = step_bytes
        self.next = 0
        self.done = 0
        self.failures: list[BaseException] = []

    def take(self) -> tuple[int, int] | None:
        if self.failures or self.next >= self.total:
            return None
        offset = self.next
        length = min(self.step, self.total - offset)
        self.next += length
        return offset, length
