"""Fixtures shared by the unit tests that build vLLM's real scheduler objects."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama config (no weights): what vLLM's config and scheduler need."""
    from tests.unit.vllm_driver import write_model_config  # imports vLLM: only when used

    return write_model_config(tmp_path_factory.mktemp("tiny-llama"))
