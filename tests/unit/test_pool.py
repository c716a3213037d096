"""Example-based tests of SlabPool, the embedded DRAM tier (umbp/runtime/pool.py)."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from umbp.runtime import (
    LoadStatus,
    PoolStats,
    SchedulerStore,
    SlabPool,
    StoreUnavailable,
    WorkerStore,
)

PAGE = 4096


def content(seed: int, size: int) -> bytes:
    """Deterministic, seed-specific bytes (distinct seeds give distinct contents)."""
    return random.Random(seed).randbytes(size)


def make_pool(pages: int = 16, high: float = 0.95, low: float = 0.85) -> SlabPool:
    return SlabPool(pages * PAGE, page_bytes=PAGE, high_watermark=high, low_watermark=low)


def load(pool: SlabPool, key: str, size: int) -> tuple[LoadStatus, bytes]:
    out = bytearray(size)
    (status,) = pool.get_batch_into([key], [memoryview(out)])
    return status, bytes(out)


def owned_pages(pool: SlabPool, keys: list[str]) -> list[int]:
    """Pages owned by the resident keys among `keys`, as seen through object_regions."""
    pages: list[int] = []
    for key, resident in zip(keys, pool.lookup(keys)):
        if resident:
            pages.extend(offset // pool.page_bytes for offset, _ in pool.object_regions(key))
    return pages


def assert_pages_accounted(pool: SlabPool, keys: list[str]) -> None:
    pages = owned_pages(pool, keys)
    assert len(pages) == len(set(pages)), "a page is owned by two objects"
    assert len(pages) + pool.free_page_count() == pool.total_pages
    assert pool.stats().used_bytes == len(pages) * pool.page_bytes


# ------------------------------------------------------------------ round trips


def test_single_page_object_round_trips() -> None:
    pool = make_pool()
    data = content(1, 1000)
    assert pool.put_batch(["a"], [memoryview(data)]) == (True,)
    assert load(pool, "a", len(data)) == (LoadStatus.HIT, data)


def test_object_spanning_pages_round_trips_with_a_partial_last_page() -> None:
    pool = make_pool()
    data = content(2, 3 * PAGE + PAGE // 2)
    assert pool.put_batch(["big"], [memoryview(data)]) == (True,)
    regions = pool.object_regions("big")
    assert [length for _, length in regions] == [PAGE, PAGE, PAGE, PAGE // 2]
    assert all(offset % PAGE == 0 for offset, _ in regions)
    assert load(pool, "big", len(data)) == (LoadStatus.HIT, data)


def test_object_on_non_contiguous_pages_round_trips() -> None:
    pool = make_pool(pages=8)
    for index in range(6):
        assert pool.put_batch([f"k{index}"], [content(index, PAGE)]) == (True,)
    for victim in ("k1", "k3"):  # corrupt two objects so their pages return to the free list
        offset, _ = pool.object_regions(victim)[0]
        pool.slab_view()[offset] ^= 0xFF
        assert load(pool, victim, PAGE)[0] is LoadStatus.CORRUPT
    data = content(99, 3 * PAGE)
    assert pool.put_batch(["spread"], [data]) == (True,)
    pages = sorted(offset // PAGE for offset, _ in pool.object_regions("spread"))
    assert pages != list(range(pages[0], pages[0] + 3)), "expected a fragmented placement"
    assert load(pool, "spread", len(data)) == (LoadStatus.HIT, data)
    for index in (0, 2, 4, 5):
        assert load(pool, f"k{index}", PAGE) == (LoadStatus.HIT, content(index, PAGE))


def test_zero_length_object_round_trips_and_takes_one_page() -> None:
    """The paging rule of every tier (umbp.runtime.paging): an empty object takes a page,
    so every resident object costs capacity."""
    pool = make_pool()
    free_before = pool.free_page_count()
    assert pool.put_batch(["empty"], [b""]) == (True,)
    assert pool.lookup(["empty"]) == (True,)
    assert load(pool, "empty", 0) == (LoadStatus.HIT, b"")
    ((offset, length),) = pool.object_regions("empty")
    assert length == 0 and offset % PAGE == 0
    assert pool.free_page_count() == free_before - 1
    assert pool.stats().used_bytes == PAGE


def test_numpy_buffers_of_any_dtype_and_shape_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    pool = make_pool()
    rows = np.arange(3 * 2048, dtype=np.uint8).reshape(3, 2048)  # like tensor rows via .numpy()
    halves = np.linspace(0, 1, 1024, dtype=np.float16).reshape(32, 32)
    assert pool.put_batch(["r0", "r1", "h"], [rows[0], rows[1], halves]) == (True, True, True)
    outs = np.zeros((2, 2048), dtype=np.uint8)
    half_out = np.zeros_like(halves)
    statuses = pool.get_batch_into(["r1", "r0", "h"], [outs[0], outs[1], half_out])
    assert statuses == (LoadStatus.HIT, LoadStatus.HIT, LoadStatus.HIT)
    assert (outs[0] == rows[1]).all() and (outs[1] == rows[0]).all()
    assert (half_out == halves).all()


def test_batch_results_come_one_per_key_in_order() -> None:
    pool = make_pool()
    data = [content(seed, 100 * (seed + 1)) for seed in range(4)]
    assert pool.put_batch(["a", "b", "c", "d"], data) == (True,) * 4
    outs = [bytearray(len(item)) for item in data]
    outs.insert(2, bytearray(5))
    statuses = pool.get_batch_into(["a", "b", "nope", "c", "d"], outs)
    assert statuses == (
        LoadStatus.HIT,
        LoadStatus.HIT,
        LoadStatus.MISSING,
        LoadStatus.HIT,
        LoadStatus.HIT,
    )
    assert [bytes(out) for out in outs[:2] + outs[3:]] == data


def test_resident_key_is_acknowledged_without_rewrite() -> None:
    pool = make_pool()
    first, second = content(1, 500), content(2, 500)
    assert pool.put_batch(["k"], [first]) == (True,)
    assert pool.put_batch(["k"], [second]) == (True,)
    assert load(pool, "k", 500) == (LoadStatus.HIT, first)
    assert pool.stats().puts == 1
    assert pool.stats().bytes_written == 500


def test_duplicate_key_within_one_batch_keeps_the_first_payload() -> None:
    pool = make_pool()
    first, second = content(1, 64), content(2, 64)
    assert pool.put_batch(["k", "k"], [first, second]) == (True, True)
    assert load(pool, "k", 64) == (LoadStatus.HIT, first)


def test_stored_keys_lists_residents_least_recently_used_first() -> None:
    pool = make_pool()
    pool.put_batch(["a", "b", "c"], [b"1", b"2", b"3"])
    load(pool, "a", 1)
    assert pool.stored_keys() == ("b", "c", "a")


def test_lookup_answers_residency_for_a_thousand_keys() -> None:
    pool = SlabPool(2000 * 64, page_bytes=64)
    stored = [f"key-{index}" for index in range(0, 2000, 2)]
    assert all(pool.put_batch(stored, [content(index, 64) for index in range(1000)]))
    asked = [f"key-{index}" for index in range(1000)]
    assert pool.lookup(asked) == tuple(index % 2 == 0 for index in range(1000))
    assert pool.lookup([]) == ()


# ------------------------------------------------------------------ eviction


def test_eviction_removes_least_recently_used_down_to_low_watermark() -> None:
    pool = make_pool(pages=10, high=0.8, low=0.5)  # high = 8 pages, low = 5 pages
    keys = [f"k{index}" for index in range(8)]
    assert all(pool.put_batch(keys, [content(index, PAGE) for index in range(8)]))
    assert pool.stats().evictions == 0, "reaching the high watermark must not evict"
    assert load(pool, "k0", PAGE)[0] is LoadStatus.HIT  # a load makes k0 most recent
    assert pool.put_batch(["k1"], [content(1, PAGE)]) == (True,)  # a re-put makes k1 recent
    pool.lookup(["k2"])  # asking is not using: k2 stays least recent

    assert pool.put_batch(["new"], [content(100, PAGE)]) == (True,)

    assert pool.take_evicted_keys() == ("k2", "k3", "k4", "k5")
    assert pool.lookup(keys + ["new"]) == (
        True,
        True,
        False,
        False,
        False,
        False,
        True,
        True,
        True,
    )
    stats = pool.stats()
    assert stats.used_bytes == 5 * PAGE
    assert stats.evictions == 4
    assert_pages_accounted(pool, keys + ["new"])


def test_eviction_makes_room_for_a_multi_page_object() -> None:
    pool = make_pool(pages=10, high=0.8, low=0.5)
    keys = [f"k{index}" for index in range(7)]
    assert all(pool.put_batch(keys, [content(index, PAGE) for index in range(7)]))
    data = content(50, 3 * PAGE)
    assert pool.put_batch(["wide"], [data]) == (True,)  # 7 + 3 > 8: evict to 5 - 3 = 2 left
    assert pool.take_evicted_keys() == tuple(keys[:5])
    assert pool.stats().used_bytes == 5 * PAGE
    assert load(pool, "wide", len(data)) == (LoadStatus.HIT, data)


def test_object_of_the_whole_pool_is_accepted_by_evicting_everything() -> None:
    pool = make_pool(pages=4)
    assert all(pool.put_batch(["a", "b"], [content(1, PAGE), content(2, PAGE)]))
    whole = content(3, 4 * PAGE)
    assert pool.put_batch(["whole"], [whole]) == (True,)
    assert set(pool.take_evicted_keys()) == {"a", "b"}
    assert load(pool, "whole", len(whole)) == (LoadStatus.HIT, whole)
    assert pool.free_page_count() == 0


def test_object_larger_than_the_pool_is_rejected_and_nothing_is_evicted() -> None:
    pool = make_pool(pages=4)
    assert pool.put_batch(["a"], [content(1, PAGE)]) == (True,)
    assert pool.put_batch(["huge", "b"], [content(2, 4 * PAGE + 1), content(3, 10)]) == (
        False,
        True,
    )
    assert pool.lookup(["huge", "a", "b"]) == (False, True, True)
    assert pool.take_evicted_keys() == ()
    assert pool.stats().put_rejects == 1


# ------------------------------------------------------------------ integrity


@pytest.mark.parametrize("piece", [0, 1, 2])
def test_flipped_byte_is_detected_and_the_object_dropped(piece: int) -> None:
    pool = make_pool()
    data = content(7, 2 * PAGE + 10)
    pool.put_batch(["victim", "bystander"], [data, content(8, 100)])
    free_before = pool.free_page_count()
    offset, length = pool.object_regions("victim")[piece]
    pool.slab_view()[offset + length - 1] ^= 0x01

    status, _ = load(pool, "victim", len(data))

    assert status is LoadStatus.CORRUPT
    assert pool.lookup(["victim", "bystander"]) == (False, True)
    assert pool.take_evicted_keys() == ("victim",)
    assert pool.stats().corrupt_loads == 1
    assert pool.free_page_count() == free_before + 3
    assert load(pool, "victim", len(data))[0] is LoadStatus.MISSING
    assert load(pool, "bystander", 100) == (LoadStatus.HIT, content(8, 100))


def test_corrupt_key_can_be_stored_again() -> None:
    pool = make_pool()
    data = content(7, 100)
    pool.put_batch(["k"], [data])
    pool.slab_view()[pool.object_regions("k")[0][0]] ^= 0xFF
    assert load(pool, "k", 100)[0] is LoadStatus.CORRUPT
    assert pool.put_batch(["k"], [data]) == (True,)
    assert load(pool, "k", 100) == (LoadStatus.HIT, data)
    assert pool.take_evicted_keys() == (), "a key stored again is resident, not evicted"


@pytest.mark.parametrize("size", [99, 101, 0])
def test_wrong_size_destination_is_refused_and_left_untouched(size: int) -> None:
    pool = make_pool()
    data = content(3, 100)
    pool.put_batch(["k"], [data])
    out = bytearray(b"\xaa" * size)
    assert pool.get_batch_into(["k"], [out]) == (LoadStatus.SIZE_MISMATCH,)
    assert out == bytearray(b"\xaa" * size)
    assert load(pool, "k", 100) == (LoadStatus.HIT, data)


# ------------------------------------------------------------------ clear, stats, drain


def test_clear_empties_the_pool_without_reporting_evictions() -> None:
    pool = make_pool(pages=4, high=0.5, low=0.25)
    pool.put_batch(["a", "b", "c"], [content(1, PAGE), content(2, PAGE), content(3, PAGE)])
    assert pool.stats().evictions > 0  # an eviction report is pending
    assert pool.clear() is True
    assert pool.lookup(["a", "b", "c"]) == (False, False, False)
    assert pool.take_evicted_keys() == ()
    assert pool.stats().used_bytes == 0 and pool.stats().objects == 0
    assert pool.free_page_count() == 4
    assert pool.put_batch(["a"], [content(1, PAGE)]) == (True,), "puts work after clear"
    assert load(pool, "a", PAGE) == (LoadStatus.HIT, content(1, PAGE))


def test_stats_count_every_outcome() -> None:
    pool = make_pool(pages=4, high=1.0, low=0.5)
    pool.put_batch(["a", "b"], [content(1, PAGE + 1), content(2, 10)])  # 2 + 1 pages
    pool.put_batch(["a", "huge"], [content(1, 1), content(9, 5 * PAGE)])  # resident, reject
    load(pool, "a", PAGE + 1)
    load(pool, "gone", 5)
    load(pool, "b", 11)  # size mismatch: neither hit nor miss
    pool.slab_view()[pool.object_regions("b")[0][0]] ^= 0xFF
    load(pool, "b", 10)  # corrupt
    pool.put_batch(["c", "d"], [content(3, 2 * PAGE), content(4, 2 * PAGE)])  # d evicts

    assert pool.stats() == PoolStats(
        capacity_bytes=4 * PAGE,
        used_bytes=2 * PAGE,
        page_bytes=PAGE,
        objects=1,
        hits=1,
        misses=1,
        puts=4,
        put_rejects=1,
        evictions=2,
        corrupt_loads=1,
        bytes_written=PAGE + 1 + 10 + 4 * PAGE,
        bytes_read=PAGE + 1,
    )
    assert pool.take_evicted_keys() == ("b", "a", "c")


def test_capacity_is_rounded_down_to_whole_pages() -> None:
    pool = SlabPool(10 * PAGE + 123, page_bytes=PAGE)
    assert pool.total_pages == 10
    assert pool.stats().capacity_bytes == 10 * PAGE


def test_evicted_keys_are_drained_once() -> None:
    pool = make_pool(pages=2, high=1.0, low=0.5)
    pool.put_batch(["a", "b", "c"], [content(1, PAGE), content(2, PAGE), content(3, PAGE)])
    assert pool.take_evicted_keys() == ("a", "b")
    assert pool.take_evicted_keys() == ()


def test_key_stored_again_after_eviction_is_not_reported() -> None:
    pool = make_pool(pages=2, high=1.0, low=0.5)
    pool.put_batch(["a", "b", "c"], [content(1, PAGE), content(2, PAGE), content(3, PAGE)])
    pool.put_batch(["a"], [content(1, PAGE)])  # a and b were evicted; a comes back
    assert pool.take_evicted_keys() == ("b",)
    assert pool.lookup(["a", "b", "c"]) == (True, False, True)


# ------------------------------------------------------------------ lending in place


def test_a_lent_object_is_read_in_place_and_verified_like_a_get() -> None:
    pool = make_pool()
    pool.put_batch(["a", "b"], [content(1, 3000), content(2, 3000)])
    loan = pool.lend(["b", "gone", "a"], 3000)
    assert loan is not None
    pages_b, missing, pages_a = loan.pages
    assert missing is None and pages_a is not None and pages_b is not None
    assert bytes(loan.memory[pages_a[0], :3000]) == content(1, 3000)
    assert bytes(loan.memory[pages_b[0], :3000]) == content(2, 3000)
    assert loan.verify() == (LoadStatus.HIT, LoadStatus.MISSING, LoadStatus.HIT)
    loan.release()
    assert pool.stored_keys() == ("b", "a")  # verified in key order: most recent last
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.bytes_read) == (2, 1, 6000)
    other_size = pool.lend(["a"], 2999)
    assert other_size.verify() == (LoadStatus.SIZE_MISMATCH,)
    other_size.release()
    assert_pages_accounted(pool, ["a", "b"])


def test_a_lent_object_is_neither_evicted_nor_overwritten_until_released() -> None:
    pool = make_pool(pages=4, high=1.0, low=0.5)
    pool.put_batch(["a"], [content(1, PAGE)])
    loan = pool.lend(["a"], PAGE)
    (lent,) = loan.pages
    assert lent is not None
    # Four more pages through a four-page pool: everything else goes, the lent one stays.
    for index in range(4):
        pool.put_batch([f"x{index}"], [content(10 + index, PAGE)])
    assert pool.lookup(["a"]) == (True,)
    assert bytes(loan.memory[lent[0]]) == content(1, PAGE)
    # Every page but the lent one taken, and nothing left to evict: a put is refused.
    assert pool.put_batch(["big"], [content(9, 4 * PAGE)]) == (False,)
    pool.clear()  # cleared while lent: the pages come back when the loan is released
    assert bytes(loan.memory[lent[0]]) == content(1, PAGE)
    assert pool.free_page_count() == 3
    assert loan.verify() == (LoadStatus.HIT,)  # the bytes copied were the stored ones
    assert pool.free_page_count() == 3
    loan.release()
    assert pool.lookup(["a"]) == (False,)
    assert pool.free_page_count() == 4
    pool.put_batch(["b"], [content(2, PAGE)])
    assert load(pool, "b", PAGE) == (LoadStatus.HIT, content(2, PAGE))


def test_a_corrupt_lent_object_is_dropped_when_verified() -> None:
    pool = make_pool()
    pool.put_batch(["a"], [content(1, 100)])
    offset, _ = pool.object_regions("a")[0]
    view = pool.slab_view()
    view[offset + 7] ^= 0x10
    view.release()
    loan = pool.lend(["a"], 100)
    assert loan.pages[0] is not None  # lent: checked only by verify
    assert loan.verify() == (LoadStatus.CORRUPT,)
    loan.release()
    assert pool.lookup(["a"]) == (False,)
    assert pool.take_evicted_keys() == ("a",)
    assert pool.stats().corrupt_loads == 1
    assert_pages_accounted(pool, ["a"])


def test_closing_a_pool_with_a_loan_out_leaves_the_lent_memory_readable() -> None:
    pool = make_pool()
    pool.put_batch(["a"], [content(1, 100)])
    loan = pool.lend(["a"], 100)
    (lent,) = loan.pages
    assert lent is not None
    pool.close()
    assert bytes(loan.memory[lent[0], :100]) == content(1, 100)
    assert loan.verify() == (LoadStatus.HIT,)
    loan.release()
    closed = pool.lend(["a"], 100)
    assert closed.pages == (None,)
    assert closed.verify() == (LoadStatus.UNAVAILABLE,)
    closed.release()


def test_a_watcher_hears_of_the_slab_at_once_and_of_its_end_after_the_last_loan() -> None:
    """What a GPU worker registers: the slab, told at once; its end only when the pool is
    closed and the last loan and reservation are settled (before the slab can go)."""
    heard: list[tuple[str, int, int]] = []

    class Watcher:
        def mapped(self, address: int, nbytes: int) -> None:
            heard.append(("mapped", address, nbytes))

        def unmapping(self, address: int) -> None:
            heard.append(("unmapping", address, 0))

    pool = make_pool()
    pool.watch_lent_memory(Watcher())
    slab = pool.lent_memory()
    assert heard == [("mapped", int(slab.ctypes.data), int(slab.nbytes))]
    pool.put_batch(["a"], [content(1, 100)])
    loan = pool.lend(["a"], 100)
    reservation = pool.reserve(["b"], 100)
    pool.close()
    loan.release()
    assert len(heard) == 1  # the reservation is still out
    assert reservation.commit([True]) == (False,)
    assert heard[1:] == [("unmapping", int(slab.ctypes.data), 0)]
    pool.watch_lent_memory(Watcher())
    assert len(heard) == 2  # closed: nothing mapped to tell of


def test_a_loan_is_verified_at_most_once_and_released_exactly_once() -> None:
    pool = make_pool()
    pool.put_batch(["a"], [content(1, 100)])
    loan = pool.lend(["a"], 100)
    loan.release()  # released unverified (the copy failed): nothing counted
    with pytest.raises(RuntimeError, match="before its release"):
        loan.verify()
    with pytest.raises(RuntimeError, match="exactly once"):
        loan.release()
    assert pool.stats().hits == 0
    assert_pages_accounted(pool, ["a"])


# ------------------------------------------------------------------ writing in place


def test_a_reserved_object_written_in_place_is_stored_like_a_put() -> None:
    pool = make_pool()
    pool.put_batch(["old"], [content(9, 100)])
    reservation = pool.reserve(["new", "old", "empty"], 100)
    new_pages, old_pages, empty_pages = reservation.pages
    assert old_pages is None  # resident: nothing to write
    assert new_pages is not None and empty_pages is not None
    assert pool.lookup(["new"]) == (False,)  # not visible until committed
    reservation.memory[new_pages[0], :100] = np.frombuffer(content(1, 100), np.uint8)
    assert reservation.commit([True, False, False]) == (True, True, False)
    assert load(pool, "new", 100) == (LoadStatus.HIT, content(1, 100))
    assert pool.lookup(["empty"]) == (False,)
    assert pool.stats().puts == 2
    with pytest.raises(RuntimeError, match="exactly once"):
        reservation.commit([True, False, False])
    assert_pages_accounted(pool, ["old", "new"])


def test_a_key_being_written_in_place_is_not_reserved_twice() -> None:
    pool = make_pool()
    first = pool.reserve(["a"], 10)
    second = pool.reserve(["a"], 10)
    assert first.pages[0] is not None and second.pages == (None,)
    assert second.commit([False]) == (False,)
    assert first.commit([True]) == (True,)


def test_a_reservation_the_pool_was_cleared_under_stores_nothing() -> None:
    pool = make_pool(pages=2, high=1.0, low=0.5)
    reservation = pool.reserve(["a"], PAGE)
    assert reservation.pages[0] is not None
    pool.clear()
    assert pool.free_page_count() == 1  # the reserved page is not handed out meanwhile
    assert reservation.commit([True]) == (False,)
    assert pool.lookup(["a"]) == (False,)
    assert pool.free_page_count() == 2
    pool.close()
    closed = pool.reserve(["a"], 10)
    assert closed.pages == (None,) and closed.commit([False]) == (False,)


def test_objects_larger_than_a_page_are_lent_and_reserved_across_their_pages() -> None:
    pool = make_pool()
    data = content(7, 2 * PAGE + 100)
    reservation = pool.reserve(["big"], len(data))
    (pages,) = reservation.pages
    assert pages is not None and len(pages) == 3
    flat = np.concatenate([reservation.memory[page] for page in pages])
    flat[: len(data)] = np.frombuffer(data, np.uint8)
    for index, page in enumerate(pages):  # write the object back page by page
        reservation.memory[page] = flat[index * PAGE : (index + 1) * PAGE]
    assert reservation.commit([True]) == (True,)
    assert load(pool, "big", len(data)) == (LoadStatus.HIT, data)  # as a put stored it
    loan = pool.lend(["big"], len(data))
    (lent,) = loan.pages
    assert lent == pages
    assert bytes(np.concatenate([loan.memory[p] for p in lent])[: len(data)]) == data
    assert loan.verify() == (LoadStatus.HIT,)
    loan.release()
    assert_pages_accounted(pool, ["big"])


# ------------------------------------------------------------------ contract edges


def test_pool_satisfies_both_store_protocols() -> None:
    pool = make_pool()
    assert isinstance(pool, SchedulerStore)
    assert isinstance(pool, WorkerStore)


def test_closed_pool_refuses_work_without_crashing() -> None:
    pool = make_pool()
    pool.put_batch(["a"], [content(1, 10)])
    held = pool.slab_view()  # an outstanding view must not make close() fail
    pool.close()
    pool.close()
    with pytest.raises(StoreUnavailable):
        pool.lookup(["a"])
    assert pool.put_batch(["b"], [content(2, 10)]) == (False,)
    assert pool.get_batch_into(["a"], [bytearray(10)]) == (LoadStatus.UNAVAILABLE,)
    assert pool.clear() is False
    assert pool.take_evicted_keys() == ()
    assert pool.stats().objects == 0
    held.release()


def test_context_manager_closes_the_pool() -> None:
    with make_pool() as pool:
        pool.put_batch(["a"], [content(1, 10)])
    with pytest.raises(StoreUnavailable):
        pool.lookup(["a"])


def test_mismatched_batch_lengths_are_rejected() -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="keys and payloads differ in length: 2 != 1"):
        pool.put_batch(["a", "b"], [b"x"])
    with pytest.raises(ValueError, match="keys and outs differ in length: 1 != 0"):
        pool.get_batch_into(["a"], [])


def test_bad_buffer_in_a_batch_stores_nothing() -> None:
    np = pytest.importorskip("numpy")
    pool = make_pool()
    strided = np.zeros((4, 4), dtype=np.uint8)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        pool.put_batch(["good", "bad"], [b"ok", strided])
    assert pool.lookup(["good"]) == (False,)


def test_read_only_destination_is_rejected() -> None:
    pool = make_pool()
    pool.put_batch(["a"], [b"abc"])
    with pytest.raises(ValueError, match="read-only"):
        pool.get_batch_into(["a"], [b"xyz"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes must be positive, got 0"),
        ({"page_bytes": -1}, "page_bytes must be positive, got -1"),
        ({"capacity_bytes": 100, "page_bytes": 4096}, r"capacity_bytes \(100\) is smaller"),
        ({"high_watermark": 1.5}, r"high_watermark must be in \(0, 1\], got 1.5"),
        ({"high_watermark": 0.0}, r"high_watermark must be in \(0, 1\], got 0.0"),
        ({"low_watermark": 0.0}, r"low_watermark must be in \(0, 1\), got 0.0"),
        ({"low_watermark": 0.95}, r"low_watermark \(0.95\) must be below high_watermark"),
        ({"high_watermark": 0.5, "low_watermark": 0.6}, r"low_watermark \(0.6\) must be below"),
    ],
)
def test_invalid_arguments_are_named_in_the_error(kwargs: dict[str, float], message: str) -> None:
    arguments: dict[str, float] = {"capacity_bytes": 16 * PAGE, "page_bytes": PAGE}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        SlabPool(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_bytes": 1.5e6}, "capacity_bytes must be an int, got float"),
        ({"page_bytes": True}, "page_bytes must be an int, got bool"),
        ({"low_watermark": "0.5"}, "low_watermark must be a float, got str"),
    ],
)
def test_wrongly_typed_arguments_are_named_in_the_error(
    kwargs: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"capacity_bytes": 16 * PAGE, "page_bytes": PAGE}
    arguments.update(kwargs)
    with pytest.raises(TypeError, match=message):
        SlabPool(**arguments)  # type: ignore[arg-type]


# ------------------------------------------------------------------ concurrency


def test_concurrent_puts_and_gets_stay_consistent() -> None:
    """Several threads put, get and look up overlapping keys in a pool small enough to
    evict constantly; a HIT must always deliver the bytes that belong to the key (contents
    are a function of the key), nothing may be CORRUPT, and no page may leak."""
    pool = SlabPool(24 * 1024, page_bytes=1024)
    keys = [f"k{index}" for index in range(40)]
    sizes = {key: 1 + (index * 737) % 3000 for index, key in enumerate(keys)}
    contents = {key: content(index, sizes[key]) for index, key in enumerate(keys)}
    failures: list[str] = []
    hits = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            batch = rng.sample(keys, 3)
            if rng.random() < 0.5:
                results = pool.put_batch(batch, [contents[key] for key in batch])
                if not all(results):
                    failures.append(f"put rejected: {batch}")
            else:
                outs = [bytearray(sizes[key]) for key in batch]
                for key, out, status in zip(batch, outs, pool.get_batch_into(batch, outs)):
                    if status is LoadStatus.HIT:
                        hits[0] += 1
                        if bytes(out) != contents[key]:
                            failures.append(f"wrong bytes for {key}")
                    elif status is not LoadStatus.MISSING:
                        failures.append(f"{key}: {status}")
            pool.lookup(keys)
            pool.take_evicted_keys()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert failures == []
    assert hits[0] > 0, "the run never loaded anything; the test proves nothing"
    assert pool.stats().evictions > 0, "the run never evicted; the test proves nothing"
    assert_pages_accounted(pool, keys)
