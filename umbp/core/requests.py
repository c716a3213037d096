"""One request's life in the scheduler role, as a value, and the rules every hook
applies to it outside lookups and stores: what an allocation plans, which loads a
step forwards, what a preemption or a cache reset forgets, and whether a finished
request's tail is stored. The lookup's rules are :mod:`umbp.core.lookup`, the
store rules :mod:`umbp.core.stores`, the load rules :mod:`umbp.core.loads`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from returns.result import Failure, Result, Success

from umbp.core.geometry import BlockTable, CacheGeometry
from umbp.core.loads.allocation import UnplannedLoad, plan_allocated_load
from umbp.core.lookup.windows import LoadSpec
from umbp.core.plans import LoadPlan
from umbp.core.stores.tracking import StoreTracker

__all__ = [
    "AllocationOutcome",
    "RequestLifecycle",
    "RequestView",
    "StepLoads",
    "after_allocation",
    "after_cache_reset",
    "after_preemption",
    "cache_reset_allowed",
    "registers_finished_tail",
    "take_step_loads",
]


class RequestView(Protocol):
    """What core reads of a serving stack's request (vLLM's ``Request`` has these):
    its chained block hashes, prompt length and every token id so far."""

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...


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
    load: LoadPlan | None = None
    unplanned_load: tuple[int, ...] | None = None
    tracker: StoreTracker | None = None

    def with_tracker(self, tracker: StoreTracker) -> RequestLifecycle:
        """The same state with a new tracker, built directly (the store step calls
        this for every storing request; ``dataclasses.replace`` costs several times
        as much)."""
        if tracker is self.tracker:
            return self
        return RequestLifecycle(
            self.load_spec, self.load_async, self.load, self.unplanned_load, tracker
        )


AllocationOutcome = Result[LoadPlan, UnplannedLoad] | None
"""A planned load, the blocks vLLM must recompute, or None: nothing to load."""


def after_allocation(
    state: RequestLifecycle,
    request_id: str,
    geometry: CacheGeometry,
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


@dataclass(frozen=True, slots=True)
class StepLoads:
    """What one step's metadata carries for loads, and the states after it."""

    loads: tuple[LoadPlan, ...]
    unplanned: Mapping[str, tuple[int, ...]]
    async_loads: frozenset[str]
    states: Mapping[str, RequestLifecycle]


def take_step_loads(states: Mapping[str, RequestLifecycle]) -> StepLoads:
    """Every planned load goes out this step, whether or not vLLM scheduled the
    request (an asynchronous load is admitted without scheduled tokens). Those in
    ``async_loads`` are reported back as finished receives. A request whose load
    went out forgets its spec and its async flag; only changed states are returned.
    """
    loads: list[LoadPlan] = []
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

