"""Copying an object into and out of the pages of a pool, checksumming as it goes.

An object in a paged pool (the embedded `SlabPool`, the server's shared-memory pool) lies
in (offset, length) regions of one byte view, not necessarily adjacent. Both directions
hash each piece right after copying it, while it is still in cache, so a checksum costs
no second pass over memory. Streaming and one-shot xxh3-64 agree, so the single-region
shortcut yields the same value.

Large pieces are copied by numpy, which releases the GIL while it copies (a memoryview
slice assignment holds it throughout): the copies run on transfer threads beside the
thread that drives the model, and a 64 MiB restore held the GIL for whole pieces at a
time. Pieces under 128 KiB (the server's 64 KiB pages) keep the slice assignment: numpy's
call costs ~0.3 us more, an eighth of a 64 KiB copy, and the GIL is held for ~2 us.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["read_regions", "write_regions"]

_GIL_FREE_FROM_BYTES = 128 * 1024


def _copy(destination: memoryview, source: memoryview | bytearray) -> None:
    """``destination[:] = source``, without the GIL for large pieces."""
    if len(destination) < _GIL_FREE_FROM_BYTES:
        destination[:] = source
    elif len(source) != len(destination):  # numpy would broadcast a 1-byte source
        raise ValueError(f"copying {len(source)} bytes into {len(destination)}")
    else:
        np.copyto(np.frombuffer(destination, np.uint8), np.frombuffer(source, np.uint8))


def write_regions(
    memory: memoryview, regions: Sequence[Sequence[int]], source: memoryview | bytearray
) -> int:
    """Copy `source` into its regions of `memory`; xxh3-64 of the bytes now stored there."""
    if len(regions) == 1:
        offset, length = regions[0]
        stored = memory[offset : offset + length]
        _copy(stored, source)
        return int(xxhash.xxh3_64_intdigest(stored))
    hasher = xxhash.xxh3_64()
    start = 0
    for offset, length in regions:
        stored = memory[offset : offset + length]
        _copy(stored, source[start : start + length])
        hasher.update(stored)
        start += length
    return int(hasher.intdigest())


def read_regions(
    memory: memoryview, regions: Sequence[Sequence[int]], destination: memoryview
) -> int:
    """Copy an object out of its regions of `memory` into `destination` (exactly its
    size); xxh3-64 of what arrived there, to compare with the stored checksum."""
    if len(regions) == 1:
        offset, length = regions[0]
        _copy(destination, memory[offset : offset + length])
        return int(xxhash.xxh3_64_intdigest(destination))
    hasher = xxhash.xxh3_64()
    start = 0
    for offset, length in regions:
        delivered = destination[start : start + length]
        _copy(delivered, memory[offset : offset + length])
        hasher.update(delivered)
        start += length
    return int(hasher.intdigest())
