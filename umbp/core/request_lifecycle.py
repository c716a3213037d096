"""One request's life in the scheduler role, as values and the rules that move them.

The scheduler shell keeps one :class:`RequestLifecycle` per request (inside its
``RequestState``) and every vLLM hook is "read vLLM's objects -> one function here
-> apply the result": which lookup step comes next, what an allocation plans, which
loads a step forwards, what a preemption or a cache reset forgets, and whether a
finished request's tail is stored. Each step's store window is
:mod:`umbp.core.store_windows`; what a failed load rewinds,
:mod:`umbp.core.failed_loads`. The plans themselves come from
:mod:`umbp.core.load_plans`, :mod:`umbp.core.store_tracking`,
:mod:`umbp.core.store_plans` and :mod:`umbp.core.lookup`; these modules only
sequence them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from returns.result import Failure, Result, Success

from umbp.core.load_plans import BlockLoadBatch, UnplannedLoad, plan_allocated_load
from umbp.core.lookup import BlockTable, LoadSpec, LookupGeometry, LookupQuery, LookupSkip
from umbp.core.store_tracking import StoreTracker

__all__ = [
    "AllocationOutcome",
    "LookupAction",
    "LookupProgress",
    "RequestLifecycle",
    "StepLoads",
    "after_allocation",
    "after_cache_reset",
    "after_lookup_skip",
    "after_match",
    "after_preemption",
    "cache_reset_allowed",
    "lookup_still_current",
    "needs_coordinator",
    "next_lookup_action",
    "registers_finished_tail",
    "take_step_loads",
]


@dataclass(frozen=True, slots=True)
class RequestLifecycle:
    """What the scheduler remembers about one request between hooks.

    ``load_spec`` is the last hit window umbp answered (until vLLM allocates for it
    or it goes stale); ``load_async`` whether that load runs asynchronously (kept
    until a step forwards the load, as vLLM remembers its own answer); ``load`` and
    ``unplanned_load`` what the allocation planned, until the next step's metadata
    carries it; ``tracker`` the store watermark and block table, from the first
    allocation with blocks (None: not tracked for storing).
    """

    load_spec: LoadSpec | None = None
    load_async: bool = False
    load: BlockLoadBatch | None = None
    unplanned_load: tuple[int, ...] | None = None
    tracker: StoreTracker | None = None

    def with_tracker(self, tracker: StoreTracker) -> RequestLifecycle:
        """The same state with a new tracker (built directly: the store step calls
        this for every scheduled request, and ``dataclasses.replace`` costs ~3x)."""
        if tracker is self.tracker:
            return self
        return RequestLifecycle(
            self.load_spec, self.load_async, self.load, self.unplanned_load, tracker
        )


# ----------------------------------------------------------------------- lookup


class LookupProgress(enum.Enum):
    """Where an asynchronous lookup of the request stands."""

    NONE = "no lookup running"
    RUNNING = "lookup running"
    ANSWERED = "lookup answered"


class LookupAction(enum.Enum):
    """What ``get_num_new_matched_tokens`` does next."""

    ANSWER_NOTHING = "answer 0 tokens and forget an earlier load spec"
    WAIT = "answer 'not yet': vLLM asks again next step"
    SUBMIT = "start an asynchronous lookup and answer 'not yet'"
    LOOKUP_NOW = "look up on the scheduler thread"
    READ_ANSWER = "read the finished asynchronous lookup"


def lookup_still_current(
    same_request: bool,
    query: LookupQuery,
    local_tokens: int,
    num_tokens: int,
    hashes: Sequence[bytes],
) -> bool:
    """Whether a running lookup still answers for the request vLLM asks about: the
    same request object (an id can be reused) in the same state (local tokens,
    length, hashes). A stale one is cancelled before anything else is decided."""
    return same_request and query.describes(local_tokens, num_tokens, hashes)


def next_lookup_action(
    skip: LookupSkip | None, progress: LookupProgress, lookup_async: bool
) -> LookupAction:
    """A skip reason (:func:`umbp.core.lookup.lookup_skip_reason`) wins over a
    running lookup (its answer would be for tokens vLLM no longer asks about); a
    running lookup is waited for; otherwise a new lookup runs, off the scheduler
    thread when ``lookup_async``."""
    if skip is not None:
        return LookupAction.ANSWER_NOTHING
    if progress is LookupProgress.RUNNING:
        return LookupAction.WAIT
    if progress is LookupProgress.ANSWERED:
        return LookupAction.READ_ANSWER
    return LookupAction.SUBMIT if lookup_async else LookupAction.LOOKUP_NOW


def after_lookup_skip(state: RequestLifecycle) -> RequestLifecycle:
    """On every skip the earlier load spec is forgotten: the answer is 0 tokens, so
    it no longer describes what vLLM allocates (see ``lookup_skip_reason``)."""
    return replace(state, load_spec=None)


def after_match(state: RequestLifecycle, spec: LoadSpec, load_async: bool) -> RequestLifecycle:
    """umbp answered ``spec``: it is what the allocation plans from."""
    return replace(state, load_spec=spec, load_async=load_async)


def needs_coordinator(group_count: int, single_group_is_full_attention: bool) -> bool:
    """Several cache groups, or one that is not plain full attention: vLLM's own
    coordinator decides the hit window from umbp's answers."""
    return group_count > 1 or (group_count == 1 and not single_group_is_full_attention)


