"""A real `mooncake_master` on loopback, for tests and benchmarks.

    with MooncakeMaster.start() as master:
        store = MooncakeStore(master.address, local_hostname="127.0.0.1")

Binds RPC and metrics to 127.0.0.1 on free ports, with the HTTP metadata server off
(clients use P2PHANDSHAKE), so nothing listens beyond this machine. The binary is the one
pip installed next to the running interpreter.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

__all__ = ["MooncakeMaster", "find_master_binary", "free_port"]


def find_master_binary() -> Path:
    """`mooncake_master` next to `sys.executable` (the venv's bin/); FileNotFoundError
    naming the package to install otherwise."""
    candidate = Path(sys.executable).parent / "mooncake_master"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    raise FileNotFoundError(
        f"no mooncake_master at {candidate}: pip install mooncake-transfer-engine-non-cuda "
        "(or mooncake-transfer-engine) into this environment"
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class MooncakeMaster:
    """A running master process; `stop()` (or leaving the `with`) kills it."""

    def __init__(
        self, process: subprocess.Popen[bytes], rpc_port: int, metrics_port: int, log: Path | None
    ) -> None:
        self.process = process
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.log = log

    @property
    def address(self) -> str:
        """What clients pass as `master_address`."""
        return f"127.0.0.1:{self.rpc_port}"

    @classmethod
    def start(
        cls,
        *,
        log: Path | None = None,
        extra_flags: tuple[str, ...] = (),
        timeout_s: float = 20.0,
    ) -> MooncakeMaster:
        """Start a master and wait until its RPC port accepts connections. Its output goes
        to `log` (discarded when None). Raises RuntimeError if it exits or stays silent."""
        binary = find_master_binary()
        last_error: Exception | None = None
        for _ in range(3):  # a free port can be taken between probing and binding
            rpc_port, metrics_port = free_port(), free_port()
            sink: IO[bytes] | int = subprocess.DEVNULL if log is None else log.open("ab")
            try:
                process = subprocess.Popen(
                    [
                        str(binary),
                        "-rpc_address=127.0.0.1",
                        f"-rpc_port={rpc_port}",
                        "-metrics_host=127.0.0.1",
                        f"-metrics_port={metrics_port}",
                        "-enable_http_metadata_server=false",
                        *extra_flags,
                    ],
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a Ctrl-C aimed at the tests does not race it
                )
            finally:
                if not isinstance(sink, int):
                    sink.close()
            master = cls(process, rpc_port, metrics_port, log)
            try:
                master.wait_until_ready(timeout_s)
                return master
            except RuntimeError as error:
                master.stop()
                last_error = error
        raise RuntimeError(f"mooncake_master did not start: {last_error}")

    def wait_until_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with {self.process.returncode} "
                    f"(log: {self.log or 'discarded'})"
                )
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"mooncake_master did not listen on {self.address} in {timeout_s} s")

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Kill the master (SIGKILL: what a crash looks like to its clients) and reap it."""
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
