"""umbp as SGLang's HiCache storage tier (GPU -> host -> umbp).

A thin shell over umbp.core and umbp.runtime, like ``umbp.shell`` is for vLLM; the
two never import each other. SGLang loads the backend with
``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "umbp_store", "module_path": "umbp.sglang.hicache_storage",
"class_name": "UMBPHiCacheStore", "interface_v1": 1, ...umbp options}``.

Not to be confused with SGLang's built-in ``umbp`` storage backend
(``sglang.srt.mem_cache.storage.umbp``), which is AMD MORI's UMBP. Importing this
package imports no SGLang and no torch; ``hicache_storage`` does.
"""

from __future__ import annotations

__all__ = ["BACKEND_CLASS", "BACKEND_MODULE", "BACKEND_NAME"]

BACKEND_NAME = "umbp_store"
BACKEND_MODULE = "umbp.sglang.hicache_storage"
BACKEND_CLASS = "UMBPHiCacheStore"
