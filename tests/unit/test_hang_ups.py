"""`HangUps`: the process's one watcher of idle server connections tells a connection's
owner once when the other end closes it, never for an answer arriving, and never after
the owner forgot the socket."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from umbp.runtime.server.hangups import EXITED, HangUps, ServerExit, peer_closed


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_the_owner_hears_once_when_the_peer_closes(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    hang_ups = HangUps()
    heard = threading.Event()
    calls: list[int] = []

    def hung_up() -> None:
        calls.append(1)
        heard.set()

    hang_ups.watch(ours, hung_up)
    theirs.sendall(b"an answer is not a hang-up")
    assert not heard.wait(0.3)
    assert not peer_closed(ours)
    theirs.close()
    assert heard.wait(5.0), "the peer's close was not heard"
    assert peer_closed(ours)
    assert hang_ups.watching() == 0  # reported once, then no longer watched
    _settle()
    assert calls == [1]


def test_a_forgotten_socket_is_not_reported(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    hang_ups = HangUps()
    calls: list[int] = []
    hang_ups.watch(ours, lambda: calls.append(1))
    assert hang_ups.watching() == 1
    hang_ups.forget(ours)
    assert hang_ups.watching() == 0
    theirs.close()
    _settle()
    assert calls == []


def test_each_of_many_sockets_is_reported_to_its_own_owner() -> None:
    hang_ups = HangUps()
    pairs = [socket.socketpair() for _ in range(8)]
    heard: dict[int, threading.Event] = {index: threading.Event() for index in range(8)}
    try:
        for index, (ours, _) in enumerate(pairs):
            hang_ups.watch(ours, heard[index].set)
        for index in (1, 4, 6):
            pairs[index][1].close()
        for index in (1, 4, 6):
            assert heard[index].wait(5.0)
        assert not any(heard[index].is_set() for index in (0, 2, 3, 5, 7))
        assert hang_ups.watching() == 5
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def _settle() -> None:
    """Time for a report that should not come to come."""
    threading.Event().wait(0.3)


def test_a_process_exit_is_heard_and_its_owner_told_once() -> None:
    """`ServerExit`: the process at the other end of a connection (its credentials, not a
    pid it announced), watched for its exit after its connection is gone."""
    child = subprocess.Popen([sys.executable, "-c", _PEER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        path = child.stdout.readline().decode().strip()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(path)
        exit_watch = ServerExit.of_peer(client)
        assert exit_watch is not None
        client.close()  # no connection left to hear a hang-up on
        hang_ups = HangUps()
        heard = threading.Event()
        hang_ups.watch(exit_watch, heard.set, EXITED)
        assert not heard.wait(0.3) and not exit_watch.exited()
        child.kill()
        assert heard.wait(5.0), "the exit was not heard"
        assert exit_watch.exited()
        exit_watch.close()
    finally:
        child.kill()
        child.wait()


_PEER = """
import os, socket, sys, tempfile, time
path = os.path.join(tempfile.mkdtemp(), "s")
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(1)
print(path, flush=True)
connection, _ = server.accept()
time.sleep(600)
"""
