"""Answer lookups for a store that lives in another process.

In embedded mode each worker owns the pool holding its rank's shards. When the
scheduler runs in a different process (several workers, or an executor that
spawns them) it asks each worker's pool over a Unix socket (abstract namespace,
same user only). Only existence answers cross the socket, never KV bytes.

Wire format (little-endian): request = op (1 byte: ``L`` lookup, ``H`` lookup by
hash, ``C`` clear) + payload length (u32) + payload; the answer to a lookup is one
byte per key (0/1), to a clear one byte. A lookup's payload is its keys joined by
newlines (UTF-8). A lookup by hash (a ``HashRuns``, so the scheduler builds no key
string) is a JSON header's length (u32), the header (``tags``, ``prefixes``,
per-segment ``hash_bytes``: every hash of a segment has that length) and every
segment's hashes back to back. A payload that does not decode closes the
connection unanswered (the client raises ``StoreUnavailable``: a miss).
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import struct
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence

from umbp.core.rank_keys import HashRuns, RankedKeys, merge_rank_answers
from umbp.runtime.contract import HashLookup, SchedulerStore, StoreUnavailable

_HEADER = struct.Struct("<cI")
_LENGTH = struct.Struct("<I")
_LOOKUP = b"L"
_LOOKUP_HASHES = b"H"
_CLEAR = b"C"
_PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            raise ConnectionError("peer closed the lookup connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class _Handler(socketserver.BaseRequestHandler):
    server: _LookupServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        if peer_uid(sock) != os.getuid():
            return  # another user: closed unanswered
        try:
            while True:
                op, length = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
                payload = _read_exactly(sock, length)
                sock.sendall(self._answer(op, payload))
        except (ConnectionError, OSError):
            return

    def _answer(self, op: bytes, payload: bytes) -> bytes:
        store = self.server.store
        if op == _LOOKUP:
            keys = payload.decode().split("\n") if payload else []
            return bytes(store.lookup(keys))
        if op == _LOOKUP_HASHES:
            return bytes(self.server.ask_by_hash(decode_hash_runs(payload)))
        if op == _CLEAR:
            return b"\x01" if store.clear() else b"\x00"
        raise ConnectionError(f"unknown lookup op {op!r}")


class _LookupServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, store: SchedulerStore) -> None:
        self.store = store
        self.ask_by_hash = _asker(store)
        super().__init__(path, _Handler)


class LookupService:
    """Serves ``lookup`` and ``clear`` of a local store to processes of the same user.

    The socket lives in Linux's abstract namespace (its address starts with a NUL
    byte): it has no file, so nothing is left behind however the owner ends. vLLM
    SIGKILLs its worker processes at shutdown, so a socket file would outlive every
    engine. Without file permissions, the handler admits only peers whose user id
    (``SO_PEERCRED``) is this process's, as a 0600 socket file would."""

    def __init__(self, store: SchedulerStore) -> None:
        self.path = f"\0umbp-lookup-{os.getpid()}-{uuid.uuid4().hex}"
        self._server = _LookupServer(self.path, store)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="umbp-lookup-service", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    _pid, uid, _gid = _PEER_CREDENTIALS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
    )
    return int(uid)


def encode_hash_runs(runs: HashRuns) -> bytes | None:
    """The ``H`` payload of ``runs`` (see the module docstring); None when a segment's
    hashes differ in length (then the keys go as strings)."""
    lengths = []
    for hashes in runs.hashes:
        sizes = set(map(len, hashes))
        if len(sizes) > 1:
            return None
        lengths.append(sizes.pop() if sizes else 0)
    header = json.dumps({
        "tags": runs.rank_tags, "prefixes": runs.prefixes,
        "counts": runs.layout.segment_sizes, "hash_bytes": lengths,
    }).encode()
    return b"".join([_LENGTH.pack(len(header)), header, *map(b"".join, runs.hashes)])


def decode_hash_runs(payload: bytes) -> HashRuns:
    """The ``HashRuns`` an ``H`` payload holds; ConnectionError for one that does not
    decode, so nothing malformed reaches the store."""
    try:
        (size,) = _LENGTH.unpack_from(payload)
        header = json.loads(payload[_LENGTH.size : _LENGTH.size + size])
        tags = tuple(str(tag) for tag in header["tags"])
        prefixes = tuple(tuple(str(p) for p in segment) for segment in header["prefixes"])
        counts = [int(count) for count in header["counts"]]
        lengths = [int(length) for length in header["hash_bytes"]]
        body = payload[_LENGTH.size + size :]
        if len(counts) != len(lengths) or any(n < 0 or n and m < 0 for n, m in zip(counts, lengths)):
            raise ValueError(f"segment counts {counts} and hash lengths {lengths}")
        if sum(n * m for n, m in zip(counts, lengths)) != len(body):
            raise ValueError(f"{len(body)} hash bytes for {counts} hashes of {lengths} bytes")
        hashes: list[tuple[bytes, ...]] = []
        offset = 0
        for count, length in zip(counts, lengths):
            end = offset + count * length
            hashes.append(tuple([body[at : at + length] for at in range(offset, end, length)])
                          if length else (b"",) * count)
            offset = end
        return HashRuns.of_segments(tags, prefixes, tuple(hashes))
    except (ValueError, KeyError, TypeError, struct.error) as error:
        raise ConnectionError(f"undecodable lookup by hash: {error}") from None


