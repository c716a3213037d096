"""Two engines sharing one node-local server (`umbp serve`): what the second engine
gets from prefixes the first one computed.

    python benchmarks/shared_server_bench.py [--json FILE] [--prefix-tokens 4096]
                                             [--repeats 5] [--quick]

A real `umbp serve` process and two engine processes ("first", "second"), both with
`mode: "server"` on the same socket, serve a random-weight Llama-style model. Each
repetition draws a new document prefix; the first engine serves it (and stores it);
then the second engine, which has never seen it, serves three prompts behind it,
the order rotating every repetition:

* ``restored``: its first sight of the prefix: only the server can provide it;
* ``vllm_hit``: the prefix is in the second engine's own prefix cache (served once
  just before);
* ``recomputed``: ``skip_reading_prefix_cache=True``: the whole prompt is prefilled.

Reported: medians of time to first token in the second engine and the ratios
restored / vLLM hit and recomputed / restored, the second engine's hit rate (prompt
tokens restored from the server / prompt tokens on first sight), and whether a
restored 16-token generation equals the recomputed one.
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
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.testing.engine_processes import EngineProcesses
from umbp.testing.table import format_table

BLOCK_SIZE = 32
VOCAB = 512
SUFFIX_TOKENS = 48
CHECK_TOKENS = 16
MAX_MODEL_LEN = 8192
KV_CACHE_BYTES = 1 << 30
SERVER_CAPACITY = 2 << 30
MODES = ("restored", "vllm_hit", "recomputed")
FULL_SHAPE = {"hidden_size": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1024}
QUICK_SHAPE = {"hidden_size": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}


def serve_engine(name: str, model_dir: str, endpoint: str, conn: Connection) -> None:
    """One engine process: answers ("generate", prompt, max_tokens, recompute) with
    (seconds, token ids, cached tokens), and ("reset",)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from umbp.testing.engine import empty_vllm_cache, make_llm

    llm = make_llm(model_dir, connector={"mode": "server", "endpoint": endpoint},
                   block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                   kv_cache_bytes=KV_CACHE_BYTES)
    conn.send("ready")
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        if message[0] == "reset":  # empty this engine's own prefix cache
            empty_vllm_cache(llm)
            conn.send(True)
            continue
        _, prompt, max_tokens, recompute = message
        params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False,
                                ignore_eos=True, skip_reading_prefix_cache=recompute or None)
        started = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                              use_tqdm=False)[0]
        conn.send((time.perf_counter() - started, list(output.outputs[0].token_ids),
                   int(output.num_cached_tokens or 0)))


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(count)]


def run(engines: EngineProcesses, prefix_tokens: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(2026)
    engines.call("second", "generate", tokens(rng, 64), 1, True)  # first-call costs
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    restored_tokens: list[int] = []
    for repeat in range(repeats):
        prefix = tokens(rng, prefix_tokens)
        engines.call("first", "generate", prefix + tokens(rng, SUFFIX_TOKENS), 1, False)
        order = MODES[repeat % 3:] + MODES[:repeat % 3]
        # The first sight must come first: rotate the other two behind it.
        order = ("restored", *[mode for mode in order if mode != "restored"])
        for mode in order:
            prompt = prefix + tokens(rng, SUFFIX_TOKENS)
            seconds, _, cached = engines.call("second", "generate", prompt, 1,
                                              mode == "recomputed")
            samples[mode].append(seconds * 1e3)
            if mode == "restored":
                restored_tokens.append(cached)
    prompt = tokens(rng, prefix_tokens + SUFFIX_TOKENS)
    engines.call("first", "generate", prompt, 1, False)
    _, from_server, _ = engines.call("second", "generate", prompt, CHECK_TOKENS, False)
    engines.call("second", "reset")
    _, reference, _ = engines.call("second", "generate", prompt, CHECK_TOKENS, True)
    median = {mode: statistics.median(values) for mode, values in samples.items()}
    return {
        "median_ms": median, "samples_ms": samples,
        "restored_over_vllm_hit": median["restored"] / median["vllm_hit"],
        "recomputed_over_restored": median["recomputed"] / median["restored"],
        "hit_rate": sum(restored_tokens) / (repeats * (prefix_tokens + SUFFIX_TOKENS)),
        "identical": from_server == reference,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny model, short prefix")
    parser.add_argument("--model-root", type=Path,
                        default=Path.home() / ".cache" / "umbp" / "bench-models")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.prefix_tokens = min(args.repeats, 2), min(args.prefix_tokens, 512)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    from umbp.runtime.server.launch import start_server
    from umbp.testing.models import llama_recipe, write_random_model

    name = (f"llama-h{shape['hidden_size']}-l{shape['layers']}-a{shape['heads']}"
            f"-kv{shape['kv_heads']}-i{shape['intermediate']}")  # ttft_bench's model too
    model_dir = str(write_random_model(
        llama_recipe(**shape, vocab=VOCAB, max_positions=MAX_MODEL_LEN),
        args.model_root / name))
    with tempfile.TemporaryDirectory(prefix="umbp-bench-") as directory:
        endpoint = str(Path(directory) / "umbp.sock")
        server = start_server(endpoint, SERVER_CAPACITY)
        engines = EngineProcesses(("first", "second"), serve_engine, (model_dir, endpoint))
        try:
            result = run(engines, args.prefix_tokens, args.repeats)
        finally:
            engines.close()
            server.terminate()
            server.wait()
    median = result["median_ms"]
    print(f"model {name} (float32), prefix {args.prefix_tokens} tokens + {SUFFIX_TOKENS}, "
          f"block {BLOCK_SIZE}, {args.repeats} repeats; second engine's TTFT:")
    print(format_table(
        ("restored ms", "vLLM hit ms", "recomputed ms", "restored/hit", "recomp/restored",
         "hit rate", "identical"),
        [(f"{median['restored']:.1f}", f"{median['vllm_hit']:.1f}",
          f"{median['recomputed']:.1f}", f"{result['restored_over_vllm_hit']:.2f}",
          f"{result['recomputed_over_restored']:.2f}", f"{result['hit_rate']:.3f}",
          "yes" if result["identical"] else "NO")]))
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "shared-server", "quick": args.quick,
                                         "prefix_tokens": args.prefix_tokens,
                                         "repeats": args.repeats, **result}, indent=2))
    return 0 if result["identical"] and result["hit_rate"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
