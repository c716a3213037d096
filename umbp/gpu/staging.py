"""Host buffers that hold stored objects on their way to or from the KV tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch


def allocate_staging(
    num_objects: int, object_bytes: int, device_of_kv: torch.device
) -> torch.Tensor:
    """A uint8 ``[num_objects, object_bytes]`` host buffer for gathers and scatters.

    Pinned when the KV lives on CUDA: only page-locked memory lets a device<->host copy
    run asynchronously on the copy stream (a pageable copy makes the host wait).
    """
    if num_objects < 0 or object_bytes < 0:
        raise ValueError(
            f"staging size must be non-negative, got {num_objects} x {object_bytes} bytes"
        )
    return torch.empty(
        (num_objects, object_bytes),
        dtype=torch.uint8,
        pin_memory=torch.device(device_of_kv).type == "cuda",
    )


class StagingRows:
    """One reused host buffer per cache group, grown by doubling: fresh memory costs
    a page fault per 4 KiB, which is slower than the copy itself.

    ``on_allocate`` / ``on_release`` see each buffer when it is made and before it
    is dropped (a transport that moves bytes only from registered memory registers
    it there)."""

    def __init__(
        self,
        on_allocate: Callable[[torch.Tensor], None] = lambda buffer: None,
        on_release: Callable[[torch.Tensor], None] = lambda buffer: None,
    ) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._on_allocate = on_allocate
        self._on_release = on_release

    def rows(
        self, group_id: int, num_objects: int, object_bytes: int, device_of_kv: torch.device
    ) -> torch.Tensor:
        """The first ``num_objects`` rows of the group's buffer (the same memory on
        every call until the buffer has to grow)."""
        buffer = self._buffers.get(group_id)
        if buffer is None or buffer.shape[0] < num_objects or buffer.shape[1] != object_bytes:
            capacity = max(num_objects, 2 * (0 if buffer is None else int(buffer.shape[0])))
            if buffer is not None:
                self._on_release(buffer)
            buffer = allocate_staging(capacity, object_bytes, device_of_kv)
            self._on_allocate(buffer)
            self._buffers[group_id] = buffer
        return buffer[:num_objects]

    def release(self) -> None:
        """Drop every buffer (after ``on_release`` saw it)."""
        for buffer in self._buffers.values():
            self._on_release(buffer)
        self._buffers = {}
