"""Admission: what a waiting request loads from the pool.

vLLM asks ``get_num_new_matched_tokens`` for a waiting request (again on later
steps while it waits), then says what it allocated. The first is core's two calls
around the store's answer (:func:`umbp.core.lookup.admission_step`, the lookup now
or on the lookup threads, :func:`umbp.core.lookup.admission_answer`); the second
one call (:func:`umbp.core.requests.after_allocation`). The hit window of a model
with several cache groups comes from vLLM's own coordinator, through
:class:`~umbp.shell.hybrid_lookup.HybridLookup`. It keeps no per-request state:
each call takes the request's :class:`~umbp.shell.request_state.RequestState` and
returns the next one, which the scheduler keeps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import replace
from functools import partial
from typing import Any, Protocol, TypeVar, cast

from returns.result import Failure, Success

from umbp.core.config import ConnectorConfig, effective_load_async
from umbp.core.geometry import CacheGeometry, block_table_of
from umbp.core.identity import KeySpace
from umbp.core.lookup import (
    AdmissionAnswer,
    LookupAction,
    LookupRules,
    RunningLookup,
    admission_answer,
    admission_step,
)
from umbp.core.lookup.admission import announced_reach, awaits_announced, awaits_prefetch
from umbp.core.lookup.query import LookupQuery
from umbp.core.lookup.windows import LoadSpec
from umbp.core.request_params import request_params
from umbp.core.requests import after_allocation
from umbp.runtime.contract import HashLookup, Medium, PrefetchesOnLookup, SchedulerStore
from umbp.shell import vllm_compat
from umbp.shell.hybrid_lookup import HybridLookup
from umbp.shell.lookup_errors import log_failed_lookup
from umbp.shell.request_state import PendingLookup, RequestState
from umbp.shell.vllm_compat.objects import BlockPoolLike, KVCacheBlocksLike, RequestLike

__all__ = ["PREFETCH_STALL_S", "Admission", "AdmissionCounters"]

logger = logging.getLogger("umbp")

Answers = TypeVar("Answers")

PREFETCH_STALL_S = 0.5
"""A request whose load is synchronous waits for the hits the store brings in from its
disk tier (`PrefetchesOnLookup`) while they keep arriving: once none has for this long
(the store's prefetch bound left them out, or its disk is slow), the load reads what is
left from disk."""
PREFETCH_POLL_S = 0.005
"""While it waits, a request asks where its hits are at most this often: vLLM's steps come
back to back when nothing else runs, and each ask takes the server's lock from the
thread that brings the objects in."""


class AdmissionCounters(Protocol):
    lookups: int
    lookup_failures: int
    hit_tokens: int
    queried_tokens: int
    planned_load_blocks: int
    announced_waits: int
    announced_wait_seconds: float
    announced_short: int
    prefetch_waits: int
    prefetch_wait_seconds: float


class Admission:
    """The model's lookup rules (geometry, the coordinator of a multi-group model,
    whether loads may run asynchronously) and one method per admission hook."""

    def __init__(
        self, config: ConnectorConfig, kv_cache_config: Any, geometry: CacheGeometry,
        hybrid: HybridLookup | None, executor: Executor, counters: AdmissionCounters,
    ) -> None:
        self._requested_load_async = config.load_async
        self._layer_kinds = vllm_compat.layer_kinds(kv_cache_config)
        # Until the workers say how they copy (bind_load_mode), loads would be
        # asynchronous; nothing is looked up before then.
        self._rules = LookupRules(geometry, config.enable_lookup, config.lookup_async, True)
        self._announced_wait_s = config.announced_wait_s
        self._hybrid = hybrid
        self._executor = executor
        self._counters = counters
        self._gpu_block_pool: BlockPoolLike | None = None
        # Whether the bound store answers by hash, or prefetches from a disk tier, found
        # once per store object (an isinstance check of a Protocol costs microseconds).
        self._probed_store: SchedulerStore | None = None
        self._by_hash = False
        self._prefetching: PrefetchesOnLookup | None = None

    def bind_gpu_block_pool(self, pool: BlockPoolLike) -> None:
        self._gpu_block_pool = pool

    def bind_load_mode(self, layer_by_layer: bool) -> None:
        """The workers' answer to :func:`umbp.core.config.restores_layer_by_layer`
        (they know their object sizes and where the KV lives) settles whether loads
        run asynchronously."""
        load_async, warning = effective_load_async(
            self._requested_load_async, layer_by_layer, *self._layer_kinds
        )
        if warning is not None:
            logger.warning("umbp: %s", warning)
        if self._requested_load_async is None:
            logger.info("umbp restores %s (load_async unset; set it to choose)", (
                "while the request waits, off the model step" if load_async else
                "layer by layer in the step that computes the rest of the prompt, copying "
                "from the store's pages (the embedded pool's, or umbp serve's shared memory) into "
                "the KV cache in host memory"
            ))
        self._rules = replace(self._rules, load_async=load_async)

    def matched_tokens(
        self, store: SchedulerStore, keyspace: KeySpace, request: RequestLike,
        local_tokens: int, state: RequestState,
    ) -> tuple[int | None, bool, RequestState]:
        """vLLM's answer (tokens umbp will load, None while a lookup runs; whether
        the load runs asynchronously) and the request's next state."""
        if store is not self._probed_store:
            self._probed_store, self._by_hash = store, isinstance(store, HashLookup)
            self._prefetching = store if isinstance(store, PrefetchesOnLookup) else None
        pending = state.lookup
        running = None if pending is None else RunningLookup(
            pending.query, pending.request is request, pending.answer.done()
        )
        step = admission_step(
            self._rules, keyspace, self._by_hash, request.block_hashes, request.num_tokens,
            local_tokens, state.life, state.lookups, running,
        )
        if step.drop_running:
            state = state.without_lookup()
        state = state.with_lookups(step.lookups)
        match step.action:
            case LookupAction.ANSWER_NOTHING:
                return 0, False, state.with_life(step.life)
            case LookupAction.WAIT:
                return None, False, state
            case LookupAction.READ_ANSWER:
                assert pending is not None and step.query is not None
                answers = self._answer_of(pending.answer)
                matched = self._matched(replace(state, lookup=None), step.query, answers)
                return self._announced(request, local_tokens, *matched)
        assert step.query is not None
        if self._prefetching is not None and step.keys is not None:
            return self._warmed(request, local_tokens, step.query, step.keys, state,
                                step.action is LookupAction.SUBMIT)
        ask = self._asking(store, step.query, step.keys)
        if step.action is LookupAction.SUBMIT:
            answer = self._executor.submit(ask)
            return None, False, replace(state, lookup=PendingLookup(request, step.query, answer))
        matched = self._matched(state, step.query, self._lookup(ask))
        return self._announced(request, local_tokens, *matched)

    def _warmed(
        self, request: RequestLike, local_tokens: int, query: LookupQuery, keys: Any,
        state: RequestState, submit: bool,
    ) -> tuple[int | None, bool, RequestState]:
        """A lookup of a store that prefetches from its disk tier (`umbp serve`'s SSD): the
        first ask starts bringing the hits on disk into memory; a synchronous load of
        such hits waits, asked again each step with `where` (nothing counted or started
        again), until they are in memory or stop arriving (`PREFETCH_STALL_S`), so that
        it never reads the disk inside the engine step."""
        store = self._prefetching
        assert store is not None
        warming = state.warming
        waiting = warming is not None
        if warming is not None and time.monotonic() - warming[3] < PREFETCH_POLL_S:
            return None, False, state
        ask = (partial(store.where, keys) if waiting
               else partial(store.lookup_where, keys, request.request_id))
        if submit:  # the lookup threads' answer comes as residency: no wait
            answer = self._executor.submit(lambda: tuple([m is not None for m in ask()]))
            return None, False, replace(state, lookup=PendingLookup(request, query, answer),
                                        prefetching=True)
        media = self._lookup(ask)
        on_disk = 0 if media is None else media.count(Medium.DISK)
        tokens, load_async, state = self._matched(
            state, query, None if media is None else tuple([m is not None for m in media]))
        now = time.monotonic()
        started, arrived, before = (now, now, on_disk) if warming is None else warming[:3]
        if on_disk < before:
            arrived = now
        state = replace(state, prefetching=state.prefetching or on_disk > 0)
        if awaits_prefetch(tokens, load_async, on_disk, now - arrived, PREFETCH_STALL_S):
            if not waiting:
                self._counters.prefetch_waits += 1
            return None, False, replace(state, warming=(started, arrived, on_disk, now))
        if waiting:
            self._counters.prefetch_wait_seconds += now - started
        return self._announced(request, local_tokens, tokens, load_async,
                               replace(state, warming=None))


    def _announced(
        self, request: RequestLike, local_tokens: int, tokens: int, load_async: bool,
        state: RequestState,
    ) -> tuple[int | None, bool, RequestState]:
        """A request whose prefill engine announced its blocks (disaggregated
        prefill) waits, asked again each step, until the pool holds them or
        ``announced_wait_s`` passed: the producer's stores may still be in flight."""
        params = request_params(request.kv_transfer_params)
        if isinstance(params, Failure):
            logger.warning("umbp: request %s: %s; served as if it asked nothing",
                           request.request_id, params.failure())
            return tokens, load_async, state
        announced = params.unwrap().announced_tokens
        if announced is None:
            return tokens, load_async, state
        reach = announced_reach(self._rules.geometry, announced, request.num_tokens)
        now = time.monotonic()
        since = now if state.awaiting_since is None else state.awaiting_since
        if awaits_announced(local_tokens + tokens, reach, now - since, self._announced_wait_s):
            if state.awaiting_since is None:
                self._counters.announced_waits += 1
            return None, False, replace(state, awaiting_since=since)
        self._counters.announced_wait_seconds += now - since
        if local_tokens + tokens < reach:
            self._counters.announced_short += 1
            logger.warning(
                "umbp: request %s: its prefill engine announced %d tokens; after %.1f s the "
                "pool holds %d of the %d reachable, vLLM computes the rest",
                request.request_id, announced, now - since, local_tokens + tokens, reach,
            )
        return tokens, load_async, replace(state, awaiting_since=None)

    def allocated(
        self, request: RequestLike, blocks: KVCacheBlocksLike, num_external_tokens: int,
        state: RequestState,
    ) -> RequestState:
        """The request's state once vLLM has allocated its blocks: the load planned
        for the external tokens vLLM allocated (it may allocate fewer than umbp
        matched; what cannot be planned is recomputed)."""
        geometry = self._rules.geometry
        life, outcome = after_allocation(
            state.life, request.request_id, geometry,
            block_table_of(blocks.get_block_ids(), geometry.group_ids),
            tuple(request.block_hashes), num_external_tokens,
        )
        match outcome:
            case Success(plan):
                self._counters.planned_load_blocks += len(plan)
            case Failure(unplanned):
                logger.warning("umbp load plan: %s; vLLM recomputes those tokens",
                               unplanned.reason)
        return replace(state, request=request, life=life)

    def _asking(
        self, store: SchedulerStore, query: LookupQuery, keys: Any
    ) -> Callable[[], tuple[bool, ...]]:
        """The store call that answers ``query``: by hash where the store answers
        so (no key string built), else with the key strings core built."""
        if keys is None:
            return partial(cast(HashLookup, store).lookup_hashes, query.runs)
        return partial(store.lookup, keys)

    def _lookup(self, ask: Callable[[], Answers]) -> Answers | None:
        try:
            return ask()
        except Exception as error:  # noqa: BLE001 (see umbp.shell.lookup_errors)
            self._lookup_failed(error)
            return None

    def _answer_of(self, answer: Future[tuple[bool, ...]]) -> tuple[bool, ...] | None:
        try:
            return answer.result()
        except Exception as error:  # noqa: BLE001 (CancelledError too: shut down meanwhile)
            self._lookup_failed(error)
            return None

    def _lookup_failed(self, error: Exception) -> None:
        """A lookup that failed counts as a miss (docs/failure-behaviour.md)."""
        self._counters.lookup_failures += 1
        log_failed_lookup("lookup", error)

    def _matched(
        self, state: RequestState, query: LookupQuery, answers: tuple[bool, ...] | None,
    ) -> tuple[int, bool, RequestState]:
        """Core's answer for the pool's answers (a failed lookup is a miss)."""
        self._counters.lookups += 1
        self._counters.queried_tokens += query.num_tokens - query.local_tokens
        answer: AdmissionAnswer = admission_answer(
            self._rules, query, answers, state.life,
            None if self._hybrid is None else self._coordinated_window,
        )
        self._counters.hit_tokens += answer.tokens
        return answer.tokens, answer.load_async, state.with_life(answer.life)

    def _coordinated_window(
        self, query: LookupQuery, folded: tuple[tuple[bool, ...], ...]
    ) -> LoadSpec | None:
        assert self._hybrid is not None
        try:
            return self._hybrid.window(query, folded, query.request_hashes, self._has_local_block)
        # vLLM's coordinator is vLLM's code and may raise anything (its asserts, a
        # KeyError on a shape it did not expect): umbp must never be the reason a
        # request fails, so any refusal is a miss (docs/failure-behaviour.md).
        except Exception as error:  # noqa: BLE001
            self._counters.lookup_failures += 1
            logger.warning("umbp hybrid hit window failed, counted as a miss: %s", error)
            return None

    def _has_local_block(self, group_id: int, block_hash: bytes) -> bool:
        pool = self._gpu_block_pool
        return pool is not None and pool.get_cached_block(block_hash, [group_id]) is not None
