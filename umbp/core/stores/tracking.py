"""Store tracking: what the scheduler remembers of each request for storing
(:class:`StoreTracker`), its hash-aligned save watermark, and the blocks that
became full since it (:func:`store_candidate_ranges`, the start of a step's
store plan in :mod:`umbp.core.stores.request_store`); plus the small rules of which
requests and groups store at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from umbp.core.geometry import BlockTable, CacheGeometry

__all__ = [
    "StoreTracker",
    "announces_under_role",
    "eagle_store_groups",
    "is_prefill",
    "save_watermark",
    "storable_tokens",
    "store_candidate_ranges",
    "store_token_limit",
    "stored_prompt_tokens",
    "stores_this_step",
    "stores_under_role",
]


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
        """vLLM's whole table: at allocation, and each step that stores (vLLM's
        current table, :func:`umbp.core.stores.windows.cached_request_store_window`)."""
        return StoreTracker(
            self.saved_tokens, tuple(tuple(group) for group in block_table), self.cached_tokens
        )

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


def stored_prompt_tokens(geometry: CacheGeometry, num_prompt_tokens: int, num_hashes: int) -> int:
    """The prompt tokens whose blocks a prefill engine stores for a request it
    finished: its whole blocks that have a hash (what it announces to the decode
    engine)."""
    covered = storable_tokens(num_prompt_tokens, num_hashes, geometry.hash_block_size)
    return covered - covered % geometry.block_size


def announces_under_role(active: bool, kv_role: str | None) -> bool:
    """A prefill engine (``kv_role="kv_producer"``) tells, with each finished
    request, which of its blocks it stores (disaggregated prefill)."""
    return active and kv_role == "kv_producer"


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


def store_candidate_ranges(
    geometry: CacheGeometry,
    previous_saved: int,
    save_to: int,
    block_table: BlockTable,
    boundary_groups: AbstractSet[int],
) -> tuple[tuple[int, range], ...]:
    """Per positionally stored group, the blocks that became full since the last
    watermark. Boundary-handoff groups (Mamba "align") are absent: their tables are
    not append-only, so they are stored only from handed-off boundaries."""
    group_ids = geometry.group_ids
    if len(group_ids) == 1 and len(block_table) == 1 and group_ids[0] not in boundary_groups:
        # One group (the usual model), built directly: every storing request of
        # every step comes here, where the per-group comprehension would cost twice
        # as much (a property holds the two equal).
        block_size = geometry.group_block_sizes[0]
        return ((group_ids[0], range(
            previous_saved // block_size, min(save_to // block_size, len(block_table[0]))
        )),)
    return _candidate_ranges_per_group(
        geometry, previous_saved, save_to, block_table, boundary_groups
    )


def _candidate_ranges_per_group(
    geometry: CacheGeometry,
    previous_saved: int,
    save_to: int,
    block_table: BlockTable,
    boundary_groups: AbstractSet[int],
) -> tuple[tuple[int, range], ...]:
    """:func:`store_candidate_ranges`' rule, group by group."""
    return tuple([
        (group_id, range(previous_saved // block_size, min(save_to // block_size, len(table))))
        for group_id, block_size, table in zip(
            geometry.group_ids, geometry.group_block_sizes, block_table
        )
        if group_id not in boundary_groups
    ])
