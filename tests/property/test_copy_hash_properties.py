"""The native copy loop (umbp/runtime/_copyhash.c) against the `xxhash` package: for
any object over 240 bytes, split into any regions laid anywhere in a pool, in either
direction, with either kernel and at any alignment (the AVX2 kernel streams its stores
past the cache where the destination is 32-byte aligned), the bytes arrive whole and the
checksum is `xxh3_64_intdigest` of the object. A checksum that disagreed would make every
object written by one path and read by another look corrupt (the SSD tier, Mooncake and
MORI store what these copies hash)."""

from __future__ import annotations

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.runtime import _copyhash

STRIPE_EDGES = st.sampled_from([64 * k + d for k in range(4, 40) for d in (-1, 0, 1)])


@st.composite
def scattered_objects(draw: st.DrawFn) -> tuple[bytes, list[tuple[int, int]], int]:
    """An object, the regions it is cut into (in object order, placed in any order
    with gaps between them), and the pool size that holds them."""
    size = draw(st.one_of(st.integers(241, 4096), STRIPE_EDGES, st.integers(4096, 70_000)))
    payload = draw(st.binary(min_size=size, max_size=size))
    cuts = sorted(draw(st.sets(st.integers(1, size - 1), max_size=9)))
    lengths = [end - start for start, end in zip([0, *cuts], [*cuts, size])]
    order = draw(st.permutations(range(len(lengths))))
    offsets = [0] * len(lengths)
    at = draw(st.integers(0, 100))
    for index in order:
        offsets[index] = at
        at += lengths[index] + draw(st.integers(0, 70))
    return payload, list(zip(offsets, lengths)), at


def buffer(nbytes: int, shift: int) -> memoryview:
    """`nbytes` of zeros starting `shift` bytes past a 64-byte boundary: on a boundary
    the AVX2 kernel streams its stores past the cache, elsewhere it stores normally."""
    raw = np.zeros(nbytes + 128, dtype=np.uint8)
    start = -raw.ctypes.data % 64 + shift
    return memoryview(raw[start : start + nbytes])


@settings(max_examples=300, deadline=None)
@given(scattered_objects(), st.sampled_from(["best", "scalar"]), st.sampled_from([0, 0, 8, 33]))
def test_a_scattered_copy_hashes_as_xxhash_and_moves_every_byte(
    case: tuple[bytes, list[tuple[int, int]], int], kernel: str, shift: int
) -> None:
    payload, regions, pool_bytes = case
    previous = _copyhash.use_kernel(kernel)
    try:
        pool = buffer(pool_bytes, shift)
        written = _copyhash.copy_hash_regions(pool, regions, payload, True)
        back = buffer(len(payload), shift)
        read = _copyhash.copy_hash_regions(pool, regions, back, False)
        whole = buffer(len(payload), shift)
        copied = _copyhash.copy_hash(whole, payload)
    finally:
        _copyhash.use_kernel(previous)
    expected = xxhash.xxh3_64_intdigest(payload)
    assert written == read == copied == expected
    assert bytes(back) == bytes(whole) == payload
    assert b"".join(bytes(pool[offset : offset + length]) for offset, length in regions) == payload


@st.composite
def objects_in_pieces(draw: st.DrawFn) -> tuple[list[bytes], list[list[int]], list[int]]:
    """Objects of one size, each cut into as many pieces at its own cut points, and the
    calls they are fed in (how many pieces of each object per call, in order)."""
    size = draw(st.one_of(st.integers(241, 4096), STRIPE_EDGES, st.integers(4096, 40_000)))
    count = draw(st.integers(1, 4))
    pieces = draw(st.integers(1, min(9, size)))
    payloads = [draw(st.binary(min_size=size, max_size=size)) for _ in range(count)]
    cuts = [sorted(draw(st.sets(st.integers(1, size - 1), min_size=pieces - 1,
                                max_size=pieces - 1))) for _ in range(count)]
    calls: list[int] = []
    left = pieces
    while left:
        calls.append(draw(st.integers(1, left)))
        left -= calls[-1]
    return payloads, cuts, calls


@settings(max_examples=300, deadline=None)
@given(objects_in_pieces(), st.sampled_from(["best", "scalar"]), st.sampled_from([0, 0, 8, 33]),
       st.booleans())
def test_objects_hashed_across_calls_hash_as_xxhash_and_move_every_byte(
    case: tuple[list[bytes], list[list[int]], list[int]], kernel: str, shift: int,
    stream: bool,
) -> None:
    """`Hashes`, as a restore feeds it a layer at a time: each object's pieces in its
    byte order, any cut points (a stripe straddling pieces and calls), the pieces
    landing scattered and out of order in the destination; the checksum of an object is
    None until its last byte moved, then `xxh3_64_intdigest` of it. Alike with stores
    that stream past the cache and with plain ones (`stream=False`)."""
    payloads, cuts, calls = case
    size = len(payloads[0])
    previous = _copyhash.use_kernel(kernel)
    try:
        sources = [np.frombuffer(payload, np.uint8) for payload in payloads]
        landing = buffer(size * len(payloads) + 64 * len(payloads) * (len(cuts[0]) + 1), shift)
        into = np.frombuffer(landing, np.uint8)
        spans = [list(zip([0, *own], [*own, size])) for own in cuts]
        places = []  # per object, where each piece lands: pieces reversed, 64 apart
        at = 0
        for own in spans:
            starts = {}
            for start, end in reversed(own):
                starts[start] = at
                at += end - start + 64
            places.append(starts)
        hashes = _copyhash.Hashes(len(payloads), size, stream=stream)
        first = 0
        for taken in calls:
            ranges = [(sources[i].ctypes.data + start, into.ctypes.data + places[i][start],
                       end - start)
                      for i, own in enumerate(spans) for start, end in own[first : first + taken]]
            assert hashes.digests() == [None] * len(payloads)
            hashes.move(*(np.array(column, np.uint64) for column in zip(*ranges)))
            first += taken
    finally:
        _copyhash.use_kernel(previous)
    assert hashes.digests() == [xxhash.xxh3_64_intdigest(payload) for payload in payloads]
    for payload, own, starts in zip(payloads, spans, places):
        landed = b"".join(bytes(into[starts[s] : starts[s] + e - s]) for s, e in own)
        assert landed == payload
