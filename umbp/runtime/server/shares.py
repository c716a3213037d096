"""How the namespaces of a `umbp serve` share its DRAM: per-namespace usage, quotas, an
even share under pressure, and retained objects.

Every engine configuration stores under its own namespace (core.identity), so one
server holds several models. Plain LRU would let one model's burst evict every other
model's working set; here each resident object is charged to its namespace, and the
DRAM index chooses victims by these rules (`NamespacedLru.choose_victims_for`), for a
reservation of `k` pages by namespace `n`:

1. **Quota.** When `n` has a quota (`umbp serve --quota`, `umbp limits`) and its pages
   plus `k` would exceed it, `n`'s own least recently used objects go first, until it
   fits: a namespace never grows past its quota, whatever room is free.
2. **Even share under pressure.** When the reservation would cross the high watermark,
   victims are chosen until usage is at the low watermark, each time the least
   recently used object among the namespaces holding more than an even share of the
   low watermark (its pages divided by the namespaces with objects in DRAM, the
   reserving one counted with its `k` pages). A namespace within its share loses
   nothing while another is over its own: one model's burst evicts that model's
   objects, not another's working set.
3. **Its own LRU.** Only if that is not enough (every namespace within its share, with
   pages taken by puts in flight, pinned or retained objects): the reserving namespace's
   own least recently used objects. Never another's: past that the reservation gets
   what is free (the high watermark is a target, not a wall), and a put that finds no
   free page is refused. (A reservation charged to no namespace takes plain LRU victims
   over everything.)

Pinned objects (a client is copying them) and objects already leaving are never
chosen, as before. **Retained** objects are never chosen while their retention lasts:
a request may ask that its blocks be kept (`retain`), for at most the server's longest
retention and within its namespace's retention budget, and everything retained together
stays within half the low watermark (so retention can never starve the pool). A
retention past its time makes the object evictable again; lowering a budget below what
is retained releases the retentions that end first.

Not thread-safe, like `PagedLru`: the server holds its index lock around every call.
Invariants: tests/property/test_shares_properties.py.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from umbp.core.identity import namespace_of_key
from umbp.runtime.paging import PagedLru, Resident

__all__ = [
    "OTHER_LABEL",
    "OTHER_NAMESPACE",
    "EvictionCause",
    "NamespaceUsage",
    "NamespacedLru",
    "SharedResident",
]

OTHER_NAMESPACE: Final = ""
"""Where objects whose keys are not umbp's are charged (`umbp ls` shows `OTHER_LABEL`)."""
OTHER_LABEL: Final = "(other)"


class EvictionCause(enum.StrEnum):
    """Why an object was chosen to leave DRAM (to SSD or dropped)."""

    QUOTA = "quota"
    """Its namespace was at its quota."""
    SHARE = "share"
    """DRAM was under pressure and its namespace held more than an even share."""
    LRU = "lru"
    """DRAM was under pressure, every namespace was within its share, and it was the
    reserving namespace's own least recently used object."""


class SharedResident(Resident):
    """A resident object charged to the namespace its key names."""

    __slots__ = ("evicted_for", "namespace", "nbytes", "retained_until", "tick")

    def __init__(self, key: str, pages: tuple[int, ...], nbytes: int) -> None:
        super().__init__(key, pages)
        namespace = namespace_of_key(key)
        self.namespace = OTHER_NAMESPACE if namespace is None else namespace
        self.nbytes = nbytes
        self.retained_until = 0.0
        """Monotonic seconds its retention lasts until; 0.0: not retained."""
        self.tick = 0
        """When it was last admitted or touched (larger: more recent)."""
        self.evicted_for: EvictionCause | None = None


S = TypeVar("S", bound=SharedResident)


@dataclass(slots=True)
class NamespaceUsage(Generic[S]):
    """One namespace's share of DRAM."""

    pages: int = 0
    """Pages of its resident objects (retained and leaving ones included)."""
    nbytes: int = 0
    objects: int = 0
    leaving_pages: int = 0
    retained_pages: int = 0
    retained_objects: int = 0
    evictions: dict[EvictionCause, int] = field(default_factory=dict)
    evictable: OrderedDict[str, S] = field(default_factory=OrderedDict)
    """Resident objects neither retained nor leaving, least recently used first."""
    retained_untils: dict[float, int] = field(default_factory=dict)
    """Retained objects per time their retention lasts until (one retain call's objects
    share one: few times, many objects)."""
    latest_untils: list[float] = field(default_factory=list)
    """Those times negated, a heap; times no object is retained until any more are
    dropped lazily (`NamespacedLru.longest_retention`)."""


