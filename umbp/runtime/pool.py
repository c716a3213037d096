"""`SlabPool`: the embedded DRAM tier, a paged slab with LRU eviction and checksums.

Layout: one preallocated, prefaulted slab cut into fixed-size pages. An object takes
ceil(size / page_bytes) pages from a free list (not necessarily contiguous), so puts never
allocate and never fault, and copies run at the memcpy limit (docs/backends.md: a
`bytes`-per-object store manages 0.7-1.1 GB/s for 1 MB objects, a slab 8-12 GB/s).

Invariants (checked by tests/property/test_pool_properties.py):
* every page is either on the free list or owned by exactly one resident object;
* used pages never exceed the slab, and a put that crosses the high watermark first evicts
  least-recently-used objects until the usage it will reach is at or below the low one;
* a load that answers HIT delivered exactly the bytes last stored under that key: every
  object carries an xxh3-64 checksum, computed on put over the slab pages just written
  (hot in cache, and it covers what was actually stored) and verified on every load over
  the destination just filled.

Concurrency: one `threading.Lock` guards the index, the free list, the counters *and* the
copies, taken once per object (not per batch) so that a `lookup` from another thread waits
for at most one object copy. Copying outside the lock would need page pinning against
concurrent eviction, clear and corrupt-drops; it buys nothing in CPython today because a
`memoryview` copy holds the GIL anyway, so the simplest correct scheme is the one here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import (
    LoadStatus,
    PoolStats,
    SchedulerStore,
    StoreUnavailable,
    WorkerStore,
)
from umbp.runtime.counters import StoreCounters
from umbp.runtime.host_memory import allocate_prefaulted_slab, byte_views
from umbp.runtime.paged_copy import read_regions, write_regions

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["SlabPool"]

DEFAULT_PAGE_BYTES = 256 * 1024


class _StoredObject(NamedTuple):
    """Where one object lives and what it must hash to. A NamedTuple rather than a frozen
    dataclass because one is built per put and a frozen dataclass costs ~1 us to build."""

    regions: tuple[tuple[int, int], ...]
    """(slab offset, length) of each page-sized piece, in object order."""
    nbytes: int
    checksum: int


class SlabPool(ClosesOnExit):
    """The embedded DRAM tier; implements both `SchedulerStore` and `WorkerStore`.

    `capacity_bytes` is rounded down to whole pages. Watermarks are fractions of the page
    count: when a put would take usage above `high_watermark`, LRU objects are evicted until
    usage including the new object is at or below `low_watermark` (or the pool is empty).
    The gap between the two makes eviction happen in bursts rather than on every put.

    Copies run at memcpy speed when buffers start on 64-byte boundaries relative to the
    slab: keep `page_bytes` a multiple of 64 (4 KiB is ideal) and pass buffers from an
    aligned allocator (torch's CPU allocator aligns to 64). A destination 16 bytes off
    (numpy's default for large arrays) halved get throughput on the reference machine.
    """

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
        self._high_pages = _watermark_pages(high_watermark, self._total_pages)
        self._low_pages = _watermark_pages(low_watermark, self._total_pages)
        self._slab = allocate_prefaulted_slab(self._total_pages * page_bytes)
        self._slab_bytes = memoryview(self._slab)
        # Popped from the end: low page numbers first, and a freed page is the next reused
        # (still warm in cache and TLB).
        self._free_pages: list[int] = list(range(self._total_pages - 1, -1, -1))
        self._objects: OrderedDict[str, _StoredObject] = OrderedDict()  # LRU first
        self._evicted: dict[str, None] = {}  # insertion-ordered set
        self._counters = StoreCounters()
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------- the contract

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        """Residency of each key. Does not refresh LRU order: asking is not using."""
        with self._lock:
            self._require_open()
            objects = self._objects
            return tuple([key in objects for key in keys])

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
                used_bytes=self._used_pages() * self._page_bytes,
                page_bytes=self._page_bytes,
                objects=len(self._objects),
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
            self._slab_bytes.release()
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
            return len(self._free_pages)

    def stored_keys(self) -> tuple[str, ...]:
        """Resident keys, least recently used first: lets a fault-injection test pick its
        victims without knowing what the connector stored."""
        with self._lock:
            return tuple(self._objects)

    def object_regions(self, key: str) -> tuple[tuple[int, int], ...]:
        """(offset, length) in `slab_view()` of each piece of the object under `key`, in
        object order. Public for fault injection: a test flips bytes there and expects the
        next load to answer CORRUPT. Raises KeyError when `key` is not resident."""
        with self._lock:
            stored = self._objects.get(key)
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
            if key in self._objects:
                self._objects.move_to_end(key)
                return True
            pages_needed = -(-source.nbytes // self._page_bytes)
            if pages_needed > self._total_pages:
                self._counters.put_rejects += 1
                return False
            if self._used_pages() + pages_needed > self._high_pages:
                self._evict_for(pages_needed)
            regions = self._regions(self._take_free_pages(pages_needed), source.nbytes)
            checksum = write_regions(self._slab_bytes, regions, source)
            self._objects[key] = _StoredObject(regions, source.nbytes, checksum)
            self._evicted.pop(key, None)
            self._counters.puts += 1
            self._counters.bytes_written += source.nbytes
            return True

    def _get_one(self, key: str, destination: memoryview) -> LoadStatus:
        with self._lock:
            if self._closed:
                return LoadStatus.UNAVAILABLE
            stored = self._objects.get(key)
            if stored is None:
                self._counters.misses += 1
                return LoadStatus.MISSING
            if destination.nbytes != stored.nbytes:
                return LoadStatus.SIZE_MISMATCH
            if read_regions(self._slab_bytes, stored.regions, destination) != stored.checksum:
                self._drop(key, stored)
                self._counters.corrupt_loads += 1
                return LoadStatus.CORRUPT
            self._objects.move_to_end(key)
            self._counters.hits += 1
            self._counters.bytes_read += stored.nbytes
            return LoadStatus.HIT

    def _evict_for(self, pages_needed: int) -> None:
        """Called when a put would cross the high watermark: evict LRU objects until usage
        including the incoming object is at or below the low watermark, or nothing is left
        to evict (an object larger than the low watermark then has the pool to itself)."""
        while self._objects and self._used_pages() + pages_needed > self._low_pages:
            key, stored = self._objects.popitem(last=False)
            self._release_pages(stored.regions)
            self._evicted[key] = None
            self._counters.evictions += 1

    def _take_free_pages(self, count: int) -> tuple[int, ...]:
        assert count <= len(self._free_pages), "eviction left too few free pages"
        if count == 1:
            return (self._free_pages.pop(),)
        if count == 0:
            return ()
        pages = tuple(reversed(self._free_pages[-count:]))
        del self._free_pages[-count:]
        return pages

    def _release_pages(self, regions: tuple[tuple[int, int], ...]) -> None:
        page_bytes = self._page_bytes
        self._free_pages.extend(offset // page_bytes for offset, _ in regions)

    def _drop(self, key: str, stored: _StoredObject) -> None:
        """Remove a resident object that can no longer be trusted; report it as evicted."""
        del self._objects[key]
        self._release_pages(stored.regions)
        self._evicted[key] = None

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

    def _used_pages(self) -> int:
        return self._total_pages - len(self._free_pages)

    def _forget_everything(self) -> None:
        self._objects.clear()
        self._evicted.clear()
        self._free_pages = list(range(self._total_pages - 1, -1, -1))

    def _require_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("SlabPool is closed")


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


def _watermark_pages(fraction: float, total_pages: int) -> int:
    """Pages at `fraction` of the pool, rounded down (with a hair of slack so 0.95 * 20
    is 19, not 18, despite binary floating point)."""
    return int(fraction * total_pages + 1e-9)


if TYPE_CHECKING:

    def _slab_pool_honours_the_contract(pool: SlabPool) -> tuple[SchedulerStore, WorkerStore]:
        """Never called: makes mypy prove that SlabPool satisfies both protocols."""
        return pool, pool
