"""Admission CPU time of this checkout's ``umbp.core`` against an earlier commit's, in one run.

    python benchmarks/admission_ab.py --before REV [--rounds N] [--json FILE]

``git archive REV umbp/core`` is unpacked into a temporary directory as the package
``umbp_before.core`` (core is pure, so it needs nothing else), and both versions'
admission (lookup query, the store's answer, per-rank fold, hit window, load plan
for a prompt whose every object hits) and lookup part (query, answer and fold) are
timed call by call (and, for a core with
``request_lookup_query``, a repeated admission of the same request, its query from
the request's memo; against a core without it, "before" is its first admission),
interleaved in rotating order, in this one process: CPU time of this thread per call
(``time.thread_time_ns``), GC on, median of ``--rounds`` calls. Prints the medians
and each case's after/before ratio.

The store is this checkout's: one ``SlabPool`` per rank holding every object. A core
whose query has ``runs`` is answered as the scheduler answers it against the embedded
pool, by hash (``RankedLookup.lookup_hashes``: no key string); an earlier core's key
strings are routed to the pools by position (what its ``RankedLookup`` did) and
answered by ``SlabPool.lookup``, so each side pays what the engine paid with it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import types
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from measure import interleaved_cpu_median_ns  # benchmarks/, this script's folder

CASES = ((32768, 32, 1), (32768, 32, 4), (32768, 16, 1), (32768, 16, 4), (8192, 32, 1))
_IMPORT = re.compile(r"^(\s*(?:from|import) )umbp(?=[. ])", re.MULTILINE)


def unpack_before(rev: str, into: Path) -> None:
    """``umbp/core`` of ``rev`` as the package ``umbp_before.core`` under ``into``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "umbp/core"], cwd=ROOT, check=True,
        capture_output=True,
    ).stdout
    package = into / "umbp_before"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith(".py"):
                continue
            extracted = tar.extractfile(member)
            assert extracted is not None
            source = _IMPORT.sub(r"\1umbp_before", extracted.read().decode())
            target = package / Path(member.name).relative_to("umbp")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(source)


def store_of(package: str, query: Any, keyspace: Any, stack: ExitStack) -> Callable[[Any], object]:
    """How ``package``'s queries are answered: one SlabPool per rank, every object held."""
    from umbp.runtime.lookup_service import RankedLookup
    from umbp.runtime.pool import SlabPool

    rank_keys: Any = importlib.import_module(f"{package}.core.rank_keys")
    keys = query.runs.key_strings() if hasattr(query, "runs") else query.keys
    pools = []
    for rank in range(keys.layout.rank_count):
        mine = keys.keys_of_rank(rank)
        pool = SlabPool((len(mine) + 2) * 64, page_bytes=64, high_watermark=1.0, low_watermark=0.9)
        stack.callback(pool.close)
        assert all(pool.put_batch(mine, [memoryview(b"x")] * len(mine)))
        pools.append(pool)
    if hasattr(query, "runs"):
        router = RankedLookup(dict(zip(rank_keys.rank_tags(keyspace), pools)))
        return lambda built: router.lookup_hashes(built.runs)

    def by_position(built: Any) -> object:
        if len(pools) == 1:
            return pools[0].lookup(built.keys)
        return rank_keys.merge_rank_answers(built.keys.layout, [
            pool.lookup(built.keys.keys_of_rank(rank)) for rank, pool in enumerate(pools)
        ])

    return by_position


def core_names(package: str) -> tuple[Any, Any]:
    """The lookup and load-plan functions of ``package``'s core, under today's names,
    whichever layout that core has: one ``core.lookup`` module (with ``core.plans``,
    later ``core.load_plans``) before the core was grouped into packages, the
    ``core.lookup``, ``core.geometry`` and ``core.loads`` packages after (whose
    ``loads.plans`` became ``loads.allocation``)."""
    if importlib.util.find_spec(f"{package}.core.geometry") is None:
        lookup: Any = importlib.import_module(f"{package}.core.lookup")
        old = "load_plans" if importlib.util.find_spec(f"{package}.core.load_plans") else "plans"
        plans: Any = importlib.import_module(f"{package}.core.{old}")
        return (
            types.SimpleNamespace(**vars(lookup), CacheGeometry=lookup.LookupGeometry),
            types.SimpleNamespace(load_plan=plans.load_batch),
        )
    names: dict[str, Any] = {}
    for module in ("geometry", "lookup.query", "lookup.windows"):
        names.update(vars(importlib.import_module(f"{package}.core.{module}")))
    allocation = ("allocation" if importlib.util.find_spec(f"{package}.core.loads.allocation")
                  else "plans")
    return (
        types.SimpleNamespace(**names),
        importlib.import_module(f"{package}.core.loads.{allocation}"),
    )


