"""Hand-offs: single blocks stored under one identity outside the prompt's store
window: Mamba "align" states that vLLM hands off at committed boundaries
(:func:`boundary_state_plans`) and the pages of a finished request's fine-grained
last boundary (:func:`finished_partial_tail_plans`). Each becomes a
:class:`BlockTransferPlan`; a request's become one store plan
(:func:`transfer_store_plan`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from returns.result import Failure, Result, Success

from umbp.core.geometry import NULL_BLOCK_ID, BlockTable, CacheGeometry
from umbp.core.identity import ObjectId
from umbp.core.plans import GroupBlocks, StoredBlockFacts, StorePlan

__all__ = [
    "BlockTransferPlan",
    "DropReason",
    "DroppedOffloads",
    "boundary_state_plans",
    "finished_partial_tail_plans",
    "transfer_store_plan",
    "transfer_store_plans",
]


@dataclass(frozen=True, slots=True)
class BlockTransferPlan:
    """One block to store under one identity (boundary states, partial tails)."""

    request_id: str
    group_id: int
    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    block_size: int

    @property
    def identity(self) -> ObjectId:
        return (self.group_id, self.block_hash)


class DropReason(enum.Enum):
    FINISHED = "finished"
    PREEMPTED = "preempted"
    UNTRACKED = "untracked"


@dataclass(frozen=True, slots=True)
class DroppedOffloads:
    """A request's handed-off boundaries that were not stored, and why."""

    request_id: str
    entries: int
    reason: DropReason


def boundary_state_plans(
    offloads: Mapping[str, Sequence[tuple[int, int, int]]],
    finished: AbstractSet[str],
    preempted: AbstractSet[str],
    request_hashes: Mapping[str, Sequence[bytes]],
    prefix_groups: AbstractSet[int],
    hash_block_size: int,
    group_block_sizes: Mapping[int, int],
    events_enabled: bool,
) -> tuple[tuple[BlockTransferPlan, ...], tuple[DroppedOffloads, ...]]:
    """Plans for the boundary states vLLM handed off, as
    ``{request_id: [(group_id, block_id, boundary_tokens), ...]}``.

    Whole requests are dropped when finished, preempted or untracked (absent from
    ``request_hashes``). Entries are skipped for non-prefix groups, null blocks, and
    boundaries that are not positive, not hash aligned or past the hashes.
    """
    plans: list[BlockTransferPlan] = []
    dropped: list[DroppedOffloads] = []
    for request_id, entries in offloads.items():
        if request_id in finished:
            dropped.append(DroppedOffloads(request_id, len(entries), DropReason.FINISHED))
            continue
        if request_id in preempted:
            dropped.append(DroppedOffloads(request_id, len(entries), DropReason.PREEMPTED))
            continue
        hashes = request_hashes.get(request_id)
        if hashes is None:
            dropped.append(DroppedOffloads(request_id, len(entries), DropReason.UNTRACKED))
            continue
        seen: set[ObjectId] = set()
        for group_id, block_id, boundary_tokens in entries:
            if group_id not in prefix_groups or block_id == NULL_BLOCK_ID:
                continue
            if boundary_tokens <= 0 or boundary_tokens % hash_block_size:
                continue
            hash_index = boundary_tokens // hash_block_size - 1
            if hash_index >= len(hashes):
                continue
            block_hash = hashes[hash_index]
            if (group_id, block_hash) in seen:
                continue
            seen.add((group_id, block_hash))
            plans.append(
                BlockTransferPlan(
                    request_id=request_id,
                    group_id=group_id,
                    block_id=block_id,
                    block_hash=block_hash,
                    parent_hash=hashes[hash_index - 1]
                    if events_enabled and hash_index > 0
                    else None,
                    block_size=group_block_sizes[group_id],
                )
            )
    return tuple(plans), tuple(dropped)


