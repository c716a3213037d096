"""SGLang TTFT with a long shared prefix: restored from umbp vs recomputed vs SGLang's
own device- and host-cache hits vs SGLang's built-in ``file`` storage backend, in one run.

Run with the SGLang venv (``make test`` builds it; docs/sglang.md)::

    .venv-sglang/bin/python benchmarks/sglang_bench.py [--prefix 2048] [--rounds 5] [--json out.json]

Two writer engines (A: umbp through ``umbp serve``; A': the ``file`` backend) store the
same prompts s0..sN; then two fresh reader engines (B: umbp, B': file) serve rounds. Round
i: B restores s_i from umbp; B' restores s_i from files; B recomputes a never-seen f_i,
then serves f_i again (a device-cache hit); B serves s_{i-1} again (a host-cache hit: the
device cache holds three prompts, so s_{i-1} has left it, but it is still in the host
pool). Round 0 only warms both readers up (an engine's first requests pay one-time
costs) and is not counted. Interleaving the cases puts each round's figures under the
same machine load, so the per-round ratios are what to read on a shared machine. TTFT =
the latency of a request for one new token. Every generated token is checked against
the first engine's, and where SGLang says each case's prefix came from (storage, host,
device) is checked, so a figure never comes from a wrong restore or the wrong tier.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.runtime.server.client import ServerStore
from umbp.runtime.server.launch import start_server, stop_server
from umbp.testing.models import llama_recipe, write_random_model
from umbp.testing.sglang_engine import (
    SGLangEngineProcess,
    cpu_environment,
    engine_arguments,
    finish_hash_extension_build,
    start_hash_extension_build,
    umbp_storage,
)

PAGE_SIZE = 16


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    return [[random.Random(seed * 1000 + i).randrange(1, 2000) for _ in range(length)]
            for i in range(count)]


def _wait(condition: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("stores did not finish")
        time.sleep(0.5)


def _request(engine: SGLangEngineProcess, prompt: list[int], case: str, source: str,
             expected: dict[tuple[int, ...], list[int]]) -> float:
    """TTFT of one request; its tokens and the tier its prefix came from checked."""
    (output,) = engine.generate([prompt], 1)
    reference = expected.setdefault(tuple(prompt), output["tokens"])
    if output["tokens"] != reference:
        raise AssertionError(f"{case}: generated tokens differ from the first engine's")
    details = output["details"]
    reused = {tier: int(details.get(tier, 0)) for tier in ("device", "host", "storage")}
    if source != "none" and reused[source] < len(prompt) - 2 * PAGE_SIZE:
        raise AssertionError(f"{case}: expected the prefix from {source}, SGLang says {reused}")
    if source == "none" and any(reused.values()):
        raise AssertionError(f"{case}: expected a recompute, SGLang says {reused}")
    return float(output["seconds"])


CASES = (  # name, engine, source tier
    ("restored_umbp", "umbp", "storage"), ("restored_file", "file", "storage"),
    ("recomputed", "umbp", "none"), ("device_hit", "umbp", "device"),
    ("host_hit", "umbp", "host"),
)
RATIOS = (("restored_umbp", "host_hit"), ("restored_umbp", "restored_file"),
          ("restored_umbp", "recomputed"), ("restored_file", "host_hit"))


def _round(readers: dict[str, SGLangEngineProcess], stored: list[list[int]],
           fresh: list[list[int]], i: int,
           expected: dict[tuple[int, ...], list[int]]) -> dict[str, float]:
    prompts = {"restored_umbp": stored[i], "restored_file": stored[i],
               "recomputed": fresh[i], "device_hit": fresh[i], "host_hit": stored[i - 1]}
    # Round 0 has no earlier stored prompt for a host hit; it only warms up.
    return {name: _request(readers[engine], prompts[name], name, source, expected)
            for name, engine, source in CASES if i > 0 or name != "host_hit"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    arguments = parser.parse_args()
    started = time.monotonic()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="umbp-sglang-bench-"))
    recipe = llama_recipe(hidden_size=256, layers=4, heads=4, kv_heads=2, intermediate=512,
                          vocab=2048, max_positions=8192)
    model = str(write_random_model(recipe, work / "model"))
    environment = cpu_environment(os.environ.get("UMBP_TEST_TORCH_EXTENSIONS_DIR",
                                                 str(work / "torch-extensions")))
    socket = str(work / "umbp.sock")
    files = work / "hicache-files"
    server = start_server(socket, 1 << 30)
    # Device cache: three prompts (a host hit needs its prompt evicted from it); host
    # pool: twelve (every prompt of a round stays there).
    sizes = {"max_total_tokens": 3 * arguments.prefix, "hicache_ratio": 4.0}
    umbp_args = engine_arguments(model, storage_backend="dynamic", **sizes,
                                 storage_config=umbp_storage(mode="server", endpoint=socket))
    file_args = engine_arguments(model, storage_backend="file", **sizes,
                                 storage_config={"prefetch_threshold": 16,
                                                 "file_storage_path": str(files)})
    count = arguments.rounds + 1
    stored = _prompts(count, arguments.prefix, seed=1)
    fresh = _prompts(count, arguments.prefix, seed=2)
    pages = count * (arguments.prefix // PAGE_SIZE)
    expected: dict[tuple[int, ...], list[int]] = {}
    engines: list[SGLangEngineProcess] = []
    rounds: list[dict[str, float]] = []
    try:
        finish_hash_extension_build(start_hash_extension_build(environment))
        writer = SGLangEngineProcess(umbp_args, environment, work / "a.log", wait=False)
        file_writer = SGLangEngineProcess(file_args, environment, work / "a-file.log",
                                          wait=False)
        engines += [writer, file_writer]
        for engine in (writer, file_writer):
            engine.wait_until_ready()
            for prompt in stored:
                _request(engine, prompt, "writer", "none", expected)
        with ServerStore(socket) as store:
            _wait(lambda: store.stats().objects >= pages)
        _wait(lambda: len(list(files.glob("*.bin"))) >= pages)
        writer.close()
        file_writer.close()
        readers = {
            "umbp": SGLangEngineProcess(umbp_args, environment, work / "b.log", wait=False),
            "file": SGLangEngineProcess(file_args, environment, work / "b-file.log",
                                        wait=False),
        }
        engines += readers.values()
        for engine in readers.values():
            engine.wait_until_ready()
        rounds = [_round(readers, stored, fresh, i, expected) for i in range(count)]
    finally:
        for engine in engines:
            engine.close()
        stop_server(server, socket)
    measured = rounds[1:]
    median = {name: statistics.median(r[name] for r in measured) for name, _, _ in CASES}
    report = {
        "prefix_tokens": arguments.prefix, "rounds": arguments.rounds,
        "model": recipe.identity(), "median_ttft_s": median,
        "median_of_round_ratios": {
            f"{a} / {b}": statistics.median(r[a] / r[b] for r in measured) for a, b in RATIOS},
        "ratio_of_medians": {f"{a} / {b}": median[a] / median[b] for a, b in RATIOS},
        "rounds_ttft_s": [{name: round(value, 4) for name, value in r.items()}
                          for r in rounds],
        "load_average_before_after": [round(load_before[0], 2),
                                      round(os.getloadavg()[0], 2)],
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(f"SGLang TTFT, {arguments.prefix}-token prefix, median of {arguments.rounds} "
          f"rounds (load average {report['load_average_before_after']}):")
    for name, seconds in median.items():
        per_round = " / ".join(f"{r[name] * 1000:.0f}" for r in measured)
        print(f"  {name:15s} {seconds * 1000:8.1f} ms   ({per_round})")
    for name, ratio in report["median_of_round_ratios"].items():
        print(f"  {name:32s} {ratio:6.3f} (median of per-round ratios)")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
