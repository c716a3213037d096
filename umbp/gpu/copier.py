"""Gather whole blocks of one cache group into byte rows, and scatter them back.

One stored *object* is one block of every layer of the group, concatenated in layer order
(a layer handed as several tensors contributes each in turn). Rows of a uint8
``[n, object_bytes]`` buffer are objects. Every layer costs one batched index op per call
(per chunk on CUDA), never a Python loop over blocks.

On CUDA the copies run on a dedicated stream that first waits for the forward pass: for
an event the forward thread recorded (``after``: the copy may be enqueued from another
thread, whose current stream knows nothing of the forward pass), else for the calling
thread's current stream. Device<->host traffic goes through a device bounce buffer so
that each chunk crosses the bus as one contiguous copy between device and pinned host
memory. On CPU the same code runs synchronously. A scatter may be limited to one layer
of the group (:meth:`BlockCopier.scatter_layer_async`): a staged object keeps its
layout, and a layer is a slice of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from operator import index as as_index
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from umbp.gpu.block_view import WORD_SIZES, BlockView, block_view, widest_word, word_dtype
from umbp.gpu.handle import CopyHandle
from umbp.gpu.layout import LayerLayout, LayerTensors, describe_layer, layer_parts

DEFAULT_DEVICE_STAGING_BYTES = 64 << 20

LENT_CHUNK_BYTES = 2 << 20
"""Host scratch for gathering lent rows, a chunk of objects at a time (one layer part
each): allocated and faulted in with the copier, so no restore pays fresh pages."""
"""Cap of the device bounce buffer; larger batches are copied in chunks of this size."""

ForwardMark: TypeAlias = "torch.cuda.Event | None"
"""Where a forward pass ended on its stream (a CUDA event), or None: nothing to order
after (CPU copies run after the forward pass returned; a CUDA caller on the forward
thread orders after its current stream)."""


def mark_forward_end(device: torch.device) -> ForwardMark:
    """Record the end of the work enqueued so far on this thread's current stream of
    ``device``: a copy enqueued later from another thread orders after it."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass(frozen=True, slots=True, eq=False)
class _Part:
    """One KV tensor of the group and where its block sits inside an object."""

    view: BlockView
    column: int
    word_bytes: int
    """Widest word dividing the KV view, the object size and this part's column, i.e.
    the word to copy with whenever the rows start on a word boundary."""

    def rows_as_blocks(self, row_words: torch.Tensor, word_bytes: int) -> torch.Tensor:
        """This part's columns of ``rows`` (given as ``word_bytes`` words), shaped like blocks."""
        columns = row_words[
            :, self.column // word_bytes : (self.column + self.view.block_bytes) // word_bytes
        ]
        block_shape = self.view.block_shape(word_bytes)
        if len(block_shape) == 1:
            return columns
        return columns.view(int(columns.shape[0]), *block_shape)


