"""What the server keeps for each client connection (its reservations and pins, until it
drops) and in total (the counters `umbp stats` reports)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from umbp.runtime.server.index import Entry, Regions

__all__ = [
    "MAX_BATCHES_IN_FLIGHT",
    "PinnedGet",
    "RequestRefused",
    "Reserved",
    "ServerCounters",
    "Session",
]


@dataclass(frozen=True, slots=True)
class Reserved:
    """Pages handed to a client for one key of a put, not yet visible to lookups."""

    key: str
    regions: Regions
    nbytes: int


@dataclass(slots=True)
class PinnedGet:
    """The pins of one BEGIN_GET, by request position, until its END_GET."""

    pinned: list[Entry | None]
    from_ssd: set[int] = field(default_factory=set)
    """Positions promoted from the SSD tier by this get (their hits are SSD hits)."""


MAX_BATCHES_IN_FLIGHT = 256
"""Puts not yet committed plus gets not yet ended, per connection. The client has one in
flight at a time; a peer that opens batches without closing them is refused more."""


class RequestRefused(ValueError):
    """A well-formed request that does not fit this connection's state (unknown token,
    wrong count); nothing was changed."""


@dataclass(slots=True)
class Session:
    """One client connection's reservations and pins, released when it drops."""

    reservations: dict[int, list[Reserved]] = field(default_factory=dict)
    gets: dict[int, PinnedGet] = field(default_factory=dict)
    tokens: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def require_room(self) -> None:
        if len(self.reservations) + len(self.gets) >= MAX_BATCHES_IN_FLIGHT:
            raise RequestRefused(
                f"{MAX_BATCHES_IN_FLIGHT} batches already in flight on this connection; "
                "commit or end them first"
            )


@dataclass(slots=True)
class ServerCounters:
    """The monotonic counters `umbp stats` reports; mutated only under the index lock."""

    hits: int = 0
    hits_from_ssd: int = 0
    misses: int = 0
    puts: int = 0
    put_rejects: int = 0
    corrupt_loads: int = 0
    evictions_to_ssd: int = 0
    evictions_dropped: int = 0
    ssd_put_failures: int = 0
    promotions: int = 0
    prefetched: int = 0
    """Of the promotions, those made ahead of their load (a lookup found them on SSD)."""
    written_ahead: int = 0
    """DRAM objects copied to SSD before their eviction (`write_ahead`), kept in DRAM."""
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_to_ssd: int = 0
    bytes_from_ssd: int = 0
    connections: int = 0
