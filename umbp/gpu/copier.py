"""Whole blocks of one cache group, between paged KV tensors and rows of host memory.

One stored *object* is one block of every layer of the group, concatenated in layer order
(a layer handed as several tensors contributes each in turn; a tensor's block in
row-major order of its remaining dims). Host memory holds objects as rows of a uint8
``[rows, row_bytes]`` array, an object at the start of its row (``row_bytes >=
object_bytes``): staging, or a store's pages lent or reserved in place, in any order;
or, where a store's pages are smaller than an object, as a list of pages per object
(its bytes in order across them).

A copy is described once, as a :class:`BlockCopy`, and carried out by a device
(:mod:`umbp.gpu.device`): with the KV in host memory by numpy (:meth:`BlockCopy.run_on_host`,
whole rows at memcpy speed, the GIL released); with the KV on a GPU as byte ranges
(:meth:`BlockCopy.ranges`: source, destination, length) that the copy engines move in one
batched submission, straight between the KV blocks and the host rows. A copy may be
limited to one layer of the group (a layer is a slice of each object), so a restore can
hand the forward pass its first layer after one layer's bytes.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from operator import index as as_index
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from umbp.gpu.block_view import WORD_SIZES, BlockView, block_view, widest_word, word_dtype
from umbp.gpu.layout import LayerLayout, LayerTensors, block_major, describe_layer, layer_parts
from umbp.runtime.paged_copy import Hashes, copies_hash, object_hashes

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["HOST_CHUNK_BYTES", "BlockCopier", "BlockCopy", "CopyRanges"]

HOST_CHUNK_BYTES = 2 << 20
"""Host scratch for rows that are not contiguous (a pool's pages in any order): blocks
pass through it a chunk at a time, in cache, so a copy still reads and writes each byte
once in memory. Allocated and faulted in with the copier: a fresh temporary per copy cost
a process's first restore 17 ms of page faults before its first layer."""


@dataclass(frozen=True, slots=True, eq=False)
class CopyRanges:
    """A copy as byte ranges: ``sizes[i]`` bytes from address ``sources[i]`` to
    ``destinations[i]`` (uint64 arrays of one length)."""

    sources: npt.NDArray[np.uint64]
    destinations: npt.NDArray[np.uint64]
    sizes: npt.NDArray[np.uint64]

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def __len__(self) -> int:
        return int(self.sizes.shape[0])


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


@dataclass(frozen=True, slots=True, eq=False)
class BlockCopy:
    """One copy between blocks ``block_ids`` of a group and rows ``rows`` of
    ``memory`` (block ``block_ids[i]`` <-> row ``rows[i]``), all layers or one.
    Validated when made (:meth:`BlockCopier.copy`)."""

    copier: BlockCopier
    to_kv: bool
    """True: rows into the KV blocks (a load); False: blocks into the rows (a store)."""
    block_ids: tuple[int, ...]
    memory: npt.NDArray[np.uint8]
    rows: tuple[int, ...]
    layer: int | None = None
    pages: tuple[tuple[int, ...], ...] | None = None
    """Where objects span several rows (pages): each object's rows, in order (``rows``
    then holds their first ones)."""
    hashes: Hashes | None = None
    """Where given (KV in host memory), the copy feeds each object's xxh3-64 as its
    bytes move: one pass over them instead of a second one to checksum them. A copy
    limited to a layer feeds that layer's slice, so its layers' copies, run in order,
    hash whole objects."""

    @property
    def nbytes(self) -> int:
        """Bytes this copy moves."""
        return len(self.block_ids) * sum(part.view.block_bytes for part in self._parts)

    @property
    def _parts(self) -> tuple[_Part, ...]:
        return self.copier.parts(self.layer)

    def ranges(self) -> CopyRanges:
        """The copy as byte ranges, object by object, each object's in its byte order
        (part by part, split where its bytes pass from one page to the next): a
        device's batched copy takes these, and a hashing copy feeds them in this order."""
        count = len(self.block_ids)
        ids = np.asarray(self.block_ids, dtype=np.uint64)
        base, stride = np.uint64(self.memory.ctypes.data), np.uint64(self.memory.strides[0])
        page_bytes = int(self.memory.shape[1]) if self.pages is not None else None
        pages = np.asarray(self.pages if self.pages is not None else [[r] for r in self.rows],
                           dtype=np.uint64).reshape(count, -1 if count else 1)
        kv: list[npt.NDArray[np.uint64]] = []
        host: list[npt.NDArray[np.uint64]] = []
        sizes: list[npt.NDArray[np.uint64]] = []
        for part in self._parts:
            view = part.view
            offsets, lengths, kv_offsets = _pieces(part, page_bytes)
            block_starts = np.uint64(view.address) + ids * np.uint64(view.block_stride)
            kv.append(block_starts[:, None] + kv_offsets[None, :])
            if page_bytes is None:
                host_starts = base + pages[:, 0] * stride
                host.append(host_starts[:, None] + offsets[None, :])
            else:
                within = offsets % np.uint64(page_bytes)
                page_of = (offsets // np.uint64(page_bytes)).astype(np.intp)
                host.append(base + pages[:, page_of] * stride + within[None, :])
            sizes.append(np.broadcast_to(lengths, (count, len(lengths))))
        kv_all, host_all = _object_major(kv), _object_major(host)
        sources, destinations = (host_all, kv_all) if self.to_kv else (kv_all, host_all)
        return CopyRanges(sources, destinations, _object_major(sizes))

    def run_on_host(self) -> None:
        """Carry the copy out with numpy (KV in host memory); releases the GIL."""
        self.copier.run_on_host(self)

    def of_layer(self, layer: int) -> BlockCopy:
        """The same copy limited to one layer, without checking its blocks and pages
        again: a layer-by-layer restore validates once, not once per layer (128 objects
        of 8 pages took ~0.2 ms per layer, before its first byte could move)."""
        if self.layer is not None:
            raise ValueError(f"this copy is already limited to layer {self.layer}")
        if not 0 <= layer < self.copier.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.copier.num_layers} layers")
        return replace(self, layer=layer)


def _pieces(
    part: _Part, page_bytes: int | None
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """A part's contiguous runs as (offset in the object, length, offset in the block),
    each cut where the object passes into its next page (``page_bytes`` None: none)."""
    view = part.view
    runs = view.segment_offsets.shape[0]
    starts = np.uint64(part.column) + np.arange(runs, dtype=np.uint64) * np.uint64(
        view.segment_bytes
    )
    lengths = np.full(runs, view.segment_bytes, dtype=np.uint64)
    if page_bytes is None or not _crosses(starts, view.segment_bytes, page_bytes):
        return starts, lengths, view.segment_offsets
    pieces: list[tuple[int, int, int]] = []
    for start, kv_offset in zip(starts.tolist(), view.segment_offsets.tolist()):
        end, at = start + view.segment_bytes, start
        while at < end:
            stop = min(end, (at // page_bytes + 1) * page_bytes)
            pieces.append((at, stop - at, kv_offset + at - start))
            at = stop
    columns = np.asarray(pieces, dtype=np.uint64).reshape(-1, 3)
    return columns[:, 0].copy(), columns[:, 1].copy(), columns[:, 2].copy()


def _crosses(starts: npt.NDArray[np.uint64], length: int, page_bytes: int) -> bool:
    first = starts // np.uint64(page_bytes)
    last = (starts + np.uint64(max(length, 1) - 1)) // np.uint64(page_bytes)
    return bool((first != last).any())


def _object_major(per_part: list[npt.NDArray[np.uint64]]) -> npt.NDArray[np.uint64]:
    """Parts' ``[objects, runs]`` arrays as one flat array, object by object."""
    return np.ascontiguousarray(np.concatenate(per_part, axis=1)).reshape(-1)


class BlockCopier:
    """The KV tensors of one cache group, as objects: describes copies between their
    blocks and host rows, and carries them out on the host.

    ``run_on_host`` uses one scratch buffer: one thread at a time."""

    def __init__(
        self, layers: Sequence[LayerTensors], num_blocks: int, *, block_dim: int | None = None
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
        self._layer_parts = tuple(self._parts[start:stop] for start, stop in pairwise(bounds))
        # Per thread: a host device runs a copier's copies on several lanes at once.
        self._scratch = threading.local()

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

    def parts(self, layer: int | None) -> tuple[_Part, ...]:
        """Every tensor's part of an object, or one layer's."""
        return self._parts if layer is None else self._layer_parts[layer]

    def copy(
        self,
        block_ids: Sequence[int],
        memory: npt.NDArray[np.uint8],
        rows: Sequence[int] | None = None,
        *,
        to_kv: bool,
        layer: int | None = None,
        pages: Sequence[Sequence[int]] | None = None,
        hashes: Hashes | None = None,
    ) -> BlockCopy:
        """Describe a copy between ``block_ids`` and ``rows`` of ``memory`` (None: its
        first rows, in order), or, with rows (pages) narrower than an object, the
        ``pages`` of ``memory`` holding each object in order; raises before anything
        moves when the copy would touch a block or a byte it must not. A load
        (``to_kv``) names each block once: two rows for one block would leave it
        undefined. ``hashes`` (from :meth:`hashes`, one per block) hash the objects as
        they move."""
        ids = self._checked_ids(block_ids)
        if to_kv:
            _check_unique(ids)
        if layer is not None and not 0 <= layer < len(self._layer_parts):
            raise IndexError(f"layer {layer} out of range for {len(self._layer_parts)} layers")
        if hashes is not None and (hashes.count, hashes.nbytes) != (len(ids), self._object_bytes):
            raise ValueError(f"hashes for {hashes.count} objects of {hashes.nbytes} bytes do "
                             f"not fit {len(ids)} objects of {self._object_bytes}")
        if pages is not None:
            checked_pages = self._checked_pages(memory, len(ids), pages)
            if checked_pages is not None:
                return BlockCopy(self, to_kv, tuple(ids), memory,
                                 tuple(p[0] for p in checked_pages), layer, checked_pages,
                                 hashes)
            rows = [p[0] for p in pages]
        checked_rows = self._checked_rows(memory, len(ids), rows)
        return BlockCopy(self, to_kv, tuple(ids), memory, checked_rows, layer, hashes=hashes)

    @property
    def copies_hash(self) -> bool:
        """Whether this host's copies hash as they move (KV in host memory, umbp's native
        copy loop running its vector kernel, objects over 240 bytes); not on a GPU,
        whose copy engines move the bytes, not a CPU."""
        return self._device.type == "cpu" and copies_hash(self._object_bytes)

    def hashes(self, count: int, *, stream: bool = True) -> Hashes | None:
        """Hash states for a copy of ``count`` objects where :attr:`copies_hash`; None
        where a checksum stays a pass of its own. ``stream`` False: the copy keeps what
        it writes in cache, for a destination read again at once (a staging row)."""
        if not self.copies_hash:
            return None
        return object_hashes(count, self._object_bytes, stream=stream)

    def gather(
        self, block_ids: Sequence[int], memory: npt.NDArray[np.uint8],
        rows: Sequence[int] | None = None, *, pages: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Copy blocks into rows (or pages) now (KV in host memory)."""
        self.copy(block_ids, memory, rows, to_kv=False, pages=pages).run_on_host()

    def scatter(
        self, block_ids: Sequence[int], memory: npt.NDArray[np.uint8],
        rows: Sequence[int] | None = None, layer: int | None = None, *,
        pages: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Copy rows (or pages) into blocks now (KV in host memory)."""
        self.copy(block_ids, memory, rows, to_kv=True, layer=layer, pages=pages).run_on_host()

    # -- validation -------------------------------------------------------------------

    def _checked_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = [as_index(block_id) for block_id in block_ids]
        for block_id in ids:
            if not 0 <= block_id < self._num_blocks:
                raise IndexError(
                    f"block id {block_id} out of range for num_blocks={self._num_blocks}"
                )
        return ids

    def _checked_pages(
        self, memory: npt.NDArray[np.uint8], count: int, pages: Sequence[Sequence[int]]
    ) -> tuple[tuple[int, ...], ...] | None:
        """Each object's pages, checked; None when one page holds an object (rows)."""
        _check_host_memory(memory)
        page_bytes = int(memory.shape[1])
        needed = max(1, -(-self._object_bytes // max(1, page_bytes)))
        if len(pages) != count:
            raise ValueError(f"{count} blocks need {count} page lists, got {len(pages)}")
        if needed == 1:
            return None
        checked: list[tuple[int, ...]] = []
        for object_pages in pages:
            owned = tuple(as_index(page) for page in object_pages)[:needed]
            if len(owned) < needed:
                raise ValueError(f"an object of {self._object_bytes} bytes spans {needed} "
                                 f"pages of {page_bytes} bytes, got {len(owned)}")
            for page in owned:
                if not 0 <= page < memory.shape[0]:
                    raise IndexError(f"page {page} out of range for {memory.shape[0]} pages")
            checked.append(owned)
        return tuple(checked)

    def _checked_rows(
        self, memory: npt.NDArray[np.uint8], count: int, rows: Sequence[int] | None
    ) -> tuple[int, ...]:
        _check_host_memory(memory)
        if int(memory.shape[1]) < self._object_bytes:
            raise ValueError(
                f"host rows must be contiguous and at least {self._object_bytes} bytes wide "
                f"(one object), got shape {list(memory.shape)} and strides "
                f"{list(memory.strides)}"
            )
        if rows is None:
            if count > memory.shape[0]:
                raise ValueError(f"{count} blocks need {count} rows, the memory has "
                                 f"{memory.shape[0]}")
            return tuple(range(count))
        checked = tuple(as_index(row) for row in rows)
        if len(checked) != count:
            raise ValueError(f"{count} blocks need {count} rows, got {len(checked)}")
        for row in checked:
            if not 0 <= row < memory.shape[0]:
                raise IndexError(f"row {row} out of range for {memory.shape[0]} rows")
        return checked

    # -- on the host --------------------------------------------------------------------

    def run_on_host(self, copy: BlockCopy) -> None:
        # numpy's fancy assignment moves whole rows at about memcpy speed (1.6x faster
        # than torch's index ops on CPU, docs/performance.md); gathers from a strided
        # view use torch's index_select (see _copy_through_scratch); both release the GIL.
        if self._device.type != "cpu":
            raise ValueError(f"the KV is on {self._device}: a device carries this copy out")
        if not copy.block_ids:
            return
        if copy.hashes is not None:
            ranges = copy.ranges()
            copy.hashes.move(ranges.sources, ranges.destinations, ranges.sizes)
            return
        if copy.pages is not None:  # objects across pages: the ranges a device would move
            _move_ranges(copy.ranges())
            return
        rows = copy.rows
        first = rows[0]
        in_order = rows == tuple(range(first, first + len(rows)))
        memory = torch.from_numpy(copy.memory)
        blocks = np.asarray(copy.block_ids, dtype=np.intp)
        if in_order:
            self._copy_contiguous(copy, memory[first : first + len(rows)], blocks)
        else:
            self._copy_through_scratch(copy, memory, blocks, np.asarray(rows, dtype=np.int64))

    def _copy_contiguous(
        self, copy: BlockCopy, rows: torch.Tensor, blocks: npt.NDArray[np.intp]
    ) -> None:
        row_words = _rows_by_word(rows)
        index = torch.from_numpy(blocks.astype(np.int64)) if not copy.to_kv else None
        for part in copy.copier.parts(copy.layer):
            word = min(part.word_bytes, max(row_words))
            objects = part.rows_as_blocks(row_words[word], word)
            if index is None:
                part.view.words(word).numpy()[blocks] = objects.numpy()
            else:
                torch.index_select(part.view.words(word), 0, index, out=objects)

    def _copy_through_scratch(
        self, copy: BlockCopy, memory: torch.Tensor, blocks: npt.NDArray[np.intp],
        rows: npt.NDArray[np.int64],
    ) -> None:
        """Rows in any order: ``kv[blocks] = memory[rows]`` (or back), a chunk of rows at
        a time through the scratch (in cache)."""
        row_words = _rows_by_word(memory)
        for part in copy.copier.parts(copy.layer):
            word = min(part.word_bytes, max(row_words))
            objects = part.rows_as_blocks(row_words[word], word)
            kv = part.view.words(word)
            per_chunk = max(1, HOST_CHUNK_BYTES // max(1, part.view.block_bytes))
            scratch = self._scratch_for(per_chunk * part.view.block_bytes)
            for start in range(0, len(blocks), per_chunk):
                chunk_rows = rows[start : start + per_chunk]
                chunk_blocks = blocks[start : start + per_chunk]
                staged = scratch[: len(chunk_rows) * part.view.block_bytes].view(
                    kv.dtype
                ).view(len(chunk_rows), *kv.shape[1:])
                # torch's index_select gathers from a strided view in place (numpy's take
                # made a contiguous copy of the whole view first: the pool's slab, per
                # chunk); numpy's fancy assignment scatters at memcpy speed.
                if copy.to_kv:
                    torch.index_select(objects, 0, torch.from_numpy(chunk_rows), out=staged)
                    kv.numpy()[chunk_blocks] = staged.numpy()
                else:
                    torch.index_select(kv, 0, torch.from_numpy(chunk_blocks), out=staged)
                    objects.numpy()[chunk_rows] = staged.numpy()

    def _scratch_for(self, nbytes: int) -> torch.Tensor:
        """This thread's scratch, at least ``nbytes`` (faulted in when made)."""
        scratch: torch.Tensor | None = getattr(self._scratch, "buffer", None)
        if scratch is None or scratch.numel() < nbytes:
            scratch = self._scratch.buffer = torch.zeros(max(nbytes, HOST_CHUNK_BYTES),
                                                         dtype=torch.uint8)
        return scratch


def _native_move() -> Callable[[Buffer, Buffer, Buffer], None] | None:
    """umbp's native batch copy (``umbp.runtime._copyhash``, built at install), or None
    where it is not built (its absence is logged by :mod:`umbp.runtime.paged_copy`)."""
    try:
        from umbp.runtime import _copyhash
    except ImportError:
        return None
    return _copyhash.move_ranges


_native_move_ranges = _native_move()


def _move_ranges(ranges: CopyRanges) -> None:
    """Every range by memmove without the GIL: in one native call where it is built (a
    layer of 128 objects is 256 ranges: a Python call per range cost about as much as
    the bytes, and took the GIL back from the model thread each time), else one foreign
    call per range."""
    if _native_move_ranges is not None:
        _native_move_ranges(ranges.sources, ranges.destinations, ranges.sizes)
        return
    for source, destination, size in zip(
        ranges.sources.tolist(), ranges.destinations.tolist(), ranges.sizes.tolist()
    ):
        ctypes.memmove(destination, source, size)


def _rows_by_word(rows: torch.Tensor) -> dict[int, torch.Tensor]:
    """``rows`` read as every word size it allows, widest included (one view each).

    Parts then never build their own views of the whole rows; rows that do not start
    on an 8-byte boundary (an odd slice of a caller's buffer) get narrower words.
    """
    aligned = widest_word(int(rows.data_ptr()), int(rows.stride(0)), int(rows.shape[1]))
    return {word: rows.view(word_dtype(word)) for word in WORD_SIZES if aligned % word == 0}


def _common_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {tensor.device for tensor in tensors}
    if len(devices) != 1:
        raise ValueError(f"all KV tensors of a group must share one device, got {devices}")
    device: torch.device = devices.pop()
    return device


def _place_parts(
    tensors: Sequence[torch.Tensor], layouts: Sequence[LayerLayout], object_bytes: int
) -> tuple[_Part, ...]:
    """Block view of each tensor (kernel blocks folded) and its byte offset inside an
    object, in order."""
    parts: list[_Part] = []
    column = 0
    for tensor, layout in zip(tensors, layouts, strict=True):
        view = block_view(block_major(tensor, layout), layout.block_dim)
        word = widest_word(view.word_bytes, object_bytes, column)
        parts.append(_Part(view=view, column=column, word_bytes=word))
        column += layout.block_bytes
    return tuple(parts)


def _check_host_memory(memory: npt.NDArray[np.uint8]) -> None:
    if not isinstance(memory, np.ndarray) or memory.dtype != np.uint8 or memory.ndim != 2:
        raise ValueError("host rows must be a uint8 numpy array of shape [rows, row_bytes]")
    if memory.size and memory.strides[1] != 1:
        raise ValueError(f"host rows must be contiguous, got strides {list(memory.strides)}")


def _check_unique(ids: Sequence[int]) -> None:
    seen: set[int] = set()
    for block_id in ids:
        if block_id in seen:
            raise ValueError(f"a load names block id {block_id} more than once")
        seen.add(block_id)
