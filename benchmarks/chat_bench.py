"""Multi-turn chat: every turn's prompt is the previous prompt, the model's answer and
a new user message. umbp (with ``save_decode_cache``, so answers are stored too)
against vLLM's own prefix cache alone, on a vLLM KV cache too small to hold every
conversation and a umbp pool smaller than the working set.

    python benchmarks/chat_bench.py [--json FILE] [--quick]

N conversations take T turns each; a seeded schedule serves them in batches of C
concurrent conversations picked at random among those with turns left, so
conversations advance at different paces (a fixed round-robin order would make
any LRU cache smaller than the working set miss every time). Both engines run in
their own long-lived process, one model thread each, and get the same schedule,
batch by batch, the engine order alternating; each engine builds its conversations
from its own answers, and the answers must be identical (restored KV is exact).

Reported per engine: umbp hit rate (tokens restored from umbp / prompt tokens),
vLLM's own prefix-cache hit rate, TTFT p50/p99 (vLLM's per-request first-token
latency, queueing within the batch included), prompt and generated tokens per
second over the whole workload, and ratios umbp / vLLM-only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.testing.engine_processes import EngineProcesses
from umbp.testing.table import format_table

BLOCK_SIZE = 32
VOCAB = 512
ENGINES = ("vllm_only", "umbp")
LABELS = {"vllm_only": "vLLM prefix cache only", "umbp": "umbp + vLLM prefix cache"}


@dataclass(frozen=True, slots=True)
class Workload:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    conversations: int
    concurrency: int
    turns: int
    first_tokens: int
    user_tokens: int
    answer_tokens: int
    max_model_len: int

    @property
    def model_name(self) -> str:
        return (f"llama-h{self.hidden}-l{self.layers}-a{self.heads}-kv{self.kv_heads}"
                f"-i{self.intermediate}")

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * 4

    def final_tokens(self) -> int:
        """Prompt plus answer of a conversation's last turn."""
        return self.first_tokens + (self.turns - 1) * (self.answer_tokens + self.user_tokens) + (
            self.answer_tokens)

    def kv_cache_bytes(self) -> int:
        """vLLM's cache: 1.5 batches of final-turn conversations (at least one
        max-length request), far from all conversations."""
        tokens = max(self.max_model_len, 3 * self.concurrency * self.final_tokens() // 2)
        return tokens * self.kv_bytes_per_token()

    def working_set_bytes(self) -> int:
        return self.conversations * self.final_tokens() * self.kv_bytes_per_token()

    def pool_bytes(self) -> int:
        """Three quarters of the working set: more than vLLM's cache, less than all."""
        return 3 * self.working_set_bytes() // 4


FULL = Workload(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1024,
                conversations=16, concurrency=4, turns=6, first_tokens=512,
                user_tokens=64, answer_tokens=32, max_model_len=2048)
QUICK = Workload(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256,
                 conversations=8, concurrency=2, turns=3, first_tokens=128,
                 user_tokens=40, answer_tokens=8, max_model_len=512)


@dataclass(slots=True)
class BatchRun:
    seconds: float
    answers: list[list[int]]
    ttft_s: list[float]
    prompt_tokens: int
    cached_tokens: int
    restored_tokens: int


@dataclass(slots=True)
class Totals:
    seconds: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    restored_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)

    def add(self, run: BatchRun) -> None:
        self.seconds += run.seconds
        self.prompt_tokens += run.prompt_tokens
        self.generated_tokens += sum(len(a) for a in run.answers)
        self.cached_tokens += run.cached_tokens
        self.restored_tokens += run.restored_tokens
        self.ttft_ms.extend(t * 1e3 for t in run.ttft_s)

    def summary(self) -> dict[str, float]:
        ttft = sorted(self.ttft_ms)
        return {
            "umbp_hit_rate": self.restored_tokens / self.prompt_tokens,
            "vllm_hit_rate": (self.cached_tokens - self.restored_tokens) / self.prompt_tokens,
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p99_ms": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "prompt_tok_s": self.prompt_tokens / self.seconds,
            "generated_tok_s": self.generated_tokens / self.seconds,
            "seconds": self.seconds,
            "prompt_tokens": float(self.prompt_tokens),
            "restored_tokens": float(self.restored_tokens),
        }


