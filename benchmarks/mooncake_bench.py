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

A worker's whole path (`measure_kv_path`), same segments: 512 KiB objects (8 layers of
float32 K/V blocks, as the stall benchmark's model) gathered from paged KV into
registered staging rows and put, then got and scattered back, 32 at a time. raw: plain
copies and Mooncake's calls; umbp: the copies hashing as they move, the put given their
checksums, the get verified by them (`ChecksumsFromCopy`); before: plain copies and
`put_batch` / `get_batch_into`. ratio = umbp / raw, before ratio = before / raw.

`--profile`: with the local segment, where `MooncakeStore`'s put and get of 1 MiB objects
spend their time beside the raw calls (the Mooncake call, the size query, the checksum
wrapped in timers), summed over `--repeats` passes, as a share of the raw call's time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.gpu.copier import BlockCopier
from umbp.runtime.contract import LoadStatus
from umbp.runtime.mooncake import transfer
from umbp.runtime.mooncake.store import MooncakeStore
from umbp.testing.mooncake_master import MooncakeMaster

BATCH = 32
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
    def profile_option(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--profile", action="store_true",
                            help="also break a local 1 MiB put and get down into phases")

    return measure.throughput_arguments(
        __doc__.split("\n\n")[0], default_gib=0.25, quick_gib=1 / 32, more=profile_option
    )


PHASES = (
    (transfer.TrailerTransfers, "_transfer", "Mooncake call (with its trailer piece)"),
    (transfer.TrailerTransfers, "_stored_sizes", "size query (get)"),
    (transfer, "checksum", "xxh3 of objects Mooncake copied"),
)


