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
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.runtime import LoadStatus
from umbp.runtime.ssd.tier import SsdTier

SLOT_BYTES = 64 << 10  # the tier's default
ALIGNMENT = 4096  # page-aligned buffers: neither side pays first-touch faults in the loops
SOURCE_BLOCK_BYTES = 16 << 20


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
    def directory_option(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dir", type=Path, default=None, help="where to put the files")

    return measure.throughput_arguments(
        __doc__.split("\n\n")[0], default_gib=1.0, quick_gib=0.0625, more=directory_option
    )


def measure_io(
    directory: Path, object_bytes: int, gib: float, repeats: int
) -> tuple[list[IoFigure], ReopenFigure]:
    """Put and get figures for one object size, each beside plain I/O of the same bytes."""
    objects = max(8, int(gib * measure.GIB) // object_bytes)
    source = measure.random_source(
        objects, object_bytes, block_bytes=SOURCE_BLOCK_BYTES, alignment=ALIGNMENT
    )
    destination = measure.prefaulted(objects, object_bytes, ALIGNMENT)
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

    times = measure.time_alternately(
        repeats, {"plain put": plain_put, "put": tier_put}, prepare={"put": tier.clear}
    )
    measure.time_alternately(repeats, {"plain get": plain_get, "get": tier_get}, into=times)
    assert np.array_equal(destination[objects // 2], source[objects // 2])
    assert tier.stats().evictions == 0, "benchmark tier evicted; figures would mislead"
    tier.close()
    os.close(plain)
    reopen_seconds = measure.timed_seconds(
        lambda: SsdTier(tier_directory, capacity, SLOT_BYTES).close()
    )
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
            measure.best_gbps(moved, times[operation]),
            measure.best_gbps(moved, times[f"plain {operation}"]),
        )
        for operation in ("put", "get")
    ]
    return figures, ReopenFigure(objects, objects * slots_per_object, reopen_seconds)


def print_table(figures: list[IoFigure], reopens: list[ReopenFigure]) -> None:
    print(
        f"{'case':<12}{'slot':>9}{'objects':>9}{'tier GB/s':>11}{'plain GB/s':>12}{'ratio':>8}"
    )
    for figure in figures:
        case = f"{figure.operation} {measure.size_label(figure.object_bytes)}"
        print(
            f"{case:<12}{measure.size_label(figure.slot_bytes):>9}{figure.objects:>9}"
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
    measure.print_run_footer(elapsed)
    if arguments.json is not None:
        report = {
            "benchmark": "ssd",
            "quick": arguments.quick,
            "io": measure.rows_with_ratio(figures),
            "reopen": [asdict(reopen) for reopen in reopens],
            "gib_per_case": arguments.gib,
            "repeats": arguments.repeats,
            "page_cache": "warm",
        }
        measure.write_report(arguments.json, report, elapsed)


if __name__ == "__main__":
    main()
