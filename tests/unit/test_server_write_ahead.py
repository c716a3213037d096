"""The server's write-ahead (`umbp.runtime.server.write_ahead`): DRAM objects next in line
for eviction are copied to a real `SsdTier` in the background, so that making room writes
nothing; a drop or clear during the copy leaves no SSD copy behind; damaged DRAM bytes are
dropped, not written; the writer gives way to reads of the SSD tier."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.unit.test_server_prefetch import GatedTier
from tests.unit.test_server_state import PAGE, HeldSsd, Rig
from umbp.runtime.server.index import PoolIndex
from umbp.runtime.server.state import StoreCore
from umbp.runtime.ssd.tier import SsdTier

PAGES = 32
HIGH, LOW = 31, 16
AHEAD = HIGH - LOW + 4
"""The watermarks' gap and room for a 4-page put (the server's default: the gap and the
prefetch bound)."""


def _rig(cold: object, ahead_pages: int = AHEAD) -> Rig:
    rig = Rig(PAGES)
    rig.core.close()
    index = PoolIndex(PAGES, PAGE, high_pages=HIGH, low_pages=LOW)
    rig.core = StoreCore(rig.view, index, cold, 0, ahead_pages * PAGE)  # type: ignore[arg-type]
    rig.session = rig.core.open_session()
    return rig


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10.0
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


@pytest.fixture
def ssd(tmp_path: Path) -> Iterator[SsdTier]:
    tier = SsdTier(tmp_path / "ssd", 256 * PAGE, slot_bytes=PAGE)
    yield tier
    tier.close()


def test_the_objects_next_in_line_are_on_ssd_before_eviction_needs_them(ssd: SsdTier) -> None:
    rig = _rig(ssd)
    keys = [f"k{i:02}" for i in range(28)]
    for index, key in enumerate(keys):
        assert rig.put({key: bytes([index]) * PAGE}) == [True]
    # 19 pages ahead, 3 of them free below the high watermark: the 16 oldest are copied
    # (28 - 16 down to the low watermark, and 4 for the next put).
    _until(lambda: rig.counters()["written_ahead"] == 16, "16 objects written ahead")
    time.sleep(0.05)
    assert rig.counters()["written_ahead"] == 16, "nothing past the window"
    assert ssd.lookup(keys) == (True,) * 16 + (False,) * 12
    assert rig.core.lookup(keys) == b"\x01" * 28, "still in DRAM: hits as before"
    assert rig.counters()["bytes_to_ssd"] == 16 * PAGE

    # Crossing the high watermark makes room down to the low one: 16 victims, all on
    # SSD already, leave without a write.
    assert rig.put({"new": b"n" * 4 * PAGE}) == [True]
    counters = rig.counters()
    assert counters["evictions_to_ssd"] == 16
    assert rig.core.where(keys[:16]) == b"\x02" * 16  # on SSD only now
    assert counters["bytes_to_ssd"] - counters["written_ahead"] * PAGE == 0, \
        "making room wrote nothing"
    assert rig.get([keys[0]], [PAGE]) == [bytes([0]) * PAGE]
    rig.core.close()


def test_no_write_ahead_when_set_to_zero(ssd: SsdTier) -> None:
    rig = _rig(ssd, ahead_pages=0)
    for index in range(28):
        rig.put({f"k{index:02}": bytes([index]) * PAGE})
    time.sleep(0.05)
    assert rig.counters()["written_ahead"] == 0 and ssd.stats().objects == 0
    rig.core.close()


@pytest.mark.parametrize("how", ["drop", "clear"])
def test_what_is_dropped_while_written_ahead_leaves_no_ssd_copy(ssd: SsdTier, how: str) -> None:
    held = HeldSsd(ssd)
    rig = _rig(held)
    keys = [f"k{i:02}" for i in range(28)]
    for index, key in enumerate(keys):
        rig.put({key: bytes([index]) * PAGE})
    assert held.writing.wait(10.0)
    if how == "drop":
        dropped = rig.core.drop(None)
        assert dropped["in_use"] == 0, "an object being written ahead is in nobody's use"
    else:
        assert rig.core.clear()
    held.release.set()
    _until(lambda: rig.counters()["written_ahead"] >= 1, "the held write finished")
    rig.core.close()
    assert rig.core.lookup(keys) == b"\x00" * 28
    assert ssd.lookup(keys) == (False,) * 28, "a copy outlived the object"


def test_damaged_dram_bytes_are_dropped_not_written_ahead(ssd: SsdTier) -> None:
    rig = _rig(ssd)
    assert rig.put({"bad": b"b" * PAGE}) == [True]
    rig.pool[10] ^= 0xFF  # the only object starts at offset 0
    keys = [f"k{i:02}" for i in range(27)]
    for index, key in enumerate(keys):
        rig.put({key: bytes([index]) * PAGE})
    _until(lambda: rig.counters()["written_ahead"] == 15, "the 15 sound ones written")
    assert rig.counters()["corrupt_loads"] == 1
    assert rig.core.lookup(["bad"]) == b"\x00" and ssd.lookup(["bad"]) == (False,)
    rig.core.close()


def test_writing_ahead_waits_while_the_ssd_tier_is_read(tmp_path: Path) -> None:
    """The SSD tier holds its lock through a write: a prefetch read queued behind the
    writer would wait for the disk, so the writer gives way until the reads are done."""
    with GatedTier(tmp_path / "ssd", 256 * PAGE, slot_bytes=PAGE) as tier:
        cold_keys = [f"c{i:02}" for i in range(4)]
        for serial, key in enumerate(cold_keys):
            assert tier.put(key, bytes([100 + serial]) * PAGE)  # stored by an earlier server
        rig = Rig(PAGES)
        rig.core.close()
        index = PoolIndex(PAGES, PAGE, high_pages=HIGH, low_pages=LOW)
        rig.core = StoreCore(rig.view, index, tier, 8 * PAGE, AHEAD * PAGE)
        rig.session = rig.core.open_session()
        tier.gate.clear()
        assert rig.core.lookup(cold_keys) == b"\x02" * 4  # on SSD only: prefetched
        assert tier.reading.wait(10.0)
        keys = [f"k{i:02}" for i in range(24)]
        for position, key in enumerate(keys):
            assert rig.put({key: bytes([position]) * PAGE}) == [True]
        time.sleep(0.2)  # time enough for the writer to have written, had it not waited
        assert rig.counters()["written_ahead"] == 0, "the writer went before the reads"
        assert tier.lookup(keys) == (False,) * 24
        tier.gate.set()
        _until(lambda: rig.core.where(cold_keys) == b"\x01" * 4, "the prefetch finished")
        _until(lambda: rig.counters()["written_ahead"] > 0, "written ahead after the reads")
        rig.core.close()
