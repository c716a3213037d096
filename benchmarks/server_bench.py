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

`--profile`: where a put and a get of 1 MiB objects spend their time, the client's calls
wrapped in timers for these passes only (the reserve round trip, the copies with their
checksum, the commit round trip; a get's round trip, copies and one-way unpin), summed
over the passes and shown as a share of the memcpy of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.core.identity import namespace_key_prefix
from umbp.runtime.server import ServerStore, start_server
from umbp.runtime.server import client as client_module
from umbp.runtime.server.link import ServerLink

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


def parse_arguments() -> argparse.Namespace:
    def profile_option(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--profile", action="store_true",
                            help="also break a 1 MiB put and get down into their phases")

    return measure.throughput_arguments(__doc__.split("\n\n")[0], default_gib=1.0,
                                        quick_gib=0.125, more=profile_option)


PHASES = (
    (ServerLink, "begin", "round trip: reserve (put) or pin (get)"),
    (ServerLink, "follow_up", "round trip: commit (put)"),
    (ServerLink, "notify", "one-way unpin (get)"),
    (client_module, "write_regions", "copies into the pool, hashed"),
    (client_module, "read_regions", "copies out of the pool, hashed"),
)


def profile_phases(store: ServerStore, gib: float, repeats: int) -> dict[str, float]:
    """Seconds per phase of `repeats` put and get passes of 1 MiB objects, beside the
    seconds of as many memcpy passes of the same bytes."""
    object_bytes = 1 << 20
    objects = max(BATCH, int(gib * measure.GIB) // object_bytes)
    source = measure.random_source(objects, object_bytes)
    destination = measure.prefaulted(objects, object_bytes)
    keys = [f"profile-{index}" for index in range(objects)]
    batches = measure.batch_ranges(objects, BATCH)
    memcpy = measure.copy_row_by_row(source, destination)
    put = measure.put_in_batches(store, keys, source, batches)
    get = measure.get_in_batches(store, keys, destination, batches)
    put()  # warm: the pool's pages touched once
    totals = {"memcpy": 0.0, "put": 0.0, "get": 0.0}
    with measure.phase_timers(PHASES) as spent:
        for _ in range(repeats):
            store.clear()
            for name, run in (("memcpy", memcpy), ("put", put), ("get", get)):
                totals[name] += measure.timed_seconds(run)
    store.clear()
    return {**totals, **spent}


def measure_copies(
    store: ServerStore, object_bytes: int, gib: float, repeats: int
) -> list[CopyFigure]:
    """Put and get figures for one object size, each beside memcpy of the same bytes."""
    objects = max(BATCH, int(gib * measure.GIB) // object_bytes)
    source = measure.random_source(objects, object_bytes)
    destination = measure.prefaulted(objects, object_bytes)
    keys = [f"bench-{object_bytes}-{index}" for index in range(objects)]
    batches = measure.batch_ranges(objects, BATCH)

    memcpy = measure.copy_row_by_row(source, destination)
    times = measure.time_alternately(
        repeats,
        {"memcpy": memcpy, "put": measure.put_in_batches(store, keys, source, batches)},
        prepare={"put": store.clear},
    )
    measure.time_alternately(
        repeats,
        {"memcpy": memcpy, "get": measure.get_in_batches(store, keys, destination, batches)},
        into=times,
    )
    assert np.array_equal(destination[objects // 2], source[objects // 2])
    assert store.stats().evictions == 0, "the server evicted; figures would mislead"
    store.clear()
    moved = objects * object_bytes
    memcpy_gbps = measure.best_gbps(moved, times["memcpy"])
    return [
        CopyFigure(
            operation,
            object_bytes,
            objects,
            measure.best_gbps(moved, times[operation]),
            memcpy_gbps,
        )
        for operation in ("put", "get")
    ]


def measure_lookup(store: ServerStore, calls: int) -> measure.LookupFigure:
    """Latency of one batched lookup of 1,000 keys of one namespace (an engine's prompt)
    over the socket, half resident."""
    payload = np.zeros(64, dtype=np.uint8)
    prefix = namespace_key_prefix("bench")
    stored = [f"{prefix}lookup-key-{index:08d}" for index in range(0, LOOKUP_KEYS, 2)]
    for start in range(0, len(stored), BATCH):
        batch = stored[start : start + BATCH]
        assert all(store.put_batch(batch, [payload] * len(batch)))
    asked = [f"{prefix}lookup-key-{index:08d}" for index in range(LOOKUP_KEYS)]
    assert sum(store.lookup(asked)) == LOOKUP_KEYS // 2
    figure = measure.measure_lookup_latency(lambda: store.lookup(asked), LOOKUP_KEYS, calls)
    store.clear()
    return figure


def print_table(copies: list[CopyFigure], lookup: measure.LookupFigure) -> None:
    print(f"{'case':<12}{'objects':>9}{'server GB/s':>13}{'memcpy GB/s':>13}{'ratio':>8}")
    for figure in copies:
        case = f"{figure.operation} {measure.size_label(figure.object_bytes)}"
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


def run(arguments: argparse.Namespace) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="umbp-bench-", dir="/tmp")
    largest = max(
        max(BATCH, int(arguments.gib * measure.GIB) // size) * size for size in OBJECT_SIZES
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
            profile = (profile_phases(store, arguments.gib, arguments.repeats)
                       if arguments.profile else None)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)
    return {"copies": copies, "lookup": lookup, "profile": profile}


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    figures = run(arguments)
    copies, lookup = figures["copies"], figures["lookup"]
    print_table(copies, lookup)
    if figures["profile"] is not None:
        measure.print_profile("1 MiB objects, batches of 32, seconds summed over the "
                              "passes, / memcpy:", figures["profile"], "memcpy")
    elapsed = time.perf_counter() - started
    measure.print_run_footer(elapsed)
    if arguments.json is not None:
        report = {
            "benchmark": "server",
            "quick": arguments.quick,
            "copies": measure.rows_with_ratio(copies),
            "lookup": asdict(lookup),
            "profile_seconds": figures["profile"],
            "gib_per_case": arguments.gib,
            "repeats": arguments.repeats,
            "page_bytes": PAGE_BYTES,
            "batch": BATCH,
        }
        measure.write_report(arguments.json, report, elapsed)


if __name__ == "__main__":
    main()
