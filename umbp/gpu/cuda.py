"""The CUDA device: copies as DMA on side streams, ordered after vLLM's stream by events.

A copy is a list of byte ranges (:meth:`~umbp.gpu.copier.BlockCopy.ranges`) between the
KV blocks and host memory that was registered with CUDA at start (the embedded pool's
slab, the staging ring), moved in one batched submission on a side stream, so the copy
engines move the bytes, not kernels beside decode, and each byte crosses once. How the
batch is submitted is chosen once per process, by the first of these that copies a test
pattern correctly both ways:

1. vLLM's own ``swap_blocks_batch`` op (``cuMemcpyBatchAsync`` on CUDA 12.8+), present
   wherever vLLM runs on CUDA;
2. ``cuMemcpyBatchAsync`` through NVIDIA's ``cuda-bindings`` package, where installed;
3. one ``cudaMemcpyAsync`` per range through the CUDA runtime torch loaded: correct
   everywhere, its cost grows with the number of ranges.

Streams and events are torch's. Host memory is registered with ``cudaHostRegister``
(``torch.cuda.cudart()``); where that fails the copies still run, from pageable memory,
slower, and umbp says so once.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from umbp.gpu.copier import BlockCopy, CopyRanges
from umbp.gpu.device import Event, Stream
from umbp.gpu.lanes import Lane

logger = logging.getLogger("umbp")

__all__ = ["CudaDevice", "select_batched_copy"]

BatchedCopy = Callable[[CopyRanges, bool], None]
"""Enqueue every range on the calling thread's current stream; the flag: host to device
(the source is host memory nobody writes meanwhile, so the engines may read it in any
order)."""

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyKind: direction from the pointers (unified addressing)


class _CudaStream:
    __slots__ = ("raw",)

    def __init__(self, raw: torch.cuda.Stream) -> None:
        self.raw = raw

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, _CudaEvent)
        self.raw.wait_event(event.raw)


class _CudaEvent:
    """An event of the device's pool: the CUDA event goes back to the pool when the
    last reference to this wrapper goes (a stream that waited on it captured its state
    then; re-recording it later changes nothing for that wait)."""

    __slots__ = ("__weakref__", "raw")

    def __init__(self, raw: torch.cuda.Event) -> None:
        self.raw = raw

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, _CudaStream)
        self.raw.record(stream.raw)

    def query(self) -> bool:
        return bool(self.raw.query())

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaDevice:
    """One GPU of vLLM's: its current stream, side streams, DMA copies."""

    copies_hash = False
    stores_start_at_save = False

    def __init__(self, device: torch.device) -> None:
        self._device = torch.device(device)
        self.name = str(self._device)
        self._host_lane: Lane | None = None
        self._free_events: list[torch.cuda.Event] = []
        with torch.cuda.device(self._device):
            self.copy_method, self._batched = select_batched_copy(self._device)
        logger.info("umbp copies between host memory and %s with %s", self.name,
                    self.copy_method)

    def current_stream(self) -> Stream:
        return _CudaStream(torch.cuda.current_stream(self._device))

    def new_stream(self, name: str) -> Stream:
        return _CudaStream(torch.cuda.Stream(device=self._device))

    def new_event(self) -> Event:
        try:
            raw = self._free_events.pop()
        except IndexError:
            raw = torch.cuda.Event()
        event = _CudaEvent(raw)
        weakref.finalize(event, self._free_events.append, raw)
        return event

    def copy(self, stream: Stream, copy: BlockCopy) -> None:
        assert isinstance(stream, _CudaStream)
        ranges = copy.ranges()
        if len(ranges):
            with torch.cuda.stream(stream.raw):
                self._batched(ranges, copy.to_kv)

    def run_beside(self, stream: Stream, job: Callable[[], None]) -> None:
        if self._host_lane is None:
            self._host_lane = Lane("umbp-transfer-host", on_start=self.bind_thread)
        self._host_lane.submit(job)

    def register_host(self, address: int, nbytes: int) -> bool:
        if nbytes <= 0:
            return False
        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
        if code != 0:
            logger.warning(
                "umbp: cudaHostRegister of %d MiB refused (CUDA error %d): copies to and "
                "from that memory still work, from pageable memory, slower",
                nbytes >> 20, code,
            )
            return False
        return True

    def unregister_host(self, address: int) -> None:
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
        if code != 0:
            logger.debug("umbp: cudaHostUnregister answered CUDA error %d", code)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self._device)

    def close(self) -> None:
        if self._host_lane is not None:
            self._host_lane.close(60.0)
            self._host_lane = None


