"""Store events: one step's stores, the device blocks they pin, and their acks.

Every step that stores anything becomes one event. The scheduler pins the event's
source blocks in vLLM's block pool (so vLLM cannot reuse them while workers still
read them) and unpins them once every worker has reported the event. While an event
is in flight its identities are *reserved*: a later step must not plan them again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

from umbp.core.identity import Identity
from umbp.core.store_plans import StoreBatch

__all__ = [
    "StoreEvent",
    "StoreEventResult",
    "event_acknowledged",
    "merge_store_results",
    "pinned_block_ids",
    "reserved_identities",
    "stored_identities",
]


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """The stores of one scheduler step: one batch per request and kind (new
    blocks, boundary states, finished partial tails)."""

    event_id: int
    batches: tuple[StoreBatch, ...] = ()

    def __bool__(self) -> bool:
        return any(self.batches)

    def identities(self) -> tuple[Identity, ...]:
        """Every identity the event writes, unique, in first-seen order."""
        seen: dict[Identity, None] = {}
        for batch in self.batches:
            seen.update(dict.fromkeys(zip(batch.group_ids, batch.block_hashes)))
        return tuple(seen)


def pinned_block_ids(event: StoreEvent | StoreBatch) -> tuple[int, ...]:
    """The source blocks to pin until the event (or a batch waiting for one) is
    acknowledged: each once, in first-seen order (unpin the same ids, in reverse
    to keep vLLM's eviction order)."""
    batches = (event,) if isinstance(event, StoreBatch) else event.batches
    block_ids = tuple(chain.from_iterable(batch.block_ids for batch in batches))
    # Usually every block appears once (the store pass plans an identity once):
    # a set of ints tells so at a quarter of the cost of an ordered dict.
    if len(set(block_ids)) == len(block_ids):
        return block_ids
    return tuple(dict.fromkeys(block_ids))


def reserved_identities(events: Iterable[StoreEvent]) -> frozenset[Identity]:
    """Identities written by in-flight events: not to be planned again."""
    return frozenset(identity for event in events for identity in event.identities())


@dataclass(frozen=True, slots=True)
class StoreEventResult:
    """What the workers reported for one event so far."""

    completed_workers: int = 0
    failed: frozenset[Identity] = frozenset()


def merge_store_results(first: StoreEventResult, second: StoreEventResult) -> StoreEventResult:
    """Reports from different workers add up; a failure on any worker counts."""
    return StoreEventResult(
        first.completed_workers + second.completed_workers, first.failed | second.failed
    )


def event_acknowledged(result: StoreEventResult, num_workers: int) -> bool:
    """Every worker reported: the pins can go."""
    return result.completed_workers >= num_workers


def stored_identities(event: StoreEvent, result: StoreEventResult) -> tuple[Identity, ...]:
    """The event's identities that no worker failed to store, first-seen order."""
    return tuple(identity for identity in event.identities() if identity not in result.failed)
