"""How long `umbp serve` takes to bring a prefix held only on its SSD tier into DRAM after
a lookup (the prefetch), with one reader thread and with several, beside the kernel's
plain `preadv` of the same bytes, measured side by side in one run.

    python benchmarks/prefetch_bench.py [--json FILE] [--readers 1,2] [--rounds 3]
                                        [--repeats 3] [--settle-s 3] [--quick]

For each reader count, a real `umbp serve` (256 MiB of DRAM, an SSD tier in a temporary
directory on the root filesystem, `--prefetch-readers N`) and one client. A round: a
64 MiB prefix (128 objects of 512 KiB, the ssd_restore_bench model's blocks) is put; then
1.25 x the DRAM tier of newer objects of the same namespace, so that the prefix leaves
DRAM for SSD (checked); `--settle-s` seconds pass (the server's write-ahead catches up);
then the client times its lookup until `where` finds every object in DRAM, asking every
5 ms as an engine's waiting request does; the objects are then got back and compared
byte for byte (untimed). Servers with each reader count take turns, `--repeats` times.

Reference, same run: the same bytes written to a file in the same directory, left
`--settle-s` seconds, then read with plain `preadv` into a buffer written just as long
before (what the kernel's page-cache copy costs on pages in that state: on the Intel
machine, memory untouched for seconds costs about twice as much to write).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.runtime.contract import LoadStatus, Medium
from umbp.runtime.server import ServerStore, start_server
from umbp.runtime.server.launch import stop_server
from umbp.testing.table import format_table

DRAM_BYTES = 256 << 20
SSD_BYTES = 2 << 30
OBJECT_BYTES = 512 << 10
PREFIX_OBJECTS = 128
BATCH = 32
POLL_S = 0.005
MAX_PUSHES = 8
DEADLINE_S = 60.0
NAMESPACE_KEY = "umbp:1:0bench0:tp0:pcp0:dcp0:pp0:g0:"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--readers", default="1,2",
                        help="reader counts to compare, comma-separated (first: the baseline)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per server")
    parser.add_argument("--repeats", type=int, default=3, help="servers per reader count")
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="1 round, 1 repeat, 0.5 s settle")
    args = parser.parse_args(argv)
    args.readers = [int(count) for count in args.readers.split(",")]
    if args.quick:
        args.rounds, args.repeats, args.settle_s = 1, 1, 0.5
    return args


def put_all(store: ServerStore, keys: Sequence[str], payloads: Sequence[memoryview]) -> None:
    for start in range(0, len(keys), BATCH):
        batch = keys[start:start + BATCH]
        assert all(store.put_batch(batch, payloads[start:start + len(batch)])), "a put failed"


def push_to_ssd(store: ServerStore, prefix: Sequence[str], rng: random.Random, tag: str) -> None:
    """Newer objects of the namespace, 1.25 x the DRAM tier at a time, until the prefix
    is on SSD only: room-making takes victims the write-ahead copied first, so on a busy
    machine (the writer runs at idle priority) some of the prefix can outlast one push."""
    filler = memoryview(rng.randbytes(OBJECT_BYTES))
    count = int(1.25 * DRAM_BYTES) // OBJECT_BYTES
    for push in range(MAX_PUSHES):
        newer = [f"{NAMESPACE_KEY}n{tag}{push:04x}{serial:012x}" for serial in range(count)]
        put_all(store, newer, [filler] * len(newer))
        media = store.where(prefix)
        if set(media) == {Medium.DISK}:
            return
    raise AssertionError(f"the prefix did not leave DRAM: {collections.Counter(media)}")


def prefetch_round(store: ServerStore, rng: random.Random, tag: str, settle_s: float) -> float:
    """Milliseconds from the lookup to every prefix object in DRAM."""
    prefix = [f"{NAMESPACE_KEY}p{tag}{serial:016x}" for serial in range(PREFIX_OBJECTS)]
    contents = [memoryview(rng.randbytes(OBJECT_BYTES)) for _ in prefix]
    put_all(store, prefix, contents)
    push_to_ssd(store, prefix, rng, tag)
    time.sleep(settle_s)
    started = time.perf_counter()
    store.lookup_where(prefix, f"request-{tag}")
    while set(media := store.where(prefix)) != {Medium.CPU}:
        if time.perf_counter() - started > DEADLINE_S:
            raise AssertionError(f"the prefetch did not bring the prefix into DRAM in "
                                 f"{DEADLINE_S:.0f} s: {collections.Counter(media)}, server "
                                 f"counters {store.server_stats()['counters']}")
        time.sleep(POLL_S)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    outs = [bytearray(OBJECT_BYTES) for _ in prefix]
    assert set(store.get_batch_into(prefix, outs)) == {LoadStatus.HIT}
    assert all(out == content for out, content in zip(outs, contents)), "bytes differ"
    return elapsed_ms


def server_rounds(readers: int, rounds: int, settle_s: float, seed: int) -> list[float]:
    directory = Path(tempfile.mkdtemp(prefix="umbp-prefetch-bench-", dir="/tmp"))
    endpoint = str(directory / "umbp.sock")
    server = start_server(endpoint, DRAM_BYTES, ssd_dir=str(directory / "ssd"),
                          ssd_capacity_bytes=SSD_BYTES, log_path=str(directory / "serve.log"),
                          extra_args=["--prefetch-readers", str(readers)])
    rng = random.Random(seed)
    try:
        with ServerStore(endpoint) as store:
            prefetch_round(store, rng, "warm", settle_s)  # first touches: untimed
            return [prefetch_round(store, rng, f"{round_:04x}", settle_s)
                    for round_ in range(rounds)]
    finally:
        stop_server(server, endpoint)
        shutil.rmtree(directory, ignore_errors=True)


def plain_read_ms(settle_s: float) -> float:
    """The kernel's copy of the prefix's bytes from the page cache, pages as idle as the
    prefetch's."""
    nbytes = PREFIX_OBJECTS * OBJECT_BYTES
    with tempfile.TemporaryDirectory(prefix="umbp-prefetch-plain-", dir="/tmp") as where:
        fd = os.open(Path(where) / "objects", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            source = os.urandom(OBJECT_BYTES)
            for serial in range(PREFIX_OBJECTS):
                os.pwrite(fd, source, serial * OBJECT_BYTES)
            destination = memoryview(bytearray(nbytes))
            destination[:] = bytes(nbytes)
            time.sleep(settle_s)
            started = time.perf_counter()
            for serial in range(PREFIX_OBJECTS):
                at = serial * OBJECT_BYTES
                os.preadv(fd, [destination[at:at + OBJECT_BYTES]], at)
            return (time.perf_counter() - started) * 1e3
        finally:
            os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    samples: dict[int, list[float]] = {readers: [] for readers in args.readers}
    plain: list[float] = []
    for repeat in range(args.repeats):
        for readers in args.readers:
            samples[readers] += server_rounds(readers, args.rounds, args.settle_s, repeat)
        plain.append(plain_read_ms(args.settle_s))
    plain_ms = statistics.median(plain)
    baseline = statistics.median(samples[args.readers[0]])
    rows = []
    for readers, values in samples.items():
        median = statistics.median(values)
        rows.append([str(readers), f"{median:.1f}", " ".join(f"{v:.0f}" for v in values),
                     f"{median / plain_ms:.2f}", f"{median / baseline:.2f}"])
    print(format_table(["readers", "median ms", "samples ms", "x plain preadv",
                        f"x {args.readers[0]} reader(s)"], rows))
    print(f"64 MiB prefix ({PREFIX_OBJECTS} x {OBJECT_BYTES >> 10} KiB) from SSD into DRAM, "
          f"lookup to all in DRAM (polled every {POLL_S * 1e3:.0f} ms), every byte verified; "
          f"plain preadv of the same bytes: {plain_ms:.1f} ms (median of {len(plain)}); "
          f"settle {args.settle_s} s")
    elapsed = time.perf_counter() - started
    measure.print_run_footer(elapsed)
    if args.json is not None:
        measure.write_report(args.json, {
            "benchmark": "prefetch", "quick": args.quick, "settle_s": args.settle_s,
            "samples_ms": {str(k): v for k, v in samples.items()},
            "median_ms": {str(k): statistics.median(v) for k, v in samples.items()},
            "plain_preadv_ms": plain, "plain_preadv_median_ms": plain_ms,
        }, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
