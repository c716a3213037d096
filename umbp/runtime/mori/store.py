"""`MoriStore`: the store contract over MORI UMBP's `mori.umbp.UMBPClient`, in its
embedded, standalone (node-local server) and distributed deployments.

MORI ships only for ROCm (docs/backends.md), so this adapter is exercised here against
`umbp.testing.fake_mori`, a fake of the documented API; pass `module=` to choose the
module (the fake in tests), else `mori.umbp` is imported on construction. Creating,
registering with and releasing a client: `umbp.runtime.mori.binding`.

How the contract is met with the documented API (batch calls answer `list[bool]`):

* Zero copy: buffers inside ranges registered with `register_host_memory` go straight to
  `batch_put_from_ptr` / `batch_get_into_ptr`; others go through one registered bounce
  buffer, allocated once (larger objects are registered for the duration of the call).
* Integrity and sizes: MORI keeps neither a checksum nor a size query, and has no call to
  put one object from two buffers, so each object has a 16-byte sidecar object under
  `key + META_SUFFIX`: the xxh3-64 of the payload and its length. Payload and sidecar go
  in one `batch_put_from_ptr`; a put answers True only if both were stored. A get reads
  the sidecars first (one batch), answers SIZE_MISMATCH or MISSING before touching the
  caller's buffer, then reads payloads and verifies them.
* No remove call is documented, so a corrupt object cannot be deleted: the adapter
  remembers it and answers MISSING / not-resident for it from then on, until a later put of
  that key is accepted. Other clients detect the corruption on their own, by checksum.
* A sidecar may be evicted apart from its payload (the store evicts objects, not pairs):
  a load then answers MISSING though `lookup` said resident, as any eviction race does.
* Known defects (docs/backends.md, `umbp.runtime.mori.binding`): in 1.2.4 every put after `clear()`
  fails, so on that version `clear()` replaces the client by a fresh one (re-registering
  memory); nightly builds have no `close()`, so the client is then left to its destructor.
* Failures: a MORI call that raises (a stopped server, a transport error) becomes a
  contract value: put False, `LoadStatus.UNAVAILABLE`, `StoreUnavailable` from `lookup`,
  `clear()` False.

`stats()`: `capacity_bytes` is the configured DRAM capacity; `used_bytes`, `objects` and
`evictions` are 0 because the API reports none of them; `page_bytes` is 1.
"""

from __future__ import annotations

import logging
import struct
import threading
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import (
    LoadStatus,
    PoolStats,
    RegistersHostMemory,
    SchedulerStore,
    StoreUnavailable,
    WorkerStore,
)
from umbp.runtime.counters import PoolCounters
from umbp.runtime.host_memory import byte_views
from umbp.runtime.mori.binding import (
    DEPLOYMENTS,
    MoriSetupError,
    clear_breaks_puts,
    import_mori,
    new_client,
    quietly,
    register_memory,
    release_client,
    where,
)
from umbp.runtime.paged_copy import copy_hashing
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

__all__ = ["META_SUFFIX", "MoriStore"]

_log = logging.getLogger(__name__)

META_SUFFIX = "#umbp.meta"
DEFAULT_CAPACITY_BYTES = 1 << 30
DEFAULT_STAGING_BYTES = 64 << 20
_META = struct.Struct("<QQ")  # xxh3-64 of the payload, payload length
_META_SLOTS = 4096  # keys per MORI call; larger batches are cut into chunks


