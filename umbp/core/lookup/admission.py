"""Admission in the scheduler role, in two calls around the pool's answer:
:func:`admission_step` (what ``get_num_new_matched_tokens`` does next for a request:
answer nothing, wait for a running lookup, read its answer, or ask the pool now or
on the lookup threads, with the query to ask) and :func:`admission_answer` (the hit
window the pool's answer gives, and the request's state after it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace
from umbp.core.lookup.guards import LookupSkip, lookup_skip_reason
from umbp.core.lookup.query import (
    LookupMemo,
    LookupQuery,
    request_lookup_keys,
    request_lookup_query,
)
from umbp.core.lookup.windows import (
    LoadSpec,
    fold_rank_hits,
    load_runs_async,
    single_group_load_spec,
)
from umbp.core.rank_keys import RankedKeys

if TYPE_CHECKING:  # core.requests imports the lookup's windows
    from umbp.core.requests import RequestLifecycle

__all__ = [
    "AdmissionAnswer",
    "AdmissionStep",
    "LookupAction",
    "LookupProgress",
    "LookupRules",
    "RunningLookup",
    "admission_answer",
    "admission_step",
    "after_lookup_skip",
    "after_match",
    "announced_reach",
    "awaits_announced",
    "awaits_prefetch",
    "lookup_still_current",
    "next_lookup_action",
]


class LookupProgress(enum.Enum):
    """Where an asynchronous lookup of the request stands."""

    NONE = "no lookup running"
    RUNNING = "lookup running"
    ANSWERED = "lookup answered"


class LookupAction(enum.Enum):
    """What ``get_num_new_matched_tokens`` does next."""

    ANSWER_NOTHING = "answer 0 tokens and forget an earlier load spec"
    WAIT = "answer 'not yet': vLLM asks again next step"
    SUBMIT = "start an asynchronous lookup and answer 'not yet'"
    LOOKUP_NOW = "look up on the scheduler thread"
    READ_ANSWER = "read the finished asynchronous lookup"


def lookup_still_current(
    same_request: bool,
    query: LookupQuery,
    local_tokens: int,
    num_tokens: int,
    hashes: Sequence[bytes],
) -> bool:
    """Whether a running lookup still answers for the request vLLM asks about: the
    same request object (an id can be reused) in the same state (local tokens,
    length, hashes). A stale one is cancelled before anything else is decided."""
    return same_request and query.describes(local_tokens, num_tokens, hashes)


def next_lookup_action(
    skip: LookupSkip | None, progress: LookupProgress, lookup_async: bool
) -> LookupAction:
    """A skip reason (:func:`umbp.core.lookup.guards.lookup_skip_reason`) wins over a
    running lookup (its answer would be for tokens vLLM no longer asks about); a
    running lookup is waited for; otherwise a new lookup runs, off the scheduler
    thread when ``lookup_async``."""
    if skip is not None:
        return LookupAction.ANSWER_NOTHING
    if progress is LookupProgress.RUNNING:
        return LookupAction.WAIT
    if progress is LookupProgress.ANSWERED:
        return LookupAction.READ_ANSWER
    return LookupAction.SUBMIT if lookup_async else LookupAction.LOOKUP_NOW


def after_lookup_skip(state: RequestLifecycle) -> RequestLifecycle:
    """On every skip the earlier load spec is forgotten: the answer is 0 tokens, so
    it no longer describes what vLLM allocates (see ``lookup_skip_reason``)."""
    return replace(state, load_spec=None)


def after_match(state: RequestLifecycle, spec: LoadSpec, load_async: bool) -> RequestLifecycle:
    """umbp answered ``spec``: it is what the allocation plans from."""
    return replace(state, load_spec=spec, load_async=load_async)



# ------------------------------------------------------------- the entry points


@dataclass(frozen=True, slots=True)
class LookupRules:
    """An engine's fixed lookup facts: its geometry, whether lookups run at all
    (the user's switch), whether they run on the lookup threads, and whether loads
    may run asynchronously (:func:`umbp.core.config.effective_load_async`)."""

    geometry: CacheGeometry
    enabled: bool
    lookup_async: bool
    load_async: bool


@dataclass(frozen=True, slots=True)
class RunningLookup:
    """A lookup running off the scheduler thread, as core sees it: its query,
    whether it was built for the very request object vLLM asks about (an id can be
    reused), and whether its answer is in."""

    query: LookupQuery
    same_request: bool
    answered: bool


@dataclass(frozen=True, slots=True)
class AdmissionStep:
    """What ``get_num_new_matched_tokens`` does now (:class:`LookupAction`).

    ``drop_running``: the running lookup answers for a request state vLLM no longer
    asks about (cancel it first). ``life``: the request's state (a skip forgets
    its spec). For ``SUBMIT`` and ``LOOKUP_NOW``, ``query`` is what to ask and
    ``keys`` its key strings for a store asked by string (None: ask by hash,
    ``query.runs``); ``lookups`` is the request's memo to keep."""

    action: LookupAction
    drop_running: bool
    life: RequestLifecycle
    lookups: LookupMemo
    query: LookupQuery | None = None
    keys: RankedKeys | None = None


