"""Properties of `umbp.runtime.paging.PagedLru`, the paging and LRU mechanism that the
embedded pool, the server's index and the SSD tier share.

A state machine drives random puts (with eviction, some victims held "leaving" as a
demotion in flight would), reservations, pins, unpins, retirements, touches, retired
pages and clears against a tier of random geometry and watermarks, with a plain model of
LRU order beside it. After every step:
* no page is owned twice: free, reserved, resident, pinned-retired and retired pages are
  disjoint and together are every page; free + used == usable;
* LRU order is the model's (puts and touches move a key to the most recent end);
and at every take, the pages come in ascending order (adjacent ones make one copy);
and at every eviction:
* only unpinned objects that were not already leaving are chosen, and they are the least
  recently used of those, in order;
* the victims bring usage (with the new pages) to the low watermark or below, or every
  eligible object went; and no fewer victims would have done.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from umbp.runtime.paging import PagedLru, Resident, pages_for

KEYS = tuple(f"k{index}" for index in range(8))


def test_an_object_takes_at_least_one_page() -> None:
    assert pages_for(0, 4096) == 1
    assert pages_for(1, 4096) == 1
    assert pages_for(4096, 4096) == 1
    assert pages_for(4097, 4096) == 2


class PagedLruMachine(RuleBasedStateMachine):
    lru: PagedLru[Resident]

    @initialize(
        total=st.integers(1, 16),
        fractions=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    )
    def create(self, total: int, fractions: tuple[float, float]) -> None:
        low, high = sorted(int(fraction * total) for fraction in fractions)
        self.lru = PagedLru(total, high, low)
        self.order: OrderedDict[str, Resident] = OrderedDict()  # model: LRU first
        self.reservations: list[tuple[int, ...]] = []
        self.pinned_retired: list[Resident] = []
        self.leaving: list[Resident] = []
        self.retired_pages: set[int] = set()

    # ------------------------------------------------------------------- rules

    @rule(key=st.sampled_from(KEYS), count=st.integers(1, 6), hold=st.booleans())
    def put(self, key: str, count: int, hold: bool) -> None:
        lru = self.lru
        resident = lru.get(key)
        if resident is not None:
            lru.touch(resident)
            self.order.move_to_end(key)
            return
        if not lru.fits(count):
            return
        if lru.needs_room(count):
            self.check_eviction(count, hold)
        pages = lru.take_pages(count)
        if pages is None:
            return
        assert list(pages) == sorted(pages), "pages are handed out ascending"
        entry = Resident(key, pages)
        lru.admit(entry)
        self.order[key] = entry

    def check_eviction(self, count: int, hold: bool) -> None:
        lru = self.lru
        eligible = [e for e in self.order.values() if not e.pins and not e.leaving]
        victims = lru.choose_victims(count)
        assert victims == eligible[: len(victims)], "victims are the LRU eligible objects"
        leaving = sum(len(e.pages) for e in self.order.values() if e.leaving)
        target = min(lru.low_pages, lru.usable_pages)
        after = lru.used_pages - leaving + count
        assert after <= target or len(victims) == len(eligible), "watermark reached"
        if victims:
            assert after + len(victims[-1].pages) > target, "no more victims than needed"
        for victim in victims:
            if hold:
                self.leaving.append(victim)
            else:
                self.settle(victim)

    def settle(self, victim: Resident) -> None:
        self.lru.finish_leaving(victim)
        if self.order.get(victim.key) is victim:
            del self.order[victim.key]
        if victim.pins:
            self.pinned_retired.append(victim)

    @precondition(lambda self: bool(self.leaving))
    @rule()
    def a_demotion_finishes(self) -> None:
        self.settle(self.leaving.pop(0))

    @rule(count=st.integers(1, 4))
    def reserve(self, count: int) -> None:
        pages = self.lru.take_pages(count)
        if pages is not None:
            assert list(pages) == sorted(pages), "pages are handed out ascending"
            self.reservations.append(pages)

    @precondition(lambda self: bool(self.reservations))
    @rule(data=st.data(), retire_one=st.booleans())
    def give_a_reservation_back(self, data: st.DataObject, retire_one: bool) -> None:
        pages = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        if retire_one:
            page = data.draw(st.sampled_from(pages))
            self.lru.retire_page(page)
            self.retired_pages.add(page)
        self.lru.return_pages(pages)

    @precondition(lambda self: bool(self.order))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        self.lru.pin(self.order[data.draw(st.sampled_from(list(self.order)))])

    @precondition(lambda self: any(e.pins for e in self.order.values() if not e.leaving)
                  or bool(self.pinned_retired))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        candidates = [
            e for e in self.order.values() if e.pins and not e.leaving
        ] + self.pinned_retired
        entry = data.draw(st.sampled_from(candidates))
        self.lru.unpin(entry)
        if entry.retired and not entry.pins:
            self.pinned_retired.remove(entry)

    @precondition(lambda self: bool(self.order))
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        entry = self.order[data.draw(st.sampled_from(list(self.order)))]
        if entry.leaving:
            return  # a victim is settled by finish_leaving
        self.lru.retire(entry)
        del self.order[entry.key]
        if entry.pins:
            self.pinned_retired.append(entry)

    @precondition(lambda self: bool(self.order))
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(list(self.order)))
        self.lru.touch(self.order[key])
        self.order.move_to_end(key)

    @rule()
    def clear(self) -> None:
        for victim in list(self.leaving):
            self.settle(victim)
        self.leaving.clear()
        resident = list(self.order.values())
        assert self.lru.clear() == len(resident)
        self.pinned_retired.extend(e for e in resident if e.pins)
        self.order.clear()

    # -------------------------------------------------------------- invariants

    @invariant()
    def every_page_is_in_exactly_one_place(self) -> None:
        lru = self.lru
        free = list(lru._free)
        owned = [p for e in self.order.values() for p in e.pages]
        owned += [p for e in self.pinned_retired for p in e.pages]
        reserved = [p for pages in self.reservations for p in pages]
        places = free + owned + reserved
        assert len(places) == len(set(places)), "a page is in two places"
        assert not set(places) & self.retired_pages, "a retired page is in use or free"
        in_use = set(places) | self.retired_pages
        assert in_use == set(range(lru.total_pages)), "a page went missing"
        assert lru.free_page_count + lru.used_pages == lru.usable_pages
        assert lru.usable_pages == lru.total_pages - len(self.retired_pages)

    @invariant()
    def lru_order_is_the_models(self) -> None:
        assert self.lru.keys() == tuple(self.order)
        assert self.lru.pinned_retired == len(self.pinned_retired)

    @invariant()
    def pinned_objects_are_never_retired_behind_the_callers_back(self) -> None:
        for entry in self.order.values():
            assert not entry.retired and entry.key in self.lru


PagedLruMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                             deadline=None)
test_paged_lru = PagedLruMachine.TestCase
