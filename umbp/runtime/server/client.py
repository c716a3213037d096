"""`ServerStore`: the client of a node-local `umbp serve` process.

Bytes move through the server's shared-memory pool, mapped here; only control messages
cross the socket. A put is two round trips (reserve pages, then commit their checksums
once the bytes are written); a get is one round trip plus a one-way unpin.

Failure semantics: any socket error, timeout or protocol error drops the connection *and*
the mapping that came with it, so nothing is ever read from or written into the pool of
a server this client is no longer connected to. The failing call answers as the contract
says (`lookup`/`where`/`stats` raise `StoreUnavailable`, `put_batch` answers False,
`get_batch_into` answers UNAVAILABLE) within `io_timeout_s`. A new connection is tried
at most once per `reconnect_interval_s`; in between, calls fail at once instead of
hammering a server that is down. When a server (the same one, or a restarted one with a
new pool) answers again, the client maps its pool and carries on by itself.

Thread-safe: one lock serialises the socket (a request and its answer are one critical
section); copies into and out of the pool run outside it, so a lookup from another thread
waits for a round trip, not for a put's copies. When one thread drops the connection while
another is copying, the socket is closed only once that copy ends (the server frees a
connection's reserved and pinned pages when its socket closes, so they cannot be reused
under the copy), and the copier's commit or unpin is then refused: its call fails.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    LoadStatus,
    PoolStats,
    ReportsTiers,
    SchedulerStore,
    StoreUnavailable,
    TierAware,
    WorkerStore,
)
from umbp.runtime.host_memory import byte_views
from umbp.runtime.paged_copy import read_regions, write_regions
from umbp.runtime.server import protocol
from umbp.runtime.server.shm import SharedPool, map_shared_pool

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ServerStore"]

logger = logging.getLogger("umbp.server.client")

_MEDIA: dict[int, str | None] = {
    protocol.WHERE_NONE: None,
    protocol.WHERE_CPU: MEDIUM_CPU,
    protocol.WHERE_DISK: MEDIUM_DISK,
}
_GET_STATUS = {
    protocol.GET_MISSING: LoadStatus.MISSING,
    protocol.GET_CORRUPT: LoadStatus.CORRUPT,
    protocol.GET_SIZE_MISMATCH: LoadStatus.SIZE_MISMATCH,
    protocol.GET_UNAVAILABLE: LoadStatus.UNAVAILABLE,
}


class _Stale(Exception):
    """The connection a multi-step call started on is gone."""


class _Connection:
    """One live connection and the pool mapping it announced: they live and die together.

    Copies into or out of the pool run inside `copying()`. Dropping the connection while
    a copy runs defers closing the socket until that copy ends: the server releases a
    connection's reservations and pins only when it sees the socket close, so no page can
    be handed to someone else while this client may still touch it.
    """

    def __init__(self, sock: socket.socket, pool: SharedPool, server_id: str, pid: int) -> None:
        self.sock = sock
        self.pool = pool
        self.server_id = server_id
        self.server_pid = pid
        self._guard = threading.Lock()
        self._copies = 0
        self._dropped = False

    @contextlib.contextmanager
    def copying(self) -> Iterator[memoryview]:
        """The pool's view for one batch of copies; `_Stale` once the connection is gone."""
        with self._guard:
            if self._dropped:
                raise _Stale()
            self._copies += 1
        try:
            yield self.pool.view
        finally:
            with self._guard:
                self._copies -= 1
                close_now = self._dropped and self._copies == 0
            if close_now:
                self.sock.close()

    def drop(self) -> None:
        """Close now, or when the last copy in flight ends. The mapping is never closed
        explicitly: CPython unmaps it when the last view of it goes."""
        with self._guard:
            self._dropped = True
            close_now = self._copies == 0
        if close_now:
            self.sock.close()


