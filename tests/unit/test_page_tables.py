"""The DRAM tier's pages made present in the background (`page_tables`): every page of
the mapping ends up in this process's page tables, and not one byte changes."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import numpy as np

from umbp.runtime.server import shm
from umbp.runtime.server.page_tables import STEP_BYTES, fill_in_background

MIB = 1 << 20


def resident_kib(mapping: mmap.mmap) -> int:
    """Rss of `mapping` in this process, from /proc/self/smaps."""
    start = f"{np.frombuffer(mapping, np.uint8).ctypes.data:x}-"
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith(start):
            for field in lines[index + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping at {start} in /proc/self/smaps")


def test_every_page_of_a_mapped_pool_becomes_present_and_no_byte_changes() -> None:
    nbytes = 2 * STEP_BYTES + 3 * mmap.PAGESIZE  # a last step shorter than the others
    pool = shm.create_shared_pool(nbytes)
    try:
        marks = np.frombuffer(pool.mapping, np.uint8)
        marks[::STEP_BYTES // 2] = 7  # a few pages touched (and written) before
        finished: list[tuple[int, float]] = []
        mapped = shm.map_shared_pool(pool.path, nbytes)  # an engine's view: filled too
        fill_in_background(pool.mapping, nbytes,
                           lambda size, seconds: finished.append((size, seconds))).join(30)
        assert [size for size, _ in finished] == [nbytes]
        assert resident_kib(pool.mapping) == nbytes // 1024
        for _ in range(300):  # the engine's own filler thread, started by map_shared_pool
            if resident_kib(mapped.mapping) == nbytes // 1024:
                break
            time.sleep(0.1)
        assert resident_kib(mapped.mapping) == nbytes // 1024
        seen = np.frombuffer(mapped.mapping, np.uint8)
        assert int(np.count_nonzero(seen)) == len(range(0, nbytes, STEP_BYTES // 2))
        assert bool((seen[::STEP_BYTES // 2] == 7).all())
        del marks, seen
    finally:
        shm.release_shared_pool(pool)
