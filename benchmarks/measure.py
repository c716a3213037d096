"""What the throughput benchmarks share: buffers, timing, figures and their reports.

pool_bench, server_bench, ssd_bench and mooncake_bench each compare a store with the
plain copy or I/O of the same bytes, measured side by side in one run. They fill and
time buffers the same way and print and save their figures the same way; this module is
that common part, so that a figure means the same in every one of them. Each benchmark
runs as a script, which puts this directory first on `sys.path`, so `import measure`
finds this file; import it after putting the repository on `sys.path` too (it uses umbp).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from umbp.runtime import LoadStatus

GIB = 1 << 30
MIB = 1 << 20
ALIGNMENT = 64  # torch's CPU allocator (c10::alignment)


def throughput_arguments(
    description: str,
    *,
    default_gib: float,
    quick_gib: float,
    more: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The options every throughput benchmark takes (`--json`, `--gib`, `--repeats`,
    `--quick`), plus those `more` adds. `--quick` caps the GiB per case at `quick_gib` and
    the passes at 2."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--gib", type=float, default=default_gib, help="GiB moved per case")
    parser.add_argument("--repeats", type=int, default=5, help="passes per figure (best)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"1/{round(1 / quick_gib)} GiB per case, 2 passes",
    )
    if more is not None:
        more(parser)
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.gib = min(arguments.gib, quick_gib)
        arguments.repeats = min(arguments.repeats, 2)
    return arguments


def prefaulted(objects: int, object_bytes: int, alignment: int = ALIGNMENT) -> Any:
    """`objects` rows in one buffer whose pages are all touched (np.empty maps lazily),
    starting on an `alignment` boundary (64 bytes: as torch's CPU allocator does). numpy
    alone aligns to 16 bytes, and a destination 16 bytes off the slab's alignment halves
    memcpy throughput here (glibc's `rep movsb` path): that would measure numpy's
    allocator, not the store."""
    raw = np.empty(objects * object_bytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    array = raw[start : start + objects * object_bytes].reshape(objects, object_bytes)
    array.fill(0)
    return array


def random_source(
    objects: int, object_bytes: int, *, block_bytes: int = 64 << 20, alignment: int = ALIGNMENT
) -> Any:
    """`objects` rows of random bytes (a random block of `block_bytes` tiled: contents do
    not change copy, I/O or hash speed, and generating 1 GiB of randomness would dominate
    the run)."""
    block = np.random.default_rng(0).integers(0, 256, size=block_bytes, dtype=np.uint8)
    source = prefaulted(objects, object_bytes, alignment)
    source.reshape(-1)[:] = np.resize(block, objects * object_bytes)
    return source


def batch_ranges(objects: int, batch: int) -> list[range]:
    """Row indices of each batch of at most `batch` rows, in order."""
    return [range(start, min(start + batch, objects)) for start in range(0, objects, batch)]


def timed_seconds(run: Callable[[], None], prepare: Callable[[], None] | None = None) -> float:
    """Seconds one `run()` takes, after an untimed `prepare()`."""
    if prepare is not None:
        prepare()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def time_alternately(
    repeats: int,
    runs: Mapping[str, Callable[[], None]],
    *,
    prepare: Mapping[str, Callable[[], None]] | None = None,
    into: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """`repeats` rounds, each timing every run once in the order given (after its untimed
    `prepare`, if any): a store and its reference alternate, so that drift in machine
    speed hits both alike. The seconds are appended under each run's name, to `into`
    when given (a reference timed in several phases pools its passes)."""
    times = {} if into is None else into
    for name in runs:
        times.setdefault(name, [])
    prepares = prepare or {}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(timed_seconds(run, prepare=prepares.get(name)))
    return times


def interleaved_cpu_median_ns(calls: Mapping[Any, Callable[[], object]], rounds: int) -> dict[Any, float]:
    """Median CPU nanoseconds of this thread per call of each entry, GC on (as the
    engine runs), after one warm-up call each; timed in rotating order round by round,
    so load on the machine falls on every entry alike."""
    names = list(calls)
    for name in names:
        calls[name]()
    samples: dict[Any, list[int]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.thread_time_ns()
            calls[name]()
            samples[name].append(time.thread_time_ns() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def copy_row_by_row(source: Any, destination: Any) -> Callable[[], None]:
    """The memcpy reference: numpy copies of the same objects, one by one."""

    def run() -> None:
        for index in range(len(source)):
            destination[index] = source[index]

    return run


@contextlib.contextmanager
def phase_timers(phases: Sequence[tuple[Any, str, str]]) -> Iterator[dict[str, float]]:
    """For a profile: each `(owner, attribute, label)` callable wrapped in a timer while
    the block runs; yields the seconds spent per label (restored afterwards)."""
    spent = {label: 0.0 for _, _, label in phases}
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in phases]

    def timed(call: Callable[..., Any], label: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - started
        return run

    for (owner, name, call), (_, _, label) in zip(originals, phases):
        setattr(owner, name, timed(call, label))
    try:
        yield spent
    finally:
        for owner, name, call in originals:
            setattr(owner, name, call)


def print_profile(title: str, seconds: Mapping[str, float], reference: str) -> None:
    """Each phase's seconds and their share of the `reference` entry's."""
    print(title)
    for name, value in seconds.items():
        print(f"  {name:<42}{value * 1e3:>9.1f} ms{value / seconds[reference]:>7.2f}")


def put_in_batches(
    store: Any, keys: Sequence[str], rows: Sequence[Any], batches: Sequence[range]
) -> Callable[[], None]:
    """Every row put through `store.put_batch`, batch by batch; each must be accepted."""

    def run() -> None:
        for batch in batches:
            results = store.put_batch([keys[i] for i in batch], [rows[i] for i in batch])
            assert all(results), results

    return run


def get_in_batches(
    store: Any, keys: Sequence[str], rows: Sequence[Any], batches: Sequence[range]
) -> Callable[[], None]:
    """Every row loaded through `store.get_batch_into`, batch by batch; each must hit."""

    def run() -> None:
        for batch in batches:
            statuses = store.get_batch_into([keys[i] for i in batch], [rows[i] for i in batch])
            assert all(status is LoadStatus.HIT for status in statuses), statuses

    return run


def best_gbps(nbytes: int, seconds: Iterable[float]) -> float:
    """GB/s of the fastest pass that moved `nbytes`: the best of several passes is the
    one least disturbed by the rest of the machine."""
    return nbytes / min(seconds) / 1e9


@dataclass(frozen=True)
class LookupFigure:
    """Latency of one batched lookup, over many calls."""

    keys: int
    median_us: float
    best_us: float
    p99_us: float


def measure_lookup_latency(lookup: Callable[[], object], keys: int, calls: int) -> LookupFigure:
    """Time `calls` calls of `lookup` (one batched lookup of `keys` keys)."""
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        lookup()
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return LookupFigure(
        keys=keys,
        median_us=statistics.median(samples),
        best_us=samples[0],
        p99_us=samples[int(len(samples) * 0.99)],
    )


def size_label(nbytes: int) -> str:
    """How the tables name object, page and slot sizes: "64 KiB", "1 MiB"."""
    return f"{nbytes >> 20} MiB" if nbytes >= MIB else f"{nbytes >> 10} KiB"


def rows_with_ratio(figures: Sequence[Any]) -> list[dict[str, Any]]:
    """Figures (dataclasses with a `ratio` property, which `asdict` leaves out) as JSON
    rows, each with its ratio."""
    return [asdict(figure) | {"ratio": figure.ratio} for figure in figures]


def print_run_footer(elapsed: float) -> None:
    """The last line of every table: how long the run took, and on what."""
    print(f"({elapsed:.1f} s, python {platform.python_version()}, {os.cpu_count()} cpus)")


def write_report(path: Path, report: dict[str, Any], elapsed: float) -> None:
    """`report` with the machine it ran on and how long it took, as indented JSON."""
    report = report | {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "seconds": elapsed,
    }
    path.write_text(json.dumps(report, indent=2) + "\n")
