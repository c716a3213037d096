"""`SlabPool`: the embedded DRAM tier, a paged slab with LRU eviction and checksums.

Layout: one preallocated, prefaulted slab cut into fixed-size pages. An object takes
max(1, ceil(size / page_bytes)) pages from a free list (not necessarily contiguous; the
paging and LRU rules are `umbp.runtime.paging`'s, shared with the server and the SSD
tier), so puts never
allocate and never fault, and copies run at the memcpy limit (docs/backends.md: a
`bytes`-per-object store manages 0.7-1.1 GB/s for 1 MB objects, a slab 8-12 GB/s).

Invariants (checked by tests/property/test_pool_properties.py):
* every page is either on the free list or owned by exactly one resident object;
* used pages never exceed the slab, and a put that crosses the high watermark first evicts
  least-recently-used objects until the usage it will reach is at or below the low one;
* `lookup_hashes(runs)` answers exactly what `lookup(runs.key_strings())` does: beside the
  resident keys the pool keeps, per key prefix, the raw hashes of its resident keys that
  are that prefix plus a lowercase hex digest, changed wherever a key comes or goes;
* a load that answers HIT delivered exactly the bytes last stored under that key: every
  object carries an xxh3-64 checksum, computed on put over the slab pages just written
  (hot in cache, and it covers what was actually stored) and verified on every load over
  the destination just filled (a loan: over the pinned pages the borrower copied from).

Concurrency: one `threading.Lock` guards the index, the free list, the counters *and* the
copies of `put_batch` / `get_batch_into`, taken once per object (not per batch) so that a
`lookup` from another thread waits for at most one object copy. `lend` copies nothing
under the lock: it pins the objects (`PagedLru.pin`: not evicted, their pages not reused
even if cleared meanwhile), the borrower copies from the pages, `verify` checks the
checksums outside the lock and counts under it, and `release` unpins. `reserve` is the
other direction: it takes pages (evicting as a put does) that no lookup sees, the caller
copies into them, and `commit` checksums them outside the lock and makes them resident
under it; a `clear` or `close` in between returns them instead.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from umbp.core.rank_keys import HashRuns
from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import (
    HashLookup,
    LendsObjects,
    LentObjects,
    LoadStatus,
    PoolStats,
    ReservedObjects,
    ReservesObjects,
    SchedulerStore,
    StoreUnavailable,
    WatchesLentMemory,
    WorkerStore,
)
from umbp.runtime.counters import PoolCounters
from umbp.runtime.host_memory import allocate_prefaulted_slab, byte_views
from umbp.runtime.paged_copy import (
    hashed_per_key,
    object_checksum,
    read_regions,
    write_regions,
)
from umbp.runtime.paging import PagedLru, Resident, pages_for, watermark_pages

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["SlabPool"]

DEFAULT_PAGE_BYTES = 256 * 1024


def _hash_identity(key: str) -> tuple[str, bytes] | None:
    """``(prefix, raw hash)`` of a key that is a prefix ending with ``:`` plus a lowercase
    hex digest (every key core builds), else None: such a key is asked only as a string.
    The round trip makes it exact: ``fromhex`` also reads upper case and spaces."""
    prefix, colon, digest = key.rpartition(":")
    if not colon:
        return None
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        return None
    return (prefix + colon, raw) if raw.hex() == digest else None


class _StoredObject(Resident):
    """Where one object lives and what it must hash to. A slotted class whose __init__
    sets every field itself: one is built per put, where a frozen dataclass's checked
    construction would cost more than the bookkeeping around it."""

    __slots__ = ("checksum", "identity", "nbytes", "regions")

    def __init__(
        self,
        key: str,
        pages: tuple[int, ...],
        regions: tuple[tuple[int, int], ...],
        nbytes: int,
        checksum: int,
        identity: tuple[str, bytes] | None,
    ) -> None:
        self.key = key
        self.pages = pages
        self.pins = 0
        self.leaving = False
        self.retired = False
        self.regions = regions
        """(slab offset, length) of each page-sized piece, in object order."""
        self.nbytes = nbytes
        self.checksum = checksum
        self.identity = identity
        """``_hash_identity(key)``: where the object sits in the pool's hash index."""


