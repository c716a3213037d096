"""Drive vLLM's real scheduler (``Scheduler``, ``KVCacheManager``, block pool,
block hasher, ``SchedulerOutput``, ``KVConnectorOutput``) with umbp's two
connector roles, without a model.

The scheduler builds umbp's scheduler-role connector itself (from the
``kv_transfer_config``, as in an engine). A worker-role connector is built next to
it and registers CPU KV tensors; a fake forward pass writes every computed
token's K/V rows with a value that depends only on (layer, position, token), so
a restored block can be checked byte for byte against what a recompute writes.
Nothing here depends on umbp's internals: only vLLM's hooks are called, and
:meth:`Driver.settle`, which waits until the worker's transfer threads are idle (a
test that reads the pool between two engine steps needs the stores handed over
in the last one; vLLM itself never waits for them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

NULL_BLOCK = 0
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS = 2
HEAD_SIZE = 32
# How long a helper steps an engine waiting on umbp's threads before it calls them hung.
THREAD_WAIT_S = 60.0


def write_model_config(directory: Path, max_positions: int = 2048) -> Path:
    """A config.json vLLM's ModelConfig reads; no weights are ever loaded."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": len(LAYERS), "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_SIZE, "vocab_size": 512,
        "max_position_embeddings": max_positions, "torch_dtype": "float32",
    }))
    return directory


def kv_value(layer: int, position: int, token: int) -> float:
    """What the fake forward pass writes for one token (exact in float32)."""
    return float(layer * 2_000_000 + position * 1000 + token)


def step_starts(output: Any) -> dict[str, int]:
    """Where each scheduled request's tokens start this step (vLLM advances
    ``request.num_computed_tokens`` inside ``schedule()``)."""
    starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    return starts


def vllm_config_for(
    model_dir: Path, *, block_size: int = 32, max_model_len: int = 1024,
    max_num_batched_tokens: int = 512, extra: dict[str, Any] | None = None,
    kv_events: bool = True, kv_role: str = "kv_both", cache: dict[str, Any] | None = None,
    max_num_seqs: int = 8, tensor_parallel_size: int = 1,
) -> Any:
    """An engine's VllmConfig with umbp as its KV connector (no weights are read)."""
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=max_model_len)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True,
                                 **(cache or {})),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="UMBPStoreConnector", kv_connector_module_path="umbp",
            kv_role=kv_role,
            kv_connector_extra_config=_extra_config(extra or {}),
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null"),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
    )


def _extra_config(extra: dict[str, Any]) -> dict[str, Any]:
    """umbp's options: an embedded pool of 64 MiB unless told otherwise (a server's size
    is the server's business)."""
    if extra.get("mode", "embedded") != "embedded":
        return dict(extra)
    return {"capacity_bytes": 64 << 20, **extra}


def resolve_layout(vllm_config: Any, specs: Iterable[Any]) -> None:
    """What the engine core does before planning the KV cache: one layout that
    the platform's attention back-ends support."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.worker.worker_base import get_supported_kv_cache_layouts, record_kv_cache_layout

    backends = get_current_attn_backends(vllm_config)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [supported], list(specs))
    record_kv_cache_layout(vllm_config.cache_config, layout.name)


@dataclass(frozen=True)
class _TpRank:
    """Stands in for vLLM's TP ``GroupCoordinator`` while one rank's worker connector is
    built: umbp reads only ``rank_in_group`` (``vllm_compat.this_worker_rank``)."""

    rank_in_group: int


class RecordingPublisher:
    """Stands in for vLLM's KV event publisher (ZMQ): keeps every batch."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, events: Any) -> None:
        self.events.extend(events.events)

    def shutdown(self) -> None:
        return None


@dataclass
class StepRecord:
    output: Any
    engine_outputs: Any
    kv_output: Any
    loads: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per request, the (group, block id) pairs whose bytes changed by the
    worker's load this step."""


@dataclass
class Reported:
    """Failed blocks and requests, and finished loads (in order, with repeats)."""

    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_recving: list[str] = field(default_factory=list)


