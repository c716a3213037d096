"""Start, wait for and stop real ``vllm serve`` processes (the command users run),
for the HTTP tests and ``benchmarks/serve_bench.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONNECTOR = {"kv_connector": "UMBPStoreConnector", "kv_connector_module_path": "umbp",
             "kv_role": "kv_both"}


def vllm_command() -> str:
    """The ``vllm`` console script of this environment (what the README runs)."""
    return str(Path(sys.executable).parent / "vllm")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def serve_args(
    model: str, port: int, *, extra_config: dict[str, Any] | None, dtype: str = "float32",
    kv_cache_bytes: int = 64 << 20, max_model_len: int = 2048, more: tuple[str, ...] = (),
    kv_role: str = "kv_both",
) -> list[str]:
    """``vllm serve`` for a local random-weight model on 127.0.0.1; with umbp when
    ``extra_config`` is given (in ``kv_role``)."""
    args = [
        vllm_command(), "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "m", "--dtype", dtype, "--load-format", "safetensors",
        "--enable-prefix-caching", "--block-size", "32", "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(kv_cache_bytes), "--enforce-eager",
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", *more,
    ]
    if extra_config is not None:
        config = {**CONNECTOR, "kv_role": kv_role, "kv_connector_extra_config": extra_config}
        args += ["--kv-transfer-config", json.dumps(config)]
    return args


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start(args: list[str], log: Path, env: dict[str, str] | None = None,
          unset: Collection[str] = ()) -> Served:
    """Start in a session of its own (its engine processes share the group, so
    :func:`stop` ends them all); output to ``log``. The environment is this process's
    with ``env`` over it, without the variables named in ``unset``."""
    port = int(args[args.index("--port") + 1])
    inherited = {name: value for name, value in os.environ.items() if name not in unset}
    environment = {**inherited, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    with open(log, "wb") as sink:
        process = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT,
                                   env=environment, start_new_session=True)
    return Served(process, port, log)


VLLM_RECORD = re.compile(
    r"\((?P<process>APIServer|EngineCore|VllmWorker|Worker)[^)]* pid=\d+\) "
    r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\] "
)
"""The head vLLM's log format puts before a record's message: process, pid, level,
time, ``[file:line]``."""
_UMBP_MESSAGE = re.compile(r"(?<![\w/.'\"-])umbp(?=[\s:])")
"""umbp's name as a message says it (``umbp sets ...``, ``umbp: ...``,
``WARNING:umbp:...``), not inside a path (``/umbp/``) or a quoted option value."""


def vllm_records(log: str) -> list[tuple[str, str]]:
    """(process, message) of every record vLLM's log handler wrote to ``log``. The
    engine's processes share one output file; a record is one write, but another
    process may have left an unfinished line just before it (a progress bar between
    its carriage returns, a C library's partial write), so a record is found where
    its head is, not only at the start of a line. A record still being written when
    the file was read is there in part: its head (then, if anything, the start of
    its message) or nothing of it."""
    records = []
    for line in log.splitlines():
        found = VLLM_RECORD.search(line)
        if found is not None:
            records.append((found["process"], line[found.end():]))
    return records


def umbp_outside_vllm_records(log: str) -> list[str]:
    """Lines where umbp's name starts a message that is not in a vLLM record: a umbp
    record that reached the output past vLLM's handler (Python's last-resort handler
    writes the bare message, ``logging.basicConfig`` ``WARNING:umbp:...``)."""
    bare = []
    for line in log.splitlines():
        found = VLLM_RECORD.search(line)
        if _UMBP_MESSAGE.search(line if found is None else line[:found.start()]):
            bare.append(line)
    return bare


def wait_ready(served: Served, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if served.process.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({served.process.returncode}):\n"
                               + _first_errors(served.log_text()))
        try:
            with urllib.request.urlopen(served.url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    stop(served)
    raise TimeoutError(f"vllm serve not ready in {timeout_s} s:\n" + served.log_text()[-4000:])


def _first_errors(log: str, count: int = 8) -> str:
    """The first error lines (the root cause precedes vLLM's tracebacks) and the tail."""
    errors = [line for line in log.splitlines() if "Error" in line or " ERROR " in line]
    return "\n".join(errors[:count]) + "\n...\n" + log[-2000:]


def stop(served: Served, wait_s: float = 90.0) -> None:
    """SIGTERM to the API server, as a user's Ctrl-C or a service manager would
    send; vLLM then shuts its engine and workers down. SIGKILL to the process
    group only for what is still running after ``wait_s``."""
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _group_alive(served.process.pid):
        served.process.poll()  # reap the leader so the group can empty
        time.sleep(0.5)
    try:
        os.killpg(served.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    served.process.wait(10)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
