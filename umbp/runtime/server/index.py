"""The server's DRAM index: pages of the shared pool as regions, and its resident entries.

The paging, pins and LRU are `umbp.runtime.paging`'s (shared with the embedded pool and
the SSD tier), the namespaces' shares of them `umbp.runtime.server.shares`'s; what is
the server's own here is that clients copy bytes themselves, so pages travel as
(offset, length) regions of the shared pool, consecutive pages fused into one region. Not thread-safe: the server holds its one index lock around every call.
Nothing here touches the pool's bytes.

Page life cycle: free -> reserved (a put in flight or a promotion from SSD, not visible)
-> owned by a resident `Entry` -> free again when the entry is retired and unpinned. A
retired entry that is still pinned (a client is copying out of it, or the server is
demoting it to SSD) keeps its pages until the last unpin, so no page is ever reused
while anyone may still read it.

Invariant (tests/unit/test_server_index.py): free pages + reserved pages + pages of
resident entries + pages of retired-but-pinned entries == total pages, each page in
exactly one of them.
"""

from __future__ import annotations

from umbp.runtime.paging import pages_for
from umbp.runtime.server.namespaces import ColdKeys
from umbp.runtime.server.shares import NamespacedLru, SharedResident

__all__ = ["Entry", "PoolIndex", "Regions", "pages_for"]

Regions = tuple[tuple[int, int], ...]
"""(offset in the pool, length) of each piece of an object, in object order."""


class Entry(SharedResident):
    """One object in DRAM, with the regions a client copies and the checksum it checks."""

    __slots__ = ("checksum", "regions")

    def __init__(self, key: str, regions: Regions, nbytes: int, checksum: int, page_bytes: int):
        super().__init__(key, _pages_of(regions, page_bytes), nbytes)
        self.regions = regions
        self.checksum = checksum


class PoolIndex(NamespacedLru[Entry]):
    """Pages and objects of a pool of `total_pages` pages of `page_bytes`; victims are
    chosen by the namespaces' shares (`umbp.runtime.server.shares`)."""

    def __init__(
        self, total_pages: int, page_bytes: int, high_pages: int, low_pages: int
    ) -> None:
        if total_pages <= 0 or page_bytes <= 0:
            raise ValueError("a pool needs at least one page of at least one byte")
        if not 0 < low_pages < high_pages <= total_pages:
            # Tiny pools round both watermarks to the same page count; keep them usable,
            # with eviction in bursts down to below the high watermark.
            high_pages = max(1, min(high_pages, total_pages))
            low_pages = max(0, min(low_pages, high_pages - 1))
        super().__init__(total_pages, high_pages, low_pages)
        self.page_bytes = page_bytes
        self.cold_mirror = ColdKeys()
        """The SSD tier's mirror (`tiering`), told which keys come and go here, so that
        it counts the objects both tiers hold without a scan."""

    def admit(self, entry: Entry) -> None:
        super().admit(entry)
        self.cold_mirror.dram_gained(entry.key)

    def retire(self, entry: Entry) -> None:
        resident = not entry.retired and self.get(entry.key) is entry
        super().retire(entry)
        if resident:
            self.cold_mirror.dram_lost(entry.key)

    def reset(self) -> None:
        super().reset()
        self.cold_mirror.in_dram = 0

    def reserve(self, nbytes: int) -> Regions | None:
        """Take the pages for an `nbytes` object off the free list (None: not enough)."""
        pages = self.take_pages(pages_for(nbytes, self.page_bytes))
        return None if pages is None else self._regions(pages, nbytes)

    def release(self, regions: Regions) -> None:
        """Return reserved pages to the free list."""
        self.return_pages(_pages_of(regions, self.page_bytes))

    def insert(self, key: str, regions: Regions, nbytes: int, checksum: int) -> Entry:
        """Make reserved pages resident under `key` (most recently used); the caller has
        checked that `key` is not resident."""
        entry = Entry(key, regions, nbytes, checksum, self.page_bytes)
        self.admit(entry)
        return entry

    def _regions(self, pages: tuple[int, ...], nbytes: int) -> Regions:
        """Consecutive pages fused into one region: fewer, larger copies for the client."""
        page_bytes = self.page_bytes
        first = pages[0]
        if pages == tuple(range(first, first + len(pages))):  # the usual run, at C speed
            return ((first * page_bytes, nbytes),)
        regions: list[tuple[int, int]] = []
        start = pages[0]
        run = 1
        for page in pages[1:]:
            if page == start + run:
                run += 1
                continue
            regions.append((start * page_bytes, run * page_bytes))
            start, run = page, 1
        regions.append((start * page_bytes, nbytes - (len(pages) - run) * page_bytes))
        return tuple(regions)


def _pages_of(regions: Regions, page_bytes: int) -> tuple[int, ...]:
    """The pages under `regions`, in object order (an empty object's one region of length
    0 still covers its page)."""
    if len(regions) == 1:  # the usual object: one run of pages, no per-page loop
        offset, length = regions[0]
        first = offset // page_bytes
        return tuple(range(first, first + pages_for(length, page_bytes)))
    pages: list[int] = []
    for offset, length in regions:
        first = offset // page_bytes
        pages.extend(range(first, first + pages_for(length, page_bytes)))
    return tuple(pages)
