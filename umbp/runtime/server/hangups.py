"""A server's end, noticed as it happens while its clients ask nothing of it.

A client reads its connection only while a request waits for its answer, so a server
that died (or restarted) while an engine was idle went unnoticed until the engine's next
request: meanwhile the engine kept the dead server's pool mapped, and a tmpfs keeps a
pool's pages while any process maps it, so a new server sized like the old one could
find no room for its pool. `HangUps` watches, with one thread per process blocked in
`poll` (no timer, no CPU while nothing happens), every registered connection for its
peer's close, and the process of a server that stopped answering (a connection dropped
on a timeout: `ServerExit`) for its exit, and tells the owner at once.

Only an end wakes it (`POLLRDHUP` on a socket, and the `POLLHUP` / `POLLERR` the kernel
always reports; a process descriptor's `POLLIN`), never an answer arriving, so it costs
nothing per request. What it reports is a hint for the owner to check under its own
lock (`peer_closed`): a descriptor closed and its number reused between a snapshot and
the `poll` may report another file's state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Protocol

__all__ = ["HANG_UPS", "HangUps", "ServerExit", "Watched", "peer_closed"]

logger = logging.getLogger("umbp.server.client")

HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR
"""A socket's peer closed it, or the socket failed."""
EXITED = select.POLLIN
"""A process descriptor's process exited."""
_ENDED = select.POLLHUP | select.POLLERR | select.POLLNVAL  # reported whatever was asked


class Watched(Protocol):
    def fileno(self) -> int: ...


def peer_closed(sock: socket.socket) -> bool:
    """Has the other end of `sock` closed it (or did the socket fail)? Reads nothing."""
    return _ended_now(sock, HUNG_UP)


def _ended_now(source: Watched, events: int) -> bool:
    """Has one of `events` (or a hang-up, an error, a closed descriptor) come to `source`?"""
    poller = select.poll()
    try:
        poller.register(source, events)
    except (ValueError, OSError):  # closed here already
        return True
    return any(happened & (events | _ENDED) for _, happened in poller.poll(0))


class ServerExit:
    """A descriptor of a server's process, readable once it exited (a Linux pidfd), opened
    while its connection proves which process it is (the peer's credentials, in this
    process's pid namespace), so that no other process reusing the pid is watched."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor

    @classmethod
    def of_peer(cls, sock: socket.socket) -> ServerExit | None:
        """The exit of the process at the other end of `sock`; None where it cannot be
        known (a peer in another pid namespace, a kernel without pidfds)."""
        try:
            credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                          struct.calcsize("3i"))
            pid = struct.unpack("3i", credentials)[0]
            return cls(os.pidfd_open(pid)) if pid > 0 else None
        except (AttributeError, OSError):
            return None

    def fileno(self) -> int:
        return self._descriptor

    def exited(self) -> bool:
        return _ended_now(self, EXITED)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._descriptor)
        self._descriptor = -1


class HangUps:
    """Calls the owner's callback once when a watched source ends (`watch`)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._watched: dict[int, tuple[Watched, int, Callable[[], None]]] = {}
        self._wake_read = -1
        self._wake_write = -1
        self._pid = -1  # the process whose thread watches (none after a fork)

    def watch(self, source: Watched, on_end: Callable[[], None], events: int = HUNG_UP) -> None:
        """Watch `source` until one of `events` (or a hang-up or error) comes (then
        `on_end()` runs on the watching thread, once), or until `forget(source)`."""
        with self._guard:
            self._start_locked()
            self._watched[source.fileno()] = (source, events, on_end)
        self._wake()

    def forget(self, source: Watched) -> None:
        """Stop watching `source` (before it closes: its number may be reused)."""
        with self._guard:
            number = source.fileno()
            entry = self._watched.get(number)
            if entry is None or entry[0] is not source:
                return
            del self._watched[number]
        self._wake()

    def watching(self) -> int:
        """How many sources are watched now."""
        with self._guard:
            return len(self._watched) if self._pid == os.getpid() else 0

    def _start_locked(self) -> None:
        if self._pid == os.getpid():
            return
        # First use in this process (or a child forked from one that watched: its thread
        # did not come along, nor do the parent's connections concern it).
        self._watched = {}
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pid = os.getpid()
        threading.Thread(
            target=self._run, args=(self._wake_read,), name="umbp-hang-ups", daemon=True
        ).start()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
            os.write(self._wake_write, b"\0")

    def _run(self, wake_read: int) -> None:
        while True:
            poller = select.poll()
            poller.register(wake_read, select.POLLIN)
            with self._guard:
                watched = dict(self._watched)
            for number, (_, events, _) in watched.items():
                poller.register(number, events)
            for number, happened in poller.poll():
                if number == wake_read:
                    _drain(wake_read)
                elif happened & (watched[number][1] | _ENDED):
                    self._report(number, watched[number])

    def _report(self, number: int, entry: tuple[Watched, int, Callable[[], None]]) -> None:
        with self._guard:
            if self._watched.get(number) is not entry:
                return  # forgotten meanwhile
            del self._watched[number]
        try:
            entry[2]()
        except Exception:  # one owner's failure must not end the watch of the others
            logger.exception("umbp: handling a server's end failed")


def _drain(wake_read: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(wake_read, 4096):
            pass


HANG_UPS = HangUps()
"""The process's one watcher of servers' ends."""
