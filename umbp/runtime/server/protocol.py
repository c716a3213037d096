"""The control protocol between `umbp serve` and its clients (KV bytes never cross it).

Frame (both directions): op (u8) + body length (u32, little-endian) + body. Request
bodies are JSON; answers are JSON except for `LOOKUP` and `WHERE`, whose answer is one
byte per key (the scheduler asks about every block of a prompt at once, so that path
skips JSON on the way back). An answer with op `ERROR` carries a JSON message instead.

Ops and bodies:
* `HELLO` {} -> {"server_id", "pid", "shm_path", "shm_bytes", "page_bytes"}: sent once per
  connection; the client maps `shm_path` and ties the mapping to this connection.
* `LOOKUP` {"keys", "request"?} -> bytes, `WHERE_*` codes: an engine asks what it could
  load (counted per namespace as hits and misses); objects only on SSD start coming
  into DRAM at once (prefetched, within the server's bound), for the engine's request
  `request` when given (its queued prefetches are cancelled by `FORGET`).
* `WHERE` {"keys"} -> bytes, `WHERE_*` codes, nothing counted or prefetched.
* `FORGET` {"request"} -> no answer (one-way): the request went away; its prefetches not
  yet started are dropped.
* `BEGIN_PUT` {"keys", "sizes"} -> {"token", "answers"}: per key `true` (already resident,
  nothing to write), `false` (rejected) or a list of [offset, length] regions reserved for
  it in the shared pool, in object order.
* `COMMIT_PUT` {"token", "checksums"} -> [bool per reserved key]: one xxh3-64 per reserved
  key (in request order), or null to abandon that key.
* `BEGIN_GET` {"keys", "sizes"} -> {"token", "answers"}: per key a `GET_*` code, or
  [nbytes, checksum, regions] for a key now pinned.
* `END_GET` {"token", "corrupt"} -> no answer (one-way): unpins, drops the corrupt keys
  (positions in the BEGIN_GET request).
* `CLEAR` {} -> bool; `STATS` {} -> the stats dict (see `umbp.runtime.server.stats`).

Per namespace (operators, and engines registering; `umbp.runtime.server.operations`):
* `REGISTER` {"namespace", "label"} -> true: the model a namespace belongs to;
* `NAMESPACES` {} -> [one row per namespace] (`umbp ls`);
* `DROP` {"namespace": str or null} -> {"namespace", "objects", "dram", "ssd", "in_use"}
  (`umbp clear`; null: every namespace);
* `RETAIN` {"keys", "seconds"} -> {"retained", "extended", "not_in_dram", "missing",
  "seconds"}: keep those objects in DRAM, or ERROR (over a budget, too long);
* `LIMITS` {"namespace", "quota_bytes"?, "retain_budget_bytes"?} -> the namespace's
  limits now (`umbp limits`).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, Final

HEADER: Final = struct.Struct("<BI")
MAX_BODY_BYTES: Final = 64 << 20

HELLO: Final = 1
LOOKUP: Final = 2
WHERE: Final = 3
BEGIN_PUT: Final = 4
COMMIT_PUT: Final = 5
BEGIN_GET: Final = 6
END_GET: Final = 7
CLEAR: Final = 8
STATS: Final = 9
REGISTER: Final = 10
NAMESPACES: Final = 11
DROP: Final = 12
RETAIN: Final = 13
LIMITS: Final = 14
FORGET: Final = 15
OK: Final = 100
ERROR: Final = 101

ONE_WAY: Final = frozenset({END_GET, FORGET})

OP_NAMES: Final = {
    HELLO: "hello", LOOKUP: "lookup", WHERE: "where", BEGIN_PUT: "begin_put",
    COMMIT_PUT: "commit_put", BEGIN_GET: "begin_get", END_GET: "end_get", CLEAR: "clear",
    STATS: "stats", REGISTER: "register", NAMESPACES: "namespaces", DROP: "drop",
    RETAIN: "retain", LIMITS: "limits", FORGET: "forget",
}
"""Each op's name, as the metrics label requests by it."""

WHERE_NONE: Final = 0
WHERE_CPU: Final = 1
WHERE_DISK: Final = 2

GET_MISSING: Final = "missing"
GET_CORRUPT: Final = "corrupt"
GET_SIZE_MISMATCH: Final = "size_mismatch"
GET_UNAVAILABLE: Final = "unavailable"


class ProtocolError(ConnectionError):
    """The peer sent something that is not a frame of this protocol; the connection is
    dropped (a ConnectionError so that every caller's connection-failure path handles it)."""


