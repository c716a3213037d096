"""Where the blocks are inside one paged KV tensor.

A paged KV tensor holds ``num_blocks`` blocks along one of its dimensions. Which one
depends on the attention back-end, so it is derived from the tensor, never assumed:

* vLLM CPU:            ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
* CUDA FlashAttention: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K/V leading)
* Mamba state:         ``[num_blocks, 1, 1, state_bytes]`` int8, a non-contiguous view whose
  block stride is the padded page size (only ``state_bytes`` of each page are state).

vLLM may also split each block into ``k`` smaller *kernel blocks* for an attention
back-end that needs them (``kernel_block_sizes``): the tensor then holds
``num_blocks * k`` kernel blocks along its block dimension, block ``b`` being kernel blocks
``b * k .. b * k + k - 1`` (vLLM splits only dense pages, so they are adjacent).
:func:`block_major` folds them back into one block of ``num_blocks``.

Some layers (several Mamba variants) arrive as a list of tensors; each is one *part* and
is described on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

LayerTensors: TypeAlias = torch.Tensor | Sequence[torch.Tensor]
"""One layer as vLLM hands it over: a tensor, or a list/tuple of tensors (Mamba)."""


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """Where the blocks of one KV tensor are and how big one block is."""

    block_dim: int
    num_blocks: int
    block_bytes: int
    """Bytes of one block of this tensor (padding outside the view is not counted)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    kernel_blocks: int = 1
    """Kernel blocks per block along ``block_dim`` (1: vLLM did not split blocks)."""


def describe_layer(
    tensor: torch.Tensor, num_blocks: int, *, block_dim: int | None = None
) -> LayerLayout:
    """Describe one paged KV tensor holding ``num_blocks`` blocks.

    The block dim is the dim whose size is ``num_blocks``. When several dims have that
    size the one with the largest stride wins: a paged allocator hands out whole pages,
    so the block dim is the outermost in memory of every block-major layout (CPU, Mamba,
    FlashInfer ``[N, 2, ...]``) and still beats the inner dims of the K/V-leading layout.
    When no dim has that size, the dim holding kernel blocks is the outermost whose size
    is a multiple of ``num_blocks`` (see the module docstring).
    The one case this cannot decide is K/V-leading with ``num_blocks == 2``, where the
    K/V dim and the block dim are indistinguishable by shape and stride; a caller that
    knows its back-end passes ``block_dim`` explicitly.
    """
    _check_num_blocks(num_blocks)
    shape = tuple(int(size) for size in tensor.shape)
    strides = tuple(int(stride) for stride in tensor.stride())
    dim = (
        _infer_block_dim(shape, strides, num_blocks)
        if block_dim is None
        else _checked_block_dim(shape, num_blocks, block_dim)
    )
    return LayerLayout(
        block_dim=dim,
        num_blocks=num_blocks,
        block_bytes=_block_bytes(shape, num_blocks, int(tensor.element_size())),
        dtype=tensor.dtype,
        shape=shape,
        kernel_blocks=shape[dim] // num_blocks,
    )


def block_major(tensor: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """``tensor`` with exactly ``num_blocks`` entries along ``layout.block_dim``: kernel
    blocks folded into their block (a free view: one dim split in two)."""
    if layout.kernel_blocks == 1:
        return tensor
    return tensor.unflatten(layout.block_dim, (layout.num_blocks, layout.kernel_blocks))


def layer_parts(layer: LayerTensors) -> tuple[torch.Tensor, ...]:
    """The tensors of one layer in order: itself, or the members of a list/tuple."""
    if isinstance(layer, torch.Tensor):
        return (layer,)
    parts: tuple[torch.Tensor, ...] = tuple(layer)
    if not parts or not all(isinstance(part, torch.Tensor) for part in parts):
        raise TypeError("a layer must be a tensor or a non-empty list/tuple of tensors")
    return parts


def describe_layer_parts(
    layer: LayerTensors, num_blocks: int, *, block_dim: int | None = None
) -> tuple[LayerLayout, ...]:
    """Describe every tensor of one layer (one layout per part, in order)."""
    return tuple(
        describe_layer(part, num_blocks, block_dim=block_dim) for part in layer_parts(layer)
    )


def _check_num_blocks(num_blocks: int) -> None:
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")


def _infer_block_dim(shape: tuple[int, ...], strides: tuple[int, ...], num_blocks: int) -> int:
    matching = [dim for dim, size in enumerate(shape) if size == num_blocks] or [
        dim for dim, size in enumerate(shape) if size % num_blocks == 0
    ]
    if not matching:
        raise ValueError(
            f"no dimension of KV tensor shape {list(shape)} has size num_blocks={num_blocks} "
            "(or a multiple of it: kernel blocks)"
        )
    # max() keeps the first of equal strides, i.e. the outermost matching dim.
    return max(matching, key=lambda dim: strides[dim])


def _checked_block_dim(shape: tuple[int, ...], num_blocks: int, block_dim: int) -> int:
    if not -len(shape) <= block_dim < len(shape):
        raise ValueError(f"block_dim {block_dim} out of range for KV tensor shape {list(shape)}")
    dim = block_dim % len(shape)
    if shape[dim] % num_blocks:
        raise ValueError(
            f"dim {dim} of KV tensor shape {list(shape)} has size {shape[dim]}, "
            f"not num_blocks={num_blocks} (or a multiple of it: kernel blocks)"
        )
    return dim


def _block_bytes(shape: tuple[int, ...], num_blocks: int, element_size: int) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel // num_blocks * element_size
