"""The store contract every runtime back-end implements.

Two handles, because vLLM runs two kinds of process that need different things:

* the scheduler only asks "which of these keys are resident?" (`SchedulerStore`), many times
  per scheduling step, so `lookup` is batched and must be cheap;
* a worker moves bytes (`WorkerStore`): it writes KV blocks gathered from the paged cache
  and reads them back into staging buffers.

Keys are `str`. Payloads are bytes-like buffers: anything that exports a C-contiguous
buffer (`memoryview`, `bytearray`, a numpy array such as a row of a uint8 torch tensor seen
through `.numpy()`). Back-ends read payloads and write into `outs` through the buffer
protocol, so the runtime never imports torch.

Batches of any length. Every batched call takes as many keys as the caller has (a
store step's residency lookup covers every cached block of every request in the step:
131,072 keys for 256 requests with 8K-token cached prefixes at block 16). A store whose
service takes fewer per call states its limit as `batch_limit` and asks in consecutive
calls of at most that many keys, in order, so that a batch answers exactly as those calls
would one after another (`umbp.runtime.batches`). The back-ends' limits:

* `umbp serve` (`ServerStore`): 65,536 keys and 16 MiB of JSON per request
  (`umbp.runtime.server.schema`); both are kept, longer batches go as several requests;
* Mooncake Store (`MooncakeStore`): none stated by Mooncake (`batch_is_exist` answered
  1,000,000 keys in one call, docs/backends.md); umbp's adapter moves puts and gets in
  calls of 4,096 objects, the slots of its registered checksum-trailer area;
* MORI UMBP (`MoriStore`): none stated by its API; the adapter moves puts and gets in
  calls of 4,096 objects, the slots of its registered sidecar area;
* the embedded pool (`SlabPool`, and the scheduler's lookups of it, in process or
  through `umbp.runtime.lookup_service`): none.

The contract is deliberately synchronous. Asynchronous scheduling (tickets, poll, wait,
cancel) is not part of it: the worker calls a `WorkerStore` from its host lanes (store
reads and writes through staging, checksums) and, for the in-process embedded pool's
`lend` and `reserve`, from vLLM's model thread (`umbp.shell.loads`, `umbp.shell.stores`),
which keeps every back-end simple and lets the overlap policy live in one place. So a
`WorkerStore` is called from several threads at once and must be thread-safe (every
back-end here serialises what it must with a lock of its own).

Expected failures are values, not exceptions: a rejected put is `False`, a failed load is a
`LoadStatus`. The one exception is `StoreUnavailable`, raised by `lookup` when the back-end
cannot be reached at all (a `lookup` answer of "not resident" would be a lie the scheduler
could not tell from a miss). `LoadStatus` is defined in `umbp.core.loads.outcomes`, where
the worker's load outcomes are decided from it, and re-exported here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from umbp.core.loads.outcomes import LoadStatus
from umbp.core.rank_keys import HashRuns

__all__ = [
    "ChecksumsFromCopy",
    "CommitsReservation",
    "HashLookup",
    "LabelsNamespaces",
    "LendsObjects",
    "LentObjects",
    "LoadStatus",
    "Medium",
    "PoolStats",
    "PrefetchesOnLookup",
    "RegistersHostMemory",
    "ReportsTiers",
    "ReservedObjects",
    "ReservesObjects",
    "Retains",
    "Retention",
    "SchedulerStore",
    "StoreRefused",
    "StoreUnavailable",
    "TierAware",
    "UncheckedObjects",
    "VerifiesLoan",
    "WatchesLentMemory",
    "WorkerStore",
]


class Medium(enum.StrEnum):
    """Where an object lives, as vLLM's KV events name it (``BlockStored.medium``
    is a string, so the members are strings)."""

    CPU = "CPU"
    """Host memory."""
    DISK = "DISK"
    """A disk tier."""


class StoreUnavailable(Exception):
    """The back-end cannot be reached (closed, server down, network partition)."""


class StoreRefused(ValueError):
    """The back-end answered but refused the request; the message names why (an unknown
    namespace, a limit broken). It changed nothing."""


@dataclass(frozen=True, slots=True)
class Retention:
    """What a `Retains.retain` did with its keys."""

    retained: int
    """Objects retained now that were not before."""
    extended: int
    """Objects retained already, for as long at least now."""
    not_retained: int
    """Keys not held where retention applies (not resident, or on a slower tier only)."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a store's occupancy and counters (counters are since construction)."""

    capacity_bytes: int
    """Bytes the store can hold (for a paged pool: number of pages times page size)."""
    used_bytes: int
    """Bytes currently taken by resident objects (for a paged pool: whole pages)."""
    page_bytes: int
    """Allocation granule; an object occupies ceil(size / page_bytes) pages."""
    objects: int
    """Resident objects."""
    hits: int
    """Loads that returned `LoadStatus.HIT`."""
    misses: int
    """Loads that returned `LoadStatus.MISSING`."""
    puts: int
    """Objects written (a put of an already-resident key writes nothing and is not counted)."""
    put_rejects: int
    """Puts that returned False (object larger than the store, store closed)."""
    evictions: int
    """Objects evicted to make room (LRU)."""
    corrupt_loads: int
    """Loads that found a checksum mismatch (the object was dropped)."""
    bytes_written: int
    """Payload bytes copied into the store."""
    bytes_read: int
    """Payload bytes copied out of the store by loads that hit."""


