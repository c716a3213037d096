"""`StoreCore`, the server without its socket: reservations, pins, sessions, tiering
(DRAM only, and over a real `SsdTier` in a temporary directory). The client's side of a
put or get (copying into the pool, hashing) is done here by hand, as the client does it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import xxhash

from umbp.runtime.contract import LoadStatus
from umbp.runtime.server import protocol
from umbp.runtime.server.cold import ColdTier
from umbp.runtime.server.index import PoolIndex
from umbp.runtime.server.sessions import Session
from umbp.runtime.server.state import StoreCore
from umbp.runtime.ssd.tier import SsdTier

PAGE = 4096


class Rig:
    """A core over a bytearray pool, with client-side put/get helpers."""

    def __init__(self, pages: int, cold: ColdTier | None = None, prefetch_bytes: int = 0) -> None:
        self.pool = bytearray(pages * PAGE)
        self.view = memoryview(self.pool)
        index = PoolIndex(pages, PAGE, high_pages=pages - 1, low_pages=pages // 2)
        self.core = StoreCore(self.view, index, cold, prefetch_bytes)
        self.session = self.core.open_session()

    def put(self, items: dict[str, bytes], session: Session | None = None) -> list[bool]:
        session = session or self.session
        keys = list(items)
        token, answers = self.core.begin_put(session, keys, [len(items[k]) for k in keys])
        results, checksums = [], []
        for key, answer in zip(keys, answers):
            if isinstance(answer, bool):
                results.append(answer)
                continue
            checksums.append(self.write(answer, items[key]))
            results.append(None)
        committed = iter(self.core.commit_put(session, token, checksums))
        return [next(committed) if result is None else result for result in results]

    def write(self, regions: Sequence[tuple[int, int]], payload: bytes) -> int:
        start = 0
        for offset, length in regions:
            self.view[offset : offset + length] = payload[start : start + length]
            start += length
        return xxhash.xxh3_64_intdigest(payload)

    def get(self, keys: list[str], sizes: list[int]) -> list[Any]:
        token, answers = self.core.begin_get(self.session, keys, sizes)
        results: list[Any] = []
        corrupt = []
        for position, answer in enumerate(answers):
            if isinstance(answer, str):
                results.append(answer)
                continue
            _nbytes, checksum, regions = answer
            data = b"".join(bytes(self.view[o : o + n]) for o, n in regions)
            if xxhash.xxh3_64_intdigest(data) != checksum:
                corrupt.append(position)
                results.append("corrupt")
            else:
                results.append(data)
        self.core.end_get(self.session, token, corrupt)
        return results

    def counters(self) -> dict[str, int]:
        return self.core.stats()["counters"]  # type: ignore[no-any-return]


@pytest.fixture
def ssd(tmp_path: Path) -> Iterator[SsdTier]:
    tier = SsdTier(tmp_path / "ssd", 64 * PAGE * 16, slot_bytes=PAGE)
    yield tier
    tier.close()


def test_put_then_get_returns_the_bytes_and_a_second_put_writes_nothing() -> None:
    rig = Rig(16)
    assert rig.put({"a": b"x" * 5000, "b": b"y" * 10}) == [True, True]
    assert rig.core.lookup(["a", "b", "c"]) == b"\x01\x01\x00"
    token, answers = rig.core.begin_put(rig.session, ["a"], [5000])
    assert answers == [True]
    assert rig.core.commit_put(rig.session, token, []) == []
    assert rig.get(["a", "c", "b"], [5000, 3, 10]) == [b"x" * 5000, "missing", b"y" * 10]
    counters = rig.counters()
    assert (counters["puts"], counters["hits"], counters["misses"]) == (2, 2, 1)


def test_a_reservation_is_invisible_until_committed_and_released_with_its_session() -> None:
    rig = Rig(16)
    other = rig.core.open_session()
    _, answers = rig.core.begin_put(other, ["a"], [3 * PAGE])
    assert isinstance(answers[0], tuple)
    assert rig.core.lookup(["a"]) == b"\x00"
    assert rig.core.stats()["sessions"]["reservations"] == 1
    assert rig.core.stats()["dram"]["used_bytes"] == 3 * PAGE
    rig.core.close_session(other)
    stats = rig.core.stats()
    assert stats["sessions"]["reservations"] == 0 and stats["dram"]["used_bytes"] == 0


def test_pins_keep_an_object_through_clear_and_a_dropped_session_releases_them() -> None:
    rig = Rig(16)
    rig.put({"a": b"a" * PAGE})
    reader = rig.core.open_session()
    _, answers = rig.core.begin_get(reader, ["a"], [PAGE])
    assert isinstance(answers[0], tuple)
    assert rig.core.clear()
    assert rig.core.lookup(["a"]) == b"\x00"
    assert rig.core.stats()["dram"]["used_bytes"] == PAGE, "pinned pages are not reused"
    assert rig.put({"b": b"b" * PAGE}) == [True]
    offset = answers[0][2][0][0]
    assert bytes(rig.view[offset : offset + PAGE]) == b"a" * PAGE
    rig.core.close_session(reader)
    assert rig.core.stats()["dram"]["used_bytes"] == PAGE


def test_a_corrupt_report_drops_the_object() -> None:
    rig = Rig(16)
    rig.put({"a": b"a" * 100})
    token, answers = rig.core.begin_get(rig.session, ["a"], [100])
    assert isinstance(answers[0], tuple)
    rig.core.end_get(rig.session, token, [0])
    assert rig.core.lookup(["a"]) == b"\x00"
    assert rig.counters()["corrupt_loads"] == 1
    assert rig.core.stats()["dram"]["used_bytes"] == 0


def test_size_mismatch_pins_nothing() -> None:
    rig = Rig(16)
    rig.put({"a": b"a" * 100})
    assert rig.get(["a"], [99]) == [protocol.GET_SIZE_MISMATCH]
    assert rig.core.stats()["sessions"]["pins"] == 0


def test_dram_only_evicts_least_recently_used_and_rejects_what_cannot_fit() -> None:
    rig = Rig(8)  # high 7 pages, low 4
    for name in "abcdef":
        assert rig.put({name: name.encode() * PAGE}) == [True]
    rig.get(["a"], [PAGE])  # "a" becomes most recently used
    assert rig.put({"g": b"g" * 2 * PAGE}) == [True]
    resident = rig.core.lookup(list("abcdefg"))
    # 6 + 2 pages cross the high watermark (7): evict until 2 more fit under the low (4).
    assert resident == bytes([1, 0, 0, 0, 0, 1, 1])
    assert rig.counters()["evictions_dropped"] == 4
    assert rig.put({"huge": b"h" * 9 * PAGE}) == [False]
    assert rig.counters()["put_rejects"] == 1


def test_objects_past_the_watermark_move_to_ssd_and_come_back_bit_identical(
    ssd: SsdTier,
) -> None:
    rig = Rig(8, cold=ssd)
    payloads = {f"k{i}": bytes([i]) * (PAGE + 17 * i) for i in range(6)}
    for key, payload in payloads.items():
        assert rig.put({key: payload}) == [True]
    assert rig.counters()["evictions_to_ssd"] > 0
    where = rig.core.where(list(payloads))
    assert protocol.WHERE_DISK in where and protocol.WHERE_CPU in where
    assert rig.core.lookup(list(payloads)) == where, "a lookup answers the tier too"
    cold_key = next(k for k, w in zip(payloads, where) if w == protocol.WHERE_DISK)
    assert rig.get([cold_key], [len(payloads[cold_key])]) == [payloads[cold_key]]
    assert rig.core.where([cold_key]) == bytes([protocol.WHERE_CPU])
    assert rig.counters()["promotions"] == 1
    assert ssd.lookup([cold_key]) == (True,), "tiers are inclusive: the SSD copy stays"


def rig_whose_next_pages_are_scattered(ssd: SsdTier) -> Rig:
    """Six one-page objects in 8 pages, b, d and f the oldest: the room the next
    three-page object needs takes their pages 1, 3 and 5 first."""
    rig = Rig(8, cold=ssd)
    for key in "abcdef":
        assert rig.put({key: key.encode() * PAGE}) == [True]
    for key in "ace":
        assert rig.get([key], [PAGE]) == [key.encode() * PAGE]
    return rig


def test_a_promotion_reads_straight_into_pages_that_are_not_contiguous(ssd: SsdTier) -> None:
    """The pages a promotion gets after evictions are scattered: the SSD tier reads the
    object into each of them in turn (no staging buffer), bit-identical."""
    rig = rig_whose_next_pages_are_scattered(ssd)
    payload = bytes(range(256)) * (3 * PAGE // 256)
    assert ssd.put("cold", payload)
    token, answers = rig.core.begin_get(rig.session, ["cold"], [len(payload)])
    nbytes, checksum, regions = answers[0]  # type: ignore[misc]
    assert len(regions) > 1, "the set-up must leave the free pages scattered"
    assert b"".join(bytes(rig.view[o : o + n]) for o, n in regions) == payload
    assert (nbytes, checksum) == (len(payload), xxhash.xxh3_64_intdigest(payload))
    rig.core.end_get(rig.session, token, [])
    assert rig.counters()["promotions"] == 1


def test_an_object_on_scattered_pages_is_demoted_from_where_it_lies(ssd: SsdTier) -> None:
    """A put into scattered pages, later pushed out of DRAM: the SSD tier writes it from
    its pages in turn (no gathering copy) and holds the same bytes."""
    rig = rig_whose_next_pages_are_scattered(ssd)
    payload = bytes(range(256)) * (3 * PAGE // 256)
    assert rig.put({"scattered": payload}) == [True]
    _token, answers = rig.core.begin_get(rig.session, ["scattered"], [len(payload)])
    regions = answers[0][2]  # type: ignore[index]
    rig.core.end_get(rig.session, _token, [])
    assert len(regions) > 1, "the set-up must leave the free pages scattered"
    for index in range(8):  # newer objects push it out
        assert rig.put({f"n{index}": b"n" * PAGE}) == [True]
    assert rig.core.where(["scattered"]) == bytes([protocol.WHERE_DISK])
    out = bytearray(len(payload))
    assert ssd.read_into("scattered", out) == (LoadStatus.HIT, xxhash.xxh3_64_intdigest(payload))
    assert bytes(out) == payload


def test_room_made_for_a_promotion_never_evicts_it_from_a_full_ssd_tier(tmp_path: Path) -> None:
    """Making room demotes DRAM objects, and on a full SSD tier their writes evict its
    least recently used: the object being promoted, the oldest there, is held against
    eviction meanwhile, so it is still there to be read straight into the freed pages."""
    with SsdTier(tmp_path / "full", 8 * PAGE, slot_bytes=PAGE) as full:
        cold = b"c" * 2 * PAGE
        assert full.put("cold", cold)  # the oldest on the SSD tier
        for index in range(6):
            assert full.put(f"s{index}", bytes([index]) * PAGE)
        rig = Rig(8, cold=full)
        for key in "abcdef":  # 6 of 8 pages, under the high watermark: nothing demoted
            assert rig.put({key: key.encode() * PAGE}) == [True]
        assert full.lookup(list("abcdef")) == (False,) * 6
        assert rig.get(["cold"], [len(cold)]) == [cold]
        assert rig.counters()["evictions_to_ssd"] > 0, "room was made by demotions"
        assert full.lookup(["cold"]) == (True,)


class HeldSsd:
    """A real SsdTier whose writes wait until `release` (to act while one is under way)."""

    def __init__(self, tier: SsdTier) -> None:
        self.tier = tier
        self.writing = threading.Event()
        self.release = threading.Event()

    def put_pieces(self, key: str, pieces: object, checksum: int | None = None) -> bool:
        self.writing.set()
        assert self.release.wait(10.0)
        return self.tier.put_pieces(key, pieces, checksum)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self.tier, name)


def rig_making_room(ssd: SsdTier) -> tuple[Rig, HeldSsd, threading.Thread]:
    """A DRAM tier one page short of full and a put (in a thread) making room for one
    more: its victims' SSD writes held until `release`."""
    held = HeldSsd(ssd)
    rig = Rig(16, cold=held)  # type: ignore[arg-type]
    for index in range(15):  # at the high watermark: one page free
        assert rig.put({f"o{index}": bytes([index]) * PAGE}) == [True]
    maker = threading.Thread(
        target=lambda: rig.put({"x": b"x" * PAGE}, rig.core.open_session()))
    maker.start()
    assert held.writing.wait(30), "the put making room is writing its victims"
    return rig, held, maker


