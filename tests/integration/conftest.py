"""Real vLLM engines, each scenario in its own interpreter (see
umbp.testing.scenario). Models are written once per test session."""

from __future__ import annotations

import pytest

from umbp.testing.models import ModelRecipe, llama_recipe, write_random_model


def _model(tmp_path_factory: pytest.TempPathFactory, name: str, recipe: ModelRecipe) -> str:
    return str(write_random_model(recipe, tmp_path_factory.getbasetemp() / name))


@pytest.fixture(scope="session")
def llama_fp32(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "llama-fp32", llama_recipe(dtype="float32"))


@pytest.fixture(scope="session")
def llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "llama-bf16", llama_recipe(dtype="bfloat16"))
