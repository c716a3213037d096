"""What a checksum costs on top of a copy: memcpy, copy then hash, umbp's Python copy that
hashes each cache-sized chunk right after copying it, and umbp's native loop that hashes
each stripe as it copies it, side by side in one run.

    python benchmarks/copy_hash_bench.py [--mib 256] [--repeats 5] [--json FILE] [--quick]

For objects of 256 KiB, 1, 4 and 16 MiB, `--mib` MiB are copied object by object from a
prefaulted source into a shared-memory mapping (as a client copies into `umbp serve`'s
pool), five ways, alternating pass by pass (each repeat starting with another), best of
`--repeats`:

* ``memcpy``: numpy's copy, nothing else (the reference);
* ``copy, then hash``: the copy, then xxh3-64 of the whole object (umbp before: a second
  pass, from cache while the object fits the core's L2);
* ``python chunks``: `umbp.runtime.paged_copy.copy_hashing` without the native loop (an
  install without a C compiler): objects over 2 x `CHUNK_BYTES` are copied and hashed a
  chunk at a time, so the hash reads what the copy just wrote, from cache;
* ``native``: `copy_hashing` through the native loop (`umbp.runtime._copyhash`, this
  CPU's best kernel; what umbp runs where that is AVX2): each 64-byte stripe loaded once,
  stored, and hashed from the same registers;
* ``native, scalar``: the same loop with the portable kernel (slower than the Python
  chunks here: a CPU without AVX2 keeps the Python chunks).

Ratios are to memcpy (see docs/performance.md, "Checksums while copying").
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.runtime import paged_copy
from umbp.runtime.paged_copy import CHUNK_BYTES, copy_hashing
from umbp.runtime.server.shm import create_shared_pool, release_shared_pool
from umbp.testing.table import format_table

SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)


def passes(total: int, size: int) -> dict[str, Callable[[], None]]:
    # Into a pool made as `umbp serve` makes its own (a posix_fallocate'd /dev/shm file),
    # from a source 64-byte aligned as torch's CPU allocator aligns a KV tensor.
    source = measure.random_source(1, total, block_bytes=min(total, 64 << 20))[0]
    pool = create_shared_pool(total)
    atexit.register(release_shared_pool, pool)
    mapping = pool.view
    target = np.frombuffer(mapping, np.uint8)
    target.fill(1)
    view, source_view = memoryview(mapping), memoryview(source)
    starts = range(0, total - size + 1, size)

    def memcpy() -> None:
        for start in starts:
            np.copyto(target[start : start + size], source[start : start + size])

    def copy_then_hash() -> None:
        for start in starts:
            np.copyto(target[start : start + size], source[start : start + size])
            xxhash.xxh3_64_intdigest(view[start : start + size])

    def hashing_copies() -> None:
        for start in starts:
            copy_hashing(view[start : start + size], source_view[start : start + size])

    def through(loop: ModuleType | None, kernel: str = "best") -> Callable[[], None]:
        """`copy_hashing` as it runs with `loop` (None: the Python chunks) and `kernel`."""

        def run() -> None:
            installed = paged_copy._native
            paged_copy._native = loop
            previous = None if loop is None else loop.use_kernel(kernel)
            try:
                hashing_copies()
            finally:
                if previous is not None:
                    loop.use_kernel(previous)
                paged_copy._native = installed

        return run

    try:
        from umbp.runtime import _copyhash
    except ImportError:
        raise SystemExit("umbp.runtime._copyhash is not built: reinstall umbp (pip install -e .)")
    python_chunks, native, scalar = through(None), through(_copyhash), through(_copyhash, "scalar")

    return {"memcpy": memcpy, "copy, then hash": copy_then_hash, "python chunks": python_chunks,
            "native": native, "native, scalar": scalar}


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
        names = list(runs)  # the same every size
        for repeat in range(arguments.repeats):
            # Each pass starts with another copy: drift and order hit all alike.
            for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                run = runs[name]
                started = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - started)
        moved = max(total, size) // size * size
        gbps = {name: moved / seconds / 1e9 for name, seconds in best.items()}
        figures.append({"object_bytes": size, "gbps": gbps,
                        "ratio": {name: gbps[name] / gbps["memcpy"] for name in gbps}})
        rows.append([f"{size >> 10} KiB", *(f"{gbps[name]:.2f}" for name in runs),
                     *(f"{gbps[name] / gbps['memcpy']:.3f}" for name in names[1:])])
    print(format_table(["object", *(f"{name} GB/s" for name in names),
                        *(f"{name} / memcpy" for name in names[1:])], rows))
    print(f"python chunks: {CHUNK_BYTES >> 10} KiB, for objects over {2 * CHUNK_BYTES >> 10} "
          f"KiB; native kernel: {paged_copy.native_kernel()}; {arguments.mib} MiB per pass, "
          f"best of {arguments.repeats}")
    if arguments.json is not None:
        report = {"benchmark": "copy-hash", "quick": arguments.quick, "chunk_bytes": CHUNK_BYTES,
                  "native_kernel": paged_copy.native_kernel(), "rows": figures}
        arguments.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
