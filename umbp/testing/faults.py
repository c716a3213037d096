"""Faults injected for real into umbp's tiers, from outside the code that owns them.

Production modules keep only a narrow, read-mostly seam for this (`SlabPool.object_regions`
and `slab_view`, `SsdTier.object_slots` and `slot_data_offset`); the damage itself is
done here, so no production module carries a test-only code path.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from umbp.runtime.pool import SlabPool
from umbp.runtime.ssd.format import (
    RECORD_MAGIC,
    SLOT_FILE_NAME,
    SUPERBLOCK_BYTES,
    SlotGeometry,
    read_geometry,
)

__all__ = ["flip_pool_objects", "flip_stored_bytes", "stop_process"]


def flip_pool_objects(pool: SlabPool, keys: Iterable[str]) -> int:
    """Flip the first byte of each object under ``keys`` in the embedded pool's slab,
    so that its checksum no longer matches and the next load answers CORRUPT.
    Returns how many objects were damaged (every key must be resident)."""
    view = pool.slab_view()
    try:
        flipped = 0
        for key in keys:
            offset, _length = pool.object_regions(key)[0]
            view[offset] ^= 0xFF
            flipped += 1
        return flipped
    finally:
        view.release()  # an exported view would keep the pool's slab from closing


def flip_stored_bytes(directory: str | os.PathLike[str]) -> int:
    """Flip the first payload byte of every occupied slot of the SSD slot file in
    `directory`, read through its superblock and without its lock, so that a server that
    owns the file keeps serving while the bytes under it go bad. Returns the number of
    slots flipped."""
    descriptor = os.open(Path(directory) / SLOT_FILE_NAME, os.O_RDWR)
    try:
        slot_bytes, total_slots, data_offset = read_geometry(
            os.pread(descriptor, SUPERBLOCK_BYTES, 0)
        )
        geometry = SlotGeometry(slot_bytes, total_slots)
        assert geometry.data_offset == data_offset, "a slot file of another layout"
        flipped = 0
        for slot in range(total_slots):
            magic = os.pread(descriptor, len(RECORD_MAGIC), geometry.record_offset(slot))
            if magic != RECORD_MAGIC:
                continue
            offset = geometry.slot_offset(slot)
            byte = os.pread(descriptor, 1, offset)
            os.pwrite(descriptor, bytes([byte[0] ^ 0xFF]), offset)
            flipped += 1
        return flipped
    finally:
        os.close(descriptor)


def stop_process(pid: int, wait_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every thread of it is stopped: delivery is
    asynchronous, and a thread still running could answer the request meant to find the
    process stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + wait_s
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {wait_s:g} s")
        time.sleep(0.01)


def _all_threads_stopped(pid: int) -> bool:
    try:
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for task in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:
        return False  # a thread went away while we looked
    return all(state in ("T", "t") for state in states)
