"""A paged KV tensor seen as ``[num_blocks, ...]`` machine words, block dim in front.

Copies move raw bits, never values, so every tensor is first reinterpreted as bytes and
then as the widest integer word its strides allow: index kernels move 8-byte words about
three times faster than single bytes, and an integer view cannot touch float payloads
(NaN bit patterns survive). Moving the block dim to the front is a free view, so the one
``index_select`` / ``index_copy_`` along dim 0 serves every layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

WORD_SIZES = (8, 4, 2, 1)
_WORD_DTYPES: dict[int, torch.dtype] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


@dataclass(frozen=True, slots=True, eq=False)
class BlockView:
    """One KV tensor as ``[num_blocks, *block_shape]`` words, block dim in front.

    The block shape is coalesced (size-1 dims dropped, contiguous neighbours merged) and
    its last dim has stride 1, so a block is ``block_bytes`` bytes in row-major order of
    the tensor's remaining dims. ``word_bytes`` is the widest word the view can be read
    as; ``words(w)`` for every narrower ``w`` is precomputed (calls are on the hot path).
    """

    block_bytes: int
    word_bytes: int
    block_shape_bytes: tuple[int, ...]
    word_views: Mapping[int, torch.Tensor]
    address: int
    """Where block 0 starts (a device address for device KV)."""
    block_stride: int
    """Bytes from one block to the next."""
    segment_offsets: npt.NDArray[np.uint64]
    """Where each contiguous run of one block starts, relative to the block, in the
    block's row-major order: run ``s`` is bytes ``[s * segment_bytes, (s + 1) *
    segment_bytes)`` of the block as an object holds it."""
    segment_bytes: int

    def words(self, word_bytes: int) -> torch.Tensor:
        """The view read as ``word_bytes``-wide integers (``word_bytes`` divides the widest)."""
        return self.word_views[word_bytes]

    def block_shape(self, word_bytes: int) -> tuple[int, ...]:
        """Shape of one block counted in ``word_bytes``-wide words."""
        *outer, inner = self.block_shape_bytes
        return (*outer, inner // word_bytes)


def block_view(tensor: torch.Tensor, block_dim: int) -> BlockView:
    """Build the block-major view of ``tensor`` whose blocks lie along ``block_dim``."""
    # unsqueeze(-1) gives a trailing stride-1 dim, so the byte view is legal for any strides.
    as_bytes = tensor.unsqueeze(-1).view(torch.uint8).movedim(block_dim, 0)
    shape = tuple(int(size) for size in as_bytes.shape)
    strides = tuple(int(stride) for stride in as_bytes.stride())
    rest = _coalesce(shape[1:], strides[1:])
    block_shape_bytes = tuple(size for size, _ in rest)
    bytes_view = as_bytes.view(shape[0], *block_shape_bytes)
    word = widest_word(
        int(bytes_view.storage_offset()),
        block_shape_bytes[-1],
        *(int(stride) for stride in bytes_view.stride()[:-1]),
    )
    block_bytes = 1
    for size in block_shape_bytes:
        block_bytes *= size
    return BlockView(
        block_bytes=block_bytes,
        word_bytes=word,
        block_shape_bytes=block_shape_bytes,
        word_views={w: bytes_view.view(word_dtype(w)) for w in WORD_SIZES if word % w == 0},
        address=int(bytes_view.data_ptr()),
        block_stride=int(bytes_view.stride(0)),
        segment_offsets=_segment_offsets(block_shape_bytes[:-1], bytes_view.stride()[1:-1]),
        segment_bytes=block_shape_bytes[-1],
    )


def _segment_offsets(
    outer_shape: tuple[int, ...], outer_strides: tuple[int, ...]
) -> npt.NDArray[np.uint64]:
    """Byte offset of every innermost run of a block, in row-major order of the outer dims."""
    offsets: npt.NDArray[np.uint64] = np.zeros(1, dtype=np.uint64)
    for size, stride in zip(outer_shape, outer_strides, strict=True):
        steps = np.arange(size, dtype=np.uint64) * np.uint64(stride)
        offsets = (offsets[:, None] + steps[None, :]).reshape(-1)
    return offsets


def word_dtype(word_bytes: int) -> torch.dtype:
    """The integer dtype ``word_bytes`` wide (uint8 for single bytes, like staging rows)."""
    return _WORD_DTYPES[word_bytes]


def widest_word(*byte_quantities: int) -> int:
    """The widest word size (8, 4, 2 or 1 bytes) dividing every given byte quantity."""
    for word in WORD_SIZES[:-1]:
        if all(quantity % word == 0 for quantity in byte_quantities):
            return word
    return 1


def _coalesce(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """Merge dims that are contiguous with their inner neighbour; drop size-1 dims.

    Returns (size, stride) pairs, innermost last, and the innermost has stride 1 (a
    size-1 dim is appended when needed) so the row can be re-read as wider words.
    """
    kept = [(size, stride) for size, stride in zip(shape, strides, strict=True) if size != 1]
    if not kept or kept[-1][1] != 1:
        kept.append((1, 1))
    merged = [kept[-1]]
    for size, stride in reversed(kept[:-1]):
        inner_size, inner_stride = merged[-1]
        if stride == inner_size * inner_stride:
            merged[-1] = (size * inner_size, inner_stride)
        else:
            merged.append((size, stride))
    merged.reverse()
    return merged
