"""Store plans: which device blocks to copy into the pool.

Store plans are computed in steps, so the shell can put vLLM's reachability masks
and one residency lookup per step between them:
:func:`umbp.core.store_tracking.store_candidate_ranges` (the blocks new since the
watermark), :func:`apply_store_masks`, then :mod:`umbp.core.store_pass` (the
residency check of every request of the step and the batches, built with
:func:`store_batch`). Store-event bookkeeping (pins and acknowledgements) lives in
:mod:`umbp.core.store_events`; what in-flight events write, in
:mod:`umbp.core.store_reservations`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain, compress, repeat
from typing import TypeAlias

from returns.result import Failure, Result, Success

from umbp.core.identity import Identity
from umbp.core.lookup import NULL_BLOCK_ID, BlockTable, LookupGeometry
from umbp.core.store_reservations import Reservations

__all__ = [
    "StoreBatch",
    "StoreSelection",
    "apply_store_masks",
    "store_batch",
    "whole_run_batch",
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
    ``range``: :func:`store_batch` plans a contiguous run without a per-block loop.

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


def _holds_none(excluded: AbstractSet[Identity], group_id: int, hashes: Sequence[bytes]) -> bool:
    """No ``(group_id, hash)`` of ``hashes`` is in ``excluded``, checked in C:
    against each event's hashes for :class:`Reservations`, else through a zip
    (which reuses its pair, so nothing per block stays)."""
    if isinstance(excluded, Reservations):
        return excluded.holds_none(group_id, hashes)
    return excluded.isdisjoint(zip(repeat(group_id), hashes))


@dataclass(frozen=True, slots=True)
class StoreBatch:
    """Blocks of one request to copy into the pool; columns align.

    ``parent_hashes`` and ``token_ids`` feed KV events: without events they are
    None and empty per block.
    """

    request_id: str
    group_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    parent_hashes: tuple[bytes | None, ...]
    token_ids: tuple[tuple[int, ...], ...]
    block_sizes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.block_ids)


assert NULL_BLOCK_ID == 0, "the contiguous store path tests block ids for truth"

# One group's part of a store batch: (group id, block size, block indices,
# block ids, block hashes); a contiguous run keeps its indices as a range and its
# ids and hashes as slices, so no per-block object is built.
_GroupStores: TypeAlias = tuple[int, int, Sequence[int], Sequence[int], Sequence[bytes]]


def store_batch(
    request_id: str,
    geometry: LookupGeometry,
    selected: StoreSelection,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    *,
    planned: dict[int, set[bytes]],
    resident: AbstractSet[Identity] = frozenset(),
    reserved: AbstractSet[Identity] = frozenset(),
    events_enabled: bool = False,
    token_ids: Sequence[int] = (),
) -> StoreBatch:
    """The selected blocks that still need storing.

    Skips null blocks, blocks past the hash coverage, restored blocks still resident
    (``resident``), identities an in-flight store event already writes
    (``reserved``), hashes the store pass has already planned (``planned``, per
    group id) and repeats of one identity. The batch's hashes are added to
    ``planned``: that record is this function's only effect, and it belongs to
    the caller's pass (one dict per pass, :func:`umbp.core.store_pass.plan_stores`;
    ``{}`` for one request alone).

    A group's contiguous run with nothing null, repeated, resident, reserved or
    planned is taken as slices (:func:`_contiguous_group_stores`); any other group
    is scanned block by block (:func:`_scanned_group_stores`). Both give the same
    plan: the scan is the rule, the slices its fast case.
    """
    hash_block_size = geometry.hash_block_size
    covered = len(request_hashes) * hash_block_size
    parts: list[_GroupStores] = []
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
        if kept[2]:
            parts.append((group_id, block_size, *kept))
    return _batch_of(
        request_id, parts, request_hashes, hash_block_size, events_enabled, token_ids
    )


def whole_run_batch(
    request_id: str,
    geometry: LookupGeometry,
    selected: StoreSelection,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    planned: dict[int, set[bytes]],
) -> StoreBatch | None:
    """:func:`store_batch`'s batch for the usual request of a store pass with
    nothing resident, reserved or evented (the caller knows that; store_batch is
    asked with ``resident``, ``reserved`` and ``events_enabled`` left out): one
    group, whose selection is one contiguous run that stores whole. None, with
    ``planned`` unchanged, in any other case: store_batch decides then.

    The same rule (:func:`_contiguous_group_stores`) without store_batch's
    per-group loop and column joins: every request of a step comes here, and they
    cost 10-25% of its batch (a property holds the two equal)."""
    group_id = geometry.group_ids[0]
    if len(selected) != 1 or len(geometry.group_ids) != 1 or selected[0][0] != group_id:
        return None
    block_size = geometry.group_block_sizes[0]
    hash_block_size = geometry.hash_block_size
    table = block_table[0]
    kept = _contiguous_group_stores(
        group_id, selected[0][1], table, request_hashes,
        min(len(request_hashes) * hash_block_size // block_size, len(table)),
        block_size // hash_block_size, frozenset(), frozenset(), _planned_of(planned, group_id),
    )
    if kept is None:
        return None
    return _one_group_batch(request_id, group_id, block_size, kept[1], kept[2])


def _planned_of(planned: dict[int, set[bytes]], group_id: int) -> set[bytes]:
    """The pass's record of one group's planned hashes, made on first use."""
    group_planned = planned.get(group_id)
    if group_planned is None:  # no set built per call, as setdefault would
        group_planned = planned[group_id] = set()
    return group_planned


def _contiguous_group_stores(
    group_id: int,
    indices: Sequence[int],
    table: Sequence[int],
    request_hashes: Sequence[bytes],
    limit: int,
    per_block: int,
    resident: AbstractSet[Identity],
    reserved: AbstractSet[Identity],
    planned: set[bytes],
) -> tuple[range, Sequence[int], Sequence[bytes]] | None:
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
    if not all(block_ids):  # the null block is id 0: a truth test, no comparison
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
    table: Sequence[int],
    request_hashes: Sequence[bytes],
    limit: int,
    per_block: int,
    resident: AbstractSet[Identity],
    reserved: AbstractSet[Identity],
    planned: set[bytes],
) -> tuple[Sequence[int], Sequence[int], Sequence[bytes]]:
    """Block by block: every rule of :func:`store_batch` checked per index;
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
    return kept_indices, kept_ids, kept_hashes


