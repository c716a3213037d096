"""Properties of UMBPHiCacheStore itself, on a real embedded SlabPool.

The host pool is a small stand-in with the page semantics of SGLang's MHA host pool
(K and V of a page, every layer, as one flat page) in three of its layouts, so that the
properties can see every slot: a load writes only the pages it was asked for and only
the leading intact ones; a corrupt object is reported False and never reaches the host
pool; the hit count is the leading run of stored pages.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from umbp.runtime.embedded import local_pools
from umbp.sglang.hicache_storage import UMBPHiCacheStore

PAGE_SIZE = 4
PAGES = 12
LAYERS, HEADS, DIM = 2, 2, 4


_DIMS = {  # SGLang's MHATokenToKVPoolHost buffer shapes, by layout
    "page_first_direct": (2, PAGES, LAYERS, PAGE_SIZE, HEADS, DIM),
    "page_first": (2, PAGES * PAGE_SIZE, LAYERS, HEADS, DIM),
    "layer_first": (2, LAYERS, PAGES * PAGE_SIZE, HEADS, DIM),
}
LAYOUTS = tuple(_DIMS)


class HostPool:
    """What the backend uses of SGLang's MHATokenToKVPoolHost, with its page semantics
    for three layouts: the backend moves page-major ones (page_first_direct, page_first)
    in one batched copy and the others page by page."""

    dtype = torch.float32
    page_size = PAGE_SIZE
    layer_num = LAYERS
    head_num = HEADS
    head_dim = DIM
    v_head_dim = DIM

    def __init__(self, seed: int, layout: str = "page_first_direct") -> None:
        generator = torch.Generator().manual_seed(seed)
        self.layout = layout
        self.kv_buffer = torch.randn(_DIMS[layout], generator=generator)

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "page_first_direct":
            return self.kv_buffer[:, index // PAGE_SIZE : index // PAGE_SIZE + 1]
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + PAGE_SIZE]
        return self.kv_buffer[:, :, index : index + PAGE_SIZE]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page[...] = data_page.reshape(page.shape)


def _backend(host: HostPool, tp_rank: int = 0, namespace: str | None = "tiny") -> UMBPHiCacheStore:
    """Outside a running SGLang server no weights are known, so an explicit namespace
    (the fingerprint's own test below publishes server arguments)."""
    extra: dict[str, Any] = {"backend_name": "umbp_store", "interface_v1": 1,
                             "mode": "embedded", "capacity_bytes": 1 << 20}
    if namespace is not None:
        extra["namespace"] = namespace
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="tiny", extra_config=extra)
    backend = UMBPHiCacheStore(config, {})
    backend.register_mem_pool_host(host)
    return backend


def _indices(slots: list[int]) -> torch.Tensor:
    return torch.tensor([slot * PAGE_SIZE + offset for slot in slots
                         for offset in range(PAGE_SIZE)], dtype=torch.int64)


def _flip(backend: UMBPHiCacheStore, page_hash: str) -> None:
    (key,) = backend._keys([page_hash]) or ()
    (pool,) = [pool for pool in local_pools() if key in pool.stored_keys()]
    offset, _ = pool.object_regions(key)[0]
    pool.slab_view()[offset + 3] ^= 0xFF


hashes = st.lists(st.binary(min_size=32, max_size=32).map(bytes.hex), min_size=1,
                  max_size=6, unique=True)


@settings(max_examples=40)
@given(hashes, st.data())
def test_hits_loads_and_corruption(page_hashes: list[str], data: Any) -> None:
    count = len(page_hashes)
    stored = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
    corrupt = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
    source_slots = data.draw(st.permutations(range(PAGES)))[:count]
    target_slots = data.draw(st.permutations(range(PAGES)))[:count]
    layout = data.draw(st.sampled_from(LAYOUTS))
    source = HostPool(seed=1, layout=layout)
    backend = _backend(source)
    try:
        chosen = [i for i in range(count) if stored[i]]
        if chosen:
            assert all(backend.batch_set_v1([page_hashes[i] for i in chosen],
                                            _indices([source_slots[i] for i in chosen])))
        leading_stored = stored.index(False) if False in stored else count
        assert backend.batch_exists(page_hashes) == leading_stored

        for i in chosen:
            if corrupt[i]:
                _flip(backend, page_hashes[i])
        target = HostPool(seed=2, layout=layout)
        before = HostPool(seed=2, layout=layout)
        backend.mem_pool_host = target  # the same store, loading into another host pool
        results = backend.batch_get_v1(page_hashes, _indices(target_slots))

        intact = [stored[i] and not corrupt[i] for i in range(count)]
        leading = intact.index(False) if False in intact else count
        assert results == [i < leading for i in range(count)]
        for slot in range(PAGES):
            written = [i for i in range(leading) if target_slots[i] == slot]
            now = target.get_data_page(slot * PAGE_SIZE)
            if written:
                assert torch.equal(now, source.get_data_page(source_slots[written[0]] * PAGE_SIZE))
            else:  # a page not asked for, or not restored, is untouched
                assert torch.equal(now, before.get_data_page(slot * PAGE_SIZE))
    finally:
        backend.close()


@given(hashes)
def test_each_tp_rank_stores_and_asks_only_its_own_keys(page_hashes: list[str]) -> None:
    rank0 = _backend(HostPool(seed=1), tp_rank=0)
    rank1 = _backend(HostPool(seed=1), tp_rank=1)
    try:
        keys0, keys1 = rank0._keys(page_hashes), rank1._keys(page_hashes)
        assert keys0 is not None and keys1 is not None
        assert not set(keys0) & set(keys1)
        assert rank0.namespace == rank1.namespace
    finally:
        rank0.close()
        rank1.close()


def test_a_second_host_pool_stops_the_start_with_a_sentence() -> None:
    """Hybrid models (sliding window, Mamba) need interface v2, which is not implemented."""
    host = HostPool(seed=1)
    backend = _backend(host)
    try:
        backend.register_mem_host_pool_v2(host, "kv")  # the KV pool itself is fine
        with pytest.raises(ValueError, match="interface v1 .* host pool 'mamba'"):
            backend.register_mem_host_pool_v2(HostPool(seed=2), "mamba")
    finally:
        backend.close()


def test_the_namespace_covers_the_weights_sglang_loaded(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New weights at the same --model-path give another namespace; none known (no
    server arguments in the process) stops the start with a sentence."""
    import types

    from sglang.srt import runtime_context

    from umbp.runtime.weights import WeightsUnknown

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    args = types.SimpleNamespace(model_path=str(model), revision=None, load_format="auto",
                                 download_dir=None, quantization=None,
                                 json_model_override_args="{}")
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
    first = _backend(HostPool(0), namespace=None).namespace
    (model / "model.safetensors").write_bytes(b"\1" * 4096)
    second = _backend(HostPool(0), namespace=None).namespace
    assert first.startswith("sglang.") and second.startswith("sglang.") and first != second
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: None)
    with pytest.raises(WeightsUnknown, match="set 'namespace'"):
        _backend(HostPool(0), namespace=None)
