"""What the SSD tier reports: `SsdStats` snapshots of its occupancy and the monotonic
`SsdCounters` behind them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SsdCounters", "SsdStats"]


@dataclass(frozen=True, slots=True)
class SsdStats:
    """A snapshot of the tier's occupancy and counters (counters are since open)."""

    capacity_bytes: int
    """Bytes of slots the tier can use (less than configured after ENOSPC/EFBIG)."""
    used_bytes: int
    """Bytes of slots taken by resident objects (whole slots)."""
    slot_bytes: int
    """Allocation granule; an object occupies max(1, ceil(size / slot_bytes)) slots."""
    objects: int
    """Resident objects."""
    hits: int
    """Reads that returned HIT."""
    misses: int
    """Reads that returned MISSING."""
    puts: int
    """Objects written (a put of a resident key writes nothing and is not counted)."""
    put_failures: int
    """Puts that failed on an I/O error (ENOSPC, EFBIG, EIO)."""
    put_rejects: int
    """Puts refused without I/O: larger than the tier, key too long, tier closed."""
    evictions: int
    """Objects evicted to make room (LRU)."""
    corrupt_reads: int
    """Reads that found a checksum mismatch or missing data (the object was dropped)."""
    read_errors: int
    """Reads that failed on an I/O error (answered UNAVAILABLE, object kept)."""
    dropped_at_open: int
    """Damaged header records, incomplete or inconsistent objects, and reset files
    (damaged superblock, other geometry) found while opening; each counts once."""
    bytes_written: int
    """Payload bytes written by successful puts."""
    bytes_read: int
    """Payload bytes delivered by reads that hit."""


@dataclass(slots=True)
class SsdCounters:
    """Monotonic counters behind `SsdStats`; mutated only under the tier's lock."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    put_rejects: int = 0
    evictions: int = 0
    corrupt_reads: int = 0
    read_errors: int = 0
    dropped_at_open: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def snapshot(
        self, *, capacity_bytes: int, used_bytes: int, slot_bytes: int, objects: int
    ) -> SsdStats:
        """These counters with the tier's occupancy, as one immutable `SsdStats`."""
        return SsdStats(
            capacity_bytes=capacity_bytes,
            used_bytes=used_bytes,
            slot_bytes=slot_bytes,
            objects=objects,
            hits=self.hits,
            misses=self.misses,
            puts=self.puts,
            put_failures=self.put_failures,
            put_rejects=self.put_rejects,
            evictions=self.evictions,
            corrupt_reads=self.corrupt_reads,
            read_errors=self.read_errors,
            dropped_at_open=self.dropped_at_open,
            bytes_written=self.bytes_written,
            bytes_read=self.bytes_read,
        )
