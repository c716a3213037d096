"""One scheduler step's stores: each scheduled request's new full blocks (through
vLLM's reachability masks and one residency lookup for the whole step) and the
boundary states vLLM handed off.

Read vLLM's step (through :mod:`umbp.shell.vllm_compat`) -> core
(:mod:`umbp.core.store_windows` for each request's window and tracker,
:mod:`umbp.core.store_pass` for the batches) -> the requests' new states and the
step's store batches.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

from returns.result import Failure, Success

from umbp.core import store_pass as core_store_pass
from umbp.core import store_windows, transfer_plans
from umbp.core.identity import Identity, KeySpace
from umbp.core.lookup import LookupGeometry, block_table_of
from umbp.core.store_pass import ResidencyCheck, StoreCandidates
from umbp.core.store_plans import StoreBatch
from umbp.core.store_windows import StoreWindow
from umbp.runtime.contract import SchedulerStore
from umbp.shell import vllm_compat
from umbp.shell.lookup_errors import log_failed_lookup
from umbp.shell.request_state import UNKNOWN, RequestState
from umbp.shell.vllm_compat.objects import RequestLike, SchedulerOutputLike

logger = logging.getLogger("umbp")


class StoreCounters(Protocol):
    planned_store_blocks: int
    store_skipped_resident_blocks: int
    residency_lookups: int
    lookup_failures: int


class StoreStep:
    """The model's fixed store facts (groups, masks' inputs), and one method per
    step. It owns no per-request state: it reads and writes the scheduler's."""

    def __init__(
        self, kv_cache_config: Any, geometry: LookupGeometry, *, save_decode_cache: bool,
        events_enabled: bool, eagle_store_groups: frozenset[int], dcp_size: int,
        counters: StoreCounters,
    ) -> None:
        self._kv_cache_config = kv_cache_config
        self._geometry = geometry
        self._save_decode_cache = save_decode_cache
        self._events_enabled = events_enabled
        self._eagle_store_groups = eagle_store_groups
        self._boundary_groups = vllm_compat.align_mamba_group_ids(kv_cache_config)
        # Groups whose blocks vLLM may drop (sliding windows, Mamba): only they are
        # asked for masks; any other keeps every block, the mask is None.
        self._masked_groups = frozenset(
            group_id for group_id in geometry.group_ids
            if not vllm_compat.keeps_every_block(kv_cache_config, group_id)
        )
        self._dcp_size = dcp_size
        self._counters = counters

    def plan(
        self,
        output: SchedulerOutputLike,
        requests: MutableMapping[str, RequestState],
        reserved: AbstractSet[Identity],
        preempted: AbstractSet[str],
        store: SchedulerStore | None,
        keyspace: KeySpace | None,
    ) -> list[StoreBatch]:
        """New full blocks (minus what the pool or an in-flight event holds), then
        handed-off boundary states; ``requests`` get their new trackers."""
        stores = list(self._store_pass(self._candidates(output, requests), reserved, store, keyspace))
        stores.extend(self._boundary_stores(output, requests, preempted))
        return stores

    def _candidates(
        self, output: SchedulerOutputLike, requests: MutableMapping[str, RequestState]
    ) -> list[StoreCandidates]:
        geometry, group_ids = self._geometry, self._geometry.group_ids
        candidates: list[StoreCandidates] = []
        for new in output.scheduled_new_reqs:
            state = requests.get(new.req_id, UNKNOWN)
            if state.request is None:  # never allocated: nothing of it to store
                continue
            life, window = store_windows.new_request_store_window(
                state.life, geometry, self._boundary_groups, new.num_computed_tokens,
                output.num_scheduled_tokens[new.req_id],
                block_table_of(new.block_ids, group_ids), len(state.request.block_hashes),
            )
            requests[new.req_id] = state.with_life(life)
            if (selected := self._masked(state.request, window)) is not None:
                candidates.append(selected)
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            state = requests.get(request_id, UNKNOWN)
            request, computed = state.request, cached.num_computed_tokens[index]
            if request is None:
                continue
            resumed = request_id in cached.resumed_req_ids
            life, stores = store_windows.cached_request_stores(
                state.life, computed, resumed, request.num_prompt_tokens, self._save_decode_cache
            )
            requests[request_id] = state.with_life(life)
            if not stores:
                continue
            current = vllm_compat.current_block_ids(output, request_id)
            if current is None:
                logger.warning(
                    "umbp: vLLM sent no current block table (kv_connector_block_state) "
                    "for scheduled request %s; it stores nothing this step", request_id,
                )
                continue
            life, window = store_windows.cached_request_store_window(
                life, geometry, self._boundary_groups, computed,
                output.num_scheduled_tokens[request_id], block_table_of(current, group_ids),
                request.num_prompt_tokens, len(request.block_hashes), self._save_decode_cache,
            )
            requests[request_id] = state.with_life(life)
            if (selected := self._masked(request, window)) is not None:
                candidates.append(selected)
        return candidates

    def _masked(self, request: RequestLike, window: StoreWindow) -> StoreCandidates | None:
        """The window's blocks vLLM's reachability masks keep (sliding windows);
        None for a malformed mask (logged)."""
        geometry, masked_groups = self._geometry, self._masked_groups
        masks: dict[int, tuple[bool, ...] | None] = {}
        if masked_groups:
            boundaries = vllm_compat.reachable_boundaries(
                request, geometry.block_size, geometry.use_eagle
            )
            masks = {
                group_id: vllm_compat.reachable_block_mask(
                    self._kv_cache_config, group_id, indices, geometry.block_size,
                    group_id in self._eagle_store_groups, boundaries, self._dcp_size,
                )
                for group_id, indices in window.ranges
                if group_id in masked_groups
            }
        hashes = tuple(request.block_hashes)
        token_ids = request.all_token_ids if self._events_enabled else ()
        if not masks:
            # No mask keeps the window whole (apply_store_masks' rule; a property
            # test holds the two equal): built directly, without two Result values
            # per request (each costs about as much as storing 20 blocks here).
            return StoreCandidates(
                request.request_id, window.ranges, window.block_table, hashes,
                window.cached_tokens, token_ids,
            )
        match store_windows.store_candidates(request.request_id, window, masks, hashes, token_ids):
            case Success(StoreCandidates() as candidates):
                return candidates
            case Failure(reason):
                logger.warning("umbp store mask for request %s: %s", request.request_id, reason)
        return None

    def _store_pass(
        self, candidates: list[StoreCandidates], reserved: AbstractSet[Identity],
        store: SchedulerStore | None, keyspace: KeySpace | None,
    ) -> tuple[StoreBatch, ...]:
        """Every request's candidates at once: one residency lookup for the blocks
        that came from a cache, then the batches without what the pool holds."""
        if not candidates:
            return ()
        check = (
            ResidencyCheck((), (), 1) if keyspace is None
            else core_store_pass.residency_check(self._geometry, keyspace, candidates, reserved)
        )
        planned = core_store_pass.plan_stores(
            self._geometry, candidates, check, self._residency_answers(check, store), reserved,
            events_enabled=self._events_enabled,
        )
        self._counters.planned_store_blocks += sum(len(batch) for batch in planned.batches)
        self._counters.store_skipped_resident_blocks += planned.skipped_resident
        return planned.batches

    def _residency_answers(
        self, check: ResidencyCheck, store: SchedulerStore | None
    ) -> tuple[bool, ...] | None:
        """None (nothing known resident, so everything is stored) when there is
        nothing to ask or the store cannot answer."""
        if not check.keys or store is None:
            return None
        self._counters.residency_lookups += 1
        try:
            return store.lookup(check.keys)
        except Exception as error:  # noqa: BLE001 (see umbp.shell.lookup_errors)
            self._counters.lookup_failures += 1
            log_failed_lookup("residency lookup", error)
            return None

    def _boundary_stores(
        self, output: SchedulerOutputLike, requests: MutableMapping[str, RequestState],
        preempted: AbstractSet[str],
    ) -> tuple[StoreBatch, ...]:
        """Mamba "align" groups: store only the boundary states vLLM handed off."""
        offloads = vllm_compat.boundary_offloads(output)
        tracked = {
            request_id: tuple(state.request.block_hashes)
            for request_id in offloads
            if (state := requests.get(request_id, UNKNOWN)).tracked
            and state.request is not None
        }
        geometry = self._geometry
        plans, dropped = transfer_plans.boundary_state_plans(
            offloads, output.finished_req_ids, preempted, tracked,
            frozenset(geometry.group_ids), geometry.hash_block_size,
            dict(zip(geometry.group_ids, geometry.group_block_sizes)), self._events_enabled,
        )
        for drop in dropped:
            logger.debug("umbp boundary offloads dropped request=%s entries=%d: %s",
                         drop.request_id, drop.entries, drop.reason.value)
        return transfer_plans.transfer_batches(plans)
