"""Many engines, one `umbp serve`: 1, 4, 8 and 16 client processes putting and getting at
once, every byte verified, beside memcpy measured in the same run.

    python benchmarks/clients_bench.py [--clients 1,4,8,16] [--mib 64] [--rounds 3]
                                       [--batch 8] [--json FILE] [--quick] [--pool-dir DIR]

A real server (64 KiB pages, DRAM only, room for every client's objects: nothing is
evicted) and up to 16 client processes, each a `ServerStore` as a worker holds one. Each
client owns `--mib` MiB of objects of 256 KiB, 512 KiB, 1 MiB and 2 MiB (in turn, every
object's bytes its own). A round: every active client puts all its objects in batches of
`--batch`, all starting together; then gets them back into other buffers, all starting
together; then compares every byte it got with what it put (untimed). Before its put
pass, a client also times numpy copies of the same objects into a prefaulted buffer
(memcpy), into a mapping in the pool's directory (/dev/shm or `--pool-dir`) like the
server's pool (memcpy to shm), and the same
with the xxh3-64 checksum a put computes (copy + checksum: the least a put does). Each
client's mapping of the pool is prefaulted first: the steady state of a worker that has
run a while (a first touch costs a minor fault per 4 KiB page, once per process).

Reported per client count: per-client throughput (median over clients of each client's
best round), p99 latency of one batch call, aggregate throughput (all bytes of a pass
over the time from the first client's start to the last one's end, best round), errors
(puts refused, loads that did not hit, bytes that differ: the goal is none), and the
server's CPU time per batch call (from /proc: what decides aggregate throughput on a host
with more cores, since the server's Python threads share one interpreter lock). The
single-client row is also given as a ratio to memcpy of the same bytes.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.runtime.contract import LoadStatus
from umbp.runtime.server import ServerStore, start_server
from umbp.runtime.server.launch import stop_server

OBJECT_SIZES = (256 << 10, 512 << 10, 1 << 20, 2 << 20)
PAGE_BYTES = 64 << 10
CLIENT_COUNTS = (1, 4, 8, 16)


# ------------------------------------------------------------------ client processes


def object_sizes(total_bytes: int) -> list[int]:
    """Sizes of one client's objects: 256 KiB, 512 KiB, 1 MiB, 2 MiB in turn."""
    sizes: list[int] = []
    while sum(sizes) + OBJECT_SIZES[len(sizes) % 4] <= total_bytes or not sizes:
        sizes.append(OBJECT_SIZES[len(sizes) % 4])
    return sizes


def object_bytes(client: int, sizes: list[int]) -> list[Any]:
    """Every object's own bytes: slices of one random block at offsets unique to the
    client and the object, 64-byte aligned rows (as torch allocates)."""
    block = np.random.default_rng(client).integers(0, 256, size=8 << 20, dtype=np.uint8)
    rows = []
    for index, size in enumerate(sizes):
        row = measure.prefaulted(1, size)[0]
        start = (index * 4099 + client * 65537) % (len(block) - size)
        row[:] = block[start : start + size]
        rows.append(row)
    return rows


@dataclass
class ClientRound:
    client: int
    put_seconds: float
    get_seconds: float
    memcpy_seconds: float
    memcpy_shm_seconds: float
    floor_seconds: float
    put_started: float
    put_ended: float
    get_started: float
    get_ended: float
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0


