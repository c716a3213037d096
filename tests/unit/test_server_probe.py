"""The probe an engine sends a umbp server when it opens its store: a missing socket or a
dead server's is absent (the engine does not start, and the error says why), while a
server that accepts the connection but is slow to answer is there (the engine starts,
missing until it answers, as it would after start-up). All over real sockets and a real
`umbp serve` stopped with SIGSTOP."""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from umbp.core.config import ConnectorConfig, parse_connector_config
from umbp.runtime.backends import BackendUnavailable, open_scheduler_store
from umbp.runtime.contract import StoreUnavailable
from umbp.runtime.server.launch import Probe, probe_server
from umbp.testing.faults import stop_process


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A directory short enough for a Unix socket path (108 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="umbp-p-", dir="/tmp"))
    yield directory
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()


def server_config(endpoint: str, **options: Any) -> ConnectorConfig:
    extra = {"mode": "server", "endpoint": endpoint, "lookup_timeout_s": 0.5, **options}
    return parse_connector_config(extra).unwrap()


def test_a_missing_socket_is_absent(socket_dir: Path) -> None:
    probe = probe_server(str(socket_dir / "none.sock"), 1.0)
    assert probe == Probe(None, False, "No such file or directory")


def test_a_dead_servers_socket_file_is_absent(socket_dir: Path) -> None:
    path = str(socket_dir / "dead.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)  # the file stays behind; nothing listens on it
    assert probe_server(path, 1.0) == Probe(None, False, "Connection refused")


def test_a_listener_that_does_not_answer_is_there(socket_dir: Path) -> None:
    path = str(socket_dir / "silent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(4)  # connections are queued, never accepted
        probe = probe_server(path, 0.3)
    assert probe == Probe(
        None, True, "it accepted a connection but did not answer within 0.3 s"
    )


def test_a_server_answers_with_its_hello(server: Any) -> None:
    probe = probe_server(server.socket_path, 5.0)
    assert probe.listening and probe.problem == ""
    assert probe.hello is not None and probe.hello["pid"] == server.pid


def test_no_server_stops_the_engine_with_the_reason(socket_dir: Path) -> None:
    endpoint = str(socket_dir / "none.sock")
    with pytest.raises(BackendUnavailable) as raised:
        open_scheduler_store(server_config(endpoint), {})
    assert str(raised.value).startswith(
        f"umbp: no umbp server answers at {endpoint} (No such file or directory). "
        f"Start one with `umbp serve --socket {endpoint}"
    )


@pytest.mark.parametrize("auto_start", [False, True])
def test_a_stalled_server_lets_the_engine_start_and_serves_once_it_answers(
    server: Any, caplog: pytest.LogCaptureFixture, auto_start: bool,
) -> None:
    """With auto_start, no second server is started at the stalled one's socket (it
    would refuse, and the engine would not start)."""
    endpoint = server.socket_path
    config = server_config(endpoint, auto_start=auto_start, reconnect_interval_s=0.1)
    stop_process(server.pid)
    try:
        with caplog.at_level(logging.WARNING, logger="umbp"):
            store = open_scheduler_store(config, {})
        assert (
            f"umbp: the umbp server at {endpoint} is not answering yet (it accepted a "
            "connection but did not answer within 0.5 s); starting anyway"
        ) in caplog.text
        with pytest.raises(StoreUnavailable):
            store.lookup(["k"])
    finally:
        os.kill(server.pid, signal.SIGCONT)
    try:
        assert _eventually_looks_up(store) == (False,)
        hello = probe_server(endpoint, 5.0).hello
        assert hello is not None and hello["pid"] == server.pid
    finally:
        store.close()


def _eventually_looks_up(store: Any, within_s: float = 30.0) -> tuple[bool, ...]:
    """The store's answer once its reconnection reaches the continued server."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return tuple(store.lookup(["k"]))
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
