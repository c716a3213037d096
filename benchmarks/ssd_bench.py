"""SsdTier throughput against plain pwrite/preadv, measured side by side in one run.

    python benchmarks/ssd_bench.py [--json FILE] [--gib 1.0] [--repeats 5] [--quick] [--dir D]

For 64 KiB and 1 MiB objects it moves `--gib` GiB through `SsdTier.put` and
`SsdTier.get_into` (checksums, header records and index included), and moves the same
bytes with plain `os.pwrite` / `os.preadv`, object by object, to and from a preallocated
file in the same directory: what the file system gives without the tier. Tier and plain
passes alternate so that drift in machine speed hits both alike; each figure is the best of
`--repeats` passes.

Page cache warm: both files stay in memory (no fsync, no O_DIRECT), which is how the tier
runs (it never fsyncs per put), so the figures compare the tier's overhead with the
kernel's copy, not disk speed. A cold-cache disk read would be slower for both alike. It
also times reopening the tier with every object resident (the header scan that rebuilds
the index).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.runtime import LoadStatus
from umbp.runtime.ssd_tier import SsdTier

GIB = 1 << 30
SLOT_BYTES = 64 << 10  # the tier's default
ALIGNMENT = 4096


@dataclass(frozen=True)
class IoFigure:
    """One row: a tier operation against plain pwrite/preadv of the same bytes."""

    operation: str
    object_bytes: int
    slot_bytes: int
    objects: int
    tier_gbps: float
    plain_gbps: float

    @property
    def ratio(self) -> float:
        return self.tier_gbps / self.plain_gbps


@dataclass(frozen=True)
class ReopenFigure:
    objects: int
    slots: int
    seconds: float


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB moved per case")
    parser.add_argument("--repeats", type=int, default=5, help="passes per figure (best)")
    parser.add_argument("--quick", action="store_true", help="1/16 GiB per case, 2 passes")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the files")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.gib, arguments.repeats = min(arguments.gib, 0.0625), min(arguments.repeats, 2)
    return arguments


def prefaulted(objects: int, object_bytes: int) -> Any:
    """`objects` rows in one page-aligned buffer whose pages are all touched, so neither
    side pays first-touch faults inside the timed loops."""
    raw = np.empty(objects * object_bytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    array = raw[start : start + objects * object_bytes].reshape(objects, object_bytes)
    array.fill(0)
    return array


def random_source(objects: int, object_bytes: int) -> Any:
    """Random rows (a 16 MiB random block tiled: contents do not change I/O or hash speed)."""
    block = np.random.default_rng(0).integers(0, 256, size=16 << 20, dtype=np.uint8)
    source = prefaulted(objects, object_bytes)
    source.reshape(-1)[:] = np.resize(block, objects * object_bytes)
    return source


def timed_seconds(run: Callable[[], None], prepare: Callable[[], None] | None = None) -> float:
    if prepare is not None:
        prepare()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure_io(
    directory: Path, object_bytes: int, gib: float, repeats: int
) -> tuple[list[IoFigure], ReopenFigure]:
    """Put and get figures for one object size, each beside plain I/O of the same bytes."""
    objects = max(8, int(gib * GIB) // object_bytes)
    source = random_source(objects, object_bytes)
    destination = prefaulted(objects, object_bytes)
    keys = [f"bench-{object_bytes}-{index}" for index in range(objects)]
    slots_per_object = -(-object_bytes // SLOT_BYTES)
    capacity = objects * slots_per_object * SLOT_BYTES
    tier_directory = directory / f"tier-{object_bytes}"
    tier = SsdTier(tier_directory, capacity, SLOT_BYTES)
    plain_path = directory / f"plain-{object_bytes}.bin"
    plain = os.open(plain_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(plain, 0, objects * object_bytes)
    rows = [source[index] for index in range(objects)]
    outs = [destination[index] for index in range(objects)]

    def plain_put() -> None:
        for index in range(objects):
            written = os.pwrite(plain, rows[index], index * object_bytes)
            assert written == object_bytes

    def plain_get() -> None:
        for index in range(objects):
            count = os.preadv(plain, [outs[index]], index * object_bytes)
            assert count == object_bytes

    def tier_put() -> None:
        for index in range(objects):
            assert tier.put(keys[index], rows[index]), "benchmark tier rejected a put"

    def tier_get() -> None:
        for index in range(objects):
            assert tier.get_into(keys[index], outs[index]) is LoadStatus.HIT

    plain_put_times, plain_get_times, put_times, get_times = [], [], [], []
    for _ in range(repeats):
        plain_put_times.append(timed_seconds(plain_put))
        put_times.append(timed_seconds(tier_put, prepare=tier.clear))
    for _ in range(repeats):
        plain_get_times.append(timed_seconds(plain_get))
        get_times.append(timed_seconds(tier_get))
    assert np.array_equal(destination[objects // 2], source[objects // 2])
    assert tier.stats().evictions == 0, "benchmark tier evicted; figures would mislead"
    tier.close()
    os.close(plain)
    reopen_seconds = timed_seconds(lambda: SsdTier(tier_directory, capacity, SLOT_BYTES).close())
    reopened = SsdTier(tier_directory, capacity, SLOT_BYTES)
    assert reopened.stats().objects == objects
    reopened.close()

    moved = objects * object_bytes
    figures = [
        IoFigure(
            operation,
            object_bytes,
            SLOT_BYTES,
            objects,
            moved / min(times) / 1e9,
            moved / min(plain_times) / 1e9,
        )
        for operation, times, plain_times in (
            ("put", put_times, plain_put_times),
            ("get", get_times, plain_get_times),
        )
    ]
    return figures, ReopenFigure(objects, objects * slots_per_object, reopen_seconds)


def print_table(figures: list[IoFigure], reopens: list[ReopenFigure]) -> None:
    print(
        f"{'case':<12}{'slot':>9}{'objects':>9}{'tier GB/s':>11}{'plain GB/s':>12}{'ratio':>8}"
    )
    for figure in figures:
        case = f"{figure.operation} {_size(figure.object_bytes)}"
        print(
            f"{case:<12}{_size(figure.slot_bytes):>9}{figure.objects:>9}"
            f"{figure.tier_gbps:>11.2f}{figure.plain_gbps:>12.2f}{figure.ratio:>7.2f}x"
        )
    print(
        "plain: os.pwrite / os.preadv of the same objects, one by one, to a preallocated "
        "file in the same directory (ratio = tier / plain); page cache warm, no fsync"
    )
    for reopen in reopens:
        print(
            f"reopen with {reopen.objects} objects ({reopen.slots} slots): "
            f"{reopen.seconds * 1e3:.1f} ms"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="umbp-ssd-bench-", dir=arguments.dir) as where:
        directory = Path(where)
        figures, reopens = [], []
        for object_bytes in (64 << 10, 1 << 20):
            rows, reopen = measure_io(directory, object_bytes, arguments.gib, arguments.repeats)
            figures += rows
            reopens.append(reopen)
    print_table(figures, reopens)
    elapsed = time.perf_counter() - started
    print(f"({elapsed:.1f} s, python {platform.python_version()}, {os.cpu_count()} cpus)")
    if arguments.json is not None:
        report = {
            "benchmark": "ssd",
            "quick": arguments.quick,
            "io": [asdict(figure) | {"ratio": figure.ratio} for figure in figures],
            "reopen": [asdict(reopen) for reopen in reopens],
            "gib_per_case": arguments.gib,
            "repeats": arguments.repeats,
            "page_cache": "warm",
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "seconds": elapsed,
        }
        arguments.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
