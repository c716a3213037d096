"""Pages, resident objects, pins and LRU eviction: the one mechanism of every umbp tier.

The embedded `SlabPool` (pages of a DRAM slab), the node-local server's `PoolIndex` (pages
of the shared pool) and the `SsdTier` (slots of a file) all cut their space into
fixed-size pages and keep objects in least-recently-used order. They differ in what a page
is and in what happens to a victim (dropped, demoted to SSD, its disk records zeroed), not
in the bookkeeping, which lives here once. Not thread-safe: each tier holds its own lock
around every call.

The rules:
* An object of n bytes takes `pages_for(n)` = max(1, ceil(n / page_bytes)) pages. An empty
  object takes one page too: the SSD tier must give it a slot for its header record, and
  charging one page everywhere means every resident object costs capacity, so the number
  of objects a tier holds is bounded by its pages in every tier alike.
* A page is free, reserved (taken by `take_pages`, not yet an object's), owned by one
  resident object, owned by a retired object that is still pinned, or retired for good
  (`retire_page`: a write there failed). Nothing else: free + used == usable pages.
* Eviction is by watermark: when taking `n` more pages would push usage above the high
  watermark, least recently used objects that are neither pinned nor already leaving are
  chosen until usage including the `n` pages is at or below the low watermark, or nothing
  more can go. Pages of objects already leaving count as free. A watermark never counts
  more pages than are usable.
* A retired object's pages come back at once, or at its last unpin when it is pinned, so
  a page is never handed out while anyone may still read it.

Invariants: tests/property/test_paging_properties.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["PagedLru", "Resident", "pages_for", "watermark_pages"]


def pages_for(nbytes: int, page_bytes: int) -> int:
    """Pages an object of `nbytes` takes: at least one (see the module docstring)."""
    return max(1, -(-nbytes // page_bytes))


def watermark_pages(fraction: float, total_pages: int) -> int:
    """Pages at `fraction` of `total_pages`, rounded down (with a hair of slack so that
    0.95 * 20 is 19, not 18, despite binary floating point)."""
    return int(fraction * total_pages + 1e-9)


class Resident:
    """A tier's record of one resident object: its key, its pages in object order and its
    pin state. Tiers subclass it with what they need to find and check the bytes. Mutable
    and compared by identity: a key stored again after a drop is another object, and a pin
    always refers to the object it took."""

    __slots__ = ("key", "leaving", "pages", "pins", "retired")

    def __init__(self, key: str, pages: tuple[int, ...]) -> None:
        self.key = key
        self.pages = pages
        self.pins = 0
        self.leaving = False
        """Chosen as an eviction victim and pinned until `finish_leaving`."""
        self.retired = False
        """No longer resident; its pages come back at the last unpin."""


R = TypeVar("R", bound=Resident)


class PagedLru(Generic[R]):
    """`total_pages` pages (numbered from 0) and the objects that own them, LRU first.

    `high_pages` and `low_pages` are the watermarks in pages, 0 <= low <= high <= total.
    """

    def __init__(self, total_pages: int, high_pages: int, low_pages: int) -> None:
        if total_pages <= 0:
            raise ValueError(f"a paged tier needs at least one page, got {total_pages}")
        if not 0 <= low_pages <= high_pages <= total_pages:
            raise ValueError(
                f"watermarks must satisfy 0 <= low ({low_pages}) <= high ({high_pages}) "
                f"<= total pages ({total_pages})"
            )
        self.total_pages = total_pages
        self.high_pages = high_pages
        self.low_pages = low_pages
        # A stack popped from the end: low page numbers first, so a fresh tier hands out
        # contiguous runs, and a freed page is the next reused (still warm in cache).
        self._free: list[int] = list(range(total_pages - 1, -1, -1))
        self._retired_pages: set[int] = set()
        self._objects: OrderedDict[str, R] = OrderedDict()  # least recently used first
        self._leaving_pages = 0
        self._pinned_retired = 0
        # Watermarks capped at the usable pages, kept current by retire_page: the put
        # path of every tier asks `needs_room`, so it must stay a few operations.
        self._high_cap = high_pages
        self._low_cap = low_pages

    # ------------------------------------------------------------------- pages

    @property
    def usable_pages(self) -> int:
        """Pages not retired for good: free + used == this."""
        return self.total_pages - len(self._retired_pages)

    @property
    def free_page_count(self) -> int:
        return len(self._free)

    @property
    def leaving_pages(self) -> int:
        """Pages of victims chosen and not yet gone (being demoted)."""
        return self._leaving_pages

    @property
    def used_pages(self) -> int:
        """Reserved pages, and pages of resident or pinned retired objects."""
        return self.total_pages - len(self._retired_pages) - len(self._free)

    def fits(self, page_count: int) -> bool:
        """Could an object of `page_count` pages ever be held (the tier emptied for it)?"""
        return page_count <= self.total_pages - len(self._retired_pages)

    def take_pages(self, count: int) -> tuple[int, ...] | None:
        """Reserve the `count` most recently freed pages, in ascending order: the order an
        object uses them (None: too few). Ascending, because the pages on top of the stack
        are often adjacent but stacked in reverse: single-page objects retired oldest
        first leave ..., 7, 8, 9 on top, and a copy into pages 9, 8, 7 is three copies
        where 7, 8, 9 is one (a server's 1 MiB objects after a clear of 64 KiB ones were
        16 regions each: copied with their hash at 9.7 GB/s, as one region at 11.4)."""
        free = self._free
        if count > len(free):
            return None
        if count == 1:
            return (free.pop(),)
        pages = tuple(sorted(free[-count:]))
        del free[-count:]
        return pages

    def return_pages(self, pages: Iterable[int]) -> None:
        """Give reserved pages back (or the pages of a retired object); retired pages stay
        out. Pushed in reverse so that the next take hands them out in the same order."""
        retired = self._retired_pages
        pages = tuple(pages)
        if retired:
            self._free.extend(page for page in reversed(pages) if page not in retired)
        elif len(pages) == 1:  # the common case for KV blocks
            self._free.append(pages[0])
        else:
            self._free.extend(reversed(pages))

    def retire_page(self, page: int) -> None:
        """Never hand `page` out again (a write there failed). It must be reserved, not
        free: the caller retires a page of the reservation it is about to give back."""
        assert page not in self._free, f"page {page} is free"
        self._retired_pages.add(page)
        usable = self.total_pages - len(self._retired_pages)
        self._high_cap = min(self.high_pages, usable)
        self._low_cap = min(self.low_pages, usable)

    # ----------------------------------------------------------------- objects

    def get(self, key: str) -> R | None:
        return self._objects.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def residency(self, keys: Iterable[str]) -> bytes:
        """One byte per key: 1 when it is resident, else 0 (at C speed: a lookup asks
        about every block of a prompt)."""
        return bytes(map(self._objects.__contains__, keys))

    def entries(self) -> Iterator[R]:
        """Resident objects, least recently used first."""
        return iter(self._objects.values())

    def keys(self) -> tuple[str, ...]:
        """Resident keys, least recently used first."""
        return tuple(self._objects)

    def admit(self, entry: R) -> None:
        """Make `entry` (whose pages the caller reserved) resident, most recently used."""
        assert entry.key not in self._objects, f"{entry.key!r} is resident already"
        self._objects[entry.key] = entry

    def touch(self, entry: R) -> None:
        """Mark as most recently used (nothing when `entry` is no longer resident)."""
        if self._objects.get(entry.key) is entry:
            self._objects.move_to_end(entry.key)

    def retire(self, entry: R) -> None:
        """Take `entry` out; its pages come back now, or at its last unpin."""
        if entry.retired:
            return
        if self._objects.get(entry.key) is entry:
            del self._objects[entry.key]
        entry.retired = True
        if entry.pins == 0:
            self.return_pages(entry.pages)
        else:
            self._pinned_retired += 1

    def pin(self, entry: R) -> None:
        entry.pins += 1

    def unpin(self, entry: R) -> None:
        assert entry.pins > 0, f"{entry.key!r} is not pinned"
        entry.pins -= 1
        if entry.pins == 0 and entry.retired:
            self._pinned_retired -= 1
            self.return_pages(entry.pages)

    @property
    def pinned_retired(self) -> int:
        """Retired objects still pinned (their pages are not free yet)."""
        return self._pinned_retired

    def clear(self) -> int:
        """Retire every resident object (pinned ones free their pages at unpin); returns
        how many there were."""
        entries = list(self._objects.values())
        for entry in entries:
            self.retire(entry)
        return len(entries)

    def reset(self) -> None:
        """Forget every object and reservation at once: every usable page is free again,
        in fresh order. Only for a tier that holds no pins and no reservations."""
        assert self._pinned_retired == 0 and self._leaving_pages == 0, "pins outstanding"
        for entry in self._objects.values():
            entry.retired = True
        self._objects.clear()
        retired = self._retired_pages
        self._free = [page for page in range(self.total_pages - 1, -1, -1) if page not in retired]

    def restore(self, entries: Iterable[R]) -> None:
        """Fill an empty tier with `entries` (least recently used first) whose pages were
        found in place (an SSD file reopened); every other usable page becomes free.
        Raises ValueError when two entries claim one page or a page is out of range."""
        assert not self._objects, "restore needs an empty tier"
        owned: set[int] = set()
        for entry in entries:
            for page in entry.pages:
                if page in owned or not 0 <= page < self.total_pages:
                    raise ValueError(f"page {page} of {entry.key!r} is out of range or taken")
                owned.add(page)
            self._objects[entry.key] = entry
        excluded = owned | self._retired_pages
        self._free = [
            page for page in range(self.total_pages - 1, -1, -1) if page not in excluded
        ]

    # ---------------------------------------------------------------- eviction

    def needs_room(self, pages_needed: int) -> bool:
        """Would taking `pages_needed` more pages cross the high watermark? Pages of
        objects already leaving count as free."""
        used = self.total_pages - len(self._retired_pages) - len(self._free)
        return used - self._leaving_pages + pages_needed > self._high_cap

    def choose_victims(self, pages_needed: int) -> list[R]:
        """Least recently used objects, neither pinned nor already leaving, until usage
        including `pages_needed` more pages is at or below the low watermark (or nothing
        more can go). Each is marked leaving and pinned: hand it to `finish_leaving` once
        dealt with (demoted or not)."""
        victims: list[R] = []
        target = self._low_cap
        for entry in self._objects.values():
            if self.used_pages - self._leaving_pages + pages_needed <= target:
                break
            if entry.pins or entry.leaving:
                continue
            entry.leaving = True
            entry.pins += 1
            self._leaving_pages += len(entry.pages)
            victims.append(entry)
        return victims

    def finish_leaving(self, entry: R) -> None:
        """A victim has been dealt with: retire it and drop the pin it was chosen with."""
        assert entry.leaving, f"{entry.key!r} is not leaving"
        entry.leaving = False
        self._leaving_pages -= len(entry.pages)
        self.retire(entry)
        self.unpin(entry)

    def evict(self, pages_needed: int) -> list[R]:
        """For a tier with nowhere to move victims: when `pages_needed` more pages would
        cross the high watermark, retire the victims at once; returns them, LRU first."""
        if not self.needs_room(pages_needed):
            return []
        victims = self.choose_victims(pages_needed)
        for victim in victims:
            self.finish_leaving(victim)
        return victims