@runtime_checkable
class SchedulerStore(Protocol):
    """What the scheduler process needs: residency answers, nothing that moves bytes."""

    @property
    def batch_limit(self) -> int | None:
        """The most keys one call to the service behind this store carries; None when
        it takes any number. Every batched method accepts a batch of any length: a
        longer one goes as consecutive calls within this limit, answered in key order
        (see the module docstring)."""
        ...

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        """Residency of each key, in order. Batched because the scheduler asks about every
        block of a prompt at once. Never raises for a missing key; raises
        `StoreUnavailable` when the back-end cannot be reached."""
        ...

    def clear(self) -> bool:
        """Drop every object; True when the store is empty afterwards."""
        ...

    def close(self) -> None:
        """Release the handle (idempotent). Later lookups raise `StoreUnavailable`."""
        ...


@runtime_checkable
class WorkerStore(Protocol):
    """What a worker process needs: move KV bytes in and out."""

    @property
    def batch_limit(self) -> int | None:
        """Same as `SchedulerStore.batch_limit`."""
        ...

    def put_batch(self, keys: Sequence[str], payloads: Sequence[memoryview]) -> tuple[bool, ...]:
        """Store `payloads[i]` under `keys[i]`; one result per key. A key already resident
        answers True without being rewritten (a key names its content). False means the
        object was not stored (too large, store unavailable)."""
        ...

    def get_batch_into(
        self, keys: Sequence[str], outs: Sequence[memoryview]
    ) -> tuple[LoadStatus, ...]:
        """Copy the object stored under `keys[i]` into the writable buffer `outs[i]`, whose
        length must equal the stored object's; one status per key."""
        ...

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        """Same as `SchedulerStore.lookup`."""
        ...

    def stats(self) -> PoolStats:
        """A snapshot of occupancy and counters."""
        ...

    def clear(self) -> bool:
        """Drop every object; True when the store is empty afterwards."""
        ...

    def close(self) -> None:
        """Release the handle and its memory (idempotent)."""
        ...


