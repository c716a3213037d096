"""The DRAM tier's pages made present in the background (`page_tables`): every page of
the mapping ends up in this process's page tables, and not one byte changes."""

from __future__ import annotations

import mmap
import os
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


def test_a_detached_pool_leaves_the_process_and_its_filler_stops_though_views_live_on() -> None:
    """A client's end of a pool (`detach_shared_pool`): the filler stops rather than make
    the empty memory put in the file's place present, neither a mapping nor a descriptor
    of this process holds the file while a view of it lives on (a tmpfs frees a removed
    file's pages only then), that view reads zeros, and writing it changes nothing in the
    server's pool."""
    nbytes = 256 * MIB
    pool = shm.create_shared_pool(nbytes)
    try:
        np.frombuffer(pool.mapping, np.uint8)[:MIB] = 9
        mapped = shm.map_shared_pool(pool.path, nbytes)
        assert mapped.filler is not None
        view = np.frombuffer(mapped.mapping, np.uint8)
        assert int(view[0]) == 9
        shm.detach_shared_pool(mapped)
        mapped.filler.join(30)
        assert not mapped.filler.is_alive()
        assert not any(pool.path in line for line in Path("/proc/self/maps").read_text()
                       .splitlines() if line.startswith(f"{view.ctypes.data:x}-"))
        assert mapped.mapping_fd is not None  # the descriptor CPython's mmap keeps
        assert os.readlink(f"/proc/self/fd/{mapped.mapping_fd[0]}") == os.devnull
        # At most the step the filler was in when told to stop, not the 256 MiB.
        assert resident_kib(mapped.mapping) <= STEP_BYTES // 1024
        assert not view[:MIB].any()
        view[:MIB] = 1
        assert bool((np.frombuffer(pool.mapping, np.uint8)[:MIB] == 9).all())
        del view
    finally:
        shm.release_shared_pool(pool)


def test_detaching_one_of_two_mappings_of_a_pool_leaves_the_other_whole() -> None:
    """A scheduler and a worker in one process map the same server's pool each: the one
    that lets go closes its own descriptor of the file, not the other's."""
    nbytes = 4 * MIB
    pool = shm.create_shared_pool(nbytes)
    try:
        np.frombuffer(pool.mapping, np.uint8)[:MIB] = 5
        first = shm.map_shared_pool(pool.path, nbytes)
        second = shm.map_shared_pool(pool.path, nbytes)
        assert first.mapping_fd is not None and second.mapping_fd is not None
        assert first.mapping_fd[0] != second.mapping_fd[0]
        shm.detach_shared_pool(first)
        assert os.readlink(f"/proc/self/fd/{second.mapping_fd[0]}") == pool.path
        kept = np.frombuffer(second.mapping, np.uint8)
        assert bool((kept[:MIB] == 5).all())
        kept[MIB] = 6
        assert int(np.frombuffer(pool.mapping, np.uint8)[MIB]) == 6
        del kept
    finally:
        shm.release_shared_pool(pool)
