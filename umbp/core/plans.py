"""Plans: which device blocks to fill from the pool, and which to copy into it.

Plans carry object identities ``(group_id, block_hash)``, never key strings: each
worker builds its own rank's key. Block tables are tuples of block ids per
prefix-cacheable group, aligned with :attr:`LookupGeometry.group_ids`; block
``i`` of a group with block size ``B`` holds tokens ``[i*B, (i+1)*B)`` and is
identified by the hash ending at ``(i+1)*B``.

* Load plans (:func:`plan_allocated_load`) turn a :class:`LoadSpec` and what vLLM
  allocated (its external token count, the block table) into destination blocks,
  or into the blocks vLLM must recompute.
* Store plans are computed in steps, so the shell can put vLLM's reachability masks
  and one residency lookup per step between them: :func:`store_candidate_ranges`,
  :func:`apply_store_masks`, then :mod:`umbp.core.store_pass` (the residency check
  of every request of the step and the batches, built with :func:`store_batch`).
* Boundary-state plans (:func:`boundary_state_plans`) store Mamba "align" states
  that vLLM hands off at committed boundaries; finished-partial-tail plans
  (:func:`finished_partial_tail_plans`) store the pages of a finished request's
  fine-grained last boundary.

Store-event bookkeeping (pins and acknowledgements) lives in
:mod:`umbp.core.store_events`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain, compress, repeat
from typing import TypeAlias

from returns.result import Failure, Result, Success

from umbp.core.lookup import NULL_BLOCK_ID, LoadSpec, LookupGeometry, hashes_at_token_ends

__all__ = [
    "BlockLoadBatch",
    "BlockTable",
    "BlockTransferPlan",
    "DropReason",
    "DroppedOffloads",
    "Identity",
    "StoreBatch",
    "StoreSelection",
    "StoreTracker",
    "UnplannedLoad",
    "allocated_window",
    "apply_store_masks",
    "boundary_state_plans",
    "eagle_store_groups",
    "finished_partial_tail_plans",
    "is_prefill",
    "load_batch",
    "plan_allocated_load",
    "save_watermark",
    "storable_tokens",
    "store_batch",
    "store_candidate_ranges",
    "store_token_limit",
    "stores_this_step",
    "stores_under_role",
    "transfer_batch",
    "transfer_batches",
    "window_block_ids",
]

Identity: TypeAlias = tuple[int, bytes]
"""One stored object, on any rank: ``(group_id, block_hash)``."""

BlockTable: TypeAlias = tuple[tuple[int, ...], ...]
"""Block ids per prefix-cacheable group, aligned with ``LookupGeometry.group_ids``."""

StoreSelection: TypeAlias = tuple[tuple[int, Sequence[int]], ...]
"""Per group id, the block indices chosen for storing (a ``range`` when the
group's candidates are kept whole)."""


# --------------------------------------------------------------------------- loads


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
    group_ids: list[int] = []
    block_ids: list[int] = []
    block_hashes: list[bytes] = []
    if spec.block_hashes_by_group:
        problem = _coordinated_loads(
            geometry, spec, block_table, group_ids, block_ids, block_hashes
        )
    else:
        problem = _positional_loads(
            geometry, spec, block_table, request_hashes, group_ids, block_ids, block_hashes
        )
    if problem is not None:
        return Failure(f"request {request_id}: {problem}")
    destinations = set(block_ids)
    if NULL_BLOCK_ID in destinations:
        group_id = group_ids[block_ids.index(NULL_BLOCK_ID)]
        return Failure(
            f"request {request_id}: a pool object maps to a null destination block "
            f"in group {group_id}"
        )
    if len(destinations) != len(block_ids):
        return Failure(f"request {request_id}: a destination block is written twice")
    return Success(
        BlockLoadBatch(request_id, tuple(group_ids), tuple(block_ids), tuple(block_hashes))
    )


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


def _coordinated_loads(
    geometry: LookupGeometry,
    spec: LoadSpec,
    block_table: BlockTable,
    group_ids: list[int],
    block_ids: list[int],
    block_hashes: list[bytes],
) -> str | None:
    if len(spec.block_hashes_by_group) != len(geometry.group_ids):
        return (
            f"load spec names {len(spec.block_hashes_by_group)} groups, "
            f"expected {len(geometry.group_ids)}"
        )
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
    return None


def _positional_loads(
    geometry: LookupGeometry,
    spec: LoadSpec,
    block_table: BlockTable,
    request_hashes: Sequence[bytes],
    group_ids: list[int],
    block_ids: list[int],
    block_hashes: list[bytes],
) -> str | None:
    hash_block_size = geometry.hash_block_size
    covered = len(request_hashes) * hash_block_size
    end = spec.external_tokens
    if end > covered:
        return f"the window ends at token {end} but hashes cover {covered}"
    for group_id, block_size, table in zip(
        geometry.group_ids, geometry.group_block_sizes, block_table
    ):
        first = spec.local_tokens // block_size
        full = end // block_size
        if full > first:
            if full > len(table):
                return f"group {group_id} has {len(table)} blocks, the window needs {full}"
            block_ids.extend(table[first:full])
            block_hashes.extend(
                hashes_at_token_ends(
                    request_hashes,
                    (first + 1) * block_size,
                    full * block_size,
                    block_size,
                    hash_block_size,
                )
            )
            group_ids.extend([group_id] * (full - first))
        if end % block_size:
            # The window ends inside this group's block: only a saved partial tail,
            # identified by the hash at the window's end, can fill it.
            if not geometry.partial_hash_hits:
                return f"the window ends inside a block of group {group_id} without partial hits"
            if end % hash_block_size:
                return f"the window end {end} is not hash aligned"
            if full >= len(table):
                return f"partial hit in group {group_id} has no destination block"
            group_ids.append(group_id)
            block_ids.append(table[full])
            block_hashes.append(request_hashes[end // hash_block_size - 1])
    return None


# ------------------------------------------------------------------- store tracking


@dataclass(frozen=True, slots=True)
class StoreTracker:
    """What the scheduler remembers about one request for storing.

    ``saved_tokens`` is the hash-aligned watermark below which every block was
    already planned; ``block_table`` is the request's table as last reported;
    ``cached_tokens`` the tokens it had when scheduled without computing them
    (vLLM's prefix-cache hits and umbp's restored window): their blocks may
    already be in the pool.
    """

    saved_tokens: int = 0
    block_table: BlockTable = ()
    cached_tokens: int = 0

    def with_blocks_replaced(self, block_table: Sequence[Sequence[int]]) -> StoreTracker:
        """vLLM passed the whole table (admission, resumption)."""
        return StoreTracker(
            self.saved_tokens, tuple(tuple(group) for group in block_table), self.cached_tokens
        )

    def with_blocks_appended(self, new_blocks: Sequence[Sequence[int]]) -> StoreTracker:
        """vLLM passed the blocks allocated this step, per group."""
        if not self.block_table:
            return self.with_blocks_replaced(new_blocks)
        if len(new_blocks) != len(self.block_table):
            raise ValueError(
                f"appending {len(new_blocks)} groups to a table of {len(self.block_table)}"
            )
        return StoreTracker(
            self.saved_tokens,
            tuple(group + tuple(added) for group, added in zip(self.block_table, new_blocks)),
            self.cached_tokens,
        )

    def with_step_blocks(
        self,
        new_blocks: Sequence[Sequence[int]] | None,
        resumed: bool,
        current_table: Sequence[Sequence[int]] | None,
    ) -> StoreTracker:
        """The table after one step's report: a resumed request's new blocks are
        its whole table, any other request's are appended; a current table vLLM
        reports (``kv_connector_block_state``, tables that are not append-only)
        wins over both."""
        tracker = self
        if new_blocks:
            tracker = (
                tracker.with_blocks_replaced(new_blocks) if resumed
                else tracker.with_blocks_appended(new_blocks)
            )
        if current_table is not None:
            tracker = tracker.with_blocks_replaced(current_table)
        return tracker

    # An unchanged field returns the tracker itself (a value: sharing is safe),
    # so a step builds no tracker it does not need.

    def with_saved_tokens(self, saved_tokens: int) -> StoreTracker:
        if saved_tokens <= self.saved_tokens:
            return self
        return StoreTracker(saved_tokens, self.block_table, self.cached_tokens)

    def with_cached_tokens(self, cached_tokens: int) -> StoreTracker:
        if cached_tokens == self.cached_tokens:
            return self
        return StoreTracker(self.saved_tokens, self.block_table, cached_tokens)

    def reset(self) -> StoreTracker:
        """After preemption: the blocks are gone and the request starts over."""
        return StoreTracker()


def save_watermark(previous: int, token_count: int, hash_block_size: int) -> int:
    """The new save watermark: hash aligned (a group with smaller blocks than the
    largest must not wait for that group's block to fill), and it only grows."""
    return max(previous, token_count - token_count % hash_block_size)


def storable_tokens(token_count: int, num_hashes: int, hash_block_size: int) -> int:
    """Scheduled speculative tokens are unverified and have no hash yet; a block
    is storable only once its hash exists."""
    return min(token_count, num_hashes * hash_block_size)


def store_token_limit(total_tokens: int, num_prompt_tokens: int, save_decode_cache: bool) -> int:
    """Without ``save_decode_cache`` only the prompt is stored."""
    return total_tokens if save_decode_cache else min(total_tokens, num_prompt_tokens)


def is_prefill(num_computed_tokens: int, num_prompt_tokens: int) -> bool:
    """``num_tokens`` counts sampled tokens, so only the prompt bounds the prefill."""
    return num_computed_tokens < num_prompt_tokens


def stores_under_role(active: bool, kv_role: str | None) -> bool:
    """A consumer (``kv_role="kv_consumer"``) only loads; an inactive umbp does
    neither."""
    return active and kv_role != "kv_consumer"


def eagle_store_groups(
    explicit: AbstractSet[int], group_ids: Sequence[int], use_eagle: bool
) -> frozenset[int]:
    """The groups whose last block the EAGLE drafter recomputes (their store masks
    drop it): those vLLM marks as EAGLE groups, else every prefix-cacheable group
    when EAGLE drops a block."""
    if explicit:
        return frozenset(explicit)
    return frozenset(group_ids) if use_eagle else frozenset()


def stores_this_step(
    num_computed_tokens: int, num_prompt_tokens: int, save_decode_cache: bool
) -> bool:
    """Whether a running request's step can produce anything to store."""
    return save_decode_cache or is_prefill(num_computed_tokens, num_prompt_tokens)


# ----------------------------------------------------------------- store planning


def store_candidate_ranges(
    geometry: LookupGeometry,
    previous_saved: int,
    save_to: int,
    block_table: BlockTable,
    boundary_groups: AbstractSet[int],
) -> tuple[tuple[int, range], ...]:
    """Per positionally stored group, the blocks that became full since the last
    watermark. Boundary-handoff groups (Mamba "align") are absent: their tables are
    not append-only, so they are stored only from handed-off boundaries."""
    return tuple([
        (group_id, range(previous_saved // block_size, min(save_to // block_size, len(table))))
        for group_id, block_size, table in zip(
            geometry.group_ids, geometry.group_block_sizes, block_table
        )
        if group_id not in boundary_groups
    ])


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
        group_planned = planned.get(group_id)
        if group_planned is None:
            group_planned = planned[group_id] = set()
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
    # isdisjoint walks the zip in C; zip reuses its pair, so nothing per block stays.
    for excluded in (resident, reserved):
        if excluded and not excluded.isdisjoint(zip(repeat(group_id), hashes)):
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


# The constant columns of a batch, one shared tuple per value and length: requests
# of one step have the same few lengths, and a tuple kept per request would feed
# the garbage collector (the columns are immutable, so sharing them is safe).


@lru_cache(maxsize=1024)
def _repeated_int(value: int, count: int) -> tuple[int, ...]:
    return (value,) * count


@lru_cache(maxsize=256)
def _nones(count: int) -> tuple[None, ...]:
    return (None,) * count


@lru_cache(maxsize=256)
def _no_tokens(count: int) -> tuple[tuple[int, ...], ...]:
    return ((),) * count


# ------------------------------------------------------- boundary and tail transfers


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
    def identity(self) -> Identity:
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
        seen: set[Identity] = set()
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


def transfer_batch(request_id: str, plans: Sequence[BlockTransferPlan]) -> StoreBatch:
    """Transfer plans of one request as a store batch (whole pages, no token ids:
    a state page is not token-addressable)."""
    return StoreBatch(
        request_id,
        tuple(plan.group_id for plan in plans),
        tuple(plan.block_id for plan in plans),
        tuple(plan.block_hash for plan in plans),
        tuple(plan.parent_hash for plan in plans),
        tuple(() for _ in plans),
        tuple(plan.block_size for plan in plans),
    )


def transfer_batches(plans: Sequence[BlockTransferPlan]) -> tuple[StoreBatch, ...]:
    """One store batch per request, in first-seen request order."""
    by_request: dict[str, list[BlockTransferPlan]] = {}
    for plan in plans:
        by_request.setdefault(plan.request_id, []).append(plan)
    return tuple(transfer_batch(request_id, group) for request_id, group in by_request.items())


def finished_partial_tail_plans(
    request_id: str,
    geometry: LookupGeometry,
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
