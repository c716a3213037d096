"""Batches beyond what `umbp serve` takes in one request, through a real server.

The server refuses a request of more than 65,536 keys or a body over 16 MiB
(`umbp.runtime.server.schema`); `ServerStore` sends a longer batch as several requests.
Before it did, a 70,000-key lookup raised `StoreUnavailable` and a 70,000-key put
answered False for every key. Here each kind of call crosses both limits and every key
answers for itself, in order, with its own bytes.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.integration.harness import server_events
from umbp.runtime.contract import LoadStatus, Medium
from umbp.runtime.server import ServerStore, protocol
from umbp.runtime.server.launch import start_server, stop_server
from umbp.runtime.server.schema import MAX_BATCH, MAX_KEY_BYTES, body_limit

pytestmark = pytest.mark.integration

OBJECTS = 70_000
OBJECT_BYTES = 64


@pytest.fixture(scope="module")
def store() -> Iterator[ServerStore]:
    """A server with 64-byte pages, room for 131,072 small objects."""
    directory = Path(tempfile.mkdtemp(prefix="umbp-batch-", dir="/tmp"))
    socket_path = str(directory / "umbp.sock")
    log = directory / "serve.log"
    process = start_server(socket_path, 8 << 20, page_bytes=64, log_path=str(log))
    client = ServerStore(socket_path, io_timeout_s=60.0)
    try:
        events = server_events(log, "populated")
        assert [event["bytes"] for event in events] == [8 << 20]  # its start-up, logged
        for _ in range(300):  # then its pages made present in the background, logged
            if '{"event": "present", "bytes": 8388608' in log.read_text():
                break
            time.sleep(0.1)
        assert '{"event": "present", "bytes": 8388608' in log.read_text()
        yield client
    finally:
        client.close()
        stop_server(process, socket_path)
        shutil.rmtree(directory, ignore_errors=True)


def payloads(count: int) -> np.ndarray:
    """Row i: 64 bytes that spell i (every object different, so a misplaced answer
    shows)."""
    rows = np.zeros((count, OBJECT_BYTES), dtype=np.uint8)
    rows[:, :8] = np.arange(count, dtype="<u8").view(np.uint8).reshape(count, 8)
    rows[:, 8:] = (np.arange(count) % 251).astype(np.uint8)[:, None]
    return rows


def test_a_put_and_get_of_more_keys_than_a_request_takes(store: ServerStore) -> None:
    assert OBJECTS > MAX_BATCH
    assert store.clear()
    keys = [f"batch:{index:08d}" for index in range(OBJECTS)]
    rows = payloads(OBJECTS)
    assert store.put_batch(keys, list(rows)) == (True,) * OBJECTS
    assert store.stats().objects == OBJECTS

    # Every other object read back, among as many keys nobody stored.
    asked = [key if index % 2 else f"absent:{index:08d}" for index, key in enumerate(keys)]
    outs = np.zeros_like(rows)
    statuses = store.get_batch_into(asked, list(outs))
    expected = [LoadStatus.HIT if index % 2 else LoadStatus.MISSING for index in range(OBJECTS)]
    assert statuses == tuple(expected)
    assert np.array_equal(outs[1::2], rows[1::2])
    assert not outs[0::2].any(), "a miss must not touch its buffer"

    lookup = store.lookup(asked + keys)
    assert lookup == tuple(index % 2 == 1 for index in range(OBJECTS)) + (True,) * OBJECTS
    assert store.where(asked) == tuple(
        Medium.CPU if index % 2 else None for index in range(OBJECTS)
    )


def test_a_lookup_of_long_keys_over_the_body_limit(store: ServerStore) -> None:
    """Few keys but long ones in JSON: 480 two-byte characters (960 UTF-8 bytes, the
    longest key there is) escape to 2,882 bytes each, so 6,000 of them need 17 MB, more
    than one request's body may hold."""
    assert store.clear()
    keys = [f"{index:06d}" + "é" * (MAX_KEY_BYTES // 2 - 3) for index in range(6_000)]
    assert all(len(key.encode()) == MAX_KEY_BYTES for key in keys)
    assert len(protocol.encode_json(protocol.LOOKUP, {"keys": keys})) > body_limit(
        protocol.LOOKUP
    )
    stored = keys[::1_000] + keys[-1:]
    assert store.put_batch(stored, [b"x"] * len(stored)) == (True,) * len(stored)
    assert store.lookup(keys) == tuple(key in stored for key in keys)
