"""vLLM's own KV cache coordinator, fed with the pool's lookup results.

For a model whose cache has several groups (sliding window + full attention,
Mamba + full attention, chunked local attention) or one group that is not plain
full attention, how far a prefix hit reaches is a question only vLLM's
coordinator answers correctly: a sliding-window group needs just the last
window of blocks, a Mamba group just one state at a boundary, and every group
must agree on one length. So umbp builds a second, lookup-only coordinator over
the prefix-cacheable groups and swaps its block pool for a :class:`_LookupBlockPool`
that answers ``get_cached_block`` from per-group hit sets: the pool's hits
(:func:`umbp.core.lookup.windows.coordinator_hit_sets`) plus vLLM's own cached blocks
inside the local tokens. The coordinator's answer becomes a
:class:`~umbp.core.lookup.windows.LoadSpec` through
:func:`umbp.core.lookup.windows.load_spec_from_hits`.

Every decision stays in vLLM (hit length) or in ``umbp.core`` (hit sets, the
window); this module only wires them together. The hit sets live in the lookup
pool only for the duration of one :meth:`HybridLookup.window` call.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from umbp.core.geometry import CacheGeometry, lookup_unit
from umbp.core.lookup.query import LookupQuery
from umbp.core.lookup.windows import (
    LoadSpec,
    coordinator_hit_sets,
    load_spec_from_hits,
    local_object_hashes,
)
from umbp.shell import vllm_compat
from umbp.shell.vllm_compat.versions import (
    coordinator_allows_partial_hash_hits,
    coordinator_arguments,
    coordinator_lookahead,
)

__all__ = ["HybridLookup", "LocalBlockProbe"]

LocalBlockProbe = Callable[[int, bytes], bool]
"""``(group_id, block_hash) -> bool``: does vLLM's device block pool hold this
block (``BlockPool.get_cached_block(block_hash, [group_id])``)? ``group_id`` is
vLLM's KV cache group id, not a position among the cacheable groups."""

_HIT_BLOCK_ID = 1
"""Block id of every hit block the lookup pool hands out; only the hash matters."""


class _LookupBlockPool:
    """Stands in for vLLM's ``BlockPool`` inside the lookup-only coordinator.

    The coordinator's managers read only ``hash_block_size``, ``null_block`` and
    ``get_cached_block`` while finding a hit; this pool answers the last from the
    hit sets of the call in progress. ``kv_cache_group_ids`` are positions in the
    lookup coordinator's group list (the prefix-cacheable groups in order). One
    lookup at a time: the scheduler calls from its own thread only.
    """

    def __init__(self, hash_block_size: int) -> None:
        from vllm.v1.core.kv_cache_utils import (
            KVCacheBlock,
            get_block_hash,
            make_block_hash_with_group_id,
        )

        self.hash_block_size = hash_block_size
        self.null_block: Any = KVCacheBlock(block_id=0, is_null=True)
        self._new_block: Callable[..., Any] = KVCacheBlock
        self._hash_with_group: Callable[[bytes, int], Any] = make_block_hash_with_group_id
        self._hash_of_key: Callable[[Any], bytes] = get_block_hash
        self._hits: tuple[frozenset[bytes], ...] = ()

    @property
    def holds_hits(self) -> bool:
        """True only while a lookup is in progress."""
        return bool(self._hits)

    def load_hits(self, hits: tuple[frozenset[bytes], ...]) -> None:
        self._hits = hits

    def clear_hits(self) -> None:
        self._hits = ()

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[Any] | None:
        """One block per group if every group holds ``block_hash``, else None
        (``BlockPool.get_cached_block``'s contract)."""
        hits = self._hits
        for position in kv_cache_group_ids:
            if position >= len(hits) or block_hash not in hits[position]:
                return None
        return [self._hit_block(block_hash, position) for position in kv_cache_group_ids]

    def _hit_block(self, block_hash: bytes, position: int) -> Any:
        block = self._new_block(block_id=_HIT_BLOCK_ID)
        block.set_block_hash(self._hash_with_group(block_hash, position))
        return block

    def object_hash(self, block: Any) -> bytes | None:
        """The object a block of the coordinator's answer stands for; None for a
        null (skipped) block."""
        if block.is_null or block.block_hash is None:
            return None
        return bytes(self._hash_of_key(block.block_hash))