def transfer_store_plan(
    request_id: str, plans: Sequence[BlockTransferPlan], events_enabled: bool
) -> StorePlan:
    """Transfer plans of one request as one store plan, grouped by cache group in
    first-seen order (whole pages; no token ids: a state page is not
    token-addressable)."""
    by_group: dict[int, list[BlockTransferPlan]] = {}
    for plan in plans:
        by_group.setdefault(plan.group_id, []).append(plan)
    groups = tuple(
        GroupBlocks(
            group_id, group[0].block_size, tuple(p.block_id for p in group),
            tuple(p.block_hash for p in group),
        )
        for group_id, group in by_group.items()
    )
    facts = tuple(
        StoredBlockFacts(tuple(p.parent_hash for p in group), tuple(() for _ in group))
        for group in by_group.values()
    ) if events_enabled else None
    return StorePlan(request_id, groups, facts)


def transfer_store_plans(
    plans: Sequence[BlockTransferPlan], events_enabled: bool
) -> tuple[StorePlan, ...]:
    """One store plan per request, in first-seen request order."""
    by_request: dict[str, list[BlockTransferPlan]] = {}
    for plan in plans:
        by_request.setdefault(plan.request_id, []).append(plan)
    return tuple(
        transfer_store_plan(request_id, group, events_enabled)
        for request_id, group in by_request.items()
    )


def finished_partial_tail_plans(
    request_id: str,
    geometry: CacheGeometry,
    entries: Sequence[tuple[int, int, int]],
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    num_computed_tokens: int,
    num_in_flight_tokens: int,
    full_attention_groups: AbstractSet[int],
    pool_size: int,
    null_block_ids: AbstractSet[int] = frozenset({NULL_BLOCK_ID}),
    events_enabled: bool = False,
) -> Result[tuple[BlockTransferPlan, ...], str]:
    """Plans for a finished request's fine-grained last boundary.

    vLLM hands off ``(group_id, block_id, boundary_tokens)`` state pages. Every
    entry must name one boundary, hash aligned, equal to the computed tokens with
    nothing in flight, in prefix-cacheable groups. Each full-attention group whose
    block the boundary splits adds its tail page, so every group can resolve the
    same boundary. No source may be null or outside the pool (``pool_size``
    blocks; ``null_block_ids`` are the pool's null blocks). A Mamba page is a state
    snapshot rather than token-addressable bytes, so whole pages are stored.
    An error value (the reason) means: store nothing.
    """
    if not entries:
        return Failure("no partial tail entries")
    boundaries = {boundary for _, _, boundary in entries}
    if len(boundaries) != 1:
        return Failure(f"partial tail entries span several boundaries: {sorted(boundaries)}")
    boundary = boundaries.pop()
    hash_block_size = geometry.hash_block_size
    if boundary <= 0 or boundary % hash_block_size:
        return Failure(f"boundary {boundary} is not a positive multiple of {hash_block_size}")
    if boundary != num_computed_tokens:
        return Failure(f"boundary {boundary} is not the computed tokens {num_computed_tokens}")
    if num_in_flight_tokens:
        return Failure(f"{num_in_flight_tokens} tokens are still in flight")
    hash_index = boundary // hash_block_size - 1
    if hash_index >= len(request_hashes):
        return Failure(f"boundary {boundary} is past the request's {len(request_hashes)} hashes")
    sources = {group_id: block_id for group_id, block_id, _ in entries}
    if not sources.keys() <= set(geometry.group_ids):
        return Failure(
            f"groups {sorted(sources.keys() - set(geometry.group_ids))} are not prefix-cacheable"
        )
    for group_id, block_size, table in zip(
        geometry.group_ids, geometry.group_block_sizes, block_table
    ):
        if group_id in full_attention_groups and boundary % block_size:
            index = boundary // block_size
            if index >= len(table):
                return Failure(f"group {group_id} has no tail block {index}")
            sources.setdefault(group_id, table[index])
    block_hash = request_hashes[hash_index]
    parent_hash = request_hashes[hash_index - 1] if events_enabled and hash_index > 0 else None
    plans: list[BlockTransferPlan] = []
    for group_id, block_id in sources.items():
        if block_id == NULL_BLOCK_ID or block_id in null_block_ids or not 0 <= block_id < pool_size:
            return Failure(f"group {group_id} source block {block_id} is null or outside the pool")
        plans.append(
            BlockTransferPlan(
                request_id=request_id,
                group_id=group_id,
                block_id=block_id,
                block_hash=block_hash,
                parent_hash=parent_hash,
                block_size=geometry.group_block_sizes[geometry.position(group_id)],
            )
        )
    return Success(tuple(plans))
