"""Start-up of big pools: populating the DRAM tiers per GiB, reopening the SSD index per
object, measured here and projected to a GPU host's sizes.

    python benchmarks/startup_bench.py [--gib 2] [--repeats 5] [--ssd-objects 1048576]
                                       [--part all|dram|ssd] [--json FILE] [--quick]

DRAM: `--gib` GiB populated as `umbp serve` does (`create_shared_pool`: a /dev/shm file
allocated in 1 GiB steps), beside the same allocation by two threads on one file (what
tmpfs would allow in parallel) and on two files; and as the embedded pool does
(`allocate_prefaulted_slab`) with one thread and with as many as it uses. Each round runs
every variant, in an order rotated round by round; each figure is the best of
`--repeats` rounds. Projected: the seconds a 64 GiB and a
512 GiB pool take at the measured cost per GiB.

SSD: an `SsdTier` of `--ssd-objects` objects of 100 bytes (one 512-byte slot each: the
index, not the bytes, is what a reopen reads), and one of 32,768 objects of 16 slots
(64 KiB objects in 4 KiB slots: a multi-slot object's every record is read), each
closed and reopened (page cache warm: the reopen's own work; a cold one also reads the
header records from disk, 1 KiB per slot). The figure is seconds per reopen and
microseconds per object and per slot.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.runtime.ssd.tier import SsdTier

GIB = 1 << 30
PROJECTED_GIB = (64, 512)
SHM_DIRECTORY = Path("/dev/shm")


@dataclass(frozen=True)
class Population:
    """One way of populating a DRAM tier."""

    name: str
    gib: float
    seconds: float

    @property
    def seconds_per_gib(self) -> float:
        return self.seconds / self.gib

    def projected_seconds(self, gib: int) -> float:
        return self.seconds_per_gib * gib


@dataclass(frozen=True)
class Reopen:
    objects: int
    slots_per_object: int
    seconds: float

    @property
    def us_per_object(self) -> float:
        return self.seconds / self.objects * 1e6

    @property
    def us_per_slot(self) -> float:
        return self.us_per_object / self.slots_per_object


def server_pool(nbytes: int) -> None:
    from umbp.runtime.server import shm

    shm.release_shared_pool(shm.create_shared_pool(nbytes))


def one_file_two_threads(nbytes: int) -> None:
    path = SHM_DIRECTORY / f"umbp-bench-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        half = nbytes // 2
        _in_threads([lambda: os.posix_fallocate(fd, 0, half),
                     lambda: os.posix_fallocate(fd, half, nbytes - half)])
    finally:
        os.close(fd)
        os.unlink(path)


def two_files_two_threads(nbytes: int) -> None:
    paths = [SHM_DIRECTORY / f"umbp-bench-{os.getpid()}-{part}" for part in (0, 1)]
    fds = [os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600) for path in paths]
    try:
        _in_threads([lambda fd=fd: os.posix_fallocate(fd, 0, nbytes // 2) for fd in fds])
    finally:
        for fd, path in zip(fds, paths):
            os.close(fd)
            os.unlink(path)


def embedded_slab(threads: int) -> Callable[[int], None]:
    from umbp.runtime import host_memory

    def populate(nbytes: int) -> None:
        original = host_memory.populate_threads
        host_memory.populate_threads = lambda: threads
        try:
            host_memory.allocate_prefaulted_slab(nbytes).close()
        finally:
            host_memory.populate_threads = original
    return populate


def _in_threads(runs: list[Callable[[], Any]]) -> None:
    workers = [threading.Thread(target=run) for run in runs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def measure_population(gib: float, repeats: int) -> list[Population]:
    from umbp.runtime.host_memory import populate_threads

    nbytes = int(gib * GIB) // (2 << 20) * (2 << 20)
    threads = populate_threads()
    runs: dict[str, Callable[[int], None]] = {
        "umbp serve (1 GiB fallocate steps, 1 thread)": server_pool,
        "one /dev/shm file, 2 threads": one_file_two_threads,
        "two /dev/shm files, 1 thread each": two_files_two_threads,
        "embedded slab, 1 thread": embedded_slab(1),
        f"embedded slab, {threads} threads": embedded_slab(threads),
    }
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        # Rotating order: what ran just before (freed shmem pages, free huge pages or
        # none) changes how fast memory is handed out; every variant follows each other.
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(measure.timed_seconds(lambda name=name: runs[name](nbytes)))
    return [Population(name, nbytes / GIB, min(seconds)) for name, seconds in times.items()]


def measure_reopen(objects: int, slots_per_object: int) -> Reopen:
    slot_bytes = 512 if slots_per_object == 1 else 4096
    size = 100 if slots_per_object == 1 else slots_per_object * slot_bytes
    directory = tempfile.mkdtemp(prefix="umbp-reopen-", dir="/tmp")
    try:
        capacity = objects * slots_per_object * slot_bytes
        tier = SsdTier(directory, capacity, slot_bytes)
        payload = os.urandom(size)
        for index in range(objects):
            assert tier.put(f"model-0123456789abcdef:tp0:pp0:g0:{index:064x}", payload)
        tier.close()
        samples = []
        for _ in range(2):
            started = time.perf_counter()
            reopened = SsdTier(directory, capacity, slot_bytes)
            samples.append(time.perf_counter() - started)
            assert reopened.stats().objects == objects
            reopened.close()
        return Reopen(objects, slots_per_object, min(samples))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="GiB populated per pass")
    parser.add_argument("--repeats", type=int, default=5,
                        help="passes per figure (best), each in another order")
    parser.add_argument("--ssd-objects", type=int, default=1 << 20,
                        help="objects in the one-slot SSD index reopened")
    parser.add_argument("--part", choices=("all", "dram", "ssd"), default="all",
                        help="measure only the DRAM population or only the SSD reopen")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true",
                        help="0.25 GiB, 1 pass, 16,384 and 1,024 objects")
    arguments = parser.parse_args()
    arguments.multi_slot_objects = 32_768
    if arguments.quick:
        arguments.gib, arguments.repeats = min(arguments.gib, 0.25), 1
        arguments.ssd_objects, arguments.multi_slot_objects = 16_384, 1_024
    return arguments


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    populations = (measure_population(arguments.gib, arguments.repeats)
                   if arguments.part in ("all", "dram") else [])
    reopens = [measure_reopen(arguments.ssd_objects, 1),
               measure_reopen(arguments.multi_slot_objects, 16)
               ] if arguments.part in ("all", "ssd") else []
    if populations:
        print(f"{'DRAM tier population':<48}{'s/GiB':>8}"
              + "".join(f"{f'{gib} GiB (s)':>14}" for gib in PROJECTED_GIB))
    for figure in populations:
        print(f"{figure.name:<48}{figure.seconds_per_gib:>8.3f}"
              + "".join(f"{figure.projected_seconds(gib):>14.1f}" for gib in PROJECTED_GIB))
    if populations:
        print(f"(measured on {populations[0].gib:.2f} GiB, best of {arguments.repeats}; "
              "larger sizes projected)")
    if reopens:
        print(f"{'SSD reopen':<48}{'seconds':>8}{'us/object':>14}{'us/slot':>14}")
    for reopen in reopens:
        name = f"{reopen.objects:,} objects of {reopen.slots_per_object} slot(s)"
        print(f"{name:<48}{reopen.seconds:>8.2f}{reopen.us_per_object:>14.2f}"
              f"{reopen.us_per_slot:>14.2f}")
    elapsed = time.perf_counter() - started
    measure.print_run_footer(elapsed)
    if arguments.json is not None:
        report = {
            "benchmark": "startup", "quick": arguments.quick,
            "population": [asdict(figure) | {"seconds_per_gib": figure.seconds_per_gib}
                           for figure in populations],
            "reopen": [asdict(reopen) | {"us_per_object": reopen.us_per_object,
                                         "us_per_slot": reopen.us_per_slot}
                       for reopen in reopens],
            "gib": arguments.gib, "repeats": arguments.repeats,
        }
        measure.write_report(arguments.json, report, elapsed)


if __name__ == "__main__":
    main()
