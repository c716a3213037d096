"""Model-based properties of SsdTier: a reference LRU over a dict predicts every answer.

The state machine drives random puts, reads (right and wrong sizes), removes, clears,
byte flips in data slots, and reopens (close, then open the same directory) against a tier
with random small geometry. After every step it checks:
* residency and LRU order equal the model's (after a reopen: put order, since recency is
  kept in memory only);
* a HIT delivers exactly the bytes last stored under that key;
* every slot is free or owned by exactly one resident object (used + free == total), and
  used bytes equal the model's whole slots;
* a reopen keeps exactly the resident set and drops nothing (nothing was damaged in the
  header area; flipped data bytes are found lazily, at read).
"""

from __future__ import annotations

import itertools
import random
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from umbp.runtime import LoadStatus
from umbp.runtime.ssd.tier import SsdTier

KEYS = tuple(f"k{index}" for index in range(8))


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def split(size: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[start, end) ranges covering 0..size, cut at `cuts` (taken modulo size + 1; empty
    pieces included)."""
    points = [0, *sorted(cut % (size + 1) for cut in cuts), size]
    return list(itertools.pairwise(points))


class ReferenceTier:
    """The behaviour SsdTier promises, written as plainly as possible."""

    def __init__(self, total_slots: int, slot_bytes: int) -> None:
        self.total_slots = total_slots
        self.slot_bytes = slot_bytes
        self.objects: OrderedDict[str, bytes] = OrderedDict()  # least recent first
        self.put_order: dict[str, int] = {}
        self.puts = 0
        self.corrupt: set[str] = set()

    def slots_of(self, size: int) -> int:
        return max(1, -(-size // self.slot_bytes))

    def used_slots(self) -> int:
        return sum(self.slots_of(len(data)) for data in self.objects.values())

    def put(self, key: str, data: bytes) -> bool:
        if key in self.objects:
            self.objects.move_to_end(key)
            return True
        needed = self.slots_of(len(data))
        if needed > self.total_slots:
            return False
        while self.total_slots - self.used_slots() < needed:
            self.forget(next(iter(self.objects)))
        self.objects[key] = data
        self.puts += 1
        self.put_order[key] = self.puts
        return True

    def load(self, key: str, size: int) -> LoadStatus:
        if key not in self.objects:
            return LoadStatus.MISSING
        if size != len(self.objects[key]):
            return LoadStatus.SIZE_MISMATCH
        if key in self.corrupt:
            self.forget(key)
            return LoadStatus.CORRUPT
        self.objects.move_to_end(key)
        return LoadStatus.HIT

    def forget(self, key: str) -> None:
        del self.objects[key]
        del self.put_order[key]
        self.corrupt.discard(key)

    def reopen(self) -> None:
        self.objects = OrderedDict(
            sorted(self.objects.items(), key=lambda item: self.put_order[item[0]])
        )


class SsdTierMachine(RuleBasedStateMachine):
    tier: SsdTier
    model: ReferenceTier
    directory: Path

    @initialize(
        slot_bytes=st.sampled_from([16, 64, 100]),
        total_slots=st.integers(min_value=1, max_value=10),
    )
    def create_tier(self, slot_bytes: int, total_slots: int) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="ssd-tier-property-"))
        self.tier = SsdTier(self.directory / "tier", total_slots * slot_bytes, slot_bytes)
        self.model = ReferenceTier(total_slots, slot_bytes)

    def teardown(self) -> None:
        if hasattr(self, "tier"):
            self.tier.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    @rule(
        key=st.sampled_from(KEYS),
        seed=st.integers(0, 2**32),
        slots=st.one_of(st.integers(0, 2), st.integers(0, 11)),  # mostly several fit
        trim=st.integers(0, 15),
    )
    def put(self, key: str, seed: int, slots: int, trim: int) -> None:
        size = max(0, slots * self.model.slot_bytes - trim)
        data = content(seed, size)
        assert self.tier.put(key, memoryview(data)) is self.model.put(key, data)

    @rule(
        key=st.sampled_from(KEYS),
        seed=st.integers(0, 2**32),
        slots=st.integers(0, 6),
        trim=st.integers(0, 15),
        cuts=st.lists(st.integers(0, 2**16), max_size=4),
    )
    def put_in_pieces(self, key: str, seed: int, slots: int, trim: int, cuts: list[int]) -> None:
        """A DRAM object's pages, scattered: any split of the bytes stores the same."""
        data = content(seed, max(0, slots * self.model.slot_bytes - trim))
        pieces = [memoryview(data)[start:end] for start, end in split(len(data), cuts)]
        assert self.tier.put_pieces(key, pieces) is self.model.put(key, data)

    @precondition(lambda self: bool(self.model.objects))
    @rule(data=st.data(), cuts=st.lists(st.integers(0, 2**16), max_size=4))
    def load_into_pieces(self, data: st.DataObject, cuts: list[int]) -> None:
        """Any split of the destination reads the same bytes."""
        key = data.draw(st.sampled_from(tuple(self.model.objects)))
        expected = self.model.objects[key]
        pieces = [bytearray(end - start) for start, end in split(len(expected), cuts)]
        status, _checksum = self.tier.read_pieces_into(key, pieces)
        assert status is self.model.load(key, len(expected))
        if status is LoadStatus.HIT:
            assert b"".join(pieces) == expected

    @precondition(lambda self: bool(self.model.objects))
    @rule(data=st.data())
    def load_a_resident_key(self, data: st.DataObject) -> None:
        self.load_with_right_size(data.draw(st.sampled_from(tuple(self.model.objects))))

    @rule(key=st.sampled_from(KEYS))
    def load_with_right_size(self, key: str) -> None:
        expected = self.model.objects.get(key, b"")
        out = bytearray(len(expected))
        status = self.tier.get_into(key, out)
        assert status is self.model.load(key, len(expected))
        if status is LoadStatus.HIT:
            assert bytes(out) == expected

    @rule(key=st.sampled_from(KEYS), delta=st.sampled_from([-1, 1, 7]))
    def load_with_wrong_size(self, key: str, delta: int) -> None:
        size = max(0, len(self.model.objects.get(key, b"")) + delta)
        status = self.tier.get_into(key, bytearray(size))
        assert status is self.model.load(key, size)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: str) -> None:
        resident = key in self.model.objects
        assert self.tier.remove(key) is resident
        if resident:
            self.model.forget(key)

    @rule()
    def clear(self) -> None:
        assert self.tier.clear() is True
        for key in list(self.model.objects):
            self.model.forget(key)

    @rule()
    def reopen(self) -> None:
        self.tier.close()
        self.tier = SsdTier(
            self.directory / "tier",
            self.model.total_slots * self.model.slot_bytes,
            self.model.slot_bytes,
        )
        self.model.reopen()
        assert self.tier.stats().dropped_at_open == 0

    def intact_nonempty_keys(self) -> list[str]:
        """Keys whose bytes can be flipped; corrupt ones are excluded because flipping the
        same bit twice would repair them behind the model's back."""
        return [k for k, v in self.model.objects.items() if v and k not in self.model.corrupt]

    @precondition(lambda self: bool(self.intact_nonempty_keys()))
    @rule(data=st.data())
    def flip_a_stored_byte(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.intact_nonempty_keys()))
        size = len(self.model.objects[key])
        position = data.draw(st.integers(0, size - 1))
        part, within = divmod(position, self.model.slot_bytes)
        offset = self.tier.slot_data_offset(self.tier.object_slots(key)[part]) + within
        with open(self.tier.path, "r+b") as file:
            file.seek(offset)
            (value,) = file.read(1)
            file.seek(offset)
            file.write(bytes([value ^ data.draw(st.sampled_from([0x01, 0x10, 0x80]))]))
        self.model.corrupt.add(key)

    @invariant()
    def residency_and_order_match_the_model(self) -> None:
        assert self.tier.lookup(KEYS) == tuple(key in self.model.objects for key in KEYS)
        assert self.tier.keys() == tuple(self.model.objects)

    @invariant()
    def slots_are_free_or_owned_once(self) -> None:
        owned = [slot for key in self.model.objects for slot in self.tier.object_slots(key)]
        assert len(owned) == len(set(owned))
        assert all(0 <= slot < self.tier.total_slots for slot in owned)
        assert len(owned) + self.tier.free_slot_count() == self.tier.total_slots
        for key, stored in self.model.objects.items():
            assert len(self.tier.object_slots(key)) == self.model.slots_of(len(stored))

    @invariant()
    def usage_matches_the_model(self) -> None:
        stats = self.tier.stats()
        assert stats.used_bytes == self.model.used_slots() * self.model.slot_bytes
        assert stats.used_bytes <= stats.capacity_bytes
        assert stats.capacity_bytes == self.model.total_slots * self.model.slot_bytes
        assert stats.objects == len(self.model.objects)
        for key, stored in self.model.objects.items():
            assert self.tier.size_of(key) == len(stored)


SsdTierMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, report_multiple_bugs=False
)
TestSsdTier = SsdTierMachine.TestCase
