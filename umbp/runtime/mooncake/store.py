"""`MooncakeStore`: the store contract over a Mooncake Store cluster (one master, a
client per process, each node contributing a memory segment).

What Mooncake gives and what this adapter adds (facts in docs/backends.md,
checked against `mooncake-transfer-engine-non-cuda==0.3.13.post1`):

* Zero-copy batched I/O from *registered* memory only (`batch_put_from_multi_buffers`,
  `batch_get_into_multi_buffers`). A caller buffer inside a range registered through
  `register_host_memory` goes straight to Mooncake; any other buffer is copied through one
  internal registered bounce buffer of `local_buffer_bytes`, allocated and prefaulted once.
  An object larger than the bounce buffer is registered for the duration of the call.
* No integrity check: every object travels with an xxh3-64 trailer, verified on every
  load, and a wrong-sized buffer answers SIZE_MISMATCH untouched (`umbp.runtime.mooncake.transfer`).
  The worker's copies into and out of its staging rows hash as they move, so its puts
  give the trailers (`put_batch_checksummed`) and its loads check them against the copy
  out (`get_batch_unchecked`): then umbp reads no byte a second time.
  Over TCP a trailer as a second piece costs about one more transfer, which for 100 KiB
  objects between processes cost more than a copy, so registered payloads below
  `stage_below_bytes` are staged too.
* A put of a key that exists answers 0 without overwriting: exactly the contract's "a
  resident key answers True without being rewritten".
* Every code and every exception from the binding becomes a contract value: put False,
  a `LoadStatus`, or `StoreUnavailable` from `lookup`; calls fail at once while the
  master is known to be gone (`umbp.runtime.mooncake.binding`).
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

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import (
    ChecksumsFromCopy,
    LoadStatus,
    PoolStats,
    RegistersHostMemory,
    SchedulerStore,
    StoreUnavailable,
    UncheckedObjects,
    WorkerStore,
)
from umbp.runtime.counters import PoolCounters
from umbp.runtime.host_memory import byte_views
from umbp.runtime.mooncake.binding import (
    RPC_FAIL,
    MasterHealth,
    MooncakeClient,
    MooncakeSetupError,
    new_client,
    parse_address,
    probe_master,
    quietly,
)
from umbp.runtime.mooncake.operations import namespace_key_pattern
from umbp.runtime.mooncake.transfer import TRAILER_BYTES, TRAILER_SLOTS, TrailerTransfers
from umbp.runtime.paged_copy import hashed_per_key
from umbp.runtime.registered_memory import HostArea, Piece, RegisteredRanges, plan_chunks

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


class MooncakeStore(ClosesOnExit):
    """A Mooncake Store client that honours `WorkerStore`, `SchedulerStore`,
    `RegistersHostMemory` and `ChecksumsFromCopy` (see the module docstring for how each
    rule is met).

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

    batch_limit: int | None = None
    """None: Mooncake states no per-call limit (a 1,000,000-key `batch_is_exist` is one
    call, docs/backends.md); puts and gets go in calls of `TRAILER_SLOTS` objects, the
    slots of the registered trailer area."""

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
        self._counters = PoolCounters()
        self._ranges = RegisteredRanges()
        self._client = new_client()
        self._health = MasterHealth(self._client, master_address)
        probe_master(master_address, connect_timeout_s)
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
            self._trailers = self._registered_area(TRAILER_SLOTS * TRAILER_BYTES)
            self._transfers = TrailerTransfers(
                self._client, self._trailers, self._counters, self._health
            )
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
            if self._health.unreachable():
                raise StoreUnavailable(f"Mooncake master {self._master_address} is unreachable")
            try:
                codes = self._client.batch_is_exist(list(keys))
            except Exception as error:
                raise StoreUnavailable(
                    f"Mooncake lookup via master {self._master_address} raised: {error}"
                ) from error
            # count() and map(bool) run in C: this answer is on the scheduler's hot path.
            if len(codes) != len(keys) or codes.count(0) + codes.count(1) != len(codes):
                self._health.suspect = self._health.suspect or RPC_FAIL in codes
                failed = sorted({code for code in codes if code < 0})
                raise StoreUnavailable(
                    f"Mooncake master {self._master_address} answered lookup with error "
                    f"codes {failed or 'of the wrong length'}"
                )
        return tuple(map(bool, codes))

    def put_batch(self, keys: Sequence[str], payloads: Sequence[Buffer]) -> tuple[bool, ...]:
        """Store each payload plus its checksum trailer; one result per key. ValueError for
        mismatched lengths or unusable buffers, before anything is stored."""
        return self._put(keys, payloads, None)

    def _put(
        self, keys: Sequence[str], payloads: Sequence[Buffer], checksums: Sequence[int] | None
    ) -> tuple[bool, ...]:
        views = byte_views(keys, payloads, writable=False)
        results = [False] * len(keys)
        with self._lock:
            if self._closed or (keys and self._health.unreachable()):
                self._counters.put_rejects += len(keys)
                return tuple(results)
            # Largest first: when the master cannot place an object it evicts others to
            # make room, which must not take this batch's smaller objects with it.
            chunks = sorted(self._plan(views), key=_largest_piece, reverse=True)
            for chunk in chunks:
                self._transfers.put_chunk(keys, chunk, results, checksums)
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
        return tuple(self._get(keys, byte_views(keys, outs, writable=True), None))

    def _get(
        self, keys: Sequence[str], views: list[memoryview], stored: list[int | None] | None
    ) -> list[LoadStatus]:
        statuses = [LoadStatus.UNAVAILABLE] * len(keys)
        with self._lock:
            if self._closed or not keys or self._health.unreachable():
                return statuses
            chunks = list(self._plan(views))
            direct = [
                (piece.index, piece.view)
                for chunk in chunks
                for piece in chunk
                if piece.staged is None
            ]
            decided = self._transfers.check_sizes(keys, direct, statuses)
            for chunk in chunks:
                pending = [piece for piece in chunk if piece.index not in decided]
                if pending:
                    self._transfers.get_chunk(keys, pending, statuses, stored)
            self._counters.misses += statuses.count(LoadStatus.MISSING)
        return statuses

    # ------------------------------------------------------------ ChecksumsFromCopy

    def put_batch_checksummed(
        self, keys: Sequence[str], payloads: Sequence[Buffer], checksums: Sequence[int]
    ) -> tuple[bool, ...]:
        """`put_batch` with each payload's xxh3-64 given (the caller's copy into it hashed
        it): the trailers are written, the payloads not read again."""
        if len(checksums) != len(keys):
            raise ValueError(f"put_batch_checksummed needs one checksum per key: "
                             f"{len(keys)} keys, {len(checksums)} checksums")
        return self._put(keys, payloads, checksums)

    def get_batch_unchecked(
        self, keys: Sequence[str], outs: Sequence[Buffer]
    ) -> UncheckedObjects:
        """`get_batch_into` without hashing what arrived: each arrived object's trailer
        is kept for ``verify``, which compares it with the checksum the caller's copy
        out of the buffer computed (a mismatch drops the object, as a failed check in
        `get_batch_into` does)."""
        views = byte_views(keys, outs, writable=True)
        stored: list[int | None] = [None] * len(keys)
        arrived = self._get(keys, views, stored)
        nbytes = [view.nbytes for view in views]
        settled = False

        def verify(copied: Sequence[int | None] | None = None) -> tuple[LoadStatus, ...]:
            nonlocal settled
            given = hashed_per_key(copied, len(keys), "verify")
            with self._lock:
                if settled:
                    raise RuntimeError("an unchecked load is verified once")
                settled = True
                if self._closed:  # nothing may be dropped now; the bytes stay unverified
                    return tuple(LoadStatus.UNAVAILABLE if status is LoadStatus.HIT
                                 else status for status in arrived)
                return self._transfers.settle_unchecked(keys, nbytes, arrived, stored, given)

        return UncheckedObjects(tuple(arrived), verify)

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
            if self._closed or self._health.unreachable():
                return False
            try:
                code = self._client.remove_all(True)
                self._health.suspect = code == RPC_FAIL
                return code >= 0
            except Exception:  # noqa: BLE001 - no binding error may reach the caller
                _log.warning("Mooncake remove_all raised", exc_info=True)
                return False

    def drop(self, namespace: str | None) -> int:
        """Remove a namespace's objects (every object for None) from the whole cluster,
        except those Mooncake holds a lease on (read in the last seconds: in use); how
        many were removed. Raises `StoreUnavailable` when the master refuses or is gone."""
        with self._lock:
            if self._closed or self._health.unreachable():
                raise StoreUnavailable(f"Mooncake master {self._master_address} unreachable")
            try:
                code = (self._client.remove_all(False) if namespace is None else
                        self._client.remove_by_regex(namespace_key_pattern(namespace), False))
            except Exception as error:
                raise StoreUnavailable(f"Mooncake remove raised: {error}") from error
            if code < 0:
                self._health.suspect = code == RPC_FAIL
                raise StoreUnavailable(f"Mooncake master {self._master_address} answered "
                                       f"the removal with error code {code}")
            return code

    def close(self) -> None:
        """Unmount this client's segment and release its buffers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for area in (getattr(self, "_bounce", None), getattr(self, "_trailers", None)):
                if area is not None:
                    quietly(self._client.unregister_buffer, area.address)
            for address in self._ranges.starts():
                quietly(self._client.unregister_buffer, address)
            quietly(self._client.close)
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
                quietly(self._client.unregister_buffer, address)

    # --------------------------------------------------------- for tests and tools

    @property
    def master_address(self) -> str:
        return self._master_address

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def raw_client(self) -> MooncakeClient:
        """The binding itself, for fault injection and side-by-side benchmarks. Calling
        it after `close()` crashes the process."""
        return self._client

    # ------------------------------------------------------------------ internals

    def _plan(self, views: list[memoryview]) -> Iterator[list[Piece]]:
        return plan_chunks(
            views,
            self._ranges,
            self._bounce,
            TRAILER_SLOTS,
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


if TYPE_CHECKING:

    def _mooncake_store_honours_the_contract(
        store: MooncakeStore,
    ) -> tuple[SchedulerStore, WorkerStore, RegistersHostMemory, ChecksumsFromCopy]:
        """Never called: makes mypy prove that MooncakeStore satisfies the protocols."""
        return store, store, store, store


def _largest_piece(chunk: list[Piece]) -> int:
    return max(piece.view.nbytes for piece in chunk)
