"""`umbp serve` throughput against plain memcpy, measured side by side in one run.

    python benchmarks/server_bench.py [--json FILE] [--gib 1.0] [--repeats 5] [--quick]

A real server process holds the pool; `ServerStore` in this process copies objects into
and out of the server's shared-memory pool (checksums included, two round trips per put
batch, one per get batch). For 64 KiB and 1 MiB objects it moves `--gib` GiB through
`put_batch` and `get_batch_into` in batches of 32 and copies the same bytes with numpy,
object by object, into a prefaulted buffer: the physical limit on this machine. Server
and memcpy passes alternate so that drift in machine speed hits both alike; each figure
is the best of `--repeats` passes. It also times a batched `lookup` of 1,000 keys (half
resident) over the socket.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pool_bench import GIB, prefaulted, random_source, timed_seconds

from umbp.runtime import LoadStatus
from umbp.runtime.server import ServerStore, start_server

BATCH = 32
OBJECT_SIZES = (64 << 10, 1 << 20)
PAGE_BYTES = 64 << 10
LOOKUP_KEYS = 1000
LOOKUP_CALLS = 1000
QUICK_LOOKUP_CALLS = 200


@dataclass(frozen=True)
class CopyFigure:
    """One row: a server operation against memcpy of the same bytes."""

    operation: str
    object_bytes: int
    objects: int
    server_gbps: float
    memcpy_gbps: float

    @property
    def ratio(self) -> float:
        return self.server_gbps / self.memcpy_gbps


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


def measure_copies(
    store: ServerStore, object_bytes: int, gib: float, repeats: int
) -> list[CopyFigure]:
    """Put and get figures for one object size, each beside memcpy of the same bytes."""
    objects = max(BATCH, int(gib * GIB) // object_bytes)
    source = random_source(objects, object_bytes)
    destination = prefaulted(objects, object_bytes)
    keys = [f"bench-{object_bytes}-{index}" for index in range(objects)]
    batches = [range(start, min(start + BATCH, objects)) for start in range(0, objects, BATCH)]

    def memcpy() -> None:
        for index in range(objects):
            destination[index] = source[index]

    def put_all() -> None:
        for batch in batches:
            results = store.put_batch([keys[i] for i in batch], [source[i] for i in batch])
            assert all(results), "the server rejected a put"

    def get_all() -> None:
        for batch in batches:
            statuses = store.get_batch_into(
                [keys[i] for i in batch], [destination[i] for i in batch]
            )
            assert all(status is LoadStatus.HIT for status in statuses), statuses

    memcpy_times, put_times, get_times = [], [], []
    for _ in range(repeats):
        memcpy_times.append(timed_seconds(memcpy))
        put_times.append(timed_seconds(put_all, prepare=store.clear))
    for _ in range(repeats):
        memcpy_times.append(timed_seconds(memcpy))
        get_times.append(timed_seconds(get_all))
    assert np.array_equal(destination[objects // 2], source[objects // 2])
    assert store.stats().evictions == 0, "the server evicted; figures would mislead"
    store.clear()
    moved = objects * object_bytes
    memcpy_gbps = moved / min(memcpy_times) / 1e9
    return [
        CopyFigure(operation, object_bytes, objects, moved / min(times) / 1e9, memcpy_gbps)
        for operation, times in (("put", put_times), ("get", get_times))
    ]


def measure_lookup(store: ServerStore, calls: int) -> LookupFigure:
    """Latency of one batched lookup of 1,000 keys over the socket, half resident."""
    payload = np.zeros(64, dtype=np.uint8)
    stored = [f"umbp:bench:lookup-key-{index:08d}" for index in range(0, LOOKUP_KEYS, 2)]
    for start in range(0, len(stored), BATCH):
        batch = stored[start : start + BATCH]
        assert all(store.put_batch(batch, [payload] * len(batch)))
    asked = [f"umbp:bench:lookup-key-{index:08d}" for index in range(LOOKUP_KEYS)]
    assert sum(store.lookup(asked)) == LOOKUP_KEYS // 2
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        store.lookup(asked)
        samples.append((time.perf_counter() - start) * 1e6)
    store.clear()
    samples.sort()
    return LookupFigure(
        keys=LOOKUP_KEYS,
        median_us=statistics.median(samples),
        best_us=samples[0],
        p99_us=samples[int(len(samples) * 0.99)],
    )


def print_table(copies: list[CopyFigure], lookup: LookupFigure) -> None:
    print(f"{'case':<12}{'objects':>9}{'server GB/s':>13}{'memcpy GB/s':>13}{'ratio':>8}")
    for figure in copies:
        case = f"{figure.operation} {_size(figure.object_bytes)}"
        print(
            f"{case:<12}{figure.objects:>9}{figure.server_gbps:>13.2f}"
            f"{figure.memcpy_gbps:>13.2f}{figure.ratio:>7.2f}x"
        )
    print(
        "server: ServerStore in this process, umbp serve in another (64 KiB pages, "
        f"batches of {BATCH}); memcpy: numpy copy of the same objects, one by one, into a "
        "prefaulted buffer (ratio = server / memcpy)"
    )
    print(
        f"lookup of {lookup.keys} keys over the socket: median {lookup.median_us:.1f} us, "
        f"best {lookup.best_us:.1f} us, p99 {lookup.p99_us:.1f} us"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def run(arguments: argparse.Namespace) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="umbp-bench-", dir="/tmp")
    largest = max(
        max(BATCH, int(arguments.gib * GIB) // size) * size for size in OBJECT_SIZES
    )
    # Headroom below the high watermark: an eviction would make the figures mislead.
    capacity = int(largest / 0.8) + 64 * PAGE_BYTES
    server = start_server(
        os.path.join(directory, "s.sock"), capacity, page_bytes=PAGE_BYTES,
        log_path=os.path.join(directory, "serve.log"),
    )
    try:
        with ServerStore(os.path.join(directory, "s.sock"), io_timeout_s=30.0) as store:
            copies = [
                figure
                for size in OBJECT_SIZES
                for figure in measure_copies(store, size, arguments.gib, arguments.repeats)
            ]
            calls = QUICK_LOOKUP_CALLS if arguments.quick else LOOKUP_CALLS
            lookup = measure_lookup(store, calls)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)
    return {"copies": copies, "lookup": lookup}


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    figures = run(arguments)
    copies, lookup = figures["copies"], figures["lookup"]
    print_table(copies, lookup)
    elapsed = time.perf_counter() - started
    print(f"({elapsed:.1f} s, python {platform.python_version()}, {os.cpu_count()} cpus)")
    if arguments.json is not None:
        report = {
            "benchmark": "server",
            "quick": arguments.quick,
            "copies": [asdict(figure) | {"ratio": figure.ratio} for figure in copies],
            "lookup": asdict(lookup),
            "gib_per_case": arguments.gib,
            "repeats": arguments.repeats,
            "page_bytes": PAGE_BYTES,
            "batch": BATCH,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "seconds": elapsed,
        }
        arguments.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