class SlabPool(ClosesOnExit):
    """The embedded DRAM tier; implements `SchedulerStore`, `WorkerStore` and `HashLookup`.

    `capacity_bytes` is rounded down to whole pages. Watermarks are fractions of the page
    count: when a put would take usage above `high_watermark`, LRU objects are evicted until
    usage including the new object is at or below `low_watermark` (or the pool is empty).
    The gap between the two makes eviction happen in bursts rather than on every put.

    Copies run at memcpy speed when buffers start on 64-byte boundaries relative to the
    slab: keep `page_bytes` a multiple of 64 (4 KiB is ideal) and pass buffers from an
    aligned allocator (torch's CPU allocator aligns to 64). A destination 16 bytes off
    (numpy's default for large arrays) halved get throughput on the reference machine.
    """

    batch_limit: int | None = None
    """No limit: a batch of any length is one call into this process's slab."""

    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
    ) -> None:
        _validate_geometry(capacity_bytes, page_bytes)
        _validate_watermarks(high_watermark, low_watermark)
        self._page_bytes = page_bytes
        self._total_pages = capacity_bytes // page_bytes
        self._pages: PagedLru[_StoredObject] = PagedLru(
            self._total_pages,
            high_pages=watermark_pages(high_watermark, self._total_pages),
            low_pages=watermark_pages(low_watermark, self._total_pages),
        )
        self._slab = allocate_prefaulted_slab(self._total_pages * page_bytes)
        self._slab_bytes = memoryview(self._slab)
        # The slab as page rows, lent to readers (`lend`); a loan keeps its own reference,
        # so the mapping outlives a close() until the last borrower lets go of it.
        self._page_rows: npt.NDArray[np.uint8] = np.frombuffer(self._slab, np.uint8).reshape(
            self._total_pages, page_bytes
        )
        self._slab_address = int(self._page_rows.ctypes.data)
        self._watchers: list[WatchesLentMemory] = []
        self._outstanding = 0  # objects lent and pages reserved, not yet given back
        self._reserved_keys: set[str] = set()
        self._generation = 0  # clear and close: reservations made before are not stored
        self._evicted: dict[str, None] = {}  # insertion-ordered set
        # Per key prefix, the raw hashes of its resident keys (see _hash_identity): what
        # lookup_hashes reads. Kept exact by _admit and _forget, the only two places a key
        # becomes or stops being resident (clear and close reset it with the pages).
        self._hashes_by_prefix: dict[str, set[bytes]] = {}
        self._counters = PoolCounters()
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------- the contract

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        """Residency of each key. Does not refresh LRU order: asking is not using."""
        with self._lock:
            self._require_open()
            pages = self._pages
            return tuple([key in pages for key in keys])

    def lookup_hashes(self, runs: HashRuns) -> tuple[bool, ...]:
        """`lookup(runs.key_strings())`'s answer without the key strings: one set probe per
        hash (a whole run resident: one C-level `issuperset`)."""
        with self._lock:
            self._require_open()
            index = self._hashes_by_prefix
            answers: list[bool] = []
            for prefixes, hashes in zip(runs.prefixes, runs.hashes):
                for prefix in prefixes:
                    held = index.get(prefix)
                    if held is None:
                        answers += [False] * len(hashes)
                    elif held.issuperset(hashes):
                        answers += [True] * len(hashes)
                    else:
                        answers += map(held.__contains__, hashes)
            return tuple(answers)

    def put_batch(self, keys: Sequence[str], payloads: Sequence[Buffer]) -> tuple[bool, ...]:
        """Store each payload (any C-contiguous buffer); one result per key.

        A resident key answers True without rewriting and becomes most recently used.
        False: the object is larger than the whole pool, or the pool is closed.
        Raises ValueError for mismatched lengths or unusable buffers before storing
        anything.
        """
        sources = byte_views(keys, payloads, writable=False)
        return tuple([self._put_one(key, source) for key, source in zip(keys, sources)])

    def get_batch_into(self, keys: Sequence[str], outs: Sequence[Buffer]) -> tuple[LoadStatus, ...]:
        """Copy each object into its writable, C-contiguous buffer; one status per key.

        HIT refreshes LRU order. CORRUPT drops the object (reported by
        `take_evicted_keys`). UNAVAILABLE for every key once the pool is closed.
        Raises ValueError for mismatched lengths or unusable buffers before loading
        anything.
        """
        destinations = byte_views(keys, outs, writable=True)
        return tuple(
            [self._get_one(key, destination) for key, destination in zip(keys, destinations)]
        )

    def lend(self, keys: Sequence[str], nbytes: int) -> LentObjects:
        """Pin the objects under `keys` and lend their pages for copying in place
        (`LendsObjects`). A key not resident answers MISSING, one of another size
        SIZE_MISMATCH, all of them UNAVAILABLE once the pool is closed; `verify`
        refreshes LRU order and counts like `get_batch_into`, and drops a corrupt object
        the same way."""
        lent: list[_StoredObject | None] = []
        answers: list[LoadStatus] = []  # HIT for a lent object until verified
        with self._lock:
            memory = self._page_rows
            for key in keys:
                stored = None if self._closed else self._pages.get(key)
                if stored is not None and stored.nbytes == nbytes:
                    self._pages.pin(stored)
                    self._outstanding += 1
                    lent.append(stored)
                    answers.append(LoadStatus.HIT)
                else:
                    lent.append(None)
                    answers.append(self._refusal(stored))
        pages = tuple(None if stored is None else stored.pages for stored in lent)
        loan = _Loan(self, memory, tuple(lent), tuple(answers))
        return LentObjects(memory, pages, loan.verify, loan.release)

    def lent_memory(self) -> npt.NDArray[np.uint8]:
        """The slab as page rows: every loan and reservation lies in it."""
        return self._page_rows

    def watch_lent_memory(self, watcher: WatchesLentMemory) -> None:
        """`watcher` hears of the slab now (`mapped`), and of its end once the pool is
        closed and nothing lent or reserved is outstanding; nothing when closed already."""
        with self._lock:
            if self._closed:
                return
            self._watchers.append(watcher)
            watcher.mapped(self._slab_address, int(self._page_rows.nbytes))

    def reserve(self, keys: Sequence[str], nbytes: int) -> ReservedObjects:
        """Reserve pages for each key's object of `nbytes` (`ReservesObjects`), evicting
        as a put does. A resident key gets no pages and is stored (LRU refreshed); a key
        another reservation is writing, or one the pool has no room for, gets no pages
        and is not."""
        reserved: list[tuple[int, ...] | None] = []
        stored_already: list[bool] = []
        with self._lock:
            memory, generation = self._page_rows, self._generation
            for key in keys:
                pages, resident = self._reserve_one(key, nbytes)
                reserved.append(pages)
                stored_already.append(resident)
        reservation = _Reservation(
            self, tuple(keys), nbytes, memory, generation, tuple(reserved), tuple(stored_already)
        )
        return ReservedObjects(memory, tuple(reserved), reservation.commit)

    def _reserve_one(self, key: str, nbytes: int) -> tuple[tuple[int, ...] | None, bool]:
        """(the pages reserved for `key` or None, whether it is stored already); under
        the lock."""
        pages = self._pages
        resident = None if self._closed else pages.get(key)
        if resident is not None:
            pages.touch(resident)
            return None, True
        needed = pages_for(nbytes, self._page_bytes)
        if self._closed or key in self._reserved_keys or not pages.fits(needed):
            self._counters.put_rejects += 1
            return None, False
        if pages.needs_room(needed):
            self._evict_for(needed)
        taken = pages.take_pages(needed)
        if taken is None:  # what eviction could not free is pinned right now
            self._counters.put_rejects += 1
            return None, False
        self._reserved_keys.add(key)
        self._outstanding += 1
        return taken, False

    def _count_loan(
        self, lent: Sequence[_StoredObject | None], intact: Sequence[bool],
        answers: Sequence[LoadStatus],
    ) -> tuple[LoadStatus, ...]:
        """A loan's statuses, counted (under the lock)."""
        return tuple(
            status if stored is None else self._verdict(stored, ok)
            for stored, ok, status in zip(lent, intact, answers)
        )

    def _end_loan(self, lent: Sequence[_StoredObject | None]) -> None:
        with self._lock:
            for stored in lent:
                if stored is not None:
                    self._pages.unpin(stored)
                    self._outstanding -= 1
            self._tell_unmapping_once_unused()

    def _commit_reservation(
        self, reservation: _Reservation, checksums: Sequence[int | None]
    ) -> tuple[bool, ...]:
        """Publish the reserved objects whose checksum is given (under the lock); give
        back the pages of the others, and of every one when the pool was cleared or
        closed since the reservation."""
        results: list[bool] = []
        with self._lock:
            current = reservation.generation == self._generation and not self._closed
            for key, pages, checksum, stored in zip(
                reservation.keys, reservation.pages, checksums, reservation.stored_already
            ):
                if pages is None:  # stored already, unless the pool was cleared since
                    results.append(stored and current)
                    continue
                self._reserved_keys.discard(key)
                self._outstanding -= 1
                if checksum is None or not current or key in self._pages:
                    self._pages.return_pages(pages)
                    results.append(checksum is not None and current)
                    continue
                regions = self._regions(pages, reservation.nbytes)
                self._admit(_StoredObject(
                    key, pages, regions, reservation.nbytes, checksum, _hash_identity(key)
                ))
                self._evicted.pop(key, None)
                self._counters.puts += 1
                self._counters.bytes_written += reservation.nbytes
                results.append(True)
            self._tell_unmapping_once_unused()
        return tuple(results)

    def _refusal(self, stored: _StoredObject | None) -> LoadStatus:
        """Why an object is not lent (under the lock; counts a miss like a get)."""
        if self._closed:
            return LoadStatus.UNAVAILABLE
        if stored is None:
            self._counters.misses += 1
            return LoadStatus.MISSING
        return LoadStatus.SIZE_MISMATCH

    def _verdict(self, stored: _StoredObject, intact: bool) -> LoadStatus:
        """A read object's status, counted (under the lock): a corrupt one is dropped
        and reported as evicted (unless clear or close dropped it meanwhile)."""
        if not intact:
            if not stored.retired:
                self._pages.retire(stored)
                self._forget(stored)
                self._evicted[stored.key] = None
            self._counters.corrupt_loads += 1
            return LoadStatus.CORRUPT
        self._pages.touch(stored)
        self._counters.hits += 1
        self._counters.bytes_read += stored.nbytes
        return LoadStatus.HIT

    def take_evicted_keys(self) -> tuple[str, ...]:
        """Keys evicted or dropped as corrupt since the last call, oldest first, that are
        not resident now (a key stored again meanwhile is not reported). Not part of the
        contract (KV events poll residency instead): it lets tests observe eviction order."""
        with self._lock:
            evicted = tuple(self._evicted)
            self._evicted.clear()
            return evicted

    def stats(self) -> PoolStats:
        """A consistent snapshot (taken under the lock)."""
        with self._lock:
            return self._counters.snapshot(
                capacity_bytes=self._total_pages * self._page_bytes,
                used_bytes=self._pages.used_pages * self._page_bytes,
                page_bytes=self._page_bytes,
                objects=len(self._pages),
            )

    def clear(self) -> bool:
        """Drop every object (not reported as evicted); False once closed."""
        with self._lock:
            if self._closed:
                return False
            self._forget_everything()
            return True

    def close(self) -> None:
        """Drop every object and release the slab (idempotent). The memory returns to the
        OS now, or when the last view handed out by `slab_view` is released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._forget_everything()
            self._tell_unmapping_once_unused()
            self._slab_bytes.release()
            self._page_rows = np.empty((0, self._page_bytes), np.uint8)
            try:
                self._slab.close()
            except BufferError:
                pass  # a caller still holds a slab_view(); the mapping dies with it

    # ------------------------------------------------- geometry and fault injection

    @property
    def page_bytes(self) -> int:
        """Allocation granule in bytes."""
        return self._page_bytes

    @property
    def total_pages(self) -> int:
        """Pages in the slab."""
        return self._total_pages

    def free_page_count(self) -> int:
        """Pages on the free list (for invariant checks: free + owned == total)."""
        with self._lock:
            return self._pages.free_page_count

    def stored_keys(self) -> tuple[str, ...]:
        """Resident keys, least recently used first: lets a fault-injection test pick its
        victims without knowing what the connector stored."""
        with self._lock:
            return self._pages.keys()

    def object_regions(self, key: str) -> tuple[tuple[int, int], ...]:
        """(offset, length) in `slab_view()` of each piece of the object under `key`, in
        object order. Public for fault injection: a test flips bytes there and expects the
        next load to answer CORRUPT. Raises KeyError when `key` is not resident."""
        with self._lock:
            stored = self._pages.get(key)
            if stored is None:
                raise KeyError(key)
            return stored.regions

    def slab_view(self) -> memoryview:
        """A writable view of the whole slab, for fault injection together with
        `object_regions`. Writing through it bypasses every invariant but the checksum."""
        with self._lock:
            self._require_open()
            return self._slab_bytes[:]

    # ------------------------------------------------------------------ internals

    def _put_one(self, key: str, source: memoryview) -> bool:
        with self._lock:
            if self._closed:
                self._counters.put_rejects += 1
                return False
            pages = self._pages
            resident = pages.get(key)
            if resident is not None:
                pages.touch(resident)
                return True
            pages_needed = pages_for(source.nbytes, self._page_bytes)
            if not pages.fits(pages_needed):
                self._counters.put_rejects += 1
                return False
            if pages.needs_room(pages_needed):
                self._evict_for(pages_needed)
            taken = pages.take_pages(pages_needed)
            if taken is None:  # what eviction could not free is lent (pinned) right now
                self._counters.put_rejects += 1
                return False
            regions = self._regions(taken, source.nbytes)
            checksum = write_regions(self._slab_bytes, regions, source)
            self._admit(_StoredObject(
                key, taken, regions, source.nbytes, checksum, _hash_identity(key)
            ))
            self._evicted.pop(key, None)
            self._counters.puts += 1
            self._counters.bytes_written += source.nbytes
            return True

    def _evict_for(self, pages_needed: int) -> None:
        """LRU victims out, reported as evicted (under the lock)."""
        for victim in self._pages.evict(pages_needed):
            self._forget(victim)
            self._evicted[victim.key] = None
            self._counters.evictions += 1

    def _get_one(self, key: str, destination: memoryview) -> LoadStatus:
        with self._lock:
            if self._closed:
                return LoadStatus.UNAVAILABLE
            stored = self._pages.get(key)
            if stored is None:
                self._counters.misses += 1
                return LoadStatus.MISSING
            if destination.nbytes != stored.nbytes:
                return LoadStatus.SIZE_MISMATCH
            intact = read_regions(self._slab_bytes, stored.regions, destination) == stored.checksum
            return self._verdict(stored, intact)

    def _regions(self, pages: tuple[int, ...], nbytes: int) -> tuple[tuple[int, int], ...]:
        """(slab offset, length) of each piece of an `nbytes` object laid on `pages`;
        computed once per put so that loads only walk a tuple."""
        page_bytes = self._page_bytes
        if len(pages) == 1:
            return ((pages[0] * page_bytes, nbytes),)
        return tuple(
            (page * page_bytes, min(page_bytes, nbytes - index * page_bytes))
            for index, page in enumerate(pages)
        )

    def _admit(self, stored: _StoredObject) -> None:
        self._pages.admit(stored)
        if stored.identity is not None:
            prefix, raw = stored.identity
            held = self._hashes_by_prefix.get(prefix)
            if held is None:
                self._hashes_by_prefix[prefix] = {raw}
            else:
                held.add(raw)

    def _forget(self, stored: _StoredObject) -> None:
        """A key left (evicted, dropped as corrupt): out of the hash index too, and a
        prefix with no resident key left goes with it."""
        if stored.identity is not None:
            prefix, raw = stored.identity
            held = self._hashes_by_prefix[prefix]
            held.discard(raw)
            if not held:
                del self._hashes_by_prefix[prefix]

    def _forget_everything(self) -> None:
        self._generation += 1
        if self._outstanding:  # lent and reserved pages come back when given back
            self._pages.clear()
        else:
            self._pages.reset()
        self._hashes_by_prefix.clear()
        self._evicted.clear()

    def _tell_unmapping_once_unused(self) -> None:
        """Closed, and no borrower or reserver left (under the lock): the slab's watchers
        let go of it before it can be unmapped."""
        if self._closed and not self._outstanding:
            watchers, self._watchers = self._watchers, []
            for watcher in watchers:
                watcher.unmapping(self._slab_address)

    def _require_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("SlabPool is closed")


class _Loan:
    """One `lend`'s pinned objects: verified at most once, released exactly once."""

    __slots__ = ("_answers", "_lent", "_memory", "_pool", "_released", "_verified")

    def __init__(
        self, pool: SlabPool, memory: npt.NDArray[np.uint8],
        lent: tuple[_StoredObject | None, ...], answers: tuple[LoadStatus, ...],
    ) -> None:
        self._pool, self._memory, self._lent, self._answers = pool, memory, lent, answers
        self._verified = self._released = False

    def verify(self, copied: Sequence[int | None] | None = None) -> tuple[LoadStatus, ...]:
        if self._verified or self._released:
            raise RuntimeError("a loan is verified at most once, before its release")
        hashed = hashed_per_key(copied, len(self._lent), "verify")
        self._verified = True
        # Hashed outside the lock: a pinned object's pages are neither reused nor freed.
        intact = [
            stored is not None
            and object_checksum(self._memory, stored.pages, stored.nbytes, digest)
            == stored.checksum
            for stored, digest in zip(self._lent, hashed)
        ]
        with self._pool._lock:
            return self._pool._count_loan(self._lent, intact, self._answers)

    def release(self) -> None:
        if self._released:
            raise RuntimeError("a loan is released exactly once")
        self._released = True
        self._pool._end_loan(self._lent)


