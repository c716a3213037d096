"""A prefix the server holds only on its SSD tier, restored by vLLM's real Scheduler
with synchronous loads (read inside the engine step): the lookup starts bringing its
objects into DRAM, the request waits (vLLM is told "not yet") until they are there,
and the load then reads DRAM only; the restored blocks hold what was computed."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_scheduler_at_scale import (
    BLOCK,
    first_schedule,
    long_model_dir,  # noqa: F401 - the fixture
    prompt,
    stored_once,
)
from tests.unit.vllm_driver import LAYERS
from umbp.core.identity import namespace_key_prefix
from umbp.runtime.server import ServerStore
from umbp.runtime.server.launch import start_server, stop_server

pytestmark = pytest.mark.vllm_versions

PAGE = 512
DRAM = 256 * PAGE


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    directory = Path(tempfile.mkdtemp(prefix="umbp-prefetch-", dir="/tmp"))
    socket_path = str(directory / "umbp.sock")
    process = start_server(socket_path, DRAM, page_bytes=PAGE, ssd_dir=str(directory / "ssd"),
                           ssd_capacity_bytes=64 << 20, log_path=str(directory / "serve.log"))
    try:
        yield socket_path
    finally:
        stop_server(process, socket_path)
        shutil.rmtree(directory, ignore_errors=True)


def push_namespace_to_ssd(endpoint: str, namespace: str, object_bytes: int) -> None:
    """Newer objects of the same namespace fill DRAM twice over: its older ones (the
    prefix) are its least recently used, so they move to SSD."""
    filler = [f"{namespace_key_prefix(namespace)}tp0:pcp0:dcp0:pp0:g0:{serial:032x}"
              for serial in range(2 * DRAM // object_bytes)]
    with ServerStore(endpoint) as store:
        payload = memoryview(bytes(object_bytes))
        for start in range(0, len(filler), 16):
            store.put_batch(filler[start:start + 16], [payload] * len(filler[start:start + 16]))


def test_an_ssd_resident_prefix_is_prefetched_at_lookup_and_restored_from_dram(
    server: str, long_model_dir: Path,  # noqa: F811 - the fixture
) -> None:
    blocks = 8
    tokens = prompt(blocks * BLOCK + 5, seed=4242)
    driver = stored_once(server, long_model_dir, tokens)
    try:
        with ServerStore(server) as store:
            (row,) = [r for r in store.namespaces() if r["puts"] == blocks]
            object_bytes = store.server_stats()["counters"]["bytes_written"] // blocks
        push_namespace_to_ssd(server, row["namespace"], object_bytes)
        with ServerStore(server) as store:
            before = store.server_stats()["counters"]
            (row,) = [r for r in store.namespaces() if r["namespace"] == row["namespace"]]
            assert row["ssd"]["objects"] >= blocks, "the prefix went to SSD"
        assert driver.scheduler.reset_prefix_cache()

        driver.add("b", tokens, max_tokens=2)
        assert first_schedule(driver, "b") == blocks * BLOCK, "every block restored"
        assert driver.blocks_hold("b", tokens, 0, blocks, 0) == blocks * len(LAYERS)
        driver.run(["b"])
        driver.drain()
        stats = driver.connector_stats()
        assert stats["worker_loaded_blocks"] == blocks
        assert stats["scheduler_prefetch_waits"] == 1, "vLLM was told 'not yet', then waited"
        with ServerStore(server) as store:
            after = store.server_stats()["counters"]
        assert after["prefetched"] - before["prefetched"] == blocks
        assert after["hits_from_ssd"] == before["hits_from_ssd"], "the load read DRAM only"
    finally:
        driver.close()