def admission_step(
    rules: LookupRules,
    keyspace: KeySpace,
    by_hash: bool,
    hashes: Sequence[bytes],
    num_tokens: int,
    local_tokens: int,
    life: RequestLifecycle,
    lookups: LookupMemo,
    running: RunningLookup | None,
) -> AdmissionStep:
    """The first half of an admission: drop a stale running lookup
    (:func:`lookup_still_current`), then the reference's guards in order
    (:func:`~umbp.core.lookup.guards.lookup_skip_reason`), then wait for, read or
    start a lookup (:func:`next_lookup_action`). A new lookup's query comes from
    the request's memo while it still describes the request; its key strings are
    built (once per request) only for a store that does not answer by hash."""
    drop = running is not None and not lookup_still_current(
        running.same_request, running.query, local_tokens, num_tokens, hashes
    )
    if drop:
        running = None
    skip = lookup_skip_reason(rules.geometry, rules.enabled, len(hashes), num_tokens, local_tokens)
    progress = (
        LookupProgress.NONE if running is None
        else LookupProgress.ANSWERED if running.answered else LookupProgress.RUNNING
    )
    action = next_lookup_action(skip, progress, rules.lookup_async)
    if action is LookupAction.ANSWER_NOTHING:
        return AdmissionStep(action, drop, after_lookup_skip(life), lookups)
    if action is not LookupAction.SUBMIT and action is not LookupAction.LOOKUP_NOW:
        return AdmissionStep(action, drop, life, lookups, running.query if running else None)
    query, lookups = request_lookup_query(
        rules.geometry, keyspace, hashes, local_tokens, num_tokens, lookups
    )
    keys = None
    if not by_hash:
        keys, lookups = request_lookup_keys(rules.geometry, keyspace, query, lookups)
    return AdmissionStep(action, drop, life, lookups, query, keys)


@dataclass(frozen=True, slots=True)
class AdmissionAnswer:
    """vLLM's answer (tokens umbp loads, whether asynchronously), the hit window
    behind it (None: a miss) and the request's state after it (a miss keeps the
    earlier spec, as vLLM keeps its earlier answer)."""

    tokens: int
    load_async: bool
    spec: LoadSpec | None
    life: RequestLifecycle


HitWindow = Callable[[LookupQuery, tuple[tuple[bool, ...], ...]], LoadSpec | None]
"""The hit window of a query given every group's folded hits: core's own for one
plain full-attention group, vLLM's coordinator (through the shell) otherwise."""


def admission_answer(
    rules: LookupRules,
    query: LookupQuery,
    answers: Sequence[bool] | None,
    life: RequestLifecycle,
    coordinator: HitWindow | None = None,
) -> AdmissionAnswer:
    """The second half: the pool's answers (None: the lookup failed, a miss) folded
    over ranks (:func:`~umbp.core.lookup.windows.fold_rank_hits`: an object hits
    only if every rank holds it), the hit window (never the last prompt token;
    ``coordinator`` decides it for a coordinated geometry), and whether the load
    runs asynchronously."""
    folded = None if answers is None else fold_rank_hits(query, answers)
    spec = None
    if folded is not None:
        spec = (
            single_group_load_spec(rules.geometry, query, folded) if coordinator is None
            else coordinator(query, folded)
        )
    if spec is None:
        return AdmissionAnswer(0, False, None, life)
    load_async = load_runs_async(rules.load_async, spec, rules.geometry)
    return AdmissionAnswer(
        spec.num_tokens_to_load, load_async, spec, after_match(life, spec, load_async)
    )


# --------------------------------------------- disaggregated prefill (announced)


def announced_reach(geometry: CacheGeometry, announced_tokens: int, num_tokens: int) -> int:
    """How far a hit can reach for a request whose prefill engine announced
    ``announced_tokens``: those tokens, but never the last prompt token's block
    (vLLM computes at least one token), and one block less with EAGLE."""
    block = geometry.block_size
    reach = min(announced_tokens, (num_tokens - 1) // block * block)
    return max(0, reach - block) if geometry.use_eagle else reach


def awaits_prefetch(
    tokens: int, load_async: bool, hits_on_disk: int, stalled_s: float, bound_s: float
) -> bool:
    """Whether to ask again next step rather than answer now: a synchronous load (read
    inside the engine step that computes the rest) of hits of which ``hits_on_disk`` are
    still on the store's disk tier, on their way into memory, the last of them having
    arrived less than ``bound_s`` ago (``stalled_s``; objects the store does not bring in
    must not hold the request). An asynchronous load reads off the step and never waits."""
    return tokens > 0 and not load_async and hits_on_disk > 0 and stalled_s < bound_s


def awaits_announced(reached: int, reach: int, waited_s: float, bound_s: float) -> bool:
    """Whether to ask again next step rather than answer now: the pool does not
    yet hold every block the prefill engine announced (its stores are still in
    flight) and the request has waited less than ``bound_s``. ``reached``: local
    plus matched tokens."""
    return reached < reach and waited_s < bound_s
