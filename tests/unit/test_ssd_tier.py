"""Example-based tests of SsdTier, the disk tier (umbp/runtime/ssd/tier.py): round trips,
LRU, reopen, damage found at open and at read, crashes at every write, full disks."""

from __future__ import annotations

import array
import errno
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from umbp.runtime import LoadStatus, StoreUnavailable
from umbp.runtime.ssd.format import MAX_KEY_BYTES, RECORD_BYTES, SLOT_FILE_NAME
from umbp.runtime.ssd.index import ForeignSlotFile
from umbp.runtime.ssd.tier import SsdTier
from umbp.testing.tmpfs import CannotMount, small_tmpfs

REPO = Path(__file__).resolve().parents[2]
SLOT = 4096


def content(seed: int, size: int) -> bytes:
    """Deterministic, seed-specific bytes (distinct seeds give distinct contents)."""
    return random.Random(seed).randbytes(size)


def read(tier: SsdTier, key: str, size: int) -> tuple[LoadStatus, bytes]:
    out = bytearray(size)
    status = tier.get_into(key, out)
    return status, bytes(out)


def flip_byte(path: Path, offset: int, bit: int = 0x01) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        (value,) = file.read(1)
        file.seek(offset)
        file.write(bytes([value ^ bit]))


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


@pytest.fixture
def open_tier(directory: Path) -> Iterator[Callable[..., SsdTier]]:
    """Opens tiers on `directory` and closes whatever a test left open."""
    opened: list[SsdTier] = []

    def make(slots: int = 8, slot_bytes: int = SLOT) -> SsdTier:
        tier = SsdTier(directory, slots * slot_bytes, slot_bytes)
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


def slot_accounting_holds(tier: SsdTier) -> bool:
    owned = [slot for key in tier.keys() for slot in tier.object_slots(key)]  # noqa: SIM118
    return (
        len(owned) == len(set(owned))
        and len(owned) + tier.free_slot_count() == tier.usable_slot_count()
    )


# --------------------------------------------------------------------- round trips


