"""Admission: what a waiting request loads from the pool.

vLLM asks ``get_num_new_matched_tokens`` for a waiting request (again on later
steps while it waits), then says what it allocated. Each is read -> core -> apply:
core picks the lookup's next action (:func:`umbp.core.request_lifecycle.next_lookup_action`:
answer nothing, look up now, submit to the lookup threads, wait, read the answer),
the hit window (core's for one full-attention group, vLLM's own coordinator through
:class:`~umbp.shell.hybrid_lookup.HybridLookup` otherwise) and the load planned for
what vLLM allocated. A store that answers by hash (``HashLookup``: the embedded pool)
is asked the query's prefixes and raw hashes; any other gets the key strings, built
through the request's memo. It keeps no per-request state: each call takes the request's
:class:`~umbp.shell.request_state.RequestState` and returns the next one, which the
scheduler keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import replace
from functools import partial
from typing import Any, Protocol, cast

from returns.result import Failure, Success

from umbp.core import lookup as core_lookup
from umbp.core import request_lifecycle as lifecycle
from umbp.core.config import ConnectorConfig, effective_load_async
from umbp.core.identity import KeySpace
from umbp.core.lookup import LoadSpec, LookupGeometry, LookupQuery, block_table_of
from umbp.core.request_lifecycle import LookupAction
from umbp.runtime.contract import HashLookup, SchedulerStore
from umbp.shell import vllm_compat
from umbp.shell.hybrid_lookup import HybridLookup
from umbp.shell.lookup_errors import log_failed_lookup
from umbp.shell.request_state import PendingLookup, RequestState
from umbp.shell.vllm_compat.objects import BlockPoolLike, KVCacheBlocksLike, RequestLike

__all__ = ["Admission", "AdmissionCounters"]

logger = logging.getLogger("umbp")

class AdmissionCounters(Protocol):
    lookups: int
    lookup_failures: int
    hit_tokens: int
    queried_tokens: int
    planned_load_blocks: int


class Admission:
    """The model's lookup facts (geometry, the coordinator of a multi-group model,
    whether loads may run asynchronously) and one method per admission hook."""

    def __init__(
        self, config: ConnectorConfig, kv_cache_config: Any, geometry: LookupGeometry,
        hybrid: HybridLookup | None, executor: Executor, counters: AdmissionCounters,
    ) -> None:
        self._config = config
        self._geometry = geometry
        self._hybrid = hybrid
        self._window: Callable[[LookupQuery, Any], LoadSpec | None] = (
            self._single_group_window if hybrid is None else self._coordinated_window
        )
        self._load_async, warning = effective_load_async(
            config.load_async, *vllm_compat.layer_kinds(kv_cache_config)
        )
        if warning is not None:
            logger.warning("umbp: %s", warning)
        self._executor = executor
        self._counters = counters
        self._gpu_block_pool: BlockPoolLike | None = None
        # Whether the bound store answers by hash, found once per store object (an
        # isinstance check of a Protocol costs microseconds on every admission).
        self._probed_store: SchedulerStore | None = None
        self._by_hash = False

    def bind_gpu_block_pool(self, pool: BlockPoolLike) -> None:
        self._gpu_block_pool = pool

    def matched_tokens(
        self, store: SchedulerStore, keyspace: KeySpace, request: RequestLike,
        local_tokens: int, state: RequestState,
    ) -> tuple[int | None, bool, RequestState]:
        """vLLM's answer (tokens umbp will load, None while a lookup runs; whether
        the load runs asynchronously) and the request's next state."""
        hashes, num_tokens = request.block_hashes, request.num_tokens
        pending = state.lookup
        if pending is not None and not lifecycle.lookup_still_current(
            pending.request is request, pending.query, local_tokens, num_tokens, hashes
        ):
            state = state.without_lookup()
        skip = core_lookup.lookup_skip_reason(
            self._geometry, self._config.enable_lookup, len(hashes), num_tokens, local_tokens
        )
        match lifecycle.next_lookup_action(skip, state.lookup_progress, self._config.lookup_async):
            case LookupAction.ANSWER_NOTHING:
                return 0, False, state.with_life(lifecycle.after_lookup_skip(state.life))
            case LookupAction.WAIT:
                return None, False, state
            case LookupAction.SUBMIT:
                query, state = self._query(keyspace, request, local_tokens, state)
                ask, state = self._asking(store, keyspace, query, state)
                answer = self._executor.submit(ask)
                return None, False, replace(state, lookup=PendingLookup(request, query, answer))
            case LookupAction.LOOKUP_NOW:
                query, state = self._query(keyspace, request, local_tokens, state)
                ask, state = self._asking(store, keyspace, query, state)
                return self._match(state, query, self._lookup(ask))
            case LookupAction.READ_ANSWER:
                assert pending is not None
                answers = self._answer_of(pending.answer)
                return self._match(replace(state, lookup=None), pending.query, answers)

    def allocated(
        self, request: RequestLike, blocks: KVCacheBlocksLike, num_external_tokens: int,
        state: RequestState,
    ) -> RequestState:
        """The request's state once vLLM has allocated its blocks: the load planned
        for the external tokens vLLM allocated (it may allocate fewer than umbp
        matched; what cannot be planned is recomputed)."""
        request_id = request.request_id
        life, outcome = lifecycle.after_allocation(
            state.life, request_id, self._geometry,
            block_table_of(blocks.get_block_ids(), self._geometry.group_ids),
            tuple(request.block_hashes), num_external_tokens,
        )
        match outcome:
            case Success(batch):
                self._counters.planned_load_blocks += len(batch.block_ids)
            case Failure(unplanned):
                logger.warning("umbp load plan: %s; vLLM recomputes those tokens",
                               unplanned.reason)
        return replace(state, request=request, life=life)

    def _query(
        self, keyspace: KeySpace, request: RequestLike, local_tokens: int, state: RequestState
    ) -> tuple[LookupQuery, RequestState]:
        """The lookup query, from the request's memo where it has it or its keys
        (vLLM asks again for a waiting request on later steps)."""
        query, lookups = core_lookup.request_lookup_query(
            self._geometry, keyspace, request.block_hashes, local_tokens, request.num_tokens,
            state.lookups,
        )
        return query, state.with_lookups(lookups)

    def _asking(
        self, store: SchedulerStore, keyspace: KeySpace, query: LookupQuery, state: RequestState
    ) -> tuple[Callable[[], tuple[bool, ...]], RequestState]:
        """The store call that answers ``query``: by hash where the store answers so
        (no key string built), else with the key strings from the request's memo."""
        if store is not self._probed_store:
            self._probed_store, self._by_hash = store, isinstance(store, HashLookup)
        if self._by_hash:
            return partial(cast(HashLookup, store).lookup_hashes, query.runs), state
        keys, lookups = core_lookup.request_lookup_keys(
            self._geometry, keyspace, query, state.lookups
        )
        return partial(store.lookup, keys), state.with_lookups(lookups)

    def _lookup(self, ask: Callable[[], tuple[bool, ...]]) -> tuple[bool, ...] | None:
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

    def _match(
        self, state: RequestState, query: LookupQuery, answers: tuple[bool, ...] | None,
    ) -> tuple[int, bool, RequestState]:
        """The hit window for the pool's answers (a failed lookup is a miss); a
        miss keeps the state's earlier spec, as vLLM keeps its earlier answer."""
        self._counters.lookups += 1
        self._counters.queried_tokens += query.num_tokens - query.local_tokens
        folded = None if answers is None else core_lookup.fold_rank_hits(query, answers)
        spec = None if folded is None else self._window(query, folded)
        if spec is None:
            return 0, False, state
        load_async = core_lookup.load_runs_async(self._load_async, spec, self._geometry)
        self._counters.hit_tokens += spec.num_tokens_to_load
        return (
            spec.num_tokens_to_load, load_async,
            state.with_life(lifecycle.after_match(state.life, spec, load_async)),
        )

    def _single_group_window(self, query: LookupQuery, folded: Any) -> LoadSpec | None:
        return core_lookup.single_group_load_spec(self._geometry, query, folded)

    def _coordinated_window(self, query: LookupQuery, folded: Any) -> LoadSpec | None:
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
