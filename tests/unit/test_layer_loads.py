"""A step's synchronous loads over a real embedded pool and real block copiers
(umbp/shell/layer_loads.py, umbp/shell/group_io.py): objects the pool lends are
scattered layer by layer straight from its pages and verified when the read settles;
whatever goes wrong, every block ends loaded or reported failed, and no loan stays
pinned."""

from __future__ import annotations

import pytest
import torch

from umbp.core.identity import KeySpace, RankCoord, RankTopology
from umbp.core.loads.outcomes import LoadStatus
from umbp.core.plans import GroupBlocks, LoadPlan
from umbp.gpu.copier import BlockCopier
from umbp.runtime.pool import SlabPool
from umbp.shell.group_io import GroupIO
from umbp.shell.layer_loads import LayerwiseLoads

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
    rows = torch.empty(len(hashes), copier.object_bytes, dtype=torch.uint8)
    copier.gather(list(range(len(hashes))), rows)
    keys = [KEYSPACE.key(RANK, 0, block_hash) for block_hash in hashes]
    assert all(pool.put_batch(keys, [rows[i].numpy() for i in range(len(hashes))]))
    return copier.object_bytes


def loads_into(pool: SlabPool, kv: list[torch.Tensor], plan: LoadPlan) -> LayerwiseLoads:
    io = GroupIO({0: BlockCopier(kv, NUM_BLOCKS)}, lambda: pool, KEYSPACE, RANK,
                 (lambda _: None, lambda _: None))
    return LayerwiseLoads([plan], io, {0: LAYERS})


def test_lent_objects_restore_every_layer_bit_exact_and_a_corrupt_one_fails_its_block() -> None:
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
    loads = loads_into(pool, kv, LoadPlan("r", (GroupBlocks(0, BLOCK, (5, 2, 7), tuple(hashes)),)))
    loads.run()
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


@pytest.mark.parametrize("bad_block", [NUM_BLOCKS, -1])
def test_a_scatter_that_raises_fails_every_block_and_releases_the_loan(bad_block: int) -> None:
    """A block id the copier refuses (a plan breaking its contract) raises inside the
    lane's job: every block of the read is reported failed, never loaded, the layer
    waits still return, and the lent objects are unpinned (a full pool evicts them)."""
    source = kv_layers(2)
    hashes = [bytes([i]) * 4 for i in range(2)]
    pool = SlabPool(4 * 4096, page_bytes=4096, high_watermark=1.0, low_watermark=0.5)
    stored(pool, source, hashes)
    kv = [torch.zeros_like(layer) for layer in source]
    loads = loads_into(pool, kv, LoadPlan("r", (GroupBlocks(0, BLOCK, (1, bad_block),
                                                            tuple(hashes)),)))
    with pytest.raises(IndexError):
        loads.run()
    for layer in range(LAYERS):
        loads.wait_layer(0, layer)
    (outcome,) = loads.outcomes()
    assert outcome.failed_block_ids == frozenset({1, bad_block})
    assert not any(group.loaded_block_ids for group in outcome.groups)
    filler = torch.zeros(4096, dtype=torch.uint8).numpy()
    assert pool.put_batch([f"x{i}" for i in range(4)], [filler] * 4) == (True,) * 4
    assert pool.lookup([KEYSPACE.key(RANK, 0, block_hash) for block_hash in hashes]) == (
        False, False)