class _Reservation:
    """One `reserve`'s pages: committed exactly once."""

    __slots__ = ("_committed", "generation", "keys", "memory", "nbytes", "pages", "pool",
                 "stored_already")

    def __init__(
        self, pool: SlabPool, keys: tuple[str, ...], nbytes: int,
        memory: npt.NDArray[np.uint8], generation: int,
        pages: tuple[tuple[int, ...] | None, ...], stored_already: tuple[bool, ...],
    ) -> None:
        self.pool, self.keys, self.nbytes, self.memory = pool, keys, nbytes, memory
        self.generation, self.pages, self.stored_already = generation, pages, stored_already
        self._committed = False

    def commit(
        self, written: Sequence[bool], checksums: Sequence[int | None] | None = None
    ) -> tuple[bool, ...]:
        if self._committed:
            raise RuntimeError("a reservation is committed exactly once")
        if len(written) != len(self.keys):
            raise ValueError(f"commit needs one answer per key: {len(self.keys)}, got "
                             f"{len(written)}")
        hashed = hashed_per_key(checksums, len(self.keys), "commit")
        self._committed = True
        # Hashed outside the lock: reserved pages are neither reused nor freed.
        stored = [
            None if pages is None or not wrote
            else object_checksum(self.memory, pages, self.nbytes, digest)
            for pages, wrote, digest in zip(self.pages, written, hashed)
        ]
        return self.pool._commit_reservation(self, stored)


