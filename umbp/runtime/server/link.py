"""The client's link to a `umbp serve` process: one connection and the pool mapping it
announced, reconnects, and request/answer exchanges within a timeout.

Failure semantics: any socket error, timeout or protocol error drops the connection, so
nothing is ever read from or written into the pool through a connection the server no
longer honours (it released that connection's pins and reservations); the failing
exchange raises `StoreUnavailable` within `io_timeout_s`. A new connection is tried at
most once per `reconnect_interval_s`; in between, exchanges fail at once instead of
hammering a server that is down. When a server answers again, the link repeats its
greetings (what a new server must hear, such as the namespaces this client registered)
and carries on by itself.

The pool's mapping (`Mapping`) outlives a connection dropped on a timeout: the server
may only have been slow, and mapping a large pool anew (its page tables, and a GPU
worker's registration of it) costs seconds, so a reconnection to the same server (the
same server id, pool file and size) takes it up again. Any other failure means the
server is gone or is not the one expected (a dead server's socket is closed by the
kernel, which the client sees as a reset or end of stream), and so does a reconnection
that fails or reaches another server: then the link lets go of the old mapping at once,
and it ends when the last connection using it does. A server that closes a connection
while this client asks nothing of it (it died, or stopped) is heard at once (`hangups`),
not at the next request, and so is the exit of a server whose pool is kept after a
timeout (its process, known by the connection's peer credentials): an idle engine does
not keep a dead server's pool, whose pages a tmpfs keeps allocated while any process
maps it or holds it open (`detach_shared_pool` takes it out of this process even while
views of it live on). Whoever watches the memory loans lie
in (`watch_mappings`: a GPU worker registering it with its copy engines) hears of each
mapping once, before anything in it is lent, and of its end once nothing in it is (after
the last connection using it closed, before the mapping can be unmapped).

Thread-safe: one lock serialises the socket (a request and its answer are one critical
section); copies into and out of the pool run outside it, inside `Connection.copying()`.
When one thread drops the connection while another is copying, the socket is closed only
once that copy ends (the server frees a connection's reserved and pinned pages when its
socket closes, so they cannot be reused under the copy), and the copier's follow-up is
then refused with `Stale`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from umbp.runtime.contract import StoreUnavailable, WatchesLentMemory
from umbp.runtime.registered_memory import buffer_address
from umbp.runtime.server import protocol
from umbp.runtime.server.hangups import (
    EXITED,
    HANG_UPS,
    HUNG_UP,
    ServerExit,
    Watched,
    peer_closed,
)
from umbp.runtime.server.shm import SharedPool, detach_shared_pool, map_shared_pool

__all__ = ["Connection", "Mapping", "ServerLink", "Stale", "decode"]

logger = logging.getLogger("umbp.server.client")


class Stale(Exception):
    """The connection a multi-step call started on is gone."""


class Mapping:
    """A server's pool mapped into this process, held by the connections to that server
    and by the link while it may reconnect to it. Its watchers hear of it once, and of
    its end when the last holder lets go; then the pool's file leaves this process
    (`detach_shared_pool`: views that outlive their use stay valid, over empty memory)."""

    def __init__(self, pool: SharedPool, server_id: str, exit: ServerExit | None) -> None:
        self.pool = pool
        self.server_id = server_id
        self.exit = exit
        """The server process's exit, heard while no connection is left to hear its
        hang-up on (after a timeout)."""
        self.address = buffer_address(pool.view)
        """Where the pool lies in this process: what the watchers are told."""
        self._guard = threading.Lock()
        self._holders = 1
        self._watchers: list[WatchesLentMemory] = []

    def serves(self, hello: Any) -> bool:
        """Is this the pool the server that said `hello` announces?"""
        return (str(hello["server_id"]) == self.server_id
                and str(hello["shm_path"]) == self.pool.path
                and int(hello["shm_bytes"]) == self.pool.nbytes)

    def watch(self, watcher: WatchesLentMemory) -> None:
        """Tell `watcher` of the mapping now (`mapped`) and of its end (`unmapping`); only
        by a holder, so the mapping has not ended."""
        with self._guard:
            self._watchers.append(watcher)
        watcher.mapped(self.address, self.pool.nbytes)

    def hold(self) -> Mapping:
        with self._guard:
            self._holders += 1
        return self

    def release(self) -> None:
        """One holder lets go; the last one tells the watchers of the end."""
        with self._guard:
            self._holders -= 1
            if self._holders > 0:
                return
            watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            try:
                watcher.unmapping(self.address)
            except Exception:  # one watcher's failure must not keep the others' hold
                logger.exception("umbp: a watcher of the pool's mapping failed")
        detach_shared_pool(self.pool)
        if self.exit is not None:
            HANG_UPS.forget(self.exit)
            self.exit.close()


class Connection:
    """One live connection, holding the pool mapping the server announced.

    Copies into or out of the pool run inside `copying()`. Dropping the connection while
    a copy runs defers closing the socket until that copy ends: the server releases a
    connection's reservations and pins only when it sees the socket close, so no page can
    be handed to someone else while this client may still touch it. The connection lets
    go of the mapping then too: no loan or reservation of its is left in it.
    """

    def __init__(self, sock: socket.socket, mapping: Mapping, pid: int, page_bytes: int) -> None:
        self.sock = sock
        self.mapping = mapping
        self.page_bytes = page_bytes
        """The server's page: regions start on one, an object's pages are its regions'."""
        self.server_pid = pid
        self._guard = threading.Lock()
        self._copies = 0
        self._dropped = False

    @property
    def pool(self) -> SharedPool:
        return self.mapping.pool

    @property
    def server_id(self) -> str:
        return self.mapping.server_id

    @contextlib.contextmanager
    def copying(self) -> Iterator[memoryview]:
        """The pool's view for one batch of copies; `Stale` once the connection is gone."""
        self.hold()
        try:
            yield self.pool.view
        finally:
            self.let_go()

    def hold(self) -> None:
        """A copy (or a loan, or a reservation, until :meth:`let_go`) starts: the socket
        stays open, so the server keeps its pins; `Stale` once the connection is gone."""
        with self._guard:
            if self._dropped:
                raise Stale()
            self._copies += 1

    def let_go(self) -> None:
        with self._guard:
            self._copies -= 1
            close_now = self._dropped and self._copies == 0
        if close_now:
            self._close()

    def drop(self) -> None:
        """Close now, or when the last copy in flight ends."""
        with self._guard:
            self._dropped = True
            close_now = self._copies == 0
        if close_now:
            self._close()

    def _close(self) -> None:
        """The last use of the connection ended: it lets go of the mapping (whose last
        holder tells the watchers, before anything can unmap it), and its socket closes."""
        try:
            self.mapping.release()
        finally:
            self.sock.close()