@pytest.mark.parametrize("size", [0, 1, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT + 5])
def test_roundtrip_is_bit_identical_below_at_and_above_one_slot(
    open_tier: Callable[..., SsdTier], size: int
) -> None:
    tier = open_tier()
    data = content(size, size)
    assert tier.put("k", data)
    assert tier.size_of("k") == size
    assert read(tier, "k", size) == (LoadStatus.HIT, data)
    assert len(tier.object_slots("k")) == max(1, -(-size // SLOT))
    stats = tier.stats()
    assert (stats.puts, stats.hits, stats.bytes_written, stats.bytes_read) == (1, 1, size, size)
    assert slot_accounting_holds(tier)


def test_any_contiguous_buffer_is_stored_as_its_bytes(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier()
    words = array.array("I", range(3000))
    assert tier.put("words", words)
    out = array.array("I", bytes(len(words) * words.itemsize))
    assert tier.get_into("words", out) is LoadStatus.HIT
    assert out == words


def test_resident_key_answers_true_without_rewriting(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier()
    assert tier.put("a", content(1, 100)) and tier.put("b", content(2, 100))
    assert tier.put("a", content(99, 100))  # a key names its content: not rewritten
    assert tier.keys() == ("b", "a")
    assert tier.stats().puts == 2
    assert read(tier, "a", 100) == (LoadStatus.HIT, content(1, 100))


def test_lru_eviction_order_when_full(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier(slots=4)
    for index, key in enumerate("abcd"):
        assert tier.put(key, content(index, SLOT))
    assert read(tier, "a", SLOT)[0] is LoadStatus.HIT  # a becomes most recent
    assert tier.lookup(["b"]) == (True,)  # asking is not using: b stays least recent
    assert tier.put("e", content(4, 2 * SLOT))  # needs two slots: evicts b, then c
    assert tier.keys() == ("d", "a", "e")
    assert tier.take_evicted_keys() == ("b", "c")
    assert tier.lookup(["a", "b", "c", "d", "e"]) == (True, False, False, True, True)
    assert tier.stats().evictions == 2
    for key, seed, size in (("a", 0, SLOT), ("d", 3, SLOT), ("e", 4, 2 * SLOT)):
        assert read(tier, key, size) == (LoadStatus.HIT, content(seed, size))
    assert slot_accounting_holds(tier)


def test_object_larger_than_the_tier_is_refused_without_evicting(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier(slots=4)
    assert tier.put("small", content(0, 10))
    assert not tier.put("huge", content(1, 4 * SLOT + 1))
    assert tier.keys() == ("small",)
    assert tier.stats().put_rejects == 1 and tier.stats().evictions == 0


def test_key_length_limit_is_in_utf8_bytes(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier()
    longest = "é" * (MAX_KEY_BYTES // 2)  # two UTF-8 bytes each
    assert MAX_KEY_BYTES >= 512
    assert tier.put(longest, b"x")
    assert not tier.put(longest + "a" * (MAX_KEY_BYTES % 2 + 1), b"y")
    assert not tier.put("\ud800", b"z")  # a lone surrogate has no UTF-8 form
    assert tier.keys() == (longest,)
    assert tier.stats().put_rejects == 2
    tier.close()
    reopened = open_tier()
    assert read(reopened, longest, 1) == (LoadStatus.HIT, b"x")


def test_size_mismatch_copies_nothing_and_keeps_the_object(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier()
    assert tier.put("k", content(0, 300))
    out = bytearray(b"\xaa" * 301)
    assert tier.get_into("k", out) is LoadStatus.SIZE_MISMATCH
    assert out == b"\xaa" * 301
    assert read(tier, "k", 300) == (LoadStatus.HIT, content(0, 300))


def test_missing_key_and_remove(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier()
    assert read(tier, "nope", 3)[0] is LoadStatus.MISSING
    assert tier.size_of("nope") is None
    assert tier.put("k", content(0, 2 * SLOT))
    assert tier.remove("k") and not tier.remove("k")
    assert read(tier, "k", 2 * SLOT)[0] is LoadStatus.MISSING
    assert tier.free_slot_count() == 8
    assert tier.stats().misses == 2
    assert tier.take_evicted_keys() == ()  # removed, not evicted


def test_unusable_buffers_are_caller_errors(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier()
    assert tier.put("k", b"abc")
    with pytest.raises(ValueError, match="read-only"):
        tier.get_into("k", b"xyz")
    with pytest.raises(ValueError, match="C-contiguous"):
        tier.put("j", memoryview(bytearray(8))[::2])


def test_geometry_is_validated(directory: Path) -> None:
    with pytest.raises(ValueError, match="smaller than one slot"):
        SsdTier(directory, 100, 4096)
    with pytest.raises(ValueError, match="positive"):
        SsdTier(directory, 4096, 0)
    with pytest.raises(TypeError):
        SsdTier(directory, True, 4096)


def test_files_are_private_and_preallocated(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier(slots=8)
    assert tier.path.parent.stat().st_mode & 0o777 == 0o700
    assert tier.path.stat().st_mode & 0o777 == 0o600
    size = tier.path.stat().st_size
    assert size == tier.slot_data_offset(8)
    assert tier.path.stat().st_blocks * 512 >= size  # blocks reserved, not a sparse file


def test_a_second_opener_is_refused(open_tier: Callable[..., SsdTier], directory: Path) -> None:
    tier = open_tier()
    with pytest.raises(OSError) as raised:
        SsdTier(directory, 8 * SLOT, SLOT)
    assert raised.value.errno == errno.EBUSY
    tier.close()
    open_tier().close()  # the lock went with the first handle


# ------------------------------------------------------------- clear and close


def test_clear_empties_the_tier_on_disk_too(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier()
    for index in range(4):
        assert tier.put(f"k{index}", content(index, SLOT + 7))
    assert tier.clear()
    assert tier.keys() == () and tier.stats().used_bytes == 0
    assert tier.free_slot_count() == 8
    assert tier.put("after", content(9, 10))
    tier.close()
    reopened = open_tier()
    assert reopened.keys() == ("after",)
    assert reopened.stats().dropped_at_open == 0


def test_close_makes_everything_unavailable(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier()
    assert tier.put("k", content(0, 10))
    tier.close()
    tier.close()  # idempotent
    assert tier.get_into("k", bytearray(10)) is LoadStatus.UNAVAILABLE
    assert not tier.put("j", b"x")
    assert not tier.remove("k") and not tier.clear()
    assert tier.size_of("k") is None and tier.keys() == ()
    with pytest.raises(StoreUnavailable):
        tier.lookup(["k"])
    with pytest.raises(StoreUnavailable):
        tier.flush()
    assert tier.stats().put_rejects == 1


# ------------------------------------------------------------------- reopening


def test_an_empty_object_takes_one_slot_and_survives_a_reopen(
    open_tier: Callable[..., SsdTier],
) -> None:
    """The paging rule of every tier (umbp.runtime.paging): an empty object takes one
    slot, which holds its header record, so it is found again after a reopen."""
    tier = open_tier()
    assert tier.put("empty", b"")
    assert len(tier.object_slots("empty")) == 1
    assert tier.stats().used_bytes == SLOT
    assert read(tier, "empty", 0) == (LoadStatus.HIT, b"")
    tier.close()
    reopened = open_tier()
    assert reopened.keys() == ("empty",)
    assert read(reopened, "empty", 0) == (LoadStatus.HIT, b"")
    assert slot_accounting_holds(reopened)


def test_reopen_rebuilds_the_same_objects_in_put_order(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier(slots=16)
    sizes = {"a": 1, "b": SLOT, "c": 3 * SLOT + 1, "d": 0, "e": 2 * SLOT}
    for seed, (key, size) in enumerate(sizes.items()):
        assert tier.put(key, content(seed, size))
    assert tier.remove("b")
    assert read(tier, "a", 1)[0] is LoadStatus.HIT  # recency is not persisted
    slots = {key: tier.object_slots(key) for key in tier.keys()}  # noqa: SIM118
    tier.flush()
    tier.close()

    reopened = open_tier(slots=16)
    assert reopened.keys() == ("a", "c", "d", "e")
    assert {key: reopened.object_slots(key) for key in reopened.keys()} == slots  # noqa: SIM118
    for seed, (key, size) in enumerate(sizes.items()):
        expected = (LoadStatus.MISSING, bytes(size)) if key == "b" else (
            LoadStatus.HIT, content(seed, size))
        assert read(reopened, key, size) == expected
    stats = reopened.stats()
    assert stats.dropped_at_open == 0 and stats.objects == 4
    assert slot_accounting_holds(reopened)
    assert reopened.put("f", content(7, 5 * SLOT))  # free slots were rebuilt too
    assert slot_accounting_holds(reopened)


def test_evicted_objects_stay_gone_after_reopen(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier(slots=3)
    for index in range(5):
        assert tier.put(f"k{index}", content(index, SLOT))
    tier.close()
    assert open_tier(slots=3).keys() == ("k2", "k3", "k4")


def test_other_geometry_or_damaged_superblock_resets(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier(slots=4)
    assert tier.put("k", content(0, 10))
    tier.close()
    resized = open_tier(slots=5)
    assert resized.keys() == () and resized.stats().dropped_at_open == 1
    assert resized.put("k", content(0, 10))
    path = resized.path
    resized.close()
    flip_byte(path, 20)
    damaged = open_tier(slots=5)
    assert damaged.keys() == () and damaged.stats().dropped_at_open == 1
    assert damaged.put("j", content(1, 10)) and damaged.keys() == ("j",)


def test_a_file_umbp_did_not_make_is_refused_untouched(directory: Path) -> None:
    directory.mkdir(mode=0o700)
    slot_file = directory / SLOT_FILE_NAME
    foreign = content(5, 100_000)
    slot_file.write_bytes(foreign)
    slot_file.chmod(0o600)
    with pytest.raises(ForeignSlotFile, match="is not an umbp SSD slot file") as refused:
        SsdTier(directory, 8 * SLOT, SLOT)
    assert str(slot_file) in str(refused.value)
    assert slot_file.read_bytes() == foreign
    slot_file.write_bytes(b"")  # an empty file is formatted (a start that died early)
    tier = SsdTier(directory, 8 * SLOT, SLOT)
    assert tier.put("k", content(1, 10)) and tier.stats().dropped_at_open == 0
    tier.close()


def test_damaged_header_record_drops_that_object_at_open(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier()
    assert tier.put("before", content(0, SLOT))
    assert tier.put("victim", content(1, 3 * SLOT))
    assert tier.put("after", content(2, SLOT))
    middle_slot = tier.object_slots("victim")[1]
    path, record = tier.path, tier.slot_record_offset(middle_slot)
    tier.close()
    flip_byte(path, record + 100)  # inside the key: only the record checksum notices

    reopened = open_tier()
    assert reopened.keys() == ("before", "after")
    # The damaged record, and the object left without its middle part.
    assert reopened.stats().dropped_at_open == 2
    assert read(reopened, "before", SLOT) == (LoadStatus.HIT, content(0, SLOT))
    assert read(reopened, "after", SLOT) == (LoadStatus.HIT, content(2, SLOT))
    assert slot_accounting_holds(reopened) and reopened.free_slot_count() == 6
    reopened.close()
    again = open_tier()  # the leftovers were zeroed: nothing to drop twice
    assert again.stats().dropped_at_open == 0 and again.keys() == ("before", "after")


def test_truncated_file_keeps_only_objects_whose_bytes_survive(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier()
    assert tier.put("whole", content(0, 2 * SLOT))  # slots 0-1
    assert tier.put("cut", content(1, 3 * SLOT))  # slots 2-4
    assert tier.put("gone", content(2, SLOT))  # slot 5
    path, cut_at = tier.path, tier.slot_data_offset(3) + 17
    tier.close()
    os.truncate(path, cut_at)

    reopened = open_tier()
    assert reopened.keys() == ("whole",)
    # "cut" and "gone", and (since issue 11) the truncation itself, which also loses
    # whatever was recorded past the cut.
    assert reopened.stats().dropped_at_open == 2 + 1
    assert read(reopened, "whole", 2 * SLOT) == (LoadStatus.HIT, content(0, 2 * SLOT))
    assert reopened.path.stat().st_size == reopened.slot_data_offset(8)  # grown back
    assert reopened.put("new", content(3, 6 * SLOT))
    assert read(reopened, "new", 6 * SLOT) == (LoadStatus.HIT, content(3, 6 * SLOT))


def test_file_truncated_into_the_header_area(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier()
    for index in range(8):
        assert tier.put(f"k{index}", content(index, 100))
    path, cut_at = tier.path, tier.slot_record_offset(3) + RECORD_BYTES // 2
    tier.close()
    os.truncate(path, cut_at)
    reopened = open_tier()
    assert reopened.keys() == ()  # every object's data was past the cut
    # three whole records, one torn, and (since issue 11) the truncation itself, which
    # stands for the records past the cut
    assert reopened.stats().dropped_at_open == 3 + 1 + 1
    assert slot_accounting_holds(reopened) and reopened.free_slot_count() == 8


def read_span(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(length)


def write_span(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def test_lost_writes_leaving_two_copies_keep_the_newest(
    open_tier: Callable[..., SsdTier],
) -> None:
    """After a power loss the zeroing of an old copy's record may not have reached the
    disk while a newer copy did: the newer generation wins, the older is dropped."""
    tier = open_tier()
    assert tier.put("a", content(0, 100)) and tier.object_slots("a") == (0,)
    path, old_record = tier.path, read_span(tier.path, tier.slot_record_offset(0), RECORD_BYTES)
    old_data = read_span(path, tier.slot_data_offset(0), 100)
    assert tier.remove("a")
    assert tier.put("filler", content(1, 100)) and tier.object_slots("filler") == (0,)
    assert tier.put("a", content(0, 100)) and tier.object_slots("a") == (1,)
    tier.close()
    write_span(path, tier.slot_record_offset(0), old_record)  # as if never zeroed...
    write_span(path, tier.slot_data_offset(0), old_data)  # ...nor overwritten

    reopened = open_tier()
    assert reopened.keys() == ("a",) and reopened.object_slots("a") == (1,)
    assert reopened.stats().dropped_at_open == 1
    assert read(reopened, "a", 100) == (LoadStatus.HIT, content(0, 100))
    assert reopened.free_slot_count() == 7
    reopened.close()
    assert open_tier().stats().dropped_at_open == 0


def test_stale_record_over_refilled_slots_is_never_served(
    open_tier: Callable[..., SsdTier],
) -> None:
    """The other lost-write case: a stale record survives while its slot now holds another
    object's bytes. The record is whole, so the object is rebuilt; its payload checksum
    catches it at the first read."""
    tier = open_tier()
    assert tier.put("old", content(0, 3000))
    path, stale = tier.path, read_span(tier.path, tier.slot_record_offset(0), RECORD_BYTES)
    assert tier.remove("old")
    assert tier.put("new", content(1, 3000)) and tier.object_slots("new") == (0,)
    tier.close()
    write_span(path, tier.slot_record_offset(0), stale)

    reopened = open_tier()
    assert reopened.keys() == ("old",)
    assert read(reopened, "old", 3000)[0] is LoadStatus.CORRUPT
    assert reopened.keys() == () and reopened.stats().corrupt_reads == 1


# ----------------------------------------------------------- damage at read time


def test_flipped_data_byte_answers_corrupt_then_missing(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier()
    assert tier.put("ok", content(0, SLOT))
    assert tier.put("bad", content(1, 2 * SLOT + 9))
    flip_byte(tier.path, tier.slot_data_offset(tier.object_slots("bad")[2]) + 4, 0x80)
    assert read(tier, "bad", 2 * SLOT + 9)[0] is LoadStatus.CORRUPT
    assert read(tier, "bad", 2 * SLOT + 9)[0] is LoadStatus.MISSING
    assert tier.take_evicted_keys() == ("bad",)
    assert read(tier, "ok", SLOT) == (LoadStatus.HIT, content(0, SLOT))
    stats = tier.stats()
    assert (stats.corrupt_reads, stats.hits, stats.objects) == (1, 1, 1)
    assert slot_accounting_holds(tier) and tier.free_slot_count() == 7
    tier.close()
    assert open_tier().keys() == ("ok",)  # the drop reached the disk


def test_data_damaged_while_closed_is_caught_at_the_first_read(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier()
    assert tier.put("k", content(0, 500))
    path, offset = tier.path, tier.slot_data_offset(tier.object_slots("k")[0]) + 499
    tier.close()
    flip_byte(path, offset)
    reopened = open_tier()
    assert reopened.keys() == ("k",)  # checksums are verified lazily, at read
    assert read(reopened, "k", 500)[0] is LoadStatus.CORRUPT
    assert reopened.keys() == ()


def test_file_truncated_under_an_open_tier_answers_corrupt(
    open_tier: Callable[..., SsdTier],
) -> None:
    tier = open_tier()
    assert tier.put("k", content(0, 3 * SLOT))
    os.truncate(tier.path, tier.slot_data_offset(1))
    assert read(tier, "k", 3 * SLOT)[0] is LoadStatus.CORRUPT
    assert tier.keys() == ()


def test_read_io_error_answers_unavailable_and_keeps_the_object(
    open_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier()
    assert tier.put("k", content(0, SLOT))

    def failing_preadv(*_: object) -> int:
        raise OSError(errno.EIO, "injected read error")

    monkeypatch.setattr(os, "preadv", failing_preadv)
    assert read(tier, "k", SLOT)[0] is LoadStatus.UNAVAILABLE
    monkeypatch.undo()
    assert read(tier, "k", SLOT) == (LoadStatus.HIT, content(0, SLOT))
    assert tier.stats().read_errors == 1


def test_write_io_error_leaves_nothing_readable(
    open_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier()
    assert tier.put("earlier", content(0, 2 * SLOT))
    real_pwritev = os.pwritev
    calls = 0

    def pwritev_failing_on_the_second_call(fd: int, buffers: Any, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:  # the first run of header records, after the data went in
            raise OSError(errno.EIO, "injected write error")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev_failing_on_the_second_call)
    assert not tier.put("failed", content(1, 3 * SLOT))
    monkeypatch.undo()
    assert tier.lookup(["failed"]) == (False,)
    assert read(tier, "earlier", 2 * SLOT) == (LoadStatus.HIT, content(0, 2 * SLOT))
    assert tier.stats().put_failures == 1
    assert slot_accounting_holds(tier) and tier.free_slot_count() == 6
    assert tier.put("next", content(2, 6 * SLOT))  # EIO retires nothing
    tier.close()
    assert open_tier().keys() == ("earlier", "next")


def test_concurrent_puts_and_gets_stay_exact(open_tier: Callable[..., SsdTier]) -> None:
    tier = open_tier(slots=64, slot_bytes=512)
    failures: list[str] = []

    def worker(offset: int) -> None:
        for index in range(offset, offset + 40):
            data = content(index, 700 + index)
            key = f"k{index}"
            if not tier.put(key, data):
                failures.append(f"put {key}")
            status, got = read(tier, key, len(data))
            if status is LoadStatus.HIT and got != data:
                failures.append(f"wrong bytes for {key}")

    threads = [threading.Thread(target=worker, args=(100 * n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert slot_accounting_holds(tier)
    for key in tier.keys():  # noqa: SIM118 (a tuple, not a dict view)
        index = int(key[1:])
        assert read(tier, key, 700 + index) == (LoadStatus.HIT, content(index, 700 + index))


class HeldReads:
    """`preadv` made to wait at a gate: reads stay in flight until the test lets go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.in_flight = 0
        self.count = threading.Condition()
        real_preadv = os.preadv

        def held_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
            with self.count:
                self.in_flight += 1
                self.count.notify_all()
            try:
                assert self.gate.wait(30), "the test never let the reads go"
                return real_preadv(fd, buffers, offset)
            finally:
                with self.count:
                    self.in_flight -= 1

        monkeypatch.setattr(os, "preadv", held_preadv)

    def until_in_flight(self, reads: int) -> None:
        with self.count:
            assert self.count.wait_for(lambda: self.in_flight == reads, 30)


def reading_thread(tier: SsdTier, key: str, size: int, into: list[object]) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.append(read(tier, key, size)))
    thread.start()
    return thread


def test_reads_of_several_objects_overlap_and_answer_lookups_meanwhile(
    open_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier()
    for index in range(3):
        assert tier.put(f"k{index}", content(index, SLOT))
    held = HeldReads(monkeypatch)
    got: list[object] = []
    threads = [reading_thread(tier, f"k{index}", SLOT, got) for index in range(3)]
    held.until_in_flight(3)  # all three inside preadv at once
    assert tier.lookup(["k0", "k9"]) == (True, False), "the index is not held by reads"
    held.gate.set()
    for thread in threads:
        thread.join(30)
    assert sorted(got) == sorted((LoadStatus.HIT, content(index, SLOT)) for index in range(3))
    assert tier.stats().hits == 3


def test_a_put_that_evicts_an_object_being_read_waits_for_the_read(
    open_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(slots=1)
    assert tier.put("old", content(0, SLOT))
    held = HeldReads(monkeypatch)
    got: list[object] = []
    reader = reading_thread(tier, "old", SLOT, got)
    held.until_in_flight(1)
    put_done = threading.Event()
    writer = threading.Thread(
        target=lambda: (tier.put("new", content(2, SLOT)), put_done.set()))
    writer.start()
    assert not put_done.wait(0.2), "the put refilled a slot while it was being read"
    held.gate.set()
    reader.join(30)
    writer.join(30)
    assert got == [(LoadStatus.HIT, content(0, SLOT))]
    assert put_done.is_set() and tier.keys() == ("new",)
    assert read(tier, "new", SLOT) == (LoadStatus.HIT, content(2, SLOT))


def test_two_reads_of_one_corrupt_object_drop_it_once(
    open_tier: Callable[..., SsdTier], directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier()
    assert tier.put("k", content(0, SLOT))
    assert tier.put("kept", content(1, SLOT))
    flip_byte(directory / SLOT_FILE_NAME, tier.slot_data_offset(tier.object_slots("k")[0]))
    held = HeldReads(monkeypatch)
    got: list[object] = []
    threads = [reading_thread(tier, "k", SLOT, got) for _ in range(2)]
    held.until_in_flight(2)
    held.gate.set()
    for thread in threads:
        thread.join(30)
    assert [status for status, _ in got] == [LoadStatus.CORRUPT] * 2  # type: ignore[misc]
    assert tier.keys() == ("kept",) and tier.take_evicted_keys() == ("k",)
    assert slot_accounting_holds(tier) and tier.free_slot_count() == 7
    assert tier.stats().corrupt_reads == 2


def test_reads_beside_puts_removes_and_clears_never_serve_wrong_bytes(
    open_tier: Callable[..., SsdTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads run outside the index lock now: whatever refills, frees or clears slots
    meanwhile, a read answers the object's exact bytes or MISSING, never other bytes and
    never CORRUPT (nothing here damages the file). Each `preadv` first pauses a little,
    so that the writer's calls land while reads are in flight: with a put that does not
    wait for the reads (its `alone` taken out), this failed 5 runs of 5."""
    real_preadv = os.preadv

    def slow_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        threading.Event().wait(0.0005)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    tier = open_tier(slots=24, slot_bytes=512)
    keys = 20
    sizes = {index: 300 + 60 * index for index in range(keys)}  # 1 to 3 slots each
    failures: list[str] = []
    stop = threading.Event()

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            index = rng.randrange(keys)
            status, got = read(tier, f"k{index}", sizes[index])
            if status is LoadStatus.HIT and got != content(index, sizes[index]):
                failures.append(f"wrong bytes for k{index}")
            elif status not in (LoadStatus.HIT, LoadStatus.MISSING):
                failures.append(f"k{index}: {status}")

    def writer() -> None:
        rng = random.Random(99)
        for step in range(800):
            index = rng.randrange(keys)
            if step % 97 == 0:
                tier.clear()
            elif step % 7 == 0:
                tier.remove(f"k{index}")
            else:  # twice the tier's room in all: most puts evict what others read
                tier.put(f"k{index}", content(index, sizes[index]))
        stop.set()

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(3)]
    threads.append(threading.Thread(target=writer))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert stop.is_set() and failures == []
    assert slot_accounting_holds(tier)
    assert tier.stats().corrupt_reads == 0


# ------------------------------------------------------------------- crashes

CRASH_SLOT = 64
CRASH_SLOTS = 8


def crash_scenario(tier: SsdTier, completed: list[str]) -> None:
    """Runs in a forked child: a put spanning a hole (two runs of slots, so two data and
    two header writes), a put that evicts two objects, a remove, a last put."""
    for key, seed, size in (("b", 11, 3 * CRASH_SLOT - 5), ("c", 12, 4 * CRASH_SLOT)):
        assert tier.put(key, content(seed, size))
        completed.append(key)
    assert tier.remove("a3")
    completed.remove("a3")
    assert tier.put("d", content(13, CRASH_SLOT))
    completed.append("d")


CRASH_CONTENTS = {
    "a0": (0, 2 * CRASH_SLOT), "a1": (1, CRASH_SLOT), "a2": (2, 2 * CRASH_SLOT - 1),
    "a3": (3, CRASH_SLOT), "b": (11, 3 * CRASH_SLOT - 5), "c": (12, 4 * CRASH_SLOT),
    "d": (13, CRASH_SLOT),
}  # fmt: skip


def run_crashing_child(directory: Path, crash_at: int) -> dict[str, list[str]] | None:
    """Fork a child that runs `crash_scenario` and SIGKILLs itself just before its
    `crash_at`-th write (`pwritev`), reporting what was resident and which puts had returned.
    None when the scenario finished before reaching that write."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            tier = SsdTier(directory, CRASH_SLOTS * CRASH_SLOT, CRASH_SLOT)
            completed = list(tier.keys())
            real_pwritev = os.pwritev
            calls = 0

            def pwritev_then_die(fd: int, buffers: Any, offset: int) -> int:
                nonlocal calls
                if calls == crash_at:
                    report = {"resident": list(tier._slots.keys()), "completed": completed}
                    os.write(write_end, json.dumps(report).encode())
                    os.kill(os.getpid(), signal.SIGKILL)
                calls += 1
                return real_pwritev(fd, buffers, offset)

            os.pwritev = pwritev_then_die  # type: ignore[assignment]
            crash_scenario(tier, completed)
            os.write(write_end, b"null")
            os._exit(0)
        finally:
            os._exit(1)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert report, f"child died without a report (wait status {status})"
    outcome: dict[str, list[str]] | None = json.loads(report)
    if outcome is None:
        assert os.waitstatus_to_exitcode(status) == 0
    else:
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
    return outcome


def test_crash_at_every_write_serves_only_complete_objects(tmp_path: Path) -> None:
    """Kill a process just before each of its writes in turn (data written but no header,
    some header runs written, eviction half-zeroed...); the reopened tier must hold every
    object that was resident at the crash, nothing that was not completely put, and serve
    every object it holds bit-identically."""
    base = tmp_path / "base"
    with SsdTier(base, CRASH_SLOTS * CRASH_SLOT, CRASH_SLOT) as tier:
        for key in ("a0", "a1", "a2", "a3"):
            seed, size = CRASH_CONTENTS[key]
            assert tier.put(key, content(seed, size))
        assert tier.remove("a1")  # a hole at slot 2: "b" will span two runs of slots
    crashes, partial_states = 0, 0
    for crash_at in range(100):
        directory = tmp_path / f"crash{crash_at}"
        shutil.copytree(base, directory)
        outcome = run_crashing_child(directory, crash_at)
        with SsdTier(directory, CRASH_SLOTS * CRASH_SLOT, CRASH_SLOT) as reopened:
            resident = set(reopened.keys())
            if outcome is None:
                assert resident == {"b", "c", "d"}
                break
            crashes += 1
            assert set(outcome["resident"]) <= resident <= set(outcome["completed"])
            partial_states += reopened.stats().dropped_at_open > 0
            for key in resident:
                seed, size = CRASH_CONTENTS[key]
                assert read(reopened, key, size) == (LoadStatus.HIT, content(seed, size))
            assert slot_accounting_holds(reopened)
        shutil.rmtree(directory)
    assert crashes >= 10, "the scenario should write at least ten times"
    assert partial_states >= 2, "crashes between header runs should leave incomplete objects"


KILL_SCRIPT = """
import random, sys
from umbp.runtime.ssd.tier import SsdTier
tier = SsdTier(sys.argv[1], 24 * 4096, 4096)
for index in range(10**9):
    size = 4096 * (1 + index % 5) - index % 7
    assert tier.put(f"k{index}", random.Random(index).randbytes(size))
    print(index, flush=True)
"""


def test_kill_9_mid_puts_then_reopen_serves_only_exact_objects(tmp_path: Path) -> None:
    directory = tmp_path / "killed"
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(directory)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None
    last = -1
    for line in child.stdout:
        last = int(line)
        if last >= 60:  # many evictions behind it, puts still streaming
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    # The child kept putting until the signal landed: its last acknowledged put is
    # the last line it wrote (each one write, after the put returned).
    for line in child.stdout:
        last = int(line)
    child.stdout.close()
    assert last >= 60
    with SsdTier(directory, 24 * 4096, 4096) as tier:
        keys = tier.keys()
        assert f"k{last}" in keys
        assert len(keys) >= 3
        for key in keys:
            index = int(key[1:])
            size = 4096 * (1 + index % 5) - index % 7
            assert read(tier, key, size) == (LoadStatus.HIT, random.Random(index).randbytes(size))
        assert slot_accounting_holds(tier)


# ----------------------------------------------------------------- full disks

FSIZE_SCRIPT = """
import json, resource, signal, sys
from umbp.runtime.ssd.tier import SsdTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so writes past the limit fail with EFBIG
directory, slot = sys.argv[1], 4096
resource.setrlimit(resource.RLIMIT_FSIZE, (5 * slot, resource.RLIM_INFINITY))
try:
    SsdTier(directory, 16 * slot, slot)
except OSError as error:
    print(json.dumps({"refused": str(error)}))
else:
    print(json.dumps({"refused": None}))
"""


def test_a_file_size_limit_below_the_slot_file_refuses_to_open(tmp_path: Path) -> None:
    """Behaviour changed (issue 11): the tier no longer opens with a file that grows as it
    goes and collapses at the first ENOSPC/EFBIG; it reserves its file at open or refuses,
    saying what it needs and what to do."""
    done = subprocess.run(
        [sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path / "limited")],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    refused = json.loads(done.stdout)["refused"]
    assert refused is not None and "cannot reserve" in refused, refused
    assert "file size limit" in refused and "--ssd-capacity" in refused


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, where root may mount one; skipped elsewhere."""
    try:
        with small_tmpfs(tmp_path / "tiny", "1m", mode="1777") as mount_point:
            yield mount_point
    except CannotMount as reason:
        pytest.skip(str(reason))


def test_a_tier_larger_than_its_filesystem_refuses_to_open(tiny_filesystem: Path) -> None:
    """2 MiB asked of a 1 MiB filesystem: refused at open, before the index is built,
    with the figures (it used to open, grow lazily and lose slots at every ENOSPC)."""
    with pytest.raises(OSError, match="needs .* bytes .* has .* available; lower --ssd-capacity"):
        SsdTier(tiny_filesystem / "ssd", 32 * (64 << 10), 64 << 10)
    with pytest.raises(OSError, match="available"):
        SsdTier(tiny_filesystem / "huge", 1 << 60, 64 << 10)  # no MemoryError either


def test_the_space_is_reserved_and_a_failed_write_retires_only_its_slot(
    tiny_filesystem: Path,
) -> None:
    """A tier that fits is preallocated for real: another file filling the disk costs it
    nothing. When a slot's blocks are taken from under it anyway (a hole punched in the
    file, the disk then full), the put that hits it fails and only that slot is retired:
    the slots after it keep working."""
    slot = 64 << 10
    directory = tiny_filesystem / "ssd"
    filler = tiny_filesystem / "filler"
    with SsdTier(directory, 8 * slot, slot) as tier:
        assert os.stat(tier.path).st_blocks * 512 >= tier.slot_data_offset(8)
        _fill(filler)
        for index in range(3):
            assert tier.put(f"k{index}", content(index, slot))  # slots 0-2, on reserved space
        subprocess.run(["fallocate", "--punch-hole", "--offset", str(tier.slot_data_offset(3)),
                        "--length", str(slot), str(tier.path)], check=True)  # fmt: skip
        _fill(filler)
        results = [tier.put(f"k{index}", content(index, slot)) for index in range(3, 8)]
        assert results == [False, True, True, True, True]  # slot 3 failed, 4-7 work
        assert tier.stats().put_failures == 1
        assert tier.usable_slot_count() == 7 and tier.stats().capacity_bytes == 7 * slot
        assert tier.lookup(["k3"]) == (False,)
        for index in (0, 1, 2, 4, 5, 6, 7):
            assert read(tier, f"k{index}", slot) == (LoadStatus.HIT, content(index, slot))
        assert tier.put("k8", content(8, slot))  # evicts k0 rather than failing again
        assert read(tier, "k8", slot) == (LoadStatus.HIT, content(8, slot))
        assert slot_accounting_holds(tier)
        resident = tier.keys()
    filler.unlink()
    with SsdTier(directory, 8 * slot, slot) as reopened:
        assert reopened.keys() == resident and reopened.stats().dropped_at_open == 0
        assert reopened.usable_slot_count() == 8  # the hole is reserved again at open


def _fill(path: Path) -> None:
    """Append to `path` until the filesystem is full."""
    with open(path, "ab", buffering=0) as out:  # unbuffered: nothing left to flush at close
        try:
            while True:
                out.write(bytes(4096))
        except OSError as error:
            assert error.errno == errno.ENOSPC, error


def test_a_large_fragmented_object_is_hashed_chunk_by_chunk_as_written_and_read(
    open_tier: Callable[..., SsdTier],
) -> None:
    """An object over two hash chunks, in non-consecutive slots (several extents): its
    checksum is computed while its payload is written and verified while it is read,
    and equals the one-shot xxh3-64; one flipped byte anywhere is caught."""
    import xxhash

    from umbp.runtime.paged_copy import CHUNK_BYTES

    slot = 256 << 10
    tier = open_tier(slots=24, slot_bytes=slot)
    for index in range(0, 12, 2):  # leave holes, so that the big object is fragmented
        assert tier.put(f"pad{index}", content(index, slot))
        assert tier.put(f"gap{index}", content(100 + index, slot))
    for index in range(0, 12, 2):
        assert tier.remove(f"gap{index}")
    size = 2 * CHUNK_BYTES + 3 * slot + 17
    payload = content(7, size)
    assert tier.put("big", payload)
    out = bytearray(size)
    status, checksum = tier.read_into("big", out)
    assert status is LoadStatus.HIT and bytes(out) == payload
    assert checksum == xxhash.xxh3_64_intdigest(payload)


def test_an_object_reads_into_pieces_that_hold_its_bytes_in_order(
    open_tier: Callable[..., SsdTier],
) -> None:
    """A promotion's DRAM pages need not be contiguous: the object is read into each
    piece in turn (pieces cut across slots and the hash's chunks), checksummed as one,
    and written from pieces as well, however many; pieces that do not add up to its
    size are a size mismatch, nothing copied."""
    import xxhash

    from umbp.runtime.paged_copy import CHUNK_BYTES

    tier = open_tier(slots=8, slot_bytes=256 << 10)
    payload = content(3, CHUNK_BYTES + (300 << 10) + 5)
    assert tier.put("big", payload)
    cuts = [0, 7, 4096, CHUNK_BYTES - 1, CHUNK_BYTES + 4096, len(payload)]
    pieces = [bytearray(end - start) for start, end in itertools.pairwise(cuts)]
    status, checksum = tier.read_pieces_into("big", pieces)
    assert status is LoadStatus.HIT and b"".join(pieces) == payload
    assert checksum == xxhash.xxh3_64_intdigest(payload)
    tiny = 64  # `umbp serve --page-bytes 64`: more pieces per chunk than one call takes
    assert tier.put_pieces("tiny", [payload[at : at + tiny] for at in range(0, len(payload), tiny)])
    pieces = [bytearray(tiny) for _ in range(0, len(payload), tiny)]
    pieces[-1] = bytearray(len(payload) % tiny or tiny)
    assert tier.read_pieces_into("tiny", pieces)[0] is LoadStatus.HIT
    assert b"".join(pieces) == payload
    short = [bytearray(len(payload) - 1), bytearray(0)]
    assert tier.read_pieces_into("big", short) == (LoadStatus.SIZE_MISMATCH, 0)
    assert not any(short[0])


def test_a_held_object_is_not_evicted_and_drops_cleanly_when_removed_or_cleared(
    open_tier: Callable[..., SsdTier],
) -> None:
    """While held (a promotion makes room for it), puts evict other objects, never the
    held one; a remove or a clear while held still drops it, and its
    slots are accounted for once, when the hold ends."""
    tier = open_tier(slots=4)
    assert tier.put("old", content(1, SLOT))
    with tier.held("old") as resident:
        assert resident
        for index in range(4):  # the fourth needs room: the oldest but the held one goes
            assert tier.put(f"n{index}", content(10 + index, SLOT))
        assert tier.lookup(["old", "n0", "n1", "n2", "n3"]) == (True, False, True, True, True)
        assert read(tier, "old", SLOT) == (LoadStatus.HIT, content(1, SLOT))
    with tier.held("nowhere") as resident:
        assert not resident
    with tier.held("old"):
        assert tier.remove("old")
        assert tier.free_slot_count() == 0, "its slot waits for the hold to end"
    assert tier.free_slot_count() == 1 and slot_accounting_holds(tier)
    with tier.held("n2"):
        assert tier.clear()
    assert tier.free_slot_count() == 4 and slot_accounting_holds(tier)
    for index in range(4):
        assert tier.put(f"again{index}", content(20 + index, SLOT))
    assert slot_accounting_holds(tier) and tier.free_slot_count() == 0


def test_a_checksum_given_with_a_put_is_kept_and_a_wrong_one_never_serves_bytes(
    open_tier: Callable[..., SsdTier],
) -> None:
    """The server hands the checksum it verified (a demotion): the tier keeps it; had it
    been wrong, the read would find the object corrupt and drop it."""
    import xxhash

    tier = open_tier()
    good, bad = content(1, 3 * SLOT + 5), content(2, SLOT)
    assert tier.put("good", good, xxhash.xxh3_64_intdigest(good))
    assert tier.put("bad", bad, xxhash.xxh3_64_intdigest(bad) ^ 1)
    assert read(tier, "good", len(good)) == (LoadStatus.HIT, good)
    assert tier.read_into("bad", bytearray(SLOT)) == (LoadStatus.CORRUPT, 0)
    assert tier.lookup(["bad"]) == (False,)
