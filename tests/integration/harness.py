"""Run one engine scenario in a process of its own (see umbp.testing.scenario).

vLLM keeps process-wide state (the KV transfer agent, distributed groups), so every
scenario runs in a fresh process. Importing vLLM costs ~10 s of CPU here, about as
much as a whole in-process scenario, so the processes are forked from a forkserver
that has imported vLLM once and never started an engine (vLLM itself forks its
engine-core processes after the same imports). Each child gets the caller's
environment and working directory, writes its own stdout/stderr, and runs the
interpreter's exit handlers as a fresh ``python -m umbp.testing.scenario`` would."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCENARIO_TIMEOUT_S = 600

# Imported once in the forkserver: what every scenario imports before its first engine.
_PRELOAD = ["torch", "vllm", "vllm.config", "vllm.entrypoints.llm", "vllm.inputs",
            "vllm.sampling_params", "umbp.shell.connector", "umbp.testing.engine",
            "umbp.testing.scenario"]
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(_PRELOAD)


def _scenario_main(spec_json: str, environment: dict[str, str], cwd: str,
                   out_path: str, err_path: str) -> None:
    """The child: ``python -m umbp.testing.scenario <spec>`` without the imports."""
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    code = 1
    try:
        from umbp.testing.scenario import main

        code = main(["umbp.testing.scenario", spec_json])
    except BaseException:  # noqa: BLE001 - reported like an interpreter would
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # multiprocessing children skip them; an interpreter does not
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


class ScenarioProcess:
    """A running scenario; the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="umbp-scenario-"))
        self._out, self._err = self._folder / "stdout", self._folder / "stderr"
        environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self._process = _FORKSERVER.Process(
            target=_scenario_main,
            args=(json.dumps(spec), environment, str(REPO), str(self._out), str(self._err)),
        )
        self._texts: tuple[str, str] | None = None
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (killed past ``timeout``, then TimeoutError); its output."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
            raise TimeoutError(f"scenario ran past {timeout} s:\n{self._output()[1][-5000:]}")
        return self._output()

    def _output(self) -> tuple[str, str]:
        """The ended process's output (read once; its folder then goes)."""
        if self._texts is None:
            out, err = (path.read_text(errors="replace") if path.exists() else ""
                        for path in (self._out, self._err))
            self._texts = out, err
            shutil.rmtree(self._folder, ignore_errors=True)
        return self._texts


def run_scenario(spec: dict[str, Any], *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one scenario process; fail with its output if it did not report."""
    process = ScenarioProcess(spec, env)
    stdout, stderr = process.communicate(timeout=SCENARIO_TIMEOUT_S)
    for line in stdout.splitlines():
        if line.startswith("UMBP-SCENARIO "):
            report: dict[str, Any] = json.loads(line.removeprefix("UMBP-SCENARIO "))
            # vLLM logs (umbp's lines included) to stdout, Python warnings to stderr.
            report["log"] = stdout + stderr
            return report
    raise AssertionError(
        f"scenario exited {process.returncode} without a report\n"
        f"--- stdout ---\n{stdout[-5000:]}\n--- stderr ---\n{stderr[-15000:]}"
    )


def start_scenario(spec: dict[str, Any]) -> ScenarioProcess:
    """Run a scenario in the background (with ``mark``/``hold`` steps: an engine that
    stays alive while the test runs another)."""
    return ScenarioProcess(spec)


def wait_for_mark(mark: Path, process: ScenarioProcess) -> None:
    """Wait until the background scenario's ``mark`` step created ``mark``."""
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    while not mark.exists():
        if process.poll() is not None:
            raise AssertionError("the background engine ended early:\n" + process.communicate()[1])
        assert time.monotonic() < deadline, "the background engine never got to its mark"
        time.sleep(0.2)


def server_events(log: Path, name: str) -> list[dict[str, Any]]:
    """The JSON events named `name` that `umbp serve` wrote to its log, in order."""
    prefix = f'{{"event": "{name}"'
    return [json.loads(line) for line in log.read_text().splitlines()
            if line.startswith(prefix)]
