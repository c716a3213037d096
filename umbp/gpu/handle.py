"""A block copy that may still be running on a CUDA copy stream."""

from __future__ import annotations

import torch


class CopyHandle:
    """Completion of one enqueued gather or scatter.

    On CUDA the copy runs on the copier's stream and ``event`` is recorded after it; the
    handle also keeps the tensors the copy reads or writes alive (index tensors, caller
    buffers) until the copy is known to be finished. On CPU the copy already happened.
    """

    __slots__ = ("_device", "_event", "_keepalive")

    def __init__(
        self,
        event: torch.cuda.Event | None,
        device: torch.device | None = None,
        keepalive: tuple[object, ...] = (),
    ) -> None:
        self._event = event
        self._device = device
        self._keepalive = keepalive

    @classmethod
    def completed(cls) -> CopyHandle:
        """A handle for a copy that already finished (every CPU copy)."""
        return cls(None)

    def done(self) -> bool:
        """True once the copy finished; never blocks."""
        if self._event is None or bool(self._event.query()):
            self._release()
            return True
        return False

    def wait(self) -> None:
        """Block the host until the copy finished (gathered bytes are then readable)."""
        if self._event is not None:
            self._event.synchronize()
        self._release()

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order later work on ``stream`` (default: the current one) after this copy.

        Does not block the host: a forward pass that reads scattered blocks calls this
        instead of ``wait`` so the GPU, not the CPU, waits. Buffers stay referenced until
        ``done``/``wait`` because the host cannot know when the GPU finished with them.
        """
        if self._event is None:
            return
        waiting = stream if stream is not None else torch.cuda.current_stream(self._device)
        waiting.wait_event(self._event)

    def _release(self) -> None:
        self._event = None
        self._keepalive = ()