def client_main(client: int, endpoint: str, mib: int, batch: int, commands: Any,
                results: Any, barriers: dict[int, Any], pool_dir: str) -> None:
    """One client process: runs a round for each (client count, key prefix) command
    between that count's barriers, answers with its `ClientRound`; None ends it."""
    sizes = object_sizes(mib << 20)
    sources = object_bytes(client, sizes)
    destinations = [measure.prefaulted(1, size)[0] for size in sizes]
    memcpy_target = [measure.prefaulted(1, size)[0] for size in sizes]
    shm = _shm_mapping(sum(sizes), pool_dir)
    batches = measure.batch_ranges(len(sizes), batch)
    store = ServerStore(endpoint, io_timeout_s=120.0)
    _prefault_pool_mapping(store)
    try:
        while True:
            command = commands.get()
            if command is None:
                return
            count, prefix = command
            barrier = barriers[count]
            for destination in destinations:
                destination.fill(0)
            memcpy_seconds = _timed(lambda: _copy_rows(sources, memcpy_target))
            memcpy_shm_seconds = _timed(lambda: _copy_into(shm, sources))
            floor_seconds = _timed(lambda: _copy_into(shm, sources, checksum=True))
            keys = [f"{prefix}-c{client}-{index}" for index in range(len(sizes))]
            latencies: list[float] = []
            errors = 0
            barrier.wait()
            put_started = time.time()
            for rows in batches:
                started = time.perf_counter()
                stored = store.put_batch([keys[i] for i in rows], [sources[i] for i in rows])
                latencies.append((time.perf_counter() - started) * 1e3)
                errors += stored.count(False)
            put_ended = time.time()
            barrier.wait()
            get_started = time.time()
            for rows in batches:
                started = time.perf_counter()
                statuses = store.get_batch_into(
                    [keys[i] for i in rows], [destinations[i] for i in rows]
                )
                latencies.append((time.perf_counter() - started) * 1e3)
                errors += sum(status is not LoadStatus.HIT for status in statuses)
            get_ended = time.time()
            errors += sum(not np.array_equal(got, sent)
                          for got, sent in zip(destinations, sources))
            results.put(ClientRound(
                client, put_ended - put_started, get_ended - get_started, memcpy_seconds,
                memcpy_shm_seconds, floor_seconds, put_started, put_ended, get_started,
                get_ended,
                latencies, errors,
            ))
    finally:
        store.close()
        shm.close()


def _prefault_pool_mapping(store: ServerStore) -> None:
    """Fill this process's page tables for the server's pool (a worker that has run a
    while has touched every page; a first touch costs a minor fault per 4 KiB page, once
    per process, which would otherwise dominate short rounds). Reads the store's private
    link: a benchmark's business only."""
    store.lookup(["connect"])
    connection = store._link._connection
    assert connection is not None
    connection.pool.mapping.madvise(23)  # MADV_POPULATE_WRITE


def _timed(run: Any) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _copy_rows(sources: list[Any], targets: list[Any]) -> None:
    for source, target in zip(sources, targets):
        target[:] = source


def _copy_into(mapping: mmap.mmap, sources: list[Any], *, checksum: bool = False) -> None:
    """Each source copied into `mapping` (and, with `checksum`, the xxh3-64 of what
    arrived, as a put computes it: the least a put into shared memory does)."""
    view = memoryview(mapping)
    offset = 0
    for source in sources:
        stored = view[offset : offset + len(source)]
        stored[:] = memoryview(source)
        if checksum:
            xxhash.xxh3_64_intdigest(stored)
        stored.release()
        offset += len(source)
    view.release()