class Driver:
    """With ``tensor_parallel_size`` above 1, one worker-role connector per TP rank in
    this process, each with its own KV tensors (``workers``, ``rank_kv``), stepped one
    after another as vLLM's executor runs its workers, their outputs joined by vLLM's
    ``KVOutputAggregator``. While a rank is stepped ``worker`` and ``kv`` are its own
    (the forward pass writes the same values on every rank); otherwise rank 0's. A
    worker learns its rank from vLLM's TP group (``rank_in_group``), which needs a
    process per rank: while one is built, that group is a stand-in holding only
    ``rank_in_group`` (all umbp reads of it)."""

    track_loads = True
    """Record which blocks each step's load changed (`StepRecord.loads`): a copy and a
    comparison of every KV tensor per step, which a driver of a huge cache turns off."""

    def __init__(
        self,
        model_dir: Path,
        *,
        num_blocks: int = 64,
        block_size: int = 32,
        max_model_len: int = 1024,
        max_num_batched_tokens: int = 512,
        sliding_window: int | None = None,
        extra: dict[str, Any] | None = None,
        kv_events: bool = True,
        kv_role: str = "kv_both",
        cache: dict[str, Any] | None = None,
        max_num_seqs: int = 8,
        tensor_parallel_size: int = 1,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        import umbp
        from umbp.shell import vllm_compat
        from umbp.shell.vllm_compat import versions

        self.vllm_config = vllm_config_for(
            model_dir, block_size=block_size, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, extra=extra, kv_events=kv_events,
            kv_role=kv_role, cache=cache, max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.block_size = block_size
        self.sliding_window = sliding_window

        specs = {name: self.layer_spec(i) for i, name in enumerate(LAYERS)}
        resolve_layout(self.vllm_config, specs.values())
        page = next(iter(specs.values())).page_size_bytes
        worker_config, scheduler_config = versions.engine_kv_cache_configs(
            self.vllm_config, specs, num_blocks * page * len(LAYERS)
        )
        self.kv_cache_config = scheduler_config
        block_size_, hash_block_size = vllm_compat.block_sizes(self.vllm_config, scheduler_config)
        self.scheduler = Scheduler(
            self.vllm_config, scheduler_config, StructuredOutputManager(self.vllm_config),
            block_size=block_size_, hash_block_size=hash_block_size, log_stats=True,
        )
        self.publisher = RecordingPublisher()
        self.scheduler.kv_event_publisher = self.publisher
        self.connector: Any = self.scheduler.connector
        assert isinstance(self.connector, umbp.UMBPStoreConnector)
        self.num_blocks = int(worker_config.num_blocks)
        self.group_of_layer = {
            name: g for g, group in enumerate(scheduler_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.workers = [self._rank_worker(worker_config, rank)
                        for rank in range(tensor_parallel_size)]
        self.rank_kv = [self.new_kv_tensors() for _ in self.workers]
        for worker, kv in zip(self.workers, self.rank_kv):
            worker.register_kv_caches(kv)
        self.worker, self.kv = self.workers[0], self.rank_kv[0]
        self._aggregator = KVOutputAggregator(len(self.workers))
        # The KV as the last step left it: a load that lands between steps (umbp's
        # load threads run beside the engine) is seen by the next step.
        self._kv_seen = {name: tensor.clone() for name, tensor in self.kv.items()}
        self.connector.set_xfer_handshake_metadata(
            {rank: worker.get_handshake_metadata() for rank, worker in enumerate(self.workers)}
        )
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(hash_block_size, sha256)
        self.requests: dict[str, Any] = {}
        self.steps: list[StepRecord] = []

    # -- set-up -------------------------------------------------------------

    def worker_connector(self, role: Any, worker_config: Any) -> Any:
        """The worker-role connector, as vLLM's worker builds it (a subclass may hand
        it a device)."""
        import umbp

        return umbp.UMBPStoreConnector(self.vllm_config, role, worker_config)

    def _rank_worker(self, worker_config: Any, rank: int) -> Any:
        """The worker-role connector of TP rank ``rank``."""
        from vllm.distributed import parallel_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        if self.vllm_config.parallel_config.world_size == 1:
            return self.worker_connector(KVConnectorRole.WORKER, worker_config)
        saved = parallel_state._TP
        parallel_state._TP = _TpRank(rank)
        try:
            return self.worker_connector(KVConnectorRole.WORKER, worker_config)
        finally:
            parallel_state._TP = saved

    def layer_spec(self, layer: int) -> Any:
        """vLLM's KV cache spec of one of ``LAYERS`` (a subclass may change it)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        if self.sliding_window is not None and layer == 0:
            return SlidingWindowSpec(block_size=self.block_size, num_kv_heads=KV_HEADS,
                                     head_size=HEAD_SIZE, dtype=torch.float32,
                                     sliding_window=self.sliding_window)
        return FullAttentionSpec(block_size=self.block_size, num_kv_heads=KV_HEADS,
                                 head_size=HEAD_SIZE, dtype=torch.float32)

    def new_kv_tensors(self) -> dict[str, torch.Tensor]:
        """One CPU KV tensor per layer, vLLM's CPU layout
        ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, filled with a
        marker no forward pass writes."""
        return {
            name: torch.full((self.num_blocks, KV_HEADS, self.block_size, 2 * HEAD_SIZE), -1.0)
            for name in LAYERS
        }

    def add(self, request_id: str, tokens: Sequence[int], max_tokens: int = 1,
            kv_transfer_params: dict[str, Any] | None = None) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
            extra_args=None if kv_transfer_params is None
            else {"kv_transfer_params": kv_transfer_params},
        )
        request = Request(request_id, list(tokens), params, None, block_hasher=self._hasher)
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request

    def settle(self) -> None:
        """Until every load and store the workers were handed has finished (what a
        step hands over lands on umbp's threads, after the step)."""
        for worker in self.workers:
            assert worker.worker.wait_idle(THREAD_WAIT_S), "umbp's transfers did not finish"

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.connector.shutdown()

    # -- one engine step ------------------------------------------------------

    def schedule(self) -> Any:
        return self.scheduler.schedule()

    def execute(self, output: Any) -> tuple[Any, dict[str, list[tuple[int, int]]]]:
        """The workers' part of a step, rank after rank; their outputs joined as
        vLLM's executor joins them (rank 0's loads are the ones tracked)."""
        if len(self.workers) == 1:
            return self._execute_rank(output)
        from vllm.v1.outputs import ModelRunnerOutput

        per_rank = []
        loads: dict[str, list[tuple[int, int]]] = {}
        try:
            for rank in reversed(range(len(self.workers))):  # rank 0 last: its loads
                self.worker, self.kv = self.workers[rank], self.rank_kv[rank]
                kv_output, loads = self._execute_rank(output, track=rank == 0)
                per_rank.append(ModelRunnerOutput(
                    req_ids=[], req_id_to_index={}, kv_connector_output=kv_output
                ))
        finally:
            self.worker, self.kv = self.workers[0], self.rank_kv[0]
        joined = self._aggregator.aggregate(per_rank[::-1])
        assert joined is not None
        return joined.kv_connector_output, loads

    def _execute_rank(
        self, output: Any, track: bool = True
    ) -> tuple[Any, dict[str, list[tuple[int, int]]]]:
        """One worker's part of a step, in the order vLLM's model runner calls the
        connector (``KVConnectorModelRunnerMixin``)."""
        from vllm.v1.outputs import KVConnectorOutput

        worker = self.worker
        worker.bind_connector_metadata(output.kv_connector_metadata)
        self.before_forward(output)
        before = self._kv_seen
        if output.has_sync_kv_loads:
            worker.start_load_kv(None)
        self._forward(output)
        if not output.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(output.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        self.after_step()
        if not (self.track_loads and track):
            return kv_output, {}
        self._kv_seen = {name: tensor.clone() for name, tensor in self.kv.items()}
        return kv_output, self._changed_blocks(before, output)

    def before_forward(self, output: Any) -> None:
        """What the model runner enqueues before the step's forward pass (a subclass
        adds to it)."""

    def after_step(self) -> None:
        """What the model runner does once the step's hooks ran (a subclass adds to it)."""

    def finish(self, output: Any, kv_output: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in req_ids:
            request = self.requests[request_id]
            reached = request.num_computed_tokens >= request.num_tokens
            sampled.append([7] if reached else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[], kv_connector_output=kv_output,
        )
        return self.scheduler.update_from_output(output, runner_output)

    def step(self) -> StepRecord:
        output = self.schedule()
        kv_output, loads = self.execute(output)
        engine_outputs = self.finish(output, kv_output)
        record = StepRecord(output, engine_outputs, kv_output, loads)
        self.steps.append(record)
        return record

    def run(self, request_ids: Iterable[str], max_steps: int | None = None) -> list[StepRecord]:
        """Step until every named request has finished."""
        wanted = set(request_ids)
        return self._step_until(lambda record: not wanted & set(self.scheduler.requests),
                                f"requests {sorted(wanted)} did not finish", max_steps)

    def run_collecting_preemptions(self, request_ids: Iterable[str]) -> set[str]:
        """Step until every named request has finished; the requests vLLM preempted on
        the way."""
        records = self.run(request_ids)
        return {request_id for record in records
                for request_id in record.output.preempted_req_ids or ()}

    def until_scheduled(self, request_id: str, max_steps: int | None = None) -> list[StepRecord]:
        """Step until vLLM schedules the request to compute (after its asynchronous
        load, if any, was reported finished: umbp's load thread decides when)."""
        return self._step_until(
            lambda record: request_id in record.output.num_scheduled_tokens,
            f"{request_id} was not scheduled", max_steps, pause_s=0.005,
        )

    def until_reported(self, request_id: str, max_steps: int | None = None) -> list[StepRecord]:
        """Step until vLLM hears the request's asynchronous load finished (in the
        step umbp's load thread got there)."""
        return self._step_until(
            lambda record: request_id in record.kv_output.finished_recving,
            f"{request_id}'s load was not reported", max_steps, pause_s=0.005,
        )

    def _step_until(self, done: Callable[[StepRecord], bool], failure: str,
                    max_steps: int | None, pause_s: float = 0.0) -> list[StepRecord]:
        """Step as vLLM's engine loop does until ``done`` holds for a step. umbp's
        threads decide when, and on a loaded machine a put or a load can take seconds:
        unless the caller bounds the steps (a claim about them), the bound is a
        deadline, which only a hang reaches."""
        deadline = time.monotonic() + THREAD_WAIT_S
        records: list[StepRecord] = []
        while True:
            records.append(self.step())
            if done(records[-1]):
                return records
            if len(records) == max_steps or time.monotonic() > deadline:
                raise AssertionError(f"{failure} in {len(records)} steps")
            if pause_s:
                time.sleep(pause_s)

    @staticmethod
    def reported(records: Iterable[StepRecord]) -> Reported:
        """What the worker told vLLM over these steps, each step's sets joined."""
        reports = Reported()
        for record in records:
            reports.invalid_block_ids |= set(record.kv_output.invalid_block_ids or ())
            reports.failed_recving |= set(record.kv_output.failed_recving or ())
            reports.finished_recving.extend(sorted(record.kv_output.finished_recving or ()))
        return reports

    @staticmethod
    def loads_of(records: Iterable[StepRecord], request_id: str) -> list[tuple[int, int]]:
        """The (group, block) pairs loads wrote for the request over these steps, each
        once (a load landing while a step's snapshot is taken shows in two steps)."""
        return list(dict.fromkeys(
            pair for record in records for pair in record.loads.get(request_id, [])
        ))

    def drain(self) -> None:
        """Step an idle engine as vLLM's engine loop does, until its scheduler has
        nothing left (``has_requests``: the connector's pending work, store
        acknowledgements and KV-event checks; finished requests whose blocks wait for
        a load still running)."""
        self._step_until(lambda record: not self.scheduler.has_requests(),
                         "the connector kept pending push work", None, pause_s=0.01)

    def fill_pool(self, request_id: str, tokens: Sequence[int]) -> None:
        """Compute ``tokens`` once, let every store be acknowledged, then empty
        vLLM's own prefix cache: the next identical prefix can only come from umbp."""
        self.add(request_id, tokens)
        self.run([request_id])
        self.drain()
        assert self.scheduler.reset_prefix_cache()

    def prefill(self, request_id: str, max_steps: int = 50) -> None:
        """Step until the request's whole prompt is computed (it is still running)."""
        request = self.requests[request_id]
        for _ in range(max_steps):
            if request.num_computed_tokens >= request.num_prompt_tokens:
                return
            self.step()
        raise AssertionError(f"{request_id} did not finish its prefill")

    # -- what a step did -------------------------------------------------------

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(g) for g in
                     self.scheduler.kv_cache_manager.get_block_ids(request_id))

    def _forward(self, output: Any) -> None:
        """Write K and V of every token the step computes, layer by layer, each
        layer after the connector's ``wait_for_layer_load`` for it (as vLLM's
        attention layers call it)."""
        starts = step_starts(output)
        for layer, name in enumerate(LAYERS):
            if output.kv_connector_metadata is not None:
                self.worker.wait_for_layer_load(name)
            for request_id, count in output.num_scheduled_tokens.items():
                request = self.requests[request_id]
                start = starts[request_id]
                table = self.block_ids(request_id)[self.group_of_layer[name]]
                for position in range(start, start + count):
                    self.write_token(name, layer, table, position,
                                     request.all_token_ids[position])

    def write_token(
        self, name: str, layer: int, table: Sequence[int], position: int, token: int
    ) -> None:
        index, offset = divmod(position, self.block_size)
        if index >= len(table) or table[index] == NULL_BLOCK:
            return
        self.kv[name][table[index], :, offset, :] = kv_value(layer, position, token)

    def _changed_blocks(
        self, before: dict[str, torch.Tensor], output: Any
    ) -> dict[str, list[tuple[int, int]]]:
        """Blocks the worker's load wrote (those the forward pass did not)."""
        computed: set[tuple[int, int]] = set()
        starts = step_starts(output)
        for request_id, count in output.num_scheduled_tokens.items():
            tables = self.block_ids(request_id)
            for position in range(starts[request_id], starts[request_id] + count):
                index = position // self.block_size
                for g, table in enumerate(tables):
                    if index < len(table):
                        computed.add((g, table[index]))
        changed: dict[tuple[int, int], None] = {}
        for name, tensor in self.kv.items():
            g = self.group_of_layer[name]
            diff = (tensor != before[name]).flatten(1).any(dim=1).nonzero().flatten().tolist()
            for block in diff:
                if (g, block) not in computed:
                    changed[(g, block)] = None
        owners: dict[str, list[tuple[int, int]]] = {}
        for request_id in self.requests:
            if request_id not in self.scheduler.requests:
                continue
            tables = self.block_ids(request_id)
            for g, table in enumerate(tables):
                for block in table:
                    if (g, block) in changed:
                        owners.setdefault(request_id, []).append((g, block))
        return owners

    def expected_block(self, name: str, tokens: Sequence[int], index: int) -> torch.Tensor:
        layer = LAYERS.index(name)
        rows = [
            torch.full((KV_HEADS, 2 * HEAD_SIZE), kv_value(layer, p, tokens[p]))
            for p in range(index * self.block_size, (index + 1) * self.block_size)
        ]
        return torch.stack(rows, dim=1)

    def assert_blocks_hold(self, request_id: str, tokens: Sequence[int],
                           block_indices: Iterable[int], group: int | None = None) -> int:
        """The request's blocks at ``block_indices`` hold exactly what the
        forward pass writes for ``tokens``; returns how many blocks were checked."""
        tables = self.block_ids(request_id)
        checked = 0
        for name in LAYERS:
            g = self.group_of_layer[name]
            if group is not None and g != group:
                continue
            for index in block_indices:
                block = tables[g][index]
                if block == NULL_BLOCK:
                    continue
                assert torch.equal(self.kv[name][block], self.expected_block(name, tokens, index)), (
                    f"{name} block {index} (id {block}) of {request_id} differs"
                )
                checked += 1
        return checked

    def kv_transfer_params(self, request_id: str) -> Any:
        """The ``kv_transfer_params`` vLLM put in the request's final output (what
        ``vllm serve`` returns to the client), from the steps so far."""
        for record in reversed(self.steps):
            for outputs in record.engine_outputs.values():
                for out in outputs.outputs:
                    if out.request_id == request_id and out.finish_reason is not None:
                        return out.kv_transfer_params
        raise AssertionError(f"no final output for request {request_id}")

    def cached_tokens(self, request_id: str) -> int:
        """``num_cached_tokens`` vLLM reported for the request (local + external
        hits), from the engine-core outputs of the steps so far."""
        for record in reversed(self.steps):
            for outputs in record.engine_outputs.values():
                for out in outputs.outputs:
                    stats = getattr(out, "prefill_stats", None)
                    if out.request_id == request_id and stats is not None:
                        return int(stats.num_cached_tokens)
        raise AssertionError(f"no output for request {request_id}")

    def connector_stats(self) -> dict[str, float]:
        """Every step's connector stats as vLLM's scheduler reported them, summed."""
        total: dict[str, float] = {}
        for record in self.steps:
            for outputs in record.engine_outputs.values():
                stats = outputs.scheduler_stats
                for name, value in ((stats and stats.kv_connector_stats) or {}).items():
                    total[name] = total.get(name, 0) + value
        return total

    def stored_events(self) -> list[Any]:
        from vllm.distributed.kv_events import BlockStored

        return [e for e in self.publisher.events
                if isinstance(e, BlockStored) and e.medium == "CPU"]
