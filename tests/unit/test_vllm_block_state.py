"""The store step reads a scheduled request's table from vLLM's
``kv_connector_block_state`` only: vLLM 0.32 and 0.33 build it for every request
a step schedules whenever a connector is set, so without it umbp refuses with an
error naming the request rather than guess a table from ``new_block_ids``."""

from __future__ import annotations

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
def test_no_current_table_is_an_error_naming_the_request(has_state: bool) -> None:
    state = KVConnectorBlockState(
        req_ids=set(), resolve_block_ids=lambda req_id: ([1],), boundary_state_offloads={}
    ) if has_state else None
    with pytest.raises(RuntimeError, match=r"no current block table .* 'r1'"):
        vllm_compat.current_block_ids(step_output(state), "r1")
