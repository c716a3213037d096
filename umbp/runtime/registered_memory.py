"""Registered host memory, transport-neutral: what the Mooncake and MORI adapters share.

Both transports move bytes zero-copy only from memory registered with them, so both keep
the registered ranges, a registered bounce buffer for everything else, and cut a batch
into transport calls the same way (`plan_chunks`). Both verify payloads with the same
xxh3-64 `checksum`. What each stores beside the payload (Mooncake a trailer, MORI a
sidecar object) stays in its adapter.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import xxhash

from umbp.runtime.host_memory import allocate_prefaulted_slab

__all__ = [
    "HostArea",
    "Piece",
    "RegisteredRanges",
    "buffer_address",
    "checksum",
    "plan_chunks",
    "temporarily_registered",
]

_STAGING_ALIGN = 64  # staged objects start on cache-line boundaries (memcpy speed)


class _PyBuffer(ctypes.Structure):
    """CPython's `Py_buffer`, to read the address behind any buffer (read-only ones too,
    which `ctypes.c_char.from_buffer` refuses)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a C-contiguous buffer. Valid while `view` (which
    holds its own export of the underlying object) is alive."""
    exported = _PyBuffer()
    if _get_buffer(view, ctypes.byref(exported), 0) != 0:  # raises on failure
        raise ValueError("buffer does not export its memory")
    try:
        return int(exported.buf or 0)
    finally:
        _release_buffer(ctypes.byref(exported))


class RegisteredRanges:
    """Disjoint [start, end) address ranges registered with a transport; answers "does
    this buffer lie inside one?" with one bisect."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, address: int, nbytes: int) -> None:
        index = bisect.bisect_right(self._starts, address)
        self._starts.insert(index, address)
        self._ends.insert(index, address + nbytes)

    def remove(self, address: int) -> bool:
        index = bisect.bisect_left(self._starts, address)
        if index < len(self._starts) and self._starts[index] == address:
            del self._starts[index], self._ends[index]
            return True
        return False

    def contains(self, address: int, nbytes: int) -> bool:
        index = bisect.bisect_right(self._starts, address) - 1
        return index >= 0 and address + nbytes <= self._ends[index]

    def starts(self) -> tuple[int, ...]:
        return tuple(self._starts)

    def spans(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of every range."""
        return tuple(zip(self._starts, self._ends))


def checksum(view: memoryview) -> int:
    """xxh3-64 of a payload, as stored beside it (Mooncake's trailer, MORI's sidecar)."""
    return int(xxhash.xxh3_64_intdigest(view))


class HostArea:
    """A prefaulted private mapping with its address and a byte view."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.mapping: mmap.mmap = allocate_prefaulted_slab(nbytes)
        self.view = memoryview(self.mapping)
        self.address = buffer_address(self.view)

    def release(self) -> None:
        self.view.release()
        try:
            self.mapping.close()
        except BufferError:
            pass  # a view handed out is still alive; the mapping dies with it


@dataclass(slots=True)
class Piece:
    """One key of a batch on its way to or from the transport."""

    index: int
    """Position in the caller's batch."""
    view: memoryview
    pointer: int
    """Where the transport reads or writes the payload: the caller's buffer or the bounce."""
    staged: memoryview | None
    """The bounce-buffer region used instead of the caller's buffer (payload, then any
    trailer room), or None when the transport reads or writes the caller's buffer."""
    temporary: bool
    """The caller's buffer is registered for this call only (larger than the bounce)."""


def plan_chunks(
    views: list[memoryview],
    ranges: RegisteredRanges,
    bounce: HostArea | None,
    max_keys: int,
    *,
    stage_below: int = 0,
    trailer_bytes: int = 0,
) -> Iterator[list[Piece]]:
    """Cut a batch into transport calls of at most `max_keys` keys whose staged payloads
    fit the bounce buffer together. `Piece.index` is the position in `views`.

    A payload in registered memory goes direct unless it is smaller than `stage_below`
    (then it is staged too, so that payload and trailer travel as one piece). A staged
    piece's region has `trailer_bytes` of room after the payload. A payload outside
    registered memory that does not fit the bounce buffer goes alone, marked for
    registration during its call."""
    chunk: list[Piece] = []
    staged_bytes = 0
    for index, view in enumerate(views):
        nbytes = view.nbytes
        address = buffer_address(view) if nbytes else 0
        registered = not nbytes or ranges.contains(address, nbytes)
        fits = bounce is not None and nbytes + trailer_bytes <= bounce.nbytes
        if registered and (nbytes >= stage_below or not fits):
            piece = Piece(index, view, address, None, False)
        elif fits:
            assert bounce is not None
            start = -(-staged_bytes // _STAGING_ALIGN) * _STAGING_ALIGN
            if start + nbytes + trailer_bytes > bounce.nbytes:
                yield chunk
                chunk, start = [], 0
            staged_bytes = start + nbytes + trailer_bytes
            staged = bounce.view[start:staged_bytes]
            piece = Piece(index, view, bounce.address + start, staged, False)
        else:
            if chunk:
                yield chunk
            yield [Piece(index, view, address, None, True)]
            chunk, staged_bytes = [], 0
            continue
        chunk.append(piece)
        if len(chunk) == max_keys:
            yield chunk
            chunk, staged_bytes = [], 0
    if chunk:
        yield chunk


@contextmanager
def temporarily_registered(
    chunk: list[Piece],
    register: Callable[[int, int], bool],
    unregister: Callable[[int], None],
) -> Iterator[bool]:
    """Register the chunk's `temporary` pieces (`register(address, nbytes)`) for the
    duration of one transport call, and unregister them afterwards whatever happens.
    Yields False when a registration was refused: the call must not be made, because the
    transport would read or write unregistered memory. An exception from `register`
    propagates after the registrations made so far are undone."""
    registered: list[int] = []
    try:
        accepted = True
        for piece in chunk:
            if piece.temporary:
                if not register(piece.pointer, piece.view.nbytes):
                    accepted = False
                    break
                registered.append(piece.pointer)
        yield accepted
    finally:
        for pointer in registered:
            unregister(pointer)