def _shm_mapping(nbytes: int, directory: str) -> mmap.mmap:
    """A prefaulted mapping of a file in `directory` (the server's pool directory): the
    kind of memory the server's pool is."""
    path = os.path.join(directory, f"umbp-bench-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    memoryview(mapping)[::4096] = bytes(len(range(0, nbytes, 4096)))
    return mapping


# ------------------------------------------------------------------ the parent


@dataclass(frozen=True)
class Row:
    """The figures of one client count."""

    clients: int
    object_bytes_per_client: int
    batch_calls: int
    put_client_gbps: float
    get_client_gbps: float
    put_aggregate_gbps: float
    get_aggregate_gbps: float
    p99_batch_ms: float
    errors: int
    server_cpu_us_per_put_batch: float
    server_cpu_us_per_get_batch: float
    memcpy_gbps: float
    memcpy_shm_gbps: float
    copy_checksum_shm_gbps: float


def server_cpu_seconds(pid: int) -> float:
    """CPU time of the server's threads so far, in nanoseconds' resolution (schedstat:
    /proc/PID/stat counts 10 ms ticks). Every connection thread lives as long as its
    client, so none of a round's work leaves with an ended thread."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def run_count(count: int, workers: list[Any], results: Any, barrier: Any, store: ServerStore,
              server_pid: int, rounds: int, mib: int, batch: int) -> Row:
    sizes = object_sizes(mib << 20)
    per_client = sum(sizes)
    batch_calls = len(measure.batch_ranges(len(sizes), batch))
    rounds_seen: list[list[ClientRound]] = []
    put_cpu = get_cpu = 0.0
    for round_index in range(rounds):
        assert store.clear()
        for commands in workers[:count]:
            commands.put((count, f"n{count}-r{round_index}"))
        barrier[count].wait()
        before = server_cpu_seconds(server_pid)
        barrier[count].wait()
        middle = server_cpu_seconds(server_pid)
        got = [results.get(timeout=600) for _ in range(count)]
        after = server_cpu_seconds(server_pid)
        put_cpu += middle - before
        get_cpu += after - middle
        rounds_seen.append(got)
    per_client_put = [max(per_client / r.put_seconds for r in client_rounds(rounds_seen, c))
                      for c in range(count)]
    per_client_get = [max(per_client / r.get_seconds for r in client_rounds(rounds_seen, c))
                      for c in range(count)]
    total = per_client * count
    aggregate_put = max(total / (max(r.put_ended for r in got) - min(r.put_started for r in got))
                        for got in rounds_seen)
    aggregate_get = max(total / (max(r.get_ended for r in got) - min(r.get_started for r in got))
                        for got in rounds_seen)
    latencies = sorted(value for got in rounds_seen for r in got for value in r.latencies_ms)
    calls = batch_calls * count * rounds
    return Row(
        clients=count,
        object_bytes_per_client=per_client,
        batch_calls=calls,
        put_client_gbps=statistics.median(per_client_put) / 1e9,
        get_client_gbps=statistics.median(per_client_get) / 1e9,
        put_aggregate_gbps=aggregate_put / 1e9,
        get_aggregate_gbps=aggregate_get / 1e9,
        p99_batch_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        errors=sum(r.errors for got in rounds_seen for r in got),
        server_cpu_us_per_put_batch=put_cpu / calls * 1e6,
        server_cpu_us_per_get_batch=get_cpu / calls * 1e6,
        memcpy_gbps=max(per_client / r.memcpy_seconds for got in rounds_seen for r in got) / 1e9,
        memcpy_shm_gbps=max(
            per_client / r.memcpy_shm_seconds for got in rounds_seen for r in got) / 1e9,
        copy_checksum_shm_gbps=max(
            per_client / r.floor_seconds for got in rounds_seen for r in got) / 1e9,
    )


def client_rounds(rounds_seen: list[list[ClientRound]], client: int) -> list[ClientRound]:
    return [r for got in rounds_seen for r in got if r.client == client]


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=",".join(map(str, CLIENT_COUNTS)),
                        help="client counts to run, comma-separated")
    parser.add_argument("--mib", type=int, default=64, help="MiB of objects per client")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per client count")
    parser.add_argument("--batch", type=int, default=32, help="objects per batch call")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="8 MiB per client, 1 round")
    parser.add_argument("--pool-dir", default=None,
                        help="umbp serve --pool-dir: a tmpfs directory for its DRAM tier")
    arguments = parser.parse_args()
    arguments.counts = [int(value) for value in arguments.clients.split(",")]
    if arguments.quick:
        arguments.mib = min(arguments.mib, 8)
        arguments.rounds = 1
    return arguments


def run(arguments: argparse.Namespace) -> list[Row]:
    directory = tempfile.mkdtemp(prefix="umbp-clients-", dir="/tmp")
    endpoint = os.path.join(directory, "s.sock")
    most = max(arguments.counts)
    capacity = int(most * sum(object_sizes(arguments.mib << 20)) / 0.8) + 64 * PAGE_BYTES
    server = start_server(endpoint, capacity, page_bytes=PAGE_BYTES, pool_dir=arguments.pool_dir,
                          log_path=os.path.join(directory, "serve.log"))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    barrier = {count: context.Barrier(count + 1) for count in arguments.counts}
    workers: list[Any] = []
    processes = []
    try:
        for client in range(most):
            commands = context.Queue()
            own = {count: barrier[count] for count in arguments.counts if client < count}
            process = context.Process(
                target=client_main,
                args=(client, endpoint, arguments.mib, arguments.batch, commands, results, own,
                      arguments.pool_dir or "/dev/shm"),
                daemon=True,
            )
            process.start()
            workers.append(commands)
            processes.append(process)
        rows = []
        with ServerStore(endpoint, io_timeout_s=60.0) as store:
            for count in arguments.counts:
                rows.append(run_count(count, workers, results, barrier, store, server.pid,
                                      arguments.rounds, arguments.mib, arguments.batch))
        return rows
    finally:
        for commands in workers:
            commands.put(None)
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        stop_server(server, endpoint)
        shutil.rmtree(directory, ignore_errors=True)


def print_table(rows: list[Row]) -> None:
    print(f"{'clients':>7}{'put GB/s':>10}{'get GB/s':>10}{'put agg':>9}{'get agg':>9}"
          f"{'p99 ms':>8}{'errors':>7}{'srv us/put':>11}{'srv us/get':>11}")
    for row in rows:
        print(f"{row.clients:>7}{row.put_client_gbps:>10.2f}{row.get_client_gbps:>10.2f}"
              f"{row.put_aggregate_gbps:>9.2f}{row.get_aggregate_gbps:>9.2f}"
              f"{row.p99_batch_ms:>8.1f}{row.errors:>7}{row.server_cpu_us_per_put_batch:>11.0f}"
              f"{row.server_cpu_us_per_get_batch:>11.0f}")
    single = next((row for row in rows if row.clients == 1), None)
    if single is not None:
        print(
            f"1 client vs memcpy of the same bytes (same run): put "
            f"{single.put_client_gbps / single.memcpy_gbps:.2f}, get "
            f"{single.get_client_gbps / single.memcpy_gbps:.2f} (memcpy {single.memcpy_gbps:.2f}"
            f" GB/s); vs memcpy into the pool's tmpfs ({single.memcpy_shm_gbps:.2f} GB/s): put "
            f"{single.put_client_gbps / single.memcpy_shm_gbps:.2f}, get "
            f"{single.get_client_gbps / single.memcpy_shm_gbps:.2f}; copy + checksum into "
            f"that tmpfs, the least a put does: {single.copy_checksum_shm_gbps:.2f} GB/s = "
            f"{single.copy_checksum_shm_gbps / single.memcpy_gbps:.2f} of memcpy"
        )
    print("per client: median of each client's best round; agg: all clients' bytes over "
          "first start to last end; srv us: server CPU per batch call")


def main() -> None:
    arguments = parse_arguments()
    started = time.perf_counter()
    rows = run(arguments)
    print_table(rows)
    elapsed = time.perf_counter() - started
    measure.print_run_footer(elapsed)
    if arguments.json is not None:
        report = {
            "benchmark": "clients", "quick": arguments.quick, "rows": [asdict(r) for r in rows],
            "mib_per_client": arguments.mib, "rounds": arguments.rounds,
            "batch": arguments.batch, "page_bytes": PAGE_BYTES,
            "object_sizes": list(OBJECT_SIZES),
        }
        measure.write_report(arguments.json, report, elapsed)


if __name__ == "__main__":
    main()
