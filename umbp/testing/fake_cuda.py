"""A recording fake of a CUDA device: the conformance harness for umbp's GPU path on a
machine without one.

It implements umbp's device protocol (:mod:`umbp.gpu.device`) the way CUDA behaves,
over host memory that stands for the GPU's (the KV tensors a test registers with
:meth:`FakeCuda.device_memory`):

* a stream runs its work in order; ``stream.wait_event(e)`` makes its later work wait
  for what preceded ``e``'s record; another thread's current stream is its own default
  stream, not the model thread's (so waiting on "the current stream" from a lane orders
  nothing after the forward pass, as on a GPU);
* work runs *lazily*: a copy runs only when something needs it done (an event after it
  queried or synchronized, work that waits for it run, the end of a step as vLLM's
  per-step synchronization on sampled tokens). Bytes read on the host without that
  read what was there before, as on a GPU whose copy has not run yet;
* a copy runs from its byte ranges alone (``ctypes.memmove``), after each range was
  checked to lie wholly in device memory on one side and in host memory on the other
  (a range outside both raises: a wild pointer).

It records every operation with what it waited for (the happens-before graph; a host
thread's observation of an event, by query or synchronize, orders what is submitted
after it) and reports :attr:`FakeCuda.violations`:

* two operations touching overlapping bytes, one of them writing, neither ordered before
  the other (a load landing in a block the forward pass zeroes or reads, a store reading
  a block before the forward pass wrote it, a staging slot reused by a copy while an
  earlier copy of it may still run);
* a device synchronization on the model thread during a step;
* a store copy not ordered after the step's sampled-token copy (vLLM issues stores
  after it, so they never delay it);
* a copy from or to host memory never registered (a pageable copy);
* registered host memory unmapped before it was unregistered, and a copy through a
  registration whose memory was unmapped since (CUDA would move the pages it locked
  then, not what is mapped there now): told apart by the file and offset
  ``/proc/self/maps`` gives for the address (a server's pool file), so the unmapping of
  anonymous memory followed by another anonymous mapping at the same address goes unseen;
* host memory registered twice, or an unregistration that starts no registration (CUDA
  answers both with an error);
* a device call from a host thread that never bound the device;
* a copy carrying hash states (``BlockCopy.hashes``): the copy engines would not feed
  them, and the store would be handed checksums never computed.

Nothing here runs in production: it exists so the tests can drive the real worker
through vLLM's real scheduler in every mode and assert the GPU path's ordering and
bytes (tests/unit/test_cuda_conformance.py).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from umbp.gpu.copier import BlockCopy
from umbp.gpu.device import Event, Stream
from umbp.gpu.lanes import Lane

__all__ = ["FakeCuda", "Op"]

Ranges = tuple[tuple[int, int], ...]
"""Sorted, merged ``[start, end)`` byte intervals."""

Backing = tuple[int, int]
"""What is mapped at an address: (the file's inode, the offset in it), or (0, the address)
for anonymous memory."""


def mappings() -> list[tuple[int, int, Backing]]:
    """This process's mappings from ``/proc/self/maps``: (start, end, backing of start),
    sorted."""
    found: list[tuple[int, int, Backing]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, offset, _, inode = line.split(maxsplit=5)[:5]
            start, end = (int(bound, 16) for bound in span.split("-"))
            found.append((start, end, (int(inode), int(offset, 16)) if int(inode) else (0, start)))
    return found


def backing_at(address: int, mapped: Sequence[tuple[int, int, Backing]]) -> Backing | None:
    """What ``mapped`` (:func:`mappings`) holds at ``address``; None when nothing."""
    index = bisect.bisect_right(mapped, (address, float("inf"))) - 1
    if index < 0 or not mapped[index][0] <= address < mapped[index][1]:
        return None
    start, _, (inode, offset) = mapped[index]
    return inode, offset + address - start


@dataclass(frozen=True, slots=True)
class _Registration:
    end: int
    backing: Backing | None
    """What was mapped at the start when it was registered."""

    def still_mapped(self, start: int, address: int,
                     mapped: Sequence[tuple[int, int, Backing]]) -> bool:
        """Whether ``address`` (inside the registration at ``start``) still holds what was
        registered."""
        if self.backing is None:
            return False
        inode, offset = self.backing
        return backing_at(address, mapped) == (inode, offset + address - start)


def merged(ranges: Iterable[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)


def overlap(a: Ranges, b: Ranges) -> bool:
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


@dataclass(eq=False)
class Op:
    """One operation on a stream."""

    index: int
    stream: FakeStream
    kind: str
    """copy-load, copy-store, forward-write, forward-read, forward-zero, sample, record,
    wait."""
    reads: Ranges = ()
    writes: Ranges = ()
    deps: list[Op] = field(default_factory=list)
    run: Callable[[], None] | None = None
    done: bool = False
    ancestors: int = 0
    """Bit i set: operation i happens before this one."""
    label: str = ""
    step: int = 0
    """The step it was enqueued in (forward-pass work)."""


class FakeStream:
    def __init__(self, device: FakeCuda, name: str) -> None:
        self._device = device
        self.name = name
        self.last: Op | None = None

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, FakeEvent)
        self._device.enqueue(self, "wait", deps=[event.op] if event.op is not None else [])


class FakeEvent:
    def __init__(self, device: FakeCuda) -> None:
        self._device = device
        self.op: Op | None = None

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, FakeStream)
        self.op = self._device.enqueue(stream, "record")

    def query(self) -> bool:
        return self._device.complete(self, wait=False)

    def synchronize(self) -> None:
        self._device.complete(self, wait=True)


class FakeCuda:
    """The recording device. ``name`` reads like CUDA's, so umbp treats it as a GPU."""

    name = "cuda:0 (fake)"
    copies_hash = False
    stores_start_at_save = False

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ops: list[Op] = []
        self._live: list[Op] = []  # operations not yet known complete to every thread
        self._observed = 0  # happens before anything submitted from now on
        self._device_ranges: list[tuple[int, int]] = []
        self._host_ranges: Ranges = ()
        self._registrations: dict[int, _Registration] = {}
        self._default_streams: dict[int, FakeStream] = {}
        self.forward = FakeStream(self, "forward")
        self.model_thread: int | None = None
        self.in_step = False
        self._step_tails: list[Op] = []  # each step's sampled-token copy
        self._forward_writes: list[Op] = []
        self._bound: set[int] = set()
        self._host_lane: Lane | None = None
        self.violations: list[str] = []
        self.copies: list[Op] = []
        self.model_thread_syncs = 0

    # -- what the test sets up --------------------------------------------------------------

    def device_memory(self, tensors: Iterable[torch.Tensor]) -> None:
        """The tensors' storage counts as device memory (the KV cache)."""
        with self._lock:
            for tensor in tensors:
                storage = tensor.untyped_storage()
                start = int(storage.data_ptr())
                self._device_ranges.append((start, start + int(storage.nbytes())))
            self._device_ranges = list(merged(self._device_ranges))

    # -- the device protocol -----------------------------------------------------------------

    def current_stream(self) -> Stream:
        ident = threading.get_ident()
        if ident == self.model_thread:
            return self.forward
        with self._lock:
            stream = self._default_streams.get(ident)
            if stream is None:
                stream = self._default_streams[ident] = FakeStream(self, f"default-{ident}")
            return stream

    def new_stream(self, name: str) -> Stream:
        return FakeStream(self, name)

    def new_event(self) -> Event:
        return FakeEvent(self)

    def copy(self, stream: Stream, copy: BlockCopy) -> None:
        assert isinstance(stream, FakeStream)
        if copy.hashes is not None:  # the copy engines would leave them unfed
            self.violations.append("a copy carries hash states a GPU's copy engines cannot "
                                   "feed (the store would verify a checksum never computed)")
        ranges = copy.ranges()
        triples = list(zip(ranges.sources.tolist(), ranges.destinations.tolist(),
                           ranges.sizes.tolist()))
        sources = merged((s, s + n) for s, _, n in triples)
        destinations = merged((d, d + n) for _, d, n in triples)
        device_side, host_side = (destinations, sources) if copy.to_kv else (sources, destinations)
        for start, end in device_side:
            if not self._inside(self._device_ranges, start, end):
                raise AssertionError(f"a copy touches [{start:#x}, {end:#x}) outside device memory")
        for start, end in host_side:
            if self._inside(self._device_ranges, start, end):
                raise AssertionError("a copy between device memory and device memory")
            if not self._inside(self._host_ranges, start, end):
                self.violations.append(f"a copy touches host memory [{start:#x}, {end:#x}) that "
                                       "was never registered (pageable)")
        self._check_still_mapped(host_side)

        def run() -> None:
            for source, destination, size in triples:
                ctypes.memmove(destination, source, size)

        op = self.enqueue(stream, "copy-load" if copy.to_kv else "copy-store",
                          reads=sources, writes=destinations, run=run)
        with self._lock:
            if not copy.to_kv:
                self._check_after_sampling(op)
            self.copies.append(op)

    def _check_after_sampling(self, store: Op) -> None:
        """A store reads blocks after the sampled tokens of the step that wrote them."""
        for write in self._forward_writes:
            if write.index > store.index or not overlap(write.writes, store.reads):
                continue
            sample = (self._step_tails[write.step]
                      if write.step < len(self._step_tails) else None)
            if sample is None or not store.ancestors >> sample.index & 1:
                self.violations.append(
                    f"store copy {store.index} is not ordered after the sampled tokens of "
                    f"step {write.step}, which wrote its blocks")
                return

    def run_beside(self, stream: Stream, job: Callable[[], None]) -> None:
        with self._lock:
            if self._host_lane is None:
                self._host_lane = Lane("fake-cuda-host", on_start=self.bind_thread)
        self._host_lane.submit(job)

    def register_host(self, address: int, nbytes: int) -> bool:
        backing = backing_at(address, mappings())
        with self._lock:
            self._require_bound_locked("host memory registered")
            if overlap(self._host_ranges, ((address, address + nbytes),)):
                self.violations.append(f"host memory at {address:#x} registered twice")
                return False
            self._registrations[address] = _Registration(address + nbytes, backing)
            self._host_ranges = self._registered_ranges()
        return True

    def unregister_host(self, address: int) -> None:
        mapped = mappings()
        with self._lock:
            self._require_bound_locked("host memory unregistered")
            registration = self._registrations.pop(address, None)
            if registration is None:
                self.violations.append(f"unregistering {address:#x}, where no registration "
                                       "starts")
                return
            if not registration.still_mapped(address, address, mapped):
                self.violations.append(f"host memory registered at {address:#x} was unmapped "
                                       "before it was unregistered")
            self._host_ranges = self._registered_ranges()

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(r.end - start for start, r in self._registrations.items())

    def _registered_ranges(self) -> Ranges:
        return merged((start, r.end) for start, r in self._registrations.items())

    def _check_still_mapped(self, host_side: Ranges) -> None:
        """Every registration of a file's pages a copy goes through still holds the pages
        registered (``/proc/self/maps`` is read only then: anonymous memory cannot be told
        apart from a later mapping at its address anyway)."""
        with self._lock:
            through = [
                (start, registration, max(start, low))
                for start, registration in self._registrations.items()
                if registration.backing is not None and registration.backing[0]
                for low, high in host_side
                if start < high and low < registration.end
            ]
        if not through:
            return
        mapped = mappings()
        for start, registration, address in through:
            if not registration.still_mapped(start, address, mapped):
                with self._lock:
                    self.violations.append(
                        f"a copy through the registration at {start:#x}, whose memory was "
                        "unmapped since (the device would move the pages it locked then)")
                return

    def bind_thread(self) -> None:
        with self._lock:
            self._bound.add(threading.get_ident())

    def _require_bound_locked(self, what: str) -> None:
        """CUDA acts in the calling thread's current device: another device's context (a
        new thread's is device 0's), where a registration is not found and an unbound
        thread creates a context of its own."""
        ident = threading.get_ident()
        if ident != self.model_thread and ident not in self._bound:
            self.violations.append(f"{what} from a thread that never bound the device "
                                   f"({threading.current_thread().name})")

    def close(self) -> None:
        if self._host_lane is not None:
            self._host_lane.close(60.0)
            self._host_lane = None

    def drain(self, timeout_s: float) -> bool:
        return self._host_lane is None or self._host_lane.drain(timeout_s)

    # -- what the test's forward pass does -------------------------------------------------

    def forward_op(self, kind: str, ranges: Iterable[tuple[int, int]],
                   run: Callable[[], None] | None = None, label: str = "") -> Op:
        """Work of vLLM's forward pass on its stream (on the model thread): ``kind``
        forward-write (token rows), forward-zero (a reused block) or forward-read
        (attention)."""
        intervals = merged(ranges)
        reads, writes = (intervals, ()) if kind == "forward-read" else ((), intervals)
        op = self.enqueue(self.forward, kind, reads=reads, writes=writes, run=run, label=label)
        if kind == "forward-write":
            with self._lock:
                op.step = len(self._step_tails)
                self._forward_writes.append(op)
        return op

    def end_step(self) -> None:
        """What vLLM does at the end of a step: the sampled tokens are copied off the
        forward stream, and the host waits for the *previous* step's (asynchronous
        scheduling runs one step ahead)."""
        sample = self.enqueue(self.forward, "sample")
        with self._lock:
            self._step_tails.append(sample)
            if len(self._step_tails) >= 2:
                self._complete_op(self._step_tails[-2])

    def run_all(self) -> None:
        """Everything enqueued runs (the GPU catching up)."""
        with self._lock:
            for op in list(self._ops):
                self._run(op)

    # -- the recorder ---------------------------------------------------------------------

    def enqueue(self, stream: FakeStream, kind: str, *, reads: Ranges = (), writes: Ranges = (),
                deps: Sequence[Op] = (), run: Callable[[], None] | None = None,
                label: str = "") -> Op:
        with self._lock:
            self._require_bound_locked(f"{kind} enqueued")
            predecessors = list(deps) + ([stream.last] if stream.last is not None else [])
            op = Op(len(self._ops), stream, kind, reads, writes, predecessors, run,
                    label=label)
            ancestors = self._observed
            for dep in predecessors:
                ancestors |= dep.ancestors | (1 << dep.index)
            op.ancestors = ancestors
            for earlier in self._live:
                if ancestors >> earlier.index & 1:
                    continue
                if (overlap(op.writes, earlier.writes) or overlap(op.writes, earlier.reads)
                        or overlap(op.reads, earlier.writes)):
                    self.violations.append(
                        f"{op.kind} {op.index} on {stream.name} {op.label} races with "
                        f"{earlier.kind} {earlier.index} on {earlier.stream.name} "
                        f"{earlier.label}: not ordered after it")
            self._ops.append(op)
            if op.reads or op.writes:
                self._live.append(op)
            stream.last = op
            return op

    def complete(self, event: FakeEvent, wait: bool) -> bool:
        """Run what precedes the event's record (the GPU gets there) and observe it."""
        ident = threading.get_ident()
        with self._lock:
            if ident != self.model_thread and ident not in self._bound:
                self.violations.append("an event was queried from a thread that never bound "
                                       f"the device ({threading.current_thread().name})")
            if wait and ident == self.model_thread and self.in_step:
                self.model_thread_syncs += 1
                self.violations.append("the model thread synchronized with the device "
                                       "during a step")
            if event.op is not None:
                self._complete_op(event.op)
            return True

    def _complete_op(self, op: Op) -> None:
        self._run(op)
        self._observed |= op.ancestors | (1 << op.index)
        self._live = [live for live in self._live if not self._observed >> live.index & 1]

    def _run(self, op: Op) -> None:
        if op.done:
            return
        stack = [op]
        while stack:
            current = stack[-1]
            pending = [dep for dep in current.deps if not dep.done]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if not current.done:
                if current.run is not None:
                    current.run()
                current.done = True

    @staticmethod
    def _inside(ranges: Sequence[tuple[int, int]], start: int, end: int) -> bool:
        index = bisect.bisect_right(ranges, (start, float("inf"))) - 1
        return index >= 0 and ranges[index][0] <= start and end <= ranges[index][1]