# ------------------------------------------------------------- engine process


def write_model(workload: Workload, root: Path) -> str:
    from umbp.testing.models import llama_recipe, write_random_model

    recipe = llama_recipe(hidden_size=workload.hidden, layers=workload.layers,
                          heads=workload.heads, kv_heads=workload.kv_heads,
                          intermediate=workload.intermediate, vocab=VOCAB,
                          max_positions=max(4096, workload.max_model_len))
    return str(write_random_model(recipe, root / workload.model_name))


def serve_engine(name: str, model_dir: str, workload: Workload, threads: int,
                 conn: Connection) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from umbp.testing.engine import local_connector, make_llm

    connector = None
    if name == "umbp":
        connector = {"mode": "embedded", "capacity_bytes": workload.pool_bytes(),
                     "save_decode_cache": True}
    llm = make_llm(model_dir, connector=connector, block_size=BLOCK_SIZE,
                   max_model_len=workload.max_model_len,
                   kv_cache_bytes=workload.kv_cache_bytes(), disable_log_stats=False)
    worker = None if local_connector() is None else local_connector().worker
    params = SamplingParams(temperature=0, max_tokens=workload.answer_tokens,
                            detokenize=False, ignore_eos=True)
    conn.send("ready")
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        if message[0] == "pool":
            pool = None if worker is None else worker.pool
            conn.send({} if pool is None else {
                "objects": pool.stats().objects, "evictions": pool.stats().evictions,
                "used_bytes": pool.stats().used_bytes})
            continue
        prompts: list[list[int]] = message[1]
        loaded = 0 if worker is None else worker.counters.loaded_blocks
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        seconds = time.perf_counter() - started
        restored = 0 if worker is None else (worker.counters.loaded_blocks - loaded) * BLOCK_SIZE
        conn.send(BatchRun(
            seconds=seconds,
            answers=[list(o.outputs[0].token_ids) for o in outputs],
            ttft_s=[float(o.metrics.first_token_latency) for o in outputs],
            prompt_tokens=sum(len(p) for p in prompts),
            cached_tokens=sum(int(o.num_cached_tokens or 0) for o in outputs),
            restored_tokens=restored,
        ))
    del llm


class Engines(EngineProcesses):
    def __init__(self, model_dir: str, workload: Workload, threads: int) -> None:
        super().__init__(ENGINES, serve_engine, (model_dir, workload, threads))

    def run(self, name: str, prompts: list[list[int]]) -> BatchRun:
        result = self.call(name, "run", prompts)
        assert isinstance(result, BatchRun)
        return result

    def pool(self, name: str) -> dict[str, int]:
        result = self.call(name, "pool")
        assert isinstance(result, dict)
        return result


# ------------------------------------------------------------------ workload


def schedule(workload: Workload, rng: random.Random) -> list[list[int]]:
    """Batches of up to C distinct conversations, picked at random among those
    with turns left."""
    left = {c: workload.turns for c in range(workload.conversations)}
    batches = []
    while left:
        batch = sorted(rng.sample(sorted(left), min(workload.concurrency, len(left))))
        for conversation in batch:
            left[conversation] -= 1
            if left[conversation] == 0:
                del left[conversation]
        batches.append(batch)
    return batches


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(count)]


