"""Block movement between vLLM's paged KV tensors and host memory.

Knows tensors, layouts and devices; nothing of keys or of vLLM's scheduler.
"""

from umbp.gpu.copier import BlockCopier, BlockCopy, CopyRanges
from umbp.gpu.device import Device, Event, HostDevice, Stream, device_for
from umbp.gpu.layout import LayerLayout, LayerTensors, describe_layer, describe_layer_parts
from umbp.gpu.staging import StagingRing, StagingSlot

__all__ = [
    "BlockCopier",
    "BlockCopy",
    "CopyRanges",
    "Device",
    "Event",
    "HostDevice",
    "LayerLayout",
    "LayerTensors",
    "StagingRing",
    "StagingSlot",
    "Stream",
    "describe_layer",
    "describe_layer_parts",
    "device_for",
]
