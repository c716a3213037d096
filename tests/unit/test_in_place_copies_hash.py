"""On a host whose copies hash as they move (KV in host memory, the native loop's AVX2
kernel), a worker's copies in place hand the store the checksums they computed: a
store's copy commits its reservation with them, a restore's layer copies verify the loan
with them. The store then reads no page a second time; the checksums are those of the
objects' bytes, so a later read or a corrupt page is judged exactly as before."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from tests.unit.test_layer_loads import (
    BLOCK,
    KEYSPACE,
    LAYERS,
    NUM_BLOCKS,
    RANK,
    context,
    kv_layers,
    stored,
)
from umbp.core.loads.outcomes import LoadStatus
from umbp.core.plans import GroupBlocks, LoadPlan, StorePlan
from umbp.core.stores.acks import StoreEventResult
from umbp.gpu.copier import BlockCopier
from umbp.gpu.device import HostDevice
from umbp.runtime.contract import LentObjects, ReservedObjects
from umbp.runtime.paged_copy import native_kernel
from umbp.runtime.pool import SlabPool
from umbp.shell.loads import LayerwiseLoad
from umbp.shell.stores import StoreQueue

pytestmark = pytest.mark.skipif(
    native_kernel() != "avx2",
    reason="copies hash as they move only where the native loop runs its AVX2 kernel")


class Recording:
    """The pool, its loans' verify and its reservations' commit recorded."""

    def __init__(self, pool: SlabPool) -> None:
        self.pool = pool
        self.verified: list[Sequence[int | None] | None] = []
        self.committed: list[Sequence[int | None] | None] = []

    def lend(self, keys: Sequence[str], nbytes: int) -> LentObjects:
        loan = self.pool.lend(keys, nbytes)

        def verify(copied: Sequence[int | None] | None = None) -> tuple[LoadStatus, ...]:
            self.verified.append(copied)
            return loan.verify(copied)

        return LentObjects(loan.memory, loan.pages, verify, loan.release)

    def reserve(self, keys: Sequence[str], nbytes: int) -> ReservedObjects:
        reservation = self.pool.reserve(keys, nbytes)

        def commit(
            written: Sequence[bool], checksums: Sequence[int | None] | None = None
        ) -> tuple[bool, ...]:
            self.committed.append(checksums)
            return reservation.commit(written, checksums)

        return ReservedObjects(reservation.memory, reservation.pages, commit)

    def watch_lent_memory(self, watcher: Any) -> None:
        self.pool.watch_lent_memory(watcher)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def objects_of(kv: list[torch.Tensor], block_ids: Sequence[int]) -> list[bytes]:
    copier = BlockCopier(kv, NUM_BLOCKS)
    rows = np.empty((len(block_ids), copier.object_bytes), dtype=np.uint8)
    copier.gather(list(block_ids), rows)
    return [bytes(row) for row in rows]


def test_a_store_commits_with_the_checksums_its_copy_computed(device: HostDevice) -> None:
    source = kv_layers(7)
    recording = Recording(SlabPool(1 << 20, page_bytes=512))  # objects across pages
    hashes = [b"s1", b"s3"]
    results: list[StoreEventResult] = []
    done = threading.Event()
    ctx = context(device, recording, source)  # type: ignore[arg-type]
    queue = StoreQueue(ctx, 1 << 30, ctx.store_lane,
                       lambda _, result: (results.append(result), done.set()))
    queue.add(1, [StorePlan("r", (GroupBlocks(0, BLOCK, (1, 3), tuple(hashes)),))],
              frozenset())
    queue.submit(ctx.forward_mark())
    assert done.wait(30)
    assert results == [StoreEventResult(1, frozenset())]
    expected = objects_of(source, (1, 3))
    assert recording.committed == [[xxhash.xxh3_64_intdigest(data) for data in expected]]
    keys = [KEYSPACE.key(RANK, 0, block_hash) for block_hash in hashes]
    outs = [bytearray(len(data)) for data in expected]
    assert recording.pool.get_batch_into(keys, outs) == (LoadStatus.HIT,) * 2
    assert [bytes(out) for out in outs] == expected


def test_a_restore_verifies_its_loan_with_the_checksums_its_layer_copies_computed(
    device: HostDevice,
) -> None:
    source = kv_layers(8)
    pool = SlabPool(1 << 20, page_bytes=512)
    hashes = [bytes([i]) * 4 for i in range(3)]
    stored(pool, source, hashes)
    (offset, _), *_ = pool.object_regions(KEYSPACE.key(RANK, 0, hashes[2]))
    view = pool.slab_view()
    view[offset + 9] ^= 0x20  # the third object corrupt in the pool
    view.release()
    recording = Recording(pool)
    kv = [torch.zeros_like(layer) for layer in source]
    ctx = context(device, recording, kv)  # type: ignore[arg-type]
    plan = LoadPlan("r", (GroupBlocks(0, BLOCK, (4, 6, 2, 0),
                                      (hashes[0], b"gone", hashes[1], hashes[2])),))
    loads = LayerwiseLoad([plan], ctx, ctx.forward_mark(), {0: LAYERS}, mid_block=False)
    loads.start()
    for layer in range(LAYERS):
        loads.wait_layer(0, layer)
    (outcome,) = loads.outcomes()
    (group,) = outcome.groups
    assert group.loaded_block_ids == (4, 2)
    assert dict(zip(group.failed_block_ids, group.failures)) == {
        6: LoadStatus.MISSING, 0: LoadStatus.CORRUPT}
    originals = objects_of(source, (0, 1, 2))
    (copied,) = recording.verified
    assert copied is not None
    assert copied[:3] == [xxhash.xxh3_64_intdigest(originals[0]), None,
                          xxhash.xxh3_64_intdigest(originals[1])]
    assert copied[3] != xxhash.xxh3_64_intdigest(originals[2])  # what the copy read
    assert objects_of(kv, (4, 2)) == originals[:2]
    assert loads.poll(wait=True)
