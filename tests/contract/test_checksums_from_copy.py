"""`ChecksumsFromCopy` on a real Mooncake Store: a put stores the checksum its caller's
copy computed (the trailer is what the caller said, never recomputed), and an unchecked
get is settled only by the checksums of the caller's copy out of its buffers; both for
objects Mooncake moves straight from and into registered memory and for objects staged
through the bounce buffer. Then a worker's staged stores and restores over that store:
the copies between the KV blocks and the registered staging rows compute the checksums,
and a corrupt object still fails its block only."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from tests.contract.conftest import Backend
from umbp.runtime.contract import ChecksumsFromCopy, LoadStatus

HIT, MISSING, CORRUPT, UNAVAILABLE = (LoadStatus.HIT, LoadStatus.MISSING,
                                      LoadStatus.CORRUPT, LoadStatus.UNAVAILABLE)
DIRECT = 300_000  # above the stage_below default: straight from registered memory
STAGED = 40_000  # staged through the bounce buffer with its trailer

pytestmark = pytest.mark.parametrize("backend", ["mooncake"], indirect=True)


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def xxh3(data: bytes | bytearray | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


@pytest.fixture
def registered(backend: Backend) -> Iterator[np.ndarray]:
    """Four rows of DIRECT bytes the store has registered (as a worker's staging)."""
    rows = np.zeros((4, DIRECT), dtype=np.uint8)
    backend.store.register_host_memory(rows.ctypes.data, rows.nbytes)
    yield rows
    backend.store.unregister_host_memory(rows.ctypes.data)


def test_mooncake_takes_checksums_from_the_copy(backend: Backend) -> None:
    assert isinstance(backend.store, ChecksumsFromCopy)


@pytest.mark.parametrize("size", [DIRECT, STAGED])
def test_a_put_stores_the_checksum_it_is_given(
    backend: Backend, registered: np.ndarray, size: int
) -> None:
    """The right checksum: read back HIT and intact. A wrong one: the object's own
    checksum check then fails (CORRUPT): the trailer is the caller's, not recomputed."""
    store = backend.store
    good, bad = content(1, size), content(2, size)
    registered[0, :size] = np.frombuffer(good, np.uint8)
    registered[1, :size] = np.frombuffer(bad, np.uint8)
    payloads = [registered[0, :size], registered[1, :size]]
    assert store.put_batch_checksummed(["good", "bad"], payloads,
                                       [xxh3(good), xxh3(bad) ^ 1]) == (True, True)
    outs = [bytearray(size), bytearray(size)]
    assert store.get_batch_into(["good", "bad"], outs) == (HIT, CORRUPT)
    assert bytes(outs[0]) == good
    assert store.lookup(["good", "bad"]) == (True, False)


def test_a_checksummed_put_needs_one_checksum_per_key(backend: Backend) -> None:
    with pytest.raises(ValueError, match="one checksum per key: 2 keys, 1 checksums"):
        backend.store.put_batch_checksummed(["a", "b"], [b"x" * 300, b"y" * 300], [7])
    assert backend.store.lookup(["a", "b"]) == (False, False), "nothing was stored"


@pytest.mark.parametrize("size", [DIRECT, STAGED])
def test_an_unchecked_get_is_settled_by_the_copys_checksums(
    backend: Backend, registered: np.ndarray, size: int
) -> None:
    """Arrived objects answer HIT until verified. The copy's checksum equal to the
    stored one: HIT (counted); another: CORRUPT and dropped; none: UNAVAILABLE and kept
    (the store reads no buffer to settle it). A missing key is final at once."""
    store = backend.store
    data = [content(seed, size) for seed in (3, 4, 5)]
    assert store.put_batch(["a", "b", "c"], data) == (True,) * 3
    before = store.stats()
    outs = [registered[row, :size] for row in range(4)]
    unchecked = store.get_batch_unchecked(["a", "b", "c", "gone"], outs)
    assert unchecked.statuses == (HIT, HIT, HIT, MISSING)
    assert [bytes(out) for out in outs[:3]] == data, "the bytes arrived as stored"
    final = unchecked.verify([xxh3(data[0]), xxh3(b"other"), None, None])
    assert final == (HIT, CORRUPT, UNAVAILABLE, MISSING)
    after = store.stats()
    assert (after.hits - before.hits, after.corrupt_loads - before.corrupt_loads) == (1, 1)
    assert store.lookup(["a", "b", "c"]) == (True, False, True)
    with pytest.raises(RuntimeError, match="verified once"):
        unchecked.verify([None] * 4)


def test_an_unchecked_get_of_a_corrupt_object_fails_it_alone(backend: Backend) -> None:
    store = backend.store
    data = [content(6, DIRECT), content(7, DIRECT)]
    assert store.put_batch(["victim", "other"], data) == (True, True)
    backend.corrupt("victim")
    outs = [bytearray(DIRECT), bytearray(DIRECT)]
    unchecked = store.get_batch_unchecked(["victim", "other"], outs)
    assert unchecked.verify([xxh3(out) for out in outs]) == (CORRUPT, HIT)
    assert bytes(outs[1]) == data[1]
    assert store.lookup(["victim", "other"]) == (False, True)


def test_an_unchecked_verify_given_another_count_is_refused(backend: Backend) -> None:
    store = backend.store
    assert store.put_batch(["a"], [content(8, STAGED)]) == (True,)
    out = bytearray(STAGED)
    unchecked = store.get_batch_unchecked(["a"], [out])
    with pytest.raises(ValueError, match="one checksum .or None. per key: 1, got 2"):
        unchecked.verify([None, None])
    assert unchecked.verify([xxh3(out)]) == (HIT,)  # the refused call settled nothing


# -- a worker's staged copies ---------------------------------------------------------


def _staged_context(device: Any, store: Any, kv: list[torch.Tensor]) -> Any:
    """A worker's transfers through a staging ring the store has registered."""
    from tests.unit.test_layer_loads import context
    from umbp.gpu.staging import StagingRing

    ring = StagingRing(1 << 20)
    store.register_host_memory(ring.address, ring.nbytes)
    return context(device, store, kv, ring)


class _Recording:
    """The store, each checksummed put's checksums and each unchecked verify's recorded."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.put: list[list[int]] = []
        self.verified: list[Any] = []

    def put_batch_checksummed(self, keys: Any, payloads: Any, checksums: Any) -> Any:
        self.put.append(list(checksums))
        return self.store.put_batch_checksummed(keys, payloads, checksums)

    def get_batch_unchecked(self, keys: Any, outs: Any) -> Any:
        from umbp.runtime.contract import UncheckedObjects

        unchecked = self.store.get_batch_unchecked(keys, outs)

        def verify(copied: Any = None) -> Any:
            self.verified.append(copied)
            return unchecked.verify(copied)

        return UncheckedObjects(unchecked.statuses, verify)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_worker_stores_and_restores_through_staging_with_its_copies_checksums(
    backend: Backend,
) -> None:
    from tests.unit.test_in_place_copies_hash import objects_of
    from tests.unit.test_layer_loads import BLOCK, KEYSPACE, LAYERS, RANK, kv_layers
    from umbp.core.plans import GroupBlocks, LoadPlan, StorePlan
    from umbp.core.stores.acks import StoreEventResult
    from umbp.gpu.device import HostDevice
    from umbp.runtime.paged_copy import native_kernel
    from umbp.shell.loads import LayerwiseLoad
    from umbp.shell.stores import StoreQueue

    if native_kernel() != "avx2":
        pytest.skip("copies hash as they move only where the native loop runs AVX2")
    device = HostDevice()
    source = kv_layers(11)
    recording = _Recording(backend.store)
    hashes = [bytes([i]) * 4 for i in range(3)]
    ctx = _staged_context(device, recording, source)
    results: list[StoreEventResult] = []
    done = threading.Event()
    queue = StoreQueue(ctx, 1 << 30, ctx.store_lane,
                       lambda _, result: (results.append(result), done.set()))
    queue.add(1, [StorePlan("r", (GroupBlocks(0, BLOCK, (0, 1, 2), tuple(hashes)),))],
              frozenset())
    queue.submit(ctx.forward_mark())
    assert done.wait(30)
    assert results == [StoreEventResult(1, frozenset())]
    originals = objects_of(source, (0, 1, 2))
    assert recording.put == [[xxh3(data) for data in originals]]
    backend.corrupt(KEYSPACE.key(RANK, 0, hashes[1]))

    kv = [torch.zeros_like(layer) for layer in source]
    restore = _staged_context(device, recording, kv)
    plan = LoadPlan("r", (GroupBlocks(0, BLOCK, (4, 5, 6, 7),
                                      (hashes[0], hashes[1], b"gone", hashes[2])),))
    loads = LayerwiseLoad([plan], restore, restore.forward_mark(), {0: LAYERS},
                          mid_block=False)
    loads.start()
    for layer in range(LAYERS):
        loads.wait_layer(0, layer)
    (outcome,) = loads.outcomes()
    (group,) = outcome.groups
    assert group.loaded_block_ids == (4, 7)
    assert dict(zip(group.failed_block_ids, group.failures)) == {
        5: CORRUPT, 6: MISSING}
    (copied,) = recording.verified
    assert copied is not None and copied[0] == xxh3(originals[0]) and copied[2] is None
    assert objects_of(kv, (4, 7)) == [originals[0], originals[2]]
    assert loads.poll(wait=True)
    for used in (ctx, restore):
        backend.store.unregister_host_memory(used.ring.address)
        used.ring.close()
    device.close()
