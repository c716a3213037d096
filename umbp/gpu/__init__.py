"""Block movement between vLLM's paged KV tensors and flat byte rows.

Knows tensors and layouts; nothing of keys or of vLLM's scheduler.
"""

from umbp.gpu.copier import BlockCopier
from umbp.gpu.handle import CopyHandle
from umbp.gpu.layout import LayerLayout, LayerTensors, describe_layer, describe_layer_parts
from umbp.gpu.staging import StagingRows, allocate_staging

__all__ = [
    "BlockCopier",
    "CopyHandle",
    "LayerLayout",
    "LayerTensors",
    "StagingRows",
    "allocate_staging",
    "describe_layer",
    "describe_layer_parts",
]
