"""`MooncakeStore`: the store contract over a Mooncake Store cluster (one master, a
client per process, each node contributing a memory segment).

What Mooncake gives and what this adapter adds (facts in docs/backends.md,
checked against `mooncake-transfer-engine-non-cuda==0.3.13.post1`):

* Zero-copy batched I/O from *registered* memory only (`batch_put_from_multi_buffers`,
  `batch_get_into_multi_buffers`). A caller buffer inside a range registered through
  `register_host_memory` goes straight to Mooncake; any other buffer is copied through one
  internal registered bounce buffer of `local_buffer_bytes`, allocated and prefaulted once.
  An object larger than the bounce buffer is registered for the duration of the call.
* No integrity check. Every stored object is the payload followed by an 8-byte trailer,
  the little-endian xxh3-64 of the payload. For a direct (zero-copy) object the trailer
  sits in a small registered area and travels as a second piece of the same object; a
  staged object has it right after the payload in the bounce buffer (one piece). Over TCP
  a second piece costs about one more transfer, which for 100 KiB objects between
  processes cost more than a copy, so registered payloads below `stage_below_bytes` are
  staged too. A load whose bytes do not hash to their trailer answers CORRUPT and removes
  the object (forced: a plain `remove` answers OBJECT_HAS_LEASE for 10 s after any read).
* Sizes: a wrong-sized buffer answers SIZE_MISMATCH and is not touched. A staged load
  lands in the bounce buffer, so the transfer's answer shows a wrong size harmlessly
  (BUFFER_OVERFLOW-style -600 when the object is longer, TRANSFER_FAIL -800 when it is
  shorter, told apart from a real transfer failure by asking the size). A direct load
  asks the stored sizes first (`batch_get_replica_desc`, one master round trip per batch),
  because a plain `batch_get_into` copies a shorter object into a longer buffer.
* A put of a key that exists answers 0 without overwriting: exactly the contract's "a
  resident key answers True without being rewritten".
* Failures come back as negative codes (OBJECT_NOT_FOUND -704, RPC_FAIL -900 when the
  master is gone, NO_AVAILABLE_HANDLE -200 when no segment has room, ...). Every code and
  every exception from the binding becomes a contract value: put False, a `LoadStatus`,
  or `StoreUnavailable` from `lookup`. After one failed round trip Mooncake spends ~4 s per
  call reconnecting, and `setup` against an absent master retries for ~90 s; so the
  constructor probes the master's port first, and calls fail at once while the client's
  `health_check` or a probe of the master's port says it is gone.
* Calling the binding after its `close()` crashes the process, so every call runs under
  one lock and checks the closed flag first: one batch at a time per store (the binding
  releases the GIL and parallelises a batch internally).

`stats()`: `capacity_bytes` is the segment this client contributes (0 for a pure client);
`used_bytes`, `objects` and `evictions` are 0 because placement and eviction belong to the
master and a client cannot observe them (the master's metrics endpoint reports them);
`puts` counts accepted puts, including puts of keys that were already resident (Mooncake
answers both with 0). `page_bytes` is 1: Mooncake allocates per object.

Cost (benchmarks/mooncake_bench.py, docs/multi-node.md): the checksum and, for direct
loads, the size query are what separates this adapter from raw Mooncake calls.
"""

from __future__ import annotations

import importlib
import logging
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import (
    LoadStatus,
    PoolStats,
    RegistersHostMemory,
    SchedulerStore,
    StoreUnavailable,
    WorkerStore,
)
from umbp.runtime.counters import StoreCounters
from umbp.runtime.host_memory import byte_views
from umbp.runtime.registered_memory import (
    HostArea,
    Piece,
    RegisteredRanges,
    checksum,
    plan_chunks,
    temporarily_registered,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_LOCAL_BUFFER_BYTES",
    "DEFAULT_SEGMENT_BYTES",
    "MooncakeSetupError",
    "MooncakeStore",
    "parse_address",
]

