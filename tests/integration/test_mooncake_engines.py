"""Two vLLM engines in separate processes act as two nodes of one Mooncake Store cluster
(a real `mooncake_master` on loopback, TCP transport): a prefix one engine computed is
restored by the other with identical tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import run_scenario, start_scenario, wait_for_mark
from umbp.testing.engine import shared_prefix_prompts, unique_prompts
from umbp.testing.mooncake_master import MooncakeMaster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPTS = [*shared_prefix_prompts(2, prefix_tokens=200, suffix_tokens=41),
           *unique_prompts(1, 300, seed=41)]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    with MooncakeMaster.start(log=tmp_path / "master.log") as running:
        yield running


def _node(master: MooncakeMaster) -> dict[str, Any]:
    """One engine = one node: it contributes a 64 MiB segment to the cluster."""
    return {"mode": "mooncake", "mooncake_master": master.address,
            "mooncake_local_hostname": "127.0.0.1", "capacity_bytes": 64 << 20,
            "mooncake_buffer_bytes": 16 << 20}


def _spec(model_dir: str, engines: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model_dir": model_dir, "engine": {"block_size": 32, "dtype": "float32"},
            "prompts": PROMPTS, "max_tokens": 8, "engines": engines, **extra}


def test_a_prefix_computed_on_one_node_is_restored_on_another_with_identical_tokens(
    llama_fp32: str, master: MooncakeMaster, tmp_path: Path
) -> None:
    hold, mark = tmp_path / "release-first-node", tmp_path / "first-node-stored"
    # The first node stays up while the second restores: its segment holds the objects.
    first = start_scenario(_spec(llama_fp32, [
        {"connector": _node(master), "steps": ["generate", "stats", "mark", "hold"]},
    ], hold_file=str(hold), mark_file=str(mark)))
    try:
        wait_for_mark(mark, first)
        second = run_scenario(_spec(llama_fp32, [
            {"connector": None, "steps": ["generate"]},
            {"connector": _node(master), "steps": ["generate", "stats"]},
        ], bad_configs=[{**_node(master), "mooncake_master": "127.0.0.1:1"}]))
    finally:
        hold.touch()
        first.communicate(timeout=600)
    (baseline,), (restored, stats) = second["engines"]
    assert restored["tokens"] == baseline["tokens"]
    for prompt, cached in zip(PROMPTS, restored["cached"]):
        assert 0 < cached < len(prompt), (len(prompt), cached)
    worker = stats["worker"]
    assert worker["loaded_blocks"] > 0 and not worker["load_failures"]
    assert first.returncode == 0
    (unreachable,) = second["bad_starts"]
    assert not unreachable["started"] and "127.0.0.1:1" in unreachable["error"]
