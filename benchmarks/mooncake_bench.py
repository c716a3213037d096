"""MooncakeStore against Mooncake's own client calls, side by side in one run.

    python benchmarks/mooncake_bench.py [--json FILE] [--gib 0.25] [--repeats 5] [--quick]

Starts a `mooncake_master` on loopback and measures twice: with the segment inside the
benchmark's own client ("local": Mooncake copies with memcpy, the worst case for any
per-byte overhead) and with the segment in a second process on this machine ("remote":
bytes cross Mooncake's TCP transport, as between nodes). For
1 MiB and 100 KiB objects, in batches of 32, it moves `--gib` GiB with
`MooncakeStore.put_batch` / `get_batch_into` (checksum trailer, size query and checks
included) and with the raw `batch_put_from` / `batch_get_into` of the same client, on the
same registered buffers; raw and MooncakeStore passes alternate and each figure is the
best of `--repeats`. ratio = MooncakeStore / raw (goal >= 0.9). Two reference rows:
MooncakeStore from *unregistered* buffers (the bounce-buffer path), and xxh3-64 alone over
the same bytes (what the checksum costs by itself). Lookup: one batched call for 1,000
keys (half resident), `lookup` against `batch_is_exist`, median of many calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.runtime import LoadStatus
from umbp.runtime.mooncake import MooncakeStore
from umbp.testing.mooncake_master import MooncakeMaster

GIB = 1 << 30
MIB = 1 << 20
BATCH = 32
ALIGNMENT = 64
LOOKUP_KEYS = 1000
LOOKUP_CALLS = 300


@dataclass(frozen=True)
class CopyFigure:
    segment: str
    operation: str
    object_bytes: int
    objects: int
    umbp_gbps: float
    raw_gbps: float
    bounce_gbps: float
    xxh3_gbps: float

    @property
    def ratio(self) -> float:
        return self.umbp_gbps / self.raw_gbps


@dataclass(frozen=True)
class LookupFigure:
    segment: str
    keys: int
    umbp_median_us: float
    raw_median_us: float

    @property
    def ratio(self) -> float:
        return self.raw_median_us / self.umbp_median_us


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--gib", type=float, default=0.25, help="GiB moved per case")
    parser.add_argument("--repeats", type=int, default=5, help="passes per figure (best)")
    parser.add_argument("--quick", action="store_true", help="1/32 GiB per case, 2 passes")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.gib, arguments.repeats = min(arguments.gib, 1 / 32), min(arguments.repeats, 2)
    return arguments


def prefaulted(objects: int, object_bytes: int) -> Any:
    """Rows in one 64-byte-aligned buffer whose pages are all touched (see pool_bench)."""
    raw = np.empty(objects * object_bytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    array = raw[start : start + objects * object_bytes].reshape(objects, object_bytes)
    array.fill(0)
    return array


def best_seconds(run: Callable[[], None], prepare: Callable[[], None] | None = None) -> float:
    if prepare is not None:
        prepare()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure_copies(
    store: MooncakeStore, segment: str, object_bytes: int, gib: float, repeats: int
) -> list[CopyFigure]:
    raw = store.raw_client
    objects = max(BATCH, int(gib * GIB) // object_bytes)
    rng = np.random.default_rng(object_bytes)
    source = prefaulted(objects, object_bytes)
    source.reshape(-1)[:] = rng.integers(0, 256, size=objects * object_bytes, dtype=np.uint8)
    destination = prefaulted(objects, object_bytes)
    loose_source = source.copy()  # not registered: MooncakeStore bounces these
    loose_destination = prefaulted(objects, object_bytes)
    for array in (source, destination):
        store.register_host_memory(array.ctypes.data, array.nbytes)
    batches = [range(start, min(start + BATCH, objects)) for start in range(0, objects, BATCH)]
    raw_keys = [f"raw-{object_bytes}-{index}" for index in range(objects)]
    umbp_keys = [f"umbp-{object_bytes}-{index}" for index in range(objects)]
    source_rows = [source[index] for index in range(objects)]
    destination_rows = [destination[index] for index in range(objects)]
    loose_source_rows = [loose_source[index] for index in range(objects)]
    loose_destination_rows = [loose_destination[index] for index in range(objects)]
    pointers = [source.ctypes.data + index * object_bytes for index in range(objects)]
    out_pointers = [destination.ctypes.data + index * object_bytes for index in range(objects)]
    sizes = [object_bytes] * BATCH

    def raw_put() -> None:
        for batch in batches:
            codes = raw.batch_put_from(
                [raw_keys[i] for i in batch], [pointers[i] for i in batch], sizes[: len(batch)]
            )
            assert all(code == 0 for code in codes), codes

    def raw_get() -> None:
        for batch in batches:
            codes = raw.batch_get_into(
                [raw_keys[i] for i in batch],
                [out_pointers[i] for i in batch],
                sizes[: len(batch)],
            )
            assert all(code == object_bytes for code in codes), codes

    def umbp_put(rows: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for batch in batches:
                results = store.put_batch([umbp_keys[i] for i in batch], [rows[i] for i in batch])
                assert all(results), results

        return run

    def umbp_get(rows: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for batch in batches:
                statuses = store.get_batch_into(
                    [umbp_keys[i] for i in batch], [rows[i] for i in batch]
                )
                assert all(status is LoadStatus.HIT for status in statuses), statuses

        return run

    def hash_all() -> None:
        for row in source_rows:
            xxhash.xxh3_64_intdigest(row)

    def clear() -> None:
        assert store.clear()

    times: dict[str, list[float]] = {
        name: [] for name in ("raw put", "umbp put", "bounce put", "raw get", "umbp get",
                              "bounce get", "xxh3")
    }
    # Untimed warm-up: a client's first transfers to a segment are markedly slower.
    raw_put()
    umbp_put(source_rows)()
    for _ in range(repeats):
        times["raw put"].append(best_seconds(raw_put, prepare=clear))
        times["umbp put"].append(best_seconds(umbp_put(source_rows), prepare=clear))
        times["bounce put"].append(best_seconds(umbp_put(loose_source_rows), prepare=clear))
        times["xxh3"].append(best_seconds(hash_all))
    clear()
    raw_put()
    umbp_put(source_rows)()
    for _ in range(repeats):
        times["raw get"].append(best_seconds(raw_get))
        times["umbp get"].append(best_seconds(umbp_get(destination_rows)))
        times["bounce get"].append(best_seconds(umbp_get(loose_destination_rows)))
    assert np.array_equal(destination[objects // 2], source[objects // 2])
    assert np.array_equal(loose_destination[objects - 1], source[objects - 1])
    clear()
    for array in (source, destination):
        store.unregister_host_memory(array.ctypes.data)

    moved = objects * object_bytes
    gbps = {name: moved / min(samples) / 1e9 for name, samples in times.items()}
    return [
        CopyFigure(
            segment,
            operation,
            object_bytes,
            objects,
            gbps[f"umbp {operation}"],
            gbps[f"raw {operation}"],
            gbps[f"bounce {operation}"],
            gbps["xxh3"],
        )
        for operation in ("put", "get")
    ]


def measure_lookup(store: MooncakeStore, segment: str) -> LookupFigure:
    raw = store.raw_client
    assert store.clear()
    stored = [f"lookup-{index}" for index in range(0, 2 * LOOKUP_KEYS, 2)]
    assert all(store.put_batch(stored, [b"v"] * len(stored)))
    asked = [f"lookup-{index}" for index in range(LOOKUP_KEYS)]
    assert sum(store.lookup(asked)) == LOOKUP_KEYS // 2
    umbp_samples: list[float] = []
    raw_samples: list[float] = []
    for _ in range(LOOKUP_CALLS):
        start = time.perf_counter()
        raw.batch_is_exist(asked)
        raw_samples.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        store.lookup(asked)
        umbp_samples.append((time.perf_counter() - start) * 1e6)
    assert store.clear()
    return LookupFigure(
        segment, LOOKUP_KEYS, statistics.median(umbp_samples), statistics.median(raw_samples)
    )


def print_table(copies: list[CopyFigure], lookups: list[LookupFigure]) -> None:
    print(
        f"{'case':<22}{'objects':>8}{'umbp GB/s':>11}{'raw GB/s':>10}{'ratio':>8}"
        f"{'bounce GB/s':>13}{'xxh3 GB/s':>11}"
    )
    for figure in copies:
        case = f"{figure.segment} {figure.operation} {_size(figure.object_bytes)}"
        print(
            f"{case:<22}{figure.objects:>8}{figure.umbp_gbps:>11.2f}{figure.raw_gbps:>10.2f}"
            f"{figure.ratio:>7.2f}x{figure.bounce_gbps:>13.2f}{figure.xxh3_gbps:>11.2f}"
        )
    print(
        "umbp: MooncakeStore from registered buffers; raw: batch_put_from/batch_get_into "
        "on the same buffers; bounce: MooncakeStore from unregistered buffers; xxh3: the "
        "checksum alone over the same bytes"
    )
    for lookup in lookups:
        print(
            f"{lookup.segment} lookup of {lookup.keys} keys: umbp median "
            f"{lookup.umbp_median_us:.0f} us, raw batch_is_exist median "
            f"{lookup.raw_median_us:.0f} us, ratio {lookup.ratio:.2f}x"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= MIB else f"{nbytes >> 10} KiB"


HOLDER = """
import sys
from umbp.runtime.mooncake import MooncakeStore
store = MooncakeStore(sys.argv[1], local_hostname="127.0.0.1",
                      global_segment_bytes=int(sys.argv[2]), local_buffer_bytes=0)
