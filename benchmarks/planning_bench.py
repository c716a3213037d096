"""Planning cost of ``umbp.core``: lookup to load plan, and store planning.

    python benchmarks/planning_bench.py [--json FILE] [--quick]

Prints microseconds per call, measured side by side in one run with a
per-object baseline written the way the reference scheduler computes the same
answer (a key tuple per object via ``KeySpace.rank_keys``, an ``all()`` per
object, index-by-index scans, one append per block), so the ratios are
comparable across machines. Figures:

* lookup -> load plan for a 32,768-token prompt: block 16 and 32, 1 and 4 ranks;
  every object hits (the longest window, the most work);
* growth with prompt length (2K, 8K, 32K tokens) at block 16, one rank;
* the store step (:func:`store_step_section`): 256 new 1,024-token requests, block 16
  and 32, TP1 and TP4, CPU time per step (``time.thread_time_ns``, GC on, the
  set-up heap frozen as vLLM's engine freezes its start-up heap) and GC
  collections per step, umbp vs the reference scheduler (vLLM 0.33's UMBP
  connector, on the same requests, its plans checked identical) in one run;
* admission CPU time (:func:`admission_section`): the same lookup -> load plan as
  the engine's scheduler thread pays for it, CPU time per call
  (``time.thread_time_ns``, GC on), median of many calls, against the issue's
  targets (32K tokens <= 0.15 ms at block 32 TP1, TP4 <= 1.5x TP1 per key,
  linear in blocks).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import interleaved_cpu_median_ns  # benchmarks/, this script's folder

from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace, RankTopology
from umbp.core.loads.allocation import load_plan, plan_allocated_load
from umbp.core.lookup.query import (
    EMPTY_LOOKUP_MEMO,
    LookupMemo,
    LookupQuery,
    build_lookup_query,
    request_lookup_keys,
    request_lookup_query,
)
from umbp.core.lookup.windows import fold_rank_hits, single_group_load_spec
from umbp.core.plans import GroupBlocks, LoadPlan, StorePlan
from umbp.core.rank_keys import rank_tags
from umbp.core.requests import RequestLifecycle
from umbp.core.stores import ScheduledStep, StoreRules, finish_store_step, plan_store_step
from umbp.core.stores.acks import StoreEvent, pinned_block_ids, reserved_identities
from umbp.core.stores.tracking import (
    StoreTracker,
)
from umbp.runtime.contract import SchedulerStore
from umbp.runtime.embedded import connect_to_pool, open_embedded_pool
from umbp.runtime.lookup_service import RankedLookup
from umbp.runtime.pool import SlabPool


def measure_us(call: Callable[[], object], budget_s: float, repeats: int = 5) -> float:
    """Best of ``repeats`` runs of the mean microseconds per call (the least
    disturbed by other work on the machine)."""
    call()
    loops = 1
    while True:
        start = time.perf_counter()
        for _ in range(loops):
            call()
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s / repeats or loops >= 1 << 20:
            break
        loops *= 2
    samples = [elapsed / loops]
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(loops):
            call()
        samples.append((time.perf_counter() - start) / loops)
    return min(samples) * 1e6


def block_hashes(count: int, salt: bytes = b"") -> tuple[bytes, ...]:
    """32-byte hashes, as vLLM's sha256 block hashes."""
    return tuple(hashlib.sha256(salt + index.to_bytes(8, "big")).digest() for index in range(count))


def geometry_for(block_size: int) -> CacheGeometry:
    return CacheGeometry(
        group_ids=(0,),
        group_block_sizes=(block_size,),
        lookup_units=(block_size,),
        block_size=block_size,
        hash_block_size=block_size,
    )


# --------------------------------------------------------- per-object baseline


