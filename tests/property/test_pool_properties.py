"""Model-based properties of SlabPool: a reference LRU predicts every answer of the pool.

The state machine drives random puts, loads (right and wrong sizes), look-ups, byte flips,
drains of the eviction queue and clears, against a pool with random geometry and
watermarks. After every step it checks the invariants:
* used bytes never exceed capacity, and equal the pages owned by resident objects;
* every page is free or owned by exactly one resident object (free + owned == total);
* residency equals the model's; a key absent from the model is never a HIT;
* a HIT delivers exactly the bytes last accepted under that key, copied out or lent
  in place (``lend``: the lent row holds them, ``verify`` answers as a get would);
* an object written in place (``reserve``, the row written, ``commit``) is stored as a
  put of it would be; a reservation not written, or cleared under, stores nothing and
  gives its page back;
* a lookup by hash (``lookup_hashes``) answers what ``lookup`` answers for the same keys.
  Keys are a mix of what core builds (a prefix ending with ':' + a lowercase hex digest,
  the empty digest too) and keys that only look like it (upper case, odd length, no
  colon), which the pool must never answer for a hash.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from umbp.core.rank_keys import HashRuns
from umbp.runtime import LoadStatus, SlabPool

PREFIXES = ("umbp:f:ns:tp0:g0:", "umbp:f:ns:tp1:g0:", "p:")
HASHES = (b"\x01\x02", b"\xab", b"", b"\xde\xad\xbe\xef")
KEYS = (
    "k0", "k1",  # no colon
    "umbp:f:ns:tp0:g0:0102", "umbp:f:ns:tp0:g0:ab", "umbp:f:ns:tp0:g0:deadbeef",
    "umbp:f:ns:tp1:g0:0102", "umbp:f:ns:tp1:g0:", "p:ab", "p:",
    "p:AB", "p:abc", "umbp:f:ns:tp1:g0:DEADBEEF",  # look like prefix + hex: are not
)


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


class ReferenceLru:
    """The behaviour SlabPool promises, written as plainly as possible."""

    def __init__(self, total_pages: int, page_bytes: int, high: float, low: float) -> None:
        self.total_pages = total_pages
        self.page_bytes = page_bytes
        self.high_pages = int(high * total_pages + 1e-9)
        self.low_pages = int(low * total_pages + 1e-9)
        self.objects: OrderedDict[str, bytes] = OrderedDict()  # least recent first
        self.corrupt: set[str] = set()
        self.evicted: dict[str, None] = {}

    def pages_of(self, size: int) -> int:
        return max(1, -(-size // self.page_bytes))  # an empty object takes a page too

    def used_pages(self) -> int:
        return sum(self.pages_of(len(data)) for data in self.objects.values())

    def put(self, key: str, data: bytes) -> bool:
        if key in self.objects:
            self.objects.move_to_end(key)
            return True
        needed = self.pages_of(len(data))
        if needed > self.total_pages:
            return False
        self.make_room(needed)
        self.objects[key] = data
        self.evicted.pop(key, None)
        return True

    def make_room(self, needed: int) -> None:
        """The evictions taking `needed` more pages makes."""
        if self.used_pages() + needed > self.high_pages:
            while self.objects and self.used_pages() + needed > self.low_pages:
                gone, _ = self.objects.popitem(last=False)
                self.corrupt.discard(gone)
                self.evicted[gone] = None

    def load(self, key: str, size: int) -> LoadStatus:
        if key not in self.objects:
            return LoadStatus.MISSING
        if size != len(self.objects[key]):
            return LoadStatus.SIZE_MISMATCH
        if key in self.corrupt:
            del self.objects[key]
            self.corrupt.discard(key)
            self.evicted[key] = None
            return LoadStatus.CORRUPT
        self.objects.move_to_end(key)
        return LoadStatus.HIT

    def drain(self) -> tuple[str, ...]:
        drained = tuple(self.evicted)
        self.evicted.clear()
        return drained

    def clear(self) -> None:
        self.objects.clear()
        self.corrupt.clear()
        self.evicted.clear()


class SlabPoolMachine(RuleBasedStateMachine):
    pool: SlabPool
    model: ReferenceLru

    @initialize(
        page_bytes=st.sampled_from([1, 64, 100, 256]),
        total_pages=st.integers(min_value=1, max_value=12),
        watermarks=st.tuples(
            st.floats(min_value=0.05, max_value=1.0), st.floats(min_value=0.05, max_value=1.0)
        ).filter(lambda pair: pair[0] != pair[1]),
    )
    def create_pool(
        self, page_bytes: int, total_pages: int, watermarks: tuple[float, float]
    ) -> None:
        low, high = sorted(watermarks)
        self.pool = SlabPool(
            total_pages * page_bytes, page_bytes, high_watermark=high, low_watermark=low
        )
        self.model = ReferenceLru(total_pages, page_bytes, high, low)

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.pool.close()

    def size_strategy(self) -> st.SearchStrategy[int]:
        return st.integers(
            min_value=0, max_value=(self.model.total_pages + 1) * self.pool.page_bytes
        )

    @rule(data=st.data(), count=st.integers(min_value=1, max_value=3))
    def put(self, data: st.DataObject, count: int) -> None:
        keys = [data.draw(st.sampled_from(KEYS)) for _ in range(count)]
        sizes = [data.draw(self.size_strategy()) for _ in range(count)]
        seeds = [data.draw(st.integers(0, 2**32)) for _ in range(count)]
        payloads = [content(seed, size) for seed, size in zip(seeds, sizes)]
        expected = tuple(self.model.put(key, payload) for key, payload in zip(keys, payloads))
        assert self.pool.put_batch(keys, [memoryview(payload) for payload in payloads]) == expected

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def load_with_right_size(self, keys: list[str]) -> None:
        sizes = [len(self.model.objects.get(key, b"")) for key in keys]
        outs = [bytearray(size) for size in sizes]
        statuses = self.pool.get_batch_into(keys, outs)
        for key, size, out, status in zip(keys, sizes, outs, statuses):
            expected_bytes = self.model.objects.get(key)
            assert status is self.model.load(key, size)
            if status is LoadStatus.HIT:
                assert bytes(out) == expected_bytes

    @rule(data=st.data())
    def put_one_page(self, data: st.DataObject) -> None:
        """Objects of at most a page: the ones a pool lends in place."""
        key = data.draw(st.sampled_from(KEYS))
        payload = content(data.draw(st.integers(0, 2**32)),
                          data.draw(st.integers(0, self.pool.page_bytes)))
        expected = (self.model.put(key, payload),)
        assert self.pool.put_batch([key], [memoryview(payload)]) == expected

    @rule(data=st.data())
    def lend_in_place_and_verify(self, data: st.DataObject) -> None:
        """A loan answers, object by object, what a get of that size would: the lent
        pages hold the stored bytes in order, verify checks them (a flipped byte is
        CORRUPT, dropped) and refreshes recency in key order."""
        keys = data.draw(st.lists(st.sampled_from(list(self.model.objects) or KEYS),
                                  min_size=1, max_size=4, unique=True))
        keys += [key for key in data.draw(st.lists(st.sampled_from(KEYS), max_size=1))
                 if key not in keys]  # unique keys: the model loads them in order
        sizes = sorted({len(self.model.objects.get(key, b"")) for key in keys})
        size = data.draw(st.sampled_from(sizes))
        loan = self.pool.lend(keys, size)
        assert len(loan.pages) == len(keys)
        expected = [self.model.load(key, size) for key in keys]
        for key, pages, status in zip(keys, loan.pages, expected):
            assert (pages is not None) == (status in (LoadStatus.HIT, LoadStatus.CORRUPT))
            if status is LoadStatus.HIT:
                assert pages is not None
                lent = b"".join(bytes(loan.memory[page]) for page in pages)
                assert lent[:size] == self.model.objects[key]
        assert loan.verify() == tuple(expected)
        loan.release()

    @rule(data=st.data())
    def write_in_place(self, data: st.DataObject) -> None:
        """A reservation written and committed stores what a put of the same bytes
        would; one not written, or one the pool was cleared under, stores nothing and
        gives its pages back."""
        key = data.draw(st.sampled_from(KEYS))
        page = self.pool.page_bytes
        size = data.draw(st.sampled_from([0, 1, page, page + 1, 3 * page]))
        payload = content(data.draw(st.integers(0, 2**32)), size)
        reservation = self.pool.reserve([key], size)
        outcome = data.draw(st.sampled_from(["written", "not written", "cleared"]))
        (pages,) = reservation.pages
        if pages is not None:
            for index, owned in enumerate(pages):
                piece = payload[index * page : (index + 1) * page]
                reservation.memory[owned, : len(piece)] = memoryview(piece)
        if outcome == "cleared":  # (what the reservation evicted goes anyway)
            self.pool.clear()
            self.model.clear()
            assert reservation.commit([pages is not None]) == (False,)
            return
        written = outcome == "written" and pages is not None
        stored = reservation.commit([written])
        if pages is None:  # resident already (stored, recency refreshed), or too large
            resident = key in self.model.objects
            assert stored == (resident,)
            if resident:
                self.model.objects.move_to_end(key)
            else:
                assert self.model.pages_of(size) > self.model.total_pages
            return
        assert stored == (written,)
        self.model.make_room(self.model.pages_of(size))  # reserving evicted as a put would
        if written:
            self.model.objects[key] = payload
            self.model.evicted.pop(key, None)

    @rule(key=st.sampled_from(KEYS), delta=st.sampled_from([-1, 1, 7]))
    def load_with_wrong_size(self, key: str, delta: int) -> None:
        size = max(0, len(self.model.objects.get(key, b"")) + delta)
        (status,) = self.pool.get_batch_into([key], [bytearray(size)])
        assert status is self.model.load(key, size)
        assert status is not LoadStatus.HIT or key in self.model.objects

    def intact_nonempty_keys(self) -> list[str]:
        """Keys whose bytes can be flipped; corrupt ones are excluded because flipping the
        same bit twice would repair them behind the model's back."""
        return [k for k, v in self.model.objects.items() if v and k not in self.model.corrupt]

    @precondition(lambda self: bool(self.intact_nonempty_keys()))
    @rule(data=st.data())
    def flip_a_stored_byte(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.intact_nonempty_keys()))
        regions = self.pool.object_regions(key)
        offset, length = data.draw(st.sampled_from(regions))
        position = offset + data.draw(st.integers(0, length - 1))
        bit = data.draw(st.sampled_from([0x01, 0x10, 0x80]))
        view = self.pool.slab_view()
        view[position] ^= bit
        view.release()
        self.model.corrupt.add(key)

    @rule()
    def drain_evicted_keys(self) -> None:
        assert self.pool.take_evicted_keys() == self.model.drain()

    @rule()
    def clear(self) -> None:
        assert self.pool.clear() is True
        self.model.clear()

    @invariant()
    def residency_matches_the_model(self) -> None:
        assert self.pool.lookup(KEYS) == tuple(key in self.model.objects for key in KEYS)

    @invariant()
    def a_lookup_by_hash_answers_as_the_key_strings(self) -> None:
        for ranks in (1, 2, 3):
            for prefixes in ((PREFIXES[:ranks],), (PREFIXES[-ranks:], PREFIXES[:ranks])):
                runs = HashRuns.of_segments(
                    tuple(f"rank{rank}" for rank in range(ranks)), prefixes,
                    tuple(HASHES[::step] for step in (1, -1)[: len(prefixes)]),
                )
                assert self.pool.lookup_hashes(runs) == self.pool.lookup(runs.key_strings())

    @rule(data=st.data())
    def ask_by_hash(self, data: st.DataObject) -> None:
        ranks = data.draw(st.integers(1, 3))
        segments = data.draw(st.integers(0, 3))
        runs = HashRuns.of_segments(
            tuple(f"rank{rank}" for rank in range(ranks)),
            tuple(tuple(data.draw(st.lists(st.sampled_from(PREFIXES + ("q:",)),
                                           min_size=ranks, max_size=ranks)))
                  for _ in range(segments)),
            tuple(tuple(data.draw(st.lists(st.sampled_from(HASHES + (b"\x00",)), max_size=6)))
                  for _ in range(segments)),
        )
        answers = self.pool.lookup_hashes(runs)
        assert answers == tuple(key in self.model.objects for key in runs.key_strings())

    @invariant()
    def recency_order_matches_the_model(self) -> None:
        assert self.pool.stored_keys() == tuple(self.model.objects)

    @invariant()
    def pages_are_free_or_owned_once(self) -> None:
        owned = [
            offset // self.pool.page_bytes
            for key in self.model.objects
            for offset, _ in self.pool.object_regions(key)
        ]
        assert len(owned) == len(set(owned))
        assert all(0 <= page < self.pool.total_pages for page in owned)
        assert len(owned) + self.pool.free_page_count() == self.pool.total_pages

    @invariant()
    def usage_is_bounded_and_matches_the_model(self) -> None:
        stats = self.pool.stats()
        assert stats.used_bytes <= stats.capacity_bytes
        assert stats.used_bytes == self.model.used_pages() * self.pool.page_bytes
        assert stats.objects == len(self.model.objects)

    @invariant()
    def regions_cover_each_object_exactly(self) -> None:
        for key, data in self.model.objects.items():
            assert sum(length for _, length in self.pool.object_regions(key)) == len(data)


SlabPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, report_multiple_bugs=False
)
TestSlabPool = SlabPoolMachine.TestCase