print("ready", flush=True)
sys.stdin.readline()
store.close()
"""


def measure_segment(
    segment: str, arguments: argparse.Namespace
) -> tuple[list[CopyFigure], LookupFigure]:
    """All figures with the segment in this process ("local") or in another ("remote")."""
    moved = int(arguments.gib * GIB)
    # Room for the raw and the MooncakeStore copies at once, below the 0.9 eviction mark.
    segment_bytes = max(256 * MIB, int(2 * moved / 0.8))
    repo = Path(__file__).resolve().parents[1]
    with MooncakeMaster.start() as master:
        holder = None
        if segment == "remote":
            holder = subprocess.Popen(
                [sys.executable, "-c", HOLDER, master.address, str(segment_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
            )
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        store = MooncakeStore(
            master.address,
            local_hostname="127.0.0.1",
            global_segment_bytes=segment_bytes if holder is None else 0,
            local_buffer_bytes=64 * MIB,
        )
        try:
            copies = measure_copies(store, segment, MIB, arguments.gib, arguments.repeats)
            copies += measure_copies(
                store, segment, 100 << 10, arguments.gib, arguments.repeats
            )
            lookup = measure_lookup(store, segment)
        finally:
            store.close()
            if holder is not None:
                holder.communicate("exit\n", timeout=60)
    return copies, lookup


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    copies: list[CopyFigure] = []
    lookups: list[LookupFigure] = []
    for segment in ("local", "remote"):
        segment_copies, lookup = measure_segment(segment, arguments)
        copies += segment_copies
        lookups.append(lookup)
    print_table(copies, lookups)
    elapsed = time.perf_counter() - started
    print(f"({elapsed:.1f} s, python {platform.python_version()}, {os.cpu_count()} cpus)")
    if arguments.json is not None:
        report = {
            "benchmark": "mooncake",
            "quick": arguments.quick,
            "copies": [asdict(figure) | {"ratio": figure.ratio} for figure in copies],
            "lookups": [asdict(lookup) | {"ratio": lookup.ratio} for lookup in lookups],
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
