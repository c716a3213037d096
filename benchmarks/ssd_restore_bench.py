"""Time to first token of a prefix `umbp serve` holds only on its SSD tier, against the
same prefix restored from its DRAM tier, side by side in one run.

    python benchmarks/ssd_restore_bench.py [--json FILE] [--prefix-tokens 4096] [--repeats 5]
                                           [--load-async default|true|false]
                                           [--write-ahead-bytes N] [--prefetch-readers N]
                                           [--settle-s S] [--pool-dir DIR] [--quick]

A real `umbp serve` (256 MiB of DRAM, an SSD tier in a temporary directory on the root
filesystem, the default prefetch bound) and one in-process vLLM engine in server mode
(the ttft_bench model: llama-h512-l8-a8-kv4-i1024, float32, block 32). Each repetition:

1. a new document prefix is computed and stored (recomputed, not timed);
2. ``dram``: vLLM's own prefix cache emptied, the prefix plus a new suffix is timed:
   restored from the server's DRAM tier;
3. the prefix is pushed to SSD: objects of the same namespace, 1.25 x the DRAM tier, are
   put by a second client, so that the prefix's objects are the namespace's least
   recently used and leave DRAM for SSD (checked: the server's SSD tier then holds them),
   then ``--settle-s`` seconds pass (the server's write-ahead catches up with the push);
4. ``ssd``: vLLM's cache emptied again, the prefix plus another new suffix is timed: the
   lookup finds the objects on SSD only and starts bringing them into DRAM (prefetch);
   a synchronous load waits for them ("not yet"), an asynchronous one reads what is
   not there yet itself.

Medians of the repetitions; ratio = ssd / dram (goal <= 1.3, issue 34). The page cache
holds the SSD file (just written): the disk's own read time is not in the figure. Also
reported: objects the server prefetched and objects loads still read from SSD.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ttft_bench import (  # this folder
    BLOCK_SIZE,
    FULL_MODEL,
    KV_CACHE_BYTES,
    LOAD_ASYNC,
    MAX_MODEL_LEN,
    QUICK_MODEL,
    SUFFIX_TOKENS,
    Bench,
    random_tokens,
    write_model,
)

from umbp.core.identity import namespace_key_prefix
from umbp.runtime.server import ServerStore, start_server
from umbp.runtime.server.launch import stop_server
from umbp.testing.table import format_table

DRAM_BYTES = 256 << 20
SSD_BYTES = 2 << 30
GOAL_SSD_OVER_DRAM = 1.3


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--load-async", choices=tuple(LOAD_ASYNC), default="default")
    parser.add_argument("--write-ahead-bytes", default=None,
                        help="the server's --write-ahead-bytes (default: its own; 0: off)")
    parser.add_argument("--prefetch-readers", default=None,
                        help="the server's --prefetch-readers (default: its own)")
    parser.add_argument("--settle-s", type=float, default=0.0,
                        help="seconds between the push to SSD and the timed restore")
    parser.add_argument("--pool-dir", default=None,
                        help="umbp serve --pool-dir: a tmpfs directory for its DRAM tier")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 repeats")
    parser.add_argument("--model-root", type=Path,
                        default=Path.home() / ".cache" / "umbp" / "bench-models")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    return args


def server_options(args: argparse.Namespace) -> list[str]:
    options = [] if args.write_ahead_bytes is None else ["--write-ahead-bytes",
                                                          args.write_ahead_bytes]
    if args.prefetch_readers is not None:
        options += ["--prefetch-readers", args.prefetch_readers]
    if args.pool_dir is not None:
        options += ["--pool-dir", args.pool_dir]
    return options


def start_engine(model_dir: str, endpoint: str, load_async: bool | None) -> Any:
    from umbp.testing.engine import make_llm

    connector: dict[str, object] = {"mode": "server", "endpoint": endpoint}
    if load_async is not None:
        connector["load_async"] = load_async
    return make_llm(model_dir, connector=connector, block_size=BLOCK_SIZE,
                    max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES)


def timed_restore(bench: Bench, prompt: Sequence[int]) -> tuple[float, int]:
    """Milliseconds to the first token with vLLM's own cache emptied; tokens restored."""
    bench.empty_vllm_cache()
    started = time.perf_counter()
    output = bench.generate(prompt, 1)
    return (time.perf_counter() - started) * 1e3, int(output.num_cached_tokens or 0)


