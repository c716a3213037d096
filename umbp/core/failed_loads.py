"""Failed loads in the scheduler role: which requests a step's synchronous loads
leave exposed, and what vLLM's report of a failed load rewinds.

vLLM's async scheduling plans the next step before a step's failures are known,
so the scheduler keeps a step's synchronous loads (:func:`sync_loads_of`, a
:class:`SyncLoads`), joins them to the next step's (:func:`loads_in_reach`) and
tells workers which stores depend on them (:func:`stores_over_sync_loads`); once
vLLM reports a failure, each request it concerns (:func:`hit_by_failed_load`)
gets its store watermark rewound to where vLLM recomputes from
(:func:`after_failed_load`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from umbp.core.load_plans import BlockLoadBatch
from umbp.core.lookup import BlockTable
from umbp.core.request_lifecycle import RequestLifecycle, StepLoads

__all__ = [
    "NO_SYNC_LOADS",
    "SyncLoads",
    "after_failed_load",
    "hit_by_failed_load",
    "loads_in_reach",
    "rewound_watermark",
    "stores_over_sync_loads",
    "sync_loads_of",
]


@dataclass(frozen=True, slots=True)
class SyncLoads:
    """Synchronous loads: the planned batches and, per request, the block ids of
    loads that could not be planned (reported failed by the worker)."""

    loads: tuple[BlockLoadBatch, ...]
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
    must not store what it computed (``umbp.core.load_outcomes.stores_past_failed_loads``).
    Block ids are compared across groups: synchronous loads exist only for one-group
    models (``effective_load_async``), and a false match only drops a store."""
    filled: dict[int, set[str]] = {}
    for request_id, block_ids in (
        *((b.request_id, b.block_ids) for b in sync.loads), *sync.unplanned.items()
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