class MoriStore(ClosesOnExit):
    """A MORI UMBP client honouring `WorkerStore`, `SchedulerStore` and
    `RegistersHostMemory` (see the module docstring for how).

    `deployment`: "embedded" (a pool inside this process), "standalone" (a node-local
    `umbp_standalone_server`, `address` like "unix:///run/umbp.sock") or "distributed"
    (`address` is the `umbp_master` to join). `capacity_bytes` sizes the DRAM tier of an
    embedded pool (and is passed on for the others). `auto_start` lets a standalone client
    start the server when none answers (MORI's `standalone_process.auto_start`).
    `staging_bytes` sizes the registered bounce buffer. Raises `MoriSetupError` when MORI
    is missing or refuses the configuration, naming the address.
    """

    batch_limit: int | None = None
    """None: MORI's API states no per-call limit; puts and gets go in calls of
    `_META_SLOTS` objects, the slots of the registered sidecar area."""

    def __init__(
        self,
        deployment: str = "embedded",
        address: str | None = None,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        auto_start: bool = False,
        module: types.ModuleType | None = None,
    ) -> None:
        if deployment not in DEPLOYMENTS:
            raise ValueError(f"deployment must be one of {DEPLOYMENTS}, got {deployment!r}")
        if deployment != "embedded" and not address:
            raise ValueError(f"deployment {deployment!r} needs an address")
        if capacity_bytes <= 0 or staging_bytes < 0:
            raise ValueError("capacity_bytes must be positive and staging_bytes non-negative")
        self._deployment = deployment
        self._address = address or ""
        self._capacity = capacity_bytes
        self._auto_start = auto_start
        self._lock = threading.Lock()
        self._closed = True
        self._counters = PoolCounters()
        self._ranges = RegisteredRanges()
        self._dropped: set[str] = set()
        self._umbp = module if module is not None else import_mori()
        self._clear_breaks_puts = clear_breaks_puts(self._umbp)
        self._client = self._new_client()
        self._closed = False
        self._meta = HostArea(_META_SLOTS * _META.size)
        self._bounce = HostArea(staging_bytes) if staging_bytes else None
        try:
            self._register(self._meta.address, self._meta.nbytes)
            if self._bounce is not None:
                self._register(self._bounce.address, self._bounce.nbytes)
        except OSError as error:
            self.close()
            raise MoriSetupError(f"MORI refused to register staging memory: {error}") from error

    # ----------------------------------------------------------------- the contract

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"MoriStore ({self._where()}) is closed")
            if not keys:
                return ()
            try:
                answers = list(self._client.batch_exists(list(keys)))
            except Exception as error:
                raise StoreUnavailable(f"MORI ({self._where()}) lookup failed: {error}") from error
            if len(answers) != len(keys):
                raise StoreUnavailable(f"MORI ({self._where()}) answered the wrong length")
            dropped = self._dropped
            return tuple(
                [bool(present) and key not in dropped for key, present in zip(keys, answers)]
            )

    def put_batch(self, keys: Sequence[str], payloads: Sequence[Buffer]) -> tuple[bool, ...]:
        views = byte_views(keys, payloads, writable=False)
        results = [False] * len(keys)
        with self._lock:
            if self._closed:
                self._counters.put_rejects += len(keys)
                return tuple(results)
            for chunk in plan_chunks(views, self._ranges, self._bounce, _META_SLOTS):
                self._put_chunk(keys, chunk, results)
        return tuple(results)

    def get_batch_into(
        self, keys: Sequence[str], outs: Sequence[Buffer]
    ) -> tuple[LoadStatus, ...]:
        views = byte_views(keys, outs, writable=True)
        statuses = [LoadStatus.UNAVAILABLE] * len(keys)
        with self._lock:
            if self._closed:
                return tuple(statuses)
            for start in range(0, len(keys), _META_SLOTS):
                indices = range(start, min(start + _META_SLOTS, len(keys)))
                self._get_slice(keys, views, indices, statuses)
            self._counters.misses += statuses.count(LoadStatus.MISSING)
        return tuple(statuses)

    def stats(self) -> PoolStats:
        with self._lock:
            return self._counters.snapshot(
                capacity_bytes=self._capacity, used_bytes=0, page_bytes=1, objects=0
            )

    def clear(self) -> bool:
        """Drop every object (of the whole pool, for the shared deployments)."""
        with self._lock:
            if self._closed:
                return False
            try:
                self._client.clear()
            except Exception:  # noqa: BLE001 - no MORI error may reach the caller
                _log.warning("MORI clear() raised", exc_info=True)
                return False
            self._dropped.clear()
            if self._clear_breaks_puts:
                return self._replace_client()
            return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._release_client(self._client)
            for area in (getattr(self, "_meta", None), getattr(self, "_bounce", None)):
                if area is not None:
                    area.release()

    # ------------------------------------------------------- RegistersHostMemory

    def register_host_memory(self, address: int, nbytes: int) -> None:
        with self._lock:
            if self._closed:
                raise OSError(f"MoriStore ({self._where()}) is closed")
            self._register(address, nbytes)
            self._ranges.add(address, nbytes)

    def unregister_host_memory(self, address: int) -> None:
        with self._lock:
            if self._ranges.remove(address) and not self._closed:
                quietly(self._client.deregister_memory, address)

    # --------------------------------------------------------- for tests and tools

    @property
    def deployment(self) -> str:
        return self._deployment

    @property
    def raw_client(self) -> Any:
        """The `UMBPClient` itself (fault injection, benchmarks)."""
        return self._client

    # ------------------------------------------------------------------ internals

    def _where(self) -> str:
        return where(self._deployment, self._address)

    def _new_client(self) -> Any:
        return new_client(
            self._umbp, self._deployment, self._address, self._capacity, self._auto_start
        )

    def _register(self, address: int, nbytes: int) -> None:
        register_memory(self._client, address, nbytes)

    def _replace_client(self) -> bool:
        """The 1.2.4 workaround: after clear(), only a new client accepts puts."""
        self._release_client(self._client)
        try:
            self._client = self._new_client()
            for area in (self._meta, self._bounce):
                if area is not None:
                    self._client.register_memory(area.address, area.nbytes)
            for start, end in self._ranges.spans():
                self._client.register_memory(start, end - start)
        except Exception:  # noqa: BLE001 - no MORI error may reach the caller
            _log.warning("MORI client could not be replaced after clear()", exc_info=True)
            self._closed = True
            return False
        return True

    def _release_client(self, client: Any) -> None:
        areas = (getattr(self, "_meta", None), getattr(self, "_bounce", None))
        staging = [area.address for area in areas if area is not None]
        release_client(client, [*staging, *self._ranges.starts()])

    def _put_chunk(self, keys: Sequence[str], chunk: list[Piece], results: list[bool]) -> None:
        meta = self._meta
        for slot, piece in enumerate(chunk):
            digest = (checksum(piece.view) if piece.staged is None
                      else copy_hashing(piece.staged, piece.view))  # hashed as it is staged
            _META.pack_into(meta.view, slot * _META.size, digest, piece.view.nbytes)
        payload_keys = [keys[piece.index] for piece in chunk]
        names = payload_keys + [key + META_SUFFIX for key in payload_keys]
        pointers = [piece.pointer for piece in chunk] + [
            meta.address + slot * _META.size for slot in range(len(chunk))
        ]
        sizes = [piece.view.nbytes for piece in chunk] + [_META.size] * len(chunk)
        answers = self._call(self._client.batch_put_from_ptr, names, pointers, sizes, chunk)
        if answers is None:
            answers = [False] * len(names)
        count = len(chunk)
        for slot, piece in enumerate(chunk):
            stored = bool(answers[slot]) and bool(answers[count + slot])
            results[piece.index] = stored
            if stored:
                self._dropped.discard(payload_keys[slot])
                self._counters.puts += 1
                self._counters.bytes_written += piece.view.nbytes
            else:
                self._counters.put_rejects += 1

    def _get_slice(
        self,
        keys: Sequence[str],
        views: list[memoryview],
        indices: range,
        statuses: list[LoadStatus],
    ) -> None:
        meta = self._meta
        names = [keys[index] + META_SUFFIX for index in indices]
        pointers = [meta.address + slot * _META.size for slot in range(len(names))]
        found = self._call(
            self._client.batch_get_into_ptr, names, pointers, [_META.size] * len(names), []
        )
        if found is None:
            return  # unreachable: UNAVAILABLE stays
        wanted: list[int] = []
        expected: list[int] = []
        for slot, index in enumerate(indices):
            if not found[slot] or keys[index] in self._dropped:
                statuses[index] = LoadStatus.MISSING
                continue
            digest, length = _META.unpack_from(meta.view, slot * _META.size)
            if length != views[index].nbytes:
                statuses[index] = LoadStatus.SIZE_MISMATCH
            else:
                wanted.append(index)
                expected.append(digest)
        chosen = [views[index] for index in wanted]
        for chunk in plan_chunks(chosen, self._ranges, self._bounce, _META_SLOTS):
            chunk_keys = [keys[wanted[piece.index]] for piece in chunk]
            answers = self._call(
                self._client.batch_get_into_ptr,
                chunk_keys,
                [piece.pointer for piece in chunk],
                [piece.view.nbytes for piece in chunk],
                chunk,
            )
            if answers is None:
                continue
            for piece, key, answer in zip(chunk, chunk_keys, answers):
                index = wanted[piece.index]
                if not answer:
                    statuses[index] = LoadStatus.MISSING
                    continue
                arrived = (checksum(piece.view) if piece.staged is None
                           else copy_hashing(piece.view, piece.staged))
                if arrived == expected[piece.index]:
                    self._counters.hits += 1
                    self._counters.bytes_read += piece.view.nbytes
                    statuses[index] = LoadStatus.HIT
                else:
                    self._counters.corrupt_loads += 1
                    self._dropped.add(key)
                    statuses[index] = LoadStatus.CORRUPT

    def _call(
        self,
        call: Any,
        names: list[str],
        pointers: list[int],
        sizes: list[int],
        chunk: list[Piece],
    ) -> list[bool] | None:
        """One batch call with temporary registrations around it; None when it raised or
        answered something malformed (the caller reports failure for every key)."""
        try:
            with temporarily_registered(
                chunk,
                self._register_for_one_call,
                lambda address: quietly(self._client.deregister_memory, address),
            ):
                answers = call(names, pointers, sizes)
                if len(answers) != len(names):
                    return None
                return [bool(answer) for answer in answers]
        except Exception:  # noqa: BLE001 - no MORI error may reach the caller
            _log.warning("MORI batch call raised", exc_info=True)
            return None

    def _register_for_one_call(self, address: int, nbytes: int) -> bool:
        """A registration that lasts one batch call. Only a raise counts as a refusal
        here; the answer is not read."""
        self._client.register_memory(address, nbytes)
        return True



if TYPE_CHECKING:

    def _mori_store_honours_the_contract(
        store: MoriStore,
    ) -> tuple[SchedulerStore, WorkerStore, RegistersHostMemory]:
        """Never called: makes mypy prove that MoriStore satisfies the protocols."""
        return store, store, store