def profile_phases(store: MooncakeStore, gib: float, repeats: int) -> dict[str, float]:
    """Seconds per phase of `repeats` put and get passes of 1 MiB objects from registered
    buffers, beside as many raw `batch_put_from` / `batch_get_into` passes."""
    raw, object_bytes = store.raw_client, measure.MIB
    objects = max(BATCH, int(gib * measure.GIB) // object_bytes)
    source = measure.random_source(objects, object_bytes)
    destination = measure.prefaulted(objects, object_bytes)
    for array in (source, destination):
        store.register_host_memory(array.ctypes.data, array.nbytes)
    batches = measure.batch_ranges(objects, BATCH)
    keys = [f"profile-{index}" for index in range(objects)]
    raw_keys = [f"profile-raw-{index}" for index in range(objects)]
    sizes = [object_bytes] * BATCH

    def raw_call(call: Any, base: int) -> Callable[[], None]:
        def run() -> None:
            for batch in batches:
                call([raw_keys[i] for i in batch],
                     [base + i * object_bytes for i in batch], sizes[: len(batch)])
        return run

    runs = {
        "raw put": raw_call(raw.batch_put_from, source.ctypes.data),
        "umbp put": measure.put_in_batches(store, keys, source, batches),
        "raw get": raw_call(raw.batch_get_into, destination.ctypes.data),
        "umbp get": measure.get_in_batches(store, keys, destination, batches),
    }
    runs["raw put"]()
    runs["umbp put"]()  # warm
    totals = dict.fromkeys(runs, 0.0)
    with measure.phase_timers(PHASES) as spent:
        for _ in range(repeats):
            assert store.clear()
            for name, run in runs.items():
                totals[name] += measure.timed_seconds(run)
    assert store.clear()
    for array in (source, destination):
        store.unregister_host_memory(array.ctypes.data)
    return {**totals, **spent}


def measure_copies(
    store: MooncakeStore, segment: str, object_bytes: int, gib: float, repeats: int
) -> list[CopyFigure]:
    raw = store.raw_client
    objects = max(BATCH, int(gib * measure.GIB) // object_bytes)
    rng = np.random.default_rng(object_bytes)
    source = measure.prefaulted(objects, object_bytes)
    source.reshape(-1)[:] = rng.integers(0, 256, size=objects * object_bytes, dtype=np.uint8)
    destination = measure.prefaulted(objects, object_bytes)
    loose_source = source.copy()  # not registered: MooncakeStore bounces these
    loose_destination = measure.prefaulted(objects, object_bytes)
    for array in (source, destination):
        store.register_host_memory(array.ctypes.data, array.nbytes)
    batches = measure.batch_ranges(objects, BATCH)
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
        return measure.put_in_batches(store, umbp_keys, rows, batches)

    def umbp_get(rows: list[Any]) -> Callable[[], None]:
        return measure.get_in_batches(store, umbp_keys, rows, batches)

    def hash_all() -> None:
        for row in source_rows:
            xxhash.xxh3_64_intdigest(row)

    def clear() -> None:
        assert store.clear()

    # Untimed warm-up: a client's first transfers to a segment are markedly slower.
    raw_put()
    umbp_put(source_rows)()
    times = measure.time_alternately(
        repeats,
        {
            "raw put": raw_put,
            "umbp put": umbp_put(source_rows),
            "bounce put": umbp_put(loose_source_rows),
            "xxh3": hash_all,
        },
        prepare={"raw put": clear, "umbp put": clear, "bounce put": clear},
    )
    clear()
    raw_put()
    umbp_put(source_rows)()
    measure.time_alternately(
        repeats,
        {
            "raw get": raw_get,
            "umbp get": umbp_get(destination_rows),
            "bounce get": umbp_get(loose_destination_rows),
        },
        into=times,
    )
    assert np.array_equal(destination[objects // 2], source[objects // 2])
    assert np.array_equal(loose_destination[objects - 1], source[objects - 1])
    clear()
    for array in (source, destination):
        store.unregister_host_memory(array.ctypes.data)

    moved = objects * object_bytes
    gbps = {name: measure.best_gbps(moved, samples) for name, samples in times.items()}
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


@dataclass(frozen=True)
class KvFigure:
    segment: str
    operation: str
    object_bytes: int
    objects: int
    umbp_gbps: float
    before_gbps: float
    raw_gbps: float

    @property
    def ratio(self) -> float:
        return self.umbp_gbps / self.raw_gbps

    @property
    def before_ratio(self) -> float:
        return self.before_gbps / self.raw_gbps


KV_LAYERS, KV_TOKENS, KV_HEADS, KV_HEAD_DIM = 8, 16, 8, 64  # 512 KiB objects, as stall_bench


def measure_kv_path(
    store: MooncakeStore, segment: str, gib: float, repeats: int
) -> list[KvFigure]:
    """A worker's path between paged KV blocks and Mooncake, through registered staging
    rows `BATCH` objects at a time: the copy between the blocks and the rows, then the
    transfer. raw: plain copies and Mooncake's own calls; umbp: the copies hashing as they
    move (the gather keeping its rows in cache, as a worker's staged store does),
    `put_batch_checksummed` / `get_batch_unchecked` + `verify`; before: plain copies and
    `put_batch` / `get_batch_into` (the checksum a pass of its own)."""
    raw = store.raw_client
    layer_bytes = 2 * KV_TOKENS * KV_HEADS * KV_HEAD_DIM * 4
    object_bytes = KV_LAYERS * layer_bytes
    blocks = max(BATCH, int(gib * measure.GIB) // object_bytes)
    generator = torch.Generator().manual_seed(blocks)
    source = [torch.randn(2, blocks, KV_TOKENS, KV_HEADS, KV_HEAD_DIM, generator=generator)
              for _ in range(KV_LAYERS)]
    restored = [torch.zeros_like(layer) for layer in source]
    gather, scatter = BlockCopier(source, blocks), BlockCopier(restored, blocks)
    assert gather.object_bytes == object_bytes and gather.copies_hash
    staging = measure.prefaulted(BATCH, object_bytes)
    store.register_host_memory(staging.ctypes.data, staging.nbytes)
    rows = [staging[index] for index in range(BATCH)]
    pointers = [staging.ctypes.data + index * object_bytes for index in range(BATCH)]
    batches = [list(batch) for batch in measure.batch_ranges(blocks, BATCH)]
    keys = {way: [f"kv-{way}-{index}" for index in range(blocks)]
            for way in ("raw", "umbp", "before")}

    def put(way: str) -> Callable[[], None]:
        def run() -> None:
            for batch in batches:
                hashes = gather.hashes(len(batch), stream=False) if way == "umbp" else None
                gather.copy(batch, staging, to_kv=False, hashes=hashes).run_on_host()
                names = [keys[way][i] for i in batch]
                if way == "raw":
                    codes = raw.batch_put_from(names, pointers[: len(batch)],
                                               [object_bytes] * len(batch))
                    assert all(code == 0 for code in codes), codes
                    continue
                if hashes is not None:
                    digests = [int(d) for d in hashes.digests() if d is not None]
                    stored = store.put_batch_checksummed(names, rows[: len(batch)], digests)
                else:
                    stored = store.put_batch(names, rows[: len(batch)])
                assert all(stored), stored
        return run

    def get(way: str) -> Callable[[], None]:
        def run() -> None:
            for batch in batches:
                names = [keys[way][i] for i in batch]
                hashes = None
                if way == "raw":
                    codes = raw.batch_get_into(names, pointers[: len(batch)],
                                               [object_bytes] * len(batch))
                    assert all(code == object_bytes for code in codes), codes
                elif way == "before":
                    statuses = store.get_batch_into(names, rows[: len(batch)])
                    assert all(status is LoadStatus.HIT for status in statuses), statuses
                else:
                    unchecked = store.get_batch_unchecked(names, rows[: len(batch)])
                    hashes = scatter.hashes(len(batch))
                scatter.copy(batch, staging, to_kv=True, hashes=hashes).run_on_host()
                if hashes is not None:
                    statuses = unchecked.verify(hashes.digests())
                    assert all(status is LoadStatus.HIT for status in statuses), statuses
        return run

    def clear() -> None:
        assert store.clear()

    for way in ("raw", "umbp"):  # untimed warm-up
        put(way)()
    ways = ("raw", "umbp", "before")
    times = measure.time_alternately(
        repeats, {f"{way} put": put(way) for way in ways},
        prepare={f"{way} put": clear for way in ways})
    clear()
    for way in ways:
        put(way)()
    measure.time_alternately(repeats, {f"{way} get": get(way) for way in ways}, into=times)
    assert all(torch.equal(a, b) for a, b in zip(source, restored)), "a restore differs"
    clear()
    store.unregister_host_memory(staging.ctypes.data)
    gbps = {name: measure.best_gbps(blocks * object_bytes, samples)
            for name, samples in times.items()}
    return [KvFigure(segment, operation, object_bytes, blocks, gbps[f"umbp {operation}"],
                     gbps[f"before {operation}"], gbps[f"raw {operation}"])
            for operation in ("put", "get")]


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


def print_kv_table(figures: list[KvFigure]) -> None:
    print(f"{'KV blocks <-> Mooncake':<26}{'objects':>8}{'umbp GB/s':>11}{'raw GB/s':>10}"
          f"{'ratio':>8}{'before GB/s':>13}{'before ratio':>14}")
    for figure in figures:
        case = f"{figure.segment} {figure.operation} {measure.size_label(figure.object_bytes)}"
        print(f"{case:<26}{figure.objects:>8}{figure.umbp_gbps:>11.2f}{figure.raw_gbps:>10.2f}"
              f"{figure.ratio:>7.2f}x{figure.before_gbps:>13.2f}{figure.before_ratio:>13.2f}x")
    print("a worker's path through registered staging rows: raw: plain copies + Mooncake's "
          "batch_put_from/batch_get_into; umbp: copies hashing as they move + "
          "put_batch_checksummed / get_batch_unchecked; before: plain copies + put_batch / "
          "get_batch_into")


def print_table(copies: list[CopyFigure], lookups: list[LookupFigure]) -> None:
    print(
        f"{'case':<22}{'objects':>8}{'umbp GB/s':>11}{'raw GB/s':>10}{'ratio':>8}"
        f"{'bounce GB/s':>13}{'xxh3 GB/s':>11}"
    )
    for figure in copies:
        case = f"{figure.segment} {figure.operation} {measure.size_label(figure.object_bytes)}"
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


HOLDER = """
import sys
from umbp.runtime.mooncake.store import MooncakeStore
store = MooncakeStore(sys.argv[1], local_hostname="127.0.0.1",
                      global_segment_bytes=int(sys.argv[2]), local_buffer_bytes=0)
print("ready", flush=True)
sys.stdin.readline()
store.close()
"""


def measure_segment(
    segment: str, arguments: argparse.Namespace
) -> tuple[list[CopyFigure], list[KvFigure], LookupFigure]:
    """All figures with the segment in this process ("local") or in another ("remote")."""
    moved = int(arguments.gib * measure.GIB)
    # Room for the KV path's raw, umbp and before copies at once, below the 0.9
    # eviction mark.
    segment_bytes = max(256 * measure.MIB, int(3 * moved / 0.8))
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
            local_buffer_bytes=64 * measure.MIB,
        )
        try:
            copies = measure_copies(store, segment, measure.MIB, arguments.gib, arguments.repeats)
            copies += measure_copies(
                store, segment, 100 << 10, arguments.gib, arguments.repeats
            )
            kv = measure_kv_path(store, segment, arguments.gib, arguments.repeats)
            lookup = measure_lookup(store, segment)
            if segment == "local" and arguments.profile:
                measure.print_profile(
                    "local, 1 MiB objects, batches of 32, seconds summed over the passes, "
                    "/ the raw put's:",
                    profile_phases(store, arguments.gib, arguments.repeats), "raw put")
        finally:
            store.close()
            if holder is not None:
                holder.communicate("exit\n", timeout=60)
    return copies, kv, lookup


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    copies: list[CopyFigure] = []
    kv: list[KvFigure] = []
    lookups: list[LookupFigure] = []
    for segment in ("local", "remote"):
        segment_copies, segment_kv, lookup = measure_segment(segment, arguments)
        copies += segment_copies
        kv += segment_kv
        lookups.append(lookup)
    print_table(copies, lookups)
    print_kv_table(kv)
    elapsed = time.perf_counter() - started
    measure.print_run_footer(elapsed)
    if arguments.json is not None:
        report = {
            "benchmark": "mooncake",
            "quick": arguments.quick,
            "copies": measure.rows_with_ratio(copies),
            "kv_path": [{**row, "before_ratio": figure.before_ratio} for row, figure
                        in zip(measure.rows_with_ratio(kv), kv)],
            "lookups": measure.rows_with_ratio(lookups),
            "gib_per_case": arguments.gib,
            "repeats": arguments.repeats,
        }
        measure.write_report(arguments.json, report, elapsed)


if __name__ == "__main__":
    main()
