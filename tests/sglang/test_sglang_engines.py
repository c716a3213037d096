"""Real SGLang engines (CPU, random-weight llama, float32) with umbp as HiCache's storage.

Engine A stores through umbp into a real ``umbp serve``; engine B, a process of its
own that never saw A's requests, restores from it. Two more engines do the same through
umbp's Mooncake mode against a real ``mooncake_master`` (TCP on loopback): the writer
stays up while the reader restores, because its segment holds the objects. Every generation is compared with a plain SGLang engine without
HiCache. Faults are real: bytes flipped in the server's shared-memory pool, the server
killed with SIGKILL while B serves. The engines are shared by the tests of this module
(they run in file order; each later test builds on what the earlier ones left).

Runs in .venv-sglang (``make test`` builds it); see docs/sglang.md.
"""

from __future__ import annotations

import mmap
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from umbp.runtime.server.client import ServerStore
from umbp.runtime.server.launch import start_server, stop_server
from umbp.testing.models import llama_recipe, write_random_model
from umbp.testing.mooncake_master import MooncakeMaster
from umbp.testing.sglang_engine import (
    SGLangEngineProcess,
    cpu_environment,
    engine_arguments,
    finish_hash_extension_build,
    start_hash_extension_build,
    umbp_storage,
)

pytestmark = pytest.mark.integration

PROMPT_TOKENS = 512
PAGE_SIZE = 16
NEW_TOKENS = 8
PROMPTS = {name: [random.Random(seed).randrange(1, 500) for _ in range(PROMPT_TOKENS)]
           for seed, name in enumerate(["restore", "corrupt", "killed", "after_kill",
                                        "mooncake"])}
SERVER_PROMPTS = ("restore", "corrupt", "killed", "after_kill")  # the rest: Mooncake's
# Full pages of a prompt: SGLang stores only full pages.
PAGES_PER_PROMPT = PROMPT_TOKENS // PAGE_SIZE


@dataclass
class World:
    socket: str
    server: subprocess.Popen[bytes]
    engine_b: SGLangEngineProcess
    mooncake_reader: SGLangEngineProcess
    reference: dict[str, list[int]]
    from_a: dict[str, dict[str, Any]]
    pages_of: dict[str, range]
    log_dir: Path
    closed: list[SGLangEngineProcess] = field(default_factory=list)


def _used_pages(socket: str) -> int:
    with ServerStore(socket) as store:
        figures = store.server_stats()
    return int(figures["dram"]["used_bytes"]) // int(figures["server"]["page_bytes"])


def _wait_for_objects(socket: str, count: int, timeout_s: float = 120.0) -> int:
    """SGLang writes pages to storage asynchronously: poll the server."""
    deadline = time.monotonic() + timeout_s
    with ServerStore(socket) as store:
        while True:
            objects = store.stats().objects
            if objects >= count or time.monotonic() > deadline:
                return objects
            time.sleep(0.5)


def _mooncake_keys(master: MooncakeMaster) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics",
                                timeout=10) as answer:
        metrics = answer.read().decode()
    (count,) = [line.split()[1] for line in metrics.splitlines()
                if line.startswith("master_key_count ")]
    return int(float(count))


