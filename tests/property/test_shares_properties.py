"""Properties of how namespaces share the server's DRAM (`umbp.runtime.server.shares`,
through the server's `PoolIndex`).

A state machine drives puts by three namespaces (each making room the way the server
does: victims chosen for the reserving namespace, then settled), touches, pins, unpins,
retentions, a clock that ends them, quotas set and removed, and drops. After every step
the per-namespace books agree with the objects (pages, bytes, counts, retained figures,
the evictable order holding exactly the resident objects neither retained nor leaving).
At every choice of victims:
* a retained (unexpired) or pinned object is never chosen;
* a victim chosen for a quota is the reserving namespace's own;
* a victim chosen for pressure ("share") belongs to a namespace that held more than an
  even share of the low watermark before the choice, and one chosen past that ("lru") is
  the reserving namespace's own: a namespace within its share loses nothing to another's
  burst;
* afterwards the reserving namespace fits its quota, unless it had nothing left to evict.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from umbp.runtime.server.index import Entry, PoolIndex
from umbp.runtime.server.shares import EvictionCause

PAGE = 64
NAMESPACES = ("aaaa", "bbbb", "cccc")


def key_of(namespace: str, serial: int) -> str:
    return f"umbp:1:{namespace}:tp0:pcp0:dcp0:pp0:g0:{serial:08x}"


class SharesMachine(RuleBasedStateMachine):
    index: PoolIndex

    @initialize(total=st.integers(4, 40), fractions=st.tuples(st.floats(0.3, 0.7),
                                                               st.floats(0.75, 1.0)))
    def create(self, total: int, fractions: tuple[float, float]) -> None:
        low, high = (max(1, int(fraction * total)) for fraction in fractions)
        self.index = PoolIndex(total, PAGE, high_pages=max(high, low + 1), low_pages=low)
        self.index.default_budget_pages = total
        self.now = 0.0
        self.serial = 0
        self.pinned: list[Entry] = []

    # ------------------------------------------------------------------- rules

    @rule(namespace=st.sampled_from(NAMESPACES), pages=st.integers(1, 4))
    def put(self, namespace: str, pages: int) -> None:
        index = self.index
        before = {name: self._held(name) for name in NAMESPACES}
        active = {name for name, held in before.items() if held} | {namespace}
        share = index.low_pages // len(active)
        over_share = {name: held + (pages if name == namespace else 0) > share
                      for name, held in before.items()}
        retained = {entry.key for entry in index.entries() if entry.retained_until}
        pinned = {entry.key for entry in index.entries() if entry.pins}
        victims: list[Entry] = []
        if index.needs_room_for(namespace, pages):
            victims = index.choose_victims_for(namespace, pages, self.now)
        for victim in victims:
            assert victim.key not in retained and victim.key not in pinned
            if victim.evicted_for is EvictionCause.QUOTA:
                assert victim.namespace == namespace
            elif victim.evicted_for is EvictionCause.SHARE:
                assert over_share[victim.namespace], (victim.namespace, before, share)
            else:
                assert victim.evicted_for is EvictionCause.LRU
                assert victim.namespace == namespace
        for victim in victims:
            index.finish_leaving(victim)
        quota = index.quota_pages.get(namespace)
        if quota is not None:
            usage = index.usage(namespace)
            held = 0 if usage is None else usage.pages
            evictable = [] if usage is None else [e for e in usage.evictable.values()
                                                  if not e.pins]
            assert held + pages <= quota or not evictable
            if pages > (index.quota_room(namespace) or 0):
                return  # the server refuses a put past the quota
        regions = index.reserve(pages * PAGE)
        if regions is None:
            return
        self.serial += 1
        index.insert(key_of(namespace, self.serial), regions, pages * PAGE - 1, 0)

    @rule(namespace=st.sampled_from(NAMESPACES), sizes=st.lists(st.integers(1, 3), max_size=8))
    def burst(self, namespace: str, sizes: list[int]) -> None:
        """One namespace puts many objects in a row (a model's burst)."""
        for pages in sizes:
            self.put(namespace, pages)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        entries = list(self.index.entries())
        if entries:
            self.index.touch(data.draw(st.sampled_from(entries)))

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        entries = list(self.index.entries())
        if entries:
            entry = data.draw(st.sampled_from(entries))
            self.index.pin(entry)
            self.pinned.append(entry)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        if self.pinned:
            entry = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
            self.index.unpin(entry)

    @rule(data=st.data(), seconds=st.floats(0.5, 10.0))
    def retain(self, data: st.DataObject, seconds: float) -> None:
        entries = [entry for entry in self.index.entries() if not entry.leaving]
        if not entries:
            return
        entry = data.draw(st.sampled_from(entries))
        if entry.retained_until or len(entry.pages) <= self.index.retainable_pages(
            entry.namespace
        ):
            self.index.retain(entry, self.now + seconds)

    @rule(seconds=st.floats(0.0, 5.0))
    def advance(self, seconds: float) -> None:
        self.now += seconds
        ended = self.index.expire_retentions(self.now)
        assert ended >= 0
        assert all(entry.retained_until > self.now or not entry.retained_until
                   for entry in self.index.entries())

    @rule(namespace=st.sampled_from(NAMESPACES), quota=st.none() | st.integers(1, 20))
    def set_quota(self, namespace: str, quota: int | None) -> None:
        if quota is None:
            self.index.quota_pages.pop(namespace, None)
        else:
            self.index.quota_pages[namespace] = quota

    @rule(namespace=st.sampled_from(NAMESPACES), budget=st.integers(0, 10))
    def lower_budget(self, namespace: str, budget: int) -> None:
        self.index.budget_pages[namespace] = budget
        self.index.release_past_budget(namespace)
        usage = self.index.usage(namespace)
        assert usage is None or usage.retained_pages <= budget

    @rule(namespace=st.sampled_from(NAMESPACES))
    def drop(self, namespace: str) -> None:
        for entry in self.index.entries_of(namespace):
            self.index.retire(entry)

    # -------------------------------------------------------------- invariants

    @invariant()
    def books_agree_with_the_objects(self) -> None:
        index = self.index
        total_retained = 0
        for name in NAMESPACES:
            entries = [entry for entry in index.entries() if entry.namespace == name]
            usage = index.usage(name)
            if usage is None:
                assert not entries
                continue
            assert usage.pages == sum(len(entry.pages) for entry in entries)
            assert usage.nbytes == sum(entry.nbytes for entry in entries)
            assert usage.objects == len(entries)
            kept = [entry for entry in entries if entry.retained_until]
            assert usage.retained_pages == sum(len(entry.pages) for entry in kept)
            assert usage.retained_objects == len(kept)
            assert set(usage.evictable) == {
                entry.key for entry in entries if not entry.retained_until and not entry.leaving
            }
            total_retained += usage.retained_pages
        assert index.retained_pages == total_retained

    def _held(self, namespace: str) -> int:
        usage = self.index.usage(namespace)
        return 0 if usage is None else usage.pages - usage.leaving_pages


TestShares = SharesMachine.TestCase
TestShares.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
