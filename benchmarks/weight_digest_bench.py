"""What the weights' part of a namespace costs (umbp.runtime.weights.files_digest), on
real files, cold and warm, beside reading the same files whole in the same run.

    python benchmarks/weight_digest_bench.py [--json FILE] [--dir D] [--files 4]
                                             [--file-gib 4.67] [--tensors 24] [--quick]

It writes `--files` safetensors files of `--file-gib` GiB each (random bytes, written
for real: no sparse file), each with `--tensors` tensors: the defaults are shards of a
140 GB checkpoint (30 such files; Llama-3-70B has 723 tensors in 30 shards, 24 each).
Then, per pass:
* cold: each file's pages are dropped from the page cache (fsync, then
  `posix_fadvise(DONTNEED)`; the rest of a shared machine's cache is left alone), then
  the digest is taken: what an engine start pays on a host that has not read the
  weights yet (in practice vLLM has just read them, so the warm figure applies);
* warm: the digest again, the sampled pages still cached;
* reference: one file read whole, cold (what a digest of every byte would cost per
  file), timed in the same run.
It prints the reads and bytes a digest takes, the best of `--repeats` passes, and a
projection to a 140 GB checkpoint: per-file cold cost x 30 files (the cost is the
number of reads, the same for every file of a given tensor count, so a file's cost
projects; the bigger the file, the further apart its chunks, so measure at the real
shard size, as the defaults do). The files are removed at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.runtime.weights import files_digest

GIB = 1 << 30
CHECKPOINT_BYTES = 140 * 10**9
WRITE_BLOCK = 64 << 20


def write_shard(path: Path, nbytes: int, tensors: int, seed: int) -> None:
    """A safetensors file of `tensors` equal uint8 tensors filling `nbytes`."""
    size = nbytes // tensors
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for index in range(tensors):
        header[f"model.layers.{index}.weight"] = {
            "dtype": "U8", "shape": [size], "data_offsets": [index * size, (index + 1) * size]}
    encoded = json.dumps(header).encode()
    block = bytearray(os.urandom(WRITE_BLOCK))
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        left = size * tensors
        serial = seed << 32
        while left:
            struct.pack_into("<Q", block, 0, serial)  # every block distinct
            serial += 1
            count = min(left, WRITE_BLOCK)
            file.write(memoryview(block)[:count])
            left -= count
        file.flush()
        os.fsync(file.fileno())


def drop_cache(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (written back first). Only these
    files': the machine is shared, so the whole cache is left alone."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_whole(path: Path) -> float:
    started = time.perf_counter()
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as file:
        while chunk := file.read(16 << 20):
            digest.update(chunk)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--dir", default="/tmp/umbp-weight-digest-bench")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-gib", type=float, default=4.67)
    parser.add_argument("--tensors", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 files of 0.25 GiB, 1 pass")
    parser.add_argument("--keep", action="store_true", help="keep the files for a later run")
    args = parser.parse_args()
    if args.quick:
        args.files, args.file_gib, args.repeats = 2, 0.25, 1
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.file_gib * GIB)
    paths = [folder / f"model-{index:05d}-of-{args.files:05d}.safetensors"
             for index in range(args.files)]
    started = time.perf_counter()
    for index, path in enumerate(paths):
        if not path.exists() or path.stat().st_size < nbytes:
            write_shard(path, nbytes, args.tensors, index)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    written_s = time.perf_counter() - started

    cold, warm, whole = [], [], []
    digest, cost = files_digest(folder)
    for _ in range(args.repeats):
        drop_cache(paths)
        started = time.perf_counter()
        files_digest(folder)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        files_digest(folder)
        warm.append(time.perf_counter() - started)
        drop_cache(paths[:1])
        whole.append(read_whole(paths[0]))
    per_file_cold = min(cold) / args.files
    shards = CHECKPOINT_BYTES / (nbytes + 8)
    result = {
        "benchmark": "weight_digest", "quick": args.quick, "files": args.files,
        "file_bytes": nbytes, "tensors_per_file": args.tensors, "digest": digest,
        "reads": cost.reads, "bytes_read": cost.bytes_read,
        "cold_s": min(cold), "warm_s": min(warm), "whole_file_cold_s": min(whole),
        "written_s": written_s,
        "projected_140gb_cold_s": per_file_cold * shards,
        "projected_140gb_warm_s": min(warm) / args.files * shards,
        "projected_140gb_whole_read_s": min(whole) * shards,
    }
    print(f"{args.files} files of {nbytes / GIB:.2f} GiB, {args.tensors} tensors each")
    print(f"digest reads {cost.reads} pieces, {cost.bytes_read / 2**20:.1f} MiB "
          f"({cost.bytes_read / (args.files * nbytes) * 100:.3f} % of the bytes)")
    print(f"cold digest          {min(cold) * 1e3:9.1f} ms  ({per_file_cold * 1e3:.1f} ms a file)")
    print(f"warm digest          {min(warm) * 1e3:9.1f} ms")
    print(f"one file read whole  {min(whole) * 1e3:9.1f} ms cold "
          f"({nbytes / min(whole) / 1e9:.2f} GB/s); digest/file vs whole read: "
          f"{per_file_cold / min(whole):.4f}x")
    print(f"140 GB ({shards:.0f} such files): digest {result['projected_140gb_cold_s']:.2f} s "
          f"cold, {result['projected_140gb_warm_s'] * 1e3:.0f} ms warm; reading every byte "
          f"{result['projected_140gb_whole_read_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.keep:
        for path in paths:
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
