"""The serving path as users run it: the ``vllm`` console script's ``vllm serve``
(an OpenAI-compatible server on 127.0.0.1) with umbp, driven over HTTP by a real
client. A random-weight float32 model and a tokenizer made locally; float32
because there a restored prefix must give exactly the tokens of a cold run.

Servers are shared between the tests of a class (each start costs ~1 minute
here); the two servers of the shared-pool class start concurrently."""

from __future__ import annotations

import glob
import os
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from umbp.runtime.server.launch import start_server, stop_server
from umbp.testing import serve

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

PREFIX_TOKENS = 1024  # 32 blocks of 32
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
SUFFIX_TOKENS = 40
NEW_TOKENS = 12
VOCAB = 512


def _prompts(count: int, seed: int) -> list[list[int]]:
    """``count`` prompts: two long shared prefixes, each prompt its own suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(3, VOCAB) for _ in range(SUFFIX_TOKENS)]
            for i in range(count)]


def _complete(client: Any, prompt: list[int]) -> tuple[int, list[int], int]:
    """(HTTP status, generated token ids, cached prompt tokens) of one completion."""
    answer = client.post("/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    })
    if answer.status_code != 200:
        return answer.status_code, [], 0
    body = answer.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return 200, list(body["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def _reset_vllm_prefix_cache(client: Any, wait_s: float = 30.0) -> None:
    """vLLM's own cache only (dev-mode endpoint): the next hits can come from umbp alone.
    Refused while umbp's last stores are in flight (their blocks stay pinned until
    stored; the engine steps by itself meanwhile), so asked again until it succeeds,
    as an operator would."""
    deadline = time.monotonic() + wait_s
    while True:
        answer = client.post("/reset_prefix_cache")
        assert answer.status_code == 200, answer.text
        if answer.json() == {"success": True}:
            return
        assert time.monotonic() < deadline, "vLLM kept refusing to reset its prefix cache"
        time.sleep(0.05)


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + "{", name + " "))]
    assert values, f"/metrics has no {name}"
    return sum(values)


def _settled_metrics(client: Any, name: str, wait_s: float = 30.0) -> str:
    """/metrics once ``name`` has stopped changing: the engine reports a step's
    counters with its outputs, possibly just after the HTTP answer went out."""
    deadline = time.monotonic() + wait_s
    previous = None
    while True:
        text = client.get("/metrics").text
        value = _metric(text, name)
        if value == previous or time.monotonic() > deadline:
            return text
        previous = value
        time.sleep(2.0)


def _lookup_folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "umbp-lookup-*")))


@pytest.fixture(scope="session")
def served_model(llama_fp32: str) -> str:
    from umbp.testing.tokenizer import write_word_tokenizer

    write_word_tokenizer(Path(llama_fp32), VOCAB)
    return llama_fp32


@pytest.fixture(scope="module")
def embedded_server(served_model: str, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[serve.Served, set[str]]]:
    folders_before = _lookup_folders()
    args = serve.serve_args(served_model, serve.free_port(),
                            extra_config={"mode": "embedded", "capacity_bytes": 256 << 20})
    # As from a shell that never set it: umbp's config phase sets it then (and logs so).
    served = serve.start(args, tmp_path_factory.mktemp("serve") / "vllm.log",
                         unset=(RESERVED_CPU_ENV,))
    try:
        serve.wait_ready(served)
        yield served, folders_before
    finally:
        serve.stop(served)


class TestEmbeddedPool:
    def test_restored_prefixes_give_the_cold_tokens_over_http(
        self, embedded_server: tuple[serve.Served, set[str]]
    ) -> None:
        served, _ = embedded_server
        prompts = _prompts(4, seed=11)
        with httpx.Client(base_url=served.url, timeout=300) as client:
            cold = [_complete(client, prompt) for prompt in prompts]
            assert all(status == 200 for status, _, _ in cold)
            _reset_vllm_prefix_cache(client)
            restored = [_complete(client, prompt) for prompt in prompts]
            metrics = _settled_metrics(client, "umbp_scheduler_store_skipped_resident_blocks_total")
        assert [tokens for _, tokens, _ in restored] == [tokens for _, tokens, _ in cold]
        assert all(len(tokens) == NEW_TOKENS for _, tokens, _ in cold)
        # vLLM's cache was empty: every cached token of the first request per prefix
        # came from umbp (whole blocks of the prompt, the last one recomputed).
        for _, _, cached in restored[:2]:
            assert cached >= PREFIX_TOKENS, restored
        assert _metric(metrics, "umbp_worker_loaded_blocks_total") >= 2 * PREFIX_TOKENS // 32
        assert _metric(metrics, "umbp_scheduler_hit_tokens_total") >= 2 * PREFIX_TOKENS
        # Every distinct full block copied out once: the two prefixes and one suffix block
        # per prompt. vLLM's own hits (cold round) and umbp's restores (second round) were
        # already resident and are not stored again.
        distinct = 2 * PREFIX_TOKENS // 32 + len(prompts) * (SUFFIX_TOKENS // 32)
        assert _metric(metrics, "umbp_worker_stored_blocks_total") == distinct
        assert _metric(metrics, "umbp_scheduler_store_skipped_resident_blocks_total") > 0

    def test_umbp_logs_through_vllm_logging(
        self, embedded_server: tuple[serve.Served, set[str]]
    ) -> None:
        # Read while the server runs, after any test of the class: a record is found
        # by its head wherever it starts (another process may have left an unfinished
        # line before it), and only umbp's own messages are asked about.
        log = embedded_server[0].log_text()
        records = serve.vllm_records(log)

        def logged(process: str, start: str, *also: str) -> bool:
            return any(name == process and message.startswith(start)
                       and all(part in message for part in also)
                       for name, message in records)

        assert logged("Worker", "umbp worker rank", "mode embedded")
        assert logged("EngineCore", "umbp sets kv_load_failure_policy=recompute")
        # The fixture starts vllm serve without the variable, so umbp sets it.
        assert logged("APIServer", f"umbp sets {RESERVED_CPU_ENV}=")
        bare = serve.umbp_outside_vllm_records(log)
        assert not bare, f"umbp lines outside vLLM's log format: {bare}"

    def test_a_stopped_server_leaves_no_lookup_socket(
        self, embedded_server: tuple[serve.Served, set[str]]
    ) -> None:
        served, folders_before = embedded_server
        serve.stop(served)  # the fixture's stop is then a no-op
        assert served.process.returncode is not None
        assert _lookup_folders() - folders_before == set()


def test_a_bad_option_stops_vllm_serve_before_the_model_loads(
    served_model: str, tmp_path: Path
) -> None:
    args = serve.serve_args(served_model, serve.free_port(),
                            extra_config={"mode": "embedded", "capacity_byte": 1 << 26})
    served = serve.start(args, tmp_path / "vllm.log")
    try:
        returncode = served.process.wait(600)
    finally:
        serve.stop(served)
    log = served.log_text()
    assert returncode != 0
    assert "Traceback" not in log, log
    # No engine process started, so no model was loaded.
    assert "EngineCore" not in log and "Starting to load model" not in log, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert errors and "capacity_byte" in errors[0], log


@pytest.fixture(scope="module")
def shared_servers(served_model: str, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[Any, str, list[serve.Served]]]:
    """A prefill engine (kv_producer) and a decode engine (kv_consumer) on one
    ``umbp serve``: the shared pool, and disaggregated prefill through it."""
    folder = tmp_path_factory.mktemp("shared")
    socket_path = str(folder / "umbp.sock")
    pool = start_server(socket_path, 256 << 20, log_path=str(folder / "umbp.log"))
    extra = {"mode": "server", "endpoint": socket_path}
    engines = [serve.start(serve.serve_args(served_model, serve.free_port(), extra_config=extra,
                                            kv_role=role),
                           folder / f"vllm-{index}.log")
               for index, role in enumerate(("kv_producer", "kv_consumer"))]
    try:
        for engine in engines:
            serve.wait_ready(engine)
        yield pool, socket_path, engines
    finally:
        for engine in engines:
            serve.stop(engine)
        stop_server(pool, socket_path)


class TestSharedServer:
    """Two ``vllm serve`` processes on one ``umbp serve``: the prefill engine's stores
    are the decode engine's hits, directly and through ``umbp pd-proxy`` (the decode
    engine waits for the blocks the prefill engine announced, its stores still in
    flight); a ``kill -9`` of ``umbp serve`` under load loses no request."""

    def test_disaggregated_prefill_through_the_store_gives_one_engines_tokens(
        self, shared_servers: tuple[Any, str, list[serve.Served]]
    ) -> None:
        from umbp.pd_proxy import serve as serve_proxy

        _, _, (prefill, decode) = shared_servers
        proxy = serve_proxy("127.0.0.1", serve.free_port(), prefill.url, decode.url, 300.0)
        prompts = _prompts(4, seed=31)  # prefixes neither engine has seen
        full_blocks = (len(prompts[0]) - 1) // 32 * 32
        try:
            url = f"http://127.0.0.1:{proxy.server_address[1]}"
            with httpx.Client(base_url=url, timeout=300) as client:
                assert client.get("/health").status_code == 200
                with ThreadPoolExecutor(max_workers=4) as executor:  # stores race lookups
                    split = list(executor.map(lambda p: _complete(client, p), prompts))
            with httpx.Client(base_url=prefill.url, timeout=300) as client:
                single = [_complete(client, prompt) for prompt in prompts]
        finally:
            proxy.shutdown()
        assert [status for status, _, _ in split] == [200] * len(prompts)
        # The decode engine computed only the last block: every announced block came
        # from the pool, none of it raced past a store still in flight.
        assert [cached for _, _, cached in split] == [full_blocks] * len(prompts), split
        # The tokens one engine generates for the whole prompt (float32: its own prefix
        # hit here equals a cold run).
        assert [tokens for _, tokens, _ in split] == [tokens for _, tokens, _ in single]
        with httpx.Client(base_url=decode.url, timeout=300) as client:
            metrics = _settled_metrics(client, "umbp_worker_loaded_blocks_total")
        assert _metric(metrics, "umbp_worker_stored_blocks_total") == 0  # a consumer
        assert _metric(metrics, "umbp_scheduler_announced_short_total") == 0

    def test_a_request_body_asks_its_blocks_be_kept_and_umbp_ls_names_the_model(
        self, shared_servers: tuple[Any, str, list[serve.Served]]
    ) -> None:
        """``kv_transfer_params`` in the HTTP request reaches the connector, which asks
        the server to retain the request's blocks (runs before the pool is killed)."""
        from umbp.runtime.server import ServerStore

        _, socket_path, engines = shared_servers
        (prompt,) = _prompts(1, seed=41)
        with httpx.Client(base_url=engines[0].url, timeout=300) as client:
            for params in ({"umbp": {"retain_s": "long"}}, {"umbp": {"retain_s": 120}}):
                answer = client.post("/v1/completions", json={
                    "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": params})
                assert answer.status_code == 200, answer.text
        with ServerStore(socket_path) as store:
            deadline = time.monotonic() + 60
            while True:
                (row,) = store.namespaces()  # both engines serve one model: one namespace
                if row["retained"]["objects"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert row["retained"]["objects"] == len(prompt) // 32
        assert row["label"].startswith("vllm ") and " weights files:" in row["label"]
        assert "retain_s must be a number of seconds" in engines[0].log_text()

    def test_one_engines_stores_are_the_others_hits_and_a_killed_pool_loses_nothing(
        self, shared_servers: tuple[Any, str, list[serve.Served]]
    ) -> None:
        pool, _, engines = shared_servers
        prompts = _prompts(6, seed=23)
        first, second = (httpx.Client(base_url=e.url, timeout=300) for e in engines)
        with first, second:
            reference = [_complete(first, prompt) for prompt in prompts]
            assert all(status == 200 for status, _, _ in reference)
            shared = [_complete(second, prompt) for prompt in prompts[:2]]
            assert [t for _, t, _ in shared] == [t for _, t, _ in reference[:2]]
            assert all(cached >= PREFIX_TOKENS for _, _, cached in shared), shared

            for client in (first, second):
                _reset_vllm_prefix_cache(client)
            jobs = [(client, index) for index in range(len(prompts)) for client in (first, second)]
            jobs = jobs * 2
            killed = threading.Event()

            def run(job: tuple[Any, int]) -> tuple[int, int, list[int]]:
                client, index = job
                status, tokens, _ = _complete(client, prompts[index])
                if not killed.is_set():
                    killed.set()
                    pool.kill()  # kill -9 while the other requests are in flight
                return index, status, tokens

            with ThreadPoolExecutor(max_workers=4) as executor:
                answers = list(executor.map(run, jobs))
        assert pool.wait(30) is not None
        assert [status for _, status, _ in answers] == [200] * len(jobs)
        for index, _, tokens in answers:
            assert tokens == reference[index][1], index
