"""Lifecycles that combine a load from the pool with what follows it, driven by
vLLM's real scheduler objects (see ``vllm_driver``): a loaded prefix whose rest
is prefilled in chunks, and a loaded request that vLLM preempts and resumes.

Assertions are about behaviour only: which blocks were loaded and stored, their
bytes, the stats vLLM reported and the blocks vLLM's pool has free at the end.
"""

from __future__ import annotations

from typing import Any

from tests.unit.vllm_driver import Driver

BLOCK = 32


def prompt(blocks: int, tail: int = 5, seed: int = 1) -> list[int]:
    return [(seed * 131 + i * 7) % 500 + 1 for i in range(blocks * BLOCK + tail)]


def stored_hashes(driver: Driver, since: int) -> list[str]:
    """Block hashes of the BlockStored events published after the first ``since``."""
    from vllm.distributed.kv_events import BlockStored

    events = [e for e in driver.publisher.events[since:]
              if isinstance(e, BlockStored) and e.medium == "CPU"]
    return [str(h) for event in events for h in event.block_hashes]


def test_a_loaded_prefix_then_chunked_prefill_stores_only_the_computed_blocks_once(
    make_driver: Any,
) -> None:
    """4 blocks come from the pool, the next 4 are computed 2 blocks a step: each
    computed block is stored exactly once, none of the loaded ones again, and a
    later request restores all 8 byte for byte."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    driver = make_driver(max_num_batched_tokens=2 * BLOCK, extra={"load_async": False})
    tokens = prompt(8)
    driver.fill_pool("a", tokens[: 4 * BLOCK])
    stored_before = driver.connector_stats()["worker_stored_blocks"]
    events_before = len(driver.publisher.events)

    driver.add("b", tokens, max_tokens=2)
    first = driver.step()
    table = driver.block_ids("b")[0]
    assert sorted(first.loads["b"]) == sorted((0, b) for b in table[:4])
    records = driver.run(["b"])
    driver.drain()
    chunks = [r for r in [first, *records] if "b" in r.output.num_scheduled_tokens]
    assert len(chunks) >= 3, "the rest of the prompt must be prefilled in chunks"
    assert driver.connector_stats()["worker_stored_blocks"] - stored_before == 4
    hashes = [maybe_convert_block_hash(bytes(h)) for h in driver.requests["b"].block_hashes]
    assert sorted(stored_hashes(driver, events_before)) == sorted(map(str, hashes[4:8]))

    assert driver.scheduler.reset_prefix_cache()
    driver.add("c", tokens, max_tokens=2)
    records = driver.run(["c"])
    loaded = [pair for r in records for pair in r.loads.get("c", [])]
    assert len(loaded) == 8
    assert driver.cached_tokens("c") == 8 * BLOCK


def test_a_loaded_request_preempted_and_resumed_stores_exact_blocks(make_driver: Any) -> None:
    """Both prompts come from the pool; decoding then overflows vLLM's 13 usable
    blocks, so vLLM preempts one. The resumed request's blocks (loaded again or
    recomputed) hold exactly what a forward pass writes; what it stores after the
    resume (decode blocks too, with ``save_decode_cache``) comes from its new
    blocks, so a later request restores both whole sequences exactly; every pin is
    released and no store fails."""
    driver = make_driver(num_blocks=14, max_model_len=320, max_num_batched_tokens=512,
                         extra={"save_decode_cache": True})
    pool = driver.scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    a, b = prompt(5, tail=0, seed=1), prompt(5, tail=0, seed=2)
    driver.fill_pool("fill-a", a)
    driver.fill_pool("fill-b", b)
    loaded_before = driver.connector_stats().get("worker_loaded_blocks", 0)

    driver.add("a", a, max_tokens=150)
    driver.add("b", b, max_tokens=150)
    preempted: set[str] = set()
    resumed_checked: set[str] = set()
    for _ in range(400):
        record = driver.step()
        preempted |= set(record.output.preempted_req_ids or ())
        for name in preempted & set(driver.scheduler.requests) - resumed_checked:
            request = driver.requests[name]
            if name in record.output.num_scheduled_tokens and (
                request.num_computed_tokens >= request.num_prompt_tokens
            ):
                # Resumed past its prompt: every full block so far is right.
                full = request.num_computed_tokens // BLOCK
                assert driver.assert_blocks_hold(name, request.all_token_ids, range(full)) == (
                    2 * full
                )
                resumed_checked.add(name)
        if not {"a", "b"} & set(driver.scheduler.requests):
            break
    assert preempted, "the set-up must force a preemption"
    assert resumed_checked == preempted
    loaded = driver.connector_stats().get("worker_loaded_blocks", 0) - loaded_before
    # Each prompt but its last block (the last token is always computed).
    assert loaded >= 2 * 4, "both prompts were loaded from the pool at admission"
    driver.drain()
    stats = driver.connector_stats()
    assert stats.get("worker_store_failures", 0) == 0
    assert not any(name.startswith("worker_load_failures") for name in stats)
    assert driver.scheduler.reset_prefix_cache()
    assert pool.get_num_free_blocks() == free_at_start

    # Prompt and decode blocks were stored from the right blocks, before and after
    # the resume: the whole sequences restore byte for byte.
    for name in ("a", "b"):
        sequence = list(driver.requests[name].all_token_ids)
        full = (len(sequence) - 1) // BLOCK  # the last token is always computed
        again = f"{name}-again"
        driver.add(again, sequence, max_tokens=4)
        driver.prefill(again)
        assert driver.assert_blocks_hold(again, sequence, range(full)) == 2 * full
        driver.run([again])
        assert driver.cached_tokens(again) == full * BLOCK