# -- choosing how a batch is submitted --------------------------------------------------


def select_batched_copy(device: torch.device) -> tuple[str, BatchedCopy]:
    """The first way to submit a batch of ranges that copies a test pattern right, both
    ways (see the module docstring); raises when none does."""
    tried: list[str] = []
    for name, make in (
        ("vLLM's swap_blocks_batch", _vllm_swap_blocks_batch),
        ("cuMemcpyBatchAsync (cuda-bindings)", _driver_memcpy_batch),
        ("cudaMemcpyAsync per range", _runtime_memcpy_per_range),
    ):
        try:
            batched = make()
            _prove(batched, device)
        except Exception as error:  # noqa: BLE001 - the next way is tried
            tried.append(f"{name}: {error}")
            continue
        return name, batched
    raise RuntimeError("umbp cannot copy between host memory and " + str(device) + ": "
                       + "; ".join(tried))


def _prove(batched: BatchedCopy, device: torch.device) -> None:
    """Two ranges there and back through a fresh stream, then compared."""
    pattern = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    source = pattern.pin_memory()
    back = torch.zeros_like(source).pin_memory()
    on_device = torch.zeros(source.numel(), dtype=torch.uint8, device=device)
    half = source.numel() // 2
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        batched(_ranges([(source.data_ptr() + half, on_device.data_ptr(), half),
                         (source.data_ptr(), on_device.data_ptr() + half, half)]), True)
        batched(_ranges([(on_device.data_ptr(), back.data_ptr() + half, half),
                         (on_device.data_ptr() + half, back.data_ptr(), half)]), False)
    stream.synchronize()
    if not torch.equal(back, source):
        raise RuntimeError("the test pattern came back altered")


def _ranges(triples: list[tuple[int, int, int]]) -> CopyRanges:
    sources, destinations, sizes = (np.asarray(column, dtype=np.uint64)
                                    for column in zip(*triples))
    return CopyRanges(sources, destinations, sizes)


def _vllm_swap_blocks_batch() -> BatchedCopy:
    op: Any = torch.ops._C_cache_ops.swap_blocks_batch  # AttributeError without vLLM

    def batched(ranges: CopyRanges, to_device: bool) -> None:
        op(torch.from_numpy(ranges.sources.view(np.int64)),
           torch.from_numpy(ranges.destinations.view(np.int64)),
           torch.from_numpy(ranges.sizes.view(np.int64)), to_device)

    return batched


def _driver_memcpy_batch() -> BatchedCopy:
    driver: Any = importlib.import_module("cuda.bindings.driver")  # optional package

    orders = {}
    for to_device, order in ((True, "CU_MEMCPY_SRC_ACCESS_ORDER_ANY"),
                             (False, "CU_MEMCPY_SRC_ACCESS_ORDER_STREAM")):
        attributes = driver.CUmemcpyAttributes()
        attributes.srcAccessOrder = getattr(driver.CUmemcpySrcAccessOrder, order)
        orders[to_device] = attributes

    def batched(ranges: CopyRanges, to_device: bool) -> None:
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        answer = driver.cuMemcpyBatchAsync(
            ranges.destinations.tolist(), ranges.sources.tolist(), ranges.sizes.tolist(),
            len(ranges), [orders[to_device]], [0], 1, stream,
        )
        code = answer[0] if isinstance(answer, tuple) else answer
        if code != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync answered {code}")

    return batched


def _runtime_memcpy_per_range() -> BatchedCopy:
    memcpy = _cuda_runtime().cudaMemcpyAsync
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_void_p]
    memcpy.restype = ctypes.c_int

    def batched(ranges: CopyRanges, to_device: bool) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        for source, destination, size in zip(
            ranges.sources.tolist(), ranges.destinations.tolist(), ranges.sizes.tolist()
        ):
            code = memcpy(destination, source, size, _CUDA_MEMCPY_DEFAULT, stream)
            if code != 0:
                raise RuntimeError(f"cudaMemcpyAsync answered CUDA error {code}")

    return batched


def _cuda_runtime() -> ctypes.CDLL:
    """The CUDA runtime library this process loaded (torch's), found in its mappings."""
    torch.cuda.init()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "/libcudart.so" in path:
                return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")
