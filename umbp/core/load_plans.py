"""Load plans: which device blocks to fill from the pool.

A load plan turns a :class:`~umbp.core.lookup.LoadSpec` and what vLLM allocated
(its external token count, the block table) into destination blocks, or into the
blocks vLLM must recompute (:func:`plan_allocated_load`). Plans carry object
identities ``(group_id, block_hash)``, never key strings: each worker builds its
own rank's key. Block ``i`` of a group with block size ``B`` holds tokens
``[i*B, (i+1)*B)`` and is identified by the hash ending at ``(i+1)*B``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TypeAlias

from returns.result import Failure, Result, Success

from umbp.core.lookup import (
    NULL_BLOCK_ID,
    BlockTable,
    LoadSpec,
    LookupGeometry,
    hashes_at_token_ends,
)

__all__ = [
    "BlockLoadBatch",
    "UnplannedLoad",
    "allocated_window",
    "load_batch",
    "plan_allocated_load",
    "window_block_ids",
]


@dataclass(frozen=True, slots=True)
class BlockLoadBatch:
    """Objects to read from the pool into one request's blocks; columns align."""

    request_id: str
    group_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]

    def __len__(self) -> int:
        return len(self.block_ids)


def load_batch(
    request_id: str,
    geometry: LookupGeometry,
    spec: LoadSpec,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    num_external_tokens: int,
) -> Result[BlockLoadBatch, str]:
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
    planned = (
        _coordinated_loads(geometry, spec, block_table)
        if spec.block_hashes_by_group
        else _positional_loads(geometry, spec, block_table, request_hashes)
    )
    if isinstance(planned, str):
        return Failure(f"request {request_id}: {planned}")
    group_ids, block_ids, block_hashes = planned
    # One set answers both checks; it is most of a plan's cost (no per-block
    # Python work is left beside it).
    destinations = set(block_ids)
    if NULL_BLOCK_ID in destinations:
        group_id = group_ids[block_ids.index(NULL_BLOCK_ID)]
        return Failure(
            f"request {request_id}: a pool object maps to a null destination block "
            f"in group {group_id}"
        )
    if len(destinations) != len(block_ids):
        return Failure(f"request {request_id}: a destination block is written twice")
    return Success(BlockLoadBatch(request_id, group_ids, block_ids, block_hashes))


@dataclass(frozen=True, slots=True)
class UnplannedLoad:
    """A load that cannot be served: why, and the blocks vLLM must recompute
    (reported to it as failed loads)."""

    reason: str
    block_ids: tuple[int, ...]


def allocated_window(
    geometry: LookupGeometry, spec: LoadSpec | None, num_external_tokens: int
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
    geometry: LookupGeometry,
    spec: LoadSpec | None,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    num_external_tokens: int,
) -> Result[BlockLoadBatch, UnplannedLoad]:
    """The load for the external tokens vLLM allocated (:func:`allocated_window`,
    then :func:`load_batch`), or the blocks to recompute: the allocated window's,
    or, without a match to place it, every block of the table."""
    window = allocated_window(geometry, spec, num_external_tokens).alt(
        lambda reason: f"request {request_id}: {reason}"
    ).bind(
        lambda allocated: load_batch(
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
    geometry: LookupGeometry, local_tokens: int, end_tokens: int, block_table: BlockTable
) -> tuple[int, ...]:
    """The non-null blocks holding tokens ``[local_tokens, end_tokens)`` in any group:
    what vLLM must recompute when a load cannot even be planned."""
    blocks: dict[int, None] = {}
    for block_size, table in zip(geometry.group_block_sizes, block_table):
        first, last = local_tokens // block_size, -(-end_tokens // block_size)
        blocks.update(dict.fromkeys(b for b in table[first:last] if b != NULL_BLOCK_ID))
    return tuple(blocks)


_Columns: TypeAlias = tuple[tuple[int, ...], tuple[int, ...], tuple[bytes, ...]]
"""A plan's group ids, block ids and block hashes, aligned."""


def _coordinated_loads(
    geometry: LookupGeometry, spec: LoadSpec, block_table: BlockTable
) -> _Columns | str:
    if len(spec.block_hashes_by_group) != len(geometry.group_ids):
        return (
            f"load spec names {len(spec.block_hashes_by_group)} groups, "
            f"expected {len(geometry.group_ids)}"
        )
    group_ids: list[int] = []
    block_ids: list[int] = []
    block_hashes: list[bytes] = []
    for group_id, block_size, table, group_hashes in zip(
        geometry.group_ids, geometry.group_block_sizes, block_table, spec.block_hashes_by_group
    ):
        for index in range(spec.local_tokens // block_size, len(group_hashes)):
            block_hash = group_hashes[index]
            if block_hash is None:
                continue
            if index >= len(table):
                return f"group {group_id} has no destination block {index}"
            group_ids.append(group_id)
            block_ids.append(table[index])
            block_hashes.append(block_hash)
    return tuple(group_ids), tuple(block_ids), tuple(block_hashes)


def _positional_loads(
    geometry: LookupGeometry,
    spec: LoadSpec,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
) -> _Columns | str:
    """Each group's window as slices of its table and of the hashes, and one shared
    constant column: no per-block Python work."""
    hash_block_size = geometry.hash_block_size
    covered = len(request_hashes) * hash_block_size
    end = spec.external_tokens
    if end > covered:
        return f"the window ends at token {end} but hashes cover {covered}"
    parts: list[_Columns] = []
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
        parts.append(((group_id,) * len(block_ids), block_ids, block_hashes))
    if len(parts) == 1:
        return parts[0]
    return (
        tuple(chain.from_iterable(part[0] for part in parts)),
        tuple(chain.from_iterable(part[1] for part in parts)),
        tuple(chain.from_iterable(part[2] for part in parts)),
    )
