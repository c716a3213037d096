"""Properties of how namespaces share the server's DRAM (`umbp.runtime.server.shares`,
through the server's `PoolIndex`).

A state machine drives puts by three namespaces (each making room the way the server
does: victims chosen for the reserving namespace, then settled), touches, pins, unpins,
retentions, a clock that ends them, quotas set and removed, and drops. After every step
the per-namespace books agree with the objects (pages, bytes, counts, retained figures,
the evictable order holding exactly the resident objects neither retained nor leaving,
the longest retention), and the figures kept incrementally (pinned objects, resident
pages) equal a recount.
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

import contextlib
import tempfile
import time
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.unit.test_server_state import PAGE as SERVER_PAGE
from tests.unit.test_server_state import Rig
from umbp.runtime.server.index import Entry, PoolIndex
from umbp.runtime.server.sessions import RequestRefused, Session
from umbp.runtime.server.shares import EvictionCause
from umbp.runtime.ssd.tier import SsdTier

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
            assert index.longest_retention(name) == max(
                (entry.retained_until for entry in kept), default=0.0)
        assert index.retained_pages == total_retained

    @invariant()
    def figures_kept_as_objects_come_and_go_equal_a_recount(self) -> None:
        """What `umbp ls` and a metrics scrape read without a scan of the objects."""
        index = self.index
        assert index.pinned_objects == sum(1 for entry in index.entries() if entry.pins)
        assert index.resident_pages() == sum(len(entry.pages) for entry in index.entries())

    def _held(self, namespace: str) -> int:
        usage = self.index.usage(namespace)
        return 0 if usage is None else usage.pages - usage.leaving_pages


TestShares = SharesMachine.TestCase
TestShares.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


class ServerFiguresMachine(RuleBasedStateMachine):
    """`StoreCore` over a real SSD tier: puts by two namespaces (demoting to SSD), gets
    (promoting back), gets left open (pins), lookups, retentions of one call's objects
    (one time for all of them) and extensions, drops, clears, the shutdown's copy to
    SSD, the SSD tier's own evictions. After every step `umbp ls`' and `umbp stats`'
    figures, kept as objects come and go, equal a recount over the objects."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        self.ssd = SsdTier(Path(self.directory.name) / "ssd", 12 * SERVER_PAGE,
                           slot_bytes=SERVER_PAGE)
        self.rig = Rig(16, cold=self.ssd)
        self.rig.core.configure_retention(3600.0, 4 * SERVER_PAGE, capped=True)
        self.open_gets: list[tuple[Session, int]] = []

    def teardown(self) -> None:
        self.ssd.close()
        self.directory.cleanup()

    @rule(namespace=st.sampled_from(NAMESPACES[:2]), serials=st.lists(st.integers(0, 12),
                                                                     min_size=1, max_size=6))
    def put(self, namespace: str, serials: list[int]) -> None:
        self.rig.put({key_of(namespace, serial): bytes([serial]) * (SERVER_PAGE - serial)
                      for serial in serials})

    @rule(namespace=st.sampled_from(NAMESPACES[:2]), serials=st.lists(st.integers(0, 12),
                                                                     min_size=1, max_size=4),
          keep_open=st.booleans())
    def get(self, namespace: str, serials: list[int], keep_open: bool) -> None:
        keys = [key_of(namespace, serial) for serial in dict.fromkeys(serials)]
        sizes = [SERVER_PAGE - serial for serial in dict.fromkeys(serials)]
        if not keep_open:
            self.rig.get(keys, sizes)
            return
        session = self.rig.core.open_session()
        token, _ = self.rig.core.begin_get(session, keys, sizes)
        self.open_gets.append((session, token))

    @rule(data=st.data(), corrupt=st.booleans())
    def end_get(self, data: st.DataObject, corrupt: bool) -> None:
        if self.open_gets:
            session, token = self.open_gets.pop(
                data.draw(st.integers(0, len(self.open_gets) - 1)))
            self.rig.core.end_get(session, token, [0] if corrupt else [])
            self.rig.core.close_session(session)

    @rule(namespace=st.sampled_from(NAMESPACES[:2]), serials=st.lists(st.integers(0, 12),
                                                                     max_size=6))
    def lookup(self, namespace: str, serials: list[int]) -> None:
        self.rig.core.lookup([key_of(namespace, serial) for serial in serials])

    @rule(namespace=st.sampled_from(NAMESPACES[:2]), serials=st.lists(st.integers(0, 12),
                                                                     min_size=1, max_size=4),
          seconds=st.sampled_from([30.0, 60.0, 600.0]))
    def retain(self, namespace: str, serials: list[int], seconds: float) -> None:
        with contextlib.suppress(RequestRefused):  # past a budget: nothing retained
            self.rig.core.retain([key_of(namespace, serial) for serial in serials], seconds)

    @rule(namespace=st.none() | st.sampled_from(NAMESPACES[:2]))
    def drop(self, namespace: str | None) -> None:
        with contextlib.suppress(RequestRefused):  # a namespace the server never saw
            self.rig.core.drop(namespace)

    @rule()
    def clear(self) -> None:
        self.rig.core.clear()

    @rule()
    def persist(self) -> None:
        self.rig.core.persist_to_cold()

    @invariant()
    def listing_and_stats_equal_a_recount(self) -> None:
        core = self.rig.core
        index: PoolIndex = core._index
        cold_keys = core._tiers.cold_keys
        entries = list(index.entries())
        stats = core.stats()
        assert stats["objects"] == len({entry.key for entry in entries} | set(cold_keys))
        assert stats["dram"]["resident_bytes"] == sum(
            len(entry.pages) for entry in entries) * SERVER_PAGE
        assert stats["dram"]["pinned_objects"] == sum(1 for entry in entries if entry.pins)
        now = time.monotonic()
        for row in core.namespaces():
            kept = [entry.retained_until for entry in entries
                    if entry.namespace == row["namespace"] and entry.retained_until]
            longest = max(kept, default=0.0)
            assert row["retained"]["objects"] == len(kept)
            assert abs(row["retained"]["longest_s"] - max(0.0, longest - now)) < 5.0
            assert index.longest_retention(row["namespace"]) == longest


TestServerFigures = ServerFiguresMachine.TestCase
TestServerFigures.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