class BlockCopier:
    """Moves whole blocks of one cache group between paged KV tensors and byte rows.

    Not thread-safe: one copier is driven by one thread (it owns one stream and one
    bounce buffer, which consecutive calls reuse in stream order).
    """

    def __init__(
        self,
        layers: Sequence[LayerTensors],
        num_blocks: int,
        *,
        block_dim: int | None = None,
        device_staging_bytes: int = DEFAULT_DEVICE_STAGING_BYTES,
    ) -> None:
        per_layer = [layer_parts(layer) for layer in layers]
        tensors = tuple(part for parts in per_layer for part in parts)
        if not tensors:
            raise ValueError("a cache group needs at least one KV tensor")
        bounds = [0]
        for parts in per_layer:
            bounds.append(bounds[-1] + len(parts))
        self._device = _common_device(tensors)
        self._num_blocks = num_blocks
        self._layouts = tuple(describe_layer(t, num_blocks, block_dim=block_dim) for t in tensors)
        self._object_bytes = sum(layout.block_bytes for layout in self._layouts)
        self._parts = _place_parts(tensors, self._layouts, self._object_bytes)
        self._layer_parts = tuple(
            self._parts[start:stop] for start, stop in pairwise(bounds)
        )
        self._chunk_objects = max(1, device_staging_bytes // max(1, self._object_bytes))
        self._stream = (
            torch.cuda.Stream(device=self._device) if self._device.type == "cuda" else None
        )
        self._bounce: torch.Tensor | None = None
        self._scratch = (
            torch.zeros(LENT_CHUNK_BYTES, dtype=torch.uint8) if self._stream is None else None
        )

    @property
    def object_bytes(self) -> int:
        """Bytes of one stored object: one block of every tensor of the group."""
        return self._object_bytes

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def device(self) -> torch.device:
        """Where the KV tensors live."""
        return self._device

    @property
    def num_layers(self) -> int:
        """The layers the group was built from, in order."""
        return len(self._layer_parts)

    @property
    def layouts(self) -> tuple[LayerLayout, ...]:
        """Layout of every tensor, in object order (list/tuple layers flattened)."""
        return self._layouts

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` into rows of ``out`` (uint8 ``[n, object_bytes]``)."""
        self.gather_async(block_ids, out).wait()

    def scatter(
        self, block_ids: Sequence[int], src: torch.Tensor, src_rows: Sequence[int] | None = None
    ) -> None:
        """Copy rows of ``src`` (uint8 ``[n, object_bytes]``, or lent rows: see
        :meth:`scatter_async`) into blocks ``block_ids``."""
        self.scatter_async(block_ids, src, src_rows=src_rows).wait()

    def gather_async(
        self, block_ids: Sequence[int], out: torch.Tensor, after: ForwardMark = None
    ) -> CopyHandle:
        """Enqueue a gather; ``out`` is readable after ``handle.wait()``.

        Duplicate ids are allowed (each row gets its own copy of the block). ``after``:
        the forward pass's end (:func:`mark_forward_end`), when the caller is not the
        thread that ran it.
        """
        ids = self._checked_ids(block_ids)
        self._check_rows(out, len(ids), "out")
        return self._enqueue(ids, out, lambda index: self._gather_rows(index, out), after)

    def scatter_async(
        self, block_ids: Sequence[int], src: torch.Tensor, after: ForwardMark = None,
        src_rows: Sequence[int] | None = None,
    ) -> CopyHandle:
        """Enqueue a scatter; the KV blocks hold ``src`` once the handle completes.

        A forward pass that reads the blocks calls ``handle.make_stream_wait()`` (GPU-side
        wait) or ``handle.wait()``. ``src`` must stay unmodified until then. Duplicate ids
        are rejected: two rows for one block would leave the block undefined.
        ``src_rows``: block ``block_ids[i]`` comes from row ``src_rows[i]`` of ``src``
        (host memory, rows at least ``object_bytes`` wide: a store's pages lent in
        place), instead of row ``i``; host KV only (a device copy needs pinned staging).
        """
        return self._scatter(block_ids, src, self._parts, after, src_rows)

    def scatter_layer_async(
        self, layer: int, block_ids: Sequence[int], src: torch.Tensor, after: ForwardMark = None,
        src_rows: Sequence[int] | None = None,
    ) -> CopyHandle:
        """:meth:`scatter_async` of one layer's part of every row (the layer's slice of
        each object): the other layers' blocks are not touched."""
        if not 0 <= layer < len(self._layer_parts):
            raise IndexError(f"layer {layer} out of range for {len(self._layer_parts)} layers")
        return self._scatter(block_ids, src, self._layer_parts[layer], after, src_rows)

    def _scatter(
        self, block_ids: Sequence[int], src: torch.Tensor, parts: Sequence[_Part],
        after: ForwardMark, src_rows: Sequence[int] | None,
    ) -> CopyHandle:
        ids = self._checked_ids(block_ids)
        _check_unique(ids)
        if src_rows is not None:
            rows = self._checked_source_rows(src, src_rows, len(ids))
            self._scatter_on_host(ids, src, parts, rows)
            return CopyHandle.completed()
        self._check_rows(src, len(ids), "src")
        if self._stream is None:
            self._scatter_on_host(ids, src, parts, None)
            return CopyHandle.completed()
        return self._enqueue(ids, src, lambda index: self._scatter_rows(index, src, parts), after)

    # -- validation -------------------------------------------------------------------

    def _checked_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = [as_index(block_id) for block_id in block_ids]
        for block_id in ids:
            if not 0 <= block_id < self._num_blocks:
                raise IndexError(
                    f"block id {block_id} out of range for num_blocks={self._num_blocks}"
                )
        return ids

    def _check_rows(self, rows: torch.Tensor, num_objects: int, name: str) -> None:
        expected = (num_objects, self._object_bytes)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != expected:
            raise ValueError(
                f"{name} must be uint8 of shape {list(expected)}, "
                f"got {rows.dtype} of shape {list(rows.shape)}"
            )
        if not rows.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if rows.device not in (self._device, torch.device("cpu")):
            raise ValueError(f"{name} is on {rows.device}; the KV is on {self._device}")

    def _checked_source_rows(
        self, src: torch.Tensor, src_rows: Sequence[int], num_objects: int
    ) -> list[int]:
        if self._device.type != "cpu" or src.device.type != "cpu":
            raise ValueError("src_rows scatters host rows into host KV only; "
                             f"the KV is on {self._device}, src on {src.device}")
        if src.dtype != torch.uint8 or src.dim() != 2 or not src.is_contiguous():
            raise ValueError(f"src must be contiguous uint8 rows, got {src.dtype} of shape "
                             f"{list(src.shape)}")
        if int(src.shape[1]) < self._object_bytes:
            raise ValueError(f"src rows of {int(src.shape[1])} bytes cannot hold objects "
                             f"of {self._object_bytes}")
        rows = [as_index(row) for row in src_rows]
        if len(rows) != num_objects:
            raise ValueError(f"{len(rows)} src_rows for {num_objects} blocks")
        for row in rows:
            if not 0 <= row < int(src.shape[0]):
                raise IndexError(f"src row {row} out of range for {int(src.shape[0])} rows")
        return rows

    # -- enqueueing -------------------------------------------------------------------

    def _enqueue(
        self, ids: list[int], rows: torch.Tensor, copy: Callable[[torch.Tensor], None],
        after: ForwardMark,
    ) -> CopyHandle:
        if not ids:
            return CopyHandle.completed()
        host_index = torch.tensor(ids, dtype=torch.int64, pin_memory=self._stream is not None)
        if self._stream is None:
            copy(host_index)
            return CopyHandle.completed()
        return self._enqueue_on_stream(self._stream, host_index, rows, copy, after)

    def _enqueue_on_stream(
        self,
        stream: torch.cuda.Stream,
        host_index: torch.Tensor,
        rows: torch.Tensor,
        copy: Callable[[torch.Tensor], None],
        after: ForwardMark,
    ) -> CopyHandle:
        # The forward pass wrote (or still reads) the KV: order the copy after its end,
        # or after everything enqueued so far on this thread's current stream.
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            index = host_index.to(self._device, non_blocking=True)
            copy(index)
            event = torch.cuda.Event()
            event.record(stream)
        if rows.is_cuda:
            # Tell the caching allocator the caller's buffer is in use on our stream.
            rows.record_stream(stream)
        return CopyHandle(event, self._device, keepalive=(host_index, index, rows))

    # -- the copies -------------------------------------------------------------------

    def _gather_rows(self, index: torch.Tensor, out: torch.Tensor) -> None:
        for start, stop, rows in self._chunks(out):
            chunk_index = index[start:stop]
            row_words = self._rows_by_word(rows)
            for part in self._parts:
                word = min(part.word_bytes, max(row_words))
                torch.index_select(
                    part.view.words(word),
                    0,
                    chunk_index,
                    out=part.rows_as_blocks(row_words[word], word),
                )
            if rows is not out:
                out[start:stop].copy_(rows, non_blocking=True)

    def _scatter_rows(
        self, index: torch.Tensor, src: torch.Tensor, parts: Sequence[_Part]
    ) -> None:
        for start, stop, rows in self._chunks(src):
            if rows is not src:
                rows.copy_(src[start:stop], non_blocking=True)
            chunk_index = index[start:stop]
            row_words = self._rows_by_word(rows)
            for part in parts:
                word = min(part.word_bytes, max(row_words))
                part.view.words(word).index_copy_(
                    0, chunk_index, part.rows_as_blocks(row_words[word], word)
                )

    def _scatter_on_host(
        self, ids: list[int], src: torch.Tensor, parts: Sequence[_Part],
        src_rows: list[int] | None,
    ) -> None:
        # numpy's fancy assignment moves whole rows at ~memcpy speed, 1.6x faster than
        # torch's index_copy_ on CPU (docs/performance.md, micro-measurements); both
        # release the GIL. CUDA keeps index_copy_ on the copy stream.
        if not ids:
            return
        index = np.asarray(ids, dtype=np.intp)
        lent = None if src_rows is None else torch.tensor(src_rows, dtype=torch.int64)
        row_words = self._rows_by_word(src)
        for part in parts:
            word = min(part.word_bytes, max(row_words))
            source = part.rows_as_blocks(row_words[word], word)
            blocks = part.view.words(word).numpy()
            if lent is None:
                blocks[index] = source.numpy()
            else:
                self._scatter_lent(blocks, index, source, lent, part.view.block_bytes)

    def _scatter_lent(
        self, blocks: npt.NDArray[Any], index: npt.NDArray[np.intp], source: torch.Tensor,
        src_rows: torch.Tensor, block_bytes: int,
    ) -> None:
        """``blocks[index] = source[src_rows]``, the rows gathered a chunk at a time into
        the copier's scratch (a fresh temporary of a whole layer costs page faults: the
        first restore of a process waited 17 ms for its first layer instead of 2)."""
        per_chunk = max(1, LENT_CHUNK_BYTES // max(1, block_bytes))
        scratch = self._scratch
        if scratch is None or scratch.numel() < per_chunk * block_bytes:
            scratch = self._scratch = torch.zeros(per_chunk * block_bytes, dtype=torch.uint8)
        for start in range(0, int(src_rows.shape[0]), per_chunk):
            chunk = src_rows[start : start + per_chunk]
            count = int(chunk.shape[0])
            out = scratch[: count * block_bytes].view(source.dtype).view(
                count, *source.shape[1:]
            )
            torch.index_select(source, 0, chunk, out=out)
            blocks[index[start : start + per_chunk]] = out.numpy()

    def _rows_by_word(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        """``rows`` read as every word size it allows, widest included (one view each).

        Parts then never build their own views of the whole rows; rows that do not start
        on an 8-byte boundary (an odd slice of a caller's buffer) get narrower words.
        """
        aligned = widest_word(int(rows.storage_offset()), int(rows.stride(0)))
        return {word: rows.view(word_dtype(word)) for word in WORD_SIZES if aligned % word == 0}

    def _chunks(self, caller_rows: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, stop, rows on the KV device) for each chunk of the caller's rows.

        Rows already on the KV device are used in place, in one chunk; host rows bounce
        through the device buffer, whose size bounds the chunk.
        """
        num_objects = int(caller_rows.shape[0])
        if caller_rows.device == self._device:
            yield 0, num_objects, caller_rows
            return
        for start in range(0, num_objects, self._chunk_objects):
            stop = min(start + self._chunk_objects, num_objects)
            yield start, stop, self._bounce_rows(stop - start)

    def _bounce_rows(self, num_objects: int) -> torch.Tensor:
        # Allocated on the copy stream (we run inside its context) and grown on demand up
        # to one chunk: reuse and release are ordered by that stream, so no event needed.
        if self._bounce is None or int(self._bounce.shape[0]) < num_objects:
            self._bounce = torch.empty(
                (num_objects, self._object_bytes), dtype=torch.uint8, device=self._device
            )
        return self._bounce[:num_objects]


def _common_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {tensor.device for tensor in tensors}
    if len(devices) != 1:
        raise ValueError(f"all KV tensors of a group must share one device, got {devices}")
    device: torch.device = devices.pop()
    return device


def _place_parts(
    tensors: Sequence[torch.Tensor], layouts: Sequence[LayerLayout], object_bytes: int
) -> tuple[_Part, ...]:
    """Block view of each tensor and its byte offset inside an object, in order."""
    parts: list[_Part] = []
    column = 0
    for tensor, layout in zip(tensors, layouts, strict=True):
        view = block_view(tensor, layout.block_dim)
        word = widest_word(view.word_bytes, object_bytes, column)
        parts.append(_Part(view=view, column=column, word_bytes=word))
        column += layout.block_bytes
    return tuple(parts)


def _check_unique(ids: Sequence[int]) -> None:
    seen: set[int] = set()
    for block_id in ids:
        if block_id in seen:
            raise ValueError(f"scatter got block id {block_id} more than once")
        seen.add(block_id)
