"""The server's prefetch of SSD hits (`umbp.runtime.server.prefetch`), on `StoreCore`
over a real `SsdTier`: a lookup that finds objects only on SSD brings them into DRAM
before their get, within its bound, cancelled with its request or its connection, and
never read twice when a get asks first. `GatedTier` (a real SsdTier whose reads wait for
a gate) holds the prefetch threads still where an order must be pinned down: the first
`PREFETCH_READERS` keys asked are then being read, the rest queued."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_server_state import PAGE, Rig
from umbp.runtime.contract import LoadStatus
from umbp.runtime.server import protocol
from umbp.runtime.server.prefetch import PREFETCH_READERS
from umbp.runtime.ssd.tier import SsdTier

OBJECT = PAGE - 9


class GatedTier(SsdTier):
    """An SsdTier whose reads wait until `gate` is set (counting them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.reads: list[str] = []
        self.reading = threading.Event()

        self.in_flight = 0
        self.most_in_flight = 0
        self._count = threading.Lock()

    def read_pieces_into(self, key: str, pieces: Any) -> tuple[LoadStatus, int]:
        with self._count:
            self.reads.append(key)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.reading.set()
        try:
            assert self.gate.wait(30), "the test never opened the gate"
            return super().read_pieces_into(key, pieces)
        finally:
            with self._count:
                self.in_flight -= 1


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[GatedTier]:
    with GatedTier(tmp_path / "ssd", 64 * PAGE, slot_bytes=PAGE) as opened:
        yield opened


def key(serial: int) -> str:
    return f"umbp:1:aaaa:tp0:pcp0:dcp0:pp0:g0:{serial:04x}"


def payload(serial: int) -> bytes:
    return bytes([serial + 1]) * OBJECT


def on_ssd_only(tier: GatedTier, rig_pages: int, count: int, prefetch_bytes: int) -> Rig:
    """A server whose first `count` objects were stored on SSD by an earlier server (DRAM
    empty: a restart), with a prefetch bound of `prefetch_bytes`."""
    for serial in range(count):
        assert tier.put(key(serial), payload(serial))
    return Rig(rig_pages, cold=tier, prefetch_bytes=prefetch_bytes)


def until(condition: Callable[[], bool]) -> None:
    """Wait for what the prefetch thread does (a deadline, not a timing assertion)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the prefetch thread did not get there"
        time.sleep(0.005)


def test_a_lookup_brings_objects_only_on_ssd_into_dram_before_their_get(
    tier: GatedTier,
) -> None:
    rig = on_ssd_only(tier, 32, 6, prefetch_bytes=16 * PAGE)
    keys = [key(serial) for serial in range(6)]
    assert rig.core.lookup(keys + [key(99)]) == bytes([protocol.WHERE_DISK] * 6 + [0])
    until(lambda: rig.core.where(keys) == bytes([protocol.WHERE_CPU]) * 6)
    counters = rig.counters()
    assert (counters["prefetched"], counters["promotions"]) == (6, 6)
    reads = len(tier.reads)
    assert rig.get(keys, [OBJECT] * 6) == [payload(serial) for serial in range(6)]
    assert len(tier.reads) == reads == 6, "the get read nothing from SSD"
    assert rig.counters()["hits_from_ssd"] == 0
    assert rig.core.where(keys) == bytes([protocol.WHERE_CPU]) * 6


def test_the_bound_limits_what_is_queued_and_the_rest_is_read_by_its_get(
    tier: GatedTier,
) -> None:
    rig = on_ssd_only(tier, 32, 6, prefetch_bytes=2 * OBJECT)
    tier.gate.clear()  # the first read holds the thread, so the queue is what is bounded
    keys = [key(serial) for serial in range(6)]
    rig.core.lookup(keys)
    assert tier.reading.wait(30)
    counters = rig.counters()
    assert counters["prefetch_skipped"] == 4, "two objects' bytes: two queued or read"
    assert counters["prefetch_queued_bytes"] == 2 * OBJECT
    tier.gate.set()
    until(lambda: rig.counters()["prefetched"] == 2)
    assert rig.get(keys, [OBJECT] * 6) == [payload(serial) for serial in range(6)]
    assert sorted(tier.reads) == sorted(keys), "each object read once"


def test_forgetting_a_request_or_closing_its_connection_cancels_what_was_not_read(
    tier: GatedTier,
) -> None:
    rig = on_ssd_only(tier, 32, 6, prefetch_bytes=16 * PAGE)
    tier.gate.clear()
    engine = rig.core.open_session()
    rig.core.lookup([key(0), key(1), key(2)], engine, "request-a")
    until(lambda: len(tier.reads) == 2)  # keys 0 and 1 are being read; 2 waits
    rig.core.lookup([key(3), key(4)], engine, "request-b")
    other = rig.core.open_session()
    rig.core.lookup([key(5)], other, "request-a")  # another engine's request of that name
    rig.core.forget(engine, "request-a")
    assert rig.counters()["prefetch_cancelled"] == 1
    rig.core.close_session(engine)
    assert rig.counters()["prefetch_cancelled"] == 3
    tier.gate.set()
    until(lambda: rig.counters()["prefetched"] == 3)
    assert sorted(tier.reads) == [key(0), key(1), key(5)]
    assert rig.core.where([key(0), key(1), key(5)]) == bytes([protocol.WHERE_CPU]) * 3
    assert rig.core.where([key(2), key(3)]) == bytes([protocol.WHERE_DISK]) * 2


def test_a_get_takes_over_queued_keys_and_waits_for_the_one_being_read(
    tier: GatedTier,
) -> None:
    rig = on_ssd_only(tier, 32, 4, prefetch_bytes=16 * PAGE)
    tier.gate.clear()
    keys = [key(serial) for serial in range(4)]
    rig.core.lookup(keys)
    until(lambda: len(tier.reads) == 2)  # keys 0 and 1 are being read
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(rig.get(keys, [OBJECT] * 4)))
    reader.start()
    until(lambda: rig.counters()["prefetch_claimed"] == 2)
    tier.gate.set()
    reader.join(30)
    assert got == [[payload(serial) for serial in range(4)]]
    assert sorted(tier.reads) == sorted(keys), "no key read twice"
    counters = rig.counters()
    assert counters["prefetched"] == 2 and counters["hits_from_ssd"] == 2


def test_several_objects_are_read_at_once(tier: GatedTier) -> None:
    rig = on_ssd_only(tier, 32, 6, prefetch_bytes=16 * PAGE)
    tier.gate.clear()
    keys = [key(serial) for serial in range(6)]
    rig.core.lookup(keys)
    until(lambda: tier.in_flight == PREFETCH_READERS)
    assert tier.reads == keys[:PREFETCH_READERS], "first asked, first started"
    tier.gate.set()
    until(lambda: rig.core.where(keys) == bytes([protocol.WHERE_CPU]) * 6)
    assert tier.most_in_flight == PREFETCH_READERS
    assert rig.get(keys, [OBJECT] * 6) == [payload(serial) for serial in range(6)]