def _wait_for_mooncake_keys(master: MooncakeMaster, count: int,
                            timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (keys := _mooncake_keys(master)) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    return keys


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    work = tmp_path_factory.mktemp("sglang")
    model = str(write_random_model(llama_recipe(), work / "model"))
    environment = cpu_environment(os.environ.get("UMBP_TEST_TORCH_EXTENSIONS_DIR",
                                                 str(work / "torch-extensions")))
    socket = str(work / "umbp.sock")
    server = start_server(socket, 256 << 20)
    master = MooncakeMaster.start(log=work / "mooncake-master.log")
    storage = umbp_storage(mode="server", endpoint=socket, io_timeout_s=2.0,
                           reconnect_interval_s=0.5)
    # One engine = one Mooncake node contributing a segment of its own.
    mooncake = umbp_storage(mode="mooncake", mooncake_master=master.address,
                            mooncake_local_hostname="127.0.0.1", capacity_bytes=64 << 20,
                            mooncake_buffer_bytes=16 << 20)
    with_umbp = engine_arguments(model, storage_backend="dynamic", storage_config=storage)
    with_mooncake = engine_arguments(model, storage_backend="dynamic",
                                     storage_config=mooncake)
    build = start_hash_extension_build(environment)
    # All side by side: engine starts are mostly imports and waiting, and the
    # extension is needed only by the first storage lookup. B is a process of its own
    # that never sees A's requests; it is asked only after A's pages are stored.
    plain = SGLangEngineProcess(engine_arguments(model, hicache=False), environment,
                                work / "plain.log", wait=False)
    engine_a = SGLangEngineProcess(with_umbp, environment, work / "a.log", wait=False)
    engine_b = SGLangEngineProcess(with_umbp, environment, work / "b.log", wait=False)
    mooncake_writer = SGLangEngineProcess(with_mooncake, environment,
                                          work / "mooncake-a.log", wait=False)
    engines = [plain, engine_a, engine_b, mooncake_writer]
    try:
        finish_hash_extension_build(build)
        for engine in engines:
            engine.wait_until_ready()
        reference = {name: out["tokens"] for name, out in
                     zip(PROMPTS, plain.generate(list(PROMPTS.values()), NEW_TOKENS))}
        plain.close()
        # Started once the plain engine is gone: five engines at once left too little
        # memory on a loaded machine. It starts while A and the Mooncake writer work.
        mooncake_reader = SGLangEngineProcess(with_mooncake, environment,
                                              work / "mooncake-b.log", wait=False)
        engines.append(mooncake_reader)
        from_a: dict[str, dict[str, Any]] = {}
        pages_of: dict[str, range] = {}
        for number, name in enumerate(SERVER_PROMPTS, 1):
            before = _used_pages(socket)
            (from_a[name],) = engine_a.generate([PROMPTS[name]], NEW_TOKENS)
            _wait_for_objects(socket, number * PAGES_PER_PROMPT)
            pages_of[name] = range(before, _used_pages(socket))
        engine_a.close()
        (from_a["mooncake"],) = mooncake_writer.generate([PROMPTS["mooncake"]], NEW_TOKENS)
        _wait_for_mooncake_keys(master, PAGES_PER_PROMPT)
        mooncake_reader.wait_until_ready()
        yield World(socket, server, engine_b, mooncake_reader, reference, from_a, pages_of,
                    work)
    finally:
        for engine in engines:
            engine.close()
        master.stop()
        stop_server(server, socket)


def test_engine_a_stores_every_full_page_and_generates_what_plain_sglang_does(
    world: World,
) -> None:
    for name, output in world.from_a.items():  # A's, and the Mooncake writer's
        assert output["tokens"] == world.reference[name], name
        assert output["details"].get("storage", 0) == 0, "nothing was stored before A"
    assert _wait_for_objects(world.socket, 0) >= len(SERVER_PROMPTS) * PAGES_PER_PROMPT


def test_a_fresh_engine_restores_the_prefix_from_umbp_serve(world: World) -> None:
    (output,) = world.engine_b.generate([PROMPTS["restore"]], NEW_TOKENS)
    assert output["details"]["storage_backend"] == "UMBPHiCacheStore"
    restored = output["details"]["storage"]
    # SGLang computes at least the last prompt token itself.
    assert PROMPT_TOKENS - 2 * PAGE_SIZE <= restored < PROMPT_TOKENS
    assert output["tokens"] == world.reference["restore"] == world.from_a["restore"]["tokens"]


def _flip_a_byte_of_server_page(socket: str, page: int) -> None:
    """Corrupt one page of the server's DRAM pool from outside, through its file."""
    with ServerStore(socket) as store:
        figures = store.server_stats()["server"]
    path, size = figures["shm_path"], int(figures["shm_bytes"])
    page_bytes = int(figures["page_bytes"])
    descriptor = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(descriptor, size) as pool:
            pool[page * page_bytes + 100] ^= 0xFF
    finally:
        os.close(descriptor)


def test_a_corrupted_stored_byte_is_detected_and_recomputed(world: World) -> None:
    """One byte of one page of the prompt's objects (the server hands out free pages in
    order, so A's objects for this prompt lie in the pages it took while storing it)."""
    pages = world.pages_of["corrupt"]
    assert len(pages) >= PAGES_PER_PROMPT
    with ServerStore(world.socket) as store:
        corrupt_before = store.stats().corrupt_loads
    _flip_a_byte_of_server_page(world.socket, pages[len(pages) // 2])
    (output,) = world.engine_b.generate([PROMPTS["corrupt"]], NEW_TOKENS)
    assert output["tokens"] == world.reference["corrupt"], "a corrupted page was served"
    # Pages before the corrupt one may restore; it and every later one are recomputed.
    assert output["details"].get("storage", 0) < PROMPT_TOKENS - PAGE_SIZE
    with ServerStore(world.socket) as store:
        assert store.stats().corrupt_loads == corrupt_before + 1


def test_the_server_killed_mid_run_costs_hits_not_requests(world: World) -> None:
    # Killed while B serves a request: whichever step it lands in, the request completes.
    killer = threading.Timer(0.3, os.kill, (world.server.pid, signal.SIGKILL))
    killer.start()
    try:
        (during,) = world.engine_b.generate([PROMPTS["killed"]], NEW_TOKENS)
    finally:
        killer.join()
    world.server.wait(timeout=30)
    assert during["tokens"] == world.reference["killed"]
    # Its pages were stored intact by A: with the server gone they cost hits only.
    (after,) = world.engine_b.generate([PROMPTS["after_kill"]], NEW_TOKENS)
    assert after["tokens"] == world.reference["after_kill"]
    assert after["details"].get("storage", 0) == 0
    # And B keeps serving what it holds itself.
    (again,) = world.engine_b.generate([PROMPTS["restore"]], NEW_TOKENS)
    assert again["tokens"] == world.reference["restore"]


def test_a_fresh_engine_restores_through_mooncake_what_another_node_stored(
    world: World,
) -> None:
    """umbp's Mooncake mode under SGLang: the writer node's segment holds the pages, the
    reader (a fresh process, another node) finds and fetches them over TCP."""
    (output,) = world.mooncake_reader.generate([PROMPTS["mooncake"]], NEW_TOKENS)
    assert output["details"]["storage_backend"] == "UMBPHiCacheStore"
    assert PROMPT_TOKENS - 2 * PAGE_SIZE <= output["details"]["storage"] < PROMPT_TOKENS
    assert output["tokens"] == world.reference["mooncake"]
