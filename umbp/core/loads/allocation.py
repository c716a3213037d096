"""Load plans: which device blocks to fill from the pool.

A load plan turns a :class:`~umbp.core.lookup.windows.LoadSpec` and what vLLM
allocated (its external token count, the block table) into a
:class:`~umbp.core.plans.LoadPlan`, or into the blocks vLLM must recompute
(:func:`plan_allocated_load`). Block ``i`` of a group with block size ``B`` holds
tokens ``[i*B, (i+1)*B)`` and is identified by the hash ending at ``(i+1)*B``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from returns.result import Failure, Result, Success

from umbp.core.geometry import NULL_BLOCK_ID, BlockTable, CacheGeometry, hashes_at_token_ends
from umbp.core.lookup.windows import LoadSpec
from umbp.core.plans import GroupBlocks, LoadPlan, plan_block_ids

__all__ = [
    "UnplannedLoad",
    "allocated_window",
    "load_plan",
    "plan_allocated_load",
    "window_block_ids",
]


def load_plan(
    request_id: str,
    geometry: CacheGeometry,
    spec: LoadSpec,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    num_external_tokens: int,
) -> Result[LoadPlan, str]:
    """The objects of a hit window and the allocated blocks they fill.

    With the coordinator's per-group hashes, every named block past the local
    blocks; otherwise every full block of the window plus, with partial hash hits,
    the block holding a window that ends inside it (read from the hash at the
    window's end). An error value when vLLM allocated a different count than the
    spec matched (the request would wait forever), or when a destination is
    missing, null or repeated.
    """
    if num_external_tokens != spec.num_tokens_to_load:
        return Failure(
            f"request {request_id}: matched {spec.num_tokens_to_load} external tokens "
            f"but {num_external_tokens} were allocated"
        )
    if len(block_table) != len(geometry.group_ids):
        return Failure(
            f"request {request_id}: block table has {len(block_table)} groups, "
            f"expected {len(geometry.group_ids)}"
        )
    groups = (
        _coordinated_loads(geometry, spec, block_table)
        if spec.block_hashes_by_group
        else _positional_loads(geometry, spec, block_table, request_hashes)
    )
    if isinstance(groups, str):
        return Failure(f"request {request_id}: {groups}")
    # One set answers both checks, across groups (vLLM's groups share one block
    # pool); it is most of a plan's cost.
    block_ids = plan_block_ids(LoadPlan(request_id, groups))  # every group's, in order
    destinations = set(block_ids)
    if NULL_BLOCK_ID in destinations:
        group_id = next(g.group_id for g in groups if NULL_BLOCK_ID in g.block_ids)
        return Failure(
            f"request {request_id}: a pool object maps to a null destination block "
            f"in group {group_id}"
        )
    if len(destinations) != len(block_ids):
        return Failure(f"request {request_id}: a destination block is written twice")
    ends_mid_block = not spec.block_hashes_by_group and any(
        spec.external_tokens % size for size in geometry.group_block_sizes
    )
    return Success(LoadPlan(request_id, groups, ends_mid_block))


@dataclass(frozen=True, slots=True)
class UnplannedLoad:
    """A load that cannot be served: why, and the blocks vLLM must recompute
    (reported to it as failed loads)."""

    reason: str
    block_ids: tuple[int, ...]


def allocated_window(
    geometry: CacheGeometry, spec: LoadSpec | None, num_external_tokens: int
) -> Result[LoadSpec, str]:
    """The window to load for what vLLM allocated.

    vLLM may allocate fewer external tokens than umbp matched (its bounded-replay
    path trims them to a block boundary): the window's first
    ``num_external_tokens`` are loaded, its full blocks being objects the lookup
    found. An error value for a count above the match or without a match; for a
    lowered window ending inside a block (its partial-tail object was never looked
    up); and for a lowered coordinated (multi-group) hit (a state group's object
    exists only at the matched end).
    """
    if spec is None:
        return Failure(f"umbp matched nothing but vLLM allocated {num_external_tokens} tokens")
    matched = spec.num_tokens_to_load
    if num_external_tokens == matched:
        return Success(spec)
    if num_external_tokens > matched:
        return Failure(f"umbp matched {matched} tokens but vLLM allocated {num_external_tokens}")
    if spec.block_hashes_by_group:
        return Failure(
            f"vLLM lowered a multi-group hit from {matched} to {num_external_tokens} tokens"
        )
    end = spec.local_tokens + num_external_tokens
    if end % geometry.block_size:
        return Failure(f"vLLM lowered the window to end inside a block (token {end})")
    return Success(LoadSpec(spec.local_tokens, end))


def plan_allocated_load(
    request_id: str,
    geometry: CacheGeometry,
    spec: LoadSpec | None,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    num_external_tokens: int,
) -> Result[LoadPlan, UnplannedLoad]:
    """The load for the external tokens vLLM allocated (:func:`allocated_window`,
    then :func:`load_plan`), or the blocks to recompute: the allocated window's,
    or, without a match to place it, every block of the table."""
    window = allocated_window(geometry, spec, num_external_tokens).alt(
        lambda reason: f"request {request_id}: {reason}"
    ).bind(
        lambda allocated: load_plan(
            request_id, geometry, allocated, block_table, request_hashes, num_external_tokens
        )
    )
    if isinstance(window, Success):
        return window
    if spec is None:
        start, end = 0, max(
            (len(table) * size for size, table in zip(geometry.group_block_sizes, block_table)),
            default=0,
        )
    else:
        start, end = spec.local_tokens, spec.local_tokens + num_external_tokens
    return Failure(
        UnplannedLoad(
            window.failure(),
            window_block_ids(geometry, start, end, block_table),
        )
    )


def window_block_ids(
    geometry: CacheGeometry, local_tokens: int, end_tokens: int, block_table: BlockTable
) -> tuple[int, ...]:
    """The non-null blocks holding tokens ``[local_tokens, end_tokens)`` in any group:
    what vLLM must recompute when a load cannot even be planned."""
    blocks: dict[int, None] = {}
    for block_size, table in zip(geometry.group_block_sizes, block_table):
        first, last = local_tokens // block_size, -(-end_tokens // block_size)
        blocks.update(dict.fromkeys(b for b in table[first:last] if b != NULL_BLOCK_ID))
    return tuple(blocks)


def _coordinated_loads(
    geometry: CacheGeometry, spec: LoadSpec, block_table: BlockTable
) -> tuple[GroupBlocks, ...] | str:
    """Every block the coordinator named past the local blocks, per group."""
    if len(spec.block_hashes_by_group) != len(geometry.group_ids):
        return (
            f"load spec names {len(spec.block_hashes_by_group)} groups, "
            f"expected {len(geometry.group_ids)}"
        )
    groups: list[GroupBlocks] = []
    for group_id, block_size, table, group_hashes in zip(
        geometry.group_ids, geometry.group_block_sizes, block_table, spec.block_hashes_by_group
    ):
        block_ids: list[int] = []
        block_hashes: list[bytes] = []
        for index in range(spec.local_tokens // block_size, len(group_hashes)):
            block_hash = group_hashes[index]
            if block_hash is None:
                continue
            if index >= len(table):
                return f"group {group_id} has no destination block {index}"
            block_ids.append(table[index])
            block_hashes.append(block_hash)
        if block_ids:
            groups.append(GroupBlocks(group_id, block_size, tuple(block_ids), tuple(block_hashes)))
    return tuple(groups)


def _positional_loads(
    geometry: CacheGeometry,
    spec: LoadSpec,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
) -> tuple[GroupBlocks, ...] | str:
    """Each group's window as slices of its table and of the hashes: no per-block
    Python work."""
    hash_block_size = geometry.hash_block_size
    covered = len(request_hashes) * hash_block_size
    end = spec.external_tokens
    if end > covered:
        return f"the window ends at token {end} but hashes cover {covered}"
    groups: list[GroupBlocks] = []
    for group_id, block_size, table in zip(
        geometry.group_ids, geometry.group_block_sizes, block_table
    ):
        first = spec.local_tokens // block_size
        full = end // block_size
        block_ids: tuple[int, ...] = ()
        block_hashes: tuple[bytes, ...] = ()
        if full > first:
            if full > len(table):
                return f"group {group_id} has {len(table)} blocks, the window needs {full}"
            block_ids = tuple(table[first:full])
            block_hashes = hashes_at_token_ends(
                request_hashes, (first + 1) * block_size, full * block_size, block_size,
                hash_block_size,
            )
        if end % block_size:
            # The window ends inside this group's block: only a saved partial tail,
            # identified by the hash at the window's end, can fill it.
            if not geometry.partial_hash_hits:
                return f"the window ends inside a block of group {group_id} without partial hits"
            if end % hash_block_size:
                return f"the window end {end} is not hash aligned"
            if full >= len(table):
                return f"partial hit in group {group_id} has no destination block"
            block_ids += (table[full],)
            block_hashes += (request_hashes[end // hash_block_size - 1],)
        if block_ids:
            groups.append(GroupBlocks(group_id, block_size, block_ids, block_hashes))
    return tuple(groups)
