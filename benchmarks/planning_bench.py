"""Planning cost of ``umbp.core``: lookup to load plan, and store planning.

    python benchmarks/planning_bench.py [--json FILE] [--quick]

Prints microseconds per call, measured side by side in one run with a
per-object baseline written the way the reference scheduler computes the same
answer (a key tuple per object via ``KeySpace.rank_keys``, an ``all()`` per
object, index-by-index scans, one append per block), so the ratios are
comparable across machines. Figures:

* lookup -> load plan for a 32,768-token prompt: block 16 and 32, 1 and 4 ranks;
  every object hits (the longest window, the most work);
* growth with prompt length (2K, 8K, 32K tokens) at block 16, one rank;
* store planning for 256 requests in one scheduler step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.core.identity import KeySpace, RankTopology
from umbp.core.lookup import (
    LookupGeometry,
    build_lookup_query,
    fold_rank_hits,
    single_group_load_spec,
)
from umbp.core.plans import (
    BlockLoadBatch,
    apply_store_masks,
    load_batch,
    save_watermark,
    storable_tokens,
    store_candidate_ranges,
)
from umbp.core.store_events import StoreEvent, pinned_block_ids
from umbp.core.store_pass import StoreCandidates, plan_stores, residency_check


def measure_us(call: Callable[[], object], budget_s: float, repeats: int = 5) -> float:
    """Best of ``repeats`` runs of the mean microseconds per call (the least
    disturbed by other work on the machine)."""
    call()
    loops = 1
    while True:
        start = time.perf_counter()
        for _ in range(loops):
            call()
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s / repeats or loops >= 1 << 20:
            break
        loops *= 2
    samples = [elapsed / loops]
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(loops):
            call()
        samples.append((time.perf_counter() - start) / loops)
    return min(samples) * 1e6


def block_hashes(count: int, salt: bytes = b"") -> tuple[bytes, ...]:
    """32-byte hashes, as vLLM's sha256 block hashes."""
    return tuple(hashlib.sha256(salt + index.to_bytes(8, "big")).digest() for index in range(count))


def geometry_for(block_size: int) -> LookupGeometry:
    return LookupGeometry(
        group_ids=(0,),
        group_block_sizes=(block_size,),
        lookup_units=(block_size,),
        block_size=block_size,
        hash_block_size=block_size,
    )


# --------------------------------------------------------- per-object baseline


