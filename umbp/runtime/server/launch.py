"""Start `umbp serve` as a child (tests, benchmarks) or detached (the connector's
`auto_start`), and ask whether a server answers at a socket."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umbp.runtime.private_files import UnsafePath, open_private_file, prepare_directory
from umbp.runtime.server import protocol
from umbp.runtime.server.server import DEFAULT_PAGE_BYTES

__all__ = [
    "Probe", "ServerStartError", "probe_server", "server_log_path", "server_reachable",
    "start_server", "stop_server",
]

_POLL_S = 0.05
_LOG_TAIL_BYTES = 4000


class ServerStartError(RuntimeError):
    """The server died or did not answer in time; the message ends with its log tail."""


@dataclass(frozen=True)
class Probe:
    """What one HELLO at a socket found: the server's answer, or why none came and
    whether anything accepted the connection (a server that is stalled, overloaded or at
    its connection limit is there; a missing socket or a dead server's is not)."""

    hello: dict[str, Any] | None
    listening: bool
    problem: str


def server_reachable(socket_path: str, timeout_s: float = 1.0) -> bool:
    """True when a umbp server answers a HELLO at `socket_path` within `timeout_s`
    (a socket file left by a dead server, or a stalled server, answers False)."""
    return probe_server(socket_path, timeout_s).hello is not None


def probe_server(socket_path: str, timeout_s: float) -> Probe:
    """Send one HELLO to `socket_path` and wait at most `timeout_s` for its answer."""
    deadline = protocol.Deadline(timeout_s)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(deadline.remaining())
        try:
            sock.connect(socket_path)
        except BlockingIOError:  # a Unix socket's listen queue is full
            return Probe(None, True, "its queue of connections waiting to be accepted is full")
        except OSError as error:
            return Probe(None, False, error.strerror or str(error))
        try:
            # A refused connection may be closed before the HELLO is written: its reason
            # is still there to read.
            with contextlib.suppress(BrokenPipeError):
                protocol.send_all(sock, protocol.encode_json(protocol.HELLO, {}), deadline)
            op, body = protocol.read_frame(sock, deadline)
            answer = protocol.decode_json(body)
        except TimeoutError:
            return Probe(None, True, f"it accepted a connection but did not answer within "
                                     f"{timeout_s:g} s")
        except OSError as error:
            return Probe(None, True, f"it accepted a connection, then: {error}")
        if op != protocol.OK:
            return Probe(None, True, f"it refused: {answer}")
        if not isinstance(answer, dict):
            return Probe(None, True, "its answer to HELLO is not an object")
        return Probe(answer, True, "")
    finally:
        sock.close()


def serve_command(
    socket_path: str,
    capacity_bytes: int,
    *,
    pool_dir: str | None = None,
    ssd_dir: str | None = None,
    ssd_capacity_bytes: int = 0,
    page_bytes: int = DEFAULT_PAGE_BYTES,
    high_watermark: float = 0.95,
    low_watermark: float = 0.85,
    persist_on_exit: bool = False,
    max_connections: int | None = None,
    frame_timeout_s: float | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    command = [
        sys.executable, "-m", "umbp.cli", "serve",
        "--socket", socket_path,
        "--capacity", str(capacity_bytes),
        "--page-bytes", str(page_bytes),
        "--high-watermark", repr(high_watermark),
        "--low-watermark", repr(low_watermark),
    ]
    if pool_dir is not None:
        command += ["--pool-dir", pool_dir]
    if ssd_dir is not None:
        command += ["--ssd-dir", ssd_dir, "--ssd-capacity", str(ssd_capacity_bytes)]
    if persist_on_exit:
        command.append("--persist-on-exit")
    if max_connections is not None:
        command += ["--max-connections", str(max_connections)]
    if frame_timeout_s is not None:
        command += ["--frame-timeout", repr(frame_timeout_s)]
    return command + list(extra_args)


def start_server(
    socket_path: str,
    capacity_bytes: int,
    *,
    pool_dir: str | None = None,
    ssd_dir: str | None = None,
    ssd_capacity_bytes: int = 0,
    page_bytes: int = DEFAULT_PAGE_BYTES,
    high_watermark: float = 0.95,
    low_watermark: float = 0.85,
    wait_s: float = 30.0,
    detach: bool = False,
    log_path: str | None = None,
    persist_on_exit: bool = False,
    max_connections: int | None = None,
    frame_timeout_s: float | None = None,
    extra_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Spawn `umbp serve` and return once it answers at `socket_path`.

    Its output is appended to `log_path`, by default `server_log_path(socket_path)`
    (beside the socket, where its operator looks and whatever cleans the socket's
    directory finds it). `detach=True` starts it in a session of its own, so that it
    outlives the caller and its terminal's signals. `extra_args`: further `umbp serve`
    options (quotas, metrics...). Raises `ServerStartError` with the log's tail when the
    server exits, or goes `wait_s` without answering and without logging anything (it is
    then killed): a server allocating a large DRAM tier logs its progress every second,
    and is waited for as long as it does; and, naming the problem, before starting
    anything when the log is a symbolic link or open to other users.
    """
    if server_reachable(socket_path, timeout_s=1.0):
        raise ServerStartError(f"a umbp server already answers at {socket_path}")
    command = serve_command(
        socket_path, capacity_bytes, pool_dir=pool_dir, ssd_dir=ssd_dir,
        ssd_capacity_bytes=ssd_capacity_bytes, page_bytes=page_bytes,
        high_watermark=high_watermark, low_watermark=low_watermark,
        persist_on_exit=persist_on_exit, max_connections=max_connections,
        frame_timeout_s=frame_timeout_s, extra_args=extra_args,
    )
    log_name = server_log_path(socket_path) if log_path is None else log_path
    log_fd = _open_log(log_name)
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            start_new_session=detach,
            env=_child_environment(),
        )
    finally:
        os.close(log_fd)
    _wait_until_answering(process, socket_path, wait_s, log_name)
    return process


def _open_log(log_name: str) -> int:
    """The log appended to, owner-only (it names the pool's file), its directory made
    as the server makes its socket's."""
    try:
        prepare_directory(os.path.dirname(log_name) or ".", "server log directory")
        return open_private_file(log_name, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                 "server log")
    except (UnsafePath, OSError) as error:
        raise ServerStartError(f"umbp serve was not started: {error}") from None


def server_log_path(socket_path: str) -> str:
    """Where a server started for `socket_path` logs unless told otherwise (owner-only:
    the log names the pool's file)."""
    return socket_path + ".log"


def _child_environment() -> dict[str, str]:
    """The caller's environment, with this checkout importable when the package is run
    from a source tree rather than installed."""
    environment = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    paths = [root] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return environment


def _wait_until_answering(
    process: subprocess.Popen[bytes], socket_path: str, wait_s: float, log_name: str
) -> None:
    deadline = time.monotonic() + wait_s
    logged = _size(log_name)
    while True:
        hello = probe_server(socket_path, timeout_s=1.0).hello
        if hello is not None and hello.get("pid") == process.pid:
            return
        code = process.poll()
        if code is not None:
            raise ServerStartError(
                f"umbp serve exited with status {code} before answering at {socket_path}; "
                f"log {log_name}:\n{_tail(log_name)}"
            )
        if _size(log_name) != logged:  # progress (a large pool being allocated)
            logged = _size(log_name)
            deadline = time.monotonic() + wait_s
        if time.monotonic() >= deadline:
            process.kill()
            process.wait()
            raise ServerStartError(
                f"umbp serve did not answer at {socket_path}, nor log anything, for "
                f"{wait_s:g} s (killed); log {log_name}:\n{_tail(log_name)}"
            )
        time.sleep(_POLL_S)


def _size(log_name: str) -> int:
    try:
        return os.stat(log_name).st_size
    except OSError:
        return -1


def _tail(log_name: str) -> str:
    try:
        with open(log_name, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
            return log.read().decode(errors="replace")
    except OSError as error:
        return f"(log unreadable: {error})"


def stop_server(process: subprocess.Popen[bytes], socket_path: str, wait_s: float = 10.0) -> None:
    """Stop a server this process started, whatever state a test left it in (stopped,
    killed, running), and remove what a killed server leaves behind: its socket and its
    shared-memory pool file (a SIGTERMed server removes both itself)."""
    from umbp.runtime.server.server import remove_stale_leftovers

    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if not server_reachable(socket_path, 1.0):  # a restarted server is not ours to clean
        remove_stale_leftovers(socket_path)
