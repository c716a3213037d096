"""What a client pays to carry on after a timed-out exchange with `umbp serve`.

    python benchmarks/reconnect_bench.py [--json FILE] [--gib 4] [--repeats 5] [--quick]

A real server (`--gib` of DRAM, 64 KiB pages) holds a 64 MiB prefix of 1 MiB objects.
Each repetition stops the server (SIGSTOP) until one of the client's lookups times out
(the link drops its connection), lets it go on, and times the client's next get of the
whole prefix: it reconnects to the same server and carries on in the pool it still has
mapped. Reference, same run: a new client's first get of the same prefix, which maps the
pool (what every reconnection did before the mapping was kept: page tables made anew,
and on a GPU host the pool registered again), and a warm get by a connected client.
Also the client process's CPU seconds over the 2 s after each get (the background
population of a new mapping's page tables runs then), and how many mappings of the pool
the process holds at the end.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.runtime.contract import LoadStatus, StoreUnavailable
from umbp.runtime.server import ServerStore, start_server
from umbp.runtime.server.launch import probe_server, stop_server
from umbp.testing.faults import stop_process

OBJECT_BYTES = 1 << 20
OBJECTS = 64
PAGE_BYTES = 64 << 10
IO_TIMEOUT_S = 0.5
AFTER_S = 2.0


def timed_get(store: ServerStore, keys: list[str], outs: list[Any]) -> float:
    started = time.perf_counter()
    statuses = store.get_batch_into(keys, outs)
    seconds = time.perf_counter() - started
    if statuses != (LoadStatus.HIT,) * len(keys):
        raise AssertionError(f"the prefix was not all there: {set(statuses)}")
    return seconds


def cpu_seconds_after() -> float:
    """This process's CPU seconds (every thread) over the next `AFTER_S`."""
    started = time.process_time()
    time.sleep(AFTER_S)
    return time.process_time() - started


def pool_mappings(pool_path: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(pool_path))


def stall_until_dropped(store: ServerStore, server: Any) -> None:
    stop_process(server.pid)
    try:
        try:
            store.lookup(["k0"])
        except StoreUnavailable:
            return
        raise AssertionError("a lookup of a stopped server did not time out")
    finally:
        server.send_signal(signal.SIGCONT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--gib", type=float, default=4.0, help="the server's DRAM tier")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a 256 MiB server, 2 repeats")
    args = parser.parse_args()
    gib, repeats = (0.25, 2) if args.quick else (args.gib, args.repeats)
    begun = time.perf_counter()
    directory = Path(tempfile.mkdtemp(prefix="umbp-rb-", dir="/tmp"))
    socket_path = str(directory / "umbp.sock")
    server = start_server(socket_path, int(gib * (1 << 30)), page_bytes=PAGE_BYTES,
                          log_path=str(directory / "serve.log"))
    keys = [f"k{i}" for i in range(OBJECTS)]
    source = measure.random_source(OBJECTS, OBJECT_BYTES)
    outs = list(measure.prefaulted(OBJECTS, OBJECT_BYTES))
    figures: dict[str, list[float]] = {"warm": [], "new client": [], "reconnected": [],
                                       "new client cpu": [], "reconnected cpu": []}
    try:
        with ServerStore(socket_path, io_timeout_s=IO_TIMEOUT_S,
                         reconnect_interval_s=0.01) as store:
            assert all(store.put_batch(keys, [bytes(row) for row in source]))
            pool_path = str(probe_server(socket_path, 5.0).hello["shm_path"])  # type: ignore[index]
            for _ in range(repeats):
                with ServerStore(socket_path, io_timeout_s=5.0) as fresh:
                    figures["new client"].append(timed_get(fresh, keys, outs))
                    figures["new client cpu"].append(cpu_seconds_after())
                figures["warm"].append(min(timed_get(store, keys, outs) for _ in range(3)))
                stall_until_dropped(store, server)
                figures["reconnected"].append(timed_get(store, keys, outs))
                figures["reconnected cpu"].append(cpu_seconds_after())
                for out, expected in zip(outs, source):
                    assert np.array_equal(out, expected), "a reconnected get read wrong bytes"
            mappings = pool_mappings(pool_path)
    finally:
        stop_server(server, socket_path)
        shutil.rmtree(directory, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in figures.items()}
    warm = medians["warm"]
    print(f"umbp serve of {gib:g} GiB, a {OBJECTS} MiB prefix in 1 MiB objects, "
          f"{repeats} repetitions, medians")
    print(f"{'get of the prefix':38} {'ms':>8} {'vs warm':>8} {'client CPU s in 2 s after':>26}")
    print(f"{'warm (connected)':38} {warm * 1e3:8.1f} {1.0:7.2f}x {'':>26}")
    for name, label in (("new client", "new client (maps the pool)"),
                        ("reconnected", "after a timeout (same server)")):
        print(f"{label:38} {medians[name] * 1e3:8.1f} {medians[name] / warm:7.2f}x "
              f"{medians[name + ' cpu']:26.3f}")
    print(f"mappings of the pool in the client at the end: {mappings}")
    report = {"gib": gib, "repeats": repeats, "samples": figures, "medians": medians,
              "pool_mappings": mappings}
    if args.json:
        measure.write_report(args.json, report, time.perf_counter() - begun)
    measure.print_run_footer(time.perf_counter() - begun)


if __name__ == "__main__":
    main()