_log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 1 << 30
DEFAULT_LOCAL_BUFFER_BYTES = 64 << 20
DEFAULT_STAGE_BELOW_BYTES = 256 << 10
TRAILER_BYTES = 8
_TRAILER = struct.Struct("<Q")
_TRAILER_SLOTS = 4096  # keys per Mooncake call; larger batches are cut into chunks

# Mooncake error codes this adapter tells apart (mooncake-store's ErrorCode).
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_REPLICA_IS_NOT_READY = -703
_INVALID_PARAMS = -600  # what a get into a too-small buffer answers
_TRANSFER_FAIL = -800  # also what a multi-buffer get answers when the object is shorter
_RPC_FAIL = -900  # the master did not answer
_HEALTH_MASTER_UNREACHABLE = 2  # health_check(): 0 healthy, 1 closed, 2 master unreachable
_PROBE_TIMEOUT_S = 0.25


class MooncakeSetupError(StoreUnavailable):
    """The client could not join the cluster (master unreachable, setup refused,
    package missing). The message names the master address."""


# ------------------------------------------------------------------ the binding


class _MooncakeClient(Protocol):
    """The part of `mooncake.store.MooncakeDistributedStore` used here (no stubs ship)."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...
    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def remove(self, key: str, force: bool = ...) -> int: ...
    def remove_all(self, force: bool = ...) -> int: ...
    def health_check(self) -> int: ...
    def close(self) -> int: ...


def _new_client() -> _MooncakeClient:
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as error:
        raise MooncakeSetupError(
            "mode 'mooncake' needs the Mooncake client: pip install "
            "mooncake-transfer-engine (GPU machines) or mooncake-transfer-engine-non-cuda "
            f"(CPU machines), and libibverbs1 from apt ({error})"
        ) from error
    return cast(_MooncakeClient, module.MooncakeDistributedStore())


def parse_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" (IPv6 hosts in brackets)."""
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


