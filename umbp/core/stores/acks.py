"""Store events: one step's store plans, the device blocks they pin, and the
workers' acknowledgements.

Every step that stores anything becomes one event. The scheduler pins the event's
source blocks in vLLM's block pool (so vLLM cannot reuse them while workers still
read them) and unpins them once every worker has reported the event. While an event
is in flight its identities are *reserved*: a later step must not plan them again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import chain

from umbp.core.identity import ObjectId
from umbp.core.plans import StorePlan, plan_block_ids
from umbp.core.stores.reservations import Reservations

__all__ = [
    "StoreEvent",
    "StoreEventResult",
    "acknowledge_reports",
    "event_acknowledged",
    "merge_store_results",
    "pinned_block_ids",
    "reserved_identities",
]


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """The stores of one scheduler step: one plan per request and kind (new
    blocks, boundary states, finished partial tails).

    ``_reserved`` caches :meth:`hashes_by_group` (a function of ``plans``, so
    the value stays immutable to its users): a later step asks for it while the
    event is in flight, and it is built once per event, not once per step."""

    event_id: int
    plans: tuple[StorePlan, ...] = ()
    _reserved: dict[int, frozenset[bytes]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __bool__(self) -> bool:
        return any(self.plans)

    def hashes_by_group(self) -> Mapping[int, frozenset[bytes]]:
        """The block hashes the event writes, per group id."""
        if self._reserved is None:
            object.__setattr__(self, "_reserved", _hashes_by_group(self.plans))
        assert self._reserved is not None
        return self._reserved



def pinned_block_ids(source: StoreEvent | StorePlan) -> tuple[int, ...]:
    """The source blocks to pin until the event (or a plan waiting for one) is
    acknowledged: each once, in first-seen order (unpin the same ids, in reverse
    to keep vLLM's eviction order)."""
    plans = (source,) if isinstance(source, StorePlan) else source.plans
    block_ids = (
        plan_block_ids(plans[0]) if len(plans) == 1
        else tuple(chain.from_iterable(map(plan_block_ids, plans)))
    )
    # Usually every block appears once (the store pass plans an identity once).
    if len(set(block_ids)) == len(block_ids):
        return block_ids
    return tuple(dict.fromkeys(block_ids))


def reserved_identities(
    events: Iterable[StoreEvent], unreserved: Mapping[int, AbstractSet[str]] | None = None
) -> Reservations:
    """Identities written by in-flight events: not to be planned again (each
    event's hashes per group, built once per event). ``unreserved``: per event id,
    requests whose plans in it no longer reserve anything (the worker leaves out
    what they computed over a failed load, so those identities are for the
    recompute to store)."""
    held: list[Mapping[int, frozenset[bytes]]] = []
    for event in events:
        dropped = unreserved.get(event.event_id) if unreserved else None
        hashes = event.hashes_by_group() if not dropped else _hashes_by_group(
            plan for plan in event.plans if plan.request_id not in dropped
        )
        if hashes:
            held.append(hashes)
    return Reservations(tuple(held))


def _hashes_by_group(plans: Iterable[StorePlan]) -> dict[int, frozenset[bytes]]:
    groups: dict[int, set[bytes]] = {}
    for plan in plans:
        for group in plan.groups:
            groups.setdefault(group.group_id, set()).update(group.block_hashes)
    return {group_id: frozenset(hashes) for group_id, hashes in groups.items()}


@dataclass(frozen=True, slots=True)
class StoreEventResult:
    """What the workers reported for one event so far."""

    completed_workers: int = 0
    failed: frozenset[ObjectId] = frozenset()


def merge_store_results(first: StoreEventResult, second: StoreEventResult) -> StoreEventResult:
    """Reports from different workers add up; a failure on any worker counts."""
    return StoreEventResult(
        first.completed_workers + second.completed_workers, first.failed | second.failed
    )


def event_acknowledged(result: StoreEventResult, num_workers: int) -> bool:
    """Every worker reported: the pins can go."""
    return result.completed_workers >= num_workers


def acknowledge_reports(
    open_events: Mapping[int, tuple[StoreEvent, StoreEventResult]],
    reports: Mapping[int, StoreEventResult],
    num_workers: int,
) -> tuple[dict[int, tuple[StoreEvent, StoreEventResult]], tuple[tuple[StoreEvent, StoreEventResult], ...]]:
    """Workers' reports merged into the open events: (the events still open, the
    events every worker has now reported, in report order). Reports for unknown
    events (already acknowledged) are ignored."""
    still_open = dict(open_events)
    done: list[tuple[StoreEvent, StoreEventResult]] = []
    for event_id, reported in reports.items():
        entry = still_open.get(event_id)
        if entry is None:
            continue
        event, result = entry[0], merge_store_results(entry[1], reported)
        if event_acknowledged(result, num_workers):
            del still_open[event_id]
            done.append((event, result))
        else:
            still_open[event_id] = (event, result)
    return still_open, tuple(done)
