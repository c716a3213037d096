"""``UMBPHiCacheStore``: the HiCache storage backend SGLang loads (interface v1).

Each TP rank's scheduler process builds one of these. Per call it does three things:
page hashes -> this rank's umbp keys (core.page_identity), one batched call on the
store (runtime contract: embedded pool, ``umbp serve`` client, Mooncake), and the
answer back in SGLang's terms. Every page is one object: the host pool's flat page
(``get_data_page``), K then V, checksummed by the store and verified on every load.

Failure never costs a request: a store that is down answers no hits and refuses
writes; a load that misses, fails its checksum or cannot reach the store is reported
``False`` and SGLang recomputes those tokens. Fetched bytes sit in a staging buffer
until they are known good; only the leading intact pages are copied into the host
pool, so a corrupt page never reaches it.

Interface v2 (several pools: sliding window, Mamba) is not implemented: see
docs/sglang.md for what SGLang's CPU path can run here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from umbp.core.config import ConnectorConfig
from umbp.core.identity import KeySpace
from umbp.core.page_identity import (
    SGLANG_STACK,
    PageRank,
    PageShape,
    leading_hit_count,
    page_key_space,
    page_keys,
    page_namespace,
    pages_to_write,
)
from umbp.runtime.backends import WorkerBackend, open_worker_backend
from umbp.runtime.contract import LabelsNamespaces, LoadStatus
from umbp.runtime.weights import WeightsUnknown, weights_identity
from umbp.sglang.config import parse_backend_config

__all__ = ["HiCacheCounters", "UMBPHiCacheStore"]

logger = logging.getLogger("umbp.sglang")
_KV_POOL = "kv"  # SGLang's PoolName.KV
_PAGE_ROW_LAYOUTS = ("page_first_direct", "page_head")


@dataclass(slots=True)
class HiCacheCounters:
    """What this rank's backend did, since start (logged at close, read by tests)."""

    exists_calls: int = 0
    pages_found: int = 0
    pages_loaded: int = 0
    pages_failed: int = 0
    corrupt_pages: int = 0
    pages_stored: int = 0
    store_failures: int = 0
    store_errors: int = 0


