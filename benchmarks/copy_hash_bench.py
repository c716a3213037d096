"""What a checksum costs on top of a copy: memcpy, copy then hash, and umbp's copy that
hashes each cache-sized chunk right after copying it, side by side in one run.

    python benchmarks/copy_hash_bench.py [--mib 256] [--repeats 5] [--json FILE] [--quick]

For objects of 256 KiB, 1, 4 and 16 MiB, `--mib` MiB are copied object by object from a
prefaulted source into a shared-memory mapping (as a client copies into `umbp serve`'s
pool), three ways, alternating pass by pass, best of `--repeats`:

* ``memcpy``: numpy's copy, nothing else (the reference);
* ``copy, then hash``: the copy, then xxh3-64 of the whole object (umbp before: a second
  pass, from cache while the object fits the core's L2);
* ``copy_hashing``: `umbp.runtime.paged_copy.copy_hashing`, what every path uses now:
  objects over 2 x `CHUNK_BYTES` are copied and hashed a chunk at a time, so the hash
  reads what the copy just wrote, from cache.

Ratios are to memcpy; a fused copy-and-hash loop in native code would be the ceiling
Python cannot reach (see docs/performance.md, "Checksums while copying").
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.runtime.paged_copy import CHUNK_BYTES, copy_hashing
from umbp.testing.table import format_table

SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)


def shared_mapping(nbytes: int) -> mmap.mmap:
    """A prefaulted /dev/shm mapping, as the server's pool is."""
    fd, path = tempfile.mkstemp(prefix="umbp-copy-hash-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)
    np.frombuffer(mapping, np.uint8).fill(1)
    return mapping


def passes(total: int, size: int) -> dict[str, Callable[[], None]]:
    source = np.random.default_rng(size).integers(0, 256, size=total, dtype=np.uint8)
    mapping = shared_mapping(total)
    target = np.frombuffer(mapping, np.uint8)
    view, source_view = memoryview(mapping), memoryview(source)
    starts = range(0, total - size + 1, size)

    def memcpy() -> None:
        for start in starts:
            np.copyto(target[start : start + size], source[start : start + size])

    def copy_then_hash() -> None:
        for start in starts:
            np.copyto(target[start : start + size], source[start : start + size])
            xxhash.xxh3_64_intdigest(view[start : start + size])

    def chunked() -> None:
        for start in starts:
            copy_hashing(view[start : start + size], source_view[start : start + size])

    return {"memcpy": memcpy, "copy, then hash": copy_then_hash, "copy_hashing": chunked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB copied per pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="32 MiB, 2 passes")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.mib, arguments.repeats = min(arguments.mib, 32), min(arguments.repeats, 2)
    total = arguments.mib << 20
    rows, figures = [], []
    for size in SIZES:
        runs = passes(max(total, size), size)
        best = {name: float("inf") for name in runs}
        for _ in range(arguments.repeats):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - started)
        moved = max(total, size) // size * size
        gbps = {name: moved / seconds / 1e9 for name, seconds in best.items()}
        figures.append({"object_bytes": size, "gbps": gbps,
                        "ratio": {name: gbps[name] / gbps["memcpy"] for name in gbps}})
        rows.append([f"{size >> 10} KiB", *(f"{gbps[name]:.2f}" for name in runs),
                     *(f"{gbps[name] / gbps['memcpy']:.3f}" for name in list(runs)[1:])])
    print(format_table(["object", "memcpy GB/s", "copy, then hash GB/s", "copy_hashing GB/s",
                        "then hash / memcpy", "copy_hashing / memcpy"], rows))
    print(f"chunk: {CHUNK_BYTES >> 10} KiB, for objects over {2 * CHUNK_BYTES >> 10} KiB; "
          f"{arguments.mib} MiB per pass, best of {arguments.repeats}")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps({"benchmark": "copy-hash", "quick": arguments.quick,
                                              "chunk_bytes": CHUNK_BYTES, "rows": figures},
                                             indent=2))


if __name__ == "__main__":
    main()
