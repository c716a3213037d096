"""Copies into and out of a paged pool's regions: bytes and checksums agree on both
paths (the slice assignment for small pieces, numpy's GIL-free copy for large ones)."""

from __future__ import annotations

import os

import pytest
import xxhash

from umbp.runtime.paged_copy import CHUNK_BYTES, copy_hashing, read_regions, write_regions

KIB = 1024


@pytest.mark.parametrize("piece", [4 * KIB, 64 * KIB, 256 * KIB])
def test_an_object_split_over_regions_comes_back_whole_with_its_checksum(piece: int) -> None:
    memory = memoryview(bytearray(8 * piece))
    regions = [(5 * piece, piece), (0, piece), (2 * piece, piece // 2)]  # not adjacent
    source = os.urandom(sum(length for _, length in regions))
    stored = write_regions(memory, regions, memoryview(source))
    assert stored == xxhash.xxh3_64_intdigest(source)
    destination = memoryview(bytearray(len(source)))
    assert read_regions(memory, regions, destination) == stored
    assert bytes(destination) == source


def test_a_short_source_is_refused_not_broadcast() -> None:
    memory = memoryview(bytearray(128 * KIB))
    with pytest.raises(ValueError):
        write_regions(memory, [(0, 64 * KIB)], memoryview(b"\x07"))
    assert bytes(memory[: 64 * KIB]) == bytes(64 * KIB)


@pytest.mark.parametrize("sizes", [[3 * 1024 * KIB + 5], [64 * KIB, 2 * 1024 * KIB + 1, 7]])
def test_pieces_longer_than_two_chunks_are_hashed_chunk_by_chunk_to_the_same_checksum(
    sizes: list[int],
) -> None:
    """Past 2 x CHUNK_BYTES a piece is copied and hashed a chunk at a time (ending on a
    partial chunk here): the checksum is the one-shot xxh3-64 of the whole object."""
    assert max(sizes) > 2 * CHUNK_BYTES
    memory = memoryview(bytearray(sum(sizes) + 4 * KIB))
    regions, offset = [], 4 * KIB
    for size in reversed(sizes):  # laid out backwards: regions not in memory order
        regions.insert(0, (offset, size))
        offset += size
    regions = [(o - 4 * KIB, n) for o, n in regions]
    source = os.urandom(sum(sizes))
    stored = write_regions(memory, regions, memoryview(source))
    assert stored == xxhash.xxh3_64_intdigest(source)
    destination = memoryview(bytearray(len(source)))
    assert read_regions(memory, regions, destination) == stored
    assert bytes(destination) == source
    copied = memoryview(bytearray(len(source)))
    assert copy_hashing(copied, memoryview(source)) == stored and bytes(copied) == source