# ------------------------------------------------------------------ validation


def _validate_geometry(capacity_bytes: int, page_bytes: int) -> None:
    """Reject sizes that would make a pool with no pages, naming the argument."""
    for name, value in (("capacity_bytes", capacity_bytes), ("page_bytes", page_bytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if capacity_bytes < page_bytes:
        raise ValueError(
            f"capacity_bytes ({capacity_bytes}) is smaller than one page "
            f"(page_bytes={page_bytes}); raise capacity_bytes or lower page_bytes"
        )


def _validate_watermarks(high_watermark: float, low_watermark: float) -> None:
    """Require 0 < low_watermark < high_watermark <= 1, naming the offending argument."""
    for name, value in (("high_watermark", high_watermark), ("low_watermark", low_watermark)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 0 < high_watermark <= 1:
        raise ValueError(f"high_watermark must be in (0, 1], got {high_watermark}")
    if not 0 < low_watermark < 1:
        raise ValueError(f"low_watermark must be in (0, 1), got {low_watermark}")
    if not low_watermark < high_watermark:
        raise ValueError(
            f"low_watermark ({low_watermark}) must be below high_watermark ({high_watermark})"
        )


if TYPE_CHECKING:

    def _slab_pool_honours_the_contract(
        pool: SlabPool,
    ) -> tuple[SchedulerStore, WorkerStore, HashLookup, LendsObjects, ReservesObjects]:
        """Never called: makes mypy prove that SlabPool satisfies the protocols."""
        return pool, pool, pool, pool, pool
