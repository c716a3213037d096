"""A finished request's partial tail, as vLLM hands it to umbp
(``register_finished_partial_tail``), driven by vLLM's real scheduler.

vLLM 0.32 and 0.33 call the hook alike (``Scheduler._connector_finished``, before
the request's blocks are freed) for a producer whose Mamba "align" group registered
a partial tail: hashes finer than the block (``prefix_match_unit`` 32, blocks 64)
make the scheduler stop a prefill chunk at the prompt's hash-aligned checkpoint
inside a block (160 of a 180-token prompt), and a request that finishes right
there (aborted after that chunk, nothing in flight) hands over
``[(mamba group, state block, 160)]``. The hook returns False, so vLLM frees the
request's blocks at once: umbp's pins must keep the state page and the
full-attention page that the boundary splits until a worker has stored them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit import vllm_driver
from tests.unit.vllm_driver import KV_HEADS, LAYERS, NULL_BLOCK, Driver, step_starts
from umbp.core.loads.outcomes import LoadStatus

pytestmark = pytest.mark.vllm_versions

BLOCK = 64
HASH_BLOCK = 32
MAMBA, ATTENTION = LAYERS
STATE_SHAPE = (KV_HEADS * BLOCK, 2 * vllm_driver.HEAD_SIZE)
"""One state page as big as one attention page (vLLM wants one page size)."""
PROMPT = [(i * 7) % 500 + 1 for i in range(180)]
TAIL = 160
"""The prompt's last hash-aligned position before its last token, inside block 2."""


