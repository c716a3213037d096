"""A real SGLang engine in a child process, driven over JSON lines (tests, benchmarks).

The child runs with the TEST-ONLY CPU stand-ins of ``umbp/testing/sglang_cpu`` on
``PYTHONPATH`` (SGLang is built for GPUs; see docs/sglang.md). Each engine lives in a
process of its own: SGLang spawns its scheduler processes from it, and a fresh process
is what "a second engine restores from the store" means.

Parent side: :class:`SGLangEngineProcess`. Child side: ``python -m
umbp.testing.sglang_engine SPEC_JSON`` reads one request per line on stdin and answers
one JSON line on stdout (``{"op": "generate", "prompts": [[ids]], "max_new_tokens": n}``
-> ``{"outputs": [{"tokens", "details", "seconds"}]}``; ``{"op": "stop"}``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import umbp
from umbp.sglang import BACKEND_CLASS, BACKEND_MODULE, BACKEND_NAME

__all__ = [
    "STAND_INS",
    "SGLangEngineProcess",
    "build_hash_extension",
    "cpu_environment",
    "engine_arguments",
    "finish_hash_extension_build",
    "start_hash_extension_build",
    "umbp_storage",
]

STAND_INS = Path(__file__).resolve().parent / "sglang_cpu"
_REPO = Path(umbp.__file__).resolve().parents[1]
_READY = "umbp-sglang-engine-ready"


def cpu_environment(torch_extensions_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The environment of a CPU SGLang process: the stand-ins and this checkout first on
    the path, SGLang's CPU engine, and a private torch-extensions folder (a killed
    engine leaves a lock there that would block later engines forever)."""
    environment = dict(os.environ)
    paths = [str(STAND_INS), str(_REPO)]
    paths += [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    environment["SGLANG_USE_CPU_ENGINE"] = "1"
    environment["TORCH_EXTENSIONS_DIR"] = str(torch_extensions_dir)
    environment.setdefault("OMP_NUM_THREADS", "2")
    return environment


def start_hash_extension_build(environment: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start compiling SGLang's page-hash C++ extension (needs g++ and libssl-dev) into
    the environment's TORCH_EXTENSIONS_DIR. Call it only while no engine of that folder
    runs: it first removes the locks killed engines left there, which would otherwise
    block every later engine forever."""
    extensions = Path(environment["TORCH_EXTENSIONS_DIR"])
    if extensions.is_dir():
        for lock in extensions.rglob("lock"):
            lock.unlink()
    return subprocess.Popen(
        [sys.executable, "-c", ("from sglang.srt.mem_cache.cpp_utils.native_hash import "
                                "_load_native_hash_module as load; load()")],
        env=dict(environment), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def finish_hash_extension_build(build: subprocess.Popen[bytes], timeout_s: float = 900.0) -> None:
    _, errors = build.communicate(timeout=timeout_s)
    if build.returncode:
        raise RuntimeError(f"building SGLang's hash extension failed: {errors.decode()[-2000:]}")


def build_hash_extension(environment: Mapping[str, str], timeout_s: float = 900.0) -> None:
    """Compile SGLang's page-hash extension once, before any engine starts."""
    finish_hash_extension_build(start_hash_extension_build(environment), timeout_s)


def umbp_storage(**options: Any) -> dict[str, Any]:
    """The HiCache extra config that loads umbp's backend with ``options``."""
    return {"backend_name": BACKEND_NAME, "module_path": BACKEND_MODULE,
            "class_name": BACKEND_CLASS, "interface_v1": 1, "prefetch_threshold": 16,
            **options}


def engine_arguments(model: str, *, storage_backend: str | None = None,
                     storage_config: Mapping[str, Any] | None = None,
                     hicache: bool = True, max_total_tokens: int = 8192,
                     page_size: int = 16, hicache_ratio: float = 2.0) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments that run on these CPUs (float32, torch
    attention, no CUDA graphs); HiCache with the direct IO backend when asked."""
    arguments: dict[str, Any] = {
        "model_path": model, "device": "cpu", "skip_tokenizer_init": True,
        "attention_backend": "torch_native", "page_size": page_size,
        "disable_cuda_graph": True, "max_total_tokens": max_total_tokens,
        # max_total_tokens sizes the KV pool; the fraction only has to pass SGLang's
        # check that weights leave room, which counts the whole machine's free memory
        # (other processes' churn on a shared host failed 0.05 once).
        "mem_fraction_static": 0.15, "dtype": "float32", "log_level": "warning",
        "random_seed": 0,
        # An idle scheduler spins a core by default; engines here share two cores.
        "sleep_on_idle": True,
    }
    if hicache:
        arguments.update(
            enable_hierarchical_cache=True, hicache_io_backend="direct",
            hicache_mem_layout="page_first_direct", hicache_ratio=hicache_ratio,
            hicache_write_policy="write_through",
            hicache_storage_prefetch_policy="wait_complete",
        )
    if storage_backend is not None:
        arguments["hicache_storage_backend"] = storage_backend
        if storage_config is not None:
            arguments["hicache_storage_backend_extra_config"] = json.dumps(storage_config)
    return arguments


class SGLangEngineProcess:
    """One engine in a child process; ``close`` stops it (and kills it if it hangs)."""

    def __init__(self, arguments: Mapping[str, Any], environment: Mapping[str, str],
                 log_path: str | os.PathLike[str], start_timeout_s: float = 600.0,
                 wait: bool = True) -> None:
        """Start the child; with ``wait=False`` call :meth:`wait_until_ready` later
        (engines start faster side by side than one after another)."""
        self._log = open(log_path, "ab")  # noqa: SIM115 - the child writes it until close()
        self.log_path = str(log_path)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "umbp.testing.sglang_engine", json.dumps(dict(arguments))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=dict(environment), start_new_session=True,
        )
        self._start_timeout_s = start_timeout_s
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        try:
            self._expect_ready(self._start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._process.pid

    def generate(self, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int) -> list[dict[str, Any]]:
        answer = self._call({"op": "generate", "prompts": [list(p) for p in prompts],
                             "max_new_tokens": max_new_tokens})
        outputs: list[dict[str, Any]] = answer["outputs"]
        return outputs

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._call({"op": "stop"})
                self._process.wait(timeout=60)
            except Exception:  # noqa: BLE001, S110 - a hung child is killed below
                pass
        if self._process.poll() is None:
            os.killpg(self._process.pid, 9)
            self._process.wait()
        else:  # SGLang's scheduler children share the session; none may outlive it
            try:
                os.killpg(self._process.pid, 9)
            except ProcessLookupError:
                pass
        self._log.close()

    def _expect_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        stdout = self._stdout()
        while time.monotonic() < deadline:
            line = stdout.readline()
            if not line:
                raise RuntimeError(f"SGLang engine exited during start; log {self.log_path}")
            if line.decode().strip() == _READY:
                return
        raise RuntimeError(f"SGLang engine did not start in {timeout_s:g} s; log {self.log_path}")

    def _call(self, request: Mapping[str, Any]) -> dict[str, Any]:
        stdin = self._process.stdin
        assert stdin is not None
        stdin.write(json.dumps(dict(request)).encode() + b"\n")
        stdin.flush()
        line = self._stdout().readline()
        if not line:
            raise RuntimeError(f"SGLang engine died; log {self.log_path}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"SGLang engine: {answer['error']}; log {self.log_path}")
        return answer

    def _stdout(self) -> IO[bytes]:
        stdout = self._process.stdout
        assert stdout is not None
        return stdout


def _serve(arguments: dict[str, Any]) -> None:
    """Child: start the engine, then answer requests until told to stop."""
    import sglang

    out = sys.stdout
    sys.stdout = sys.stderr  # SGLang prints; only answers go to the real stdout
    engine = sglang.Engine(**arguments)
    out.write(_READY + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "stop":
                out.write("{}\n")
                out.flush()
                break
            try:
                answer: dict[str, Any] = {"outputs": [
                    _generate_one(engine, prompt, int(request["max_new_tokens"]))
                    for prompt in request["prompts"]
                ]}
            except Exception as error:  # noqa: BLE001 - reported to the parent
                answer = {"error": f"{type(error).__name__}: {error}"}
            out.write(json.dumps(answer) + "\n")
            out.flush()
    finally:
        engine.shutdown()


def _generate_one(engine: Any, prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    result = engine.generate(input_ids=prompt, sampling_params={
        "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True})
    seconds = time.perf_counter() - started
    meta = result.get("meta_info", {})
    return {"tokens": list(result["output_ids"]), "seconds": seconds,
            "cached": int(meta.get("cached_tokens", 0)),
            "details": meta.get("cached_tokens_details") or {}}


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
