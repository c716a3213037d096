"""Batched lookup latency: the scheduler asking the pool which objects it holds.

    python benchmarks/lookup_bench.py [--json FILE] [--quick]

A ``SlabPool`` holds 1,000 small objects; one batch asks for 1,000 keys, half
of them resident. Measured side by side, interleaved (the order rotates every
round), median of 200 rounds (20 with ``--quick``):

* ``direct``: ``SlabPool.lookup`` in this process (scheduler and worker share a
  process, vLLM's single-worker executor);
* ``socket``: ``LookupClient`` -> ``LookupService`` over the Unix socket, the
  pool living in another (spawned) process;
* ``build_query``: ``build_lookup_query`` for a 32,000-token prompt at block 32,
  i.e. building the keys of one such batch, for scale.

Prints microseconds per batch and per key, and each row's ratio to ``direct``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.core.identity import KeySpace, RankCoord, RankTopology
from umbp.core.lookup import LookupGeometry, LookupQuery, build_lookup_query
from umbp.runtime.lookup_service import LookupClient, LookupService
from umbp.runtime.pool import SlabPool
from umbp.testing.table import format_table

KEYS = 1000
OBJECT_BYTES = 256
PAGE_BYTES = 4096
POOL_BYTES = 2 * KEYS * PAGE_BYTES
PROMPT_TOKENS = 32_000
BLOCK_SIZE = 32
NAMESPACE = "bench-lookup-0123"
CLIENT_TIMEOUT_S = 10.0
ROUNDS = 200
QUICK_ROUNDS = 20


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    keys: int
    us_per_batch: float
    us_per_key: float
    ratio_to_direct: float


# ------------------------------------------------------------------ fixtures


def block_hashes(count: int, salt: bytes) -> list[bytes]:
    """32-byte hashes, as vLLM's sha256 block hashes."""
    return [hashlib.sha256(salt + i.to_bytes(8, "big")).digest() for i in range(count)]


def keyspace() -> KeySpace:
    return KeySpace(NAMESPACE, RankTopology())


def stored_and_queried_keys() -> tuple[list[str], list[str]]:
    """1,000 stored keys, and a 1,000-key query: every other key is stored."""
    space, rank = keyspace(), RankCoord()
    stored = [space.key(rank, 0, h) for h in block_hashes(KEYS, b"stored")]
    missing = [space.key(rank, 0, h) for h in block_hashes(KEYS // 2, b"missing")]
    query = [key for pair in zip(stored[: KEYS // 2], missing) for key in pair]
    return stored, query


def filled_pool(keys: Sequence[str]) -> SlabPool:
    pool = SlabPool(POOL_BYTES, page_bytes=PAGE_BYTES)
    payloads = [bytes([i % 251]) * OBJECT_BYTES for i in range(len(keys))]
    if not all(pool.put_batch(keys, payloads)):
        raise RuntimeError("the benchmark pool rejected an object")
    return pool


def serve_pool(keys: list[str], conn: Connection) -> None:
    """Child process: a filled pool behind a LookupService until told to stop."""
    pool = filled_pool(keys)
    service = LookupService(pool)
    conn.send(service.path)
    conn.recv()  # stop
    service.close()
    pool.close()


def query_builder() -> Callable[[], LookupQuery]:
    geometry = LookupGeometry(
        group_ids=(0,), group_block_sizes=(BLOCK_SIZE,), lookup_units=(BLOCK_SIZE,),
        block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
    )
    space = keyspace()
    hashes = tuple(block_hashes(PROMPT_TOKENS // BLOCK_SIZE, b"prompt"))
    return lambda: build_lookup_query(geometry, space, hashes, 0, PROMPT_TOKENS)


# ------------------------------------------------------------------- timing


def time_once(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def interleaved_medians(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each entry, timed in rotating order round by round."""
    names = list(calls)
    for name in names:  # warm-up: connections, caches
        calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(time_once(calls[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(rounds: int) -> list[Row]:
    stored, query = stored_and_queried_keys()
    pool = filled_pool(stored)
    build = query_builder()
    built_keys = len(build().keys)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=serve_pool, args=(stored, child), daemon=True)
    server.start()
    client: LookupClient | None = None
    try:
        client = LookupClient(parent.recv(), CLIENT_TIMEOUT_S)
        check_answers(pool.lookup(query), client.lookup(query))
        remote = client
        medians = interleaved_medians(
            {"direct": lambda: pool.lookup(query), "socket": lambda: remote.lookup(query),
             "build_query": build},
            rounds,
        )
    finally:
        if client is not None:
            client.close()
        parent.send("stop")
        server.join(timeout=10)
        pool.close()
    sizes = {"direct": len(query), "socket": len(query), "build_query": built_keys}
    return [
        Row(name, sizes[name], seconds * 1e6, seconds * 1e6 / sizes[name],
            seconds / medians["direct"])
        for name, seconds in medians.items()
    ]


def check_answers(direct: Sequence[bool], remote: Sequence[bool]) -> None:
    if list(direct) != list(remote) or sum(direct) != KEYS // 2:
        raise RuntimeError(
            f"lookup answers disagree: direct {sum(direct)} hits, socket {sum(remote)} hits"
        )


# -------------------------------------------------------------------- report

LABELS = {
    "direct": "direct (same process)",
    "socket": "socket (other process)",
    "build_query": f"build_query ({PROMPT_TOKENS:,} tokens)",
}


def print_table(rows: Sequence[Row], rounds: int) -> None:
    print(f"lookup of {KEYS} keys ({KEYS // 2} resident) in a pool of {KEYS} objects; "
          f"median of {rounds} interleaved rounds")
    header = ("mode", "keys", "us/batch", "us/key", "x direct")
    cells = [(LABELS[r.name], str(r.keys), f"{r.us_per_batch:.1f}", f"{r.us_per_key:.3f}",
              f"{r.ratio_to_direct:.2f}") for r in rows]
    print(format_table(header, cells))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds")
    args = parser.parse_args(argv)
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    rows = measure(rounds)
    print_table(rows, rounds)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "benchmark": "lookup", "quick": args.quick, "rounds": rounds, "keys": KEYS,
            "hits": KEYS // 2, "rows": [asdict(row) for row in rows],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
