"""One request's store plan: the selected blocks that still need storing, per
cache group (:func:`store_plan`), after vLLM's reachability masks chose which of
the candidate blocks are worth storing (:func:`apply_store_masks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import compress, repeat
from typing import TypeAlias

from returns.result import Failure, Result, Success

from umbp.core.geometry import NULL_BLOCK_ID, BlockTable, CacheGeometry
from umbp.core.identity import ObjectId
from umbp.core.plans import GroupBlocks, StoredBlockFacts, StorePlan
from umbp.core.stores.reservations import Reservations

__all__ = [
    "StoreSelection",
    "apply_store_masks",
    "store_plan",
    "whole_run_plan",
]

StoreSelection: TypeAlias = tuple[tuple[int, Sequence[int]], ...]
"""Per group id, the block indices chosen for storing (a ``range`` when the
group's candidates are kept whole)."""


def apply_store_masks(
    ranges: Sequence[tuple[int, range]],
    masks: Mapping[int, Sequence[bool] | None],
) -> Result[StoreSelection, str]:
    """Keep the blocks vLLM's cache semantics can later reuse (its reachability
    masks, one entry per candidate; None or absent keeps all). A mask of the wrong
    length is an error value. A group whose mask keeps every block keeps its
    ``range``: :func:`store_plan` plans a contiguous run without a per-block loop.

    Masked-out blocks are never retried: the save watermark passes every candidate
    before the masks apply, so a block masked out once (or a step whose mask was
    malformed) is not a candidate again for that request.
    """
    selected: list[tuple[int, Sequence[int]]] = []
    dropped = False
    for group_id, indices in ranges:
        mask = masks.get(group_id)
        if mask is None:
            selected.append((group_id, indices))
            continue
        if len(mask) != len(indices):
            return Failure(
                f"store mask for group {group_id} has {len(mask)} entries for {len(indices)} blocks"
            )
        if all(mask):
            selected.append((group_id, indices))
        else:
            dropped = True
            selected.append((group_id, tuple(compress(indices, mask))))
    if not dropped and isinstance(ranges, tuple):
        return Success(ranges)  # every candidate kept: the ranges themselves
    return Success(tuple(selected))


def _holds_none(excluded: AbstractSet[ObjectId], group_id: int, hashes: Sequence[bytes]) -> bool:
    """No ``(group_id, hash)`` of ``hashes`` is in ``excluded``, checked in C:
    against each event's hashes for :class:`Reservations`, else through a zip
    (which reuses its pair, so nothing per block stays)."""
    if isinstance(excluded, Reservations):
        return excluded.holds_none(group_id, hashes)
    return excluded.isdisjoint(zip(repeat(group_id), hashes))


# One group's kept blocks: their indices, block ids and hashes. A contiguous run
# keeps its indices as a range and its ids and hashes as tuple slices, so no
# per-block object is built.
_Kept: TypeAlias = tuple[Sequence[int], tuple[int, ...], tuple[bytes, ...]]


def store_plan(
    request_id: str,
    geometry: CacheGeometry,
    selected: StoreSelection,
    block_table: BlockTable,
    request_hashes: tuple[bytes, ...],
    *,
    planned: dict[int, set[bytes]],
    resident: AbstractSet[ObjectId] = frozenset(),
    reserved: AbstractSet[ObjectId] = frozenset(),
    events_enabled: bool = False,
    token_ids: Sequence[int] = (),
) -> StorePlan:
    """The selected blocks that still need storing.

    Skips null blocks, blocks past the hash coverage, restored blocks still resident
    (``resident``), identities an in-flight store event already writes
    (``reserved``), hashes the store pass has already planned (``planned``, per
    group id) and repeats of one identity. The plan's hashes are added to
    ``planned``: that record is this function's only effect, and it belongs to
    the caller's pass (one dict per pass, :func:`umbp.core.stores.step.plan_stores`;
    ``{}`` for one request alone). With ``events_enabled`` every group carries its
    blocks' KV-event facts (parents, token ids).

    A group's contiguous run with nothing null, repeated, resident, reserved or
    planned is taken as slices (:func:`_contiguous_group_stores`); any other group
    is scanned block by block (:func:`_scanned_group_stores`). Both give the same
    plan: the scan is the rule, the slices its fast case.
    """
    hash_block_size = geometry.hash_block_size
    covered = len(request_hashes) * hash_block_size
    groups: list[GroupBlocks] = []
    facts: list[StoredBlockFacts] = []
    for group_id, indices in selected:
        position = geometry.position(group_id)
        block_size = geometry.group_block_sizes[position]
        table = block_table[position]
        limit = min(covered // block_size, len(table))
        per_block = block_size // hash_block_size
        group_planned = _planned_of(planned, group_id)
        kept = _contiguous_group_stores(
            group_id, indices, table, request_hashes, limit, per_block,
            resident, reserved, group_planned,
        ) or _scanned_group_stores(
            group_id, indices, table, request_hashes, limit, per_block,
            resident, reserved, group_planned,
        )
        kept_indices, block_ids, block_hashes = kept
        if not block_ids:
            continue
        groups.append(GroupBlocks(group_id, block_size, block_ids, block_hashes))
        if events_enabled:
            facts.append(_stored_facts(kept_indices, block_size, hash_block_size,
                                       request_hashes, token_ids))
    return StorePlan(request_id, tuple(groups), tuple(facts) if events_enabled else None)


def whole_run_plan(
    request_id: str,
    geometry: CacheGeometry,
    selected: StoreSelection,
    block_table: BlockTable,
    request_hashes: tuple[bytes, ...],
    planned: dict[int, set[bytes]],
) -> StorePlan | None:
    """:func:`store_plan`'s plan for the usual request of a store pass with
    nothing resident, reserved or evented (the caller knows that; store_plan is
    asked with ``resident``, ``reserved`` and ``events_enabled`` left out): one
    group, whose selection is one contiguous run that stores whole. None, with
    ``planned`` unchanged, in any other case: store_plan decides then.

    The same rule (:func:`_contiguous_group_stores`) without store_plan's
    per-group loop: every request of a step comes here (a property holds the two
    equal)."""
    group_id = geometry.group_ids[0]
    if len(selected) != 1 or len(geometry.group_ids) != 1 or selected[0][0] != group_id:
        return None
    block_size = geometry.group_block_sizes[0]
    table = block_table[0]
    kept = _contiguous_group_stores(
        group_id, selected[0][1], table, request_hashes,
        min(len(request_hashes) * geometry.hash_block_size // block_size, len(table)),
        block_size // geometry.hash_block_size, frozenset(), frozenset(),
        _planned_of(planned, group_id),
    )
    if kept is None:
        return None
    if not kept[1]:
        return StorePlan(request_id, ())
    return StorePlan(request_id, (GroupBlocks(group_id, block_size, kept[1], kept[2]),))


def _planned_of(planned: dict[int, set[bytes]], group_id: int) -> set[bytes]:
    """The pass's record of one group's planned hashes, made on first use."""
    group_planned = planned.get(group_id)
    if group_planned is None:  # no set built per call, as setdefault would
        group_planned = planned[group_id] = set()
    return group_planned


def _contiguous_group_stores(
    group_id: int,
    indices: Sequence[int],
    table: tuple[int, ...],
    request_hashes: tuple[bytes, ...],
    limit: int,
    per_block: int,
    resident: AbstractSet[ObjectId],
    reserved: AbstractSet[ObjectId],
    planned: set[bytes],
) -> _Kept | None:
    """A run of consecutive indices whose blocks all store: their indices, ids
    and hashes as slices (the hashes added to ``planned``); None, with
    ``planned`` unchanged, when the run is not consecutive or any block would be
    skipped (the scan decides then)."""
    start = _run_start(indices)
    if start is None:
        return None
    stop = min(start + len(indices), limit)
    if stop <= start:
        return range(0), (), ()
    block_ids = table[start:stop]
    if NULL_BLOCK_ID in block_ids:
        return None
    hashes = request_hashes[start * per_block + per_block - 1 : stop * per_block : per_block]
    for excluded in (resident, reserved):
        if excluded and not _holds_none(excluded, group_id, hashes):
            return None
    if planned and not planned.isdisjoint(hashes):
        return None
    before = len(planned)
    planned.update(hashes)
    if len(planned) - before != len(hashes):  # a hash repeats within the run
        planned.difference_update(hashes)  # none was there before: undo them all
        return None
    return range(start, stop), block_ids, hashes


def _run_start(indices: Sequence[int]) -> int | None:
    """The first index when ``indices`` are consecutive ascending and not
    negative (an empty run starts anywhere), else None."""
    if isinstance(indices, range):
        return indices.start if indices.step == 1 and indices.start >= 0 else None
    count = len(indices)
    if not count:
        return 0
    first = indices[0]
    if first < 0 or indices[-1] != first + count - 1:
        return None
    if count > 2 and tuple(indices) != tuple(range(first, first + count)):
        return None
    return first


def _scanned_group_stores(
    group_id: int,
    indices: Sequence[int],
    table: tuple[int, ...],
    request_hashes: tuple[bytes, ...],
    limit: int,
    per_block: int,
    resident: AbstractSet[ObjectId],
    reserved: AbstractSet[ObjectId],
    planned: set[bytes],
) -> _Kept:
    """Block by block: every rule of :func:`store_plan` checked per index;
    ``planned`` gains the hashes kept."""
    kept_indices: list[int] = []
    kept_ids: list[int] = []
    kept_hashes: list[bytes] = []
    for index in indices:
        if index >= limit:
            continue
        block_id = table[index]
        if block_id == NULL_BLOCK_ID:
            continue
        block_hash = request_hashes[index * per_block + per_block - 1]
        if block_hash in planned:
            continue
        identity = (group_id, block_hash)
        if identity in resident or identity in reserved:
            continue
        planned.add(block_hash)
        kept_indices.append(index)
        kept_ids.append(block_id)
        kept_hashes.append(block_hash)
    return kept_indices, tuple(kept_ids), tuple(kept_hashes)


def _stored_facts(
    indices: Sequence[int],
    block_size: int,
    hash_block_size: int,
    request_hashes: Sequence[bytes],
    token_ids: Sequence[int],
) -> StoredBlockFacts:
    """The KV-event facts of a group's kept blocks: each block's parent (the hash
    ending where it starts) and its token ids."""
    return StoredBlockFacts(
        tuple(
            request_hashes[index * block_size // hash_block_size - 1] if index else None
            for index in indices
        ),
        tuple(tuple(token_ids[index * block_size : (index + 1) * block_size])
              for index in indices),
    )