def baseline_lookup_to_load(
    geometry: CacheGeometry,
    keyspace: KeySpace,
    hashes: Sequence[bytes],
    num_tokens: int,
    answer: Callable[[int], Sequence[bool]],
    table: tuple[int, ...],
) -> LoadPlan:
    """The reference's shape of the same computation, object by object."""
    hbs = geometry.hash_block_size
    unit = geometry.lookup_units[0]
    group_id = geometry.group_ids[0]
    block_size = geometry.group_block_sizes[0]
    objects: list[tuple[bytes, tuple[str, ...]]] = []
    keys: list[str] = []
    for token_end in range(unit, num_tokens - 1 + 1, unit):
        block_hash = hashes[token_end // hbs - 1]
        rank_keys = keyspace.rank_keys(group_id, block_hash)
        objects.append((block_hash, rank_keys))
        keys.extend(rank_keys)
    hits = list(answer(len(keys)))
    ranks = keyspace.topology.rank_count
    group_hits = (
        hits if ranks == 1 else [all(hits[i : i + ranks]) for i in range(0, len(hits), ranks)]
    )
    per_block = block_size // unit
    matched = 0
    for index in range(per_block - 1, len(group_hits), per_block):
        if not group_hits[index]:
            break
        matched = index + 1
    end = matched * unit
    block_ids: list[int] = []
    out_hashes: list[bytes] = []
    for block in range(end // block_size):
        out_hashes.append(hashes[(block + 1) * block_size // hbs - 1])
        block_ids.append(table[block])
    if not block_ids:
        return LoadPlan("r", ())
    return LoadPlan("r", (GroupBlocks(group_id, block_size, tuple(block_ids),
                                      tuple(out_hashes)),))


# ------------------------------------------------------------------- scenarios


def lookup_case(num_tokens: int, block_size: int, tp: int, budget_s: float) -> dict[str, float]:
    geometry = geometry_for(block_size)
    keyspace = KeySpace("bench-namespace-0123", RankTopology(tp_size=tp))
    hashes = block_hashes(num_tokens // block_size)
    with ExitStack() as pools:
        return _lookup_case_figures(
            geometry, keyspace, hashes, num_tokens, block_size, tp, budget_s,
            admission_calls(num_tokens, block_size, tp, pools),  # checks core == baseline
        )


def _lookup_case_figures(
    geometry: CacheGeometry, keyspace: KeySpace, hashes: tuple[bytes, ...], num_tokens: int,
    block_size: int, tp: int, budget_s: float, calls: dict[str, Callable[[], object]],
) -> dict[str, float]:
    blocks = -(-num_tokens // block_size)
    table = (tuple(range(1, blocks + 1)),)
    query = build_lookup_query(geometry, keyspace, hashes, 0, num_tokens)
    answers = (True,) * query.key_count  # what a runtime returns: a tuple of bools
    core_path, baseline = calls["admission"], calls["baseline"]
    folded = fold_rank_hits(query, answers)
    assert folded is not None
    spec = single_group_load_spec(geometry, query, folded)
    assert spec is not None
    return {
        "tokens": num_tokens,
        "block_size": block_size,
        "ranks": tp,
        "blocks": blocks,
        "keys": query.key_count,
        "total_us": measure_us(core_path, budget_s),
        "build_query_us": measure_us(
            lambda: build_lookup_query(geometry, keyspace, hashes, 0, num_tokens), budget_s / 2
        ),
        "fold_us": measure_us(lambda: fold_rank_hits(query, answers), budget_s / 2),
        "hit_window_us": measure_us(
            lambda: single_group_load_spec(geometry, query, folded), budget_s / 2
        ),
        "load_batch_us": measure_us(
            lambda: load_plan("r", geometry, spec, table, hashes, spec.num_tokens_to_load),
            budget_s / 2,
        ),
        "baseline_us": measure_us(baseline, budget_s),
    }


# ------------------------------------------------------------ store step CPU time


STORE_TARGET_US_PER_BLOCK = 0.35
STORE_P90_TARGET = 1.5
# The issue's own basis for 0.35 us per block: "the store path at a third of the
# reference's cost". Where it was set, the reference cost ~1.1-1.3 us per block; on a
# machine several times slower the absolute figure says more about the machine, the
# ratio to the reference timed in the same run says what the code costs.
STORE_TARGET_OF_REFERENCE = 1 / 3
STORE_REQUESTS = 256
STORE_TOKENS = 1024
VLLM033_DIR = Path(__file__).resolve().parents[1] / ".vllm-0.33.0"


@dataclass(frozen=True)
class StoreStepInput:
    """One scheduler step's new requests as vLLM hands them over: per request its
    id, block hashes (a list, as ``Request.block_hashes``) and block table (a
    tuple of lists, as ``NewRequestData.block_ids``)."""

    block_size: int
    tp: int
    tokens: int
    requests: tuple[tuple[str, list[bytes], tuple[list[int], ...]], ...]

    @property
    def blocks(self) -> int:
        return sum(len(table[0]) for _, _, table in self.requests)


def store_step_input(
    block_size: int, tp: int, requests: int = STORE_REQUESTS, tokens: int = STORE_TOKENS,
) -> StoreStepInput:
    per_request = tokens // block_size
    return StoreStepInput(block_size, tp, tokens, tuple(
        (
            f"req-{index}",
            list(block_hashes(per_request, salt=index.to_bytes(4, "big"))),
            ([index * per_request + block + 1 for block in range(per_request)],),
        )
        for index in range(requests)
    ))


@dataclass(frozen=True)
class _BenchRequest:
    """What core reads of a request (``core.requests.RequestView``)."""

    block_hashes: list[bytes]
    num_prompt_tokens: int
    all_token_ids: tuple[int, ...] = ()


class _BenchReads:
    """``core.stores.StoreStepReads`` over plain dicts: new requests need no table
    or mask from vLLM."""

    def __init__(self, states: dict[str, tuple[_BenchRequest, RequestLifecycle]]) -> None:
        self.states = states

    def state(self, request_id: str) -> tuple[_BenchRequest, RequestLifecycle]:
        return self.states[request_id]

    def current_table(self, request_id: str) -> None:
        return None

    def masks(self, request: object, ranges: object) -> dict[int, None]:
        return {}


def umbp_store_step(step: StoreStepInput) -> Callable[[], Callable[[], object]]:
    """umbp.core's part of the store step for new requests (the ``core`` figure):
    the in-flight reservations, ``core.stores.plan_store_step`` (per request the
    table copied out of vLLM's lists, the tracker, watermark and candidates; full
    attention has no mask), one residency answer, ``finish_store_step``, the event
    and its pins, without vLLM's objects or vLLM's block pool (the ``hook`` figure
    has them). ``prepare()`` resets the trackers (untimed) and returns the timed
    call."""
    geometry = geometry_for(step.block_size)
    keyspace = KeySpace("bench-namespace-0123", RankTopology(tp_size=step.tp))
    rules = StoreRules(geometry)
    allocated = {
        request_id: (
            _BenchRequest(request_hashes, step.tokens),
            RequestLifecycle(tracker=StoreTracker().with_blocks_replaced(table)),
        )
        for request_id, request_hashes, table in step.requests
    }
    scheduled = ScheduledStep(
        [(request_id, 0, table) for request_id, _, table in step.requests], (), (),
        frozenset(), {request_id: step.tokens for request_id, _, _ in step.requests},
    )
    in_flight: tuple[StoreEvent, ...] = ()

    def prepare() -> Callable[[], object]:
        reads = _BenchReads(dict(allocated))

        def run() -> object:
            reserved = reserved_identities(in_flight)
            draft = plan_store_step(rules, scheduled, frozenset(), reserved, keyspace, reads)
            answers = (True,) * len(draft.check.keys) if draft.check.keys else None
            planned = finish_store_step(rules, draft, answers)
            event = StoreEvent(0, planned.plans)
            pinned_block_ids(event)
            return event

        return run

    return prepare


ReferencePlans = dict[str, tuple[tuple[int, ...], tuple[bytes, ...]]]


def _ids_and_hashes(plan: StorePlan) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    """A one-group plan's block ids and hashes, as the reference's batch lists them."""
    return (
        tuple(b for g in plan.groups for b in g.block_ids),
        tuple(h for g in plan.groups for h in g.block_hashes),
    )


@dataclass
class VllmStep:
    """One step's vLLM objects, built once and handed to both schedulers: the
    configs, each request with the blocks vLLM allocated it (``Request`` hashed as
    the step input says, ``KVCacheBlocks``), and the ``SchedulerOutput`` that
    schedules every request new."""

    vllm_config: Any
    kv_cache_config: Any
    admitted: list[tuple[Any, Any]]
    output: Any
    block_pool: Callable[[], Any]


def vllm_step(step: StoreStepInput) -> VllmStep | str:
    """The step's objects from vLLM 0.33 (the code ``make test`` extracts into
    ``.vllm-0.33.0``; umbp's shell runs on it as on 0.32). A sentence instead when
    it cannot be built."""
    if not VLLM033_DIR.is_dir():
        return f"no {VLLM033_DIR.name} (make test extracts vLLM 0.33's code there)"
    if "vllm" in sys.modules and not sys.modules["vllm"].__file__.startswith(str(VLLM033_DIR)):
        return "another vLLM is already imported in this process"
    sys.path.insert(0, str(VLLM033_DIR))
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    config = VllmConfig(
        cache_config=CacheConfig(block_size=step.block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=step.tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="UMBPStoreConnector",
            kv_connector_module_path="vllm.distributed.kv_transfer.kv_connector.v1.umbp",
            kv_role="kv_both",
        ),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=step.blocks + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(
            block_size=step.block_size, num_kv_heads=2, head_size=32, dtype=torch.float32,
        ))],
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    admitted = []
    new_requests = []
    for request_id, request_hashes, block_ids in step.requests:
        request = Request(request_id, [1] * step.tokens, params, None)
        request.block_hashes = request_hashes
        blocks = KVCacheBlocks(tuple([KVCacheBlock(b) for b in group] for group in block_ids))
        admitted.append((request, blocks))
        new_requests.append(NewRequestData(
            req_id=request_id, prompt_token_ids=request.prompt_token_ids, mm_features=[],
            sampling_params=params, pooling_params=None, block_ids=block_ids,
            num_computed_tokens=0, lora_request=None,
        ))
    output = SchedulerOutput(
        scheduled_new_reqs=new_requests,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={request_id: step.tokens for request_id, _, _ in step.requests},
        total_num_scheduled_tokens=step.tokens * len(step.requests),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )

    def block_pool() -> Any:
        """vLLM's block pool with every request's blocks allocated (ref count 1):
        each scheduler pins the event's blocks in its own."""
        pool = BlockPool(step.blocks + 1, True, step.block_size)
        pool.get_new_blocks(step.blocks)
        return pool

    return VllmStep(config, kv_cache_config, admitted, output, block_pool)


def _release_pins(pool: Any) -> None:
    """Untimed, between steps: every block back to its allocation's one reference
    (what acknowledging the step's event does)."""
    for block in pool.blocks[1:]:
        block.ref_cnt = 1


def reference_store_step(
    step: StoreStepInput, objects: VllmStep
) -> tuple[Callable[[], Callable[[], object]], Callable[[object], ReferencePlans]]:
    """The reference's store step on the same requests: vLLM 0.33's UMBP
    connector scheduler (``UMBPStoreConnectorScheduler.build_connector_meta``)
    with vLLM's own objects, pinning in its own block pool. ``prepare()`` admits
    every request again (``update_state_after_alloc``, untimed) and returns the
    timed call."""
    from vllm.distributed.kv_transfer.kv_connector.v1.umbp.data import (
        BlockIdentityCodec,
        UMBPNamespace,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.umbp.data import (
        RankTopology as ReferenceTopology,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.umbp.scheduler import (
        UMBPStoreConnectorScheduler,
    )

    scheduler = UMBPStoreConnectorScheduler(
        objects.vllm_config, objects.kv_cache_config, None,
        BlockIdentityCodec(UMBPNamespace("bench-namespace-0123")),
        ReferenceTopology(tp_size=step.tp),
    )
    pool = objects.block_pool()
    scheduler.bind_gpu_block_pool(pool)
    output = objects.output

    def prepare() -> Callable[[], object]:
        scheduler._request_trackers.clear()
        scheduler._store_events.clear()
        _release_pins(pool)
        for request, blocks in objects.admitted:
            scheduler.update_state_after_alloc(request, blocks, 0)
        return lambda: scheduler.build_connector_meta(output)

    def plans_of(meta: object) -> ReferencePlans:
        return {
            request_id: (tuple(batch.block_ids), tuple(batch.block_hashes))
            for request_id, batch in meta.store_requests.items()  # type: ignore[attr-defined]
        }

    return prepare, plans_of


def shell_store_step(step: StoreStepInput, objects: VllmStep) -> Callable[[], Callable[[], object]]:
    """umbp's whole scheduler hook on the same vLLM objects: ``UMBPScheduler``
    bound to its workers (one embedded pool handshake per rank, so the key space is
    real) and to its own vLLM block pool, ``build_connector_meta(output)`` timed.
    ``prepare()`` forgets every request and event and admits every request again
    (``update_state_after_alloc``, untimed), as the reference's does."""
    from umbp.core.config import DEFAULT_CONFIG
    from umbp.core.identity import RankTopology as Topology
    from umbp.shell.metadata import UMBPHandshake
    from umbp.shell.scheduler import UMBPScheduler

    scheduler = UMBPScheduler(objects.vllm_config, objects.kv_cache_config, DEFAULT_CONFIG)
    scheduler.bind_workers({
        index: UMBPHandshake("bench-namespace-0123", rank, None)
        for index, rank in enumerate(Topology(tp_size=step.tp).coords())
    })
    pool = objects.block_pool()
    scheduler.bind_gpu_block_pool(pool)
    output = objects.output

    def prepare() -> Callable[[], object]:
        scheduler._requests.clear()
        scheduler._pinned._events.clear()
        scheduler._store_step._storing.clear()
        _release_pins(pool)
        for request, blocks in objects.admitted:
            scheduler.update_state_after_alloc(request, blocks, 0)
        return lambda: scheduler.build_connector_meta(output)

    return prepare


@dataclass(frozen=True)
class CpuTimes:
    """CPU time per step (ns) and garbage collections (every generation) per step."""

    samples_ns: tuple[int, ...]
    collections: tuple[int, ...]

    @property
    def median_ns(self) -> float:
        return statistics.median(self.samples_ns)

    @property
    def p90_ns(self) -> float:
        return statistics.quantiles(self.samples_ns, n=10)[-1]

    @property
    def collections_per_step(self) -> float:
        return statistics.mean(self.collections)


def cpu_times_per_step(
    prepares: dict[str, Callable[[], Callable[[], object]]], rounds: int
) -> dict[str, CpuTimes]:
    """This thread's CPU time per call of each entry (``time.thread_time_ns``: time
    other sessions take from the machine is not counted), GC on as the engine runs,
    entries alternating in rotating order round by round; ``prepare()`` is untimed."""
    names = list(prepares)
    for name in names:  # warm up
        prepares[name]()()
    samples: dict[str, list[int]] = {name: [] for name in names}
    collections: dict[str, list[int]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            call = prepares[name]()
            before = sum(generation["collections"] for generation in gc.get_stats())
            started = time.thread_time_ns()
            call()
            samples[name].append(time.thread_time_ns() - started)
            collections[name].append(
                sum(generation["collections"] for generation in gc.get_stats()) - before
            )
    return {name: CpuTimes(tuple(samples[name]), tuple(collections[name])) for name in names}


def _figures(times: CpuTimes, blocks: int) -> dict[str, float]:
    return {"median_us": times.median_ns / 1e3, "p90_us": times.p90_ns / 1e3,
            "us_per_block": times.median_ns / 1e3 / blocks,
            "collections_per_step": times.collections_per_step}


STORE_ENTRIES = ("core", "hook", "reference")


def store_step_times(
    step: StoreStepInput, rounds: int
) -> tuple[dict[str, CpuTimes], str | None]:
    """One case, timed interleaved: umbp's core calls alone (``core``), umbp's whole
    ``build_connector_meta`` on vLLM's objects (``hook``) and the reference's
    (``reference``), after checking all three plan the same blocks and hashes for
    every request. Without vLLM 0.33's code only ``core`` runs (and the reason)."""
    prepares = {"core": umbp_store_step(step)}
    objects = vllm_step(step)
    if isinstance(objects, str):
        with startup_heap_frozen():
            return cpu_times_per_step(prepares, rounds), objects
    prepare_reference, plans_of = reference_store_step(step, objects)
    prepares["hook"] = shell_store_step(step, objects)
    prepares["reference"] = prepare_reference
    event = prepares["core"]()()
    assert isinstance(event, StoreEvent)
    core_plans = {p.request_id: _ids_and_hashes(p) for p in event.plans}
    meta = prepares["hook"]()()
    hook_plans = {p.request_id: _ids_and_hashes(p) for p in meta.stores}  # type: ignore[attr-defined]
    reference_plans = plans_of(prepare_reference()())
    assert core_plans == reference_plans, "umbp's core and the reference disagree"
    assert hook_plans == reference_plans, "umbp's scheduler and the reference disagree"
    with startup_heap_frozen():
        return cpu_times_per_step(prepares, rounds), None


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """The heap as vLLM's engine runs with it: ``EngineCore`` calls
    ``freeze_gc_heap()`` after start-up (``vllm/utils/gc_utils.py``: a collection
    of every generation, then ``gc.freeze()``), so the collector never walks the
    objects start-up made. Here start-up is the case's setup (schedulers, vLLM's
    objects and the step's requests: in the engine the requests come later);
    unfrozen after the case, so one case's objects do not stay frozen in the next."""
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def store_step_section(quick: bool) -> dict[str, object]:
    """The store step of 256 new 1,024-token requests (one full-attention group)
    at block 16 and 32, TP1 and TP4: umbp's core calls, umbp's whole scheduler hook
    and the reference's hook in one run, their plans checked identical; then the
    cost per block as the step grows from 16 to 1,024 requests."""
    rounds = 15 if quick else 200
    print(f"store step, {STORE_REQUESTS} new requests x {STORE_TOKENS:,} tokens, one "
          f"full-attention group: thread CPU time per step, GC on (set-up heap frozen, as "
          f"vLLM's engine does after start-up), {rounds} interleaved "
          f"steps each; load average {os.getloadavg()[0]:.1f}")
    print("core: umbp.core's calls alone; hook: UMBPScheduler.build_connector_meta on "
          "vLLM's objects (pins in vLLM's block pool included); reference: vLLM 0.33's "
          "UMBP connector, the same hook on the same objects")
    header = f"{'block':>5} {'ranks':>5} {'blocks':>6}"
    for name in STORE_ENTRIES:
        header += f" | {name + ' p50':>10} {'p90':>7} {'us/blk':>6} {'gc':>4}"
    print(header + f" | {'core/ref':>8} {'hook/ref':>8}")
    rows: list[dict[str, Any]] = []
    unavailable: str | None = None
    for block_size in (16, 32):
        for tp in (1, 4):
            step = store_step_input(block_size, tp)
            times, unavailable = store_step_times(step, rounds)
            row: dict[str, Any] = {"block_size": block_size, "ranks": tp, "blocks": step.blocks}
            line = f"{block_size:>5} {tp:>5} {step.blocks:>6}"
            for name in STORE_ENTRIES:
                if name not in times:
                    line += f" | {'-':>10} {'-':>7} {'-':>6} {'-':>4}"
                    continue
                row[name] = figures = _figures(times[name], step.blocks)
                line += (f" | {figures['median_us']:>8.0f}us {figures['p90_us']:>5.0f}us "
                         f"{figures['us_per_block']:>6.2f} {figures['collections_per_step']:>4.1f}")
            if "reference" in times:
                for name in ("core", "hook"):
                    row[f"{name}_over_reference"] = (
                        times[name].median_ns / times["reference"].median_ns
                    )
                line += (f" | {row['core_over_reference']:>7.2f}x "
                         f"{row['hook_over_reference']:>7.2f}x")
            rows.append(row)
            print(line)
    if unavailable:
        print(f"hook and reference not measured: {unavailable}")
    for name in ("core", "hook"):
        head = rows[0].get(name)
        if head is None:
            continue
        per_block, spread = head["us_per_block"], head["p90_us"] / head["median_us"]
        print(f"{name}, block 16, TP1: {per_block:.3f} us per block (target <= "
              f"{STORE_TARGET_US_PER_BLOCK}: {'met' if per_block <= STORE_TARGET_US_PER_BLOCK else 'NOT met'}"
              f"), p90 {spread:.2f}x the median (target <= {STORE_P90_TARGET}x: "
              f"{'met' if spread <= STORE_P90_TARGET else 'NOT met'})")
        ratio = rows[0].get(f"{name}_over_reference")
        if ratio is not None:
            print(f"{name}, block 16, TP1: {ratio:.2f}x the reference timed in this run "
                  f"(target <= {STORE_TARGET_OF_REFERENCE:.2f}x, a third of its cost: "
                  f"{'met' if ratio <= STORE_TARGET_OF_REFERENCE else 'NOT met'})")
    growth = store_step_growth(max(rounds // 5, 5))
    return {"rounds": rounds, "load_average": os.getloadavg()[0], "rows": rows,
            "growth": growth, "reference_unavailable": unavailable}


def store_step_growth(rounds: int) -> list[dict[str, Any]]:
    """Cost per block at block 16, TP1 as the step grows from 16 to 1,024 new
    requests (1,024 to 65,536 blocks), each entry timed as in the table."""
    print(f"growth at block 16, TP1 ({rounds} interleaved steps each), us per block:")
    growth: list[dict[str, Any]] = []
    for requests in (16, 64, 256, 1024):
        step = store_step_input(16, 1, requests=requests)
        times, _ = store_step_times(step, rounds)
        entry: dict[str, Any] = {"requests": requests, "blocks": step.blocks}
        for name, t in times.items():
            entry[name] = _figures(t, step.blocks)
        growth.append(entry)
        print(f"  {requests:>5} requests {step.blocks:>6} blocks: " + ", ".join(
            f"{name} {entry[name]['us_per_block']:.3f}" for name in STORE_ENTRIES if name in entry))
    return growth


# ------------------------------------------------------ admission CPU time


ADMISSION_TARGET_MS = 0.15
TP4_PER_KEY_TARGET = 1.5




def embedded_scheduler_store(
    keyspace: KeySpace, query: LookupQuery, stack: ExitStack
) -> RankedLookup:
    """What the scheduler asks in embedded mode with the workers in its process: one
    ``SlabPool`` per rank, each holding every object of ``query`` (one byte each),
    reached through ``connect_to_pool`` (``_Borrowed``) and ``RankedLookup``."""
    stores: dict[str, SchedulerStore] = {}
    for rank, tag in enumerate(rank_tags(keyspace)):
        keys = query.runs.of_rank(rank).key_strings()
        pool = SlabPool((len(keys) + 2) * 64, page_bytes=64, high_watermark=1.0,
                        low_watermark=0.9)
        embedded = open_embedded_pool(pool, serve_other_processes=False)
        stack.callback(embedded.close)
        assert all(pool.put_batch(keys, [memoryview(b"x")] * len(keys)))
        stores[tag] = connect_to_pool(embedded.address, timeout_s=5.0)
    return RankedLookup(stores)


def admission_calls(
    num_tokens: int, block_size: int, tp: int, stack: ExitStack
) -> dict[str, Callable[[], object]]:
    """What the scheduler thread pays to admit a request whose every object hits:
    its lookup (query, the store's answer, per-rank fold, hit window) in
    ``get_num_new_matched_tokens`` and its load plan in ``update_state_after_alloc``
    (``plan_allocated_load``), from vLLM's list of block hashes, against the store
    embedded mode gives the scheduler (:func:`embedded_scheduler_store`).
    ``admission``: the request's first lookup, asked by hash as the shell asks the
    embedded pool (no key string built); ``repeat``: a later lookup of the same
    request (vLLM asks for a waiting request on every step until it is scheduled),
    its query from the request's memo (``request_lookup_query``, as the scheduler
    calls it). ``*_strings``: the same, asked by key string (what a store without
    ``lookup_hashes`` gets: the server, Mooncake, MORI clients; keys through the
    request's memo). Also the first lookup alone (query, store, fold), the
    reference-shaped baseline, and what a first lookup by string cannot go below:
    each key string alone (prefix + hex digest)."""
    geometry = geometry_for(block_size)
    keyspace = KeySpace("bench-namespace-0123", RankTopology(tp_size=tp))
    hashes = list(block_hashes(num_tokens // block_size))  # vLLM's Request.block_hashes
    table = (tuple(range(1, -(-num_tokens // block_size) + 1)),)
    first_query, memo = request_lookup_query(
        geometry, keyspace, hashes, 0, num_tokens, EMPTY_LOOKUP_MEMO
    )
    store = embedded_scheduler_store(keyspace, first_query, stack)
    _keys, string_memo = request_lookup_keys(geometry, keyspace, first_query, memo)
    objects = hashes[: num_tokens // block_size - 1]
    prefixes = [keyspace.key(rank, 0, b"") for rank in keyspace.topology.coords()]

    def key_strings() -> object:
        return [[prefix + block_hash.hex() for block_hash in objects] for prefix in prefixes]

    def lookup() -> object:
        query, _ = request_lookup_query(
            geometry, keyspace, hashes, 0, num_tokens, EMPTY_LOOKUP_MEMO
        )
        return query, fold_rank_hits(query, store.lookup_hashes(query.runs))

    def plan(query: LookupQuery, answers: tuple[bool, ...]) -> LoadPlan:
        folded = fold_rank_hits(query, answers)
        assert folded is not None
        spec = single_group_load_spec(geometry, query, folded)
        assert spec is not None
        return plan_allocated_load(
            "r", geometry, spec, table, hashes, spec.num_tokens_to_load
        ).unwrap()

    def admit(lookups: LookupMemo) -> LoadPlan:
        query, _ = request_lookup_query(geometry, keyspace, hashes, 0, num_tokens, lookups)
        return plan(query, store.lookup_hashes(query.runs))

    def admit_by_strings(lookups: LookupMemo) -> LoadPlan:
        query, lookups = request_lookup_query(geometry, keyspace, hashes, 0, num_tokens, lookups)
        keys, _ = request_lookup_keys(geometry, keyspace, query, lookups)
        return plan(query, store.lookup(keys))

    def baseline() -> LoadPlan:
        return baseline_lookup_to_load(
            geometry, keyspace, hashes, num_tokens, lambda n: (True,) * n, table[0]
        )

    assert (admit(EMPTY_LOOKUP_MEMO) == admit(memo) == admit_by_strings(EMPTY_LOOKUP_MEMO)
            == admit_by_strings(string_memo) == baseline()), "baseline and core disagree"
    return {"admission": lambda: admit(EMPTY_LOOKUP_MEMO), "repeat": lambda: admit(memo),
            "admission_strings": lambda: admit_by_strings(EMPTY_LOOKUP_MEMO),
            "repeat_strings": lambda: admit_by_strings(string_memo),
            "lookup": lookup, "baseline": baseline, "key_strings": key_strings}


def admission_section(quick: bool) -> dict[str, object]:
    rounds = 40 if quick else 300
    print(f"admission CPU time (thread CPU per call, GC on, median of {rounds} interleaved calls; "
          f"load average {os.getloadavg()[0]:.2f}); the store: one in-process SlabPool per rank "
          "through RankedLookup, asked by hash (first, repeat) and by key string (*str)")
    print(f"{'tokens':>7} {'block':>5} {'ranks':>5} {'keys':>6} {'first':>8} {'repeat':>8} "
          f"{'first str':>9} {'repeat str':>10} {'lookup':>8} {'ns/key':>7} {'keys alone':>10} "
          f"{'baseline':>9} {'speed-up':>8}")
    rows: list[dict[str, float]] = []
    # Cases that are compared (TP4 with TP1, prompt lengths) are timed together,
    # round by round, so their ratios see the same load on the machine.
    for group in (
        ((32768, 32, 1), (32768, 32, 4)),
        ((2048, 16, 1), (8192, 16, 1), (32768, 16, 1), (32768, 16, 4)),
    ):
        with ExitStack() as pools:
            calls = {(case, name): call for case in group
                     for name, call in admission_calls(*case, pools).items()}
            # The reference-shaped baseline makes a tuple per object: timed in a pass of
            # its own, so the collections its garbage triggers land on its calls, not on
            # an admission's (GC stays on for both).
            medians = interleaved_cpu_median_ns(
                {key: call for key, call in calls.items() if key[1] != "baseline"}, rounds)
            medians.update(interleaved_cpu_median_ns(
                {key: call for key, call in calls.items() if key[1] == "baseline"},
                max(rounds // 5, 5)))
        for num_tokens, block_size, tp in group:
            case = (num_tokens, block_size, tp)
            keys = (num_tokens // block_size - 1) * tp
            row = {"tokens": num_tokens, "block_size": block_size, "ranks": tp, "keys": keys,
                   "blocks": num_tokens // block_size,
                   "admission_us": medians[(case, "admission")] / 1e3,
                   "repeat_us": medians[(case, "repeat")] / 1e3,
                   "admission_strings_us": medians[(case, "admission_strings")] / 1e3,
                   "repeat_strings_us": medians[(case, "repeat_strings")] / 1e3,
                   "lookup_us": medians[(case, "lookup")] / 1e3,
                   "lookup_ns_per_key": medians[(case, "lookup")] / keys,
                   "baseline_us": medians[(case, "baseline")] / 1e3,
                   "key_strings_us": medians[(case, "key_strings")] / 1e3}
            rows.append(row)
            print(f"{num_tokens:>7} {block_size:>5} {tp:>5} {keys:>6} "
                  f"{row['admission_us']:>6.0f}us {row['repeat_us']:>6.0f}us "
                  f"{row['admission_strings_us']:>7.0f}us {row['repeat_strings_us']:>8.0f}us "
                  f"{row['lookup_us']:>6.0f}us "
                  f"{row['lookup_ns_per_key']:>7.0f} {row['key_strings_us']:>8.0f}us "
                  f"{row['baseline_us']:>7.0f}us {row['baseline_us'] / row['admission_us']:>7.1f}x")
    by_case = {(r["tokens"], r["block_size"], r["ranks"]): r for r in rows}
    # The target case once more, its calls timed only with each other: interleaved
    # with the TP4 and by-string calls above, every call of it (the key strings alone
    # too) runs on caches those calls just filled, and takes up to twice as long.
    with ExitStack() as pools:
        target_calls = admission_calls(32768, 32, 1, pools)
        alone = {name: median / 1e3 for name, median in interleaved_cpu_median_ns(
            {name: target_calls[name] for name in ("admission", "repeat", "key_strings")},
            rounds).items()}
    print(f"32K at block 32, TP1, timed alone: first {alone['admission']:.0f}us, repeat "
          f"{alone['repeat']:.0f}us, key strings alone {alone['key_strings']:.0f}us")
    for name, label in (("admission", "first admission timed alone (by hash)"),
                        ("repeat", "repeated admission timed alone")):
        ms = alone[name] / 1e3
        print(f"32K {label} at block 32, TP1: {ms:.3f} ms "
              f"(target <= {ADMISSION_TARGET_MS} ms: {'met' if ms <= ADMISSION_TARGET_MS else 'NOT met'})")
    case = by_case[(32768, 32, 1)]
    for name, label in (("admission_us", "first admission (by hash, no key string)"),
                        ("repeat_us", "repeated admission (query from the memo)"),
                        ("admission_strings_us", "first admission by key string"),
                        ("repeat_strings_us", "repeated admission by key string")):
        ms = case[name] / 1e3
        print(f"32K {label} at block 32, TP1: {ms:.3f} ms "
              f"(target <= {ADMISSION_TARGET_MS} ms: {'met' if ms <= ADMISSION_TARGET_MS else 'NOT met'})")
    print(f"first admission: {case['admission_us'] / case['key_strings_us']:.2f}x "
          "the key strings alone it no longer builds")
    for block_size in (32, 16):
        ratio = (by_case[(32768, block_size, 4)]["lookup_ns_per_key"]
                 / by_case[(32768, block_size, 1)]["lookup_ns_per_key"])
        print(f"TP4 lookup per key vs TP1 at block {block_size}: {ratio:.2f}x "
              f"(target <= {TP4_PER_KEY_TARGET}x: {'met' if ratio <= TP4_PER_KEY_TARGET else 'NOT met'})")
    growth = [by_case[(tokens, 16, 1)] for tokens in (2048, 8192, 32768)]
    for name in ("admission_us", "repeat_us"):
        print(f"growth at block 16, TP1 ({name.removesuffix('_us')}): " + ", ".join(
            f"{int(r['tokens']):,} tokens {r[name] / r['blocks'] * 1e3:.0f} ns/block"
            for r in growth))
    return {"rounds": rounds, "load_average": os.getloadavg()[0], "rows": rows,
            "target_alone_us": alone}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="shorter timing budgets")
    parser.add_argument("--store-only", action="store_true", help="only the store step")
    args = parser.parse_args(argv)
    budget = 0.3 if args.quick else 1.0
    if args.store_only:
        store = store_step_section(args.quick)
        if args.json is not None:
            args.json.write_text(json.dumps({"store_step": store}, indent=2))
        return 0

    print(f"python {sys.version.split()[0]}; times are the best of 5 runs, microseconds per call")
    print()
    print("lookup -> load plan, 32,768-token prompt, every object hits")
    header = (
        f"{'block':>5} {'ranks':>5} {'keys':>6} {'total':>9} {'query':>9} {'fold':>8} "
        f"{'window':>8} {'load':>8} {'baseline':>9} {'speed-up':>8}"
    )
    print(header)
    lookups = []
    for block_size in (16, 32):
        for tp in (1, 4):
            row = lookup_case(32768, block_size, tp, budget)
            lookups.append(row)
            print(
                f"{block_size:>5} {tp:>5} {row['keys']:>6} {row['total_us']:>9.1f} "
                f"{row['build_query_us']:>9.1f} {row['fold_us']:>8.1f} "
                f"{row['hit_window_us']:>8.1f} {row['load_batch_us']:>8.1f} "
                f"{row['baseline_us']:>9.1f} {row['baseline_us'] / row['total_us']:>7.1f}x"
            )
    print()
    print("growth with prompt length (block 16, one rank)")
    print(f"{'tokens':>7} {'blocks':>6} {'total':>9} {'per block':>10} {'vs 2K':>7}")
    growth = []
    for num_tokens in (2048, 8192, 32768):
        row = lookup_case(num_tokens, 16, 1, budget)
        growth.append(row)
        base = growth[0]["total_us"]
        print(
            f"{num_tokens:>7} {row['blocks']:>6} {row['total_us']:>9.1f} "
            f"{row['total_us'] / row['blocks'] * 1000:>8.1f}ns {row['total_us'] / base:>6.1f}x"
        )
    print(f"(blocks grow {growth[-1]['blocks'] / growth[0]['blocks']:.0f}x)")
    print()
    store = store_step_section(args.quick)
    print()
    admission = admission_section(args.quick)
    if args.json is not None:
        args.json.write_text(json.dumps(
            {"lookup_32k": lookups, "growth": growth, "store_step": store, "admission": admission},
            indent=2,
        ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
