"""BlockCopier on CPU: bit-exact round trips over every KV layout vLLM hands out.

Each case builds its KV tensors as views into one base allocation (as vLLM does), so a
"zeroed copy" is the same views over a zeroed base, and "touches no other block" is
checked byte for byte over the whole base, padding included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.gpu import (
    BlockCopier,
    LayerTensors,
    StagingRows,
    allocate_staging,
    describe_layer,
    describe_layer_parts,
)

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


def expected_row(parts: Sequence[torch.Tensor], dims: Sequence[int], block_id: int) -> torch.Tensor:
    """The documented object format: each part's block in row-major order, concatenated."""
    return torch.cat(
        [
            as_bytes(part.select(dim, block_id)).reshape(-1)
            for part, dim in zip(parts, dims, strict=True)
        ]
    )


def expected_restore(case: KvCase, source: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """A zeroed base with exactly ``block_ids`` copied from ``source`` (slow reference)."""
    expected = torch.zeros_like(source)
    src_parts = flat_parts(case.build(source))
    dst_parts = flat_parts(case.build(expected))
    for src, dst in zip(src_parts, dst_parts, strict=True):
        dim = describe_layer(src, case.num_blocks).block_dim
        for block_id in block_ids:
            as_bytes(dst).select(dim, block_id).copy_(as_bytes(src).select(dim, block_id))
    return expected


def round_trip(
    case: KvCase,
    block_ids: Sequence[int],
    seed: int = 0,
    device: str = "cpu",
    device_staging_bytes: int | None = None,
) -> None:
    """gather, then scatter into a zeroed copy: exactly the selected blocks come back.

    The KV lives on ``device``; references are computed from a CPU copy, slowly.
    """
    source = random_base(case.base_bytes, seed)
    kv = source.to(device)
    staging_cap = (
        {} if device_staging_bytes is None else {"device_staging_bytes": device_staging_bytes}
    )
    copier = BlockCopier(case.build(kv), case.num_blocks, **staging_cap)
    out = allocate_staging(len(block_ids), copier.object_bytes, copier.device)
    copier.gather(block_ids, out)

    parts = flat_parts(case.build(source))
    dims = [layout.block_dim for layout in copier.layouts]
    for row, block_id in zip(out, block_ids, strict=True):
        assert torch.equal(row, expected_row(parts, dims, block_id))
    assert torch.equal(kv.cpu(), source), "gather must not write the KV"

    restored = torch.zeros_like(kv)
    unique_ids = list(dict.fromkeys(block_ids))
    rows = allocate_staging(len(unique_ids), copier.object_bytes, copier.device)
    rows.copy_(out[[block_ids.index(block_id) for block_id in unique_ids]])
    restorer = BlockCopier(case.build(restored), case.num_blocks, **staging_cap)
    restorer.scatter(unique_ids, rows)
    assert torch.equal(restored.cpu(), expected_restore(case, source, unique_ids))


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


CASES = {
    "float32": cpu_attention_case(torch.float32),
    "bfloat16": cpu_attention_case(torch.bfloat16),
    "float16": cpu_attention_case(torch.float16),
    "mamba_int8_pages": mamba_case(),
    "mamba_list_layer": mamba_list_case(),
    "kv_leading": kv_leading_case(),
}


def staged_blocks(case: KvCase, seed: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Random KV, three of its blocks (last, first, third) and their objects staged."""
    source = random_base(case.base_bytes, seed=seed)
    block_ids = [case.num_blocks - 1, 0, 2]
    copier = BlockCopier(case.build(source), case.num_blocks)
    rows = allocate_staging(len(block_ids), copier.object_bytes, copier.device)
    copier.gather(block_ids, rows)
    return source, block_ids, rows


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_restores_exactly_the_selected_blocks(name: str) -> None:
    case = CASES[name]
    round_trip(case, [3, 0, case.num_blocks - 1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_by_layer_scatters_make_the_whole_scatter_and_touch_only_their_layer(
    name: str,
) -> None:
    """A layer-wise restore (one scatter per layer, each a slice of the staged
    objects) ends where one whole scatter ends; before the last layer, the layers not
    yet scattered are untouched, byte for byte."""
    case = CASES[name]
    source, block_ids, rows = staged_blocks(case, seed=3)
    restored = torch.zeros_like(source)
    restorer = BlockCopier(case.build(restored), case.num_blocks)
    assert restorer.num_layers == len(case.build(restored))
    layers = case.build(restored)
    for layer in range(restorer.num_layers):
        assert restorer.scatter_layer_async(layer, block_ids, rows).done()
        later = flat_parts(layers[layer + 1:])
        assert all(not as_bytes(part).any() for part in later), "a later layer was written"
    assert torch.equal(restored, expected_restore(case, source, block_ids))
    with pytest.raises(IndexError, match="layer"):
        restorer.scatter_layer_async(restorer.num_layers, block_ids, rows)


@pytest.mark.parametrize("name", sorted(CASES))
def test_scatter_from_lent_rows_equals_the_scatter_of_staged_rows(name: str) -> None:
    """``src_rows``: objects lying in wider rows in any order (a pool's pages lent in
    place) restore the blocks exactly as the same objects staged row by row, whole or
    one layer at a time."""
    case = CASES[name]
    source, block_ids, staged = staged_blocks(case, seed=5)
    object_bytes = int(staged.shape[1])
    page_bytes = -(-object_bytes // 64) * 64 + 64  # wider than an object
    pages = torch.randint(0, 256, (7, page_bytes), dtype=torch.uint8)
    lent_rows = [5, 1, 3]
    for row, page in enumerate(lent_rows):
        pages[page, :object_bytes] = staged[row]
    whole = torch.zeros_like(source)
    BlockCopier(case.build(whole), case.num_blocks).scatter(block_ids, pages, src_rows=lent_rows)
    by_layer = torch.zeros_like(source)
    restorer = BlockCopier(case.build(by_layer), case.num_blocks)
    for layer in range(restorer.num_layers):
        assert restorer.scatter_layer_async(layer, block_ids, pages, src_rows=lent_rows).done()
    expected = expected_restore(case, source, block_ids)
    assert torch.equal(whole, expected)
    assert torch.equal(by_layer, expected)


@pytest.mark.parametrize(
    ("rows", "src_rows", "error", "message"),
    [
        (torch.zeros(4, 1152, dtype=torch.uint8), [0], ValueError, "1 src_rows for 2 blocks"),
        (torch.zeros(4, 1152, dtype=torch.uint8), [0, 4], IndexError, "src row 4 out of range"),
        (torch.zeros(4, 1088, dtype=torch.uint8), [0, 1], ValueError, "cannot hold objects"),
        (torch.zeros(4, 1152, dtype=torch.int8), [0, 1], ValueError, "uint8 rows"),
    ],
)
def test_wrong_lent_rows_are_rejected(
    rows: torch.Tensor, src_rows: list[int], error: type[Exception], message: str
) -> None:
    case = cpu_attention_case(torch.float32)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    with pytest.raises(error, match=message):
        copier.scatter([0, 1], rows, src_rows=src_rows)


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_of_every_block(name: str) -> None:
    case = CASES[name]
    round_trip(case, list(reversed(range(case.num_blocks))))


def test_object_is_one_block_of_every_layer_in_order() -> None:
    case = cpu_attention_case(torch.float32, num_layers=3)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    assert copier.object_bytes == 3 * 2 * 4 * 12 * 4
    assert [layout.block_bytes for layout in copier.layouts] == [384, 384, 384]


def test_mamba_page_counts_state_bytes_not_padding() -> None:
    case = mamba_case()
    source = random_base(case.base_bytes)
    layers = case.build(source)
    assert not flat_parts(layers)[0].is_contiguous()
    assert BlockCopier(layers, case.num_blocks).object_bytes == 2 * 40


def test_padding_between_mamba_states_is_never_written() -> None:
    case = mamba_case()
    sentinel = torch.full((case.base_bytes,), 0xAB, dtype=torch.uint8)
    copier = BlockCopier(case.build(sentinel), case.num_blocks)
    ids = list(range(case.num_blocks))
    copier.scatter(ids, torch.zeros(len(ids), copier.object_bytes, dtype=torch.uint8))
    pages = sentinel.view(2 * case.num_blocks, 128)
    assert int(pages[:, :40].count_nonzero()) == 0
    assert bool((pages[:, 40:] == 0xAB).all())


def test_empty_block_list_is_a_no_op() -> None:
    case = cpu_attention_case(torch.float32)
    source = random_base(case.base_bytes)
    before = source.clone()
    copier = BlockCopier(case.build(source), case.num_blocks)
    empty = torch.empty(0, copier.object_bytes, dtype=torch.uint8)
    copier.gather([], empty)
    copier.scatter([], empty)
    assert copier.gather_async([], empty).done()
    assert torch.equal(source, before)


def test_gather_copies_a_duplicated_id_into_each_row() -> None:
    case = cpu_attention_case(torch.bfloat16)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    out = torch.empty(3, copier.object_bytes, dtype=torch.uint8)
    copier.gather([2, 5, 2], out)
    assert torch.equal(out[0], out[2])
    assert not torch.equal(out[0], out[1])
    round_trip(case, [2, 5, 2])


def test_scatter_rejects_duplicate_ids() -> None:
    case = cpu_attention_case(torch.float32)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    with pytest.raises(ValueError, match="block id 1 more than once"):
        copier.scatter([1, 1], torch.zeros(2, copier.object_bytes, dtype=torch.uint8))


@pytest.mark.parametrize("bad_id", [7, 100, -1])
def test_out_of_range_id_names_the_id_and_num_blocks(bad_id: int) -> None:
    case = cpu_attention_case(torch.float32)  # num_blocks = 7
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    rows = torch.zeros(2, copier.object_bytes, dtype=torch.uint8)
    message = f"block id {bad_id} out of range for num_blocks=7"
    with pytest.raises(IndexError, match=message):
        copier.gather([0, bad_id], rows)
    with pytest.raises(IndexError, match=message):
        copier.scatter([bad_id, 0], rows)


@pytest.mark.parametrize(
    "rows",
    [
        torch.zeros(2, 1152, dtype=torch.float32),  # wrong dtype
        torch.zeros(3, 1152, dtype=torch.uint8),  # wrong number of rows
        torch.zeros(2, 1151, dtype=torch.uint8),  # wrong object size
        torch.zeros(1152, 2, dtype=torch.uint8).t(),  # right shape, not contiguous
    ],
)
def test_wrong_rows_are_rejected(rows: torch.Tensor) -> None:
    case = cpu_attention_case(torch.float32)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    assert copier.object_bytes == 1152
    with pytest.raises(ValueError):
        copier.gather([0, 1], rows)
    with pytest.raises(ValueError):
        copier.scatter([0, 1], rows)


def test_rows_on_another_device_are_rejected() -> None:
    case = cpu_attention_case(torch.float32)
    copier = BlockCopier(case.build(random_base(case.base_bytes)), case.num_blocks)
    rows = torch.empty(1, copier.object_bytes, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="out is on meta; the KV is on cpu"):
        copier.gather([0], rows)


def test_async_variants_complete_at_once_on_cpu() -> None:
    case = cpu_attention_case(torch.float16)
    source = random_base(case.base_bytes)
    copier = BlockCopier(case.build(source), case.num_blocks)
    out = torch.empty(2, copier.object_bytes, dtype=torch.uint8)
    handle = copier.gather_async([4, 1], out)
    assert handle.done()
    handle.wait()
    handle.make_stream_wait()  # no stream on CPU: a no-op
    assert torch.equal(out[1], expected_row(flat_parts(case.build(source)), [0, 0, 0], 1))


def test_rows_may_be_a_slice_of_a_larger_staging_buffer() -> None:
    case = cpu_attention_case(torch.float32)
    source = random_base(case.base_bytes)
    copier = BlockCopier(case.build(source), case.num_blocks)
    staging = allocate_staging(5, copier.object_bytes, torch.device("cpu"))
    copier.gather([6, 2], staging[3:5])
    assert torch.equal(staging[4], expected_row(flat_parts(case.build(source)), [0, 0, 0], 2))


def test_allocate_staging_on_cpu_is_plain_uint8() -> None:
    staging = allocate_staging(3, 10, torch.device("cpu"))
    assert staging.shape == (3, 10)
    assert staging.dtype == torch.uint8
    assert not staging.is_pinned()


def test_staging_rows_reuse_one_buffer_per_group_and_grow_by_doubling() -> None:
    allocated: list[int] = []
    released: list[int] = []
    staging = StagingRows(lambda b: allocated.append(b.data_ptr()),
                          lambda b: released.append(b.data_ptr()))
    cpu = torch.device("cpu")
    first = staging.rows(0, 3, 64, cpu)
    assert first.shape == (3, 64) and len(allocated) == 1
    # Fewer rows, or as many: the same memory, nothing allocated.
    assert staging.rows(0, 2, 64, cpu).data_ptr() == first.data_ptr()
    assert staging.rows(0, 3, 64, cpu).data_ptr() == first.data_ptr()
    # Another group has its own buffer.
    other = staging.rows(1, 1, 32, cpu)
    assert other.data_ptr() != first.data_ptr() and len(allocated) == 2
    # More rows: the old buffer is released before a twice as large one replaces it.
    grown = staging.rows(0, 4, 64, cpu)
    assert released == [first.data_ptr()] and allocated[-1] == grown.data_ptr()
    assert staging.rows(0, 6, 64, cpu).data_ptr() == grown.data_ptr()  # capacity 6
    staging.release()
    assert sorted(released) == sorted([first.data_ptr(), grown.data_ptr(), other.data_ptr()])


def test_layers_on_different_devices_are_rejected() -> None:
    cpu = torch.zeros(4, 2)
    meta = torch.zeros(4, 2, device="meta")
    with pytest.raises(ValueError, match="one device"):
        BlockCopier([cpu, meta], 4)


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
    with pytest.raises(ValueError, match="not num_blocks=2"):
        describe_layer(kv, 2, block_dim=2)
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
@given(random_layouts(), st.integers(0, 2**31 - 1))
def test_scatter_of_gather_restores_exactly_the_selected_blocks(
    case_and_ids: tuple[KvCase, list[int]], seed: int
) -> None:
    case, block_ids = case_and_ids
    round_trip(case, block_ids, seed)


# -- CUDA (skipped on CPU-only machines) --------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_round_trip_through_pinned_staging(name: str) -> None:
    case = CASES[name]
    round_trip(case, [3, 0, case.num_blocks - 1, 3], device="cuda")


@needs_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_round_trip_in_chunks_of_one_object(name: str) -> None:
    case = CASES[name]
    # A bounce buffer of one object forces one device<->host copy per object.
    round_trip(case, list(reversed(range(case.num_blocks))), device="cuda", device_staging_bytes=1)


@needs_cuda
def test_cuda_staging_is_pinned() -> None:
    assert allocate_staging(2, 64, torch.device("cuda")).is_pinned()


@needs_cuda
def test_cuda_gather_reads_what_the_current_stream_wrote_last() -> None:
    case = cpu_attention_case(torch.float32)
    kv = torch.zeros(case.base_bytes, dtype=torch.uint8, device="cuda")
    layers = case.build(kv)
    copier = BlockCopier(layers, case.num_blocks)
    out = allocate_staging(1, copier.object_bytes, copier.device)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # keep the current stream busy, then write block 2
    for layer in flat_parts(layers):
        layer[2].fill_(1.5)
    handle = copier.gather_async([2], out)
    handle.wait()
    assert bool((out.view(torch.float32) == 1.5).all())


@needs_cuda
def test_cuda_scatter_is_visible_to_a_stream_made_to_wait() -> None:
    case = cpu_attention_case(torch.float32)
    kv = torch.zeros(case.base_bytes, dtype=torch.uint8, device="cuda")
    layers = case.build(kv)
    copier = BlockCopier(layers, case.num_blocks)
    src = allocate_staging(1, copier.object_bytes, copier.device)
    src.view(torch.float32).fill_(2.5)
    handle = copier.scatter_async([4], src)
    handle.make_stream_wait()
    total = torch.stack([layer[4].sum() for layer in flat_parts(layers)]).sum()
    assert float(total) == 2.5 * copier.object_bytes / 4
    handle.wait()
    assert handle.done()


@needs_cuda
def test_cuda_rows_on_the_device_need_no_bounce() -> None:
    case = kv_leading_case()
    source = random_base(case.base_bytes)
    kv = source.cuda()
    copier = BlockCopier(case.build(kv), case.num_blocks)
    rows = torch.empty(2, copier.object_bytes, dtype=torch.uint8, device="cuda")
    copier.gather([1, 3], rows)
    dims = [layout.block_dim for layout in copier.layouts]
    assert torch.equal(rows[1].cpu(), expected_row(flat_parts(case.build(source)), dims, 3))


@needs_cuda
def test_cuda_gather_from_another_thread_reads_what_the_forward_marked() -> None:
    """The store thread enqueues its gather after the event the forward thread
    recorded (its own current stream knows nothing of the forward pass)."""
    import threading

    from umbp.gpu.copier import mark_forward_end

    case = cpu_attention_case(torch.float32)
    kv = torch.zeros(case.base_bytes, dtype=torch.uint8, device="cuda")
    layers = case.build(kv)
    copier = BlockCopier(layers, case.num_blocks)
    out = allocate_staging(1, copier.object_bytes, copier.device)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the "forward pass" is still running on its stream
    for layer in flat_parts(layers):
        layer[2].fill_(3.5)
    mark = mark_forward_end(copier.device)
    gathered: list[bool] = []

    def store_thread() -> None:
        copier.gather_async([2], out, mark).wait()
        gathered.append(bool((out.view(torch.float32) == 3.5).all()))

    thread = threading.Thread(target=store_thread)
    thread.start()
    thread.join()
    assert gathered == [True]


@needs_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_layer_by_layer_scatter_restores_every_layer(name: str) -> None:
    case = CASES[name]
    source = random_base(case.base_bytes, seed=5)
    copier = BlockCopier(case.build(source), case.num_blocks)
    rows = allocate_staging(2, copier.object_bytes, torch.device("cuda"))
    copier.gather([1, 0], rows)
    restored = torch.zeros(case.base_bytes, dtype=torch.uint8, device="cuda")
    restorer = BlockCopier(case.build(restored), case.num_blocks)
    handles = [restorer.scatter_layer_async(layer, [1, 0], rows)
               for layer in range(restorer.num_layers)]
    for handle in handles:
        handle.make_stream_wait()
    assert torch.equal(restored.cpu(), expected_restore(case, source, [1, 0]))
