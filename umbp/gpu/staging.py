"""Host buffers that hold stored objects on their way to or from the KV tensors."""

from __future__ import annotations

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
