"""`umbp serve`: the node-local store server process.

A threading Unix-socket server over `StoreCore`. Its DRAM tier is a shared-memory file
in /dev/shm that clients map; only control messages cross the socket (see `protocol`).
The socket is owner-only (0600, its directory 0700 when the server creates it), so only
processes of the same user can talk to it or map its pool. One server per socket path:
the holder of the flock on `<socket>.owner` (see `ownership`); a socket or shared-memory
file is deleted only when it is provably a dead holder's. The threat model is in
docs/operations.md.

What a restart keeps: objects in the SSD tier (its slot file rebuilds its index at open).
What it loses: the DRAM tier, which lives and dies with the process.

SIGTERM and SIGINT shut down cleanly: the socket, the shared-memory file and the record
of its name are removed and the process exits 0. With `persist_on_exit`
(`--persist-on-exit`) the DRAM tier's objects are first copied to the SSD tier, so that
the next server keeps them too. After a SIGKILL the next server started at the same
socket path removes the socket and the shared-memory file its predecessor left behind
(the file's name is recorded beside the socket, in `<socket>.pool`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import socketserver
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

from umbp.runtime.server import protocol, schema
from umbp.runtime.server.cold import ColdTier, open_cold_tier, stats_dict
from umbp.runtime.server.index import PoolIndex
from umbp.runtime.server.ownership import SocketOwnership
from umbp.runtime.server.sessions import RequestRefused, Session
from umbp.runtime.server.shm import SharedPool, create_shared_pool, release_shared_pool
from umbp.runtime.server.state import StoreCore

__all__ = ["ServerConfig", "serve"]

logger = logging.getLogger("umbp.serve")

DEFAULT_PAGE_BYTES = 64 << 10
"""The DRAM allocation granule when none is given."""
DEFAULT_MAX_CONNECTIONS = 256
MAX_CONNECTIONS_LIMIT = 4096
DEFAULT_FRAME_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerConfig:
    socket_path: str
    capacity_bytes: int
    page_bytes: int = DEFAULT_PAGE_BYTES
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    ssd_dir: str | None = None
    ssd_capacity_bytes: int = 0
    persist_on_exit: bool = False
    """On SIGTERM/SIGINT, copy the DRAM tier's objects to the SSD tier before exiting
    (costs one SSD write per object the SSD lacks; off by default)."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Client connections served at once (one thread each); more are refused."""
    frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S
    """Time a client has to finish a frame once its first byte arrived (and to read an
    answer); an idle connection between frames may wait for ever."""

    def validate(self) -> None:
        if self.page_bytes <= 0 or self.page_bytes % 64:
            raise ValueError(f"page_bytes must be a positive multiple of 64, got {self.page_bytes}")
        if self.capacity_bytes < self.page_bytes:
            raise ValueError(
                f"capacity_bytes ({self.capacity_bytes}) is below one page ({self.page_bytes})"
            )
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError(
                "watermarks must satisfy 0 < low < high <= 1, got "
                f"low={self.low_watermark} high={self.high_watermark}"
            )
        if self.ssd_capacity_bytes < 0:
            raise ValueError(f"ssd_capacity_bytes must be >= 0, got {self.ssd_capacity_bytes}")
        if self.ssd_capacity_bytes and self.ssd_dir is None:
            raise ValueError("ssd_capacity_bytes needs ssd_dir")
        if not 1 <= self.max_connections <= MAX_CONNECTIONS_LIMIT:
            raise ValueError(
                f"max_connections must be in [1, {MAX_CONNECTIONS_LIMIT}], "
                f"got {self.max_connections}"
            )
        if not 0.01 <= self.frame_timeout_s <= 3600:
            raise ValueError(f"frame_timeout_s must be in [0.01, 3600], got {self.frame_timeout_s}")


class _Handler(socketserver.BaseRequestHandler):
    server: _StoreServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        core = self.server.core
        session = core.open_session()
        self.server.track(sock)
        try:
            while True:
                op, body = protocol.read_request(
                    sock, schema.body_limit, self.server.frame_timeout_s
                )
                answer = self._answer(op, body, session)
                if answer is not None:
                    sock.settimeout(self.server.frame_timeout_s)  # a reader that never reads
                    sock.sendall(answer)
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

    def _answer(self, op: int, body: bytes, session: Session) -> bytes | None:
        try:
            request = schema.parse(op, body)
            return self._dispatch(op, request, session)
        except protocol.ProtocolError:
            raise
        except (schema.BadRequest, RequestRefused) as error:
            # The client's mistake, refused before anything changed: no traceback.
            logger.warning("umbp serve: request %d refused: %s", op, error)
            return None if op in protocol.ONE_WAY else protocol.encode_json(
                protocol.ERROR, f"{type(error).__name__}: {error}"
            )
        except Exception as error:  # one bad request must not kill the server
            logger.exception("umbp serve: request %d failed", op)
            if op in protocol.ONE_WAY:
                return None
            return protocol.encode_json(protocol.ERROR, f"{type(error).__name__}: {error}")

    def _dispatch(self, op: int, request: schema.Request, session: Session) -> bytes | None:
        core = self.server.core
        if isinstance(request, schema.Keys):
            codes = core.lookup(request.keys) if op == protocol.LOOKUP else core.where(request.keys)
            return protocol.encode(protocol.OK, codes)
        if isinstance(request, schema.BeginPut):
            token, put_answers = core.begin_put(session, request.keys, request.sizes)
            return protocol.encode_json(protocol.OK, {"token": token, "answers": put_answers})
        if isinstance(request, schema.CommitPut):
            return protocol.encode_json(
                protocol.OK, core.commit_put(session, request.token, request.checksums)
            )
        if isinstance(request, schema.BeginGet):
            token, get_answers = core.begin_get(session, request.keys, request.sizes)
            return protocol.encode_json(protocol.OK, {"token": token, "answers": get_answers})
        if isinstance(request, schema.EndGet):
            core.end_get(session, request.token, request.corrupt)
            return None
        if op == protocol.HELLO:
            return protocol.encode_json(protocol.OK, self.server.hello)
        if op == protocol.CLEAR:
            return protocol.encode_json(protocol.OK, core.clear())
        if op == protocol.STATS:
            figures = core.stats(asking=session) | {
                "pid": self.server.hello["pid"],
                "server": self.server.hello,
                "limits": self.server.limits(),
            }
            return protocol.encode_json(protocol.OK, figures)
        raise protocol.ProtocolError(f"unknown op {op}")