class MooncakeStore(ClosesOnExit):
    """A Mooncake Store client that honours `WorkerStore`, `SchedulerStore` and
    `RegistersHostMemory` (see the module docstring for how each rule is met).

    `global_segment_bytes` is the memory this process contributes to the cluster (0: a pure
    client, which stores into other nodes' segments). `local_buffer_bytes` sizes the
    registered bounce buffer for payloads outside registered memory (0: none; such
    payloads are then registered per call). Payloads in registered memory smaller than
    `stage_below_bytes` are copied through the bounce buffer all the same: over TCP the
    trailer as a second piece costs about one more transfer per object, which for
    100 KiB objects between processes cost more than the copy (module docstring).
    Raises `MooncakeSetupError` when the master cannot be reached within
    `connect_timeout_s` or refuses the client.
    """

    def __init__(
        self,
        master_address: str,
        *,
        local_hostname: str,
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES,
        stage_below_bytes: int = DEFAULT_STAGE_BELOW_BYTES,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        for name, value in (
            ("global_segment_bytes", global_segment_bytes),
            ("local_buffer_bytes", local_buffer_bytes),
            ("stage_below_bytes", stage_below_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self._master_address = master_address
        self._segment_bytes = global_segment_bytes
        self._stage_below = stage_below_bytes
        self._lock = threading.Lock()
        self._closed = True  # until setup succeeds: close() must not touch the binding
        self._counters = StoreCounters()
        self._ranges = RegisteredRanges()
        self._master_suspect = False
        self._client = _new_client()
        _probe_master(master_address, connect_timeout_s)
        try:
            code = self._client.setup(
                local_hostname,
                metadata_server,
                global_segment_bytes,
                0,  # Mooncake's own buffer serves put()/get() of bytes, never used here
                protocol,
                device_name,
                master_address,
            )
        except Exception as error:
            raise MooncakeSetupError(
                f"Mooncake setup against master {master_address} raised: {error}"
            ) from error
        if code != 0:
            raise MooncakeSetupError(
                f"Mooncake setup against master {master_address} failed with code {code} "
                f"(local_hostname={local_hostname!r}, protocol={protocol!r}, "
                f"device_name={device_name!r}, metadata_server={metadata_server!r})"
            )
        self._closed = False
        try:
            self._trailers = self._registered_area(_TRAILER_SLOTS * TRAILER_BYTES)
            self._bounce = (
                self._registered_area(local_buffer_bytes) if local_buffer_bytes else None
            )
        except BaseException:
            self.close()
            raise

    @classmethod
    def lookup_only(
        cls,
        master_address: str,
        *,
        local_hostname: str,
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        connect_timeout_s: float = 5.0,
    ) -> MooncakeStore:
        """The scheduler's client: contributes no segment and holds no bounce buffer (it
        only asks `lookup`; puts and gets still work, registering buffers per call)."""
        return cls(
            master_address,
            local_hostname=local_hostname,
            protocol=protocol,
            device_name=device_name,
            metadata_server=metadata_server,
            global_segment_bytes=0,
            local_buffer_bytes=0,
            connect_timeout_s=connect_timeout_s,
        )

    # ----------------------------------------------------------------- the contract

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        """Residency from one `batch_is_exist`; StoreUnavailable when the store is closed,
        the master cannot be reached, or Mooncake answers an error for any key."""
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"MooncakeStore ({self._master_address}) is closed")
            if not keys:
                return ()
            if self._master_unreachable():
                raise StoreUnavailable(f"Mooncake master {self._master_address} is unreachable")
            try:
                codes = self._client.batch_is_exist(list(keys))
            except Exception as error:
                raise StoreUnavailable(
                    f"Mooncake lookup via master {self._master_address} raised: {error}"
                ) from error
            # count() and map(bool) run in C: this answer is on the scheduler's hot path.
            if len(codes) != len(keys) or codes.count(0) + codes.count(1) != len(codes):
                self._master_suspect = self._master_suspect or _RPC_FAIL in codes
                failed = sorted({code for code in codes if code < 0})
                raise StoreUnavailable(
                    f"Mooncake master {self._master_address} answered lookup with error "
                    f"codes {failed or 'of the wrong length'}"
                )
        return tuple(map(bool, codes))

    def put_batch(self, keys: Sequence[str], payloads: Sequence[Buffer]) -> tuple[bool, ...]:
        """Store each payload plus its checksum trailer; one result per key. ValueError for
        mismatched lengths or unusable buffers, before anything is stored."""
        views = byte_views(keys, payloads, writable=False)
        results = [False] * len(keys)
        with self._lock:
            if self._closed or (keys and self._master_unreachable()):
                self._counters.put_rejects += len(keys)
                return tuple(results)
            # Largest first: when the master cannot place an object it evicts others to
            # make room, which must not take this batch's smaller objects with it.
            chunks = sorted(self._plan(views), key=_largest_piece, reverse=True)
            for chunk in chunks:
                self._put_chunk(keys, chunk, results)
        return tuple(results)

    def get_batch_into(
        self, keys: Sequence[str], outs: Sequence[Buffer]
    ) -> tuple[LoadStatus, ...]:
        """Load each object into its writable buffer, checking its size and its checksum;
        one status per key. ValueError for mismatched lengths or unusable buffers, before
        anything is loaded.

        A staged object lands in the bounce buffer first, so a wrong size shows in the
        transfer's answer without the caller's buffer being touched. An object read
        straight into the caller's buffer needs its stored size beforehand (one master
        round trip for those keys), because Mooncake copies a shorter object into a longer
        buffer and reports success."""
        views = byte_views(keys, outs, writable=True)
        statuses = [LoadStatus.UNAVAILABLE] * len(keys)
        with self._lock:
            if self._closed or not keys or self._master_unreachable():
                return tuple(statuses)
            chunks = list(self._plan(views))
            direct = [
                (piece.index, piece.view)
                for chunk in chunks
                for piece in chunk
                if piece.staged is None
            ]
            decided = self._check_sizes(keys, direct, statuses)
            for chunk in chunks:
                pending = [piece for piece in chunk if piece.index not in decided]
                if pending:
                    self._get_chunk(keys, pending, statuses)
            self._counters.misses += statuses.count(LoadStatus.MISSING)
        return tuple(statuses)

    def stats(self) -> PoolStats:
        """Counters of this client (see the module docstring for what the sizes mean)."""
        with self._lock:
            return self._counters.snapshot(
                capacity_bytes=self._segment_bytes, used_bytes=0, page_bytes=1, objects=0
            )

    def clear(self) -> bool:
        """Remove every object in the whole cluster (forced: leases do not protect them);
        False when closed or when the master cannot be reached."""
        with self._lock:
            if self._closed or self._master_unreachable():
                return False
            try:
                code = self._client.remove_all(True)
                self._master_suspect = code == _RPC_FAIL
                return code >= 0
            except Exception:  # noqa: BLE001 - no binding error may reach the caller
                _log.warning("Mooncake remove_all raised", exc_info=True)
                return False

    def close(self) -> None:
        """Unmount this client's segment and release its buffers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for area in (getattr(self, "_bounce", None), getattr(self, "_trailers", None)):
                if area is not None:
                    self._quietly(self._client.unregister_buffer, area.address)
            for address in self._ranges.starts():
                self._quietly(self._client.unregister_buffer, address)
            self._quietly(self._client.close)
            for area in (getattr(self, "_bounce", None), getattr(self, "_trailers", None)):
                if area is not None:
                    area.release()

    # ------------------------------------------------------- RegistersHostMemory

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """Register [address, address + nbytes) with Mooncake; buffers inside it then move
        without a bounce copy. OSError when Mooncake refuses or the store is closed."""
        with self._lock:
            if self._closed:
                raise OSError(f"MooncakeStore ({self._master_address}) is closed")
            try:
                code = self._client.register_buffer(address, nbytes)
            except Exception as error:
                raise OSError(f"Mooncake register_buffer raised: {error}") from error
            if code != 0:
                raise OSError(
                    f"Mooncake refused to register {nbytes} bytes at {address:#x} "
                    f"(code {code})"
                )
            self._ranges.add(address, nbytes)

    def unregister_host_memory(self, address: int) -> None:
        """Forget a range registered at `address`; unknown addresses are ignored."""
        with self._lock:
            if self._ranges.remove(address) and not self._closed:
                self._quietly(self._client.unregister_buffer, address)

    # --------------------------------------------------------- for tests and tools

    @property
    def master_address(self) -> str:
        return self._master_address

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def raw_client(self) -> _MooncakeClient:
        """The binding itself, for fault injection and side-by-side benchmarks. Calling
        it after `close()` crashes the process."""
        return self._client

    # ------------------------------------------------------------------ internals

    def _plan(self, views: list[memoryview]) -> Iterator[list[Piece]]:
        return plan_chunks(
            views,
            self._ranges,
            self._bounce,
            _TRAILER_SLOTS,
            stage_below=self._stage_below,
            trailer_bytes=TRAILER_BYTES,
        )

    def _registered_area(self, nbytes: int) -> HostArea:
        area = HostArea(nbytes)
        code = self._client.register_buffer(area.address, nbytes)
        if code != 0:
            area.release()
            raise MooncakeSetupError(
                f"Mooncake (master {self._master_address}) refused to register "
                f"a {nbytes}-byte buffer (code {code})"
            )
        return area

    def _put_chunk(self, keys: Sequence[str], chunk: list[Piece], results: list[bool]) -> None:
        trailers = self._trailers
        for slot, piece in enumerate(chunk):
            nbytes = piece.view.nbytes
            if piece.staged is not None:
                payload = piece.staged[:nbytes]
                payload[:] = piece.view
                _TRAILER.pack_into(piece.staged, nbytes, checksum(payload))
            else:
                _TRAILER.pack_into(trailers.view, slot * TRAILER_BYTES, checksum(piece.view))
        codes = self._transfer(
            self._client.batch_put_from_multi_buffers, [keys[p.index] for p in chunk], chunk
        )
        for piece, code in zip(chunk, codes):
            accepted = code == 0 or code == _OBJECT_ALREADY_EXISTS
            results[piece.index] = accepted
            if accepted:
                self._counters.puts += 1
                self._counters.bytes_written += piece.view.nbytes
            else:
                self._counters.put_rejects += 1

    def _get_chunk(
        self, keys: Sequence[str], chunk: list[Piece], statuses: list[LoadStatus]
    ) -> None:
        chunk_keys = [keys[piece.index] for piece in chunk]
        codes = self._transfer(self._client.batch_get_into_multi_buffers, chunk_keys, chunk)
        trailers = self._trailers.view
        unclear: list[Piece] = []
        for slot, (key, piece, code) in enumerate(zip(chunk_keys, chunk, codes)):
            nbytes = piece.view.nbytes
            if code == nbytes + TRAILER_BYTES:
                if piece.staged is not None:  # verified while hot, copied only when good
                    delivered = piece.staged[:nbytes]
                    (expected,) = _TRAILER.unpack_from(piece.staged, nbytes)
                else:
                    delivered = piece.view
                    (expected,) = _TRAILER.unpack_from(trailers, slot * TRAILER_BYTES)
                if checksum(delivered) == expected:
                    if piece.staged is not None:
                        piece.view[:] = delivered
                    self._counters.hits += 1
                    self._counters.bytes_read += nbytes
                    statuses[piece.index] = LoadStatus.HIT
                else:
                    statuses[piece.index] = self._corrupt(key)
            elif code >= 0 and piece.staged is not None:  # a shorter object, in the bounce
                statuses[piece.index] = LoadStatus.SIZE_MISMATCH
            elif code >= 0:  # shorter than its descriptor said
                statuses[piece.index] = self._corrupt(key)
            elif code in (_OBJECT_NOT_FOUND, _REPLICA_IS_NOT_READY):
                statuses[piece.index] = LoadStatus.MISSING
            elif code == _INVALID_PARAMS:  # the stored object is larger than the buffer
                statuses[piece.index] = LoadStatus.SIZE_MISMATCH
            elif code == _TRANSFER_FAIL and piece.staged is not None:
                unclear.append(piece)
            else:
                statuses[piece.index] = LoadStatus.UNAVAILABLE
        if unclear:
            # A staged get skipped the size query; this code means either a shorter
            # object or a failed transfer, and only the stored size tells which.
            wanted = [(piece.index, piece.view) for piece in unclear]
            decided = self._check_sizes(keys, wanted, statuses)
            for index, _ in wanted:
                if index not in decided:
                    statuses[index] = LoadStatus.UNAVAILABLE

    def _transfer(self, call: Any, keys: list[str], chunk: list[Piece]) -> list[int]:
        """One multi-buffer call. A staged object is one piece (payload and trailer side
        by side in the bounce buffer); a direct one is two, the caller's buffer and the
        chunk's trailer slot. Temporary registrations wrap the call; an exception or a
        malformed answer reads as a failure code for every key."""
        trailer_base = self._trailers.address
        pointers: list[list[int]] = []
        sizes: list[list[int]] = []
        for slot, piece in enumerate(chunk):
            nbytes = piece.view.nbytes
            trailer = trailer_base + slot * TRAILER_BYTES
            if piece.staged is not None:
                pointers.append([piece.pointer])
                sizes.append([nbytes + TRAILER_BYTES])
            elif nbytes:
                pointers.append([piece.pointer, trailer])
                sizes.append([nbytes, TRAILER_BYTES])
            else:
                pointers.append([trailer])
                sizes.append([TRAILER_BYTES])
        failed = [-1] * len(chunk)
        try:
            with temporarily_registered(
                chunk,
                lambda address, nbytes: self._client.register_buffer(address, nbytes) == 0,
                lambda address: self._quietly(self._client.unregister_buffer, address),
            ) as registered:
                if not registered:
                    return failed
                codes = call(keys, pointers, sizes)
                if not isinstance(codes, list) or len(codes) != len(keys):
                    return failed
                if _RPC_FAIL in codes:
                    self._master_suspect = True
                return [int(code) for code in codes]
        except Exception:  # noqa: BLE001 - no binding error may reach the caller
            _log.warning("Mooncake batch call raised", exc_info=True)
            return failed

    def _check_sizes(
        self,
        keys: Sequence[str],
        wanted: list[tuple[int, memoryview]],
        statuses: list[LoadStatus],
    ) -> set[int]:
        """Settle the (batch index, buffer) pairs whose stored size rules a load out
        (missing, wrong size, unreachable master); returns the indices settled."""
        if not wanted:
            return set()
        sizes = self._stored_sizes([keys[index] for index, _ in wanted])
        if sizes is None:
            return {index for index, _ in wanted}  # UNAVAILABLE stays
        decided: set[int] = set()
        for (index, view), stored in zip(wanted, sizes):
            if stored is None:
                statuses[index] = LoadStatus.MISSING
            elif stored < TRAILER_BYTES:  # not written by this adapter: unverifiable
                statuses[index] = self._corrupt(keys[index])
            elif stored - TRAILER_BYTES != view.nbytes:
                statuses[index] = LoadStatus.SIZE_MISMATCH
            else:
                continue
            decided.add(index)
        return decided

    def _stored_sizes(self, keys: Sequence[str]) -> list[int | None] | None:
        """Stored size of each key (None: not resident), or None for the whole batch when
        the master cannot be reached. A key without a complete replica counts as missing;
        keys absent from the descriptors are confirmed with `batch_is_exist`, because an
        unreachable master also yields an empty answer."""
        try:
            descriptors = self._client.batch_get_replica_desc(list(keys))
            sizes = [_complete_memory_size(descriptors.get(key, ())) for key in keys]
            absent = [key for key, size in zip(keys, sizes) if size is None]
            codes = self._client.batch_is_exist(absent) if absent else []
        except Exception:  # noqa: BLE001 - no binding error may reach the caller
            _log.warning("Mooncake size query raised", exc_info=True)
            return None
        if len(codes) != len(absent) or any(code < 0 for code in codes):
            self._master_suspect = True
            return None
        return sizes

    def _master_unreachable(self) -> bool:
        """True when the master is known to be gone, so that calls fail at once: after a
        failed round trip Mooncake spends ~4 s per call reconnecting, until its own
        heartbeat notices (`health_check`). While in doubt, a TCP probe of the master's
        port decides; once it answers, calls go through again."""
        try:
            if self._client.health_check() == _HEALTH_MASTER_UNREACHABLE:
                return True
        except Exception:  # noqa: BLE001 - no binding error may reach the caller
            return True
        if not self._master_suspect:
            return False
        try:
            _probe_master(self._master_address, _PROBE_TIMEOUT_S)
        except MooncakeSetupError:
            return True
        self._master_suspect = False
        return False

    def _corrupt(self, key: str) -> LoadStatus:
        """Drop an object that failed verification (forced past any read lease)."""
        self._counters.corrupt_loads += 1
        self._quietly(self._client.remove, key, True)
        return LoadStatus.CORRUPT

    @staticmethod
    def _quietly(call: Any, *arguments: object) -> None:
        try:
            call(*arguments)
        except Exception:  # noqa: BLE001 - cleanup must go on; the failure is logged
            _log.warning("Mooncake %s raised", getattr(call, "__name__", call), exc_info=True)


def _complete_memory_size(replicas: Any) -> int | None:
    """Size of the first complete in-memory replica, None when there is none. Each
    attribute is a pybind11 call (~1 us), so the usual single replica is read with as few
    as possible."""
    for replica in replicas:
        if replica.status.name == "COMPLETE" and replica.is_memory_replica():
            return int(replica.get_memory_descriptor().buffer_descriptor.size)
    return None


def _probe_master(master_address: str, timeout_s: float) -> None:
    """Fail in `timeout_s` rather than in Mooncake's ~90 s of setup retries."""
    host, port = parse_address(master_address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise MooncakeSetupError(
            f"cannot reach the Mooncake master at {master_address}: {error} "
            "(is mooncake_master running there, and is that address right?)"
        ) from error


if TYPE_CHECKING:

    def _mooncake_store_honours_the_contract(
        store: MooncakeStore,
    ) -> tuple[SchedulerStore, WorkerStore, RegistersHostMemory]:
        """Never called: makes mypy prove that MooncakeStore satisfies the protocols."""
        return store, store, store


def _largest_piece(chunk: list[Piece]) -> int:
    return max(piece.view.nbytes for piece in chunk)
