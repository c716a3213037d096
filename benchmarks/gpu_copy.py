"""umbp's block copies next to a plain contiguous copy of the same bytes, in one run.

    python benchmarks/gpu_copy.py [--device cuda|cpu] [--json FILE] [--quick]

For each block size (bytes of one block of one layer) it builds a paged KV cache of
``--layers`` layers as views into one shared allocation (the layout vLLM uses on that
device: K/V-leading FlashAttention on CUDA, ``[blocks, heads, block_size, 2*head]`` on
CPU), and host rows the way the embedded pool holds objects (a prefaulted mapping,
registered with CUDA on a GPU), then times

* gather:  scattered blocks into the host rows (a store: device->host)
* scatter: the rows back into the blocks (a restore: host->device)

each as one :class:`~umbp.gpu.copier.BlockCopy` carried out by umbp's device (on CUDA
one batched DMA submission on a side stream, on CPU numpy), against a plain contiguous
copy of the same number of bytes between the same device memory and page-locked host
memory (on CPU: a plain tensor copy). The ratio umbp/plain says how close block copies
get to the bus (or memcpy) limit. Timings are best-of-N loops, each ended by a
synchronization.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

try:
    from umbp.gpu import BlockCopier, Device, device_for
except ImportError:  # run from a checkout without `pip install -e .`: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from umbp.gpu import BlockCopier, Device, device_for
from umbp.runtime.host_memory import allocate_prefaulted_slab

KIB = 1024
MIB = 1024 * KIB
BLOCK_SIZES = (16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB)
HEAD_SIZE = 128
DTYPE = torch.bfloat16
TOKEN_HEAD_BYTES = 2 * HEAD_SIZE * DTYPE.itemsize  # K and V of one token of one head


@dataclass(frozen=True)
class Settings:
    device: torch.device
    layers: int
    bytes_per_op: int  # target bytes moved per timed gather (at least one object)
    loop_seconds: float  # length of one timed loop
    repeats: int  # timed loops per measurement; the best one counts


@dataclass(frozen=True)
class Row:
    block_bytes: int
    objects: int
    bytes_per_op: int
    gather_gbps: float
    gather_ref_gbps: float
    gather_ratio: float
    scatter_gbps: float
    scatter_ref_gbps: float
    scatter_ratio: float


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    rows = [measure_block_size(block_bytes, settings) for block_bytes in BLOCK_SIZES]
    print_table(rows, settings)
    if args.json:
        write_json(Path(args.json), rows, settings, quick=args.quick)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default_device)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's choice); 1 steadies figures on a busy host",
    )
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.quick:
        return Settings(device, args.layers, 8 * MIB, loop_seconds=0.01, repeats=3)
    full_bytes = 512 * MIB if device.type == "cuda" else 128 * MIB
    return Settings(device, args.layers, full_bytes, loop_seconds=0.2, repeats=5)


# -- one block size -------------------------------------------------------------------


def measure_block_size(block_bytes: int, settings: Settings) -> Row:
    objects = max(1, settings.bytes_per_op // (settings.layers * block_bytes))
    # Gather about every other block, in shuffled order. An odd count never equals the
    # K/V dim (2) nor any power-of-two dim, so the block dim is never ambiguous.
    num_blocks = 2 * objects + 1
    layers, base = build_kv(block_bytes, num_blocks, settings)
    copier = BlockCopier(layers, num_blocks)
    block_ids = torch.randperm(num_blocks)[:objects].tolist()
    device = device_for(settings.device)
    rows = host_rows(objects, copier.object_bytes)
    registered = device.register_host(rows.ctypes.data, rows.nbytes)
    stream = device.new_stream("umbp-bench")
    run = runner(device, stream)
    check_round_trip(copier, layers, block_ids, rows, run)

    nbytes = objects * copier.object_bytes
    plain_host = torch.empty(nbytes, dtype=torch.uint8,
                             pin_memory=settings.device.type == "cuda")
    plain_device = base[:nbytes]
    sync = synchronizer(settings.device)
    gather = best_seconds(lambda: run(copier.copy(block_ids, rows, to_kv=False)), sync, settings)
    gather_ref = best_seconds(
        lambda: plain_host.copy_(plain_device, non_blocking=True), sync, settings
    )
    scatter = best_seconds(lambda: run(copier.copy(block_ids, rows, to_kv=True)), sync, settings)
    scatter_ref = best_seconds(
        lambda: plain_device.copy_(plain_host, non_blocking=True), sync, settings
    )
    if registered:
        device.unregister_host(rows.ctypes.data)
    device.close()
    return Row(
        block_bytes=block_bytes,
        objects=objects,
        bytes_per_op=nbytes,
        gather_gbps=nbytes / gather / 1e9,
        gather_ref_gbps=nbytes / gather_ref / 1e9,
        gather_ratio=gather_ref / gather,
        scatter_gbps=nbytes / scatter / 1e9,
        scatter_ref_gbps=nbytes / scatter_ref / 1e9,
        scatter_ratio=scatter_ref / scatter,
    )


def host_rows(count: int, object_bytes: int) -> npt.NDArray[np.uint8]:
    """Rows the way the embedded pool keeps objects: a prefaulted private mapping."""
    mapping = allocate_prefaulted_slab(count * object_bytes)
    return np.frombuffer(mapping, np.uint8).reshape(count, object_bytes)


def runner(device: Device, stream: object) -> Callable[[object], None]:
    """Carry one copy out to the end: on the host at once, on a GPU enqueued on the
    side stream and waited for (what a store's completion does)."""
    from umbp.gpu import BlockCopy, HostDevice

    if isinstance(device, HostDevice):
        def on_host(copy: object) -> None:
            assert isinstance(copy, BlockCopy)
            copy.run_on_host()
        return on_host

    def on_device(copy: object) -> None:
        assert isinstance(copy, BlockCopy)
        device.copy(stream, copy)  # type: ignore[arg-type]
        done = device.new_event()
        done.record(stream)  # type: ignore[arg-type]
        done.synchronize()
    return on_device


def build_kv(
    block_bytes: int, num_blocks: int, settings: Settings
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``settings.layers`` paged KV tensors as views into one allocation, and that allocation."""
    heads = 8 if block_bytes >= 64 * KIB else max(1, block_bytes // (16 * TOKEN_HEAD_BYTES))
    block_size = block_bytes // (heads * TOKEN_HEAD_BYTES)
    layer_bytes = num_blocks * block_bytes
    base = torch.empty(settings.layers * layer_bytes, dtype=torch.uint8, device=settings.device)
    # Distinct 8-byte words everywhere: a wrong block shows in the round-trip check, and
    # every page is really written (never a shared zero page that reads too fast).
    torch.arange(base.numel() // 8, dtype=torch.int64, out=base.view(torch.int64))
    layers = [
        kv_layer(base[i * layer_bytes : (i + 1) * layer_bytes], num_blocks, heads, block_size)
        for i in range(settings.layers)
    ]
    return layers, base


def kv_layer(memory: torch.Tensor, num_blocks: int, heads: int, block_size: int) -> torch.Tensor:
    typed = memory.view(DTYPE)
    if memory.is_cuda:  # FlashAttention: K/V leading, the block dim second
        return typed.view(2, num_blocks, block_size, heads, HEAD_SIZE)
    return typed.view(num_blocks, heads, block_size, 2 * HEAD_SIZE)  # vLLM CPU


def check_round_trip(
    copier: BlockCopier, layers: Sequence[torch.Tensor], block_ids: list[int],
    rows: npt.NDArray[np.uint8], run: Callable[[object], None],
) -> None:
    """Figures from broken copies are worthless: check the first object against a slow
    reference, then that scattering the rows back and gathering again is the identity."""
    run(copier.copy(block_ids, rows, to_kv=False))
    first_object = torch.from_numpy(rows[0].copy()).to(copier.device)
    if not torch.equal(first_object, reference_object(copier, layers, block_ids[0])):
        raise SystemExit("umbp gathered the wrong bytes: figures would be meaningless")
    first = rows.copy()
    run(copier.copy(block_ids, rows, to_kv=True))
    run(copier.copy(block_ids, rows, to_kv=False))
    if not np.array_equal(first, rows):
        raise SystemExit("umbp's round trip failed: figures would be meaningless")


def reference_object(
    copier: BlockCopier, layers: Sequence[torch.Tensor], block_id: int
) -> torch.Tensor:
    """One object built block by block, layer by layer (the documented object format)."""
    return torch.cat(
        [
            layer.select(layout.block_dim, block_id).unsqueeze(-1).view(torch.uint8).reshape(-1)
            for layer, layout in zip(layers, copier.layouts, strict=True)
        ]
    )


# -- timing ---------------------------------------------------------------------------


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def best_seconds(op: Callable[[], object], sync: Callable[[], None], settings: Settings) -> float:
    """Seconds per op: best of ``repeats`` loops, each about ``loop_seconds`` long."""
    iterations = iterations_for(op, sync, settings.loop_seconds)
    best = float("inf")
    for _ in range(settings.repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iterations):
            op()
        sync()
        best = min(best, (time.perf_counter() - start) / iterations)
    return best


def iterations_for(op: Callable[[], object], sync: Callable[[], None], loop_seconds: float) -> int:
    op()  # warm-up: first-touch page faults, lazy buffers, kernel selection
    sync()
    start = time.perf_counter()
    op()
    sync()
    return max(1, int(loop_seconds / max(time.perf_counter() - start, 1e-6)))


# -- output ---------------------------------------------------------------------------

HEADER = (
    f"{'block':>8} {'objects':>7} {'MiB/op':>7} "
    f"{'gather GB/s':>11} {'plain GB/s':>10} {'ratio':>6} "
    f"{'scatter GB/s':>12} {'plain GB/s':>10} {'ratio':>6}"
)


def print_table(rows: Sequence[Row], settings: Settings) -> None:
    direction = "device<->pinned host" if settings.device.type == "cuda" else "cpu tensor copy"
    print(
        f"umbp block copies vs plain contiguous copy ({direction}); device={settings.device} "
        f"layers={settings.layers} dtype={DTYPE} threads={torch.get_num_threads()} "
        f"torch={torch.__version__}"
    )
    print(HEADER)
    for row in rows:
        print(
            f"{format_size(row.block_bytes):>8} {row.objects:>7} {row.bytes_per_op / MIB:>7.1f} "
            f"{row.gather_gbps:>11.2f} {row.gather_ref_gbps:>10.2f} {row.gather_ratio:>6.2f} "
            f"{row.scatter_gbps:>12.2f} {row.scatter_ref_gbps:>10.2f} {row.scatter_ratio:>6.2f}"
        )


def format_size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def write_json(path: Path, rows: Sequence[Row], settings: Settings, *, quick: bool) -> None:
    report = {
        "benchmark": "gpu_copy",
        "device": str(settings.device),
        "device_name": device_name(settings.device),
        "torch": torch.__version__,
        "layers": settings.layers,
        "threads": torch.get_num_threads(),
        "dtype": str(DTYPE),
        "quick": quick,
        "rows": [asdict(row) for row in rows],
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"


if __name__ == "__main__":
    sys.exit(main())