class NamespacedLru(PagedLru[S]):
    """`PagedLru` whose victims follow the rules of the module docstring."""

    def __init__(self, total_pages: int, high_pages: int, low_pages: int) -> None:
        super().__init__(total_pages, high_pages, low_pages)
        self._usage: dict[str, NamespaceUsage[S]] = {}
        self._ticks = itertools.count(1)
        self._expiries: list[tuple[float, int, S]] = []
        self._expiry_order = itertools.count()
        self.quota_pages: dict[str, int] = {}
        """Namespaces with a quota, in pages."""
        self.budget_pages: dict[str, int] = {}
        """Retention budgets set for one namespace, in pages."""
        self.default_budget_pages = 0
        """The retention budget of a namespace without one of its own."""
        self.retained_pages = 0
        """Pages of every retained object."""
        self.pinned_objects = 0
        """Resident objects with a pin (a client copying them, or leaving)."""

    # ------------------------------------------------------------------ figures

    @property
    def retained_cap_pages(self) -> int:
        """What every namespace may retain together: half the low watermark."""
        return self._low_cap // 2

    def usage(self, namespace: str) -> NamespaceUsage[S] | None:
        return self._usage.get(namespace)

    def namespaces(self) -> tuple[str, ...]:
        """Namespaces with objects in DRAM, or that had some."""
        return tuple(self._usage)

    def budget_of(self, namespace: str) -> int:
        """The namespace's retention budget, in pages."""
        return self.budget_pages.get(namespace, self.default_budget_pages)

    def resident_pages(self) -> int:
        """Pages of every resident object (retained and leaving ones included)."""
        return sum(usage.pages for usage in self._usage.values())

    def longest_retention(self, namespace: str) -> float:
        """When the namespace's longest retention ends (monotonic seconds; 0.0: none)."""
        usage = self._usage.get(namespace)
        if usage is None:
            return 0.0
        latest, untils = usage.latest_untils, usage.retained_untils
        while latest and -latest[0] not in untils:
            heapq.heappop(latest)
        return -latest[0] if latest else 0.0

    def entries_of(self, namespace: str) -> tuple[S, ...]:
        """The namespace's resident objects (any order)."""
        return tuple(entry for entry in self.entries() if entry.namespace == namespace)

    # ------------------------------------------------------------- bookkeeping

    def admit(self, entry: S) -> None:
        super().admit(entry)
        usage = self._usage_of(entry.namespace)
        usage.pages += len(entry.pages)
        usage.nbytes += entry.nbytes
        usage.objects += 1
        usage.evictable[entry.key] = entry
        entry.tick = next(self._ticks)

    def touch(self, entry: S) -> None:
        key = entry.key
        if self._objects.get(key) is not entry:
            return
        self._objects.move_to_end(key)  # PagedLru.touch, without asking again
        entry.tick = next(self._ticks)
        evictable = self._usage[entry.namespace].evictable  # admitted: it has a usage
        if key in evictable:
            evictable.move_to_end(key)

    def pin(self, entry: S) -> None:
        if not entry.pins and not entry.retired:
            self.pinned_objects += 1
        entry.pins += 1

    def unpin(self, entry: S) -> None:
        if entry.pins == 1 and not entry.retired:
            self.pinned_objects -= 1
        super().unpin(entry)

    def retire(self, entry: S) -> None:
        if not entry.retired and self._objects.get(entry.key) is entry:
            if entry.pins:
                self.pinned_objects -= 1
            usage = self._usage_of(entry.namespace)
            if entry.retained_until:
                self._forget_retention(entry, usage)
            usage.pages -= len(entry.pages)
            usage.nbytes -= entry.nbytes
            usage.objects -= 1
            usage.evictable.pop(entry.key, None)
        super().retire(entry)

    def finish_leaving(self, entry: S) -> None:
        usage = self._usage_of(entry.namespace)
        usage.leaving_pages -= len(entry.pages)
        if entry.evicted_for is not None:
            usage.evictions[entry.evicted_for] = usage.evictions.get(entry.evicted_for, 0) + 1
        super().finish_leaving(entry)

    def reset(self) -> None:
        super().reset()
        for usage in self._usage.values():
            usage.pages = usage.nbytes = usage.objects = usage.leaving_pages = 0
            usage.retained_pages = usage.retained_objects = 0
            usage.evictable.clear()
            usage.retained_untils.clear()
            usage.latest_untils.clear()
        self._expiries.clear()
        self.retained_pages = 0
        self.pinned_objects = 0

    def _usage_of(self, namespace: str) -> NamespaceUsage[S]:
        usage = self._usage.get(namespace)
        if usage is None:
            usage = self._usage[namespace] = NamespaceUsage()
        return usage

    # ----------------------------------------------------------------- victims

    def needs_room_for(self, namespace: str | None, pages_needed: int) -> bool:
        """Would `pages_needed` more pages for `namespace` cross the high watermark or
        the namespace's quota?"""
        return self.needs_room(pages_needed) or self._over_quota(namespace, pages_needed) > 0

    def choose_victims(self, pages_needed: int) -> list[S]:
        return self.choose_victims_for(None, pages_needed, now=None)

    def choose_victims_for(
        self, namespace: str | None, pages_needed: int, now: float | None
    ) -> list[S]:
        """The victims for `pages_needed` pages of `namespace` (rules 1-3 of the module
        docstring), each marked leaving and pinned: hand each to `finish_leaving`.
        `now` (monotonic seconds) ends the retentions past their time first."""
        if now is not None:
            self.expire_retentions(now)
        victims: list[S] = []
        excess = self._over_quota(namespace, pages_needed)
        if excess > 0 and namespace is not None:
            usage = self._usage_of(namespace)
            while excess > 0:
                entry = self._first_evictable(usage)
                if entry is None:
                    break
                excess -= self._take(entry, usage, EvictionCause.QUOTA, victims)
        if not self.needs_room(pages_needed):
            return victims
        target = self._low_cap
        while self._above(target, pages_needed):
            entry = self._oldest_over_share(namespace, pages_needed, target)
            if entry is None:
                break
            self._take(entry, self._usage_of(entry.namespace), EvictionCause.SHARE, victims)
        if namespace is not None:
            usage = self._usage_of(namespace)
            while self._above(target, pages_needed):
                entry = self._first_evictable(usage)
                if entry is None:
                    break
                self._take(entry, usage, EvictionCause.LRU, victims)
            return victims
        for entry in self._objects.values():  # taking one does not change this order
            if not self._above(target, pages_needed):
                break
            if entry.pins or entry.leaving or entry.retained_until:
                continue
            self._take(entry, self._usage_of(entry.namespace), EvictionCause.LRU, victims)
        return victims

    def quota_room(self, namespace: str) -> int | None:
        """Pages the namespace may still take under its quota (None: it has none).
        Pages reserved for puts not yet committed are not charged, so a namespace may
        pass its quota by what it has in flight."""
        if namespace not in self.quota_pages:
            return None
        return max(0, -self._over_quota(namespace, 0))

    def _above(self, target: int, pages_needed: int) -> bool:
        return self.used_pages - self._leaving_pages + pages_needed > target

    def _over_quota(self, namespace: str | None, pages_needed: int) -> int:
        """Pages the namespace would hold past its quota (<= 0: none)."""
        quota = None if namespace is None else self.quota_pages.get(namespace)
        if quota is None or namespace is None:
            return 0
        usage = self._usage.get(namespace)
        held = 0 if usage is None else usage.pages - usage.leaving_pages
        return held + pages_needed - quota

    def _held(self, name: str, namespace: str | None, pages_needed: int) -> int:
        """Pages `name` holds (those leaving not counted), with the `pages_needed` it asks
        for when it is the reserving `namespace`."""
        usage = self._usage.get(name)
        held = 0 if usage is None else usage.pages - usage.leaving_pages
        return held + (pages_needed if name == namespace else 0)

    def _share(self, namespace: str | None, pages_needed: int, target: int) -> int:
        """An even share of `target`: divided by the namespaces holding pages."""
        active = {name for name in self._usage if self._held(name, namespace, pages_needed) > 0}
        if namespace is not None:
            active.add(namespace)
        return target // max(1, len(active))

    def _oldest_over_share(
        self, namespace: str | None, pages_needed: int, target: int
    ) -> S | None:
        share = self._share(namespace, pages_needed, target)
        oldest: S | None = None
        for name, usage in self._usage.items():
            if self._held(name, namespace, pages_needed) <= share:
                continue
            entry = self._first_evictable(usage)
            if entry is not None and (oldest is None or entry.tick < oldest.tick):
                oldest = entry
        return oldest

    @staticmethod
    def _first_evictable(usage: NamespaceUsage[S]) -> S | None:
        for entry in usage.evictable.values():
            if not entry.pins:
                return entry
        return None

    def _take(
        self, entry: S, usage: NamespaceUsage[S], cause: EvictionCause, victims: list[S]
    ) -> int:
        entry.leaving = True
        self.pin(entry)
        entry.evicted_for = cause
        pages = len(entry.pages)
        self._leaving_pages += pages
        usage.leaving_pages += pages
        usage.evictable.pop(entry.key, None)
        victims.append(entry)
        return pages

    # --------------------------------------------------------------- retention

    def retain(self, entry: S, until: float) -> bool:
        """Keep a resident object (not leaving) until `until` (monotonic seconds), or
        longer if it is retained longer already; True when it was not retained before.
        The caller has checked the budgets (`retainable_pages`)."""
        usage = self._usage_of(entry.namespace)
        fresh = not entry.retained_until
        if fresh:
            usage.evictable.pop(entry.key, None)
            pages = len(entry.pages)
            usage.retained_pages += pages
            usage.retained_objects += 1
            self.retained_pages += pages
        if until > entry.retained_until:
            if entry.retained_until:
                _uncount_until(usage, entry.retained_until)
            entry.retained_until = until
            _count_until(usage, until)
            heapq.heappush(self._expiries, (until, next(self._expiry_order), entry))
        return fresh

    def retainable_pages(self, namespace: str) -> int:
        """Pages the namespace may still retain: within its budget and the cap on
        everything retained."""
        usage = self._usage.get(namespace)
        held = 0 if usage is None else usage.retained_pages
        return min(self.budget_of(namespace) - held, self.retained_cap_pages - self.retained_pages)

    def expire_retentions(self, now: float) -> int:
        """End the retentions past their time; how many ended."""
        ended = 0
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            until, _, entry = heapq.heappop(expiries)
            if entry.retained_until == until and not entry.retired:
                self.end_retention(entry)
                ended += 1
        return ended

    def end_retention(self, entry: S) -> None:
        """End one object's retention now: it is evictable again, by its recency."""
        if not entry.retained_until:
            return
        usage = self._usage_of(entry.namespace)
        self._forget_retention(entry, usage)
        if entry.leaving or self._objects.get(entry.key) is not entry:
            return
        evictable = usage.evictable
        evictable[entry.key] = entry
        head = next(iter(evictable.values()))
        if head is not entry and entry.tick < head.tick:
            evictable.move_to_end(entry.key, last=False)

    def release_past_budget(self, namespace: str) -> int:
        """End the namespace's retentions that end first until it is within its budget
        (after the budget was lowered); how many ended."""
        usage = self._usage.get(namespace)
        if usage is None:
            return 0
        budget = self.budget_of(namespace)
        retained = sorted(
            (entry for entry in self.entries_of(namespace) if entry.retained_until),
            key=lambda entry: entry.retained_until,
        )
        ended = 0
        for entry in retained:
            if usage.retained_pages <= budget:
                break
            self.end_retention(entry)
            ended += 1
        return ended

    def _forget_retention(self, entry: S, usage: NamespaceUsage[S]) -> None:
        pages = len(entry.pages)
        usage.retained_pages -= pages
        usage.retained_objects -= 1
        self.retained_pages -= pages
        _uncount_until(usage, entry.retained_until)
        entry.retained_until = 0.0


def _count_until(usage: NamespaceUsage[S], until: float) -> None:
    untils = usage.retained_untils
    count = untils.get(until, 0)
    untils[until] = count + 1
    if count:
        return
    latest = usage.latest_untils
    heapq.heappush(latest, -until)
    if len(latest) > 2 * len(untils) + 32:  # mostly ended ones: rebuilt, amortised O(1)
        latest[:] = [-time for time in untils]
        heapq.heapify(latest)


def _uncount_until(usage: NamespaceUsage[S], until: float) -> None:
    untils = usage.retained_untils
    count = untils[until] - 1
    if count:
        untils[until] = count
        return
    del untils[until]
    if not untils:
        usage.latest_untils.clear()
