"""`umbp ls` and a metrics scrape of a `umbp serve` holding many objects, and how long
each holds the server's index lock.

    python benchmarks/listing_bench.py [--objects 1048576] [--namespaces 10]
                                       [--repeats 20] [--json FILE] [--quick]

A `StoreCore` (the server without its socket) over a pool of 64-byte pages holds
`--objects` objects, spread over `--namespaces` namespaces that each retain objects:
2,000 per namespace, in retain calls of 20 keys with times that differ call by call, as
agent sessions ask. Objects are put through `begin_put` / `commit_put` as clients do.
Measured, median and worst of `--repeats`, the index lock timed at every hold:

* ``umbp ls``: the server's answer to a NAMESPACES request (`dispatch.answer`, JSON
  included) and the table `umbp ls` prints of it (`format_namespaces`); the command's
  own start-up and socket are not in it;
* metrics scrape: the exposition `--metrics-port` serves (`metrics.render` of
  `StoreCore.stats()` and `StoreCore.namespaces()`), as the endpoint's handler builds it;
* reference, same run: the figures these read without a scan, recounted by scanning
  every DRAM object under the lock as the listing and the stats did before this
  script's commit (resident pages, pinned objects, objects in either tier, and every
  object once per retaining namespace for its longest retention).

Goal (issue 34): ls and scrape under 50 ms with 1M objects and 10 retaining namespaces,
the lock held under 1 ms at a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.runtime.server import protocol
from umbp.runtime.server.dispatch import answer
from umbp.runtime.server.index import PoolIndex
from umbp.runtime.server.listing import format_namespaces
from umbp.runtime.server.metrics import RequestTimes, render
from umbp.runtime.server.state import StoreCore
from umbp.testing.table import format_table

PAGE = 64
RETAINED_PER_NAMESPACE = 2000
RETAIN_BATCH = 20
PUT_BATCH = 4096


class TimedLock:
    """The server's index lock, with the time of every hold recorded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0.0
        self.holds: list[float] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        self._since = time.perf_counter()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.holds.append(time.perf_counter() - self._since)
        self._lock.release()

    def acquire(self) -> bool:
        self.__enter__()
        return True

    def release(self) -> None:
        self.__exit__(None, None, None)


class Served:
    """What `dispatch.answer` reads of a server."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self.hello: dict[str, Any] = {"pid": 0}

    def limits(self) -> dict[str, Any]:
        return {}


def key(namespace: int, serial: int) -> str:
    return f"umbp:1:{namespace:016x}:tp0:pcp0:dcp0:pp0:g0:{serial:016x}"


def filled_core(objects: int, namespaces: int) -> tuple[StoreCore, TimedLock]:
    pages = objects + objects // 8
    index = PoolIndex(pages, PAGE, high_pages=pages - 1, low_pages=pages - 2)
    core = StoreCore(memoryview(bytearray(pages * PAGE)), index, None)
    lock = TimedLock()
    core._lock = core._tiers._lock = lock  # type: ignore[assignment]
    core.configure_retention(3600.0, RETAINED_PER_NAMESPACE * PAGE, capped=True)
    session = core.open_session()
    for start in range(0, objects, PUT_BATCH):
        keys = [key(serial % namespaces, serial)
                for serial in range(start, min(start + PUT_BATCH, objects))]
        token, _ = core.begin_put(session, keys, [PAGE - 1] * len(keys))
        core.commit_put(session, token, [0] * len(keys))
    for name in range(namespaces):
        core.register(f"{name:016x}", f"vllm /models/m{name} float32 tp1")
        for call in range(RETAINED_PER_NAMESPACE // RETAIN_BATCH):
            first = name + call * RETAIN_BATCH * namespaces
            core.retain([key(name, first + i * namespaces) for i in range(RETAIN_BATCH)],
                        600.0 + call)
    return core, lock


def umbp_ls(core: StoreCore) -> Callable[[], None]:
    served, session = Served(core), core.open_session()

    def run() -> None:
        frame = answer(served, protocol.NAMESPACES, b"{}", session)
        assert frame is not None and frame[0] == protocol.OK
        format_namespaces(protocol.decode_json(frame[protocol.HEADER.size:]))

    return run


def scrape(core: StoreCore) -> Callable[[], None]:
    times = RequestTimes()
    times.observe(protocol.LOOKUP, 0.0003)
    return lambda: render(core.stats(), core.namespaces(), times.snapshot(), 0) and None


def recount(core: StoreCore) -> Callable[[], None]:
    """The figures the listing and stats now keep, counted the way they were before."""

    def run() -> None:
        with core._lock:
            index = core._index
            sum(len(entry.pages) for entry in index.entries())
            sum(1 for entry in index.entries() if entry.pins)
            len(index) + sum(1 for key in core._tiers.cold_keys if key not in index)
            for name in index.namespaces():
                usage = index.usage(name)
                if usage is not None and usage.retained_objects:
                    max(entry.retained_until for entry in index.entries()
                        if entry.namespace == name and entry.retained_until)

    return run


def measured(run: Callable[[], None], lock: TimedLock, repeats: int) -> dict[str, float]:
    walls: list[float] = []
    holds: list[float] = []
    run()  # warm-up
    for _ in range(repeats):
        lock.holds.clear()
        started = time.perf_counter()
        run()
        walls.append(time.perf_counter() - started)
        holds.extend(lock.holds)
    return {"median_ms": statistics.median(walls) * 1e3, "worst_ms": max(walls) * 1e3,
            "lock_holds_per_call": len(holds) / repeats, "longest_hold_ms": max(holds) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=1 << 20)
    parser.add_argument("--namespaces", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="65,536 objects, 5 repeats")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.objects = min(arguments.objects, 1 << 16)
        arguments.repeats = min(arguments.repeats, 5)
    started = time.perf_counter()
    core, lock = filled_core(arguments.objects, arguments.namespaces)
    retained = sum(row["retained"]["objects"] for row in core.namespaces())
    print(f"{arguments.objects:,} objects in {arguments.namespaces} namespaces, {retained:,} "
          f"retained; filled in {time.perf_counter() - started:.1f} s")
    cases = {"umbp ls": umbp_ls(core), "metrics scrape": scrape(core),
             "reference: recount by scan": recount(core)}
    results = {name: measured(run, lock, arguments.repeats) for name, run in cases.items()}
    reference = results["reference: recount by scan"]["median_ms"]
    rows = [[name, f"{r['median_ms']:.2f}", f"{r['worst_ms']:.2f}",
             f"{r['longest_hold_ms']:.3f}", f"{r['lock_holds_per_call']:.0f}",
             f"{r['median_ms'] / reference:.2e}"] for name, r in results.items()]
    print(format_table(["case", "median ms", "worst ms", "longest lock hold ms",
                        "lock holds", "ratio to recount"], rows))
    if arguments.json is not None:
        arguments.json.write_text(json.dumps({
            "benchmark": "listing", "quick": arguments.quick, "objects": arguments.objects,
            "namespaces": arguments.namespaces, "retained": retained,
            "machine": platform.platform(), "cases": results,
        }, indent=2))


if __name__ == "__main__":
    main()
