"""The listening side of `umbp serve`: the owner-only Unix socket, one thread per client
connection up to a limit (connections beyond are told why and closed), and each
connection's loop of request frames. What a request does: `dispatch`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import socketserver
import threading
import time
from typing import Any

from umbp.runtime.server import protocol, schema
from umbp.runtime.server.dispatch import answer
from umbp.runtime.server.metrics import RequestTimes
from umbp.runtime.server.state import StoreCore

__all__ = ["ConnectionHandler", "StoreServer", "bind"]

logger = logging.getLogger("umbp.serve")


class ConnectionHandler(socketserver.BaseRequestHandler):
    """One client connection: its session, and request frames read and answered in turn
    until the client leaves or breaks the protocol."""

    server: StoreServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        core = self.server.core
        session = core.open_session()
        self.server.track(sock)
        connection = protocol.ServedConnection(
            sock, schema.body_limit, self.server.frame_timeout_s
        )
        try:
            while True:
                op, body = connection.read_request()
                started = time.perf_counter()
                reply = answer(self.server, op, body, session)
                if reply is not None:
                    connection.reply(reply)  # bounded: a reader that never reads
                self.server.request_times.observe(op, time.perf_counter() - started)
        except protocol.ProtocolError as error:
            # Not this protocol (unknown op, oversized or unfinished frame): say why, then
            # drop the connection; its session's reservations and pins come back below.
            logger.warning("umbp serve: dropping a connection: %s", error)
            with contextlib.suppress(OSError):
                sock.settimeout(1.0)
                sock.sendall(protocol.encode_json(protocol.ERROR, f"ProtocolError: {error}"))
        except OSError:
            return  # the client went away (ConnectionError included)
        finally:
            self.server.untrack(sock)
            core.close_session(session)


class StoreServer(socketserver.ThreadingUnixStreamServer):
    """The listening socket: a thread per connection, at most `max_connections` of them,
    and every open connection tracked so that shutdown can wake its handler."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        path: str,
        core: StoreCore,
        hello: dict[str, Any],
        max_connections: int,
        frame_timeout_s: float,
    ) -> None:
        self.core = core
        self.hello = hello
        self.max_connections = max_connections
        self.frame_timeout_s = frame_timeout_s
        self.refused_connections = 0
        self.request_times = RequestTimes()
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        # One thread per connection, and at most `max_connections` of them: a connection
        # beyond is told why and closed at once, before a thread is started for it.
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(path, ConnectionHandler)

    def limits(self) -> dict[str, Any]:
        return {
            "max_connections": self.max_connections,
            "frame_timeout_s": self.frame_timeout_s,
            "refused_connections": self.refused_connections,
            "body_limits": {str(op): limit for op, limit in schema.BODY_LIMITS.items()},
        }

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            logger.warning(
                "umbp serve: refusing a connection: all %d connections are in use",
                self.max_connections,
            )
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(protocol.encode_json(
                    protocol.ERROR,
                    f"the server holds its limit of {self.max_connections} connections; "
                    "close idle clients or raise --max-connections",
                ))
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def track(self, sock: socket.socket) -> None:
        with self._connections_lock:
            self._connections.add(sock)

    def untrack(self, sock: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(sock)

    def drop_connections(self) -> None:
        """Wake every handler blocked on its client so that none outlives the server."""
        with self._connections_lock:
            for sock in self._connections:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def bind(
    socket_path: str,
    core: StoreCore,
    hello: dict[str, Any],
    max_connections: int,
    frame_timeout_s: float,
) -> StoreServer:
    """Bind with a umask that makes the socket owner-only from its first instant (a chmod
    after bind would leave a window in which anyone could connect)."""
    previous = os.umask(0o177)
    try:
        server = StoreServer(socket_path, core, hello, max_connections, frame_timeout_s)
    finally:
        os.umask(previous)
    os.chmod(socket_path, 0o600)
    return server