class UMBPHiCacheStore(HiCacheStorage):
    """umbp as SGLang's HiCache storage tier; one object per TP rank."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self._storage_config = storage_config
        self._config: ConnectorConfig = parse_backend_config(storage_config.extra_config or {})
        self._rank = PageRank(
            tp=storage_config.tp_rank, pp=storage_config.pp_rank,
            cp=storage_config.attn_cp_rank, dcp=storage_config.dcp_rank,
        )
        self._backend: WorkerBackend | None = None
        self._shape: PageShape | None = None
        self._space: KeySpace | None = None
        self._page_elements = 0
        self._lock = threading.Lock()  # counters: prefetch and backup threads both call
        self._staging = _StagingRows()
        self.counters = HiCacheCounters()

    # -- set-up ---------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over the host pool once the backend exists: only now is the
        page shape known, so the namespace is computed and the store opened here."""
        super().register_mem_pool_host(mem_pool_host)
        sample = mem_pool_host.get_data_page(0, flat=True)
        self._page_elements = int(sample.numel())
        shape = _page_shape(mem_pool_host, self._storage_config,
                            self._page_elements * sample.element_size())
        if self._config.namespace is None:  # the fingerprint covers the weights loaded
            shape = replace(shape, **_loaded_model())
        if self._config.mode == "embedded" and shape.is_mla and shape.tp_size > 1:
            raise ValueError(
                "umbp: mode 'embedded' cannot serve an MLA model at TP > 1 (SGLang writes "
                "MLA pages from one rank only, the other ranks' pools stay empty); use "
                "mode 'server' or 'mooncake'")
        namespace = page_namespace(shape, self._config.namespace)
        if not isinstance(namespace.value_or(None), str):
            raise ValueError(f"umbp: {namespace.failure()}")  # noqa: TRY004 - a Result
        self._shape = shape
        self._space = page_key_space(namespace.unwrap(), shape)
        page_bytes = self._config.page_bytes or max(4096, -(-shape.page_bytes // 4096) * 4096)
        self._backend = open_worker_backend(self._config, page_bytes,
                                            serve_other_processes=False)
        if isinstance(self._backend.store, LabelsNamespaces):  # `umbp ls` names the model
            self._backend.store.register_namespace(
                namespace.unwrap(), f"sglang {shape.model_name} "
                f"{shape.weights[:24] or 'explicit namespace'} {shape.kv_dtype} "
                f"{shape.pool_kind} tp{shape.tp_size}")
        logger.info("umbp: SGLang HiCache storage, mode %s, namespace %s, rank %s, "
                    "%d-byte pages", self._config.mode, namespace.unwrap(), self._rank,
                    shape.page_bytes)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's cache controller registers every host pool here; the KV pool is the
        one ``register_mem_pool_host`` handed over. Any further pool (sliding-window KV,
        Mamba state...) needs interface v2, which is not implemented: the engine's start
        fails with a sentence instead of a NotImplementedError at the first request."""
        if str(host_pool_name) == _KV_POOL:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise ValueError(
            f"umbp's SGLang storage backend implements HiCache interface v1 (one KV pool) "
            f"only; this model also has the host pool {str(host_pool_name)!r}, which needs "
            "interface v2. Run it without --hicache-storage-backend dynamic (umbp).")

    @property
    def namespace(self) -> str:
        return self._require_space().namespace

    # -- interface v1 -----------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Leading pages this rank holds (SGLang takes the minimum across ranks)."""
        umbp_keys = self._keys(keys)
        if umbp_keys is None or not umbp_keys:
            return 0
        try:
            answers = self._store().lookup(umbp_keys)
        except Exception as error:  # noqa: BLE001 - a store down costs hits, not requests
            logger.warning("umbp: lookup failed (%s); counting %d pages as misses",
                           error, len(keys))
            return 0
        hits = leading_hit_count(answers)
        with self._lock:
            self.counters.exists_calls += 1
            self.counters.pages_found += hits
        return hits

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Fetch pages into staging, then copy the leading intact ones into the host
        pool at their slots; every other page answers False and is recomputed."""
        umbp_keys = self._keys(keys)
        slots = self._page_slots(host_indices, len(keys))
        if umbp_keys is None or slots is None:
            return [False] * len(keys)
        staging = self._staging.rows(len(keys), self._page_elements, self.mem_pool_host.dtype)
        rows = staging.view(torch.uint8).numpy()
        try:
            statuses = self._store().get_batch_into(umbp_keys, [memoryview(row) for row in rows])
        except Exception as error:  # noqa: BLE001 - no store error may fail a request
            logger.warning("umbp: load of %d pages failed (%s); they are recomputed",
                           len(keys), error)
            statuses = tuple(LoadStatus.UNAVAILABLE for _ in keys)
        written = pages_to_write([status is LoadStatus.HIT for status in statuses])
        self._write_pages(slots[: len(written)], staging[: len(written)])
        with self._lock:
            self.counters.pages_loaded += len(written)
            self.counters.pages_failed += len(keys) - len(written)
            self.counters.corrupt_pages += sum(s is LoadStatus.CORRUPT for s in statuses)
        if len(written) < len(keys):
            logger.info("umbp: %d of %d pages restored (%s)", len(written), len(keys),
                        ", ".join(sorted({s.value for s in statuses if s is not LoadStatus.HIT})))
        return [index < len(written) for index in range(len(keys))]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        umbp_keys = self._keys(keys)
        slots = self._page_slots(host_indices, len(keys))
        if umbp_keys is None or slots is None:
            return [False] * len(keys)
        return self._put(umbp_keys, list(self._read_pages(slots)))

    # -- the single-key methods HiCacheStorage declares abstract ----------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Pages into the given flat page tensors (or new ones); None for a page that
        did not load intact."""
        umbp_keys = self._keys(keys)
        if umbp_keys is None:
            return [None] * len(keys)
        pool = self.mem_pool_host
        targets = [
            target if target is not None else torch.empty(self._page_elements, dtype=pool.dtype)
            for target in (target_locations or [None] * len(keys))
        ]
        try:
            statuses = self._store().get_batch_into(
                umbp_keys, [memoryview(t.view(torch.uint8).numpy()) for t in targets])
        except Exception as error:  # noqa: BLE001 - no store error may fail a request
            logger.warning("umbp: load of %d pages failed (%s)", len(keys), error)
            return [None] * len(keys)
        return [t if s is LoadStatus.HIT else None for t, s in zip(targets, statuses)]

    def set(
        self, key: str, value: Any | None = None, target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        umbp_keys = self._keys(keys)
        if umbp_keys is None or values is None or len(values) != len(keys):
            return False
        return all(self._put(umbp_keys, [value.contiguous() for value in values]))

    def clear(self) -> None:
        if self._backend is not None:
            self._backend.store.clear()

    def close(self) -> None:
        if self._backend is not None:
            logger.info("umbp: closing SGLang storage backend: %s", self.counters)
            self._backend.close()
            self._backend = None

    # -- helpers --------------------------------------------------------------------

    def _read_pages(self, slots: Sequence[int]) -> torch.Tensor:
        """The flat pages at ``slots``, one row each (a copy, in this thread's staging
        rows: valid until its next call)."""
        pool = self.mem_pool_host
        buffer = self._page_major_buffer()
        if buffer is not None:
            rows = self._staging.rows(len(slots), self._page_elements, pool.dtype)
            numbers = self._page_numbers(slots)
            pages = rows.view(len(slots), 2, *buffer.shape[2:])
            for half in (0, 1):  # K, then V: gathered straight into each row's half
                torch.index_select(buffer[half], 0, numbers, out=pages[:, half])
            return rows
        return torch.stack([pool.get_data_page(slot, flat=True) for slot in slots])

    def _write_pages(self, slots: Sequence[int], rows: torch.Tensor) -> None:
        """Copy ``rows`` (flat pages) into the host pool at ``slots``."""
        if not slots:
            return
        pool = self.mem_pool_host
        buffer = self._page_major_buffer()
        if buffer is not None:
            pages = rows.view(len(slots), 2, *buffer.shape[2:]).transpose(0, 1)
            buffer[:, self._page_numbers(slots)] = pages
            return
        for slot, row in zip(slots, rows):
            pool.set_from_flat_data_page(slot, row)

    def _page_major_buffer(self) -> torch.Tensor | None:
        """The host pool's KV buffer as ``(2, pages, ...)``, page p = ``[:, p]`` (K then
        V, as ``get_data_page`` flattens it), for the layouts where that is a free view;
        None for the others (moved page by page). One batched gather or scatter then
        moves a whole call's pages. Batched, not page by page, because these calls run
        in SGLang's background threads while its scheduler thread spins: every per-page
        torch call hands the GIL back and forth, which cost seconds per prefix."""
        pool = self.mem_pool_host
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or not buffer.is_contiguous():
            return None
        if pool.layout in _PAGE_ROW_LAYOUTS and buffer.dim() == 6:
            return buffer  # (2, pages, ...) already
        if pool.layout == "page_first" and buffer.dim() == 5:  # (2, tokens, layers, ...)
            page_size = int(pool.page_size)
            return buffer.view(2, buffer.shape[1] // page_size, page_size, *buffer.shape[2:])
        return None

    def _page_numbers(self, slots: Sequence[int]) -> torch.Tensor:
        page_size = self._require_shape().page_size
        return torch.tensor([slot // page_size for slot in slots], dtype=torch.int64)

    def _put(self, umbp_keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """``pages``: contiguous flat pages (rows of one tensor, or single pages)."""
        try:
            results = self._store().put_batch(
                umbp_keys, [memoryview(page.view(torch.uint8).numpy()) for page in pages])
        except Exception as error:  # noqa: BLE001 - no store error may fail a request
            logger.warning("umbp: store of %d pages failed (%s)", len(pages), error)
            with self._lock:
                self.counters.store_errors += 1
            return [False] * len(pages)
        with self._lock:
            self.counters.pages_stored += sum(results)
            self.counters.store_failures += len(results) - sum(results)
        return list(results)

    def _keys(self, page_hashes: Sequence[str]) -> tuple[str, ...] | None:
        keys = page_keys(self._require_space(), self._rank, self._require_shape(), page_hashes)
        if keys is None:
            logger.warning("umbp: page hashes that are not hex digests; treated as misses")
        return keys

    def _page_slots(self, host_indices: torch.Tensor, pages: int) -> list[int] | None:
        """The host slot of each page's first token; None when the indices do not
        cover exactly ``pages`` pages."""
        page_size = self._require_shape().page_size
        if host_indices.numel() != pages * page_size:
            logger.warning("umbp: %d host indices for %d pages of %d tokens; refused",
                           host_indices.numel(), pages, page_size)
            return None
        return [int(slot) for slot in host_indices[::page_size].tolist()]

    def _store(self) -> Any:
        if self._backend is None:
            raise RuntimeError("umbp: the storage backend is closed or has no host pool yet")
        return self._backend.store

    def _require_space(self) -> KeySpace:
        if self._space is None:
            raise RuntimeError("umbp: register_mem_pool_host has not been called")
        return self._space

    def _require_shape(self) -> PageShape:
        if self._shape is None:
            raise RuntimeError("umbp: register_mem_pool_host has not been called")
        return self._shape


class _StagingRows(threading.local):
    """Reused page rows, one set per calling thread (SGLang's prefetch and backup
    threads call at the same time). A fresh buffer per call cost more than the copy
    itself: every 4 KiB of a new allocation is a page fault on first touch
    (docs/performance.md, SGLang HiCache). Calls larger than ``_KEEP_BYTES`` get a buffer of
    their own, so a big model's 128-page calls do not pin gigabytes per thread."""

    _KEEP_BYTES: Final = 256 << 20

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def rows(self, count: int, elements: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` rows of ``elements`` (contents undefined)."""
        wanted = count * elements * dtype.itemsize
        if wanted > self._KEEP_BYTES:
            return torch.empty((count, elements), dtype=dtype)
        if self._buffer is None or self._buffer.numel() < wanted:
            self._buffer = torch.empty(wanted, dtype=torch.uint8)
        return self._buffer[:wanted].view(dtype).view(count, elements)


def _loaded_model() -> dict[str, Any]:
    """The weights SGLang loaded and the settings that change what they compute, from
    its server arguments (``PageShape.weights``, ``PageShape.model_settings``); raises
    ``WeightsUnknown`` saying to set ``namespace`` when they cannot be identified."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except (ImportError, ValueError, AttributeError):
        args = None
    if args is None:
        raise WeightsUnknown(
            "umbp cannot read which model SGLang loaded (no server arguments in this "
            "process); set 'namespace' in --hicache-storage-backend-extra-config to a name "
            "you change whenever the weights change")
    weights = weights_identity(str(args.model_path), args.revision, str(args.load_format),
                               args.download_dir)
    settings = (("quantization", str(args.quantization)),
                ("json_model_override_args", str(args.json_model_override_args or "")))
    return {"weights": weights, "model_settings": settings}


def _page_shape(pool: Any, config: HiCacheStorageConfig, page_bytes: int) -> PageShape:
    """Everything the host pool and storage config say shapes a page's bytes. MLA pools
    have no heads: their latent widths stand in the head fields."""
    head_dim = int(getattr(pool, "head_dim", getattr(pool, "kv_lora_rank", 0)))
    v_head_dim = int(getattr(pool, "v_head_dim", getattr(pool, "qk_rope_head_dim", 0)))
    return PageShape(
        stack=SGLANG_STACK,
        model_name=str(config.model_name or ""),
        kv_dtype=str(pool.dtype),
        pool_kind=type(pool).__name__,
        layout=str(pool.layout),
        page_size=int(pool.page_size),
        layer_num=int(pool.layer_num),
        head_num=int(getattr(pool, "head_num", 1)),
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        page_bytes=page_bytes,
        is_mla=bool(config.is_mla_model),
        tp_size=int(config.tp_size),
        pp_size=int(config.pp_size),
        cp_size=int(config.attn_cp_size),
        dcp_size=int(config.dcp_size),
    )
