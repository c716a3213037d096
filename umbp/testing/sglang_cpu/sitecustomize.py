"""TEST-ONLY: patches SGLang's host-pool modules for CPU machines as they are imported.

See ``umbp/testing/sglang_cpu/__init__.py``. Runs at interpreter start in every process
with this directory on ``PYTHONPATH``; it imports nothing of SGLang itself, it waits for
SGLang to import the modules below and then replaces a few of their names.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_HOST_RESERVE_BYTES = int(os.environ.get("UMBP_TEST_SGLANG_HOST_RESERVE_BYTES", str(256 << 20)))


def _no_host_register(*args: Any, **kwargs: Any) -> None:
    """cudaHostRegister needs an NVIDIA driver; pinning buys nothing on CPU."""


def _slots(indices: Any, page_size: int) -> tuple[Any, Any]:
    return indices // page_size, indices % page_size


def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any,
                       dst_indices: Any, page_size: int) -> None:
    """Token rows between two token-major (layer_first) buffers."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any],
                                       src_indices: Any, dst_indices: Any, layer_id: int,
                                       page_size: int) -> None:
    """One layer, host (pages, layers, page_size, heads, dim) -> device (tokens, heads, dim)."""
    pages, offsets = _slots(src_indices, page_size)
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices] = src[pages, layer_id, offsets].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any],
                                       src_indices: Any, dst_indices: Any,
                                       page_size: int) -> None:
    """Every layer, device K layers then V layers -> host K and V page-first buffers."""
    pages, offsets = _slots(dst_indices, page_size)
    layers = len(src_ptrs) // len(dst_ptrs)
    for part, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[pages, layer, offsets] = src_ptrs[part * layers + layer][src_indices].to(dst.device)


def _unpinned_dummy_flat_data_page(pool: Any) -> Any:
    """SGLang's generic (non-v1) storage path reads pages into these; it pins them,
    which needs an NVIDIA driver."""
    import torch

    shape = (2, pool.layer_num, pool.page_size, pool.head_num, pool.head_dim)
    return torch.zeros(shape, dtype=pool.dtype, device=pool.device).flatten()


def _patch_common(module: ModuleType) -> None:
    # setattr: these names are SGLang's module globals, unknown to mypy
    setattr(module, "_cuda_host_register", _no_host_register)  # noqa: B010
    setattr(module, "_cuda_host_unregister", _no_host_register)  # noqa: B010


def _patch_base(module: ModuleType) -> None:
    setattr(module, "HICACHE_HOST_MEMORY_RESERVE_BYTES", _HOST_RESERVE_BYTES)  # noqa: B010


def _patch_transfer_ops(module: ModuleType) -> None:
    for op in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf,
               transfer_kv_all_layer_direct_lf_pf):
        setattr(module, op.__name__, op)
    if hasattr(module, "_cuda_host_unregister"):
        setattr(module, "_cuda_host_unregister", _no_host_register)  # noqa: B010
    host_pool = getattr(module, "MHATokenToKVPoolHost", None)
    if host_pool is not None:
        host_pool.get_dummy_flat_data_page = _unpinned_dummy_flat_data_page


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.common": _patch_common,
    "sglang.srt.mem_cache.pool_host.base": _patch_base,
    "sglang.srt.mem_cache.pool_host.mha": _patch_transfer_ops,
    "sglang.srt.mem_cache.memory_pool_host": _patch_transfer_ops,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _PatchOnImport())
