"""``umbp demo``: the main job, end to end on a real vLLM engine.

Writes a small random-weight Llama-style model locally (no model hub), serves
prompts that share long document prefixes, and compares, for each prompt, the
time to first token when the prefix is recomputed, when vLLM's own prefix
cache hits, and when vLLM's cache is empty and umbp restores the prefix. It
checks that restored generations are token-for-token identical to recomputed
ones and reports what the pool holds.

The embedded pool lives inside the engine and goes away with it, so "restored"
means: the same engine with vLLM's own prefix cache emptied
(``reset_prefix_cache()``), where only umbp can serve the prefix.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from umbp.testing.table import format_table

DEMO_CAPACITY = 512 << 20
REPEATS = 3


def _say(message: str) -> None:
    print(message, flush=True)


@dataclass(frozen=True, slots=True)
class PromptResult:
    tokens: int
    restored: int
    ttft_cold: float
    ttft_restored: float
    ttft_vllm_hit: float
    identical: bool


def _demo_prompts(count: int, prefix_tokens: int, vocab: int) -> list[list[int]]:
    """Two questions per document: documents are the long shared prefixes."""
    rng = random.Random(2026)
    documents = [[rng.randrange(1, vocab) for _ in range(prefix_tokens)]
                 for _ in range((count + 1) // 2)]
    return [documents[i // 2] + [rng.randrange(1, vocab) for _ in range(48)] for i in range(count)]


def _median_seconds(action: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
    samples = []
    for _ in range(REPEATS):
        if before is not None:
            before()
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _generate(llm: Any, prompt: Sequence[int], max_tokens: int, recompute: bool = False) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False,
                            ignore_eos=True, skip_reading_prefix_cache=recompute or None)
    return llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params,
                        use_tqdm=False)[0]


def _measure(llm: Any, prompt: Sequence[int]) -> PromptResult:
    """TTFT recomputed, on vLLM's own hit and restored from umbp; outputs compared."""
    from umbp.testing.engine import empty_vllm_cache

    reference = _generate(llm, prompt, 16, recompute=True)  # also stores it in umbp
    ttft_cold = _median_seconds(partial(_generate, llm, prompt, 1, recompute=True))
    ttft_hit = _median_seconds(partial(_generate, llm, prompt, 1))
    ttft_restored = _median_seconds(partial(_generate, llm, prompt, 1),
                                    before=partial(empty_vllm_cache, llm))
    empty_vllm_cache(llm)
    restored = _generate(llm, prompt, 16)
    return PromptResult(
        tokens=len(prompt),
        restored=int(restored.num_cached_tokens or 0),
        ttft_cold=ttft_cold,
        ttft_restored=ttft_restored,
        ttft_vllm_hit=ttft_hit,
        identical=list(restored.outputs[0].token_ids) == list(reference.outputs[0].token_ids),
    )


def run_demo(workdir: str | None, prompts: int, prefix_tokens: int) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # pool stats in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    root = Path(workdir or Path.home() / ".cache" / "umbp" / "demo")
    from umbp.testing.models import llama_recipe, write_random_model

    recipe = llama_recipe(hidden_size=256, layers=4, heads=4, kv_heads=2, max_positions=4096)
    _say(f"[1/4] writing a random-weight Llama-style model (4 layers, hidden 256) to {root} ...")
    model_dir = str(write_random_model(recipe, root / "llama-random"))
    _say("[2/4] starting a vLLM engine with umbp (embedded pool, "
         f"{DEMO_CAPACITY >> 20} MiB); importing vLLM takes ~10 s ...")
    from umbp.runtime.embedded import local_pools
    from umbp.testing.engine import make_llm

    started = time.perf_counter()
    llm = make_llm(
        model_dir,
        connector={"mode": "embedded", "capacity_bytes": DEMO_CAPACITY},
        block_size=32, max_model_len=4096, kv_cache_bytes=512 << 20,
    )
    _say(f"      engine ready in {time.perf_counter() - started:.1f} s")
    batch = _demo_prompts(prompts, prefix_tokens, vocab=500)

    _generate(llm, batch[0][:64], 1, recompute=True)  # warm-up: first-call costs
    _say(f"[3/4] serving {len(batch)} prompts of {len(batch[0])} tokens "
         f"({prefix_tokens}-token document prefixes), {REPEATS} timings each ...")
    results = [_measure(llm, prompt) for prompt in batch]
    stats = [pool.stats() for pool in local_pools()]
    _say("[4/4] results (TTFT umbp: vLLM's own prefix cache emptied first, so only umbp "
         "can serve the prefix)\n")
    _print_table(results)
    objects = sum(s.objects for s in stats)
    used = sum(s.used_bytes for s in stats)
    _say(f"\npool: {objects} objects, {used / 2**20:.1f} MiB of "
         f"{sum(s.capacity_bytes for s in stats) / 2**20:.0f} MiB used, "
         f"{sum(s.hits for s in stats)} object hits, {sum(s.evictions for s in stats)} evictions")
    ok = all(r.identical and r.restored > 0 for r in results)
    _say("all restored outputs identical to recomputed ones: " + ("yes" if ok else "NO"))
    del llm
    return 0 if ok else 1


def _print_table(results: Sequence[PromptResult]) -> None:
    header = ("prompt", "tokens", "restored", "TTFT cold", "TTFT umbp", "TTFT vLLM hit",
              "umbp speed-up", "identical")
    rows = [
        (str(i + 1), str(r.tokens), str(r.restored), f"{r.ttft_cold * 1e3:.1f} ms",
         f"{r.ttft_restored * 1e3:.1f} ms", f"{r.ttft_vllm_hit * 1e3:.1f} ms",
         f"{r.ttft_cold / r.ttft_restored:.2f}x", "yes" if r.identical else "NO")
        for i, r in enumerate(results)
    ]
    _say(format_table(header, rows))


if __name__ == "__main__":
    sys.exit(run_demo(None, 4, 1536))