def _batch_of(
    request_id: str,
    parts: Sequence[_GroupStores],
    request_hashes: Sequence[bytes],
    hash_block_size: int,
    events_enabled: bool,
    token_ids: Sequence[int],
) -> StoreBatch:
    """The columns of the groups' parts, in order."""
    if not parts:
        return StoreBatch(request_id, (), (), (), (), (), ())
    if len(parts) == 1 and not events_enabled:
        group_id, block_size, _, ids, hashes = parts[0]
        return _one_group_batch(request_id, group_id, block_size, ids, hashes)
    if len(parts) == 1:
        group_id, block_size, indices, ids, hashes = parts[0]
        group_ids = _repeated_int(group_id, len(indices))
        block_sizes = _repeated_int(block_size, len(indices))
        block_ids = tuple(ids)
        block_hashes = tuple(hashes)
    else:
        group_ids = tuple(chain.from_iterable(repeat(part[0], len(part[2])) for part in parts))
        block_sizes = tuple(chain.from_iterable(repeat(part[1], len(part[2])) for part in parts))
        block_ids = tuple(chain.from_iterable(part[3] for part in parts))
        block_hashes = tuple(chain.from_iterable(part[4] for part in parts))
    if events_enabled:
        parent_hashes: tuple[bytes | None, ...] = tuple(
            request_hashes[index * size // hash_block_size - 1] if index else None
            for _, size, indices, _, _ in parts
            for index in indices
        )
        tokens = tuple(
            tuple(token_ids[index * size : (index + 1) * size])
            for _, size, indices, _, _ in parts
            for index in indices
        )
    else:
        parent_hashes = _nones(len(block_ids))
        tokens = _no_tokens(len(block_ids))
    return StoreBatch(
        request_id, group_ids, block_ids, block_hashes, parent_hashes, tokens, block_sizes
    )


def _one_group_batch(
    request_id: str, group_id: int, block_size: int, block_ids: Sequence[int],
    block_hashes: Sequence[bytes],
) -> StoreBatch:
    """A batch of one group's blocks without events: its constant columns shared."""
    group_ids, parents, tokens, block_sizes = _constant_columns(
        group_id, block_size, len(block_ids)
    )
    return StoreBatch(
        request_id, group_ids, tuple(block_ids), tuple(block_hashes), parents, tokens,
        block_sizes,
    )


# The constant columns of a batch, one shared tuple per value and length: requests
# of one step have the same few lengths, and a tuple kept per request would feed
# the garbage collector (the columns are immutable, so sharing them is safe).


@lru_cache(maxsize=1024)
def _constant_columns(
    group_id: int, block_size: int, count: int
) -> tuple[tuple[int, ...], tuple[None, ...], tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """A one-group batch's constant columns without events (group ids, parents,
    tokens, block sizes): one cache lookup per request instead of four."""
    return (
        _repeated_int(group_id, count), _nones(count), _no_tokens(count),
        _repeated_int(block_size, count),
    )


@lru_cache(maxsize=1024)
def _repeated_int(value: int, count: int) -> tuple[int, ...]:
    return (value,) * count


@lru_cache(maxsize=256)
def _nones(count: int) -> tuple[None, ...]:
    return (None,) * count


@lru_cache(maxsize=256)
def _no_tokens(count: int) -> tuple[tuple[int, ...], ...]:
    return ((),) * count
