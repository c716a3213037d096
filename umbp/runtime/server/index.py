"""The server's DRAM index: pages of the shared pool, resident objects, pins, LRU.

Not thread-safe: the server holds its one index lock around every call. Nothing here
touches the pool's bytes; clients copy them, the server only hands out regions.

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

from collections import OrderedDict
from collections.abc import Iterator

__all__ = ["Entry", "PoolIndex", "Regions", "pages_for"]

Regions = tuple[tuple[int, int], ...]
"""(offset in the pool, length) of each piece of an object, in object order."""


class Entry:
    """One object in DRAM. Mutable (pins, flags) and compared by identity: a key stored
    again after a drop is a different entry, and a pin always refers to the one it took."""

    __slots__ = ("checksum", "key", "leaving", "nbytes", "pins", "regions", "retired")

    def __init__(self, key: str, regions: Regions, nbytes: int, checksum: int) -> None:
        self.key = key
        self.regions = regions
        self.nbytes = nbytes
        self.checksum = checksum
        self.pins = 0
        self.leaving = False
        """Being demoted to the cold tier (the server pins it meanwhile)."""
        self.retired = False
        """No longer in the index; its pages return at the last unpin."""


def pages_for(nbytes: int, page_bytes: int) -> int:
    """Pages an object of `nbytes` takes (an empty object takes none)."""
    return -(-nbytes // page_bytes)


class PoolIndex:
    """Pages and objects of a pool of `total_pages` pages of `page_bytes`."""

    def __init__(
        self, total_pages: int, page_bytes: int, high_pages: int, low_pages: int
    ) -> None:
        if total_pages <= 0 or page_bytes <= 0:
            raise ValueError("a pool needs at least one page of at least one byte")
        if not 0 < low_pages < high_pages <= total_pages:
            # Tiny pools round both watermarks to the same page count; keep them usable.
            high_pages = max(1, min(high_pages, total_pages))
            low_pages = max(0, min(low_pages, high_pages - 1))
        self.total_pages = total_pages
        self.page_bytes = page_bytes
        self.high_pages = high_pages
        self.low_pages = low_pages
        # Popped from the end: low page numbers first, so a fresh pool hands out
        # contiguous runs and an object is usually one region (one copy, one hash call).
        self._free: list[int] = list(range(total_pages - 1, -1, -1))
        self._objects: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._leaving_pages = 0
        self._pinned_retired = 0

    # --------------------------------------------------------------- residency

    def get(self, key: str) -> Entry | None:
        return self._objects.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def entries(self) -> Iterator[Entry]:
        """Resident entries, least recently used first."""
        return iter(self._objects.values())

    def touch(self, entry: Entry) -> None:
        """Mark as most recently used."""
        if self._objects.get(entry.key) is entry:
            self._objects.move_to_end(entry.key)

    # ------------------------------------------------------------------- pages

    @property
    def used_pages(self) -> int:
        return self.total_pages - len(self._free)

    @property
    def pinned_retired(self) -> int:
        """Retired entries still pinned (their pages are not free yet)."""
        return self._pinned_retired

    def reserve(self, nbytes: int) -> Regions | None:
        """Take the pages for an `nbytes` object off the free list (None: not enough)."""
        count = pages_for(nbytes, self.page_bytes)
        if count > len(self._free):
            return None
        if count == 0:
            return ()
        pages = self._free[-count:]
        pages.reverse()
        del self._free[-count:]
        return self._regions(pages, nbytes)

    def release(self, regions: Regions) -> None:
        """Return reserved pages (or those of a dropped entry) to the free list."""
        page_bytes = self.page_bytes
        for offset, length in regions:
            first = offset // page_bytes
            self._free.extend(range(first + pages_for(length, page_bytes) - 1, first - 1, -1))

    def _regions(self, pages: list[int], nbytes: int) -> Regions:
        """Consecutive pages fused into one region: fewer, larger copies for the client."""
        page_bytes = self.page_bytes
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

    # ----------------------------------------------------------------- objects

    def insert(self, key: str, regions: Regions, nbytes: int, checksum: int) -> Entry:
        """Make reserved pages resident under `key` (most recently used); the caller has
        checked that `key` is not resident."""
        assert key not in self._objects, f"{key!r} is resident already"
        entry = Entry(key, regions, nbytes, checksum)
        self._objects[key] = entry
        return entry

    def retire(self, entry: Entry) -> None:
        """Take `entry` out of the index; its pages come back now or at the last unpin."""
        if entry.retired:
            return
        if self._objects.get(entry.key) is entry:
            del self._objects[entry.key]
        entry.retired = True
        if entry.pins == 0:
            self.release(entry.regions)
        else:
            self._pinned_retired += 1

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        assert entry.pins > 0, f"{entry.key!r} is not pinned"
        entry.pins -= 1
        if entry.pins == 0 and entry.retired:
            self._pinned_retired -= 1
            self.release(entry.regions)

    def clear(self) -> int:
        """Retire every resident entry (pinned ones free their pages at unpin); returns
        how many there were."""
        entries = list(self._objects.values())
        for entry in entries:
            self.retire(entry)
        return len(entries)

    # ---------------------------------------------------------------- eviction

    def needs_room(self, pages_needed: int) -> bool:
        """Would taking `pages_needed` more pages cross the high watermark? Pages of
        objects already on their way out count as free."""
        return self.used_pages - self._leaving_pages + pages_needed > self.high_pages

    def choose_victims(self, pages_needed: int) -> list[Entry]:
        """Least recently used entries, neither pinned nor already leaving, until usage
        including `pages_needed` more pages is at or below the low watermark (or nothing
        more can go). Each is marked leaving and pinned; hand it back to `finish_leaving`
        (demoted or not) or `drop_leaving`."""
        victims: list[Entry] = []
        target = self.low_pages
        for entry in self._objects.values():
            if self.used_pages - self._leaving_pages + pages_needed <= target:
                break
            if entry.pins or entry.leaving:
                continue
            entry.leaving = True
            entry.pins += 1
            self._leaving_pages += pages_for(entry.nbytes, self.page_bytes)
            victims.append(entry)
        return victims

    def finish_leaving(self, entry: Entry) -> None:
        """A victim has been dealt with (copied to the cold tier, or not): retire it."""
        assert entry.leaving, f"{entry.key!r} is not leaving"
        entry.leaving = False
        self._leaving_pages -= pages_for(entry.nbytes, self.page_bytes)
        self.retire(entry)
        self.unpin(entry)