class ServerLink:
    """The connection to the server at `endpoint`, (re)made on demand."""

    def __init__(self, endpoint: str, io_timeout_s: float, reconnect_interval_s: float) -> None:
        if io_timeout_s <= 0:
            raise ValueError(f"io_timeout_s must be positive, got {io_timeout_s}")
        if reconnect_interval_s < 0:
            raise ValueError(f"reconnect_interval_s must be >= 0, got {reconnect_interval_s}")
        self._endpoint = endpoint
        self._io_timeout_s = io_timeout_s
        self._reconnect_interval_s = reconnect_interval_s
        self._lock = threading.Lock()
        self._connection: Connection | None = None
        self._last_attempt = float("-inf")
        self._closed = False
        self._greetings: dict[str, tuple[int, Any]] = {}
        self._watchers: list[WatchesLentMemory] = []
        self._mapping: Mapping | None = None
        """The link's hold on the pool of the server it is (or, after a timeout, was)
        connected to."""

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def connected_server(self) -> tuple[str, int] | None:
        """(server id, pid) of the server connected to, if any."""
        connection = self._connection
        return None if connection is None else (connection.server_id, connection.server_pid)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_connection_locked()
            self._let_go_of_mapping_locked()

    def watch_mappings(self, watcher: WatchesLentMemory) -> None:
        """`watcher` hears of the pool mapped now, if any, and of every later one
        (`WatchesLentMemory`)."""
        with self._lock:
            self._watchers.append(watcher)
            if self._mapping is not None:
                self._mapping.watch(watcher)

    def greet_with(self, name: str, op: int, request: Any) -> None:
        """Send `request` on every new connection, right after HELLO (the latest one
        given under `name` replaces an earlier one)."""
        with self._lock:
            self._greetings[name] = (op, request)

    @contextlib.contextmanager
    def malformed_drops(self, connection: Connection) -> Iterator[None]:
        """An answer this client cannot follow means the peer is not the server it
        expects: drop the connection (which also releases what the server holds for it)."""
        try:
            yield
        except (KeyError, TypeError, ValueError, IndexError) as error:
            with self._lock:
                if self._connection is connection:
                    self._fail_locked(error)
            raise StoreUnavailable(self.describe(error)) from error

    def request_raw(self, op: int, request: Any, expected: int) -> bytes:
        body = self.call(op, request)
        if len(body) != expected:
            raise StoreUnavailable(
                f"umbp server at {self._endpoint}: {len(body)} answer bytes for {expected} keys"
            )
        return body

    def request_json(self, op: int, request: Any) -> Any:
        return decode(self.call(op, request))

    def begin(self, op: int, request: Any) -> tuple[Connection, Any]:
        """First step of a put or get: the answer, and the connection it belongs to (the
        regions in it are only meaningful in that connection's mapping)."""
        with self._lock:
            connection, body = self._exchange_locked(op, request)
        answer = decode(body)
        if not isinstance(answer, dict) or "answers" not in answer:
            raise StoreUnavailable(f"umbp server at {self._endpoint}: malformed answer")
        return connection, answer

    def call(self, op: int, request: Any) -> bytes:
        with self._lock:
            return self._exchange_locked(op, request)[1]

    def _exchange_locked(self, op: int, request: Any) -> tuple[Connection, bytes]:
        """Send one request and read its answer, connecting first if allowed, all within
        one `io_timeout_s`. A connection found broken (the server restarted since the
        last call) is replaced at once when a reconnect is due, so that a restart costs
        the caller nothing; a timeout is never retried."""
        deadline = protocol.Deadline(self._io_timeout_s)
        frame = protocol.encode_json(op, request)
        connection, fresh = self._connection_locked(deadline)
        try:
            return connection, self._round_trip(connection, frame, deadline)
        except (ConnectionError, BrokenPipeError) as error:
            self._fail_locked(error)
            if fresh or not self._may_reconnect():
                raise StoreUnavailable(self.describe(error)) from error
        except (OSError, ValueError) as error:
            self._fail_locked(error)
            raise StoreUnavailable(self.describe(error)) from error
        connection, _ = self._connection_locked(deadline)
        try:
            return connection, self._round_trip(connection, frame, deadline)
        except (OSError, ValueError) as error:
            self._fail_locked(error)
            raise StoreUnavailable(self.describe(error)) from error

    def _round_trip(
        self, connection: Connection, frame: bytes, deadline: protocol.Deadline
    ) -> bytes:
        protocol.send_all(connection.sock, frame, deadline)
        op, body = protocol.read_frame(connection.sock, deadline)
        if op == protocol.ERROR:
            # The server is alive but refused this request: keep the connection.
            raise ServerRefused(str(decode(body)))
        if op != protocol.OK:
            raise protocol.ProtocolError(f"unexpected answer op {op}")
        return body

    def follow_up(self, connection: Connection, op: int, request: Any) -> Any:
        """A later step of a multi-step call, only on the connection the call started on."""
        frame = protocol.encode_json(op, request)
        with self._lock:
            if self._connection is not connection:
                raise Stale()
            try:
                deadline = protocol.Deadline(self._io_timeout_s)
                return decode(self._round_trip(connection, frame, deadline))
            except (OSError, ValueError) as error:
                self._fail_locked(error)
                raise StoreUnavailable(self.describe(error)) from error

    def notify(self, connection: Connection, op: int, request: Any) -> None:
        frame = protocol.encode_json(op, request)
        with self._lock:
            if self._connection is not connection:
                raise Stale()
            try:
                protocol.send_all(connection.sock, frame, protocol.Deadline(self._io_timeout_s))
            except OSError as error:
                self._fail_locked(error)
                raise StoreUnavailable(self.describe(error)) from error

    def current(self) -> Connection:
        """The live connection, made now if a reconnect is due (raises
        `StoreUnavailable`)."""
        with self._lock:
            return self._connection_locked(protocol.Deadline(self._io_timeout_s))[0]

    def notify_current(self, op: int, request: Any) -> None:
        """A one-way request on the connection open now; nothing when none is (what it
        says concerns that connection only: the server forgot the rest with it)."""
        frame = protocol.encode_json(op, request)
        with self._lock:
            connection = self._connection
            if connection is None:
                return
            try:
                protocol.send_all(connection.sock, frame, protocol.Deadline(self._io_timeout_s))
            except OSError as error:
                self._fail_locked(error)
                raise StoreUnavailable(self.describe(error)) from error

    def _connection_locked(self, deadline: protocol.Deadline) -> tuple[Connection, bool]:
        """The live connection, or a new one when a reconnect is due; (connection, fresh)."""
        self.require_open()
        if self._connection is not None:
            return self._connection, False
        if not self._may_reconnect():
            raise StoreUnavailable(
                f"umbp server at {self._endpoint} unreachable; next attempt within "
                f"{self._reconnect_interval_s:g} s"
            )
        self._last_attempt = time.monotonic()
        try:
            self._connection = self._connect(deadline)
        except (OSError, ValueError, KeyError, TypeError) as error:
            self._let_go_of_mapping_unless_slow_locked(error)
            raise StoreUnavailable(self.describe(error)) from error
        return self._connection, True

    def _may_reconnect(self) -> bool:
        return time.monotonic() - self._last_attempt >= self._reconnect_interval_s

    def _connect(self, deadline: protocol.Deadline) -> Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.remaining())
            sock.connect(self._endpoint)
            protocol.send_all(sock, protocol.encode_json(protocol.HELLO, {}), deadline)
            op, body = protocol.read_frame(sock, deadline)
            if op != protocol.OK:
                raise protocol.ProtocolError(f"unexpected hello answer op {op}")
            hello = decode(body)
            pid, page_bytes = int(hello["pid"]), int(hello["page_bytes"])
            mapping = self._mapping_for_locked(hello, sock)
        except BaseException:
            sock.close()
            raise
        connection = Connection(sock, mapping.hold(), pid, page_bytes)
        try:
            for op, request in self._greetings.values():
                try:
                    self._round_trip(connection, protocol.encode_json(op, request), deadline)
                except ServerRefused as error:  # the server lives; the greeting was wrong
                    logger.warning("umbp: server at %s refused a greeting: %s",
                                   self._endpoint, error)
        except BaseException:
            connection.drop()
            raise
        self._watch_for_hang_up(connection)
        return connection

    def _watch_for_hang_up(self, connection: Connection) -> None:
        """Hear of the server closing `connection` while nothing is asked of it (a dead
        server's pool is let go of then, not at this client's next request)."""
        self._watch_for_end(connection.sock, HUNG_UP,
                            lambda link: link._heard_hang_up(connection))

    def _watch_for_end(
        self, source: Watched, events: int, heard: Callable[[ServerLink], None]
    ) -> None:
        link = weakref.ref(self)  # the process's watcher must not keep a link alive

        def ended() -> None:
            alive = link()
            if alive is not None:
                heard(alive)

        HANG_UPS.watch(source, ended, events)

    def _heard_hang_up(self, connection: Connection) -> None:
        with self._lock:
            if self._connection is not connection:
                return  # dropped already (a request in flight saw the end first)
            if not peer_closed(connection.sock):
                self._watch_for_hang_up(connection)  # a stale report (see `hangups`)
                return
            self._fail_locked(ConnectionError(
                "the server closed the connection while this client was idle"
            ))

    def _mapping_for_locked(self, hello: Any, sock: socket.socket) -> Mapping:
        """The pool `hello` (on `sock`) announces: still mapped when it is the one this
        link holds, else mapped now (after letting go of the old one), its watchers told."""
        if self._mapping is not None and self._mapping.serves(hello):
            logger.info("umbp: connected to server %s (pid %s) again; its pool is still mapped",
                        hello["server_id"], hello["pid"])
            if self._mapping.exit is not None:
                HANG_UPS.forget(self._mapping.exit)  # a connection to hear it on again
            return self._mapping
        self._let_go_of_mapping_locked()
        pool = map_shared_pool(str(hello["shm_path"]), int(hello["shm_bytes"]))
        logger.info("umbp: connected to server %s (pid %s)", hello["server_id"], hello["pid"])
        mapping = self._mapping = Mapping(pool, str(hello["server_id"]), ServerExit.of_peer(sock))
        for watcher in self._watchers:
            mapping.watch(watcher)
        return mapping

    def _let_go_of_mapping_locked(self) -> None:
        if self._mapping is not None:
            self._mapping.release()
            self._mapping = None

    def _fail_locked(self, error: BaseException) -> None:
        if isinstance(error, ServerRefused):
            return
        logger.warning("umbp: lost server at %s: %s", self._endpoint, error)
        self._drop_connection_locked()
        self._let_go_of_mapping_unless_slow_locked(error)

    def _let_go_of_mapping_unless_slow_locked(self, error: BaseException) -> None:
        """Keep the pool mapped after a timeout only: a slow server may answer again as
        the same server; a dead one's socket was closed by the kernel (a reset, an end of
        stream, or a refused connection)."""
        if not isinstance(error, TimeoutError):
            self._let_go_of_mapping_locked()
        elif self._mapping is not None and self._mapping.exit is not None:
            self._watch_for_exit(self._mapping)

    def _watch_for_exit(self, mapping: Mapping) -> None:
        """Hear of the exit of the server whose pool is kept after a timeout: a server
        killed while it did not answer has no connection left to hang up on."""
        assert mapping.exit is not None
        self._watch_for_end(mapping.exit, EXITED, lambda link: link._heard_exit(mapping))

    def _heard_exit(self, mapping: Mapping) -> None:
        with self._lock:
            if self._connection is not None or self._mapping is not mapping:
                return  # reconnected, or let go of already
            assert mapping.exit is not None  # closed only once the link let go
            if not mapping.exit.exited():
                self._watch_for_exit(mapping)  # a stale report (see `hangups`)
                return
            logger.warning("umbp: server %s at %s exited after it stopped answering; its "
                           "pool is let go of", mapping.server_id, self._endpoint)
            self._let_go_of_mapping_locked()

    def _drop_connection_locked(self) -> None:
        if self._connection is not None:
            HANG_UPS.forget(self._connection.sock)
            self._connection.drop()
            self._connection = None

    def require_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("ServerStore is closed")

    def describe(self, error: BaseException) -> str:
        return f"umbp server at {self._endpoint}: {type(error).__name__}: {error}"


class ServerRefused(ValueError):
    """The server answered ERROR: it is alive; the request itself failed."""


def decode(body: bytes) -> Any:
    try:
        return protocol.decode_json(body)
    except protocol.ProtocolError as error:
        raise StoreUnavailable(str(error)) from error
