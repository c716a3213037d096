"""What the scheduler role keeps per request: one immutable value.

Its decisions live in :class:`umbp.core.requests.RequestLifecycle` and the
functions beside it; this value adds only what core cannot hold: vLLM's request
object (read through :class:`~umbp.shell.vllm_compat.objects.RequestLike`) and a lookup
running on the lookup thread pool.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from umbp.core.lookup.admission import LookupProgress
from umbp.core.lookup.query import EMPTY_LOOKUP_MEMO, LookupMemo, LookupQuery
from umbp.core.requests import RequestLifecycle
from umbp.shell.vllm_compat.objects import RequestLike


@dataclass(frozen=True, slots=True)
class PendingLookup:
    """A lookup running off the scheduler thread, for the request object it was
    built for (vLLM may reuse an id for another request)."""

    request: object
    query: LookupQuery
    answer: Future[tuple[bool, ...]]

    @property
    def progress(self) -> LookupProgress:
        return LookupProgress.ANSWERED if self.answer.done() else LookupProgress.RUNNING


@dataclass(frozen=True, slots=True)
class RequestState:
    """``request``: vLLM's request, from its first allocation (None before);
    ``lookup``: a running asynchronous lookup; ``life``: everything core decides
    from; ``lookups``: core's :class:`~umbp.core.lookup.query.LookupMemo`, the request's
    last query (a repeated lookup of a waiting request reuses it whole) and, only
    for a store asked by key string, the keys built so far, so none is built twice.
    ``awaiting_since``: when it started waiting for announced blocks (disaggregated
    prefill), None when it does not wait; ``warming`` likewise for hits the store brings
    in from its disk tier."""

    request: RequestLike | None = None
    lookup: PendingLookup | None = None
    life: RequestLifecycle = field(default_factory=RequestLifecycle)
    lookups: LookupMemo = EMPTY_LOOKUP_MEMO
    awaiting_since: float | None = None
    """When the request started waiting for blocks its prefill engine announced."""
    warming: tuple[float, float, int, float] | None = None
    """While the request waits for hits the store brings in from its disk tier: when it
    started, when the last of them arrived, how many were still on disk then, when it
    last asked."""
    prefetching: bool = False
    """Its lookup started bringing objects in from the store's disk tier (to be forgotten
    when the request goes away)."""

    @property
    def lookup_progress(self) -> LookupProgress:
        return LookupProgress.NONE if self.lookup is None else self.lookup.progress

    @property
    def tracked(self) -> bool:
        """Tracked for storing: allocated, with blocks in a prefix-cacheable group."""
        return self.request is not None and self.life.tracker is not None

    def with_life(self, life: RequestLifecycle) -> RequestState:
        if life is self.life:
            return self
        return RequestState(self.request, self.lookup, life, self.lookups,
                            self.awaiting_since, self.warming,
                            self.prefetching)  # hot: no replace

    def with_lookups(self, lookups: LookupMemo) -> RequestState:
        if lookups is self.lookups:
            return self
        return RequestState(self.request, self.lookup, self.life, lookups, self.awaiting_since,
                            self.warming, self.prefetching)

    def without_lookup(self) -> RequestState:
        """The running lookup is dropped (its answer is not wanted any more)."""
        if self.lookup is not None:
            self.lookup.answer.cancel()
        return replace(self, lookup=None)


UNKNOWN = RequestState()
"""A request the scheduler has no state for yet."""