class HybridLookup:
    """A lookup-only KV cache coordinator over the prefix-cacheable groups.

    ``geometry`` supplies the groups, the scheduler and hash block sizes and the
    EAGLE flag; its ``lookup_units`` are replaced (see :attr:`geometry`) by the
    units this coordinator can use. ``enable_partial_hash_hits`` is the user's
    switch; whether partial hash hits are used also depends on the coordinator
    (:attr:`allows_partial_hash_hits`).
    """

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        geometry: CacheGeometry,
        enable_partial_hash_hits: bool,
    ) -> None:
        from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator

        groups = kv_cache_config.kv_cache_groups
        lookup_config = dataclasses.replace(
            kv_cache_config,
            kv_cache_groups=[groups[group_id] for group_id in geometry.group_ids],
            num_blocks=1,
        )
        max_model_len = vllm_compat.max_model_len(vllm_config) or (
            kv_cache_config.num_blocks * geometry.block_size
        )
        required: dict[str, object] = {
            "kv_cache_config": lookup_config,
            "max_model_len": max_model_len,
            "max_in_flight_tokens": int(vllm_config.max_in_flight_tokens),
            "use_eagle": geometry.use_eagle,
            "enable_caching": True,
            "enable_kv_cache_events": False,
            "dcp_world_size": vllm_compat.parallel_sizes(vllm_config)[2],
            # 1, as vLLM's scheduler builds its own coordinator. (The reference
            # passed the PCP size, which the hybrid coordinator rejects for
            # groups that are not full attention.)
            "pcp_world_size": 1,
            "scheduler_block_size": geometry.block_size,
            "hash_block_size": geometry.hash_block_size,
        }
        optional: dict[str, object] = {
            **coordinator_lookahead(vllm_config),
            "allow_partial_hash_hits": enable_partial_hash_hits,
        }
        parameters = inspect.signature(get_kv_cache_coordinator).parameters
        coordinator = get_kv_cache_coordinator(
            **coordinator_arguments(parameters, required, optional)
        )
        pool = _LookupBlockPool(geometry.hash_block_size)
        coordinator.block_pool = pool
        for manager in coordinator.single_type_managers:
            manager.block_pool = pool
            manager._null_block = pool.null_block
        self._coordinator: Any = coordinator
        self._pool = pool
        self.allows_partial_hash_hits: bool = coordinator_allows_partial_hash_hits(
            coordinator
        )
        """Whether the coordinator probes hash-block boundaries inside a group's
        blocks (vLLM allows it only with Mamba "align" groups and fine-grained
        managers everywhere); decides the lookup unit per group."""
        self.geometry: CacheGeometry = dataclasses.replace(
            geometry,
            partial_hash_hits=enable_partial_hash_hits,
            lookup_units=tuple(
                lookup_unit(
                    size, geometry.hash_block_size, enable_partial_hash_hits,
                    self.allows_partial_hash_hits,
                )
                for size in geometry.group_block_sizes
            ),
        )
        """The geometry lookups must use with this coordinator: the given one
        with each group's lookup unit as the coordinator can probe it."""

    @property
    def holds_hits(self) -> bool:
        """Whether the lookup pool holds hit sets (only inside :meth:`window`)."""
        return self._pool.holds_hits

    def window(
        self,
        query: LookupQuery,
        folded: Sequence[Sequence[bool]],
        request_hashes: Sequence[bytes],
        has_local_block: LocalBlockProbe,
    ) -> LoadSpec | None:
        """The hit window the coordinator grants, or None if nothing loads.

        ``query`` was built with :attr:`geometry`; ``folded`` is
        :func:`~umbp.core.lookup.windows.fold_rank_hits` of its answers;
        ``request_hashes`` are the request's block hashes the query was built
        from (vLLM's ``request.block_hashes`` list, passed on uncopied).
        ``has_local_block`` is asked about every object inside the local tokens.
        Errors from vLLM propagate; the lookup pool is empty afterwards either way.
        """
        geometry = self.geometry
        if query.units != geometry.lookup_units:
            raise ValueError(
                f"query lookup units {query.units} differ from this coordinator's "
                f"{geometry.lookup_units}: build queries with HybridLookup.geometry"
            )
        try:
            local_hits = tuple(
                [
                    block_hash for block_hash in group_objects
                    if has_local_block(group_id, block_hash)
                ]
                for group_id, group_objects in zip(
                    geometry.group_ids,
                    local_object_hashes(geometry, request_hashes, query.local_tokens),
                )
            )
            self._pool.load_hits(coordinator_hit_sets(query, folded, local_hits))
            hashes = request_hashes if isinstance(request_hashes, list) else list(request_hashes)
            found = self._coordinator.find_longest_cache_hit(hashes, query.max_hit_end)
            hit_blocks, hit_length = found[0], int(found[1])
            block_hashes_by_group = tuple(
                tuple(map(self._pool.object_hash, group_blocks))
                for group_blocks in hit_blocks
            )
        finally:
            self._pool.clear_hits()
        return load_spec_from_hits(query, hit_length, block_hashes_by_group)
