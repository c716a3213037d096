"""Copies into and out of a paged pool's regions: bytes and checksums agree on every
path: the native loop (this CPU's best kernel and the portable scalar one) and the
Python fallback (the slice assignment for small pieces, numpy's GIL-free copy for large
ones, chunked past 2 x CHUNK_BYTES)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from umbp.runtime import _copyhash, paged_copy
from umbp.runtime.paged_copy import (
    CHUNK_BYTES,
    NATIVE_FROM_BYTES,
    copy_hashing,
    native_kernel,
    read_regions,
    write_regions,
)

KIB = 1024
PATHS = ("native", "native-scalar", "python")


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test through one copy path (the native ones whatever this CPU would use)."""
    if request.param == "python":
        monkeypatch.setattr(paged_copy, "_native", None)
        yield request.param
        return
    monkeypatch.setattr(paged_copy, "_native", _copyhash)
    previous = _copyhash.use_kernel("scalar" if request.param == "native-scalar" else "best")
    try:
        yield request.param
    finally:
        _copyhash.use_kernel(previous)


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as info:
        return re.search(r"^flags\s*:.*\bavx2\b", info.read(), re.MULTILINE) is not None


def test_umbp_copies_run_the_native_loop_wherever_the_cpu_has_avx2() -> None:
    """Every other test here would pass on the Python fallback alone: the install must
    have compiled the loop (importing it above), and umbp's copies must run it on a CPU
    with AVX2 and keep the Python chunks on one without (whichever machine runs this)."""
    assert native_kernel() == ("avx2" if _cpu_has_avx2() else None)