# ------------------------------------------------------------------- allocation


AllocationOutcome = Result[BlockLoadBatch, UnplannedLoad] | None
"""A planned load, the blocks vLLM must recompute, or None: nothing to load."""


def after_allocation(
    state: RequestLifecycle,
    request_id: str,
    geometry: LookupGeometry,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    num_external_tokens: int,
) -> tuple[RequestLifecycle, AllocationOutcome]:
    """``update_state_after_alloc``: vLLM's table becomes the tracker's, and the
    load is planned for what vLLM allocated (:func:`plan_allocated_load`: never an
    exception for vLLM's choice, at worst blocks to recompute).

    An empty table (nothing allocated in a prefix-cacheable group) changes nothing.
    No external tokens: the request loads nothing and forgets its spec.
    """
    if not block_table:
        return state, None
    tracker = (state.tracker or StoreTracker()).with_blocks_replaced(block_table)
    if num_external_tokens <= 0:
        return replace(
            state, tracker=tracker, load=None, load_spec=None, load_async=False
        ), None
    outcome = plan_allocated_load(
        request_id, geometry, state.load_spec, block_table, request_hashes, num_external_tokens
    )
    match outcome:
        case Success(batch):
            return replace(state, tracker=tracker, load=batch), outcome
        case Failure(unplanned):
            return replace(state, tracker=tracker, unplanned_load=unplanned.block_ids), outcome
    raise AssertionError("unreachable")  # pragma: no cover


# ------------------------------------------------------------------ step loads


@dataclass(frozen=True, slots=True)
class StepLoads:
    """What one step's metadata carries for loads, and the states after it."""

    loads: tuple[BlockLoadBatch, ...]
    unplanned: Mapping[str, tuple[int, ...]]
    async_loads: frozenset[str]
    states: Mapping[str, RequestLifecycle]


def take_step_loads(states: Mapping[str, RequestLifecycle]) -> StepLoads:
    """Every planned load goes out this step, whether or not vLLM scheduled the
    request (an asynchronous load is admitted without scheduled tokens). Those in
    ``async_loads`` are reported back as finished receives. A request whose load
    went out forgets its spec and its async flag; only changed states are returned.
    """
    loads: list[BlockLoadBatch] = []
    unplanned: dict[str, tuple[int, ...]] = {}
    async_loads: list[str] = []
    changed: dict[str, RequestLifecycle] = {}
    for request_id, state in states.items():
        if state.load is None and state.unplanned_load is None:
            continue
        if state.load is not None:
            loads.append(state.load)
        if state.unplanned_load is not None:
            unplanned[request_id] = state.unplanned_load
        if state.load_async:
            async_loads.append(request_id)
        changed[request_id] = replace(
            state, load=None, unplanned_load=None, load_spec=None, load_async=False
        )
    return StepLoads(tuple(loads), unplanned, frozenset(async_loads), changed)


# -------------------------------------------- preemption, cache reset, finish


def after_preemption(state: RequestLifecycle) -> RequestLifecycle:
    """A preempted request starts over: its blocks are gone (the tracker resets)
    and its spec describes nothing vLLM will allocate."""
    tracker = None if state.tracker is None else state.tracker.reset()
    return replace(state, load_spec=None, tracker=tracker)


def cache_reset_allowed(stores_in_flight: bool, finished_tails_waiting: bool) -> bool:
    """``reset_prefix_cache(reset_connector=True)`` is refused while a store event
    is unacknowledged or a finished request's tail waits for its step: workers are
    still to copy those pages into the pool the reset would empty (vLLM asks
    again; the pins keep the pages meanwhile)."""
    return not stores_in_flight and not finished_tails_waiting


def after_cache_reset(state: RequestLifecycle) -> RequestLifecycle:
    """The pool was emptied: no window or planned load can be served any more."""
    return replace(state, load_spec=None, load=None)


def registers_finished_tail(
    stores_enabled: bool,
    pool_bound: bool,
    has_entries: bool,
    already_registered: bool,
    tracked: bool,
) -> bool:
    """Whether a finished request's partial-tail hand-off is planned at all: umbp
    stores, vLLM's block pool is bound (the pages are pinned there), vLLM handed
    something off, the request is tracked, and only once per request (its pins are
    taken once and released once)."""
    return stores_enabled and pool_bound and has_entries and tracked and not already_registered
