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
