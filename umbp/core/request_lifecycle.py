"""One request's life in the scheduler role, as values and the rules that move them.

The scheduler shell keeps one :class:`RequestLifecycle` per request (inside its
``RequestState``) and every vLLM hook is "read vLLM's objects -> one function here
-> apply the result": which lookup step comes next, what an allocation plans, which
loads a step forwards, what a preemption or a cache reset forgets, and which block
table and token window a step stores from. The plans themselves come from
:mod:`umbp.core.load_plans`, :mod:`umbp.core.store_tracking`, :mod:`umbp.core.store_plans` and :mod:`umbp.core.lookup`; this module only sequences them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from returns.result import Failure, Result, Success

from umbp.core.load_plans import BlockLoadBatch, UnplannedLoad, plan_allocated_load
from umbp.core.lookup import BlockTable, LoadSpec, LookupGeometry, LookupQuery, LookupSkip
from umbp.core.store_events import (
    StoreEvent,
    StoreEventResult,
    event_acknowledged,
    merge_store_results,
)
from umbp.core.store_pass import StoreCandidates
from umbp.core.store_plans import apply_store_masks
from umbp.core.store_tracking import (
    StoreTracker,
    save_watermark,
    storable_tokens,
    store_candidate_ranges,
    store_token_limit,
    stores_this_step,
)

__all__ = [
    "AllocationOutcome",
    "LookupAction",
    "LookupProgress",
    "RequestLifecycle",
    "StepLoads",
    "StoreWindow",
    "acknowledge_reports",
    "after_allocation",
    "after_cache_reset",
    "after_failed_load",
    "after_lookup_skip",
    "after_match",
    "after_preemption",
    "cache_reset_allowed",
    "cached_request_store_window",
    "cached_request_stores",
    "hit_by_failed_load",
    "lookup_still_current",
    "needs_coordinator",
    "new_request_store_window",
    "next_lookup_action",
    "registers_finished_tail",
    "rewound_watermark",
    "store_candidates",
    "stores_over_sync_loads",
    "sync_loads_of",
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


def sync_loads_of(step: StepLoads) -> StepLoads:
    """The step's synchronous loads only (planned and unplanned), kept by the
    scheduler for one more step: vLLM's async scheduling plans the next step
    before this one's failures are known, and a request it admits may hit these
    blocks (:func:`stores_over_sync_loads` then counts them too)."""
    return StepLoads(
        tuple(b for b in step.loads if b.request_id not in step.async_loads),
        {r: ids for r, ids in step.unplanned.items() if r not in step.async_loads},
        frozenset(), {},
    )


def stores_over_sync_loads(
    loads: Sequence[BlockLoadBatch],
    async_loads: AbstractSet[str],
    unplanned: Mapping[str, tuple[int, ...]],
    storing: Mapping[str, BlockTable],
) -> dict[str, frozenset[str]]:
    """For each request storing this step whose table holds a block a synchronous
    load fills this step, the requests loading those blocks (itself included).

    A synchronous load lands before the step's forward pass, and vLLM lets other
    requests of the same step hit its blocks (they are cached at allocation): if
    the load fails, every such request computes over stale blocks, and the worker
    must not store what it computed (``umbp.core.load_outcomes.stores_past_failed_loads``).
    Block ids are compared across groups: synchronous loads exist only for one-group
    models (``effective_load_async``), and a false match only drops a store."""
    sync = [(b.request_id, b.block_ids) for b in loads if b.request_id not in async_loads]
    sync += [(r, ids) for r, ids in unplanned.items() if r not in async_loads]
    filled: dict[int, set[str]] = {}
    for request_id, block_ids in sync:
        for block in block_ids:
            filled.setdefault(block, set()).add(request_id)
    if not filled:
        return {}
    blocks = filled.keys()
    dependencies: dict[str, frozenset[str]] = {}
    for request_id, table in storing.items():
        shared = [block for group in table if not blocks.isdisjoint(group)
                  for block in group if block in filled]
        if shared:
            dependencies[request_id] = frozenset().union(*(filled[b] for b in shared))
    return dependencies


def after_preemption(state: RequestLifecycle) -> RequestLifecycle:
    """A preempted request starts over: its blocks are gone (the tracker resets)
    and its spec describes nothing vLLM will allocate."""
    tracker = None if state.tracker is None else state.tracker.reset()
    return replace(state, load_spec=None, tracker=tracker)


def rewound_watermark(saved_tokens: int, num_computed_tokens: int, hash_block_size: int) -> int:
    """The store watermark of a request vLLM recomputes from ``num_computed_tokens``
    after a failed load: back to the hash-aligned start of the recomputation (the
    block vLLM recomputes first is a candidate again), never forward."""
    return min(saved_tokens, num_computed_tokens - num_computed_tokens % hash_block_size)


def hit_by_failed_load(
    state: RequestLifecycle, failed_block_ids: AbstractSet[int], request_failed: bool
) -> bool:
    """Whether vLLM's report of failed loads concerns the request: it failed
    itself, or its table holds a failed block (its own load's, or one it shares:
    vLLM then reschedules it too)."""
    tracker = state.tracker
    return request_failed or (tracker is not None and not failed_block_ids.isdisjoint(
        block for group in tracker.block_table for block in group
    ))


def after_failed_load(
    state: RequestLifecycle,
    failed_block_ids: AbstractSet[int],
    request_failed: bool,
    num_computed_tokens: int,
    hash_block_size: int,
) -> RequestLifecycle:
    """vLLM heard of a failed load (``KVConnectorOutput.invalid_block_ids``, one
    cache group; ``failed_recving``, the request) and cut the request's computed
    tokens to ``num_computed_tokens``: its first failed block, or where the step
    started when an earlier request recomputes a shared failed block. It recomputes
    from there, so those blocks are stored again by this request
    (:func:`rewound_watermark`). A request holding no failed block, and not failed
    itself, is unchanged; so is one not tracked for storing."""
    tracker = state.tracker
    if tracker is None or not hit_by_failed_load(state, failed_block_ids, request_failed):
        return state
    saved = rewound_watermark(tracker.saved_tokens, num_computed_tokens, hash_block_size)
    if saved == tracker.saved_tokens:
        return state
    return state.with_tracker(replace(tracker, saved_tokens=saved))


def cache_reset_allowed(stores_in_flight: bool, finished_tails_waiting: bool) -> bool:
    """``reset_prefix_cache(reset_connector=True)`` is refused while a store event
    is unacknowledged or a finished request's tail waits for its step: workers are
    still to copy those pages into the pool the reset would empty (vLLM asks
    again; the pins keep the pages meanwhile)."""
    return not stores_in_flight and not finished_tails_waiting


def after_cache_reset(state: RequestLifecycle) -> RequestLifecycle:
    """The pool was emptied: no window or planned load can be served any more."""
    return replace(state, load_spec=None, load=None)


# ---------------------------------------------------------------------- stores


@dataclass(frozen=True, slots=True)
class StoreWindow:
    """One request's store candidates this step, before vLLM's masks."""

    ranges: tuple[tuple[int, range], ...]
    block_table: BlockTable
    cached_tokens: int


def _advance(
    tracker: StoreTracker,
    geometry: LookupGeometry,
    boundary_groups: AbstractSet[int],
    table: BlockTable,
    total_tokens: int,
    num_hashes: int,
) -> tuple[StoreTracker, StoreWindow]:
    """The blocks that became full (and hashed) since the watermark, and the
    watermark past them. It advances before the masks apply: a block masked out
    once is never a candidate again (see :func:`apply_store_masks`)."""
    storable = storable_tokens(total_tokens, num_hashes, geometry.hash_block_size)
    save_to = save_watermark(tracker.saved_tokens, storable, geometry.hash_block_size)
    ranges = store_candidate_ranges(geometry, tracker.saved_tokens, save_to, table, boundary_groups)
    return tracker.with_saved_tokens(save_to), StoreWindow(ranges, table, tracker.cached_tokens)


def new_request_store_window(
    state: RequestLifecycle,
    geometry: LookupGeometry,
    boundary_groups: AbstractSet[int],
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    block_table: BlockTable,
    num_hashes: int,
) -> tuple[RequestLifecycle, StoreWindow]:
    """A request scheduled for the first time (or loading synchronously this step:
    the load lands before the forward pass, the store reads after it). What it has
    already (vLLM's prefix-cache hits and umbp's window) came from a cache."""
    tracker = (state.tracker or StoreTracker()).with_cached_tokens(num_computed_tokens)
    tracker, window = _advance(
        tracker, geometry, boundary_groups, block_table,
        num_computed_tokens + num_scheduled_tokens, num_hashes,
    )
    return state.with_tracker(tracker), window


def cached_request_stores(
    state: RequestLifecycle,
    num_computed_tokens: int,
    resumed: bool,
    num_prompt_tokens: int,
    save_decode_cache: bool,
) -> tuple[RequestLifecycle, bool]:
    """A request scheduled before: whether this step can store anything. Untracked:
    no. Resumed: it started over, so what it has again came from a cache (noted
    even when nothing is stored). Decoding without ``save_decode_cache``: no, and
    the block table is left as it was (so vLLM's tables are not even read)."""
    tracker = state.tracker
    if tracker is None:
        return state, False
    if resumed:
        state = state.with_tracker(tracker.with_cached_tokens(num_computed_tokens))
    return state, stores_this_step(num_computed_tokens, num_prompt_tokens, save_decode_cache)


def cached_request_store_window(
    state: RequestLifecycle,
    geometry: LookupGeometry,
    boundary_groups: AbstractSet[int],
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    resumed: bool,
    new_blocks: BlockTable | None,
    current_table: BlockTable | None,
    num_prompt_tokens: int,
    num_hashes: int,
    save_decode_cache: bool,
) -> tuple[RequestLifecycle, StoreWindow]:
    """For a request :func:`cached_request_stores` said stores: the step's table
    is the current one (:meth:`StoreTracker.with_step_blocks`), and the window runs
    up to :func:`store_token_limit`."""
    if state.tracker is None:
        raise ValueError("cached_request_store_window needs a tracked request")
    tracker = state.tracker.with_step_blocks(new_blocks, resumed, current_table)
    total = store_token_limit(
        num_computed_tokens + num_scheduled_tokens, num_prompt_tokens, save_decode_cache
    )
    tracker, window = _advance(
        tracker, geometry, boundary_groups, tracker.block_table, total, num_hashes
    )
    return state.with_tracker(tracker), window


def store_candidates(
    request_id: str,
    window: StoreWindow,
    masks: Mapping[int, Sequence[bool] | None],
    request_hashes: tuple[bytes, ...],
    token_ids: Sequence[int],
) -> Result[StoreCandidates, str]:
    """The window's blocks that vLLM's masks keep, as the store pass's input; a
    malformed mask is an error value (the request stores nothing this step)."""
    return apply_store_masks(window.ranges, masks).map(
        lambda selection: StoreCandidates(
            request_id, selection, window.block_table, request_hashes,
            window.cached_tokens, token_ids,
        )
    )


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


# ------------------------------------------------------------- acknowledgements


def acknowledge_reports(
    open_events: Mapping[int, tuple[StoreEvent, StoreEventResult]],
    reports: Mapping[int, StoreEventResult],
    num_workers: int,
) -> tuple[dict[int, tuple[StoreEvent, StoreEventResult]], tuple[tuple[StoreEvent, StoreEventResult], ...]]:
    """Workers' reports merged into the open events: (the events still open, the
    events every worker has now reported, in report order). Reports for unknown
    events (already acknowledged) are ignored."""
    still_open = dict(open_events)
    done: list[tuple[StoreEvent, StoreEventResult]] = []
    for event_id, reported in reports.items():
        entry = still_open.get(event_id)
        if entry is None:
            continue
        event, result = entry[0], merge_store_results(entry[1], reported)
        if event_acknowledged(result, num_workers):
            del still_open[event_id]
            done.append((event, result))
        else:
            still_open[event_id] = (event, result)
    return still_open, tuple(done)