def test_a_reservation_waits_for_the_room_another_is_making_instead_of_failing(
    ssd: SsdTier,
) -> None:
    """While one put makes room (its victims' SSD writes under way), others may take the
    free pages below the watermark; one that finds none left waits for the victims'
    pages and is stored, rather than answered False while room was on its way (two
    prefetch readers did this: one making room, the other failing the rest of a prefix
    fast, whose request then waited for it in vain)."""
    rig, held, maker = rig_making_room(ssd)
    assert rig.put({"y": b"y" * PAGE}) == [True]  # the last free page
    opener = threading.Timer(0.2, held.release.set)
    opener.start()
    assert rig.put({"z": b"z" * PAGE}) == [True]
    assert held.release.is_set(), "it was stored once the victims had left"
    maker.join(30)
    assert rig.get(["x", "y", "z"], [PAGE] * 3) == [b"x" * PAGE, b"y" * PAGE, b"z" * PAGE]


def test_a_reservation_waits_for_room_being_made_no_longer_than_its_bound(
    ssd: SsdTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Victims whose writes do not end: a put that found too few free pages stores what
    fits and answers False for the rest once `ROOM_WAIT_S` passed (never waits for
    ever)."""
    from umbp.runtime.server import tiering

    monkeypatch.setattr(tiering, "ROOM_WAIT_S", 0.1)
    rig, held, maker = rig_making_room(ssd)
    assert rig.put({"y": b"y" * PAGE, "z": b"z" * PAGE}) == [True, False]
    assert not held.release.is_set()
    held.release.set()
    maker.join(30)
    assert rig.put({"z": b"z" * PAGE}) == [True]


def test_a_put_of_a_key_on_ssd_writes_nothing(ssd: SsdTier) -> None:
    assert ssd.put("cold", b"c" * 100)
    rig = Rig(8, cold=ssd)
    _token, answers = rig.core.begin_put(rig.session, ["cold"], [100])
    assert answers == [True]
    assert rig.get(["cold"], [100]) == [b"c" * 100]


def test_damaged_dram_bytes_are_dropped_not_demoted(ssd: SsdTier) -> None:
    rig = Rig(8, cold=ssd)
    assert rig.put({"bad": b"b" * PAGE})
    rig.pool[10] ^= 0xFF  # the only object starts at offset 0
    for index in range(7):
        rig.put({f"filler{index}": b"f" * PAGE})
    assert ssd.lookup(["bad"]) == (False,)
    assert rig.core.lookup(["bad"]) == b"\x00"
    assert rig.counters()["corrupt_loads"] >= 1


class _FullDisk:
    """A cold tier whose every write fails, as on a full disk."""

    def __init__(self) -> None:
        self.tried: list[str] = []

    def put_pieces(self, key: str, pieces: object, checksum: int | None = None) -> bool:
        self.tried.append(key)
        return False

    def read_pieces_into(self, key: str, pieces: object) -> tuple[LoadStatus, int]:
        return LoadStatus.MISSING, 0

    @contextlib.contextmanager
    def held(self, key: str) -> Iterator[bool]:
        yield False

    def size_of(self, key: str) -> int | None:
        return None

    def remove(self, key: str) -> bool:
        return False

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        return (False,) * len(keys)

    def keys(self) -> tuple[str, ...]:
        return ()

    def sizes(self) -> tuple[tuple[str, int], ...]:
        return ()

    def take_evicted_keys(self) -> tuple[str, ...]:
        return ()

    def stats(self) -> dict[str, int]:
        return {"objects": 0}

    def clear(self) -> bool:
        return True

    def close(self) -> None:
        return None


def test_a_failed_demotion_drops_the_object_and_keeps_serving_the_rest() -> None:
    full = _FullDisk()
    rig = Rig(8, cold=full)  # type: ignore[arg-type]
    for index in range(10):
        assert rig.put({f"k{index}": bytes([index]) * PAGE}) == [True]
    assert full.tried, "eviction tried the cold tier"
    counters = rig.counters()
    assert counters["ssd_put_failures"] == counters["evictions_dropped"] == len(full.tried)
    for key in full.tried:
        assert rig.core.lookup([key]) == b"\x00"
    assert rig.get(["k9"], [PAGE]) == [bytes([9]) * PAGE]


def test_a_corrupt_ssd_object_answers_corrupt_and_is_dropped(ssd: SsdTier) -> None:
    assert ssd.put("cold", b"c" * 3000)
    slot = ssd.object_slots("cold")[0]
    with open(ssd.path, "r+b") as slot_file:
        slot_file.seek(ssd.slot_data_offset(slot) + 5)
        slot_file.write(b"X")
    rig = Rig(8, cold=ssd)
    assert rig.get(["cold"], [3000]) == [protocol.GET_CORRUPT]
    assert rig.core.lookup(["cold"]) == b"\x00"
    assert rig.counters()["corrupt_loads"] == 1
    assert rig.core.stats()["dram"]["used_bytes"] == 0, "the promotion's pages came back"


def test_clear_empties_both_tiers(ssd: SsdTier) -> None:
    rig = Rig(8, cold=ssd)
    for index in range(8):
        rig.put({f"k{index}": b"z" * PAGE})
    assert rig.core.clear()
    assert rig.core.lookup([f"k{index}" for index in range(8)]) == bytes(8)
    assert ssd.keys() == ()


def test_lookups_follow_what_the_ssd_tier_evicts_by_itself(tmp_path: Path) -> None:
    """A small SSD tier evicts its own LRU objects as demotions arrive; the server's
    mirror of its keys must follow, so that every key a lookup calls resident loads."""
    with SsdTier(tmp_path / "small", 4 * PAGE, slot_bytes=PAGE) as small:
        rig = Rig(8, cold=small)
        keys = [f"k{index}" for index in range(20)]
        for index, key in enumerate(keys):
            assert rig.put({key: bytes([index]) * PAGE}) == [True]
        resident = [key for key, code in zip(keys, rig.core.lookup(keys)) if code]
        assert len(resident) <= 8 + 4
        assert set(small.keys()) <= set(resident)
        on_disk = [k for k, w in zip(keys, rig.core.where(keys)) if w == protocol.WHERE_DISK]
        assert set(on_disk) == set(small.keys())
        # Each get may promote, demote and so make the SSD tier evict: ask again each time.
        for key in keys:
            if rig.core.lookup([key]) != b"\x00":
                assert rig.get([key], [PAGE]) == [bytes([keys.index(key)]) * PAGE], key
            else:
                assert rig.get([key], [PAGE]) == [protocol.GET_MISSING], key


def test_a_get_served_from_ssd_counts_as_a_hit_of_the_ssd_tier_not_a_miss(
    ssd: SsdTier,
) -> None:
    """After a restart everything comes from SSD: each such get is a hit (and an SSD
    hit), never a miss; only the key that is nowhere is a miss."""
    payloads = {f"k{i}": bytes([i]) * (PAGE + i) for i in range(4)}
    for key, payload in payloads.items():
        assert ssd.put(key, payload)
    rig = Rig(16, cold=ssd)
    keys = [*payloads, "nowhere"]
    assert rig.get(keys, [len(p) for p in payloads.values()] + [5]) == [
        *payloads.values(), "missing"
    ]
    counters = rig.counters()
    assert (counters["hits"], counters["hits_from_ssd"], counters["misses"]) == (4, 4, 1)
    assert counters["promotions"] == 4
    assert rig.get(["k0"], [PAGE]) == [payloads["k0"]]  # now from DRAM
    counters = rig.counters()
    assert (counters["hits"], counters["hits_from_ssd"], counters["misses"]) == (5, 4, 1)


def test_stats_do_not_count_the_asking_connection() -> None:
    rig = Rig(8)
    other = rig.core.open_session()
    assert rig.core.stats(asking=rig.session)["sessions"]["connections"] == 1
    rig.core.close_session(other)
    assert rig.core.stats(asking=rig.session)["sessions"]["connections"] == 0


def test_a_bad_commit_or_end_changes_nothing_and_a_drop_releases_it(
    ssd: SsdTier,
) -> None:
    """A commit with the wrong number of checksums, or an end with a position outside its
    get, is refused and leaves the reservation / pins as they were; the session's close
    then gives everything back."""
    from umbp.runtime.server.sessions import RequestRefused

    rig = Rig(16, cold=ssd)
    rig.put({"a": b"a" * PAGE})
    session = rig.core.open_session()
    token, _ = rig.core.begin_put(session, ["b", "c"], [PAGE, 2 * PAGE])
    with pytest.raises(RequestRefused):
        rig.core.commit_put(session, token, [1])
    with pytest.raises(RequestRefused):
        rig.core.commit_put(session, token + 100, [1, 2])
    assert rig.core.stats()["sessions"]["reservations"] == 2
    get_token, _ = rig.core.begin_get(session, ["a"], [PAGE])
    with pytest.raises(RequestRefused):
        rig.core.end_get(session, get_token, [1])
    assert rig.core.stats()["sessions"]["pins"] == 1
    rig.core.close_session(session)
    stats = rig.core.stats()
    assert stats["sessions"] == {"connections": 1, "reservations": 0, "pins": 0}
    assert stats["dram"]["used_bytes"] == stats["dram"]["resident_bytes"] == PAGE