class Deadline:
    """A point in time every blocking socket step of one call must finish by, so that a
    call is bounded as a whole rather than per recv."""

    __slots__ = ("_at",)

    def __init__(self, seconds: float) -> None:
        self._at = time.monotonic() + seconds

    def remaining(self) -> float:
        left = self._at - time.monotonic()
        if left <= 0:
            raise TimeoutError("umbp server did not answer in time")
        return left


def encode(op: int, body: bytes) -> bytes:
    return HEADER.pack(op, len(body)) + body


def encode_json(op: int, value: Any) -> bytes:
    return encode(op, json.dumps(value, separators=(",", ":")).encode())


def decode_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as error:
        raise ProtocolError(f"malformed message body: {error}") from error


def read_frame(sock: socket.socket, deadline: Deadline | None) -> tuple[int, bytes]:
    """One frame; with `deadline` every recv waits at most the time left (TimeoutError
    after), without one it blocks (the server waits for its clients' next request)."""
    op, length = HEADER.unpack(_read_exactly(sock, HEADER.size, deadline))
    if length > MAX_BODY_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_BODY_BYTES}")
    return op, _read_exactly(sock, length, deadline)


class ServedConnection:
    """The server's end of one client connection: request frames in, answers out.

    It waits for a request's first byte as long as the client likes (connections are
    long-lived and mostly idle), but the rest of the frame must arrive within
    `frame_timeout_s` (a half frame never holds a thread for good). The body length is
    checked against `body_limit(op)` before the body is taken, and more is received only
    as bytes arrive, so memory grows only with bytes that actually arrived, never with
    what a header claims.

    Few system calls per request, since every client's requests pass through the one
    server process: the socket stays blocking between frames, so a request is usually
    one `recv` (at most `_CHUNK_BYTES`; the bytes of a next request read with it, such as
    the BEGIN_GET a client sends right after a one-way END_GET, wait for the next call),
    and an answer one non-blocking `send`. Only a frame or answer that does not fit at
    once goes through timed reads or writes."""

    def __init__(
        self, sock: socket.socket, body_limit: Callable[[int], int], frame_timeout_s: float
    ) -> None:
        self.sock = sock
        self._body_limit = body_limit
        self._frame_timeout_s = frame_timeout_s
        self._pending = bytearray()
        sock.settimeout(None)
        self._timed = False

    def read_request(self) -> tuple[int, bytes]:
        """The next request frame; ConnectionError when the client left, ProtocolError
        for a frame this protocol refuses."""
        pending = self._pending
        if not pending:
            self._blocking()
            first = self.sock.recv(_CHUNK_BYTES)
            if not first:
                raise ConnectionError("the client closed the connection")
            pending += first
        deadline = Deadline(self._frame_timeout_s)
        try:
            self._fill(HEADER.size, deadline)
            op, length = HEADER.unpack_from(pending)
            limit = self._body_limit(op)
            if length > limit:
                raise ProtocolError(
                    f"a body of {length} bytes for op {op} exceeds its limit of {limit}"
                )
            end = HEADER.size + length
            self._fill(end, deadline)
        except TimeoutError:
            raise ProtocolError(
                f"a frame was not completed within {self._frame_timeout_s:g} s of its "
                "first byte"
            ) from None
        body = bytes(pending[HEADER.size : end])
        del pending[:end]
        return op, body

    def reply(self, frame: bytes) -> None:
        """Send an answer frame; a client that does not read it within `frame_timeout_s`
        raises TimeoutError (an OSError: the connection is dropped)."""
        sent = 0
        if not self._timed:
            try:
                sent = self.sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent == len(frame):
                return
        self.sock.settimeout(self._frame_timeout_s)
        self._timed = True
        self.sock.sendall(memoryview(frame)[sent:])

    def _fill(self, size: int, deadline: Deadline) -> None:
        pending = self._pending
        while len(pending) < size:
            self.sock.settimeout(deadline.remaining())
            self._timed = True
            part = self.sock.recv(min(size - len(pending), _CHUNK_BYTES))
            if not part:
                raise ConnectionError("the client closed the connection mid-frame")
            pending += part

    def _blocking(self) -> None:
        if self._timed:
            self.sock.settimeout(None)
            self._timed = False


_CHUNK_BYTES: Final = 256 << 10


def send_all(sock: socket.socket, data: bytes, deadline: Deadline | None) -> None:
    if deadline is not None:
        sock.settimeout(deadline.remaining())
    sock.sendall(data)


def _read_exactly(sock: socket.socket, size: int, deadline: Deadline | None) -> bytes:
    if size == 0:
        return b""
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        if deadline is not None:
            sock.settimeout(deadline.remaining())
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("umbp server connection closed by the peer")
        received += count
    return bytes(buffer)