class ServerStore(ClosesOnExit):
    """`SchedulerStore`, `WorkerStore` and `TierAware` over a `umbp serve` socket."""

    def __init__(
        self,
        endpoint: str,
        *,
        io_timeout_s: float = 5.0,
        reconnect_interval_s: float = 1.0,
    ) -> None:
        if io_timeout_s <= 0:
            raise ValueError(f"io_timeout_s must be positive, got {io_timeout_s}")
        if reconnect_interval_s < 0:
            raise ValueError(f"reconnect_interval_s must be >= 0, got {reconnect_interval_s}")
        self._endpoint = endpoint
        self._io_timeout_s = io_timeout_s
        self._reconnect_interval_s = reconnect_interval_s
        self._lock = threading.Lock()
        self._connection: _Connection | None = None
        self._last_attempt = float("-inf")
        self._closed = False

    # ------------------------------------------------------------- the contract

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        """Residency of each key in either tier. Raises `StoreUnavailable`."""
        if not keys:
            self._require_open()
            return ()
        answer = self._request_raw(protocol.LOOKUP, {"keys": list(keys)}, len(keys))
        return tuple([byte == 1 for byte in answer])

    def where(self, keys: Sequence[str]) -> tuple[str | None, ...]:
        """"CPU", "DISK" or None per key. Raises `StoreUnavailable`."""
        if not keys:
            self._require_open()
            return ()
        answer = self._request_raw(protocol.WHERE, {"keys": list(keys)}, len(keys))
        return tuple([_MEDIA.get(code) for code in answer])

    def put_batch(self, keys: Sequence[str], payloads: Sequence[Buffer]) -> tuple[bool, ...]:
        """Store each payload; False for every key the server did not take (including
        all of them when it cannot be reached). Raises ValueError for caller bugs."""
        sources = byte_views(keys, payloads, writable=False)
        if not keys:
            return ()
        try:
            return self._put(keys, sources)
        except (StoreUnavailable, _Stale):
            return (False,) * len(keys)

    def get_batch_into(
        self, keys: Sequence[str], outs: Sequence[Buffer]
    ) -> tuple[LoadStatus, ...]:
        """Load each object into its buffer, verifying its checksum; UNAVAILABLE for every
        key when the server cannot be reached. Raises ValueError for caller bugs."""
        destinations = byte_views(keys, outs, writable=True)
        if not keys:
            return ()
        try:
            return self._get(keys, destinations)
        except (StoreUnavailable, _Stale):
            return (LoadStatus.UNAVAILABLE,) * len(keys)

    def stats(self) -> PoolStats:
        """The DRAM tier's occupancy with the server's counters (evictions: objects that
        left DRAM, to SSD or dropped). Raises `StoreUnavailable`."""
        figures = self.server_stats()
        dram, counters = figures["dram"], figures["counters"]
        return PoolStats(
            capacity_bytes=dram["capacity_bytes"],
            used_bytes=dram["used_bytes"],
            page_bytes=dram["page_bytes"],
            objects=dram["objects"],
            hits=counters["hits"],
            misses=counters["misses"],
            puts=counters["puts"],
            put_rejects=counters["put_rejects"],
            evictions=counters["evictions_to_ssd"] + counters["evictions_dropped"],
            corrupt_loads=counters["corrupt_loads"],
            bytes_written=counters["bytes_written"],
            bytes_read=counters["bytes_read"],
        )

    def server_stats(self) -> dict[str, Any]:
        """Per-tier figures and counters of the server (see `umbp.runtime.server.stats`).
        Raises `StoreUnavailable`."""
        answer = self._request_json(protocol.STATS, {})
        if not isinstance(answer, dict):
            raise StoreUnavailable(f"umbp server at {self._endpoint}: malformed stats")
        return answer

    def tier_usage(self) -> dict[str, tuple[int, int]]:
        """(used bytes, objects) of the DRAM tier and, when the server has one, the SSD
        tier; raises `StoreUnavailable` when the server cannot be reached."""
        figures = self.server_stats()
        dram, ssd = figures["dram"], figures["ssd"]
        usage = {MEDIUM_CPU: (int(dram["used_bytes"]), int(dram["objects"]))}
        if ssd.get("enabled"):
            usage[MEDIUM_DISK] = (int(ssd["used_bytes"]), int(ssd["objects"]))
        return usage

    def clear(self) -> bool:
        """Drop every object in both tiers; False when the server cannot be reached."""
        try:
            return bool(self._request_json(protocol.CLEAR, {}))
        except StoreUnavailable:
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._disconnect_locked()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def connected_server(self) -> tuple[str, int] | None:
        """(server id, pid) of the server this client is connected to, if any: lets an
        operator (and the tests) see that a reconnect reached a new server."""
        connection = self._connection
        return None if connection is None else (connection.server_id, connection.server_pid)

    # --------------------------------------------------------------------- puts

    def _put(self, keys: Sequence[str], sources: list[memoryview]) -> tuple[bool, ...]:
        connection, answer = self._begin(
            protocol.BEGIN_PUT,
            {"keys": list(keys), "sizes": [source.nbytes for source in sources]},
        )
        results = [False] * len(keys)
        reserved: list[int] = []
        checksums: list[int | None] = []
        with self._malformed_drops(connection), connection.copying() as view:
            for position, placed in enumerate(answer["answers"]):
                if placed is True:
                    results[position] = True
                elif isinstance(placed, list):
                    reserved.append(position)
                    checksums.append(write_regions(view, placed, sources[position]))
        if reserved:
            committed = self._follow_up(
                connection,
                protocol.COMMIT_PUT,
                {"token": answer["token"], "checksums": checksums},
            )
            if not isinstance(committed, list) or len(committed) != len(reserved):
                raise StoreUnavailable("umbp server: malformed commit answer")
            for position, stored in zip(reserved, committed):
                results[position] = bool(stored)
        return tuple(results)

    # --------------------------------------------------------------------- gets

    def _get(self, keys: Sequence[str], destinations: list[memoryview]) -> tuple[LoadStatus, ...]:
        connection, answer = self._begin(
            protocol.BEGIN_GET,
            {"keys": list(keys), "sizes": [out.nbytes for out in destinations]},
        )
        statuses: list[LoadStatus] = []
        corrupt: list[int] = []
        with self._malformed_drops(connection), connection.copying() as view:
            for position, found in enumerate(answer["answers"]):
                if isinstance(found, str):
                    statuses.append(_GET_STATUS.get(found, LoadStatus.UNAVAILABLE))
                    continue
                nbytes, checksum, regions = found
                destination = destinations[position]
                if (
                    nbytes == destination.nbytes
                    and read_regions(view, regions, destination) == checksum
                ):
                    statuses.append(LoadStatus.HIT)
                else:
                    statuses.append(LoadStatus.CORRUPT)
                    corrupt.append(position)
        # One-way: the server unpins when it reads this; the next request on this
        # connection is ordered after it.
        self._notify(connection, protocol.END_GET, {"token": answer["token"], "corrupt": corrupt})
        return tuple(statuses)

    @contextlib.contextmanager
    def _malformed_drops(self, connection: _Connection) -> Iterator[None]:
        """An answer this client cannot follow means the peer is not the server it
        expects: drop the connection (which also releases what the server holds for it)."""
        try:
            yield
        except (KeyError, TypeError, ValueError, IndexError) as error:
            with self._lock:
                if self._connection is connection:
                    self._fail_locked(error)
            raise StoreUnavailable(self._describe(error)) from error

    # ------------------------------------------------------------ connection

    def _request_raw(self, op: int, request: Any, expected: int) -> bytes:
        body = self._call(op, request)
        if len(body) != expected:
            raise StoreUnavailable(
                f"umbp server at {self._endpoint}: {len(body)} answer bytes for {expected} keys"
            )
        return body

    def _request_json(self, op: int, request: Any) -> Any:
        return _decode(self._call(op, request))

    def _begin(self, op: int, request: Any) -> tuple[_Connection, Any]:
        """First step of a put or get: the answer, and the connection it belongs to (the
        regions in it are only meaningful in that connection's mapping)."""
        with self._lock:
            connection, body = self._exchange_locked(op, request)
        answer = _decode(body)
        if not isinstance(answer, dict) or "answers" not in answer:
            raise StoreUnavailable(f"umbp server at {self._endpoint}: malformed answer")
        return connection, answer

    def _call(self, op: int, request: Any) -> bytes:
        with self._lock:
            return self._exchange_locked(op, request)[1]

    def _exchange_locked(self, op: int, request: Any) -> tuple[_Connection, bytes]:
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
                raise StoreUnavailable(self._describe(error)) from error
        except (OSError, ValueError) as error:
            self._fail_locked(error)
            raise StoreUnavailable(self._describe(error)) from error
        connection, _ = self._connection_locked(deadline)
        try:
            return connection, self._round_trip(connection, frame, deadline)
        except (OSError, ValueError) as error:
            self._fail_locked(error)
            raise StoreUnavailable(self._describe(error)) from error

    def _round_trip(
        self, connection: _Connection, frame: bytes, deadline: protocol.Deadline
    ) -> bytes:
        protocol.send_all(connection.sock, frame, deadline)
        op, body = protocol.read_frame(connection.sock, deadline)
        if op == protocol.ERROR:
            # The server is alive but refused this request: keep the connection.
            raise _ServerRefused(str(_decode(body)))
        if op != protocol.OK:
            raise protocol.ProtocolError(f"unexpected answer op {op}")
        return body

    def _follow_up(self, connection: _Connection, op: int, request: Any) -> Any:
        """A later step of a multi-step call, only on the connection the call started on."""
        frame = protocol.encode_json(op, request)
        with self._lock:
            if self._connection is not connection:
                raise _Stale()
            try:
                deadline = protocol.Deadline(self._io_timeout_s)
                return _decode(self._round_trip(connection, frame, deadline))
            except (OSError, ValueError) as error:
                self._fail_locked(error)
                raise StoreUnavailable(self._describe(error)) from error

    def _notify(self, connection: _Connection, op: int, request: Any) -> None:
        frame = protocol.encode_json(op, request)
        with self._lock:
            if self._connection is not connection:
                raise _Stale()
            try:
                protocol.send_all(connection.sock, frame, protocol.Deadline(self._io_timeout_s))
            except OSError as error:
                self._fail_locked(error)
                raise StoreUnavailable(self._describe(error)) from error

    def _connection_locked(self, deadline: protocol.Deadline) -> tuple[_Connection, bool]:
        """The live connection, or a new one when a reconnect is due; (connection, fresh)."""
        self._require_open()
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
            raise StoreUnavailable(self._describe(error)) from error
        return self._connection, True

    def _may_reconnect(self) -> bool:
        return time.monotonic() - self._last_attempt >= self._reconnect_interval_s

    def _connect(self, deadline: protocol.Deadline) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.remaining())
            sock.connect(self._endpoint)
            protocol.send_all(sock, protocol.encode_json(protocol.HELLO, {}), deadline)
            op, body = protocol.read_frame(sock, deadline)
            if op != protocol.OK:
                raise protocol.ProtocolError(f"unexpected hello answer op {op}")
            hello = _decode(body)
            pool = map_shared_pool(str(hello["shm_path"]), int(hello["shm_bytes"]))
        except BaseException:
            sock.close()
            raise
        logger.info("umbp: connected to server %s (pid %s)", hello["server_id"], hello["pid"])
        return _Connection(sock, pool, str(hello["server_id"]), int(hello["pid"]))

    def _fail_locked(self, error: BaseException) -> None:
        if isinstance(error, _ServerRefused):
            return
        logger.warning("umbp: lost server at %s: %s", self._endpoint, error)
        self._disconnect_locked()

    def _disconnect_locked(self) -> None:
        if self._connection is not None:
            self._connection.drop()
            self._connection = None

    def _require_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("ServerStore is closed")

    def _describe(self, error: BaseException) -> str:
        return f"umbp server at {self._endpoint}: {type(error).__name__}: {error}"


class _ServerRefused(ValueError):
    """The server answered ERROR: it is alive; the request itself failed."""


def _decode(body: bytes) -> Any:
    try:
        return protocol.decode_json(body)
    except protocol.ProtocolError as error:
        raise StoreUnavailable(str(error)) from error


if TYPE_CHECKING:

    def _server_store_honours_the_contract(
        store: ServerStore,
    ) -> tuple[SchedulerStore, WorkerStore, TierAware, ReportsTiers]:
        """Never called: makes mypy prove that ServerStore satisfies the protocols."""
        return store, store, store, store
