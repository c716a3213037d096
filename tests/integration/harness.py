"""Run one engine scenario in its own interpreter (see umbp.testing.scenario)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCENARIO_TIMEOUT_S = 600


def run_scenario(spec: dict[str, Any], *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one scenario process; fail with its output if it did not report."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    process = subprocess.run(
        [sys.executable, "-m", "umbp.testing.scenario", json.dumps(spec)],
        capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S, env=environment, cwd=REPO,
        check=False,  # a failed scenario is reported below with its output
    )
    for line in process.stdout.splitlines():
        if line.startswith("UMBP-SCENARIO "):
            report: dict[str, Any] = json.loads(line.removeprefix("UMBP-SCENARIO "))
            # vLLM logs (umbp's lines included) to stdout, Python warnings to stderr.
            report["log"] = process.stdout + process.stderr
            return report
    raise AssertionError(
        f"scenario exited {process.returncode} without a report\n"
        f"--- stdout ---\n{process.stdout[-5000:]}\n--- stderr ---\n{process.stderr[-15000:]}"
    )


def start_scenario(spec: dict[str, Any]) -> subprocess.Popen[str]:
    """Run a scenario in the background (with ``mark``/``hold`` steps: an engine that
    stays alive while the test runs another)."""
    return subprocess.Popen(
        [sys.executable, "-m", "umbp.testing.scenario", json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def wait_for_mark(mark: Path, process: subprocess.Popen[str]) -> None:
    """Wait until the background scenario's ``mark`` step created ``mark``."""
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    while not mark.exists():
        if process.poll() is not None:
            raise AssertionError("the background engine ended early:\n" + process.communicate()[1])
        assert time.monotonic() < deadline, "the background engine never got to its mark"
        time.sleep(0.2)
