"""Failed loads and the stores that read over them.

A synchronous load lands before the step's forward pass; if it fails, every request
of that step reading its blocks computes over stale KV, and what it writes must not
be stored under the right hashes. In the scheduler role: a step's synchronous loads
are kept (:func:`sync_loads_of`), joined to the next step's (:func:`loads_in_reach`,
vLLM's async scheduling plans a step before the last one's failures are known), and
the storing requests that read their blocks are named for the workers
(:func:`stores_over_sync_loads`); once vLLM reports a failure, each request it
concerns (:func:`hit_by_failed_load`) gets its store watermark rewound to where vLLM
recomputes from (:func:`after_failed_load`). In the worker role: the requests whose
stores are left out this step (:func:`computed_over_failed_loads`,
:func:`still_computing_over_failures`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from umbp.core.geometry import BlockTable
from umbp.core.loads.outcomes import RequestLoadOutcome
from umbp.core.plans import LoadPlan, plan_block_ids

if TYPE_CHECKING:  # core.requests imports this package's plans
    from umbp.core.requests import RequestLifecycle, StepLoads

__all__ = [
    "NO_SYNC_LOADS",
    "SyncLoads",
    "after_failed_load",
    "computed_over_failed_loads",
    "hit_by_failed_load",
    "loads_in_reach",
    "rewound_watermark",
    "still_computing_over_failures",
    "stores_over_sync_loads",
    "sync_loads_of",
]


@dataclass(frozen=True, slots=True)
class SyncLoads:
    """Synchronous loads: the planned loads and, per request, the block ids of
    loads that could not be planned (reported failed by the worker)."""

    loads: tuple[LoadPlan, ...]
    unplanned: Mapping[str, tuple[int, ...]]


NO_SYNC_LOADS = SyncLoads((), {})


def sync_loads_of(step: StepLoads) -> SyncLoads:
    """The step's synchronous loads only (planned and unplanned), kept by the
    scheduler for one more step: vLLM's async scheduling plans the next step
    before this one's failures are known, and a request it admits may hit these
    blocks (:func:`loads_in_reach` then counts them too). An asynchronous load
    lands before its request is scheduled, so no store reads over it."""
    return SyncLoads(
        tuple(b for b in step.loads if b.request_id not in step.async_loads),
        {r: ids for r, ids in step.unplanned.items() if r not in step.async_loads},
    )


def loads_in_reach(previous: SyncLoads, current: SyncLoads) -> SyncLoads | None:
    """The synchronous loads a step's stores may read over: the step's own
    (``current``) and the last step's (``previous``), both :func:`sync_loads_of`
    their steps, as one; None when there are none, so no store depends on a load
    and the caller need not read the storing requests' block tables. A request
    unplanned in both steps keeps both steps' blocks."""
    if not (previous.loads or previous.unplanned or current.loads or current.unplanned):
        return None
    unplanned = dict(previous.unplanned)
    for request_id, block_ids in current.unplanned.items():
        unplanned[request_id] = (*unplanned.get(request_id, ()), *block_ids)
    return SyncLoads((*previous.loads, *current.loads), unplanned)


def stores_over_sync_loads(
    sync: SyncLoads, storing: Mapping[str, BlockTable]
) -> dict[str, frozenset[str]]:
    """For each request storing this step whose table holds a block a synchronous
    load (``sync``, :func:`loads_in_reach`) fills, the requests loading those
    blocks (itself included).

    A synchronous load lands before the step's forward pass, and vLLM lets other
    requests of the same step hit its blocks (they are cached at allocation): if
    the load fails, every such request computes over stale blocks, and the worker
    must not store what it computed (``umbp.core.stores.results.stores_past_failed_loads``).
    Block ids are compared across groups: synchronous loads exist only for one-group
    models (``effective_load_async``), and a false match only drops a store."""
    filled: dict[int, set[str]] = {}
    for request_id, block_ids in (
        *((plan.request_id, plan_block_ids(plan)) for plan in sync.loads), *sync.unplanned.items()
    ):
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



def computed_over_failed_loads(outcomes: Sequence[RequestLoadOutcome]) -> frozenset[str]:
    """The requests whose synchronous load failed this step. Their load lands before
    the forward pass, which then computes every new token of theirs attending to the
    failed blocks' stale contents: what that step writes is wrong KV under the
    right hashes. (An asynchronous load's request is not computed in its step.)"""
    return frozenset(o.request_id for o in outcomes if o.failed and not o.is_async)


def still_computing_over_failures(
    previous: AbstractSet[str],
    settled: AbstractSet[str],
    failed_sync_loads: AbstractSet[str],
    read_over: Mapping[str, AbstractSet[str]],
) -> frozenset[str]:
    """The requests whose stores the worker leaves out this step: those whose own
    synchronous load failed this step (:func:`computed_over_failed_loads`), those
    of earlier steps the scheduler has not yet ``settled``, and those that read
    blocks one of these loads filled (``read_over``, the scheduler's
    ``stores_over_sync_loads``, over this step's and the last step's loads). vLLM
    plans a step before the previous step's failure is known (async scheduling):
    such a step still computes over the stale blocks. Settled
    (the scheduler saw vLLM cut their computed tokens before planning this step, or
    they finished or were preempted): what they compute from now on is the
    recompute."""
    unsettled = (set(previous) - set(settled)) | failed_sync_loads
    followers = {r for r, loads in read_over.items() if not unsettled.isdisjoint(loads)}
    return frozenset(unsettled | followers)

