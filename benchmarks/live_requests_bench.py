"""The scheduler hook's cost per step against the number of live requests.

    python benchmarks/live_requests_bench.py [--live 16,1024] [--changing 16] [--rounds N]
                                             [--before REV] [--json FILE] [--quick]

A GPU engine runs hundreds of requests at once; each step only some of them give
umbp anything to do (new requests to store, prefill chunks), while the rest decode.
This times umbp's whole ``build_connector_meta`` (``UMBPScheduler`` on vLLM 0.33's
own ``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData`` and block pool;
the code ``make test`` extracts into ``.vllm-0.33.0``) for steps in which
``--changing`` new requests arrive (a 256-token prompt each, stored whole) while
``--live`` earlier requests decode (scheduled, past their prompt: nothing to store)
and the previous step's new requests finish. CPU time of this thread per step
(``time.thread_time_ns``, GC on, the set-up heap frozen as vLLM's engine freezes it),
median of ``--rounds`` steps, every live count interleaved round by round; setting up
a step (admitting its new requests) is not timed. Goal (issue 26): the cost with
1,024 live requests within 1.5x of the cost with 16.

``--before REV`` runs the same steps on the umbp of an earlier commit too (checked out
with ``git worktree`` into a temporary directory, run in a process of its own), so the
two are measured on the same machine in one run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VLLM033_DIR = ROOT / ".vllm-0.33.0"
BLOCK = 16
PROMPT = 256  # tokens of every request's prompt: 16 blocks


def hashes_of(request_id: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{request_id}/{i}".encode()).digest() for i in range(count)]


class Steps:
    """One scheduler bound as in an engine, and steps of vLLM's objects for it."""

    def __init__(self, live: int, changing: int) -> None:
        import torch
        from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        from umbp.core.config import DEFAULT_CONFIG
        from umbp.core.identity import RankTopology
        from umbp.shell.metadata import UMBPHandshake
        from umbp.shell.scheduler import UMBPScheduler

        per_request = PROMPT // BLOCK + 1  # the prompt's blocks and one to decode into
        self.blocks = (live + 2 * changing) * per_request
        config = VllmConfig(
            cache_config=CacheConfig(block_size=BLOCK),
            kv_transfer_config=KVTransferConfig(
                kv_connector="UMBPStoreConnector", kv_connector_module_path="umbp",
                kv_role="kv_both",
            ),
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=self.blocks + 1, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
            ))],
        )
        self.scheduler = UMBPScheduler(config, kv_cache_config, DEFAULT_CONFIG)
        self.scheduler.bind_workers({0: UMBPHandshake("bench-live-0123", RankTopology().coords()[0],
                                                      None)})
        self.pool = BlockPool(self.blocks + 1, True, BLOCK)
        self.pool.get_new_blocks(self.blocks)
        self.scheduler.bind_gpu_block_pool(self.pool)
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        self.per_request = per_request
        self.changing = changing
        self.round = 0
        self.free_slots = list(range(live + 2 * changing))
        self.slot_of: dict[str, int] = {}
        self.live = [self._admit(f"live-{i}") for i in range(live)]
        self.arrived: list[str] = []
        self.computed = {request_id: 0 for request_id in self.live}
        self.step(self.live, [])()  # their prefill, untimed: they decode from now on
        for request_id in self.live:
            self.computed[request_id] = PROMPT
        self._settle()

    def _admit(self, request_id: str) -> str:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.request import Request

        slot = self.free_slots.pop()
        self.slot_of[request_id] = slot
        request = Request(request_id, [1] * PROMPT, self.params, None)
        request.block_hashes = hashes_of(request_id, PROMPT // BLOCK)
        first = 1 + slot * self.per_request
        blocks = KVCacheBlocks(([KVCacheBlock(b) for b in range(first, first + self.per_request)],))
        self.scheduler.update_state_after_alloc(request, blocks, 0)
        return request_id

    def table(self, request_id: str) -> list[int]:
        first = 1 + self.slot_of[request_id] * self.per_request
        return list(range(first, first + self.per_request))

    def step(self, new: Sequence[str], finished: Sequence[str]) -> Callable[[], object]:
        """The hook for one step: ``new`` requests prefill their whole prompt, every
        live one decodes a token, ``finished`` end."""
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        new_data = [
            NewRequestData(
                req_id=request_id, prompt_token_ids=[1] * PROMPT, mm_features=[],
                sampling_params=self.params, pooling_params=None,
                block_ids=(self.table(request_id),), num_computed_tokens=0, lora_request=None,
            )
            for request_id in new
        ]
        decoding = [r for r in self.live if r not in set(new)]
        cached = CachedRequestData.make_empty()
        cached.req_ids = decoding
        cached.num_computed_tokens = [self.computed[r] for r in decoding]
        cached.new_block_ids = [None] * len(decoding)
        cached.num_output_tokens = [1] * len(decoding)
        scheduled = {r: PROMPT for r in new} | {r: 1 for r in decoding}
        output = SchedulerOutput(
            scheduled_new_reqs=new_data, scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0], finished_req_ids=set(finished),
            free_encoder_mm_hashes=[],
        )
        return lambda: self.scheduler.build_connector_meta(output)

    def _settle(self) -> None:
        """Untimed: every store event acknowledged (the pins released)."""
        from umbp.shell.metadata import UMBPWorkerMetadata

        events = list(self.scheduler._pinned._events)
        output = _ConnectorOutput(UMBPWorkerMetadata({
            event: _result() for event in events
        }))
        self.scheduler.update_connector_output(output)

    def next_step(self) -> Callable[[], object]:
        """Untimed: finish the last step's arrivals, admit this step's."""
        self._settle()
        finished, self.arrived = self.arrived, []
        for request_id in finished:
            self.free_slots.append(self.slot_of.pop(request_id))
        self.round += 1
        self.arrived = [self._admit(f"new-{self.round}-{i}") for i in range(self.changing)]
        for request_id in self.live:
            self.computed[request_id] += 1
        return self.step(self.arrived, finished)


