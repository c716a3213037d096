"""How the ``vllm serve`` tests read a log that several engine processes write at once
(``umbp.testing.serve``): a record is found by vLLM's head wherever it starts, and a
umbp message outside any record is found wherever it is."""

from __future__ import annotations

from umbp.testing.serve import umbp_outside_vllm_records, vllm_records

WORKER = ("(Worker pid=41) INFO 12-05 08:46:09 [worker.py:164] umbp worker rank "
          "RankCoord(tp=0, pcp=0, dcp=0, pp=0): namespace ab, mode embedded")
API = ("(APIServer pid=40) INFO 12-05 08:45:54 [config_phase.py:117] umbp sets "
       "VLLM_CPU_NUM_OF_RESERVED_CPU=1 (a rule for NIXL; umbp needs none)")


def test_a_record_after_another_processes_unfinished_line_is_found() -> None:
    # A progress bar's line (no newline yet) when the worker's record was written.
    bar = "Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]"
    log = f"{bar}{WORKER}\n\rLoading safetensors checkpoint shards: 100% Completed\n{API}"
    assert vllm_records(log) == [
        ("Worker", WORKER.split("] ", 1)[1]),
        ("APIServer", API.split("] ", 1)[1]),
    ]
    assert umbp_outside_vllm_records(log) == []


def test_a_umbp_message_past_vllms_handler_is_found() -> None:
    bare = "umbp sets kv_load_failure_policy=recompute: a failed load is recomputed"
    basic = "WARNING:umbp:umbp load for request r: 1 of 4 blocks failed"
    before_a_record = "umbp: a lookup failed" + WORKER
    log = f"{WORKER}\n{bare}\n{basic}\n{before_a_record}\n{API}"
    assert umbp_outside_vllm_records(log) == [bare, basic, before_a_record]
    assert [process for process, _ in vllm_records(log)] == ["Worker", "Worker", "APIServer"]


def test_umbp_in_paths_and_option_values_is_no_message() -> None:
    log = (
        "/home/u/umbp/.venv/lib/python3.11/site-packages/vllm/x.py:138: FutureWarning: y\n"
        "Exception ignored in: /tmp/umbp-lookup-1x/umbp.sock\n"
        "(APIServer pid=40) INFO 12-05 08:45:45 [api_utils.py:286] non-default args: "
        "{'kv_connector_module_path': 'umbp'}"
    )
    assert umbp_outside_vllm_records(log) == []


def test_a_record_cut_by_a_read_while_it_was_written_is_no_bare_message() -> None:
    for cut in range(1, len(WORKER)):
        part = WORKER[:cut]
        assert umbp_outside_vllm_records(API + "\n" + part) == []
        assert all(process in ("APIServer", "Worker") for process, _ in vllm_records(part))
