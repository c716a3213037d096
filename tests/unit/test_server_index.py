"""The server's DRAM index: pages, reservations, pins and LRU victims (no bytes, no
sockets)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from umbp.runtime.server.index import Entry, PoolIndex, pages_for

PAGE = 4096


def make_index(total: int = 10, high: int = 9, low: int = 7) -> PoolIndex:
    return PoolIndex(total, PAGE, high_pages=high, low_pages=low)


def owned_pages(index: PoolIndex, extra: Sequence[Entry] = ()) -> list[int]:
    pages: list[int] = []
    for entry in list(index.entries()) + list(extra):
        for offset, length in entry.regions:
            pages.extend(range(offset // PAGE, offset // PAGE + pages_for(length, PAGE)))
    return pages


def test_a_fresh_index_hands_out_one_contiguous_region_per_object() -> None:
    index = make_index()
    assert index.reserve(3 * PAGE - 5) == ((0, 3 * PAGE - 5),)
    assert index.reserve(PAGE) == ((3 * PAGE, PAGE),)
    assert index.used_pages == 4
    assert index.reserve(0) == ((4 * PAGE, 0),), "an empty object takes a page too"
    assert index.used_pages == 5
    assert index.reserve(6 * PAGE) is None, "only 5 pages are left"


def test_fragmented_pages_come_back_as_several_regions_in_object_order() -> None:
    index = make_index()
    first = index.reserve(PAGE)
    middle = index.reserve(PAGE)
    third = index.reserve(PAGE)
    assert first is not None and middle is not None and third is not None
    index.release(first)
    index.release(third)
    regions = index.reserve(2 * PAGE + 10)
    assert regions is not None
    assert sum(length for _, length in regions) == 2 * PAGE + 10
    offsets = [offset for offset, _ in regions]
    assert middle[0][0] not in offsets
    assert index.used_pages == 4


def test_single_page_objects_cleared_oldest_first_leave_a_run_that_comes_back_as_one_region() -> None:
    index = make_index(total=8, high=8, low=8)
    for number in range(8):
        regions = index.reserve(PAGE)
        assert regions is not None
        index.insert(f"small-{number}", regions, PAGE, number)
    assert index.clear() == 8  # retired oldest first: page 7 is on top of the free stack
    assert index.reserve(4 * PAGE) == ((4 * PAGE, 4 * PAGE),), "one copy, not four"
    assert index.reserve(4 * PAGE) == ((0, 4 * PAGE),)


def test_a_retired_pinned_entry_keeps_its_pages_until_the_last_unpin() -> None:
    index = make_index()
    regions = index.reserve(2 * PAGE)
    assert regions is not None
    entry = index.insert("a", regions, 2 * PAGE, 1)
    index.pin(entry)
    index.pin(entry)
    index.retire(entry)
    assert "a" not in index and index.used_pages == 2 and index.pinned_retired == 1
    index.unpin(entry)
    assert index.used_pages == 2
    index.unpin(entry)
    assert index.used_pages == 0 and index.pinned_retired == 0


def test_clear_defers_pinned_entries_and_a_new_put_of_the_key_gets_new_pages() -> None:
    index = make_index()
    old_regions = index.reserve(PAGE)
    assert old_regions is not None
    old = index.insert("k", old_regions, PAGE, 1)
    index.pin(old)
    assert index.clear() == 1
    new_regions = index.reserve(PAGE)
    assert new_regions is not None and new_regions != old_regions
    index.insert("k", new_regions, PAGE, 2)
    index.retire(old)  # idempotent, must not touch the new entry
    assert index.get("k") is not None and index.get("k") is not old
    index.unpin(old)
    assert index.used_pages == 1


def test_victims_are_least_recently_used_unpinned_until_the_low_watermark() -> None:
    index = make_index(total=10, high=9, low=6)
    entries = []
    for name in "abcdefgh":
        regions = index.reserve(PAGE)
        assert regions is not None
        entries.append(index.insert(name, regions, PAGE, 0))
    index.pin(entries[0])  # "a" is in use: never a victim
    index.touch(entries[1])  # "b" becomes most recently used
    assert not index.needs_room(1) and index.needs_room(2)
    victims = index.choose_victims(2)
    assert [victim.key for victim in victims] == ["c", "d", "e", "f"]
    assert all(victim.leaving and victim.pins == 1 for victim in victims)
    assert not index.needs_room(2), "pages on their way out count as free"
    assert index.choose_victims(2) == [], "nothing more is needed"
    for victim in victims:
        index.finish_leaving(victim)
    assert index.used_pages == 4
    assert [entry.key for entry in index.entries()] == ["a", "g", "h", "b"]


def test_random_operations_keep_every_page_in_exactly_one_place() -> None:
    rng = random.Random(7)
    index = make_index(total=32, high=30, low=24)
    reservations: list[tuple[tuple[int, int], ...]] = []
    pinned_retired: list[Entry] = []
    serial = 0
    for _ in range(2000):
        choice = rng.random()
        if choice < 0.35:
            regions = index.reserve(rng.randrange(0, 5 * PAGE))
            if regions is not None:
                reservations.append(regions)
        elif choice < 0.6 and reservations:
            regions = reservations.pop(rng.randrange(len(reservations)))
            serial += 1
            index.insert(f"k{serial}", regions, sum(length for _, length in regions), 0)
        elif choice < 0.7 and reservations:
            index.release(reservations.pop(rng.randrange(len(reservations))))
        elif choice < 0.85 and len(index):
            entry = rng.choice(list(index.entries()))
            if rng.random() < 0.5 and not entry.pins:
                index.pin(entry)
                index.retire(entry)
                pinned_retired.append(entry)
            elif not entry.leaving:
                index.retire(entry)
        elif choice < 0.93 and pinned_retired:
            index.unpin(pinned_retired.pop())
        else:
            for victim in index.choose_victims(rng.randrange(1, 6)):
                index.finish_leaving(victim)
        reserved = [
            page
            for regions in reservations
            for offset, length in regions
            for page in range(offset // PAGE, offset // PAGE + pages_for(length, PAGE))
        ]
        owned = owned_pages(index, pinned_retired)
        free = index.total_pages - index.used_pages
        everything = reserved + owned
        assert len(everything) == len(set(everything)), "a page is in two places"
        assert len(everything) + free == index.total_pages


def test_an_index_without_pages_is_refused() -> None:
    with pytest.raises(ValueError):
        PoolIndex(0, PAGE, 0, 0)