def push_to_ssd(store: ServerStore, namespace: str, object_bytes: int, round_: int) -> None:
    """Newer objects of the namespace, 1.25 x the DRAM tier: the prefix's objects become
    its least recently used and move to SSD."""
    count = int(1.25 * DRAM_BYTES) // object_bytes
    payload = memoryview(bytes(object_bytes))
    keys = [f"{namespace_key_prefix(namespace)}tp0:pcp0:dcp0:pp0:g0:{round_:08x}{serial:024x}"
            for serial in range(count)]
    for start in range(0, count, 32):
        batch = keys[start:start + 32]
        assert all(store.put_batch(batch, [payload] * len(batch)))


def counters(store: ServerStore) -> dict[str, int]:
    return dict(store.server_stats()["counters"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    model_dir = write_model(shape, args.model_root)
    object_bytes = shape.kv_bytes_per_token() * BLOCK_SIZE
    directory = Path(tempfile.mkdtemp(prefix="umbp-ssd-restore-", dir="/tmp"))
    endpoint = str(directory / "umbp.sock")
    server = start_server(endpoint, DRAM_BYTES, ssd_dir=str(directory / "ssd"),
                          ssd_capacity_bytes=SSD_BYTES, log_path=str(directory / "serve.log"),
                          extra_args=server_options(args))
    started = time.perf_counter()
    rng = random.Random(0)
    samples: dict[str, list[float]] = {"dram": [], "ssd": []}
    restored: dict[str, list[int]] = {"dram": [], "ssd": []}
    prefetched = read_from_ssd = written_ahead = 0
    try:
        bench = Bench(start_engine(model_dir, endpoint, LOAD_ASYNC[args.load_async]))
        with ServerStore(endpoint) as store:
            for round_ in range(args.repeats + 1):  # the first round warms up, untimed
                prefix = random_tokens(rng, args.prefix_tokens)
                bench.generate(prefix + random_tokens(rng, SUFFIX_TOKENS), 1, recompute=True)
                dram_ms, dram_tokens = timed_restore(
                    bench, prefix + random_tokens(rng, SUFFIX_TOKENS))
                (row,) = [r for r in store.namespaces() if r["label"]]
                push_to_ssd(store, row["namespace"], object_bytes, round_)
                time.sleep(args.settle_s)
                before = counters(store)
                ssd_ms, ssd_tokens = timed_restore(
                    bench, prefix + random_tokens(rng, SUFFIX_TOKENS))
                after = counters(store)
                if round_ == 0:
                    continue
                samples["dram"].append(dram_ms)
                samples["ssd"].append(ssd_ms)
                restored["dram"].append(dram_tokens)
                restored["ssd"].append(ssd_tokens)
                prefetched += after["prefetched"] - before["prefetched"]
                read_from_ssd += after["hits_from_ssd"] - before["hits_from_ssd"]
                written_ahead = after["written_ahead"]
    finally:
        stop_server(server, endpoint)
        shutil.rmtree(directory, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    ratio = medians["ssd"] / medians["dram"]
    print(format_table(
        ["restored from", "median TTFT ms", "samples ms", "tokens restored (min)"],
        [[name, f"{medians[name]:.1f}", " ".join(f"{v:.0f}" for v in samples[name]),
          str(min(restored[name]))] for name in samples],
    ))
    print(f"ssd / dram: {ratio:.2f} (goal <= {GOAL_SSD_OVER_DRAM}); objects prefetched at "
          f"lookup: {prefetched}, read from SSD by loads: {read_from_ssd}, written ahead "
          f"in all: {written_ahead}; load_async {args.load_async}; write-ahead "
          f"{args.write_ahead_bytes or 'default'}; prefetch readers "
          f"{args.prefetch_readers or 'default'}; {args.prefix_tokens}-token prefix, {shape.name}, "
          f"{time.perf_counter() - started:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "benchmark": "ssd-restore", "quick": args.quick, "load_async": args.load_async,
            "prefix_tokens": args.prefix_tokens, "model": shape.name,
            "median_ms": medians, "samples_ms": samples, "ratio_ssd_over_dram": ratio,
            "restored_tokens": restored, "prefetched": prefetched,
            "read_from_ssd_by_loads": read_from_ssd, "written_ahead": written_ahead,
            "write_ahead_bytes": args.write_ahead_bytes,
            "prefetch_readers": args.prefetch_readers,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