class _StoreServer(socketserver.ThreadingUnixStreamServer):
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
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        # One thread per connection, and at most `max_connections` of them: a connection
        # beyond is told why and closed at once, before a thread is started for it.
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(path, _Handler)

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


def serve(config: ServerConfig) -> int:
    """Run a server in the foreground until SIGTERM or SIGINT; returns the exit status."""
    config.validate()
    stop = _stop_on_signals()
    socket_path = os.path.abspath(config.socket_path)
    ownership = SocketOwnership.acquire(socket_path)
    pool: SharedPool | None = None
    cold: ColdTier | None = None
    server: _StoreServer | None = None
    try:
        ownership.clear_leftovers()
        pool = create_shared_pool(config.capacity_bytes // config.page_bytes * config.page_bytes)
        ownership.record_pool(pool.path)
        if config.ssd_dir is not None and config.ssd_capacity_bytes > 0:
            cold = open_cold_tier(config.ssd_dir, config.ssd_capacity_bytes)
            _report_cold_tier(cold)
        core = StoreCore(pool.view, _index_for(config, pool), cold)
        server = _bind(socket_path, config, core, _hello(config, pool))
        ownership.bound()
        _run_until(stop, server, socket_path, pool)
        server.server_close()
        server.drop_connections()
        if config.persist_on_exit:
            _persist(core)
    finally:
        _shut_down(server, ownership, pool, cold)
    return 0


def _index_for(config: ServerConfig, pool: SharedPool) -> PoolIndex:
    total_pages = pool.nbytes // config.page_bytes
    return PoolIndex(
        total_pages,
        config.page_bytes,
        high_pages=int(config.high_watermark * total_pages + 1e-9),
        low_pages=int(config.low_watermark * total_pages + 1e-9),
    )


def _hello(config: ServerConfig, pool: SharedPool) -> dict[str, Any]:
    return {
        "server_id": secrets.token_hex(8),
        "pid": os.getpid(),
        "shm_path": pool.path,
        "shm_bytes": pool.nbytes,
        "page_bytes": config.page_bytes,
        "ssd_dir": config.ssd_dir,
    }


def remove_stale_leftovers(socket_path: str) -> None:
    """Best-effort clean-up after a server that is gone (tests' `stop_server`): when no
    live server holds the socket path's lock, remove the dead one's socket and pool file;
    otherwise touch nothing."""
    path = os.path.abspath(socket_path)
    if not os.path.isdir(os.path.dirname(path)):
        return  # nothing can be left there (and a clean-up must not create the directory)
    ownership = SocketOwnership.try_acquire(path)
    if ownership is None:
        return
    try:
        ownership.clear_leftovers(strict=False)
    finally:
        ownership.release()


def _bind(
    socket_path: str, config: ServerConfig, core: StoreCore, hello: dict[str, Any]
) -> _StoreServer:
    """Bind with a umask that makes the socket owner-only from its first instant (a chmod
    after bind would leave a window in which anyone could connect)."""
    previous = os.umask(0o177)
    try:
        server = _StoreServer(
            socket_path, core, hello, config.max_connections, config.frame_timeout_s
        )
    finally:
        os.umask(previous)
    os.chmod(socket_path, 0o600)
    return server


def _stop_on_signals() -> threading.Event:
    """Installed before anything is allocated, so that a SIGTERM during a long start
    (allocating a large pool) still ends in a clean shutdown."""
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    # A write past RLIMIT_FSIZE must fail with EFBIG (the SSD tier then answers False),
    # not kill the server and every client's pool with it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return stop


def _run_until(
    stop: threading.Event, server: _StoreServer, socket_path: str, pool: SharedPool
) -> None:
    # A short poll interval: shutdown() waits up to one interval for the loop to notice.
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="umbp-serve",
        daemon=True,
    )
    thread.start()
    print(
        json.dumps({"event": "serving", "socket": socket_path, "pool": pool.path,
                    "pool_bytes": pool.nbytes, "pid": os.getpid()}),
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(0.5):
        pass
    server.shutdown()
    thread.join()


def _persist(core: StoreCore) -> None:
    written = core.persist_to_cold()
    print(json.dumps({"event": "persisted", "objects": written}), file=sys.stderr, flush=True)


def _report_cold_tier(cold: ColdTier) -> None:
    """One line at start: what the SSD tier kept from before, and what it lost."""
    figures = stats_dict(cold.stats())
    event = {"event": "ssd_opened", "objects": figures.get("objects"),
             "dropped_at_open": figures.get("dropped_at_open")}
    print(json.dumps(event), file=sys.stderr, flush=True)


def _shut_down(
    server: _StoreServer | None,
    ownership: SocketOwnership,
    pool: SharedPool | None,
    cold: ColdTier | None,
) -> None:
    if server is not None:
        server.server_close()
        server.drop_connections()
    if pool is not None:
        release_shared_pool(pool)
    if cold is not None:
        cold.close()
    ownership.release()
    print(json.dumps({"event": "stopped", "socket": ownership.socket_path}), file=sys.stderr,
          flush=True)
