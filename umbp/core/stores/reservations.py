"""Reservations: the identities in-flight store events write, as a set that a
step's store plan checks a run of hashes against without a tuple per block
(built by :func:`umbp.core.stores.acks.reserved_identities`, read by
:func:`umbp.core.stores.request_store.store_plan`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import repeat

from umbp.core.identity import ObjectId

__all__ = ["Reservations"]


@dataclass(frozen=True, slots=True, eq=False)
class Reservations(AbstractSet[ObjectId]):
    """The identities in-flight store events write, as a set of identities: per
    event, per group id, a frozenset of block hashes (built once per event,
    :func:`umbp.core.stores.acks.reserved_identities`), so a step neither rebuilds
    one set of every in-flight identity nor makes a tuple per block. A run of one
    group's hashes is checked against each event's set in C (:meth:`holds_none`)."""

    by_event: tuple[Mapping[int, frozenset[bytes]], ...] = ()

    def __post_init__(self) -> None:
        # Only events that hold something, so truth is one tuple test: every
        # request of a step asks it.
        if not all(any(event.values()) for event in self.by_event):
            held = tuple(event for event in self.by_event if any(event.values()))
            object.__setattr__(self, "by_event", held)

    def holds_none(self, group_id: int, hashes: Iterable[bytes]) -> bool:
        """No hash of ``hashes`` is reserved in group ``group_id``."""
        sets = [held for event in self.by_event if (held := event.get(group_id))]
        if len(sets) > 1:
            hashes = tuple(hashes)  # walked once per event's set
        return all(held.isdisjoint(hashes) for held in sets)

    def __contains__(self, identity: object) -> bool:
        if not isinstance(identity, tuple) or len(identity) != 2:
            return False
        group_id, block_hash = identity
        return any(block_hash in event.get(group_id, ()) for event in self.by_event)

    def __iter__(self) -> Iterator[ObjectId]:
        seen: dict[ObjectId, None] = {}
        for event in self.by_event:
            for group_id, hashes in event.items():
                seen.update(dict.fromkeys(zip(repeat(group_id), hashes)))
        return iter(seen)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return bool(self.by_event)
