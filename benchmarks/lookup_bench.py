"""Batched lookup latency: the scheduler asking the pool which objects it holds.

    python benchmarks/lookup_bench.py [--json FILE] [--quick]

A ``SlabPool`` holds 1,000 small objects; one batch asks for 1,000 keys, half
of them resident. Measured side by side, interleaved (the order rotates every
round), median of 200 rounds (20 with ``--quick``):

* ``direct``: ``SlabPool.lookup`` in this process (scheduler and worker share a
  process, vLLM's single-worker executor);
* ``socket``: ``LookupClient`` -> ``LookupService`` over the Unix socket, the
  pool living in another (spawned) process;
* ``build_query``: the key strings of a 32,000-token prompt's lookup at block 32
  (``build_lookup_query(...).runs.key_strings()``), i.e. building the keys of one
  such batch, for scale: what a store asked by string costs on top (the embedded
  pool is asked by hash and needs none).

Prints microseconds per batch and per key, and each row's ratio to ``direct``.

A second table is one scheduler lookup as the engine runs it at TP1 and TP4
(``--ranks`` section): ``build_lookup_query`` for a 32,768-token prompt, the
answer from one in-process ``SlabPool`` per rank through ``RankedLookup``, and
``fold_rank_hits``; three quarters of the objects are held by every rank. CPU time
of the calling thread per call (``time.thread_time_ns``, GC on), median of the
rounds, interleaved: ``by hash`` asks the query's prefixes and raw hashes
(``lookup_hashes``, as the scheduler asks the embedded pool; no key string), ``by
position`` builds the key strings and routes them by their layout, ``by key name``
is the baseline routing (umbp's before, and the reference's: the rank read from
each key string, in this script), measured in the same run.
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

from measure import interleaved_cpu_median_ns  # benchmarks/, this script's folder

from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace, RankCoord, RankTopology
from umbp.core.lookup.query import build_lookup_query
from umbp.core.lookup.windows import fold_rank_hits
from umbp.core.rank_keys import RankedKeys, rank_tags
from umbp.runtime.lookup_service import LookupClient, LookupService, RankedLookup
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
RANK_PROMPT_TOKENS = 32_768
RANK_ROUNDS = 300
QUICK_RANK_ROUNDS = 40


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


def query_builder() -> Callable[[], RankedKeys]:
    geometry = CacheGeometry(
        group_ids=(0,), group_block_sizes=(BLOCK_SIZE,), lookup_units=(BLOCK_SIZE,),
        block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
    )
    space = keyspace()
    hashes = tuple(block_hashes(PROMPT_TOKENS // BLOCK_SIZE, b"prompt"))
    return lambda: build_lookup_query(geometry, space, hashes, 0, PROMPT_TOKENS).runs.key_strings()


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
    built_keys = len(build())
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


# ------------------------------------------------------- lookups by rank count


@dataclass(frozen=True, slots=True)
class RankRow:
    block_size: int
    ranks: int
    keys: int
    by_name_us: float
    by_position_us: float
    by_hash_us: float
    ns_per_key: float
    per_key_vs_tp1: float




def lookup_by_key_name(stores: dict[str, SlabPool], keys: Sequence[str]) -> tuple[bool, ...]:
    """The baseline routing (umbp's before keys carried their layout, and the
    reference's): each key's rank read from its string, one split per key, the
    answers put back by position."""
    positions: dict[str, list[int]] = {}
    for position, key in enumerate(keys):
        positions.setdefault(key.rsplit(":", 2)[0], []).append(position)
    merged = [False] * len(keys)
    for tag, indices in positions.items():
        for index, hit in zip(indices, stores[tag].lookup([keys[i] for i in indices])):
            merged[index] = hit
    return tuple(merged)


def rank_calls(block_size: int, ranks: int) -> tuple[int, dict[str, Callable[[], object]], list[SlabPool]]:
    """(keys asked, the lookup routed by key name and by position, the pools to close)."""
    geometry = CacheGeometry(
        group_ids=(0,), group_block_sizes=(block_size,), lookup_units=(block_size,),
        block_size=block_size, hash_block_size=block_size,
    )
    space = KeySpace(NAMESPACE, RankTopology(tp_size=ranks))
    hashes = tuple(block_hashes(RANK_PROMPT_TOKENS // block_size, b"ranked"))
    query = build_lookup_query(geometry, space, hashes, 0, RANK_PROMPT_TOKENS)
    held = len(query.object_hashes[0]) * 3 // 4
    pools = []
    for rank in range(ranks):
        rank_keys = query.runs.key_strings().keys_of_rank(rank)[:held]
        pool = SlabPool(len(rank_keys) * 2 * 512, page_bytes=512)
        if not all(pool.put_batch(rank_keys, [b"x"] * len(rank_keys))):
            raise RuntimeError("the benchmark pool rejected an object")
        pools.append(pool)
    router = RankedLookup(dict(zip(rank_tags(space), pools)))

    def by_position() -> object:
        built = build_lookup_query(geometry, space, hashes, 0, RANK_PROMPT_TOKENS)
        return fold_rank_hits(built, router.lookup(built.runs.key_strings()))

    def by_hash() -> object:
        built = build_lookup_query(geometry, space, hashes, 0, RANK_PROMPT_TOKENS)
        return fold_rank_hits(built, router.lookup_hashes(built.runs))

    stores = dict(zip(rank_tags(space), pools))

    def by_name() -> object:
        built = build_lookup_query(geometry, space, hashes, 0, RANK_PROMPT_TOKENS)
        return fold_rank_hits(built, lookup_by_key_name(stores, built.runs.key_strings()))

    expected = by_position()
    if by_name() != expected or by_hash() != expected or expected != ((True,) * held + (False,) * (len(hashes) - 1 - held),):
        raise RuntimeError("routing by position and by key name disagree")
    return query.key_count, {"by_name": by_name, "by_position": by_position,
                             "by_hash": by_hash}, pools


def measure_ranks(rounds: int) -> list[RankRow]:
    """Per block size, TP1 and TP4 timed together, round by round, so the per-key
    ratio between them sees the same load on the machine."""
    rows: list[RankRow] = []
    for block_size in (32, 16):
        keys: dict[int, int] = {}
        calls: dict[str, Callable[[], object]] = {}
        pools: list[SlabPool] = []
        for ranks in (1, 4):
            keys[ranks], rank_calls_, rank_pools = rank_calls(block_size, ranks)
            calls.update({f"{name}/{ranks}": call for name, call in rank_calls_.items()})
            pools.extend(rank_pools)
        try:
            medians = interleaved_cpu_median_ns(calls, rounds)
        finally:
            for pool in pools:
                pool.close()
        tp1_per_key = medians["by_hash/1"] / keys[1]
        for ranks in (1, 4):
            per_key = medians[f"by_hash/{ranks}"] / keys[ranks]
            rows.append(RankRow(block_size, ranks, keys[ranks], medians[f"by_name/{ranks}"] / 1e3,
                                medians[f"by_position/{ranks}"] / 1e3,
                                medians[f"by_hash/{ranks}"] / 1e3, per_key,
                                per_key / tp1_per_key))
    return rows


def print_rank_table(rows: Sequence[RankRow], rounds: int) -> None:
    print(f"one scheduler lookup, {RANK_PROMPT_TOKENS:,}-token prompt (query, ask one "
          f"in-process pool per rank, fold); CPU us per call, median of {rounds} rounds, GC on; "
          "ns/key and per key vs TP1 are by hash")
    header = ("block", "ranks", "keys", "by key name", "by position", "by hash",
              "position/name", "hash/position", "ns/key", "per key vs TP1")
    cells = [(str(r.block_size), str(r.ranks), str(r.keys), f"{r.by_name_us:.0f}",
              f"{r.by_position_us:.0f}", f"{r.by_hash_us:.0f}",
              f"{r.by_position_us / r.by_name_us:.2f}", f"{r.by_hash_us / r.by_position_us:.2f}",
              f"{r.ns_per_key:.0f}", f"{r.per_key_vs_tp1:.2f}x") for r in rows]
    print(format_table(header, cells))


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
    print()
    rank_rounds = QUICK_RANK_ROUNDS if args.quick else RANK_ROUNDS
    rank_rows = measure_ranks(rank_rounds)
    print_rank_table(rank_rows, rank_rounds)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "benchmark": "lookup", "quick": args.quick, "rounds": rounds, "keys": KEYS,
            "hits": KEYS // 2, "rows": [asdict(row) for row in rows],
            "rank_rounds": rank_rounds, "rank_rows": [asdict(row) for row in rank_rows],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