def _result() -> Any:
    """One worker's report of an event, in the layout of the umbp being measured."""
    try:
        from umbp.core.stores.acks import StoreEventResult
    except ImportError:  # a core from before it was grouped into packages
        from umbp.core.store_events import StoreEventResult  # type: ignore[no-redef]
    return StoreEventResult(1)


class _ConnectorOutput:
    """What ``update_connector_output`` reads of vLLM's ``KVConnectorOutput``."""

    def __init__(self, meta: object) -> None:
        self.kv_connector_worker_meta = meta
        self.invalid_block_ids: set[int] = set()
        self.failed_recving: set[str] = set()


@contextmanager
def heap_frozen() -> Iterator[None]:
    """As vLLM's ``EngineCore`` runs: the start-up heap frozen out of the collector."""
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def measure(
    live_counts: Sequence[int], changing: int, rounds: int
) -> tuple[dict[int, list[int]], dict[int, float]]:
    """CPU ns per step for each live count, interleaved round by round, and the
    blocks each live count's scheduler planned to store per timed step (the new
    requests' prompts, whatever the live count: what makes the steps comparable)."""
    benches = {live: Steps(live, changing) for live in live_counts}
    samples: dict[int, list[int]] = {live: [] for live in live_counts}
    planned_before = {live: 0 for live in live_counts}
    with heap_frozen():
        for index in range(rounds + 2):
            order = list(live_counts)[index % len(live_counts):] + \
                list(live_counts)[:index % len(live_counts)]
            for live in order:
                call = benches[live].next_step()
                started = time.thread_time_ns()
                call()
                spent = time.thread_time_ns() - started
                if index == 1:
                    planned_before[live] = benches[live].scheduler.counters.planned_store_blocks
                if index >= 2:  # two warm-up rounds
                    samples[live].append(spent)
    stored = {
        live: (bench.scheduler.counters.planned_store_blocks - planned_before[live]) / rounds
        for live, bench in benches.items()
    }
    return samples, stored


def _vllm033_on_path() -> str | None:
    if not VLLM033_DIR.is_dir():
        return f"no {VLLM033_DIR.name} (make test extracts vLLM 0.33's code there)"
    sys.path.insert(0, str(VLLM033_DIR))
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return None


def run_before(rev: str, arguments: argparse.Namespace) -> dict[str, Any]:
    """This script on ``rev``'s umbp, in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="umbp-before-") as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            out = Path(scratch) / "before.json"
            subprocess.run(
                [sys.executable, __file__, "--live", arguments.live, "--changing",
                 str(arguments.changing), "--rounds", str(arguments.rounds), "--json", str(out),
                 "--umbp", str(tree)],
                check=True, env={**os.environ, "PYTHONPATH": f"{VLLM033_DIR}:{tree}"},
            )
            return dict(json.loads(out.read_text()))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False, capture_output=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", default="16,1024", help="live request counts, comma separated")
    parser.add_argument("--changing", type=int, default=16, help="new requests per step")
    parser.add_argument("--rounds", type=int, default=60, help="timed steps per live count")
    parser.add_argument("--before", help="also run this earlier commit's umbp, side by side")
    parser.add_argument("--umbp", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true",
                        help="16 and 128 live, 10 steps: for trying the script, not for figures")
    arguments = parser.parse_args(argv)
    if arguments.quick:
        arguments.live, arguments.rounds = "16,128", 10
    sys.path.insert(0, str(arguments.umbp))
    problem = _vllm033_on_path()
    if problem is not None:
        print(f"not measured: {problem}")
        return 1
    live_counts = [int(n) for n in arguments.live.split(",")]
    samples, stored = measure(live_counts, arguments.changing, arguments.rounds)
    medians = {live: statistics.median(s) / 1e3 for live, s in samples.items()}
    figures: dict[str, Any] = {
        "changing": arguments.changing,
        "stored_blocks_per_step": {str(live): blocks for live, blocks in stored.items()},
        "median_us": {str(live): us for live, us in medians.items()},
        "p90_us": {str(live): statistics.quantiles(s, n=10)[-1] / 1e3
                   for live, s in samples.items()},
    }
    print(f"build_connector_meta CPU time per step ({arguments.changing} new {PROMPT}-token "
          f"requests stored per step; thread CPU, GC on, median of {arguments.rounds} steps)")
    base = medians[live_counts[0]]
    for live in live_counts:
        print(f"  {live:>5} live: {medians[live]:8.1f} us (p90 "
              f"{figures['p90_us'][str(live)]:.1f}), {medians[live] / base:.2f}x the "
              f"{live_counts[0]}-live step")
    if len(live_counts) > 1:
        ratio = medians[live_counts[-1]] / base
        figures["ratio"] = ratio
        print(f"{live_counts[-1]} live vs {live_counts[0]}: {ratio:.2f}x "
              f"(goal <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'})")
    if arguments.before:
        before = run_before(arguments.before, arguments)
        figures["before"] = before
        for live in live_counts:
            was = before["median_us"][str(live)]
            print(f"  before ({arguments.before}), {live:>5} live: {was:8.1f} us; "
                  f"now {medians[live] / was:.2f}x of it")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
