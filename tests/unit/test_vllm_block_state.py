"""The store step reads a scheduled request's table from vLLM's
``kv_connector_block_state`` only: vLLM 0.32 and 0.33 build it for every request
a step schedules whenever a connector is set. Without it umbp does not guess a
table from ``new_block_ids``: that request stores nothing that step, a warning
names it, and the engine goes on."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, SchedulerOutput

from umbp.shell import vllm_compat

pytestmark = pytest.mark.vllm_versions


def step_output(block_state: KVConnectorBlockState | None) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={"r1": 16},
        total_num_scheduled_tokens=16,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        kv_connector_block_state=block_state,
    )


def test_a_scheduled_requests_table_is_vllms_current_one() -> None:
    state = KVConnectorBlockState(
        req_ids={"r1"}, resolve_block_ids=lambda req_id: ([3, 7, 9],),
        boundary_state_offloads={},
    )
    assert [list(group) for group in vllm_compat.current_block_ids(step_output(state), "r1")] == [
        [3, 7, 9]
    ]


@pytest.mark.parametrize("has_state", [False, True])
def test_no_current_table_reads_as_none(has_state: bool) -> None:
    state = KVConnectorBlockState(
        req_ids=set(), resolve_block_ids=lambda req_id: ([1],), boundary_state_offloads={}
    ) if has_state else None
    assert vllm_compat.current_block_ids(step_output(state), "r1") is None


def test_a_step_without_the_table_stores_nothing_of_it_and_the_engine_goes_on(
    make_driver: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    block = 32
    driver = make_driver(max_num_batched_tokens=2 * block, extra={"load_async": False})
    build = driver.connector.build_connector_meta

    def without_block_state(output: Any) -> Any:
        if output.scheduled_cached_reqs.req_ids:
            output.kv_connector_block_state = None
        return build(output)

    driver.connector.build_connector_meta = without_block_state
    driver.add("a", [(i * 7) % 500 + 1 for i in range(6 * block + 5)])
    with caplog.at_level(logging.WARNING, logger="umbp"):
        driver.run(["a"])
        driver.drain()
    # Only the first chunk (a new request: its table is in the step) is stored.
    assert driver.connector_stats()["worker_stored_blocks"] == 2
    assert "no current block table" in caplog.text
    assert "request a;" in caplog.text
