"""The back-end registry of the contract suite: one entry per back-end.

`BACKENDS` maps a name to a factory that builds a `Backend` for one test; the `backend`
fixture is parametrized over its keys, so every test in test_store_contract.py runs
unchanged against each back-end. Adding a back-end is one entry: a factory that opens a
store (starting whatever session resources it needs through `request.getfixturevalue`),
opens further clients of the same data, and corrupts a stored object in place.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.mooncake_master import running_master
from umbp.runtime import SlabPool
from umbp.testing.faults import flip_pool_objects

MIB = 1 << 20
POOL_BYTES = 64 * MIB
"""Room in each back-end under test: the oversize test stores one object larger than it."""


@dataclass
class Backend:
    """One back-end as the suite sees it."""

    name: str
    store: Any
    """The store under test (a fresh client, emptied)."""
    open_client: Callable[[], Any]
    """Another handle on the same objects (a new client where the back-end has clients).
    The suite closes what it opens, so back-ends without clients hand out a non-closing
    wrapper."""
    corrupt: Callable[[str], None]
    """Flip one stored byte of the object under this key, behind the store's back."""
    oversize_bytes: int
    """An object of this size is rejected (larger than any single place it could go)."""
    cleanups: list[Callable[[], None]] = field(default_factory=list)


BackendFactory = Callable[[pytest.FixtureRequest], Backend]


# ------------------------------------------------------------------ embedded


class _Unclosable:
    """The same SlabPool under another name: a 'second client' of an embedded pool is the
    pool itself, and closing it must not close the original."""

    def __init__(self, pool: SlabPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def close(self) -> None:
        pass


def _embedded(request: pytest.FixtureRequest) -> Backend:
    pool = SlabPool(POOL_BYTES, page_bytes=64 << 10)

    def corrupt(key: str) -> None:
        flip_pool_objects(pool, [key])

    return Backend(
        "embedded", pool, lambda: _Unclosable(pool), corrupt, POOL_BYTES + 1, [pool.close]
    )


# ------------------------------------------------------------------ mooncake


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[Any]:
    """A real mooncake_master on loopback, shared by the session's Mooncake tests."""
    for master in running_master():
        yield master
        store = _MOONCAKE_STORES.pop(master.address, None)
        if store is not None:
            store.close()


_MOONCAKE_STORES: dict[str, Any] = {}
"""The store under test, reused from test to test: closing a Mooncake client takes 1-2 s
(its transfer engine winds down), which would dominate the suite. A test that closes it
gets a fresh one next time; `backend` empties it before every test."""


def open_mooncake(master_address: str, segment_bytes: int = POOL_BYTES) -> Any:
    from umbp.runtime.mooncake.store import MooncakeStore

    # A bounce buffer smaller than the large-batch tests, so that they cut batches into
    # several Mooncake calls; objects above it take the per-call registration path.
    return MooncakeStore(
        master_address,
        local_hostname="127.0.0.1",
        global_segment_bytes=segment_bytes,
        local_buffer_bytes=16 * MIB,
    )


def _mooncake(request: pytest.FixtureRequest) -> Backend:
    master = request.getfixturevalue("mooncake_master")
    store = _MOONCAKE_STORES.get(master.address)
    if store is None or store.closed:
        store = _MOONCAKE_STORES[master.address] = open_mooncake(master.address)

    def open_client() -> Any:
        return open_mooncake(master.address, segment_bytes=0)

    def corrupt(key: str) -> None:
        """Flip the first stored byte where Mooncake keeps it: the replica descriptor gives
        the address inside a segment. Only clients of this process mount segments on the
        session master (tests with other processes start masters of their own), so that
        address is ours."""
        replicas = store.raw_client.batch_get_replica_desc([key])[key]
        descriptor = replicas[0].get_memory_descriptor().buffer_descriptor
        assert descriptor.transport_endpoint.startswith("127.0.0.1:")
        byte = ctypes.c_ubyte.from_address(descriptor.buffer_address)
        byte.value ^= 0xFF

    return Backend("mooncake", store, open_client, corrupt, POOL_BYTES + MIB)


# ------------------------------------------------------------------ mori (fake)


def _mori(request: pytest.FixtureRequest) -> Backend:
    """MoriStore, unchanged, over umbp.testing.fake_mori in the distributed deployment
    (clients of one address share objects) and the 1.2.4 flavour, whose clear() defect
    the adapter must work around: `backend` clears before every test."""
    from umbp.runtime.mori.store import MoriStore
    from umbp.testing.fake_mori import corrupt_object, make_module

    module = make_module("1.2.4")

    def open_store() -> Any:
        return MoriStore(
            "distributed",
            "fake-umbp-master:7000",
            POOL_BYTES,
            staging_bytes=16 * MIB,
            module=module,
        )

    store = open_store()
    return Backend(
        "mori",
        store,
        open_store,
        lambda key: corrupt_object(store.raw_client, key),
        POOL_BYTES + 1,
        [store.close],
    )


# ------------------------------------------------------------------ server


@pytest.fixture(scope="session")
def umbp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `umbp serve` process (DRAM tier only), shared by the session's tests."""
    from umbp.runtime.server.launch import start_server

    endpoint = str(tmp_path_factory.mktemp("contract-server") / "umbp.sock")
    process = start_server(endpoint, POOL_BYTES)
    yield endpoint
    process.terminate()
    process.wait()


class _RemembersPayloads:
    """A ServerStore that remembers the start of each payload it put, so that `corrupt`
    can find the object's bytes in the server's shared-memory pool file."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.starts: dict[str, bytes] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put_batch(self, keys: Any, payloads: Any) -> Any:
        for key, payload in zip(keys, payloads):
            self.starts[key] = bytes(memoryview(payload).cast("B")[:4096])
        return self._store.put_batch(keys, payloads)


def _server(request: pytest.FixtureRequest) -> Backend:
    from pathlib import Path

    from umbp.runtime.server.client import ServerStore

    endpoint = request.getfixturevalue("umbp_server")
    store = _RemembersPayloads(ServerStore(endpoint, io_timeout_s=5.0))

    def corrupt(key: str) -> None:
        pool_file = Path(store.server_stats()["server"]["shm_path"])
        image = pool_file.read_bytes()
        offset = image.index(store.starts[key]) + 100  # random 300 KB payloads: unique
        with pool_file.open("r+b") as pool:
            pool.seek(offset)
            pool.write(bytes([image[offset] ^ 0xFF]))

    def open_client() -> Any:
        return ServerStore(endpoint, io_timeout_s=5.0)

    return Backend("server", store, open_client, corrupt, POOL_BYTES + 1, [store.close])


# ------------------------------------------------------------------ the registry

BACKENDS: dict[str, BackendFactory] = {
    "embedded": _embedded,
    "mooncake": _mooncake,
    "mori": _mori,
    "server": _server,
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    built = BACKENDS[request.param](request)
    assert built.store.clear(), f"{built.name}: could not empty the store before the test"
    try:
        yield built
    finally:
        for cleanup in reversed(built.cleanups):
            cleanup()