@runtime_checkable
class HashLookup(Protocol):
    """Optional: a store that answers a lookup from the keys' prefixes and raw hashes
    (`umbp.core.rank_keys.HashRuns`), so the scheduler builds no key string for it. The
    answer must be exactly `lookup(runs.key_strings())`'s, in the same order; a resident key that
    is not a prefix plus a lowercase hex digest is simply never named by a `HashRuns`."""

    def lookup_hashes(self, runs: HashRuns) -> tuple[bool, ...]:
        """Residency of each key of `runs`, in position order. Raises `StoreUnavailable`
        like `lookup`."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class LentObjects:
    """Objects a store lends where they lie, for a caller to copy straight out of its
    memory: no staging copy between the store and the KV cache.

    ``memory`` is uint8 ``[pages, page_bytes]``; a lent object is the first ``nbytes``
    of its pages' bytes taken in order. ``pages`` gives, per key in order, the pages of
    the lent object (one when it fits one), or None when it was not lent (missing,
    another size, the store closed). Lent objects stay where they are (pinned: neither
    evicted nor overwritten) until ``release``.

    ``verify`` checks each lent object's checksum and answers one `LoadStatus` per key
    (HIT, CORRUPT, or why a key was not lent): against ``copied[i]`` where the caller
    gives it (the xxh3-64 of the bytes its copy read, hashed as they moved), else over
    the memory the caller copies from; it may run before, during or after the caller's
    copies (the bytes cannot change while lent), at most once, and before ``release``.
    Bytes copied are unverified until then: the caller must treat every key ``verify``
    does not answer HIT as failed.
    ``release`` is called exactly once, when the caller's copies have finished reading
    (on a GPU: when the copy's event completed), verified or not."""

    memory: npt.NDArray[np.uint8]
    pages: tuple[tuple[int, ...] | None, ...]
    verify: VerifiesLoan
    release: Callable[[], None]


class VerifiesLoan(Protocol):
    def __call__(
        self, copied: Sequence[int | None] | None = None
    ) -> tuple[LoadStatus, ...]:
        """Per key, HIT when its checksum holds (``copied``: per key, the xxh3-64 of the
        bytes the caller's copy read, None where it did not hash them)."""
        ...


@runtime_checkable
class LendsObjects(Protocol):
    """Optional: a store whose objects lie in memory this process can read (the
    embedded pool's slab, the node-local server's shared memory) lends them in place
    (`LentObjects`) instead of copying them into the caller's buffers."""

    def lend(self, keys: Sequence[str], nbytes: int) -> LentObjects:
        """Lend the objects under `keys` of `nbytes` each. Raises `StoreUnavailable`
        when the store cannot be reached (nothing is lent then)."""
        ...

    def watch_lent_memory(self, watcher: WatchesLentMemory) -> None:
        """Tell `watcher` of the memory loans (and reservations, `ReservesObjects`)
        lie in, as it comes and goes: what a GPU host registers with its copy engines.
        `mapped` is called for the memory mapped now, if any, before this returns, and
        for every later mapping (a restarted server's new pool) before anything in it is
        lent or reserved; `unmapping` once no loan or reservation in a mapping is
        outstanding, before it is unmapped (the memory a device registered must not go
        before it is unregistered)."""
        ...


class WatchesLentMemory(Protocol):
    def mapped(self, address: int, nbytes: int) -> None:
        """`[address, address + nbytes)` may be lent or reserved from now on."""
        ...

    def unmapping(self, address: int) -> None:
        """The mapping at `address` is about to go: nothing in it is lent or reserved,
        and nothing will be."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class ReservedObjects:
    """Room a store reserves where objects will lie, for a caller to copy straight
    into: no staging copy between the KV cache and the store.

    ``memory`` is uint8 ``[pages, page_bytes]``; ``pages`` gives, per key in order, the
    pages the caller writes the object's ``nbytes`` into (in order), or None when
    nothing is to be written (already stored, or no room: ``commit`` says which).
    Reserved pages are neither visible to lookups nor reused until ``commit``, which the
    caller calls exactly once, when its copies have finished writing (on a GPU: when
    the copy's event completed), saying per key whether its pages were written and, where
    the copy hashed what it wrote, its xxh3-64 (else the store hashes the pages).
    ``commit`` publishes the written objects with their checksums and answers per key,
    as `put_batch` does, whether the object is stored (a row not written, or written
    while the store was cleared or closed, is not)."""

    memory: npt.NDArray[np.uint8]
    pages: tuple[tuple[int, ...] | None, ...]
    commit: CommitsReservation


class CommitsReservation(Protocol):
    def __call__(
        self, written: Sequence[bool], checksums: Sequence[int | None] | None = None
    ) -> tuple[bool, ...]:
        """Per key whether it is now stored (``written``: per key whether its pages
        were written; ``checksums``: per key the xxh3-64 of what was written, None
        where the copy did not hash it)."""
        ...


@runtime_checkable
class ReservesObjects(Protocol):
    """Optional: a store whose memory this process can write (the embedded pool's slab,
    the node-local server's shared memory) reserves room for objects
    (`ReservedObjects`) instead of copying them out of the caller's buffers."""

    def reserve(self, keys: Sequence[str], nbytes: int) -> ReservedObjects:
        """Reserve pages for each key's object of `nbytes`. Raises `StoreUnavailable`
        when the store cannot be reached (nothing is reserved then)."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class UncheckedObjects:
    """Objects read into the caller's buffers whose checksums are still to be compared
    (`ChecksumsFromCopy.get_batch_unchecked`). ``statuses``: per key, HIT where the
    object's bytes arrived (unverified), else why not (final). ``verify(copied)`` gives
    the final statuses, given per key the xxh3-64 that the caller's copy out of its
    buffer computed of what it read: HIT where it equals the stored checksum, CORRUPT
    where it does not (the store drops the object), UNAVAILABLE for an arrived key whose
    checksum the caller does not give (the bytes stay unverified; the store never reads
    the caller's buffers again, which may be reused by then). At most once."""

    statuses: tuple[LoadStatus, ...]
    verify: VerifiesLoan


@runtime_checkable
class ChecksumsFromCopy(Protocol):
    """Optional: a store that keeps an xxh3-64 with every object and moves it through
    the caller's buffers (Mooncake Store: the buffers are registered staging rows) takes
    the checksums from the caller's copy into or out of those buffers, which hashed the
    bytes as it moved them, instead of reading the buffers a second time to hash them."""

    def put_batch_checksummed(
        self, keys: Sequence[str], payloads: Sequence[memoryview], checksums: Sequence[int]
    ) -> tuple[bool, ...]:
        """`WorkerStore.put_batch`, each payload stored with ``checksums[i]`` as its
        checksum, not hashed again (the caller's copy hashed what it wrote there).
        ValueError for mismatched lengths, before anything is stored."""
        ...

    def get_batch_unchecked(
        self, keys: Sequence[str], outs: Sequence[memoryview]
    ) -> UncheckedObjects:
        """`WorkerStore.get_batch_into` without the checksum pass: the caller copies each
        arrived object out of its buffer, hashing as it copies, and hands the checksums
        to ``verify``; bytes it copied are unverified until then, and a key ``verify``
        does not answer HIT has failed. A buffer of a key not answered HIT may have been
        written. ValueError for mismatched lengths, before anything is read."""
        ...


@runtime_checkable
class TierAware(Protocol):
    """Optional: a store with several tiers says where each object is, so that KV events
    can name the medium (`Medium.CPU`, `Medium.DISK`)."""

    def where(self, keys: Sequence[str]) -> tuple[Medium | None, ...]:
        """The medium holding each key, None when it is not resident. Raises
        `StoreUnavailable` like `lookup`."""
        ...


@runtime_checkable
class PrefetchesOnLookup(TierAware, Protocol):
    """Optional: a store with a slower tier that starts bringing an object into its fast
    tier as soon as an engine's lookup finds it only in the slow one (`umbp serve`'s SSD
    tier), so that its load need not read the slow tier. The scheduler looks up through
    `lookup_where`; a synchronous load waits (asking `where`, which starts nothing)
    until its objects left `Medium.DISK`, and `forget` ends what a request that went
    away started."""

    def lookup_where(self, keys: Sequence[str], request_id: str) -> tuple[Medium | None, ...]:
        """`lookup` answered per medium, for the engine's request `request_id`: objects on
        `Medium.DISK` are on their way to the fast tier. Raises `StoreUnavailable`."""
        ...

    def forget(self, request_id: str) -> None:
        """The request went away: what it started and did not begin is dropped. Never
        raises."""
        ...


@runtime_checkable
class RegistersHostMemory(Protocol):
    """Optional: a store whose transport moves bytes only from registered memory
    (Mooncake, MORI). The worker registers its long-lived staging buffers, so puts and
    gets whose buffers lie inside a registered range need no bounce copy."""

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """Register [address, address + nbytes). Raises OSError when the transport refuses."""
        ...

    def unregister_host_memory(self, address: int) -> None:
        """Forget a range registered at `address` (before its memory is freed)."""
        ...


@runtime_checkable
class ReportsTiers(Protocol):
    """Optional: a store with several tiers reports the usage of each."""

    def tier_usage(self) -> dict[Medium, tuple[int, int]]:
        """(used bytes, objects) per medium the store has.
        Raises `StoreUnavailable` like `lookup`."""
        ...


@runtime_checkable
class Retains(Protocol):
    """Optional: a store that can keep objects a request asked to keep (vLLM's
    ``kv_transfer_params`` ``{"umbp": {"retain_s": N}}``): evicted last, and only past
    their time or their namespace's budget."""

    def retain(self, keys: Sequence[str], seconds: float) -> Retention:
        """Keep the objects under `keys` for `seconds`. Raises `StoreRefused` when that
        would break a limit of the store (nothing is retained then), `StoreUnavailable`
        like `lookup`."""
        ...


@runtime_checkable
class LabelsNamespaces(Protocol):
    """Optional: a store that shows operators its namespaces (`umbp ls`) learns which
    model each belongs to from the engine that stores under it."""

    def register_namespace(self, namespace: str, label: str) -> None:
        """Say that `namespace` holds the KV of the model `label` describes. Never
        raises: a store that cannot be reached learns it when it can."""
        ...
