"""A scheduler step's stores, in two calls around the step's one residency lookup:
:func:`plan_store_step` (every scheduled request's new full blocks, through vLLM's
reachability masks, and the residency check of the blocks that came from a cache),
then, with the pool's answer, :func:`finish_store_step` (the store plans without
what the pool holds, and the boundary states vLLM handed off).

What core reads of vLLM's step arrives as a :class:`ScheduledStep` (the step's
request ids and token counts, as vLLM's output holds them) and through
:class:`StoreStepReads`, the shell's side-effect-free reads of vLLM's objects that
only some requests need: a request's current block table and its masks are read
only for a request that stores this step. Requests that cannot store (decoding
past their prompt without ``save_decode_cache``) are not visited at all: the
caller keeps the ids that may store (``storing``) and applies the changes
:class:`StoreDraft` reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from returns.result import Success

from umbp.core.geometry import CacheGeometry, block_table_of
from umbp.core.identity import KeySpace, ObjectId
from umbp.core.plans import StorePlan
from umbp.core.stores.handoffs import DroppedOffloads, boundary_state_plans, transfer_store_plans
from umbp.core.stores.request_store import store_plan, whole_run_plan
from umbp.core.stores.residency import (
    NO_RESIDENCY_CHECK,
    ResidencyCheck,
    residency_check,
    resident_blocks_from_hits,
)
from umbp.core.stores.tracking import stores_this_step
from umbp.core.stores.windows import (
    StoreCandidates,
    StoreWindow,
    cached_request_store_window,
    cached_request_stores,
    new_request_store_window,
    store_candidates,
)

if TYPE_CHECKING:  # core.requests imports this package's tracker
    from umbp.core.requests import RequestLifecycle, RequestView

__all__ = [
    "ScheduledStep",
    "StoreDraft",
    "StorePass",
    "StoreRules",
    "StoreStepReads",
    "finish_store_step",
    "plan_store_step",
    "plan_stores",
]


@dataclass(frozen=True, slots=True)
class StoreRules:
    """An engine's fixed store facts.

    ``boundary_groups``: Mamba "align" groups, stored only from the boundary states
    vLLM hands off (their tables are not append-only). ``masked_groups``: groups
    whose blocks vLLM may drop (sliding windows, Mamba), the only ones whose masks
    are read; every other group keeps every block."""

    geometry: CacheGeometry
    boundary_groups: frozenset[int] = frozenset()
    masked_groups: frozenset[int] = frozenset()
    save_decode_cache: bool = False
    events_enabled: bool = False


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """What vLLM scheduled this step, as the store step reads it.

    ``new_requests``: per request scheduled for the first time, its id, computed
    tokens and vLLM's block lists (indexed by group id). ``cached_request_ids``
    and ``cached_computed_tokens`` align (requests scheduled before); ``resumed``
    are those that restarted after a preemption. ``boundary_offloads``: the Mamba
    "align" states vLLM handed off, ``{request id: [(group, block, boundary)]}``."""

    new_requests: Sequence[tuple[str, int, Sequence[Sequence[int]]]]
    cached_request_ids: Sequence[str]
    cached_computed_tokens: Sequence[int]
    resumed: AbstractSet[str]
    scheduled_tokens: Mapping[str, int]
    finished: AbstractSet[str] = frozenset()
    preempted: AbstractSet[str] = frozenset()
    boundary_offloads: Mapping[str, Sequence[tuple[int, int, int]]] = field(
        default_factory=dict
    )


class StoreStepReads(Protocol):
    """What the store step reads of vLLM's objects, on demand. Reads only: calling
    one changes nothing, and the answers hold for the step being planned."""

    def state(self, request_id: str) -> tuple[RequestView | None, RequestLifecycle]:
        """The request vLLM allocated (None before its allocation) and its state."""
        ...

    def current_table(self, request_id: str) -> Sequence[Sequence[int]] | None:
        """vLLM's whole current block lists of a scheduled request (indexed by group
        id); None when vLLM sent none."""
        ...

    def masks(
        self, request: RequestView, ranges: Sequence[tuple[int, range]]
    ) -> Mapping[int, Sequence[bool] | None]:
        """vLLM's reachability mask of each group's candidate blocks (one entry per
        block; None keeps all). Asked only for the ``masked_groups``."""
        ...


@dataclass(frozen=True, slots=True)
class StoreDraft:
    """A step's stores before the residency answer, and the requests' new states.

    ``lives``: the requests whose state changed (their trackers). ``stopped`` and
    ``started`` (disjoint): ids to drop from and add to the caller's ``storing``
    set.
    ``unreadable``: requests that store nothing this step, and why (a malformed mask,
    no current table from vLLM), for the caller to log."""

    candidates: tuple[StoreCandidates, ...]
    check: ResidencyCheck
    reserved: AbstractSet[ObjectId]
    lives: Mapping[str, RequestLifecycle]
    stopped: frozenset[str]
    started: frozenset[str]
    handoffs: tuple[StorePlan, ...]
    dropped_handoffs: tuple[DroppedOffloads, ...]
    unreadable: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class StorePass:
    """The step's store plans (non-empty, request order) and how many distinct
    objects were left out because every rank already holds them."""

    plans: tuple[StorePlan, ...]
    skipped_resident: int




def plan_stores(
    geometry: CacheGeometry,
    candidates: Sequence[StoreCandidates],
    check: ResidencyCheck,
    answers: Sequence[bool] | None,
    reserved: AbstractSet[ObjectId] = frozenset(),
    *,
    events_enabled: bool = False,
) -> StorePass:
    """The step's store plans given the answers to ``check`` (built from the
    same candidates and reservations; None when the lookup failed).

    An identity is planned once, by the first request that selects it, unless it
    is reserved or every rank holds it; null blocks and blocks past the hashes are
    never planned (see :func:`umbp.core.stores.request_store.store_plan`).
    """
    resident = resident_blocks_from_hits(check, answers)
    planned: dict[int, set[bytes]] = {}
    plans: list[StorePlan] = []
    # With nothing to leave out but repeats, a one-group request's whole run takes
    # the short path (the usual step: new requests, nothing in flight).
    whole_runs = not (resident or reserved or events_enabled)
    for candidate in candidates:
        plan = whole_run_plan(
            candidate.request_id, geometry, candidate.selected, candidate.block_table,
            candidate.block_hashes, planned,
        ) if whole_runs else None
        if plan is None:
            plan = store_plan(
                candidate.request_id, geometry, candidate.selected, candidate.block_table,
                candidate.block_hashes, planned=planned, resident=resident, reserved=reserved,
                events_enabled=events_enabled, token_ids=candidate.token_ids,
            )
        if plan.groups:
            plans.append(plan)
    return StorePass(tuple(plans), len(resident))


def plan_store_step(
    rules: StoreRules,
    step: ScheduledStep,
    storing: AbstractSet[str],
    reserved: AbstractSet[ObjectId],
    keyspace: KeySpace | None,
    reads: StoreStepReads,
) -> StoreDraft:
    """Everything of the step's stores that comes before the residency lookup.

    New requests are always visited; a request scheduled before only when it is in
    ``storing`` (or resumed). Each request's window is the blocks full since its
    watermark (:mod:`umbp.core.stores.windows`) that vLLM's masks keep; the
    residency check covers every candidate block that came from a cache, except
    identities an in-flight store (``reserved``) writes. The hand-offs are the
    boundary states of tracked requests, planned here (no residency check: a state
    page is new by construction)."""
    geometry = rules.geometry
    lives: dict[str, RequestLifecycle] = {}
    started: set[str] = set()
    stopped: set[str] = set()
    candidates: list[StoreCandidates] = []
    unreadable: list[tuple[str, str]] = []
    for request_id, computed, block_ids in step.new_requests:
        request, life = reads.state(request_id)
        if request is None:  # never allocated: nothing of it to store
            continue
        scheduled = step.scheduled_tokens[request_id]
        life, window = new_request_store_window(
            life, geometry, rules.boundary_groups, computed, scheduled,
            block_table_of(block_ids, geometry.group_ids), len(request.block_hashes),
        )
        lives[request_id] = life
        _add_candidates(rules, reads, request_id, request, window, candidates, unreadable)
        _still_storing(rules, request, computed + scheduled, request_id, started, stopped)
    for request_id, computed in _cached_to_visit(step, storing):
        request, life = reads.state(request_id)
        if request is None:
            continue
        resumed = request_id in step.resumed
        life, stores = cached_request_stores(
            life, computed, resumed, request.num_prompt_tokens, rules.save_decode_cache
        )
        lives[request_id] = life
        if not stores:
            stopped.add(request_id)
            continue
        scheduled = step.scheduled_tokens[request_id]
        _still_storing(rules, request, computed + scheduled, request_id, started, stopped)
        current = reads.current_table(request_id)
        if current is None:
            unreadable.append((request_id, _NO_CURRENT_TABLE))
            continue
        life, window = cached_request_store_window(
            life, geometry, rules.boundary_groups, computed, scheduled,
            block_table_of(current, geometry.group_ids), request.num_prompt_tokens,
            len(request.block_hashes), rules.save_decode_cache,
        )
        lives[request_id] = life
        _add_candidates(rules, reads, request_id, request, window, candidates, unreadable)
    check = (
        NO_RESIDENCY_CHECK if keyspace is None or not candidates
        else residency_check(geometry, keyspace, candidates, reserved)
    )
    handoffs, dropped = _handoffs(rules, step, reads, lives)
    return StoreDraft(
        tuple(candidates), check, reserved, lives, frozenset(stopped), frozenset(started),
        handoffs, dropped, tuple(unreadable),
    )


def finish_store_step(
    rules: StoreRules, draft: StoreDraft, answers: Sequence[bool] | None
) -> StorePass:
    """The step's store plans, given the pool's answers to ``draft.check`` (None
    when it was not asked or could not answer: nothing is known resident, so
    everything is stored), then the hand-offs."""
    planned = plan_stores(
        rules.geometry, draft.candidates, draft.check, answers, draft.reserved,
        events_enabled=rules.events_enabled,
    )
    if not draft.handoffs:
        return planned
    return StorePass(planned.plans + draft.handoffs, planned.skipped_resident)


_NO_CURRENT_TABLE = "vLLM sent no current block table (kv_connector_block_state)"


def _still_storing(
    rules: StoreRules, request: RequestView, next_computed: int, request_id: str,
    started: set[str], stopped: set[str],
) -> None:
    """Whether the request's next step can store anything (it stays in the
    caller's ``storing`` set) or not (it leaves it until it is resumed or rewound)."""
    keeps = stores_this_step(next_computed, request.num_prompt_tokens, rules.save_decode_cache)
    (started if keeps else stopped).add(request_id)


