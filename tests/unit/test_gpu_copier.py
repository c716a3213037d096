"""BlockCopier: bit-exact copies over every KV layout vLLM hands out, carried out on the
host by numpy and as byte ranges (what a GPU's copy engines move), checked against each
other byte for byte.

Each case builds its KV tensors as views into one base allocation (as vLLM does), so a
"zeroed copy" is the same views over a zeroed base, and "touches no other block" is
checked byte for byte over the whole base, padding included. Byte ranges are carried
out with ``ctypes.memmove``: every address, offset and length a device would be handed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.gpu import BlockCopier, BlockCopy, LayerTensors, describe_layer, describe_layer_parts
from umbp.gpu import copier as copier_module
from umbp.runtime.paged_copy import native_kernel, pages_checksum

Build = Callable[[torch.Tensor], list[LayerTensors]]
"""Turns a uint8 base allocation into the layers of one cache group (views into it)."""


@dataclass(frozen=True)
class KvCase:
    base_bytes: int
    num_blocks: int
    build: Build


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Same memory read as bytes, for any strides (bit-exact comparisons, NaNs included)."""
    return tensor.unsqueeze(-1).view(torch.uint8)


def random_base(nbytes: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def flat_parts(layers: Sequence[LayerTensors]) -> list[torch.Tensor]:
    parts: list[torch.Tensor] = []
    for layer in layers:
        parts.extend([layer] if isinstance(layer, torch.Tensor) else list(layer))
    return parts


def manager_block(part: torch.Tensor, num_blocks: int, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of a part as vLLM's manager counts blocks (its kernel blocks
    together, when vLLM split it)."""
    layout = describe_layer(part, num_blocks)
    k = layout.kernel_blocks
    return as_bytes(part).narrow(layout.block_dim, block_id * k, k)


def expected_row(parts: Sequence[torch.Tensor], num_blocks: int, block_id: int) -> torch.Tensor:
    """The documented object format: each part's block in row-major order, concatenated."""
    return torch.cat([manager_block(part, num_blocks, block_id).reshape(-1) for part in parts])


def expected_restore(case: KvCase, source: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """A zeroed base with exactly ``block_ids`` copied from ``source`` (slow reference)."""
    expected = torch.zeros_like(source)
    src_parts = flat_parts(case.build(source))
    dst_parts = flat_parts(case.build(expected))
    for src, dst in zip(src_parts, dst_parts, strict=True):
        for block_id in block_ids:
            manager_block(dst, case.num_blocks, block_id).copy_(
                manager_block(src, case.num_blocks, block_id))
    return expected


def rows_for(copier: BlockCopier, count: int, width: int | None = None) -> npt.NDArray[np.uint8]:
    return np.zeros((count, width or copier.object_bytes), dtype=np.uint8)


def by_ranges(copy: BlockCopy) -> int:
    """Carry a copy out from its byte ranges alone (as a device would); bytes moved."""
    ranges = copy.ranges()
    for source, destination, size in zip(
        ranges.sources.tolist(), ranges.destinations.tolist(), ranges.sizes.tolist()
    ):
        ctypes.memmove(destination, source, size)
    return ranges.nbytes


def on_host_in_python(copy: BlockCopy) -> None:
    """``run_on_host`` as an install without the native batch copy runs it (objects
    across pages moved one ``ctypes.memmove`` per range)."""
    native = copier_module._native_move_ranges
    copier_module._native_move_ranges = None
    try:
        copy.run_on_host()
    finally:
        copier_module._native_move_ranges = native


def hashing(copy: BlockCopy) -> None:
    """``run_on_host`` hashing the objects as they move (a copy of one layer hashes that
    layer's slice): the native copy loop carries the whole copy out."""
    hashes = copy.copier.hashes(len(copy.block_ids))
    assert hashes is not None or native_kernel() != "avx2" or copy.copier.object_bytes <= 240
    replace(copy, hashes=hashes).run_on_host()


Mover = Callable[[BlockCopy], object]
MOVERS: dict[str, Mover] = {"numpy": BlockCopy.run_on_host, "ranges": by_ranges,
                            "numpy_python_ranges": on_host_in_python, "hashing": hashing}


def round_trip(case: KvCase, block_ids: Sequence[int], seed: int = 0,
               move: Mover = BlockCopy.run_on_host) -> None:
    """gather, then scatter into a zeroed copy: exactly the selected blocks come back."""
    source = random_base(case.base_bytes, seed)
    copier = BlockCopier(case.build(source), case.num_blocks)
    out = rows_for(copier, len(block_ids))
    move(copier.copy(block_ids, out, to_kv=False))
    parts = flat_parts(case.build(source))
    for row, block_id in zip(out, block_ids, strict=True):
        assert np.array_equal(row, expected_row(parts, case.num_blocks, block_id).numpy())
    assert torch.equal(source, random_base(case.base_bytes, seed)), "gather wrote the KV"

    restored = torch.zeros_like(source)
    unique_ids = list(dict.fromkeys(block_ids))
    rows = out[[list(block_ids).index(block_id) for block_id in unique_ids]]
    restorer = BlockCopier(case.build(restored), case.num_blocks)
    move(restorer.copy(unique_ids, np.ascontiguousarray(rows), to_kv=True))
    assert torch.equal(restored, expected_restore(case, source, unique_ids))


# -- the layouts --------------------------------------------------------------------


def cpu_attention_case(dtype: torch.dtype, num_layers: int = 3) -> KvCase:
    """vLLM CPU: [num_blocks, heads, block_size, 2*head] per layer, layers share one buffer."""
    num_blocks, heads, block_size, head = 7, 2, 4, 6
    shape = (num_blocks, heads, block_size, 2 * head)
    layer_bytes = num_blocks * heads * block_size * 2 * head * dtype.itemsize

    def build(base: torch.Tensor) -> list[LayerTensors]:
        return [
            base[i * layer_bytes : (i + 1) * layer_bytes].view(dtype).view(shape)
            for i in range(num_layers)
        ]

    return KvCase(num_layers * layer_bytes, num_blocks, build)


def kv_leading_case(dtype: torch.dtype = torch.float16) -> KvCase:
    """CUDA FlashAttention: [2, num_blocks, block_size, heads, head] (K/V leading)."""
    num_blocks, block_size, heads, head = 5, 3, 2, 4
    shape = (2, num_blocks, block_size, heads, head)
    layer_bytes = 2 * num_blocks * block_size * heads * head * dtype.itemsize

    def build(base: torch.Tensor) -> list[LayerTensors]:
        return [
            base[i * layer_bytes : (i + 1) * layer_bytes].view(dtype).view(shape) for i in (0, 1)
        ]

    return KvCase(2 * layer_bytes, num_blocks, build)


def mamba_page(
    base: torch.Tensor, num_blocks: int, state_bytes: int, page: int, offset: int
) -> torch.Tensor:
    """Raw int8 Mamba page view: [num_blocks, 1, 1, state_bytes], block stride = page."""
    return base.view(torch.int8).as_strided(
        (num_blocks, 1, 1, state_bytes), (page, state_bytes, state_bytes, 1), offset
    )


def mamba_case() -> KvCase:
    num_blocks, state_bytes, page = 6, 40, 128

    def build(base: torch.Tensor) -> list[LayerTensors]:
        return [
            mamba_page(base, num_blocks, state_bytes, page, layer * num_blocks * page)
            for layer in (0, 1)
        ]

    return KvCase(2 * num_blocks * page, num_blocks, build)


def mamba_list_case() -> KvCase:
    """A layer handed as a list (conv state, ssm state) inside one padded page."""
    num_blocks, page = 4, 256

    def build(base: torch.Tensor) -> list[LayerTensors]:
        conv = mamba_page(base, num_blocks, 24, page, 0)
        ssm = (
            base[32:]
            .view(torch.int8)
            .as_strided((num_blocks, 3, 10), (page, 10, 1), 0)
            .view(torch.int8)
        )
        return [[conv, ssm]]

    return KvCase(num_blocks * page, num_blocks, build)


def kernel_split_case() -> KvCase:
    """vLLM 0.33 splitting each 16-token block into 4 kernel blocks of 4 tokens (a
    back-end's ``kernel_block_sizes``): ``[2, num_blocks * 4, 4, heads, head]``; the
    issue's crash was ``[2, 40, 16, 2, 8]`` with num_blocks=10."""
    num_blocks, kernels, tokens, heads, head = 5, 4, 4, 2, 8
    shape = (2, num_blocks * kernels, tokens, heads, head)
    layer_bytes = 2 * num_blocks * kernels * tokens * heads * head * 2

    def build(base: torch.Tensor) -> list[LayerTensors]:
        return [base[i * layer_bytes : (i + 1) * layer_bytes].view(torch.bfloat16).view(shape)
                for i in (0, 1)]

    return KvCase(2 * layer_bytes, num_blocks, build)


CASES = {
    "float32": cpu_attention_case(torch.float32),
    "bfloat16": cpu_attention_case(torch.bfloat16),
    "float16": cpu_attention_case(torch.float16),
    "mamba_int8_pages": mamba_case(),
    "mamba_list_layer": mamba_list_case(),
    "kv_leading": kv_leading_case(),
    "kernel_blocks": kernel_split_case(),
}


def staged_blocks(case: KvCase, seed: int) -> tuple[torch.Tensor, list[int], npt.NDArray[np.uint8]]:
    """Random KV, three of its blocks (last, first, third) and their objects staged."""
    source = random_base(case.base_bytes, seed=seed)
    block_ids = [case.num_blocks - 1, 0, 2]
    copier = BlockCopier(case.build(source), case.num_blocks)
    rows = rows_for(copier, len(block_ids))
    copier.gather(block_ids, rows)
    return source, block_ids, rows


@pytest.mark.parametrize("mover", sorted(MOVERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_restores_exactly_the_selected_blocks(name: str, mover: str) -> None:
    case = CASES[name]
    round_trip(case, [3, 0, case.num_blocks - 1], move=MOVERS[mover])


@pytest.mark.parametrize("mover", sorted(MOVERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_by_layer_loads_make_the_whole_load_and_touch_only_their_layer(
    name: str, mover: str
) -> None:
    """A layer-wise restore (one copy per layer, each a slice of the staged objects)
    ends where one whole copy ends; before the last layer, the layers not yet copied
    are untouched, byte for byte; the bytes moved per layer add up to the objects."""
    case = CASES[name]
    source, block_ids, rows = staged_blocks(case, seed=3)
    restored = torch.zeros_like(source)
    restorer = BlockCopier(case.build(restored), case.num_blocks)
    assert restorer.num_layers == len(case.build(restored))
    layers = case.build(restored)
    moved = 0
    for layer in range(restorer.num_layers):
        copy = restorer.copy(block_ids, rows, to_kv=True, layer=layer)
        MOVERS[mover](copy)
        moved += copy.nbytes
        later = flat_parts(layers[layer + 1:])
        assert all(not as_bytes(part).any() for part in later), "a later layer was written"
    assert moved == len(block_ids) * restorer.object_bytes
    assert torch.equal(restored, expected_restore(case, source, block_ids))
    with pytest.raises(IndexError, match="layer"):
        restorer.copy(block_ids, rows, to_kv=True, layer=restorer.num_layers)


@pytest.mark.parametrize("mover", sorted(MOVERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_in_any_order_of_wider_memory_copy_like_staged_rows(name: str, mover: str) -> None:
    """Objects lying in wider rows in any order (a pool's pages lent or reserved in
    place) restore the blocks exactly as the same objects staged row by row, whole or
    one layer at a time, and gather into exactly those rows."""
    case = CASES[name]
    source, block_ids, staged = staged_blocks(case, seed=5)
    object_bytes = int(staged.shape[1])
    page_bytes = -(-object_bytes // 64) * 64 + 64  # wider than an object
    pages = np.random.default_rng(1).integers(0, 256, (7, page_bytes), dtype=np.uint8)
    pages_before = pages.copy()
    lent_rows = [5, 1, 3]
    for row, page in enumerate(lent_rows):
        pages[page, :object_bytes] = staged[row]
    whole = torch.zeros_like(source)
    MOVERS[mover](BlockCopier(case.build(whole), case.num_blocks).copy(
        block_ids, pages, lent_rows, to_kv=True))
    by_layer = torch.zeros_like(source)
    restorer = BlockCopier(case.build(by_layer), case.num_blocks)
    for layer in range(restorer.num_layers):
        MOVERS[mover](restorer.copy(block_ids, pages, lent_rows, to_kv=True, layer=layer))
    expected = expected_restore(case, source, block_ids)
    assert torch.equal(whole, expected)
    assert torch.equal(by_layer, expected)
    # Back into pages in place: exactly the objects' bytes of those rows change.
    into = pages_before.copy()
    MOVERS[mover](BlockCopier(case.build(source), case.num_blocks).copy(
        block_ids, into, lent_rows, to_kv=False))
    expected_pages = pages_before.copy()
    for row, page in enumerate(lent_rows):
        expected_pages[page, :object_bytes] = staged[row]
    assert np.array_equal(into, expected_pages)


@pytest.mark.parametrize("mover", sorted(MOVERS))
@pytest.mark.parametrize("page_fraction", [0.3, 0.5, 0.77])
@pytest.mark.parametrize("name", sorted(CASES))
def test_objects_across_pages_narrower_than_an_object_copy_bit_exact(
    name: str, page_fraction: float, mover: str
) -> None:
    """A store whose pages are smaller than an object (the server's 64 KiB pages, the
    pool with page_bytes set) lends and reserves an object as a list of pages: loads,
    layer by layer too, and stores through them move exactly the object's bytes, the
    runs cut where a page ends, and touch nothing else of the pages."""
    case = CASES[name]
    source, block_ids, staged = staged_blocks(case, seed=11)
    object_bytes = int(staged.shape[1])
    page_bytes = max(1, int(object_bytes * page_fraction))
    per_object = -(-object_bytes // page_bytes)
    order = np.random.default_rng(2).permutation(per_object * len(block_ids) + 3)
    pages = [order[i * per_object : (i + 1) * per_object].tolist() for i in range(len(block_ids))]
    memory = np.random.default_rng(3).integers(0, 256, (len(order), page_bytes), dtype=np.uint8)
    for row, owned in enumerate(pages):
        flat = np.zeros(per_object * page_bytes, np.uint8)
        flat[:object_bytes] = staged[row]
        for index, page in enumerate(owned):
            if index < per_object - 1:
                memory[page] = flat[index * page_bytes : (index + 1) * page_bytes]
            else:  # the last page holds the object's tail, the rest is another's bytes
                tail = object_bytes - index * page_bytes
                memory[page, :tail] = flat[index * page_bytes : object_bytes]
    before = memory.copy()
    restored = torch.zeros_like(source)
    restorer = BlockCopier(case.build(restored), case.num_blocks)
    for layer in range(restorer.num_layers):
        MOVERS[mover](restorer.copy(block_ids, memory, to_kv=True, layer=layer, pages=pages))
    assert torch.equal(restored, expected_restore(case, source, block_ids))
    assert np.array_equal(memory, before)
    into = np.random.default_rng(3).integers(0, 256, memory.shape, dtype=np.uint8)
    MOVERS[mover](BlockCopier(case.build(source), case.num_blocks).copy(
        block_ids, into, to_kv=False, pages=pages))
    assert np.array_equal(into, before)  # the objects' bytes, and not one byte more


needs_native_kernel = pytest.mark.skipif(
    native_kernel() != "avx2",
    reason="copies hash as they move only where the native loop runs its AVX2 kernel")


def paged_objects(
    copier: BlockCopier, count: int, page_bytes: int, seed: int
) -> tuple[npt.NDArray[np.uint8], list[list[int]]]:
    """Pages of random bytes and, per object, its pages (shuffled, never shared)."""
    per_object = -(-copier.object_bytes // page_bytes)
    order = np.random.default_rng(seed).permutation(per_object * count + 2)
    pages = [order[i * per_object : (i + 1) * per_object].tolist() for i in range(count)]
    memory = np.random.default_rng(seed + 1).integers(0, 256, (len(order), page_bytes),
                                                      dtype=np.uint8)
    return memory, pages


@needs_native_kernel
@pytest.mark.parametrize("page_fraction", [0.3, 0.77, 1.0, 2.0])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_hashing_copy_hashes_each_object_as_it_lies_in_its_pages(
    name: str, page_fraction: float
) -> None:
    """A store hashing as it copies yields, per object, the checksum of the object's
    bytes in its pages (what the store would compute reading them back); a restore
    layer by layer, its hashes fed by every layer's copy, yields them too once the
    last layer moved (None before: a checksum of part of an object checks nothing),
    and a byte changed in a page meanwhile shows in that object's checksum only."""
    case = CASES[name]
    source, block_ids, _ = staged_blocks(case, seed=21)
    copier = BlockCopier(case.build(source), case.num_blocks)
    object_bytes = copier.object_bytes
    page_bytes = max(1, int(object_bytes * page_fraction))
    memory, pages = paged_objects(copier, len(block_ids), page_bytes, seed=4)
    hashes = copier.hashes(len(block_ids))
    if object_bytes <= 240:  # xxh3's short inputs: the store hashes these apart
        assert hashes is None
        return
    assert hashes is not None
    copier.copy(block_ids, memory, to_kv=False, pages=pages, hashes=hashes).run_on_host()
    stored = [pages_checksum(memory, owned, object_bytes) for owned in pages]
    assert hashes.digests() == stored

    memory[pages[1][-1], (object_bytes - 1) % page_bytes] ^= 0x5A  # the object's last byte
    restored = torch.zeros_like(source)
    restorer = BlockCopier(case.build(restored), case.num_blocks)
    restore = restorer.copy(block_ids, memory, to_kv=True, pages=pages,
                            hashes=restorer.hashes(len(block_ids)))
    assert restore.hashes is not None
    for layer in range(restorer.num_layers):
        assert restore.hashes.digests() == [None] * len(block_ids)
        restore.of_layer(layer).run_on_host()
    digests = restore.hashes.digests()
    assert digests[0] == stored[0] and digests[2] == stored[2]
    assert digests[1] == pages_checksum(memory, pages[1], object_bytes) != stored[1]


def test_hashes_must_fit_the_copy() -> None:
    case = CASES["float32"]
    source, block_ids, staged = staged_blocks(case, seed=1)
    copier = BlockCopier(case.build(source), case.num_blocks)
    hashes = copier.hashes(len(block_ids) + 1)
    if hashes is None:
        pytest.skip("copies hash as they move only where the native loop runs its AVX2 kernel")
    with pytest.raises(ValueError, match="do not fit 3 objects"):
        copier.copy(block_ids, staged, to_kv=True, hashes=hashes)


def test_a_copy_of_kv_off_the_host_gets_no_hashes() -> None:
    """On a GPU the copy engines move the bytes: no CPU sees them to hash."""
    copier = BlockCopier([torch.zeros(4, 2, 64, device="meta")], 4)
    assert copier.object_bytes > 240 and copier.hashes(3) is None


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_layer_of_a_checked_copy_is_the_layer_copy_checked_on_its_own(name: str) -> None:
    """``of_layer`` (a layer-by-layer restore checks its blocks and pages once) moves
    exactly the bytes ``copy(..., layer=)`` moves, across pages too."""
    case = CASES[name]
    source, block_ids, staged = staged_blocks(case, seed=5)
    copier = BlockCopier(case.build(torch.zeros_like(source)), case.num_blocks)
    page_bytes = max(64, int(staged.shape[1]) // 3)
    per_object = -(-int(staged.shape[1]) // page_bytes)
    pages = [list(range(i * per_object, (i + 1) * per_object)) for i in range(len(block_ids))]
    memory = np.zeros((per_object * len(block_ids), page_bytes), np.uint8)
    for paged in (None, pages):
        whole = copier.copy(block_ids, memory if paged else staged, to_kv=True, pages=paged)
        for layer in range(copier.num_layers):
            alone = copier.copy(block_ids, memory if paged else staged, to_kv=True,
                                layer=layer, pages=paged).ranges()
            derived = whole.of_layer(layer).ranges()
            for field in ("sources", "destinations", "sizes"):
                assert np.array_equal(getattr(derived, field), getattr(alone, field))
        with pytest.raises(IndexError, match="out of range"):
            whole.of_layer(copier.num_layers)
        with pytest.raises(ValueError, match="already limited to layer 0"):
            whole.of_layer(0).of_layer(0)


def test_host_copies_across_pages_use_the_native_batch_copy_where_it_is_built() -> None:
    """Where the native module is built, objects across pages move in one call per copy:
    the install must have built it (a Python call per range would take the GIL back from
    the model thread 256 times a layer)."""
    from umbp.runtime import _copyhash

    assert copier_module._native_move_ranges is _copyhash.move_ranges


def test_native_batch_copy_refuses_ranges_of_different_lengths() -> None:
    from umbp.runtime import _copyhash

    source = np.arange(64, dtype=np.uint8)
    target = np.zeros(64, dtype=np.uint8)
    addresses = np.array([source.ctypes.data], dtype=np.uint64)
    with pytest.raises(ValueError, match="three uint64 arrays of one length"):
        _copyhash.move_ranges(addresses, np.array([], dtype=np.uint64),
                              np.array([64], dtype=np.uint64))
    assert not target.any()
    _copyhash.move_ranges(addresses, np.array([target.ctypes.data], dtype=np.uint64),
                          np.array([64], dtype=np.uint64))
    assert np.array_equal(target, source)


@pytest.mark.parametrize(
    ("memory", "rows", "error", "message"),
    [
        (np.zeros((4, 1152), np.uint8), [0], ValueError, "2 blocks need 2 rows, got 1"),
        (np.zeros((4, 1152), np.uint8), [0, 4], IndexError, "row 4 out of range"),
        (np.zeros((4, 1088), np.uint8), [0, 1], ValueError, "at least 1152 bytes wide"),
        (np.zeros((4, 1152), np.int8), [0, 1], ValueError, "uint8 numpy array"),
        (np.zeros((1, 1152), np.uint8), None, ValueError, "2 blocks need 2 rows"),
        (np.zeros((1152, 4), np.uint8).T, None, ValueError, "contiguous"),
    ],
)
def test_wrong_rows_are_rejected(
    memory: npt.NDArray[np.uint8], rows: list[int] | None, error: type[Exception], message: str
) -> None:
    case = cpu_attention_case(torch.float32)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    assert copier.object_bytes == 1152
    for to_kv in (True, False):
        with pytest.raises(error, match=message):
            copier.copy([0, 1], memory, rows, to_kv=to_kv)


@pytest.mark.parametrize("mover", sorted(MOVERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_of_every_block(name: str, mover: str) -> None:
    case = CASES[name]
    round_trip(case, list(reversed(range(case.num_blocks))), move=MOVERS[mover])


def test_object_is_one_block_of_every_layer_in_order() -> None:
    case = cpu_attention_case(torch.float32, num_layers=3)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    assert copier.object_bytes == 3 * 2 * 4 * 12 * 4
    assert [layout.block_bytes for layout in copier.layouts] == [384, 384, 384]


def test_kernel_blocks_fold_into_their_block() -> None:
    """The tensor of the crash: 40 kernel blocks of 10 manager blocks, block b being
    kernel blocks 4b..4b+3 (4 KiB of K and 4 KiB of V per block)."""
    kv = torch.randn(2, 40, 16, 2, 8)
    layout = describe_layer(kv, 10)
    assert (layout.block_dim, layout.kernel_blocks, layout.block_bytes) == (1, 4, 2 * 4 * 1024)
    copier = BlockCopier([kv], 10)
    rows = rows_for(copier, 1)
    copier.gather([9], rows)
    assert np.array_equal(rows[0], as_bytes(kv[:, 36:40]).reshape(-1).numpy())
    ranges = copier.copy([9], rows, to_kv=False).ranges()
    assert ranges.sizes.tolist() == [4096, 4096]  # K, then V: two runs of a block


def test_mamba_page_counts_state_bytes_not_padding() -> None:
    case = mamba_case()
    source = random_base(case.base_bytes)
    layers = case.build(source)
    assert not flat_parts(layers)[0].is_contiguous()
    assert BlockCopier(layers, case.num_blocks).object_bytes == 2 * 40


@pytest.mark.parametrize("mover", sorted(MOVERS))
def test_padding_between_mamba_states_is_never_written(mover: str) -> None:
    case = mamba_case()
    sentinel = torch.full((case.base_bytes,), 0xAB, dtype=torch.uint8)
    copier = BlockCopier(case.build(sentinel), case.num_blocks)
    ids = list(range(case.num_blocks))
    MOVERS[mover](copier.copy(ids, rows_for(copier, len(ids)), to_kv=True))
    pages = sentinel.view(2 * case.num_blocks, 128)
    assert int(pages[:, :40].count_nonzero()) == 0
    assert bool((pages[:, 40:] == 0xAB).all())


def test_empty_block_list_is_a_no_op() -> None:
    case = cpu_attention_case(torch.float32)
    source = random_base(case.base_bytes)
    before = source.clone()
    copier = BlockCopier(case.build(source), case.num_blocks)
    empty = rows_for(copier, 0)
    copier.gather([], empty)
    copier.scatter([], empty)
    assert copier.copy([], empty, to_kv=True).ranges().nbytes == 0
    assert torch.equal(source, before)


def test_gather_copies_a_duplicated_id_into_each_row() -> None:
    case = cpu_attention_case(torch.bfloat16)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    out = rows_for(copier, 3)
    copier.gather([2, 5, 2], out)
    assert np.array_equal(out[0], out[2])
    assert not np.array_equal(out[0], out[1])
    round_trip(case, [2, 5, 2])


def test_a_load_naming_a_block_twice_is_rejected() -> None:
    case = cpu_attention_case(torch.float32)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    with pytest.raises(ValueError, match="block id 1 more than once"):
        copier.copy([1, 1], rows_for(copier, 2), to_kv=True)


@pytest.mark.parametrize("bad_id", [7, 100, -1])
def test_out_of_range_id_names_the_id_and_num_blocks(bad_id: int) -> None:
    case = cpu_attention_case(torch.float32)  # num_blocks = 7
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    rows = rows_for(copier, 2)
    message = f"block id {bad_id} out of range for num_blocks=7"
    with pytest.raises(IndexError, match=message):
        copier.gather([0, bad_id], rows)
    with pytest.raises(IndexError, match=message):
        copier.scatter([bad_id, 0], rows)


def test_rows_may_be_a_slice_of_a_larger_staging_buffer() -> None:
    case = cpu_attention_case(torch.float32)
    source = random_base(case.base_bytes)
    copier = BlockCopier(case.build(source), case.num_blocks)
    staging = rows_for(copier, 5)
    copier.gather([6, 2], staging, [3, 4])
    assert np.array_equal(staging[4], expected_row(flat_parts(case.build(source)), 7, 2).numpy())
    assert not staging[:3].any()


def test_layers_on_different_devices_are_rejected() -> None:
    cpu = torch.zeros(4, 2)
    meta = torch.zeros(4, 2, device="meta")
    with pytest.raises(ValueError, match="one device"):
        BlockCopier([cpu, meta], 4)


def test_device_kv_is_copied_by_a_device_not_on_the_host() -> None:
    kv = torch.zeros(4, 2, 8, device="meta")
    copier = BlockCopier([kv], 4)
    with pytest.raises(ValueError, match="a device carries this copy out"):
        copier.copy([0], np.zeros((1, copier.object_bytes), np.uint8), to_kv=True).run_on_host()


# -- describe_layer -----------------------------------------------------------------


def test_cpu_layout_blocks_are_dim_0() -> None:
    layout = describe_layer(torch.zeros(16, 2, 4, 8), 16)
    assert (layout.block_dim, layout.block_bytes, layout.shape) == (0, 2 * 4 * 8 * 4, (16, 2, 4, 8))
    assert layout.dtype == torch.float32


def test_kv_leading_layout_blocks_are_dim_1() -> None:
    layout = describe_layer(torch.zeros(2, 16, 4, 2, 8, dtype=torch.float16), 16)
    assert (layout.block_dim, layout.block_bytes) == (1, 2 * 4 * 2 * 8 * 2)


def test_mamba_page_view_blocks_are_dim_0_and_exclude_padding() -> None:
    view = mamba_page(torch.zeros(10 * 64, dtype=torch.uint8), 10, 24, 64, 0)
    layout = describe_layer(view, 10)
    assert (layout.block_dim, layout.block_bytes, layout.dtype) == (0, 24, torch.int8)


def test_no_dim_of_num_blocks_names_shape_and_num_blocks() -> None:
    with pytest.raises(ValueError, match=r"\[4, 2, 3\].*num_blocks=5"):
        describe_layer(torch.zeros(4, 2, 3), 5)


def test_a_dim_holding_kernel_blocks_is_the_block_dim() -> None:
    layout = describe_layer(torch.zeros(2, 40, 16, 2, 8), 10)
    assert (layout.block_dim, layout.kernel_blocks) == (1, 4)
    assert describe_layer(torch.zeros(16, 2, 4, 8), 16).kernel_blocks == 1


def test_tie_goes_to_the_largest_stride() -> None:
    # CPU layout with heads == num_blocks: the outer (page) dim is the block dim.
    assert describe_layer(torch.zeros(4, 4, 3, 8), 4).block_dim == 0
    # K/V leading with block_size == num_blocks: dim 1 beats the inner block_size dim.
    assert describe_layer(torch.zeros(2, 4, 4, 2, 8), 4).block_dim == 1
    # Block-major memory presented with the block dim second (a permuted view): memory
    # order, not logical order, decides.
    permuted = torch.zeros(4, 4, 3, 8).permute(1, 0, 2, 3)
    assert describe_layer(permuted, 4).block_dim == 1


def test_kv_leading_with_two_blocks_needs_the_explicit_block_dim() -> None:
    # K/V dim and block dim both have size 2 and are indistinguishable by stride order.
    kv = torch.zeros(2, 2, 4, 2, 8)
    assert describe_layer(kv, 2).block_dim == 0
    assert describe_layer(kv, 2, block_dim=1).block_dim == 1
    with pytest.raises(ValueError, match="not num_blocks=3"):
        describe_layer(kv, 3, block_dim=2)
    copier = BlockCopier([kv], 2, block_dim=1)
    assert copier.layouts[0].block_dim == 1


def test_layer_given_as_list_describes_each_part() -> None:
    conv = torch.zeros(6, 3, 4)
    ssm = torch.zeros(6, 2, 5, 5, dtype=torch.bfloat16)
    layouts = describe_layer_parts([conv, ssm], 6)
    assert [layout.block_bytes for layout in layouts] == [48, 100]
    assert BlockCopier([[conv, ssm], conv], 6).object_bytes == 48 + 100 + 48


# -- the property -------------------------------------------------------------------

DTYPES = [torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int64]


@st.composite
def random_layouts(draw: st.DrawFn) -> tuple[KvCase, list[int]]:
    """A group of 1-3 strided views (permuted memory order, padded inner dims) + block ids."""
    num_blocks = draw(st.integers(1, 6))
    layer_specs = draw(st.lists(layer_spec(num_blocks), min_size=1, max_size=3))
    # Each layer starts at the next multiple of its element size (as an allocator would
    # align it), so int8 layers may sit at odd offsets and exercise byte-wide copies.
    offsets = [0]
    for spec in layer_specs:
        start = -(-offsets[-1] // spec.dtype.itemsize) * spec.dtype.itemsize
        offsets[-1] = start
        offsets.append(start + spec.nbytes)

    def build(base: torch.Tensor) -> list[LayerTensors]:
        return [
            spec.view(base[start : start + spec.nbytes])
            for spec, start in zip(layer_specs, offsets, strict=False)
        ]

    block_ids = draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
    return KvCase(offsets[-1], num_blocks, build), block_ids


@dataclass(frozen=True)
class LayerSpec:
    dtype: torch.dtype
    memory_shape: tuple[int, ...]  # contiguous allocation, outermost first
    inverse_perm: tuple[int, ...]  # memory dims -> logical dims
    inner_pad: int  # extra elements per innermost memory row (padding never copied)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in (*self.memory_shape[:-1], self.memory_shape[-1] + self.inner_pad):
            numel *= size
        return numel * int(self.dtype.itemsize)

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        padded = (*self.memory_shape[:-1], self.memory_shape[-1] + self.inner_pad)
        memory = buffer.view(self.dtype).view(padded)[..., : self.memory_shape[-1]]
        return memory.permute(self.inverse_perm)


@st.composite
def layer_spec(draw: st.DrawFn, num_blocks: int) -> LayerSpec:
    other_dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    block_pos = draw(st.integers(0, len(other_dims)))
    logical = [*other_dims[:block_pos], num_blocks, *other_dims[block_pos:]]
    perm = draw(st.permutations(range(len(logical))))  # memory dim i holds logical perm[i]
    inverse = tuple(perm.index(dim) for dim in range(len(logical)))
    return LayerSpec(
        dtype=draw(st.sampled_from(DTYPES)),
        memory_shape=tuple(logical[dim] for dim in perm),
        inverse_perm=inverse,
        inner_pad=draw(st.integers(0, 3)),
    )


@settings(max_examples=200, deadline=None)
@given(random_layouts(), st.integers(0, 2**31 - 1), st.sampled_from(sorted(MOVERS)))
def test_scatter_of_gather_restores_exactly_the_selected_blocks(
    case_and_ids: tuple[KvCase, list[int]], seed: int, mover: str
) -> None:
    """On every strided layout, numpy on the host and the byte ranges a device moves
    both restore exactly the selected blocks."""
    case, block_ids = case_and_ids
    round_trip(case, block_ids, seed, MOVERS[mover])


# -- CUDA (skipped on CPU-only machines) --------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_round_trip_by_dma_from_registered_host_memory(name: str) -> None:
    """The chosen batched copy moves a load and a store of every layout bit-exactly
    between device KV and host rows registered with CUDA."""
    from umbp.gpu.cuda import CudaDevice

    case = CASES[name]
    device = CudaDevice(torch.device("cuda"))
    source = random_base(case.base_bytes, seed=9)
    kv = source.cuda()
    copier = BlockCopier(case.build(kv), case.num_blocks)
    ids = [case.num_blocks - 1, 0, 2]
    rows = rows_for(copier, len(ids))
    registered = device.register_host(rows.ctypes.data, rows.nbytes)
    stream = device.new_stream("test")
    device.copy(stream, copier.copy(ids, rows, to_kv=False))
    done = device.new_event()
    done.record(stream)
    done.synchronize()
    parts = flat_parts(case.build(source))
    for row, block_id in zip(rows, ids, strict=True):
        assert np.array_equal(row, expected_row(parts, case.num_blocks, block_id).numpy())
    restored = torch.zeros_like(kv)
    restorer = BlockCopier(case.build(restored), case.num_blocks)
    for layer in range(restorer.num_layers):
        device.copy(stream, restorer.copy(ids, rows, to_kv=True, layer=layer))
    done.record(stream)
    device.current_stream().wait_event(done)
    assert torch.equal(restored.cpu(), expected_restore(case, source, ids))
    if registered:
        device.unregister_host(rows.ctypes.data)
    device.close()


@needs_cuda
def test_cuda_store_copy_waits_for_the_forward_mark() -> None:
    """A store's copy enqueued from another thread after the mark the forward thread
    recorded reads what the forward pass wrote, even while the forward stream is busy."""
    import threading

    from umbp.gpu.cuda import CudaDevice

    case = cpu_attention_case(torch.float32)
    device = CudaDevice(torch.device("cuda"))
    kv = torch.zeros(case.base_bytes, dtype=torch.uint8, device="cuda")
    layers = case.build(kv)
    copier = BlockCopier(layers, case.num_blocks)
    out = rows_for(copier, 1)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the "forward pass" is still running on its stream
    for layer in flat_parts(layers):
        layer[2].fill_(3.5)
    mark = device.new_event()
    mark.record(device.current_stream())
    stream = device.new_stream("store")

    def store_thread() -> None:
        stream.wait_event(mark)
        device.copy(stream, copier.copy([2], out, to_kv=False))
        end = device.new_event()
        end.record(stream)
        end.synchronize()

    thread = threading.Thread(target=store_thread)
    thread.start()
    thread.join()
    assert bool((out.view(np.float32) == 3.5).all())
    device.close()


def test_copies_of_one_copier_on_several_threads_keep_their_bytes_apart() -> None:
    """A host device runs a copier's loads and stores on separate lanes at once; rows
    in any order pass through scratch memory, which each thread has its own of (one
    shared buffer mixed a store's blocks into a load)."""
    import threading

    case = cpu_attention_case(torch.float32, num_layers=2)
    source = random_base(case.base_bytes, seed=13)
    copier = BlockCopier(case.build(source), case.num_blocks)
    block_ids = [6, 1, 4, 2]
    staged = rows_for(copier, len(block_ids))
    copier.gather(block_ids, staged)
    pages = np.zeros((9, copier.object_bytes + 64), np.uint8)
    lent = [7, 0, 5, 3]
    for row, page in enumerate(lent):
        pages[page, : copier.object_bytes] = staged[row]
    failures: list[str] = []

    def loads() -> None:
        restored = torch.zeros_like(source)
        restorer = BlockCopier(case.build(restored), case.num_blocks)
        for _ in range(300):
            restorer.copy(block_ids, pages, lent, to_kv=True).run_on_host()
        if not torch.equal(restored, expected_restore(case, source, block_ids)):
            failures.append("a load got other bytes")

    shared = BlockCopier(case.build(source), case.num_blocks)
    out = np.zeros_like(pages)

    def stores() -> None:
        for _ in range(300):
            shared.copy(block_ids, out, lent, to_kv=False).run_on_host()

    def loads_on_the_shared_copier() -> None:
        into = np.zeros_like(pages)
        for _ in range(300):
            shared.copy(list(reversed(block_ids)), into, list(reversed(lent)),
                        to_kv=False).run_on_host()
            if not np.array_equal(into[lent, : copier.object_bytes], staged):
                failures.append("a gather got another thread's blocks")
                return

    threads = [threading.Thread(target=f) for f in (loads, stores, loads_on_the_shared_copier)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert np.array_equal(out[lent, : copier.object_bytes], staged)
