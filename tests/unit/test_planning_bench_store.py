"""planning_bench's store step compares like with like: before it times anything it
checks that umbp's core calls, umbp's whole scheduler hook and the reference (vLLM
0.33's UMBP connector) plan the same blocks and hashes for every request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Its own process: the bench imports vLLM 0.33 from .vllm-0.33.0 (make test extracts
# it), which cannot share a process with the venv's vLLM.
SMALL_STEPS = """
import sys
sys.path[:0] = [{benchmarks!r}, {root!r}]
import planning_bench as bench
import umbp.shell.store_step as store_step

step = bench.store_step_input(16, 4, requests=8, tokens=256)
times, unavailable = bench.store_step_times(step, rounds=2)
assert unavailable is None, unavailable
assert sorted(times) == ["core", "hook", "reference"], sorted(times)
assert all(len(t.samples_ns) == 2 and min(t.samples_ns) > 0 for t in times.values())
print("plans identical")

# A scheduler hook that drops every request's last block must be caught.
import dataclasses
plan = store_step.StoreStep.plan
store_step.StoreStep.plan = lambda self, *args: tuple(
    dataclasses.replace(p, groups=tuple(
        dataclasses.replace(g, block_ids=g.block_ids[:-1], block_hashes=g.block_hashes[:-1])
        for g in p.groups))
    for p in plan(self, *args)
)
try:
    bench.store_step_times(step, rounds=2)
except AssertionError as error:
    print("caught:", error)
"""


def test_the_store_step_bench_times_only_schedulers_that_plan_alike() -> None:
    code = SMALL_STEPS.format(benchmarks=str(ROOT / "benchmarks"), root=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT,
        check=False,  # the assertions below show stderr
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plans identical" in done.stdout
    assert "caught: umbp's scheduler and the reference disagree" in done.stdout
