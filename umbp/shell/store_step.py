"""One scheduler step's stores: core's two calls around the step's one residency
lookup (:func:`umbp.core.stores.plan_store_step`, ``store.lookup``,
:func:`umbp.core.stores.finish_store_step`), with vLLM's objects read through
:mod:`umbp.shell.vllm_compat` on core's demand (:class:`_StepReads`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol, cast

from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace, ObjectId
from umbp.core.plans import StorePlan
from umbp.core.requests import RequestLifecycle, RequestView
from umbp.core.stores import (
    ScheduledStep,
    StoreRules,
    finish_store_step,
    plan_store_step,
)
from umbp.runtime.contract import SchedulerStore, TierAware
from umbp.shell import vllm_compat
from umbp.shell.lookup_errors import log_failed_lookup
from umbp.shell.request_state import UNKNOWN, RequestState
from umbp.shell.vllm_compat.objects import RequestLike, SchedulerOutputLike

logger = logging.getLogger("umbp")


class StoreStepCounters(Protocol):
    planned_store_blocks: int
    store_skipped_resident_blocks: int
    residency_lookups: int
    lookup_failures: int


class StoreStep:
    """The model's fixed store rules, the requests that may still store, and one
    method per step. It reads and writes the scheduler's per-request states."""

    def __init__(
        self, kv_cache_config: Any, geometry: CacheGeometry, *, save_decode_cache: bool,
        events_enabled: bool, eagle_store_groups: frozenset[int], dcp_size: int,
        counters: StoreStepCounters,
    ) -> None:
        self._rules = StoreRules(
            geometry,
            boundary_groups=frozenset(vllm_compat.align_mamba_group_ids(kv_cache_config)),
            # Groups whose blocks vLLM may drop (sliding windows, Mamba): only they
            # are asked for masks; any other keeps every block.
            masked_groups=frozenset(
                group_id for group_id in geometry.group_ids
                if not vllm_compat.keeps_every_block(kv_cache_config, group_id)
            ),
            save_decode_cache=save_decode_cache,
            events_enabled=events_enabled,
        )
        self._kv_cache_config = kv_cache_config
        self._eagle_store_groups = eagle_store_groups
        self._dcp_size = dcp_size
        self._counters = counters
        # Requests that may store at their next scheduled step (core's draft says
        # which start and stop); a step visits no other request scheduled before.
        self._storing: set[str] = set()

    def forget(self, request_id: str) -> None:
        self._storing.discard(request_id)

    def may_store_again(self, request_ids: AbstractSet[str]) -> None:
        """Requests vLLM recomputes (a failed load cut their computed tokens)."""
        self._storing |= request_ids

    def plan(
        self,
        output: SchedulerOutputLike,
        requests: MutableMapping[str, RequestState],
        reserved: AbstractSet[ObjectId],
        preempted: AbstractSet[str],
        store: SchedulerStore | None,
        keyspace: KeySpace | None,
    ) -> tuple[StorePlan, ...]:
        """The step's store plans (new full blocks minus what the pool or an
        in-flight event holds, then handed-off boundary states); ``requests`` get
        their new trackers."""
        cached = output.scheduled_cached_reqs
        step = ScheduledStep(
            [(new.req_id, new.num_computed_tokens, new.block_ids)
             for new in output.scheduled_new_reqs],
            cached.req_ids, cached.num_computed_tokens, cached.resumed_req_ids,
            output.num_scheduled_tokens, output.finished_req_ids, preempted,
            vllm_compat.boundary_offloads(output),
        )
        reads = _StepReads(self, output, requests)
        draft = plan_store_step(self._rules, step, self._storing, reserved, keyspace, reads)
        for request_id, life in draft.lives.items():
            requests[request_id] = requests[request_id].with_life(life)
        self._storing -= draft.stopped
        self._storing |= draft.started
        for request_id, reason in draft.unreadable:
            logger.warning("umbp: %s for scheduled request %s; it stores nothing this step",
                           reason, request_id)
        for drop in draft.dropped_handoffs:
            logger.debug("umbp boundary offloads dropped request=%s entries=%d: %s",
                         drop.request_id, drop.entries, drop.reason.value)
        planned = finish_store_step(self._rules, draft, self._residency_answers(draft.check.keys,
                                                                                store))
        self._counters.planned_store_blocks += sum(map(len, planned.plans))
        self._counters.store_skipped_resident_blocks += planned.skipped_resident
        return planned.plans

    def masks(
        self, request: RequestLike, ranges: Sequence[tuple[int, range]]
    ) -> Mapping[int, Sequence[bool] | None]:
        """vLLM's own reachability masks of the groups' candidate blocks."""
        geometry = self._rules.geometry
        boundaries = vllm_compat.reachable_boundaries(
            request, geometry.block_size, geometry.use_eagle
        )
        return {
            group_id: vllm_compat.reachable_block_mask(
                self._kv_cache_config, group_id, indices, geometry.block_size,
                group_id in self._eagle_store_groups, boundaries, self._dcp_size,
            )
            for group_id, indices in ranges
        }

    def _residency_answers(
        self, keys: Sequence[str], store: SchedulerStore | None
    ) -> tuple[bool, ...] | None:
        """None (nothing known resident, so everything is stored) when there is
        nothing to ask or the store cannot answer."""
        if not keys or store is None:
            return None
        self._counters.residency_lookups += 1
        try:
            if isinstance(store, TierAware):
                # A store that counts its lookups as asks for loads (`umbp serve`'s hit
                # rate, and its SSD prefetch) is asked where, which it does not count.
                return tuple([medium is not None for medium in store.where(keys)])
            return store.lookup(keys)
        except Exception as error:  # noqa: BLE001 (see umbp.shell.lookup_errors)
            self._counters.lookup_failures += 1
            log_failed_lookup("residency lookup", error)
            return None


class _StepReads:
    """core's :class:`~umbp.core.stores.StoreStepReads` over this step's vLLM
    objects and the scheduler's states."""

    __slots__ = ("_output", "_requests", "_step")

    def __init__(
        self, step: StoreStep, output: SchedulerOutputLike,
        requests: Mapping[str, RequestState],
    ) -> None:
        self._step, self._output, self._requests = step, output, requests

    def state(self, request_id: str) -> tuple[RequestView | None, RequestLifecycle]:
        state = self._requests.get(request_id, UNKNOWN)
        return state.request, state.life

    def current_table(self, request_id: str) -> Sequence[Sequence[int]] | None:
        return vllm_compat.current_block_ids(self._output, request_id)

    def masks(
        self, request: RequestView, ranges: Sequence[tuple[int, range]]
    ) -> Mapping[int, Sequence[bool] | None]:
        # The request is one :meth:`state` returned: vLLM's, held in the states.
        return self._step.masks(cast(RequestLike, request), ranges)