def measure(engines: Engines, workload: Workload) -> tuple[dict[str, Totals], bool]:
    rng = random.Random(2026)
    for name in ENGINES:  # warm-up with a prompt used nowhere else
        engines.run(name, [tokens(rng, 64)])
    # What every conversation says, fixed up front: the first message and one per turn.
    first = [tokens(rng, workload.first_tokens) for _ in range(workload.conversations)]
    user = [[tokens(rng, workload.user_tokens) for _ in range(workload.turns)]
            for _ in range(workload.conversations)]
    history = {name: [list(p) for p in first] for name in ENGINES}
    turn = [0] * workload.conversations
    totals = {name: Totals() for name in ENGINES}
    identical = True
    for index, batch in enumerate(schedule(workload, rng)):
        order = ENGINES if index % 2 == 0 else ENGINES[::-1]
        answers = {}
        for name in order:
            run = engines.run(name, [history[name][c] for c in batch])
            totals[name].add(run)
            answers[name] = run.answers
        identical = identical and answers["umbp"] == answers["vllm_only"]
        for position, conversation in enumerate(batch):
            turn[conversation] += 1
            for name in ENGINES:
                history[name][conversation] += answers[name][position]
                if turn[conversation] < workload.turns:
                    history[name][conversation] += user[conversation][turn[conversation]]
    return totals, identical


# ------------------------------------------------------------------- report


def print_table(summaries: dict[str, dict[str, float]]) -> None:
    header = ("engine", "umbp hit", "vLLM hit", "TTFT p50 ms", "TTFT p99 ms",
              "prompt tok/s", "gen tok/s")
    rows = [(LABELS[name], f"{s['umbp_hit_rate']:.1%}", f"{s['vllm_hit_rate']:.1%}",
             f"{s['ttft_p50_ms']:.1f}", f"{s['ttft_p99_ms']:.1f}", f"{s['prompt_tok_s']:.1f}",
             f"{s['generated_tok_s']:.1f}") for name, s in summaries.items()]
    u, v = summaries["umbp"], summaries["vllm_only"]
    rows.append(("umbp / vLLM only", "", "", f"{u['ttft_p50_ms'] / v['ttft_p50_ms']:.2f}",
                 f"{u['ttft_p99_ms'] / v['ttft_p99_ms']:.2f}",
                 f"{u['prompt_tok_s'] / v['prompt_tok_s']:.2f}",
                 f"{u['generated_tok_s'] / v['generated_tok_s']:.2f}"))
    print(format_table(header, rows))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 conversations")
    parser.add_argument("--threads", type=int, default=1, help="model threads per engine")
    parser.add_argument("--model-root", type=Path,
                        default=Path.home() / ".cache" / "umbp" / "bench-models")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload = QUICK if args.quick else FULL
    model_dir = write_model(workload, args.model_root)
    mib = 1 << 20
    started = time.perf_counter()
    engines = Engines(model_dir, workload, args.threads)
    print(f"model {workload.model_name} (float32, {workload.kv_bytes_per_token()} KV bytes/token),"
          f" block {BLOCK_SIZE}; engines ready in {time.perf_counter() - started:.1f} s\n"
          f"{workload.conversations} conversations x {workload.turns} turns, {workload.concurrency}"
          f" at a time; first message {workload.first_tokens} tokens, user "
          f"{workload.user_tokens}, answer {workload.answer_tokens}; last turn "
          f"{workload.final_tokens()} tokens\nworking set {workload.working_set_bytes() / mib:.1f}"
          f" MiB; vLLM KV cache {workload.kv_cache_bytes() / mib:.1f} MiB; umbp pool "
          f"{workload.pool_bytes() / mib:.1f} MiB (save_decode_cache on)")
    try:
        totals, identical = measure(engines, workload)
        pool = engines.pool("umbp")
    finally:
        engines.close()
    summaries = {name: totals[name].summary() for name in ENGINES}
    print()
    print_table(summaries)
    print(f"answers identical with and without umbp: {'yes' if identical else 'NO'}; "
          f"umbp pool at the end: {pool.get('objects', 0)} objects, "
          f"{pool.get('used_bytes', 0) / mib:.0f} MiB, {pool.get('evictions', 0)} evictions")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "benchmark": "chat", "quick": args.quick, "threads": args.threads,
            "workload": asdict(workload), "kv_cache_bytes": workload.kv_cache_bytes(),
            "pool_bytes": workload.pool_bytes(),
            "working_set_bytes": workload.working_set_bytes(), "summary": summaries,
            "identical": identical, "pool": pool,
            "ttft_ms": {name: totals[name].ttft_ms for name in ENGINES},
        }, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