def _cached_to_visit(
    step: ScheduledStep, storing: AbstractSet[str]
) -> list[tuple[str, int]]:
    """(request id, computed tokens) of the requests scheduled before that may
    store: in ``storing`` or resumed, in vLLM's order."""
    ids, computed = step.cached_request_ids, step.cached_computed_tokens
    wanted = storing | step.resumed if step.resumed else storing
    if not wanted:
        return []
    if len(wanted) * 8 < len(ids):  # a few among many: find their positions in C
        positions = dict(zip(ids, range(len(ids))))
        found = sorted(p for r in wanted if (p := positions.get(r)) is not None)
        return [(ids[p], computed[p]) for p in found]
    return [(r, c) for r, c in zip(ids, computed) if r in wanted]


def _add_candidates(
    rules: StoreRules,
    reads: StoreStepReads,
    request_id: str,
    request: RequestView,
    window: StoreWindow,
    candidates: list[StoreCandidates],
    unreadable: list[tuple[str, str]],
) -> None:
    """The window's blocks vLLM's masks keep, as the request's candidates (or the
    reason it stores nothing this step)."""
    if not any(indices for _, indices in window.ranges):
        return
    hashes = tuple(request.block_hashes)
    token_ids = request.all_token_ids if rules.events_enabled else ()
    masked = [(g, r) for g, r in window.ranges if g in rules.masked_groups] \
        if rules.masked_groups else []
    if not masked:
        # No mask keeps the window whole (store_candidates' rule without its Result
        # values; a property holds the two equal).
        candidates.append(StoreCandidates(
            request_id, window.ranges, window.block_table, hashes, window.cached_tokens,
            token_ids,
        ))
        return
    selected = store_candidates(
        request_id, window, reads.masks(request, masked), hashes, token_ids
    )
    if isinstance(selected, Success):
        candidates.append(selected.unwrap())
    else:
        unreadable.append((request_id, f"a malformed store mask ({selected.failure()})"))


def _handoffs(
    rules: StoreRules, step: ScheduledStep, reads: StoreStepReads,
    lives: Mapping[str, RequestLifecycle],
) -> tuple[tuple[StorePlan, ...], tuple[DroppedOffloads, ...]]:
    """The boundary states vLLM handed off, as store plans, for requests tracked
    once this step's windows are taken (``lives``: the states they changed)."""
    if not step.boundary_offloads:
        return (), ()
    tracked: dict[str, tuple[bytes, ...]] = {}
    for request_id in step.boundary_offloads:
        request, life = reads.state(request_id)
        life = lives.get(request_id, life)
        if request is not None and life.tracker is not None:
            tracked[request_id] = tuple(request.block_hashes)
    geometry = rules.geometry
    plans, dropped = boundary_state_plans(
        step.boundary_offloads, step.finished, step.preempted, tracked,
        frozenset(geometry.group_ids), geometry.hash_block_size,
        dict(zip(geometry.group_ids, geometry.group_block_sizes)), rules.events_enabled,
    )
    return transfer_store_plans(plans, rules.events_enabled), dropped
