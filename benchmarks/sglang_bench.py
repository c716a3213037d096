"""SGLang TTFT with a long shared prefix: restored from umbp vs recomputed vs SGLang's
own host-cache hit vs SGLang's built-in ``file`` storage backend, in one run.

Run with the SGLang venv (``make test`` builds it; docs/sglang.md)::

    .venv-sglang/bin/python benchmarks/sglang_bench.py [--prefix 2048] [--json out.json]

Two writer engines (A: umbp through ``umbp serve``; A': the ``file`` backend) store the
same prompts; then two fresh reader engines (B, B') are started and measured one at a
time. B serves, in order: the stored prompts (restored from umbp), as many never-seen
prompts (recomputed; they also push the stored ones out of the device cache), the last
of those again (a device-cache hit), and the stored prompts again (SGLang's host-cache
hit: they are still in its host pool). B' serves the stored prompts
(restored from files). TTFT = the latency of a request for one new token. Every
generated token is checked against the first engine's, so a figure never comes from a
wrong restore.
"""

from __future__ import annotations

import argparse
import json
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


def _case(engine: SGLangEngineProcess, prompts: list[list[int]], source: str,
          expected: dict[tuple[int, ...], list[int]]) -> dict[str, Any]:
    outputs = engine.generate(prompts, 1)
    for prompt, output in zip(prompts, outputs):
        reference = expected.setdefault(tuple(prompt), output["tokens"])
        if output["tokens"] != reference:
            raise AssertionError(f"{source}: generated tokens differ from the first engine's")
    return {"ttft_s": [round(o["seconds"], 4) for o in outputs],
            "median_s": statistics.median(o["seconds"] for o in outputs),
            "cached": [o["details"] for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per case")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    arguments = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="umbp-sglang-bench-"))
    recipe = llama_recipe(hidden_size=256, layers=4, heads=4, kv_heads=2, intermediate=512,
                          vocab=2048, max_positions=8192)
    model = str(write_random_model(recipe, work / "model"))
    environment = cpu_environment(work / "torch-extensions")
    socket = str(work / "umbp.sock")
    files = work / "hicache-files"
    server = start_server(socket, 1 << 30)
    umbp_args = engine_arguments(model, storage_backend="dynamic", max_total_tokens=8192,
                                 storage_config=umbp_storage(mode="server", endpoint=socket))
    file_args = engine_arguments(model, storage_backend="file", max_total_tokens=8192,
                                 storage_config={"prefetch_threshold": 16,
                                                 "file_storage_path": str(files)})
    stored = _prompts(arguments.prompts, arguments.prefix, seed=1)
    fresh = _prompts(arguments.prompts, arguments.prefix, seed=2)
    pages = len(stored) * (arguments.prefix // PAGE_SIZE)
    expected: dict[tuple[int, ...], list[int]] = {}
    engines: list[SGLangEngineProcess] = []
    try:
        finish_hash_extension_build(start_hash_extension_build(environment))
        writer = SGLangEngineProcess(umbp_args, environment, work / "a.log", wait=False)
        file_writer = SGLangEngineProcess(file_args, environment, work / "a-file.log",
                                          wait=False)
        engines += [writer, file_writer]
        for engine in (writer, file_writer):
            engine.wait_until_ready()
            _case(engine, stored, "writer", expected)
        with ServerStore(socket) as store:
            _wait(lambda: store.stats().objects >= pages)
        _wait(lambda: len(list(files.glob("*.bin"))) >= pages)
        writer.close()
        file_writer.close()
        reader = SGLangEngineProcess(umbp_args, environment, work / "b.log", wait=False)
        file_reader = SGLangEngineProcess(file_args, environment, work / "b-file.log",
                                          wait=False)
        engines += [reader, file_reader]
        reader.wait_until_ready()
        file_reader.wait_until_ready()
        figures = {
            "restored_umbp": _case(reader, stored, "restored from umbp", expected),
            "recomputed": _case(reader, fresh, "recomputed", expected),
            "device_hit": _case(reader, fresh[-1:], "device-cache hit", expected),
            "host_hit": _case(reader, stored, "host-cache hit", expected),
            "restored_file": _case(file_reader, stored, "restored from file", expected),
        }
    finally:
        for engine in engines:
            engine.close()
        stop_server(server, socket)
    median = {name: case["median_s"] for name, case in figures.items()}
    report = {
        "prefix_tokens": arguments.prefix, "prompts_per_case": arguments.prompts,
        "model": recipe.identity(), "median_ttft_s": median,
        "ratios": {
            "restored_umbp / recomputed": median["restored_umbp"] / median["recomputed"],
            "restored_umbp / host_hit": median["restored_umbp"] / median["host_hit"],
            "restored_umbp / restored_file": median["restored_umbp"] / median["restored_file"],
            "restored_file / host_hit": median["restored_file"] / median["host_hit"],
        },
        "cases": figures,
    }
    print(f"SGLang TTFT, {arguments.prefix}-token prefix, median of {arguments.prompts}:")
    for name, seconds in median.items():
        print(f"  {name:15s} {seconds * 1000:8.1f} ms")
    for name, ratio in report["ratios"].items():
        print(f"  {name:32s} {ratio:6.3f}")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