def admission_calls(
    package: str, num_tokens: int, block_size: int, tp: int, stack: ExitStack
) -> dict[str, Callable[[], object]]:
    identity: Any = importlib.import_module(f"{package}.core.identity")
    lookup, plans = core_names(package)
    geometry = lookup.CacheGeometry((0,), (block_size,), (block_size,), block_size, block_size)
    keyspace = identity.KeySpace("bench-namespace-0123", identity.RankTopology(tp_size=tp))
    hashes = tuple(hashlib.sha256(i.to_bytes(8, "big")).digest() for i in range(num_tokens // block_size))
    table = (tuple(range(1, num_tokens // block_size + 1)),)
    ask = store_of(
        package, lookup.build_lookup_query(geometry, keyspace, hashes, 0, num_tokens), keyspace,
        stack,
    )

    def lookup_part() -> object:
        query = lookup.build_lookup_query(geometry, keyspace, hashes, 0, num_tokens)
        return lookup.fold_rank_hits(query, ask(query))

    def admission() -> object:
        query = lookup.build_lookup_query(geometry, keyspace, hashes, 0, num_tokens)
        folded = lookup.fold_rank_hits(query, ask(query))
        spec = lookup.single_group_load_spec(geometry, query, folded)
        return plans.load_plan("r", geometry, spec, table, hashes, spec.num_tokens_to_load).unwrap()

    calls = {"admission": admission, "lookup": lookup_part}
    if hasattr(lookup, "request_lookup_query"):
        # A later admission of the same request: its query from the request's memo.
        _, memo = lookup.request_lookup_query(geometry, keyspace, hashes, 0, num_tokens,
                                              lookup.EMPTY_LOOKUP_MEMO)

        def repeat() -> object:
            query, _ = lookup.request_lookup_query(geometry, keyspace, hashes, 0, num_tokens, memo)
            folded = lookup.fold_rank_hits(query, ask(query))
            spec = lookup.single_group_load_spec(geometry, query, folded)
            return plans.load_plan("r", geometry, spec, table, hashes, spec.num_tokens_to_load).unwrap()

        assert repeat() == admission()
        calls["repeat"] = repeat
    return calls




def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="umbp-ab-") as scratch:
        unpack_before(args.before, Path(scratch))
        sys.path.insert(0, scratch)
        print(f"admission CPU time, this checkout vs {args.before}: thread CPU per call, GC on, "
              f"median of {args.rounds} interleaved calls; every object hits")
        print(f"{'tokens':>7} {'block':>5} {'ranks':>5} {'part':>9} {'before':>9} {'after':>9} {'after/before':>12}")
        for case in CASES:
            with ExitStack() as pools:
                calls = {(package, part): call for package in ("umbp_before", "umbp")
                         for part, call in admission_calls(package, *case, pools).items()}
                medians = interleaved_cpu_median_ns(calls, args.rounds)
            for part in ("admission", "lookup", "repeat"):
                if ("umbp", part) not in medians:
                    continue
                # A core without the key memo has no repeated admission: its first.
                before = medians.get(("umbp_before", part), medians[("umbp_before", "admission")]) / 1e3
                after = medians[("umbp", part)] / 1e3
                rows.append({"tokens": case[0], "block_size": case[1], "ranks": case[2], "part": part,
                             "before_us": before, "after_us": after})
                print(f"{case[0]:>7} {case[1]:>5} {case[2]:>5} {part:>9} {before:>7.0f}us "
                      f"{after:>7.0f}us {after / before:>12.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"before": args.before, "rounds": args.rounds, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