class LookupClient:
    """A ``SchedulerStore`` that asks a ``LookupService`` in another process; a lookup
    by hash (``HashLookup``) sends the prefixes and raw hashes, no key string."""

    batch_limit: int | None = None
    """None: one request frames up to 4 GiB of keys (a u32 length), some 39 million of
    umbp's keys; no batch a scheduler builds comes near it."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self._path = path
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        if not keys:
            return ()
        answer = self._call(_LOOKUP, "\n".join(keys).encode(), len(keys))
        return tuple(byte == 1 for byte in answer)

    def lookup_hashes(self, runs: HashRuns) -> tuple[bool, ...]:
        if not runs.key_count:
            return ()
        payload = encode_hash_runs(runs)
        if payload is None:
            return self.lookup(runs.key_strings())
        answer = self._call(_LOOKUP_HASHES, payload, runs.key_count)
        return tuple(byte == 1 for byte in answer)

    def clear(self) -> bool:
        return self._call(_CLEAR, b"", 1) == b"\x01"

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    def _call(self, op: bytes, payload: bytes, answer_size: int) -> bytes:
        with self._lock:
            try:
                sock = self._connected()
                sock.sendall(_HEADER.pack(op, len(payload)) + payload)
                return _read_exactly(sock, answer_size)
            except OSError as error:
                self._disconnect()
                raise StoreUnavailable(f"lookup service {self._path}: {error}") from error

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            sock.connect(self._path)
            self._sock = sock
        return self._sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class RankedLookup:
    """One ``SchedulerStore`` over per-rank stores: each key is asked of the store
    of its rank, and a rank nobody serves holds nothing.

    Keys built by core (:class:`~umbp.core.rank_keys.RankedKeys`: a lookup query's,
    a store pass's residency check, a KV-event check) carry their layout, so each
    rank's keys are sliced out by position and the answers put back the same way;
    no key is ever parsed to find its rank. With several ranks, plain key strings
    are refused (a TypeError): every caller in umbp hands over core's keys.

    A lookup query asked by hash (:meth:`lookup_hashes`, core's
    :class:`~umbp.core.rank_keys.HashRuns`) is routed the same way: each rank's runs
    go to its store by hash, or as that rank's key strings to a store that only
    reads strings.
    """

    batch_limit: int | None = None
    """No limit of its own: each rank's store takes the batch as its contract says."""

    def __init__(self, stores: Mapping[str, SchedulerStore]) -> None:
        """``stores`` maps a rank tag (a key up to its ``:pp<r>`` field, as
        :func:`umbp.core.rank_keys.rank_tags` names ranks) to its store."""
        self._stores = dict(stores)
        # Per rank, how its store is asked a HashRuns (decided once: an isinstance
        # check of a Protocol costs microseconds, a TP1 lookup by hash tens of them).
        self._by_hash: dict[str, Callable[[HashRuns], tuple[bool, ...]]] = {
            tag: _asker(store) for tag, store in self._stores.items()
        }

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        if isinstance(keys, RankedKeys):
            return self._lookup_by_position(keys)
        if len(self._stores) == 1:
            return next(iter(self._stores.values())).lookup(keys)
        raise TypeError(
            f"RankedLookup over {len(self._stores)} ranks routes keys by position: pass "
            "umbp.core.rank_keys.RankedKeys (a lookup query's or a residency check's "
            "keys), not plain key strings"
        )

    def _lookup_by_position(self, keys: RankedKeys) -> tuple[bool, ...]:
        stores = [self._stores.get(tag) for tag in keys.rank_tags]
        if len(stores) == 1 and stores[0] is not None:
            return stores[0].lookup(keys)
        return merge_rank_answers(keys.layout, [
            None if store is None else store.lookup(keys.keys_of_rank(rank))
            for rank, store in enumerate(stores)
        ])

    def lookup_hashes(self, runs: HashRuns) -> tuple[bool, ...]:
        askers = [self._by_hash.get(tag) for tag in runs.rank_tags]
        if len(askers) == 1 and askers[0] is not None:
            return askers[0](runs)
        return merge_rank_answers(runs.layout, [
            None if ask is None else ask(runs.of_rank(rank))
            for rank, ask in enumerate(askers)
        ])

    def clear(self) -> bool:
        return all([store.clear() for store in self._stores.values()])  # noqa: C419 (clear every store)

    def close(self) -> None:
        for store in self._stores.values():
            store.close()


def _asker(store: SchedulerStore) -> Callable[[HashRuns], tuple[bool, ...]]:
    """How one store is asked a ``HashRuns``: by hash where it answers so, else as
    its key strings."""
    if isinstance(store, HashLookup):
        return store.lookup_hashes

    def by_strings(runs: HashRuns) -> tuple[bool, ...]:
        return store.lookup(runs.key_strings())

    return by_strings
