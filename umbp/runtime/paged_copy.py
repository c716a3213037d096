"""Copying bytes while checksumming them: into and out of the pages of a pool, and any
copy whose bytes carry an xxh3-64 (the SSD tier's reads and writes, Mooncake's bounce
buffer).

An object in a paged pool (the embedded `SlabPool`, the server's shared-memory pool) lies
in (offset, length) regions of one byte view, not necessarily adjacent. Every path hashes
a piece right after copying it, while it is still in cache, so a checksum costs no second
pass over memory: pieces longer than `CHUNK_BYTES` are copied and hashed `CHUNK_BYTES` at
a time (a piece of a few MiB would otherwise be hashed from the last-level cache or from
memory). Streaming and one-shot xxh3-64 agree, so a piece copied whole yields the same
value. Measured (docs/performance.md, "Checksums while copying"): chunking a 1 MiB piece
costs Python calls and gains nothing where a core's L2 holds it, so only longer pieces
are chunked.

Where umbp's native copy loop is built (`umbp.runtime._copyhash`, compiled at install)
and the CPU has AVX2, every object over 240 bytes is copied and hashed in one pass
instead: each 64-byte stripe is loaded once, stored and fed to the hash from the same
registers, without the GIL, its stores streamed past the cache where the destination is
32-byte aligned. It yields the same xxh3-64 as the `xxhash` package, and copies faster
than numpy's memcpy of the same bytes (docs/performance.md, "Checksums while copying").
Without it (no C compiler at install: said once in the log; no AVX2) the chunked Python
path below runs:

Large pieces are copied by numpy, which releases the GIL while it copies (a memoryview
slice assignment holds it throughout): the copies run on transfer threads beside the
thread that drives the model, and a 64 MiB restore held the GIL for whole pieces at a
time. Pieces under 128 KiB (the server's 64 KiB pages) keep the slice assignment: numpy's
call costs ~0.3 us more, an eighth of a 64 KiB copy, and the GIL is held for ~2 us.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Final, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = [
    "CHUNK_BYTES",
    "NATIVE_FROM_BYTES",
    "Hashes",
    "copies_hash",
    "copy_bytes",
    "copy_hashing",
    "hashed_per_key",
    "native_kernel",
    "object_checksum",
    "object_hashes",
    "pages_checksum",
    "read_regions",
    "write_regions",
]

if TYPE_CHECKING:
    from typing_extensions import Buffer

logger = logging.getLogger("umbp")


class Hashes(Protocol):
    """The xxh3-64 of `count` objects of `nbytes` each, fed while a batch copy moves
    their bytes in pieces, over one call or several (a layer at a time): the native
    loop's ``_copyhash.Hashes``."""

    @property
    def count(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def move(self, sources: Buffer, destinations: Buffer, sizes: Buffer) -> None:
        """Copy the ranges (uint64 arrays of one length, object by object, as many
        per object, each object's in its byte order), feeding each object's hash."""
        ...
    def digests(self) -> list[int | None]:
        """Each object's xxh3-64; None where not all of its bytes were moved."""
        ...


def _native_module() -> ModuleType | None:
    """The native loop, where it is built and this CPU runs its vector kernel (AVX2): its
    portable kernel measured 0.51-0.73 of memcpy, slower than the Python chunks over
    xxhash's own vector code, so a CPU without AVX2 (an Arm host) keeps the latter."""
    try:
        from umbp.runtime import _copyhash
    except ImportError as error:
        logger.warning(
            "umbp: the native copy loop (umbp.runtime._copyhash) is not built (%s); copies "
            "with checksums run in Python, ~0.8 of memcpy instead of ~1.0 (reinstall umbp "
            "where a C compiler is available)", error)
        return None
    if _copyhash.kernel() != "avx2":
        logger.info("umbp: this CPU has no AVX2; copies with checksums run in Python "
                    "(faster here than the native loop's portable kernel)")
        return None
    return _copyhash


_native: ModuleType | None = _native_module()
NATIVE_FROM_BYTES: Final = 241
"""Objects from this size on take xxh3's long-input path, the one the native loop runs;
shorter ones are hashed by the `xxhash` package."""


def native_kernel() -> str | None:
    """The native copy loop's kernel in use ('avx2', or 'scalar' while a test or benchmark
    asks for it), or None when copies run in Python."""
    return None if _native is None else str(_native.kernel())


def copies_hash(nbytes: int) -> bool:
    """Whether a batch copy of objects of `nbytes` can hash them as it moves them: the
    native loop runs here and the objects are long enough for it."""
    return _native is not None and nbytes >= NATIVE_FROM_BYTES


def object_hashes(count: int, nbytes: int, *, stream: bool = True) -> Hashes | None:
    """Hash states for `count` objects of `nbytes` whose bytes a batch copy moves in
    pieces (:meth:`umbp.gpu.copier.BlockCopier.hashes`), where the native loop runs; None
    where it does not (or objects are short): then a checksum is a pass of its own.
    `stream` False: the copy keeps its destination in cache (read again at once)."""
    if _native is None or not copies_hash(nbytes):
        return None
    hashes: Hashes = _native.Hashes(count, nbytes, stream=stream)
    return hashes


def hashed_per_key(
    digests: Sequence[int | None] | None, keys: int, asked: str
) -> Sequence[int | None]:
    """A loan's or a reservation's checksums hashed by the caller's copy, one per key
    (None: all unknown); raises where `asked` got another count."""
    if digests is None:
        return (None,) * keys
    if len(digests) != keys:
        raise ValueError(f"{asked} needs one checksum (or None) per key: {keys}, got "
                         f"{len(digests)}")
    return digests


_GIL_FREE_FROM_BYTES = 128 * 1024
CHUNK_BYTES: Final = 512 * 1024
"""Bytes copied before they are hashed, for pieces over twice this: half the L2 of a core
here (AMD EPYC, 1 MiB) and of the Xeons umbp runs on (1-2 MiB)."""


def copy_bytes(destination: memoryview, source: memoryview | bytearray) -> None:
    """``destination[:] = source``, without the GIL for large pieces."""
    if len(destination) < _GIL_FREE_FROM_BYTES:
        destination[:] = source
    elif len(source) != len(destination):  # numpy would broadcast a 1-byte source
        raise ValueError(f"copying {len(source)} bytes into {len(destination)}")
    else:
        np.copyto(np.frombuffer(destination, np.uint8), np.frombuffer(source, np.uint8))


def _copy_hashing_into(
    hasher: xxhash.xxh3_64, destination: memoryview, source: memoryview | bytearray
) -> None:
    """Copy `source` into `destination` (same length), feeding `hasher` the bytes that
    arrived, a cache-sized chunk at a time."""
    total = len(destination)
    if len(source) != total:
        raise ValueError(f"copying {len(source)} bytes into {total}")
    if total <= 2 * CHUNK_BYTES:
        copy_bytes(destination, source)
        hasher.update(destination)
        return
    source_view = memoryview(source)
    for start in range(0, total, CHUNK_BYTES):
        arrived = destination[start : start + CHUNK_BYTES]
        copy_bytes(arrived, source_view[start : start + CHUNK_BYTES])
        hasher.update(arrived)


def copy_hashing(destination: memoryview, source: memoryview | bytearray) -> int:
    """Copy `source` into `destination` (same length); xxh3-64 of the bytes now there."""
    if _native is not None and len(destination) >= NATIVE_FROM_BYTES:
        return int(_native.copy_hash(destination, source))
    if len(destination) <= 2 * CHUNK_BYTES:
        copy_bytes(destination, source)
        return int(xxhash.xxh3_64_intdigest(destination))
    hasher = xxhash.xxh3_64()
    _copy_hashing_into(hasher, destination, source)
    return int(hasher.intdigest())


def write_regions(
    memory: memoryview, regions: Sequence[Sequence[int]], source: memoryview | bytearray
) -> int:
    """Copy `source` into its regions of `memory`; xxh3-64 of the bytes now stored there."""
    if _native is not None and len(source) >= NATIVE_FROM_BYTES:
        return int(_native.copy_hash_regions(memory, regions, source, True))
    if len(regions) == 1:
        offset, length = regions[0]
        return copy_hashing(memory[offset : offset + length], source)
    hasher = xxhash.xxh3_64()
    start = 0
    for offset, length in regions:
        _copy_hashing_into(hasher, memory[offset : offset + length],
                           source[start : start + length])
        start += length
    return int(hasher.intdigest())


def read_regions(
    memory: memoryview, regions: Sequence[Sequence[int]], destination: memoryview
) -> int:
    """Copy an object out of its regions of `memory` into `destination` (exactly its
    size); xxh3-64 of what arrived there, to compare with the stored checksum."""
    if _native is not None and len(destination) >= NATIVE_FROM_BYTES:
        return int(_native.copy_hash_regions(memory, regions, destination, False))
    if len(regions) == 1:
        offset, length = regions[0]
        return copy_hashing(destination, memory[offset : offset + length])
    hasher = xxhash.xxh3_64()
    start = 0
    for offset, length in regions:
        _copy_hashing_into(hasher, destination[start : start + length],
                           memory[offset : offset + length])
        start += length
    return int(hasher.intdigest())


def object_checksum(
    memory: npt.NDArray[np.uint8], pages: Sequence[int], nbytes: int, copied: int | None
) -> int:
    """An object's xxh3-64: ``copied`` where a copy computed it as it moved the bytes,
    else read from its pages (:func:`pages_checksum`)."""
    return pages_checksum(memory, pages, nbytes) if copied is None else copied


def pages_checksum(memory: npt.NDArray[np.uint8], pages: Sequence[int], nbytes: int) -> int:
    """xxh3-64 of an object of `nbytes` lying across `pages` of `memory` (uint8
    ``[pages, page_bytes]``) in order: what a store that lends or reserves pages in
    place checks and records (the same value a copy hashed while it copied)."""
    page_bytes = int(memory.shape[1])
    if len(pages) == 1:
        return int(xxhash.xxh3_64_intdigest(memory[pages[0], :nbytes]))
    hasher = xxhash.xxh3_64()
    for index, page in enumerate(pages):
        hasher.update(memory[page, : min(page_bytes, nbytes - index * page_bytes)])
    return int(hasher.intdigest())
