"""A step's synchronous loads over a real embedded pool and real block copiers on the
host device (umbp/shell/loads.py, umbp/shell/store_io.py): objects the pool lends are
copied layer by layer straight from its pages and verified beside the copies; whatever
goes wrong, every block ends loaded or reported failed, and no loan stays pinned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from umbp.core.identity import KeySpace, RankCoord, RankTopology
from umbp.core.loads.outcomes import LoadStatus
from umbp.core.plans import GroupBlocks, LoadPlan
from umbp.gpu.copier import BlockCopier
from umbp.gpu.device import HostDevice
from umbp.gpu.lanes import Lane
from umbp.gpu.staging import StagingRing
from umbp.runtime.pool import SlabPool
from umbp.shell.loads import LayerwiseLoad
from umbp.shell.store_io import StoreAccess
from umbp.shell.transfer_context import TransferContext

LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM = 3, 8, 4, 2, 8
KEYSPACE = KeySpace("ns", RankTopology())
RANK = RankCoord()


def kv_layers(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=generator)
            for _ in range(LAYERS)]


def stored(pool: SlabPool, source: list[torch.Tensor], hashes: list[bytes]) -> int:
    """Put blocks 0.. of ``source`` under ``hashes``; the object size."""
    copier = BlockCopier(source, NUM_BLOCKS)
    rows = np.empty((len(hashes), copier.object_bytes), dtype=np.uint8)
    copier.gather(list(range(len(hashes))), rows)
    keys = [KEYSPACE.key(RANK, 0, block_hash) for block_hash in hashes]
    assert all(pool.put_batch(keys, [rows[i] for i in range(len(hashes))]))
    return copier.object_bytes


def context(
    device: HostDevice, pool: SlabPool, kv: list[torch.Tensor], ring: StagingRing | None = None
) -> TransferContext:
    """Copies in place, or through ``ring`` (staging) where one is given."""
    lane = Lane("test-io")
    return TransferContext(
        device=device, access=StoreAccess(lambda: pool, KEYSPACE, RANK), ring=ring,
        layer_load_stream=device.new_stream("test-layer-load"),
        async_load_stream=device.new_stream("test-async-load"),
        store_stream=device.new_stream("test-store"), io_lane=lane, store_lane=lane,
        in_place=ring is None, borrow_on_lane=False,
        copiers={0: BlockCopier(kv, NUM_BLOCKS)},
    )


def load(device: HostDevice, pool: SlabPool, kv: list[torch.Tensor], plan: LoadPlan) -> LayerwiseLoad:
    ctx = context(device, pool, kv)
    loads = LayerwiseLoad([plan], ctx, ctx.forward_mark(), {0: LAYERS}, mid_block=False)
    loads.start()
    return loads


def test_lent_objects_restore_every_layer_bit_exact_and_a_corrupt_one_fails_its_block(
    device: HostDevice,
) -> None:
    source = kv_layers(1)
    hashes = [bytes([i]) * 4 for i in range(3)]
    pool = SlabPool(1 << 20, page_bytes=4096)
    object_bytes = stored(pool, source, hashes)
    assert object_bytes <= pool.page_bytes  # one page per object: the pool lends them
    (offset, _), = pool.object_regions(KEYSPACE.key(RANK, 0, hashes[1]))
    view = pool.slab_view()
    view[offset + 5] ^= 0x40
    view.release()
    kv = [torch.zeros_like(layer) for layer in source]
    loads = load(device, pool, kv, LoadPlan("r", (GroupBlocks(0, BLOCK, (5, 2, 7), tuple(hashes)),)))
    for layer in range(LAYERS):
        loads.wait_layer(0, layer)
    (outcome,) = loads.outcomes()
    (group,) = outcome.groups
    assert group.loaded_block_ids == (5, 7)
    assert (group.failed_block_ids, group.failures) == ((2,), (LoadStatus.CORRUPT,))
    for restored, original in zip(kv, source):
        assert torch.equal(restored[:, 5], original[:, 0])
        assert torch.equal(restored[:, 7], original[:, 2])
    assert pool.lookup([KEYSPACE.key(RANK, 0, hashes[1])]) == (False,)  # dropped
    assert pool.stats().hits == 2
    assert loads.poll(wait=True)


@pytest.mark.parametrize("bad_block", [NUM_BLOCKS, -1])
def test_a_plan_the_copier_refuses_fails_every_block_and_releases_the_loan(
    device: HostDevice, bad_block: int
) -> None:
    """A block id the copier refuses (a plan breaking its contract): nothing is copied,
    every block of the read is reported failed, never loaded, the layer waits still
    return, and the lent objects are unpinned (a full pool evicts them)."""
    source = kv_layers(2)
    hashes = [bytes([i]) * 4 for i in range(2)]
    pool = SlabPool(4 * 4096, page_bytes=4096, high_watermark=1.0, low_watermark=0.5)
    stored(pool, source, hashes)
    kv = [torch.zeros_like(layer) for layer in source]
    loads = load(device, pool, kv, LoadPlan("r", (GroupBlocks(0, BLOCK, (1, bad_block),
                                                              tuple(hashes)),)))
    for layer in range(LAYERS):
        loads.wait_layer(0, layer)
    (outcome,) = loads.outcomes()
    assert outcome.failed_block_ids == frozenset({1, bad_block})
    assert not any(group.loaded_block_ids for group in outcome.groups)
    assert all(not layer.any() for layer in kv)
    assert loads.poll(wait=True)
    filler = np.zeros(4096, dtype=np.uint8)
    assert pool.put_batch([f"x{i}" for i in range(4)], [filler] * 4) == (True,) * 4
    assert pool.lookup([KEYSPACE.key(RANK, 0, block_hash) for block_hash in hashes]) == (
        False, False)