@pytest.mark.parametrize("piece", [4 * KIB, 64 * KIB, 256 * KIB])
def test_an_object_split_over_regions_comes_back_whole_with_its_checksum(
    path: str, piece: int
) -> None:
    memory = memoryview(bytearray(8 * piece))
    regions = [(5 * piece, piece), (0, piece), (2 * piece, piece // 2)]  # not adjacent
    source = os.urandom(sum(length for _, length in regions))
    stored = write_regions(memory, regions, memoryview(source))
    assert stored == xxhash.xxh3_64_intdigest(source)
    destination = memoryview(bytearray(len(source)))
    assert read_regions(memory, regions, destination) == stored
    assert bytes(destination) == source


def test_a_short_source_is_refused_not_broadcast(path: str) -> None:
    memory = memoryview(bytearray(128 * KIB))
    with pytest.raises(ValueError):
        write_regions(memory, [(0, 64 * KIB)], memoryview(b"\x07" * 1000))
    with pytest.raises(ValueError):
        write_regions(memory, [(0, 64 * KIB)], memoryview(b"\x07"))
    with pytest.raises(ValueError):
        copy_hashing(memory[: 64 * KIB], memoryview(b"\x07" * 1000))
    assert bytes(memory[: 64 * KIB]) == bytes(64 * KIB)


def test_a_region_outside_the_pool_is_refused_before_anything_is_copied() -> None:
    memory = bytearray(8 * KIB)
    with pytest.raises(ValueError, match="outside a pool of 8192 bytes"):
        _copyhash.copy_hash_regions(memory, [(0, 4 * KIB), (6 * KIB, 4 * KIB)],
                                    bytes(8 * KIB), True)
    with pytest.raises(ValueError, match="outside"):
        _copyhash.copy_hash_regions(memory, [(-1, 4 * KIB)], bytes(4 * KIB), True)
    assert memory == bytearray(8 * KIB)


@pytest.mark.parametrize("size", [NATIVE_FROM_BYTES - 1, NATIVE_FROM_BYTES, 1000, 64 * KIB + 1])
def test_every_size_around_the_native_threshold_hashes_as_xxhash_does(
    path: str, size: int
) -> None:
    source = os.urandom(size)
    copied = memoryview(bytearray(size))
    assert copy_hashing(copied, memoryview(source)) == xxhash.xxh3_64_intdigest(source)
    assert bytes(copied) == source


@pytest.mark.parametrize("sizes", [[3 * 1024 * KIB + 5], [64 * KIB, 2 * 1024 * KIB + 1, 7]])
def test_pieces_longer_than_two_chunks_are_hashed_chunk_by_chunk_to_the_same_checksum(
    path: str, sizes: list[int],
) -> None:
    """Past 2 x CHUNK_BYTES the Python path copies and hashes a chunk at a time (ending
    on a partial chunk here), the native one a stripe at a time: the checksum is the
    one-shot xxh3-64 of the whole object either way."""
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


def test_the_native_copy_lets_other_threads_run() -> None:
    """The GIL is released while bytes move: a thread that only needs the GIL keeps
    counting while another copies 256 MiB."""
    source = np.ones(256 << 20, dtype=np.uint8)
    destination = np.zeros_like(source)
    ticks = 0
    copying = threading.Event()
    done = threading.Event()

    def count() -> None:
        nonlocal ticks
        copying.wait()
        while not done.is_set():
            ticks += 1

    counter = threading.Thread(target=count)
    counter.start()
    copying.set()
    before = ticks
    copy_hashing(memoryview(destination), memoryview(source))
    during = ticks - before
    done.set()
    counter.join()
    assert during > 0, "the counting thread never ran while the copy was in progress"
    assert np.array_equal(destination, source)


def test_without_the_native_loop_umbp_says_so_and_copies_in_python() -> None:
    """An install without a C compiler: the import of the loop fails, the log says what
    that costs, and copies still hash as xxhash does."""
    script = textwrap.dedent("""
        import importlib.abc, logging, os, sys, xxhash
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "umbp.runtime._copyhash":
                    raise ImportError("no compiler at install (test)")
        sys.meta_path.insert(0, Hide())
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        from umbp.runtime import paged_copy
        assert paged_copy.native_kernel() is None
        data = os.urandom(3 << 20)
        out = memoryview(bytearray(len(data)))
        assert paged_copy.copy_hashing(out, memoryview(data)) == xxhash.xxh3_64_intdigest(data)
        assert bytes(out) == data
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert ("WARNING umbp: the native copy loop (umbp.runtime._copyhash) is not built "
            "(no compiler at install (test)); copies with checksums run in Python") in done.stderr


def ranges_of(*triples: tuple[int, int, int]) -> list[np.ndarray]:
    return [np.array(column, np.uint64) for column in zip(*triples)]


def test_hashes_refuse_more_bytes_than_an_object_before_anything_moves() -> None:
    """An object fed past its size (a caller's bug) raises, and no byte of the call moved:
    a copy that overran would write past the object's pages."""
    source = np.arange(2 * 300, dtype=np.uint8)
    target = np.zeros_like(source)
    hashes = _copyhash.Hashes(2, 300)
    first = ranges_of((source.ctypes.data, target.ctypes.data, 250),
                      (source.ctypes.data + 300, target.ctypes.data + 300, 200))
    hashes.move(*first)
    again = ranges_of((source.ctypes.data + 250, target.ctypes.data + 250, 50),
                      (source.ctypes.data + 500, target.ctypes.data + 500, 101))
    target[:] = 7
    with pytest.raises(ValueError, match="object 1 would get 301 bytes of 300"):
        hashes.move(*again)
    assert not (target != 7).any()  # not even object 0's 50 bytes, which fit
    assert hashes.digests() == [None, None]
    hashes.move(*ranges_of((source.ctypes.data + 250, target.ctypes.data + 250, 50),
                           (source.ctypes.data + 500, target.ctypes.data + 500, 100)))
    assert hashes.digests() == [xxhash.xxh3_64_intdigest(source[:300].tobytes()),
                                xxhash.xxh3_64_intdigest(source[300:].tobytes())]
    assert np.array_equal(target[250:300], source[250:300])
    assert np.array_equal(target[500:], source[500:])


def test_hashes_refuse_ranges_that_do_not_split_evenly_and_short_objects() -> None:
    buffer = np.zeros(1024, np.uint8)
    triple = (buffer.ctypes.data, buffer.ctypes.data + 512, 300)
    with pytest.raises(ValueError, match="3 ranges do not split evenly among 2 objects"):
        _copyhash.Hashes(2, 300).move(*ranges_of(triple, triple, triple))
    with pytest.raises(ValueError, match="objects over 240 bytes, got 1 of 240"):
        _copyhash.Hashes(1, 240)
    with pytest.raises(ValueError, match="three uint64 arrays of one length"):
        _copyhash.Hashes(1, 300).move(np.zeros(2, np.uint64), np.zeros(1, np.uint64),
                                      np.zeros(1, np.uint64))
    assert paged_copy.object_hashes(4, 240) is None  # xxh3's short inputs: hashed apart
