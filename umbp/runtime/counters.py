"""`PoolCounters`: the monotonic counters behind a store's `PoolStats`.

Every back-end that keeps its own counters (the slab pool, the Mooncake and MORI clients)
counts the same events; only occupancy differs, and only the store knows it, so a snapshot
takes occupancy as arguments. Not thread-safe: each store mutates and reads its counters
under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from umbp.runtime.contract import PoolStats

__all__ = ["PoolCounters"]


@dataclass(slots=True)
class PoolCounters:
    """Counts since construction; field meanings are those of `PoolStats`."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_rejects: int = 0
    evictions: int = 0
    corrupt_loads: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def snapshot(
        self, *, capacity_bytes: int, used_bytes: int, page_bytes: int, objects: int
    ) -> PoolStats:
        """These counters with the store's occupancy, as one immutable `PoolStats`."""
        return PoolStats(
            capacity_bytes=capacity_bytes,
            used_bytes=used_bytes,
            page_bytes=page_bytes,
            objects=objects,
            hits=self.hits,
            misses=self.misses,
            puts=self.puts,
            put_rejects=self.put_rejects,
            evictions=self.evictions,
            corrupt_loads=self.corrupt_loads,
            bytes_written=self.bytes_written,
            bytes_read=self.bytes_read,
        )
