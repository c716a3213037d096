"""What a worker's loads did: which blocks reached the KV cache, which failed and
why, and how vLLM is told to recompute them.

The worker reads each group of a :class:`~umbp.core.plans.LoadPlan` from the store
into that group's staging rows, hands the per-object statuses here, and applies the
answer: it scatters the rows this module says loaded intact, counts the failures
by kind, and reports the rest to vLLM in the one form vLLM accepts for the model
(:func:`failure_reporting`). Every block a load plan names ends up in exactly one
of "loaded" or "failed"; nothing outside the plan is ever reported.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from umbp.core.plans import GroupBlocks, LoadPlan

__all__ = [
    "LOAD_FAILURES",
    "FailureReporting",
    "GroupLoadOutcome",
    "LoadReport",
    "LoadStatus",
    "RequestLoadOutcome",
    "failure_reporting",
    "failure_unreportable",
    "group_load_outcome",
    "merged_groups",
    "plan_load_outcome",
    "report_load",
    "split_statuses",
    "unplanned_load_outcome",
]


class LoadStatus(enum.Enum):
    """Outcome of loading one key into a caller-provided buffer (the store
    contract's answer, ``umbp.runtime.contract`` re-exports it). The values name
    the failure kinds in counters and metrics."""

    HIT = "hit"
    """The buffer now holds exactly the bytes stored under the key."""
    MISSING = "missing"
    """The key is not resident; the buffer is untouched."""
    CORRUPT = "corrupt"
    """The stored bytes failed their checksum; the object was dropped. The buffer holds
    garbage and must not be used."""
    SIZE_MISMATCH = "size_mismatch"
    """The buffer's length differs from the stored object's; nothing was copied."""
    UNAVAILABLE = "unavailable"
    """The back-end (or the part of it holding this key) cannot be reached, or the
    worker has nowhere to copy it (its KV memory is released in sleep mode)."""


LOAD_FAILURES: tuple[LoadStatus, ...] = tuple(s for s in LoadStatus if s is not LoadStatus.HIT)
"""Every failure kind, in declaration order (what metrics label failures by)."""


class FailureReporting(enum.Enum):
    """The one way vLLM accepts failed loads for a model."""

    BLOCK_IDS = "block_ids"
    """``get_block_ids_with_load_errors``: vLLM cuts the request's computed tokens
    at its first failed block and recomputes from there (sync and async loads)."""
    REQUEST_IDS = "request_ids"
    """``KVConnectorTransferResults.failed_recving``: vLLM recomputes the whole
    request. vLLM acts on it only for a request waiting for an asynchronous load."""


def failure_reporting(num_cache_groups: int) -> FailureReporting:
    """Block ids are unique only within a cache group, so with several groups vLLM
    refuses block-level failures (its scheduler raises) and takes request-level
    ones; with one group, block-level failures keep the loaded prefix."""
    return FailureReporting.BLOCK_IDS if num_cache_groups <= 1 else FailureReporting.REQUEST_IDS


@dataclass(frozen=True, slots=True)
class GroupLoadOutcome:
    """One cache group's part of a load. ``loaded_rows`` index the group's staging
    rows (the order its keys were read in) and align with ``loaded_block_ids``;
    ``failures`` aligns with ``failed_block_ids``."""

    group_id: int
    loaded_rows: tuple[int, ...]
    loaded_block_ids: tuple[int, ...]
    failed_block_ids: tuple[int, ...]
    failures: tuple[LoadStatus, ...]
    problem: str | None = None
    """Set when the store broke its contract (a status count other than the key
    count): every block of the group is then failed, never guessed."""

    @property
    def all_loaded(self) -> bool:
        return not self.failed_block_ids


def group_load_outcome(
    group_id: int, block_ids: Sequence[int], statuses: Sequence[LoadStatus] | None
) -> GroupLoadOutcome:
    """Partition one group's read: a block whose object loaded intact (`HIT`) is
    loaded, every other is failed with its status. ``statuses`` None means the
    group could not be read at all (no store, or no KV memory to copy into):
    every block fails as `UNAVAILABLE`. Only intact rows may reach the KV cache: a
    corrupt row's staging bytes are garbage."""
    problem = None
    if statuses is not None and len(statuses) != len(block_ids):
        problem = (
            f"the store answered {len(statuses)} statuses for {len(block_ids)} keys "
            f"of cache group {group_id}; every block of the group counts as failed"
        )
        statuses = None
    if statuses is None:
        statuses = (LoadStatus.UNAVAILABLE,) * len(block_ids)
    loaded = [row for row, status in enumerate(statuses) if status is LoadStatus.HIT]
    failed = [row for row, status in enumerate(statuses) if status is not LoadStatus.HIT]
    return GroupLoadOutcome(
        group_id=group_id,
        loaded_rows=tuple(loaded),
        loaded_block_ids=tuple(block_ids[row] for row in loaded),
        failed_block_ids=tuple(block_ids[row] for row in failed),
        failures=tuple(statuses[row] for row in failed),
        problem=problem,
    )


@dataclass(frozen=True, slots=True)
class RequestLoadOutcome:
    """What one request's load did, this step."""

    request_id: str
    is_async: bool
    groups: tuple[GroupLoadOutcome, ...] = ()
    unplanned_block_ids: tuple[int, ...] = ()
    """Blocks the scheduler could not plan a load for: failed without a read."""

    @property
    def planned_blocks(self) -> int:
        return len(self.unplanned_block_ids) + sum(
            len(g.loaded_block_ids) + len(g.failed_block_ids) for g in self.groups
        )

    @property
    def failed_block_ids(self) -> frozenset[int]:
        return frozenset(self.unplanned_block_ids).union(
            *(g.failed_block_ids for g in self.groups)
        )

    @property
    def failures(self) -> tuple[LoadStatus, ...]:
        """The kind of every failed read (unplanned blocks were not read)."""
        return tuple(status for g in self.groups for status in g.failures)

    @property
    def failed(self) -> bool:
        """The request-level rule: a request failed iff any of its blocks did."""
        return bool(self.unplanned_block_ids) or not all(g.all_loaded for g in self.groups)


def plan_load_outcome(
    plan: LoadPlan,
    statuses: Sequence[Sequence[LoadStatus] | None],
    is_async: bool,
) -> RequestLoadOutcome:
    """The outcome of a load plan from what each of its groups' reads answered
    (``statuses`` aligned with ``plan.groups``, each in its group's block order;
    None, or a group past the end, was not read and fails whole)."""
    groups = tuple(
        group_load_outcome(
            group.group_id, group.block_ids,
            statuses[index] if index < len(statuses) else None,
        )
        for index, group in enumerate(plan.groups)
    )
    return RequestLoadOutcome(plan.request_id, is_async, groups)


def merged_groups(plans: Sequence[LoadPlan]) -> tuple[GroupBlocks, ...]:
    """Every plan's blocks of each cache group as one group (plans in order, groups
    in first-seen order): a step's loads read with one call and one staging buffer
    per group. :func:`split_statuses` gives each plan its share of the answers."""
    merged: dict[int, list[GroupBlocks]] = {}
    for plan in plans:
        for group in plan.groups:
            merged.setdefault(group.group_id, []).append(group)
    return tuple(
        GroupBlocks(
            group_id, parts[0].block_size,
            tuple(b for part in parts for b in part.block_ids),
            tuple(h for part in parts for h in part.block_hashes),
        )
        for group_id, parts in merged.items()
    )


def split_statuses(
    plans: Sequence[LoadPlan], merged: Mapping[int, Sequence[LoadStatus] | None]
) -> tuple[tuple[Sequence[LoadStatus] | None, ...], ...]:
    """Each plan's share of the :func:`merged_groups` reads' statuses (``merged``:
    per group id), one entry per group of the plan, as :func:`plan_load_outcome`
    takes them. A group that was not read, or whose answer has another length than
    its merged keys (a store breaking its contract), is None for every plan: each
    fails it whole, nothing is guessed."""
    totals: dict[int, int] = {}
    for plan in plans:
        for group in plan.groups:
            totals[group.group_id] = totals.get(group.group_id, 0) + len(group)
    offsets: dict[int, int] = {}
    shares: list[tuple[Sequence[LoadStatus] | None, ...]] = []
    for plan in plans:
        plan_shares: list[Sequence[LoadStatus] | None] = []
        for group in plan.groups:
            start = offsets.get(group.group_id, 0)
            offsets[group.group_id] = start + len(group)
            answer = merged.get(group.group_id)
            if answer is None or len(answer) != totals[group.group_id]:
                plan_shares.append(None)
            else:
                plan_shares.append(answer[start : start + len(group)])
        shares.append(tuple(plan_shares))
    return tuple(shares)


def unplanned_load_outcome(
    request_id: str, block_ids: Sequence[int], is_async: bool
) -> RequestLoadOutcome:
    """A load the scheduler could not plan: every block vLLM allocated for it fails."""
    return RequestLoadOutcome(request_id, is_async, unplanned_block_ids=tuple(block_ids))


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What vLLM has not been told yet about past loads.

    An asynchronous load's failed blocks are told in the step vLLM hears the load
    finished, never before: vLLM takes the transfer results, then the failed
    block ids, and an asynchronous load may end between the two calls."""

    finished_requests: frozenset[str] = frozenset()
    """Asynchronous loads that ended, failed or not: vLLM waits for each."""
    failed_requests: frozenset[str] = frozenset()
    """Request-level failures (`FailureReporting.REQUEST_IDS` only)."""
    failed_block_ids: frozenset[int] = frozenset()
    """Block-level failures (`FailureReporting.BLOCK_IDS` only) to report now."""
    finishing_block_ids: Mapping[str, frozenset[int]] = field(default_factory=dict)
    """Block-level failures of asynchronous loads in ``finished_requests``: they
    join ``failed_block_ids`` once vLLM took the finished requests."""

    def without_requests(self) -> LoadReport:
        """After vLLM took the transfer results: their failed blocks are due now."""
        return LoadReport(
            failed_block_ids=self.failed_block_ids.union(*self.finishing_block_ids.values())
        )

    def without_blocks(self) -> LoadReport:
        """After vLLM took the failed block ids."""
        return LoadReport(self.finished_requests, self.failed_requests,
                          finishing_block_ids=self.finishing_block_ids)


def report_load(
    report: LoadReport, outcome: RequestLoadOutcome, reporting: FailureReporting
) -> LoadReport:
    """Add one request's outcome to what vLLM is owed: an asynchronous load is
    finished whatever happened (vLLM requires failed ones among the finished), and
    its failure goes out in the model's one form of failure report (an
    asynchronous load's failed blocks with its finish)."""
    finished = report.finished_requests | (
        {outcome.request_id} if outcome.is_async else set()
    )
    failed_requests, failed_blocks = report.failed_requests, report.failed_block_ids
    finishing = report.finishing_block_ids
    if outcome.failed and reporting is FailureReporting.BLOCK_IDS:
        if outcome.is_async:
            finishing = {**finishing, outcome.request_id: outcome.failed_block_ids}
        else:
            failed_blocks = failed_blocks | outcome.failed_block_ids
    if outcome.failed and reporting is FailureReporting.REQUEST_IDS and outcome.is_async:
        failed_requests = failed_requests | {outcome.request_id}
    return LoadReport(frozenset(finished), failed_requests, failed_blocks, finishing)


def failure_unreportable(outcome: RequestLoadOutcome, reporting: FailureReporting) -> bool:
    """A synchronous load that failed where vLLM takes only request-level failures:
    vLLM ignores ``failed_recving`` for a request not waiting for a load, so the
    failure cannot be reported. ``effective_load_async`` makes every load of a
    several-group model asynchronous, so this marks a broken invariant."""
    return outcome.failed and not outcome.is_async and reporting is FailureReporting.REQUEST_IDS