def baseline_lookup_to_load(
    geometry: LookupGeometry,
    keyspace: KeySpace,
    hashes: Sequence[bytes],
    num_tokens: int,
    answer: Callable[[int], Sequence[bool]],
    table: tuple[int, ...],
) -> BlockLoadBatch:
    """The reference's shape of the same computation, object by object."""
    hbs = geometry.hash_block_size
    unit = geometry.lookup_units[0]
    group_id = geometry.group_ids[0]
    block_size = geometry.group_block_sizes[0]
    objects: list[tuple[bytes, tuple[str, ...]]] = []
    keys: list[str] = []
    for token_end in range(unit, num_tokens - 1 + 1, unit):
        block_hash = hashes[token_end // hbs - 1]
        rank_keys = keyspace.rank_keys(group_id, block_hash)
        objects.append((block_hash, rank_keys))
        keys.extend(rank_keys)
    hits = list(answer(len(keys)))
    ranks = keyspace.topology.rank_count
    group_hits = (
        hits if ranks == 1 else [all(hits[i : i + ranks]) for i in range(0, len(hits), ranks)]
    )
    per_block = block_size // unit
    matched = 0
    for index in range(per_block - 1, len(group_hits), per_block):
        if not group_hits[index]:
            break
        matched = index + 1
    end = matched * unit
    block_ids: list[int] = []
    group_ids: list[int] = []
    out_hashes: list[bytes] = []
    for block in range(end // block_size):
        out_hashes.append(hashes[(block + 1) * block_size // hbs - 1])
        block_ids.append(table[block])
        group_ids.append(group_id)
    return BlockLoadBatch("r", tuple(group_ids), tuple(block_ids), tuple(out_hashes))


# ------------------------------------------------------------------- scenarios


def lookup_case(num_tokens: int, block_size: int, tp: int, budget_s: float) -> dict[str, float]:
    geometry = geometry_for(block_size)
    keyspace = KeySpace("bench-namespace-0123", RankTopology(tp_size=tp))
    hashes = block_hashes(num_tokens // block_size)
    blocks = -(-num_tokens // block_size)
    table = (tuple(range(1, blocks + 1)),)
    query = build_lookup_query(geometry, keyspace, hashes, 0, num_tokens)
    answers = (True,) * len(query.keys)  # what a runtime returns: a tuple of bools

    def core_path() -> BlockLoadBatch:
        q = build_lookup_query(geometry, keyspace, hashes, 0, num_tokens)
        folded = fold_rank_hits(q, answers)
        assert folded is not None
        spec = single_group_load_spec(geometry, q, folded)
        assert spec is not None
        return load_batch("r", geometry, spec, table, hashes, spec.num_tokens_to_load).unwrap()

    def baseline() -> BlockLoadBatch:
        return baseline_lookup_to_load(
            geometry, keyspace, hashes, num_tokens, lambda n: (True,) * n, table[0]
        )

    assert core_path() == baseline(), "baseline and core disagree"
    folded = fold_rank_hits(query, answers)
    assert folded is not None
    spec = single_group_load_spec(geometry, query, folded)
    assert spec is not None
    return {
        "tokens": num_tokens,
        "block_size": block_size,
        "ranks": tp,
        "blocks": blocks,
        "keys": len(query.keys),
        "total_us": measure_us(core_path, budget_s),
        "build_query_us": measure_us(
            lambda: build_lookup_query(geometry, keyspace, hashes, 0, num_tokens), budget_s / 2
        ),
        "fold_us": measure_us(lambda: fold_rank_hits(query, answers), budget_s / 2),
        "hit_window_us": measure_us(
            lambda: single_group_load_spec(geometry, query, folded), budget_s / 2
        ),
        "load_batch_us": measure_us(
            lambda: load_batch("r", geometry, spec, table, hashes, spec.num_tokens_to_load),
            budget_s / 2,
        ),
        "baseline_us": measure_us(baseline, budget_s),
    }


def store_step_case(requests: int, budget_s: float) -> dict[str, float]:
    """One scheduler step: ``requests`` chunked prefills of 512 new tokens each on a
    4,096-token prompt, 1,024 of them restored from the pool (so a residency check
    runs), against 1,000 identities reserved by in-flight events."""
    block_size = 16
    geometry = geometry_for(block_size)
    keyspace = KeySpace("bench-namespace-0123", RankTopology())
    prompt = 4096
    chunk = 512
    per_request = []
    for index in range(requests):
        hashes = block_hashes(prompt // block_size, salt=index.to_bytes(4, "big"))
        table = (tuple(range(index * 300 + 1, index * 300 + 1 + prompt // block_size)),)
        previous = (index % 6) * chunk
        per_request.append((f"req-{index}", hashes, table, previous, 1024))
    reserved = frozenset((0, h) for h in block_hashes(1000, salt=b"reserved"))

    def plan_step() -> StoreEvent:
        # The shell's sequence: every request's candidates, one residency check
        # for the step (every cached block resident), then the batches.
        candidates: list[StoreCandidates] = []
        for request_id, hashes, table, previous, cached in per_request:
            limit = storable_tokens(previous + chunk, len(hashes), block_size)
            save_to = save_watermark(previous, limit, block_size)
            ranges = store_candidate_ranges(geometry, previous, save_to, table, frozenset())
            selected = apply_store_masks(ranges, {}).unwrap()
            candidates.append(StoreCandidates(request_id, selected, table, hashes, cached))
        check = residency_check(geometry, keyspace, candidates, reserved)
        planned = plan_stores(geometry, candidates, check, (True,) * len(check.keys), reserved)
        event = StoreEvent(0, planned.batches)
        pinned_block_ids(event)
        return event

    event = plan_step()
    stored_blocks = sum(len(batch) for batch in event.batches)
    total_us = measure_us(plan_step, budget_s)
    return {
        "requests": requests,
        "stored_blocks": stored_blocks,
        "total_us": total_us,
        "per_request_us": total_us / requests,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="shorter timing budgets")
    args = parser.parse_args(argv)
    budget = 0.3 if args.quick else 1.0

    print(f"python {sys.version.split()[0]}; times are the best of 5 runs, microseconds per call")
    print()
    print("lookup -> load plan, 32,768-token prompt, every object hits")
    header = (
        f"{'block':>5} {'ranks':>5} {'keys':>6} {'total':>9} {'query':>9} {'fold':>8} "
        f"{'window':>8} {'load':>8} {'baseline':>9} {'speed-up':>8}"
    )
    print(header)
    lookups = []
    for block_size in (16, 32):
        for tp in (1, 4):
            row = lookup_case(32768, block_size, tp, budget)
            lookups.append(row)
            print(
                f"{block_size:>5} {tp:>5} {row['keys']:>6} {row['total_us']:>9.1f} "
                f"{row['build_query_us']:>9.1f} {row['fold_us']:>8.1f} "
                f"{row['hit_window_us']:>8.1f} {row['load_batch_us']:>8.1f} "
                f"{row['baseline_us']:>9.1f} {row['baseline_us'] / row['total_us']:>7.1f}x"
            )
    print()
    print("growth with prompt length (block 16, one rank)")
    print(f"{'tokens':>7} {'blocks':>6} {'total':>9} {'per block':>10} {'vs 2K':>7}")
    growth = []
    for num_tokens in (2048, 8192, 32768):
        row = lookup_case(num_tokens, 16, 1, budget)
        growth.append(row)
        base = growth[0]["total_us"]
        print(
            f"{num_tokens:>7} {row['blocks']:>6} {row['total_us']:>9.1f} "
            f"{row['total_us'] / row['blocks'] * 1000:>8.1f}ns {row['total_us'] / base:>6.1f}x"
        )
    print(f"(blocks grow {growth[-1]['blocks'] / growth[0]['blocks']:.0f}x)")
    print()
    store = store_step_case(256, budget)
    print("store planning, one step of 256 requests (512 new tokens each, residency check)")
    print(
        f"  {store['total_us']:.0f} us per step, {store['per_request_us']:.1f} us per request, "
        f"{store['stored_blocks']} blocks planned"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"lookup_32k": lookups, "growth": growth, "store_step": store}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
