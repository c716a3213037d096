"""The stores whose source blocks umbp holds pinned in vLLM's block pool.

Two kinds, both pinned so vLLM cannot reuse a block while a worker still reads it:
the store events in flight (one per step that stores anything, pinned until every
worker has reported it) and finished requests' partial tails (pinned at finish,
until the next step's event takes them over). The events' identities are
*reserved* meanwhile: a later step must not plan them again. The bookkeeping is
:mod:`umbp.core.stores.acks`; this class holds the mutable part and the pins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

from umbp.core.plans import StorePlan
from umbp.core.stores.acks import (
    StoreEvent,
    StoreEventResult,
    acknowledge_reports,
    pinned_block_ids,
    reserved_identities,
)
from umbp.core.stores.reservations import Reservations
from umbp.shell.vllm_compat.objects import BlockPoolLike

__all__ = ["PinnedStores"]


class PinnedStores:
    def __init__(self) -> None:
        self._pool: BlockPoolLike | None = None
        self._events: dict[int, tuple[StoreEvent, StoreEventResult]] = {}
        # Per in-flight event, the requests whose plans in it reserve nothing any more.
        self._unreserved: dict[int, set[str]] = {}
        self._next_event = 0
        # Finished requests' last boundary pages, pinned until the next step's event.
        self._finished_tails: dict[str, StorePlan] = {}

    def bind_pool(self, pool: BlockPoolLike) -> None:
        self._pool = pool

    @property
    def events_in_flight(self) -> bool:
        return bool(self._events)

    @property
    def tails_waiting(self) -> bool:
        return bool(self._finished_tails)

    def has_tail(self, request_id: str) -> bool:
        return request_id in self._finished_tails

    def stores_for(self, request_id: str, block_hashes: Iterable[bytes]) -> bool:
        """Whether a store in flight (or waiting for its step) writes one of the
        request's blocks: one of its own, or a prefix block it shares with the request
        that stores it."""
        if request_id in self._finished_tails:
            return True
        wanted = frozenset(block_hashes)
        return any(
            plan.request_id == request_id
            or any(not wanted.isdisjoint(group.block_hashes) for group in plan.groups)
            for event, _ in self._events.values() for plan in event.plans
        )

    def reserved(self) -> Reservations:
        """The identities the in-flight events write: stored once."""
        return reserved_identities((event for event, _ in self._events.values()),
                                   self._unreserved)

    def unreserve(self, request_ids: AbstractSet[str]) -> None:
        """vLLM recomputes these requests after a failed load: what their in-flight
        plans computed over it is not stored (the worker leaves it out), so it no
        longer keeps a step from planning the recompute's blocks. The pins stay
        until the events are acknowledged."""
        for event_id, (event, _) in self._events.items():
            mine = {plan.request_id for plan in event.plans} & request_ids
            if mine:
                self._unreserved.setdefault(event_id, set()).update(mine)

    def hold_finished_tail(self, request_id: str, plan: StorePlan) -> None:
        """Pin a finished request's tail until the next step's event stores it."""
        self._pin(plan)
        self._finished_tails[request_id] = plan

    def open_event(
        self, stores: tuple[StorePlan, ...]
    ) -> tuple[tuple[StorePlan, ...], int | None]:
        """This step's stores and the waiting tails as one event, pinned: (every
        plan the event stores, its id; None when there is nothing to store)."""
        tails, self._finished_tails = self._finished_tails, {}
        plans = (*stores, *tails.values())
        event_id = None
        if plans:
            event_id = self._next_event
            self._next_event += 1
            event = StoreEvent(event_id, plans=plans)
            self._events[event_id] = (event, StoreEventResult())
            self._pin(event)
        # The event pins the tails now; release the pins taken at request finish.
        for plan in tails.values():
            self._unpin(plan)
        return plans, event_id

    def acknowledge(
        self, reports: Mapping[int, StoreEventResult], num_workers: int
    ) -> tuple[tuple[StoreEvent, StoreEventResult], ...]:
        """Merge the workers' reports; unpin and return the events every worker
        has now reported (with their merged results)."""
        self._events, acknowledged = acknowledge_reports(self._events, reports, num_workers)
        for event, _ in acknowledged:
            self._unreserved.pop(event.event_id, None)
            self._unpin(event)
        return acknowledged

    def _pin(self, source: StoreEvent | StorePlan) -> None:
        """Pin the source blocks in vLLM's pool until workers have copied them out:
        each block once (:func:`pinned_block_ids`), as :meth:`_unpin` releases them."""
        pool = self._pool
        if pool is not None:
            pool.touch(list(map(pool.blocks.__getitem__, pinned_block_ids(source))))  # C loop

    def _unpin(self, source: StoreEvent | StorePlan) -> None:
        """Release :meth:`_pin`'s pins, in reverse to keep vLLM's eviction order."""
        pool = self._pool
        if pool is not None:
            pool.free_blocks(map(pool.blocks.__getitem__, reversed(pinned_block_ids(source))))
