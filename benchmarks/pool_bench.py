"""SlabPool throughput against plain memcpy, measured side by side in one run.

    python benchmarks/pool_bench.py [--json FILE] [--gib 1.0] [--repeats 5] [--quick]

For 64 KiB and 1 MiB objects it moves `--gib` GiB through `SlabPool.put_batch` and
`SlabPool.get_batch_into` (checksums included), and copies the same bytes with numpy, object
by object, into a prefaulted buffer: the physical limit on this machine. Pool and memcpy
passes alternate so that drift in machine speed hits both alike; each figure is the best of
`--repeats` passes. A bulk copy of all objects at once is shown for context. It also
times a batched `lookup` of 1,000 keys (half resident).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.runtime import LoadStatus, SlabPool

GIB = 1 << 30
BATCH = 32  # objects per put_batch / get_batch_into call, like one worker step
ALIGNMENT = 64  # torch's CPU allocator (c10::alignment)
LOOKUP_KEYS = 1000
LOOKUP_CALLS = 2000


@dataclass(frozen=True)
class CopyFigure:
    """One row of the table: a pool operation against memcpy of the same bytes."""

    operation: str
    object_bytes: int
    page_bytes: int
    objects: int
    pool_gbps: float
    memcpy_gbps: float
    bulk_memcpy_gbps: float

    @property
    def ratio(self) -> float:
        return self.pool_gbps / self.memcpy_gbps


@dataclass(frozen=True)
class LookupFigure:
    keys: int
    median_us: float
    best_us: float
    p99_us: float


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB moved per case")
    parser.add_argument("--repeats", type=int, default=5, help="passes per figure (best)")
    parser.add_argument("--quick", action="store_true", help="1/8 GiB per case, 2 passes")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.gib, arguments.repeats = min(arguments.gib, 0.125), min(arguments.repeats, 2)
    return arguments


def prefaulted(objects: int, object_bytes: int) -> Any:
    """`objects` rows in one buffer whose pages are all touched (np.empty maps lazily),
    starting on a 64-byte boundary as torch's CPU allocator does. numpy alone aligns to 16
    bytes, and a destination 16 bytes off the slab's alignment halves memcpy throughput
    here (glibc's `rep movsb` path): that would measure numpy's allocator, not the pool."""
    raw = np.empty(objects * object_bytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    array = raw[start : start + objects * object_bytes].reshape(objects, object_bytes)
    array.fill(0)
    return array


def random_source(objects: int, object_bytes: int) -> Any:
    """`objects` rows of random bytes (a random 64 MiB block tiled: contents do not change
    copy or hash speed, and generating 1 GiB of randomness would dominate the run)."""
    block = np.random.default_rng(0).integers(0, 256, size=64 << 20, dtype=np.uint8)
    source = prefaulted(objects, object_bytes)
    source.reshape(-1)[:] = np.resize(block, objects * object_bytes)
    return source


def timed_seconds(run: Callable[[], None], prepare: Callable[[], None] | None = None) -> float:
    if prepare is not None:
        prepare()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure_copies(
    object_bytes: int, page_bytes: int, gib: float, repeats: int
) -> list[CopyFigure]:
    """Put and get figures for one object size, each beside memcpy of the same bytes."""
    objects = max(BATCH, int(gib * GIB) // object_bytes)
    source = random_source(objects, object_bytes)
    destination = prefaulted(objects, object_bytes)
    keys = [f"bench-{object_bytes}-{index}" for index in range(objects)]
    pages_per_object = -(-object_bytes // page_bytes)
    pool = SlabPool(
        int(objects * pages_per_object * page_bytes / 0.9) + page_bytes,
        page_bytes=page_bytes,
        high_watermark=0.95,
        low_watermark=0.9,
    )
    batches = [range(start, min(start + BATCH, objects)) for start in range(0, objects, BATCH)]

    def memcpy() -> None:
        for index in range(objects):
            destination[index] = source[index]

    def bulk_memcpy() -> None:
        np.copyto(destination, source)

    def put_all() -> None:
        for batch in batches:
            results = pool.put_batch([keys[i] for i in batch], [source[i] for i in batch])
            assert all(results), "benchmark pool rejected a put"

    def get_all() -> None:
        for batch in batches:
            statuses = pool.get_batch_into(
                [keys[i] for i in batch], [destination[i] for i in batch]
            )
            assert all(status is LoadStatus.HIT for status in statuses), statuses

    memcpy_times, bulk_times, put_times, get_times = [], [], [], []
    for _ in range(repeats):
        bulk_times.append(timed_seconds(bulk_memcpy))
        memcpy_times.append(timed_seconds(memcpy))
        put_times.append(timed_seconds(put_all, prepare=pool.clear))
    for _ in range(repeats):
        memcpy_times.append(timed_seconds(memcpy))
        get_times.append(timed_seconds(get_all))
    assert np.array_equal(destination[objects // 2], source[objects // 2])
    assert pool.stats().evictions == 0, "benchmark pool evicted; figures would mislead"
    pool.close()

    moved = objects * object_bytes
    memcpy_gbps = moved / min(memcpy_times) / 1e9
    bulk_gbps = moved / min(bulk_times) / 1e9
    return [
        CopyFigure(
            operation,
            object_bytes,
            page_bytes,
            objects,
            moved / min(times) / 1e9,
            memcpy_gbps,
            bulk_gbps,
        )
        for operation, times in (("put", put_times), ("get", get_times))
    ]


def measure_lookup() -> LookupFigure:
    """Latency of one batched lookup of 1,000 keys, half of them resident."""
    pool = SlabPool(2 * LOOKUP_KEYS * 4096, page_bytes=4096)
    payload = np.zeros(64, dtype=np.uint8)
    stored = [f"lookup-{index}" for index in range(0, 2 * LOOKUP_KEYS, 2)]
    pool.put_batch(stored, [payload] * len(stored))
    asked = [f"lookup-{index}" for index in range(LOOKUP_KEYS)]
    assert sum(pool.lookup(asked)) == LOOKUP_KEYS // 2
    samples = []
    for _ in range(LOOKUP_CALLS):
        start = time.perf_counter()
        pool.lookup(asked)
        samples.append((time.perf_counter() - start) * 1e6)
    pool.close()
    samples.sort()
    return LookupFigure(
        keys=LOOKUP_KEYS,
        median_us=statistics.median(samples),
        best_us=samples[0],
        p99_us=samples[int(len(samples) * 0.99)],
    )


def print_table(copies: list[CopyFigure], lookup: LookupFigure) -> None:
    print(
        f"{'case':<12}{'page':>9}{'objects':>9}{'pool GB/s':>11}{'memcpy GB/s':>13}"
        f"{'ratio':>8}{'bulk GB/s':>11}"
    )
    for figure in copies:
        case = f"{figure.operation} {_size(figure.object_bytes)}"
        print(
            f"{case:<12}{_size(figure.page_bytes):>9}{figure.objects:>9}"
            f"{figure.pool_gbps:>11.2f}{figure.memcpy_gbps:>13.2f}{figure.ratio:>7.2f}x"
            f"{figure.bulk_memcpy_gbps:>11.2f}"
        )
    print(
        "memcpy: numpy copy of the same objects, one by one, into a prefaulted buffer "
        "(ratio = pool / memcpy); bulk: one numpy copy of all of them"
    )
    print(
        f"lookup of {lookup.keys} keys: median {lookup.median_us:.1f} us, "
        f"best {lookup.best_us:.1f} us, p99 {lookup.p99_us:.1f} us"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    copies = measure_copies(64 << 10, 64 << 10, arguments.gib, arguments.repeats)
    copies += measure_copies(1 << 20, 256 << 10, arguments.gib, arguments.repeats)
    lookup = measure_lookup()
    print_table(copies, lookup)
    elapsed = time.perf_counter() - started
    print(f"({elapsed:.1f} s, python {platform.python_version()}, {os.cpu_count()} cpus)")
    if arguments.json is not None:
        report = {
            "copies": [asdict(figure) | {"ratio": figure.ratio} for figure in copies],
            "lookup": asdict(lookup),
            "gib_per_case": arguments.gib,
            "repeats": arguments.repeats,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "seconds": elapsed,
        }
        arguments.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
