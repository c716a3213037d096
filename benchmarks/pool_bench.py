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
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.runtime import SlabPool

BATCH = 32  # objects per put_batch / get_batch_into call, like one worker step
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


def parse_arguments() -> argparse.Namespace:
    return measure.throughput_arguments(__doc__.split("\n\n")[0], default_gib=1.0, quick_gib=0.125)


def measure_copies(
    object_bytes: int, page_bytes: int, gib: float, repeats: int
) -> list[CopyFigure]:
    """Put and get figures for one object size, each beside memcpy of the same bytes."""
    objects = max(BATCH, int(gib * measure.GIB) // object_bytes)
    source = measure.random_source(objects, object_bytes)
    destination = measure.prefaulted(objects, object_bytes)
    keys = [f"bench-{object_bytes}-{index}" for index in range(objects)]
    pages_per_object = -(-object_bytes // page_bytes)
    pool = SlabPool(
        int(objects * pages_per_object * page_bytes / 0.9) + page_bytes,
        page_bytes=page_bytes,
        high_watermark=0.95,
        low_watermark=0.9,
    )
    batches = measure.batch_ranges(objects, BATCH)

    memcpy = measure.copy_row_by_row(source, destination)

    def bulk_memcpy() -> None:
        np.copyto(destination, source)

    times = measure.time_alternately(
        repeats,
        {
            "bulk": bulk_memcpy,
            "memcpy": memcpy,
            "put": measure.put_in_batches(pool, keys, source, batches),
        },
        prepare={"put": pool.clear},
    )
    measure.time_alternately(
        repeats,
        {"memcpy": memcpy, "get": measure.get_in_batches(pool, keys, destination, batches)},
        into=times,
    )
    assert np.array_equal(destination[objects // 2], source[objects // 2])
    assert pool.stats().evictions == 0, "benchmark pool evicted; figures would mislead"
    pool.close()

    moved = objects * object_bytes
    memcpy_gbps = measure.best_gbps(moved, times["memcpy"])
    bulk_gbps = measure.best_gbps(moved, times["bulk"])
    return [
        CopyFigure(
            operation,
            object_bytes,
            page_bytes,
            objects,
            measure.best_gbps(moved, times[operation]),
            memcpy_gbps,
            bulk_gbps,
        )
        for operation in ("put", "get")
    ]


def measure_lookup() -> measure.LookupFigure:
    """Latency of one batched lookup of 1,000 keys, half of them resident."""
    pool = SlabPool(2 * LOOKUP_KEYS * 4096, page_bytes=4096)
    payload = np.zeros(64, dtype=np.uint8)
    stored = [f"lookup-{index}" for index in range(0, 2 * LOOKUP_KEYS, 2)]
    pool.put_batch(stored, [payload] * len(stored))
    asked = [f"lookup-{index}" for index in range(LOOKUP_KEYS)]
    assert sum(pool.lookup(asked)) == LOOKUP_KEYS // 2
    figure = measure.measure_lookup_latency(lambda: pool.lookup(asked), LOOKUP_KEYS, LOOKUP_CALLS)
    pool.close()
    return figure


def print_table(copies: list[CopyFigure], lookup: measure.LookupFigure) -> None:
    print(
        f"{'case':<12}{'page':>9}{'objects':>9}{'pool GB/s':>11}{'memcpy GB/s':>13}"
        f"{'ratio':>8}{'bulk GB/s':>11}"
    )
    for figure in copies:
        case = f"{figure.operation} {measure.size_label(figure.object_bytes)}"
        print(
            f"{case:<12}{measure.size_label(figure.page_bytes):>9}{figure.objects:>9}"
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


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    copies = measure_copies(64 << 10, 64 << 10, arguments.gib, arguments.repeats)
    copies += measure_copies(1 << 20, 256 << 10, arguments.gib, arguments.repeats)
    lookup = measure_lookup()
    print_table(copies, lookup)
    elapsed = time.perf_counter() - started
    measure.print_run_footer(elapsed)
    if arguments.json is not None:
        report = {
            "copies": measure.rows_with_ratio(copies),
            "lookup": asdict(lookup),
            "gib_per_case": arguments.gib,
            "repeats": arguments.repeats,
        }
        measure.write_report(arguments.json, report, elapsed)


if __name__ == "__main__":
    main()
