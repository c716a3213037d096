"""An in-process fake of MORI UMBP's Python module `mori.umbp`, so that `MoriStore` runs
unchanged in tests on machines where MORI cannot be installed.

It follows the API as docs/backends.md records it (amd-mori 1.2.4 and
amd-mori-nightly): the same class and method names and argument order, batch calls that
answer `list[bool]`, `batch_exists_consecutive` answering the length of the leading run of
hits, `register_memory` / `deregister_memory`, `clear`, `flush`, `is_distributed`,
`get_deployment_mode`, and the two documented defects, selected by `flavour`:

* "1.2.4": every put after `clear()` fails (on that client);
* "nightly": puts after `clear()` work, and `UMBPClient` has no `close()`.

Chosen where docs/backends.md is silent (assumptions, to be checked against real MORI):
* the deployment is picked by the config: `standalone_process.address` set -> standalone,
  `distributed.master_address` set -> distributed, neither -> embedded;
* clients of one standalone or distributed address share objects (a process-wide table
  keyed by address stands in for the server); an embedded client owns its objects;
* a put of a key that is present answers True and keeps the first content;
* a get whose size differs from the stored object's answers False and copies nothing;
* objects live in DRAM only, bounded by `dram.capacity_bytes` with LRU eviction; an
  object larger than the capacity is refused (False);
* a stopped server (`stop_server(address)`) makes every call of its clients raise
  RuntimeError, as a pybind-wrapped transport error would;
* `register_memory` returns None and raises on a bad range; pointers need not be
  registered unless the client was made with `FakeOptions.require_registered`.

Not emulated: the SSD tier, the copy pipeline, shared-memory and huge-page allocation,
`UMBPHostMemAllocator` (only a stub), ranged I/O, the `umbp_master` and
`umbp_standalone_server` binaries, timing, and anything across processes. Real MORI needs
ROCm and is verified only on AMD hardware.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = [
    "FakeBacking",
    "FakeOptions",
    "corrupt_object",
    "install",
    "make_module",
    "stop_server",
]

FLAVOURS = ("1.2.4", "nightly")


@dataclass
class FakeOptions:
    """Knobs of the fake that real MORI does not have."""

    require_registered: bool = False
    """Refuse (False) a put or get whose pointer is outside registered memory."""


@dataclass
class FakeBacking:
    """The objects behind one embedded client, or behind one server address."""

    capacity_bytes: int
    objects: OrderedDict[str, bytearray] = field(default_factory=OrderedDict)  # LRU first
    used_bytes: int = 0
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def store(self, key: str, data: bytes) -> bool:
        with self.lock:
            if key in self.objects:
                self.objects.move_to_end(key)
                return True
            if len(data) > self.capacity_bytes:
                return False
            while self.used_bytes + len(data) > self.capacity_bytes:
                _, evicted = self.objects.popitem(last=False)
                self.used_bytes -= len(evicted)
            self.objects[key] = bytearray(data)
            self.used_bytes += len(data)
            return True

    def load(self, key: str, size: int) -> bytearray | None:
        with self.lock:
            stored = self.objects.get(key)
            if stored is None or len(stored) != size:
                return None
            self.objects.move_to_end(key)
            return stored

    def clear(self) -> None:
        with self.lock:
            self.objects.clear()
            self.used_bytes = 0


# --------------------------------------------------------------------- configs


class UMBPDramConfig:
    def __init__(self) -> None:
        self.capacity_bytes = 1 << 30
        self.high_watermark = 0.95
        self.low_watermark = 0.85
        self.use_hugepages = False
        self.use_shared_memory = False


class UMBPSsdConfig:
    def __init__(self) -> None:
        self.enabled = False
        self.storage_dir = ""
        self.capacity_bytes = 0


class UMBPEvictionConfig:
    def __init__(self) -> None:
        self.policy = "lru"
        self.candidate_window = 16
        self.auto_promote_on_read = True


class UMBPCopyPipelineConfig:
    def __init__(self) -> None:
        self.enabled = False


class UMBPDistributedConfig:
    def __init__(self) -> None:
        self.master_address = ""


class UMBPStandaloneProcessConfig:
    def __init__(self) -> None:
        self.address = ""
        self.auto_start = False


class UMBPConfig:
    def __init__(self) -> None:
        self.dram = UMBPDramConfig()
        self.ssd = UMBPSsdConfig()
        self.eviction = UMBPEvictionConfig()
        self.copy_pipeline = UMBPCopyPipelineConfig()
        self.distributed = UMBPDistributedConfig()
        self.standalone_process = UMBPStandaloneProcessConfig()

    @staticmethod
    def from_environment() -> UMBPConfig:
        """Only `UMBP_DRAM_CAPACITY_BYTES` is read by the fake."""
        import os

        config = UMBPConfig()
        capacity = os.environ.get("UMBP_DRAM_CAPACITY_BYTES")
        if capacity:
            config.dram.capacity_bytes = int(capacity)
        return config


class UMBPHostBufferBacking:
    AnonymousShm = "AnonymousShm"
    Anonymous = "Anonymous"


class UMBPHostMemAllocator:
    """Stub: allocations are plain ctypes buffers kept alive by the allocator."""

    def __init__(self) -> None:
        self._buffers: list[ctypes.Array[ctypes.c_char]] = []

    def alloc(self, size: int, backing: str = "AnonymousShm", prefault: bool = True) -> int:
        buffer = ctypes.create_string_buffer(size)
        self._buffers.append(buffer)
        return ctypes.addressof(buffer)


# --------------------------------------------------------------------- the client


class _World:
    """State of one installed fake module: server backings by address."""

    def __init__(self, flavour: str, options: FakeOptions) -> None:
        self.flavour = flavour
        self.options = options
        self.servers: dict[str, FakeBacking] = {}
        self.lock = threading.Lock()

    def backing_for(self, mode: str, address: str, capacity: int) -> FakeBacking:
        if mode == "embedded":
            return FakeBacking(capacity)
        with self.lock:
            backing = self.servers.get(address)
            if backing is None:
                backing = self.servers[address] = FakeBacking(capacity)
            return backing


def _client_class(world: _World) -> type:
    class UMBPClient:
        def __init__(self, config: UMBPConfig) -> None:
            if config.standalone_process.address:
                self._mode, address = "standalone", config.standalone_process.address
            elif config.distributed.master_address:
                self._mode, address = "distributed", config.distributed.master_address
            else:
                self._mode, address = "embedded", ""
            self._backing = world.backing_for(self._mode, address, config.dram.capacity_bytes)
            self._check()
            self._registered: dict[int, int] = {}
            self._puts_broken = False

        # -- single-key calls
        def put_from_ptr(self, key: str, ptr: int, size: int) -> bool:
            return self.batch_put_from_ptr([key], [ptr], [size])[0]

        def get_into_ptr(self, key: str, ptr: int, size: int) -> bool:
            return self.batch_get_into_ptr([key], [ptr], [size])[0]

        def exists(self, key: str) -> bool:
            return self.batch_exists([key])[0]

        # -- batches
        def batch_put_from_ptr(
            self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
        ) -> list[bool]:
            self._check()
            _same_lengths(keys, ptrs, sizes)
            results = []
            for key, ptr, size in zip(keys, ptrs, sizes):
                if self._puts_broken or not self._usable(ptr, size):
                    results.append(False)
                    continue
                results.append(self._backing.store(key, ctypes.string_at(ptr, size)))
            return results

        def batch_get_into_ptr(
            self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
        ) -> list[bool]:
            self._check()
            _same_lengths(keys, ptrs, sizes)
            results = []
            for key, ptr, size in zip(keys, ptrs, sizes):
                stored = self._backing.load(key, size) if self._usable(ptr, size) else None
                if stored is not None and size:
                    ctypes.memmove(ptr, (ctypes.c_char * size).from_buffer(stored), size)
                results.append(stored is not None)
            return results

        def batch_exists(self, keys: Sequence[str]) -> list[bool]:
            self._check()
            with self._backing.lock:
                return [key in self._backing.objects for key in keys]

        def batch_exists_consecutive(self, keys: Sequence[str]) -> int:
            count = 0
            for present in self.batch_exists(keys):
                if not present:
                    break
                count += 1
            return count

        # -- memory and housekeeping
        def register_memory(self, ptr: int, size: int) -> None:
            self._check()
            if ptr <= 0 or size <= 0:
                raise RuntimeError(f"register_memory: invalid range {ptr:#x}+{size}")
            self._registered[ptr] = size

        def deregister_memory(self, ptr: int) -> None:
            self._registered.pop(ptr, None)

        def clear(self) -> None:
            self._check()
            self._backing.clear()
            if world.flavour == "1.2.4":
                self._puts_broken = True  # the documented 1.2.4 defect

        def flush(self) -> None:
            self._check()

        def is_distributed(self) -> bool:
            return self._mode == "distributed"

        def get_deployment_mode(self) -> str:
            return self._mode

        # -- internals (not MORI API)
        def _check(self) -> None:
            if self._backing.stopped:
                raise RuntimeError("UMBP: server unavailable")

        def _usable(self, ptr: int, size: int) -> bool:
            if not world.options.require_registered:
                return True
            return any(
                start <= ptr and ptr + size <= start + length
                for start, length in self._registered.items()
            )

    if world.flavour == "1.2.4":

        def close(self: UMBPClient) -> None:
            self._registered.clear()

        UMBPClient.close = close  # type: ignore[attr-defined]
    return UMBPClient


def _same_lengths(*sequences: Sequence[object]) -> None:
    if len({len(sequence) for sequence in sequences}) != 1:
        raise ValueError("keys, ptrs and sizes differ in length")


# --------------------------------------------------------------------- installing


def make_module(flavour: str = "nightly", options: FakeOptions | None = None) -> types.ModuleType:
    """A fresh fake `mori.umbp` module (its own servers) for the given flavour."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    world = _World(flavour, options or FakeOptions())
    module = types.ModuleType("mori.umbp", "Fake mori.umbp (umbp.testing.fake_mori)")
    version = "1.2.4" if flavour == "1.2.4" else "1.3.0.dev0+nightly"
    module.__version__ = version  # type: ignore[attr-defined]
    for item in (
        UMBPConfig,
        UMBPDramConfig,
        UMBPSsdConfig,
        UMBPEvictionConfig,
        UMBPCopyPipelineConfig,
        UMBPDistributedConfig,
        UMBPStandaloneProcessConfig,
        UMBPHostBufferBacking,
        UMBPHostMemAllocator,
    ):
        setattr(module, item.__name__, item)
    module.UMBPClient = _client_class(world)  # type: ignore[attr-defined]
    module._fake_world = world  # type: ignore[attr-defined]
    return module


@contextmanager
def install(
    flavour: str = "nightly", options: FakeOptions | None = None
) -> Iterator[types.ModuleType]:
    """Put a fake into `sys.modules` as `mori` / `mori.umbp` for the duration, so that
    code importing `mori.umbp` gets it; restores whatever was there."""
    module = make_module(flavour, options)
    package = types.ModuleType("mori", "Fake mori package (umbp.testing.fake_mori)")
    package.umbp = module  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("mori", "mori.umbp")}
    sys.modules["mori"], sys.modules["mori.umbp"] = package, module
    try:
        yield module
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def stop_server(module: types.ModuleType, address: str, stopped: bool = True) -> None:
    """Make the fake server at `address` (un)reachable for its clients."""
    world: _World = module._fake_world
    with world.lock:
        world.servers[address].stopped = stopped


def corrupt_object(client: object, key: str, offset: int = 0) -> None:
    """Flip one stored byte of `key` behind the client's back (fault injection)."""
    backing: FakeBacking = client._backing  # type: ignore[attr-defined]
    with backing.lock:
        backing.objects[key][offset] ^= 0xFF

