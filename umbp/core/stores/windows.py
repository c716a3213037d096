"""One request's store window in the scheduler role: each step, the blocks that
became full since its watermark and the block table they are read from, and the
candidates vLLM's masks keep (:class:`StoreCandidates`, the store pass's input).

:func:`new_request_store_window` serves a request scheduled for the first time,
:func:`cached_request_stores` then :func:`cached_request_store_window` one scheduled
before, and :func:`store_candidates` applies vLLM's masks
(:mod:`umbp.core.stores.step` sequences them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from returns.result import Result

from umbp.core.geometry import BlockTable, CacheGeometry
from umbp.core.stores.request_store import StoreSelection, apply_store_masks
from umbp.core.stores.tracking import (
    StoreTracker,
    save_watermark,
    storable_tokens,
    store_candidate_ranges,
    store_token_limit,
    stores_this_step,
)

if TYPE_CHECKING:  # core.requests imports this package's tracker
    from umbp.core.requests import RequestLifecycle

__all__ = [
    "StoreCandidates",
    "StoreWindow",
    "cached_request_store_window",
    "cached_request_stores",
    "new_request_store_window",
    "store_candidates",
]


@dataclass(frozen=True, slots=True)
class StoreCandidates:
    """One request's blocks chosen for storing this step (after vLLM's masks).

    ``cached_tokens``: the tokens the request had when it was scheduled without
    computing them (vLLM's prefix-cache hits plus umbp's restored window). Its
    blocks that end at or below that count may already be in the pool.
    """

    request_id: str
    selected: StoreSelection
    block_table: BlockTable
    block_hashes: tuple[bytes, ...]
    cached_tokens: int = 0
    token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class StoreWindow:
    """One request's store candidates this step, before vLLM's masks."""

    ranges: tuple[tuple[int, range], ...]
    block_table: BlockTable
    cached_tokens: int


def _advance(
    tracker: StoreTracker,
    geometry: CacheGeometry,
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
    geometry: CacheGeometry,
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
    geometry: CacheGeometry,
    boundary_groups: AbstractSet[int],
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    current_table: BlockTable,
    num_prompt_tokens: int,
    num_hashes: int,
    save_decode_cache: bool,
) -> tuple[RequestLifecycle, StoreWindow]:
    """For a request :func:`cached_request_stores` said stores: the step's table
    is vLLM's current one (its ``kv_connector_block_state``, which vLLM 0.32 and
    0.33 build for every scheduled request when a connector is set; a table is not
    append-only, and a resumed request's is new), and the window runs up to
    :func:`store_token_limit`."""
    if state.tracker is None:
        raise ValueError("cached_request_store_window needs a tracked request")
    tracker = state.tracker.with_blocks_replaced(current_table)
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