class HybridDriver(Driver):
    """Layer 0 a Mamba "align" state (group 0), layer 1 full attention (group 1).

    The fake forward pass writes attention rows per token (as the base driver does)
    and, at the end of each request's chunk, the state after ``end`` tokens into the
    state block vLLM's align mode keeps for it (``cdiv(end, block) - 1``)."""

    def layer_spec(self, layer: int) -> Any:
        from vllm.v1.kv_cache_interface import MambaSpec

        if LAYERS[layer] == MAMBA:
            return MambaSpec(block_size=self.block_size, shapes=(STATE_SHAPE,),
                             dtypes=(torch.float32,), mamba_cache_mode="align")
        return super().layer_spec(layer)

    def new_kv_tensors(self) -> dict[str, torch.Tensor]:
        kv = super().new_kv_tensors()
        kv[MAMBA] = torch.full((self.num_blocks, *STATE_SHAPE), -1.0)
        return kv

    def _forward(self, output: Any) -> None:
        starts = step_starts(output)
        if output.kv_connector_metadata is not None:
            for name in LAYERS:
                self.worker.wait_for_layer_load(name)
        for request_id, count in output.num_scheduled_tokens.items():
            tokens = self.requests[request_id].all_token_ids
            start, end = starts[request_id], starts[request_id] + count
            tables = self.block_ids(request_id)
            attention = tables[self.group_of_layer[ATTENTION]]
            for position in range(start, end):
                self.write_token(ATTENTION, 1, attention, position, tokens[position])
            states = tables[self.group_of_layer[MAMBA]]
            index = -(-end // self.block_size) - 1
            if index < len(states) and states[index] != NULL_BLOCK:
                self.kv[MAMBA][states[index]] = float(end * 1000 + sum(tokens[:end]) % 997)


@pytest.fixture
def driver(model_dir: Path) -> Any:
    driver = HybridDriver(
        model_dir, block_size=BLOCK, cache={"mamba_cache_mode": "align",
                                            "prefix_match_unit": HASH_BLOCK},
        extra={"enable_partial_hash_hits": True},
    )
    yield driver
    driver.close()


def stored_objects(driver: Driver) -> dict[str, bytes]:
    """Every object in the worker's embedded pool, checksum-verified on the way out."""
    pool = driver.worker.worker.pool
    keys = pool.stored_keys()
    outs = [bytearray(sum(n for _, n in pool.object_regions(key))) for key in keys]
    assert all(status is LoadStatus.HIT for status in pool.get_batch_into(keys, outs))
    return {key: bytes(out) for key, out in zip(keys, outs, strict=True)}


def page_bytes(driver: Driver, layer: str, block: int) -> bytes:
    return driver.kv[layer][block].contiguous().view(torch.uint8).numpy().tobytes()


def test_a_finished_partial_tail_is_pinned_until_stored_then_restored_bit_identical(
    driver: HybridDriver,
) -> None:
    from vllm.v1.request import RequestStatus

    calls: list[tuple[str, list[tuple[int, int, int]]]] = []
    hook = driver.connector.register_finished_partial_tail

    def recorded(request: Any, block_ids: Any, offloads: Any) -> bool:
        calls.append((request.request_id, list(offloads)))
        delay: bool = hook(request, block_ids, offloads)
        return delay

    driver.connector.register_finished_partial_tail = recorded
    mamba_group, attention_group = driver.group_of_layer[MAMBA], driver.group_of_layer[ATTENTION]
    request = driver.add("a", PROMPT, max_tokens=4)
    driver.step()  # up to the last full block, 128
    # Its stores finish before the next step, which reports them: their pins are
    # released before the request finishes.
    driver.settle()
    driver.step()  # vLLM stops the next chunk at the checkpoint inside block 2
    assert request.num_computed_tokens == TAIL
    tables = driver.block_ids("a")
    state_block, attention_block = tables[mamba_group][2], tables[attention_group][2]
    state_page = page_bytes(driver, MAMBA, state_block)
    attention_page = page_bytes(driver, ATTENTION, attention_block)
    # What the two steps stored holds no tail.
    driver.settle()
    before = stored_objects(driver)
    tail_hash = bytes(request.block_hashes[TAIL // HASH_BLOCK - 1]).hex()
    assert not any(key.endswith(tail_hash) for key in before)

    driver.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)

    assert calls == [("a", [(mamba_group, state_block, TAIL)])]
    assert "a" not in driver.scheduler.requests
    pool = driver.scheduler.kv_cache_manager.block_pool
    tail_blocks = (state_block, attention_block)
    # vLLM freed the request; only umbp's pins hold the tail's two pages.
    assert [pool.blocks[b].ref_cnt for b in tail_blocks] == [1, 1]
    assert all(pool.blocks[b].ref_cnt == 0 for group in tables for b in group
               if b != NULL_BLOCK and b not in tail_blocks)

    # The next step's store event carries the tail; pinned until acknowledged (a
    # later step: the worker's store thread stores it after the step).
    output = driver.schedule()
    assert [pool.blocks[b].ref_cnt for b in tail_blocks] == [1, 1]
    kv_output, _ = driver.execute(output)
    assert [pool.blocks[b].ref_cnt for b in tail_blocks] == [1, 1]
    driver.settle()
    after = stored_objects(driver)
    new = {key: value for key, value in after.items() if key not in before}
    assert sorted(new) == sorted(
        key for key in after if key.endswith(tail_hash)
        and (f":g{mamba_group}:" in key or f":g{attention_group}:" in key)
    )
    assert {key.split(":")[-2]: value for key, value in new.items()} == {
        f"g{mamba_group}": state_page, f"g{attention_group}": attention_page,
    }
    driver.finish(output, kv_output)
    driver.drain()  # the event's acknowledgement releases the pins
    assert [pool.blocks[b].ref_cnt for b in tail_blocks] == [0, 0]

    # Only umbp holds the prefix now: a request sharing it up to the tail loads
    # the tail's two pages, bit-identical, and resumes at the tail.
    assert driver.scheduler.reset_prefix_cache()
    driver.add("b", PROMPT[:TAIL] + [(i * 11) % 500 + 3 for i in range(40)], max_tokens=2)
    records = driver.until_reported("b")  # an asynchronous load: b waits outside the batch
    assert all("b" not in r.output.num_scheduled_tokens for r in records)
    tables_b = driver.block_ids("b")
    loaded_state, loaded_attention = tables_b[mamba_group][2], tables_b[attention_group][2]
    assert {(mamba_group, loaded_state), (attention_group, loaded_attention)} <= set(
        driver.loads_of(records, "b")
    )
    assert page_bytes(driver, MAMBA, loaded_state) == state_page
    assert page_bytes(driver, ATTENTION, loaded_attention) == attention_page
    driver.run(["b"])
    assert driver.cached_tokens("b") == TAIL
