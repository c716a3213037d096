"""The differences between the supported vLLM versions (0.32, 0.33) that umbp
meets, feature-detected: the cache coordinator's arguments (the lookahead ones,
and the optional ones its signature names) and its partial-hash-hit flag, the
``BlockStored`` event's fields, and where vLLM's engine builds its KV cache
configs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def coordinator_lookahead(vllm_config: Any) -> dict[str, int]:
    """The lookahead arguments of vLLM's cache coordinator: 0.32 takes the prefill
    lookahead only, 0.33 also a hash lookahead."""
    lookahead = {"num_prefill_lookahead": int(vllm_config.num_prefill_lookahead_tokens)}
    if hasattr(type(vllm_config), "num_hash_lookahead_tokens"):
        lookahead["num_hash_lookahead_tokens"] = int(vllm_config.num_hash_lookahead_tokens)
    return lookahead


def coordinator_arguments(
    parameters: Mapping[str, object] | Sequence[str],
    required: Mapping[str, object],
    optional: Mapping[str, object],
) -> dict[str, object]:
    """Keyword arguments for ``get_kv_cache_coordinator``: every required one,
    and the optional ones this vLLM version's signature names (0.32 and 0.33
    differ, e.g. 0.33's ``num_hash_lookahead_tokens``)."""
    missing = [name for name in required if name not in parameters]
    if missing:
        raise RuntimeError(
            "this vLLM's get_kv_cache_coordinator lacks parameters umbp needs: "
            f"{', '.join(missing)}; use vLLM 0.32 or 0.33"
        )
    return {**required, **{k: v for k, v in optional.items() if k in parameters}}


def coordinator_allows_partial_hash_hits(coordinator: Any) -> bool:
    """0.33's coordinator records whether it probes hash-block boundaries inside a
    group's blocks; 0.32's never does."""
    return bool(getattr(coordinator, "enable_partial_hash_hits", False))


def block_stored_takes_lookahead(block_stored: type) -> bool:
    """vLLM 0.33's ``BlockStored`` event has a ``lookahead_token_ids`` field."""
    return "lookahead_token_ids" in getattr(block_stored, "__struct_fields__", ())


def engine_kv_cache_configs(
    vllm_config: Any, kv_cache_specs: dict[str, Any], available_memory: int
) -> tuple[Any, Any]:
    """(worker config, scheduler config) for one worker's layer specs, built the
    way vLLM's engine core does at start-up (``_initialize_kv_caches``).

    vLLM 0.32 has ``get_kv_cache_configs`` in ``kv_cache_utils``; 0.33 moved it to
    ``kv_cache_planning`` and takes the global groups from
    ``get_global_kv_cache_groups``. Used by the tests that drive vLLM's scheduler
    without an engine."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_kv_cache_block_sizes,
    )

    legacy = getattr(kv_cache_utils, "get_kv_cache_configs", None)
    if legacy is not None:  # 0.32
        configs = legacy(vllm_config, [kv_cache_specs], [available_memory])
    else:
        try:
            from vllm.v1.core.kv_cache_planning import (
                get_global_kv_cache_groups,
                get_kv_cache_configs,
            )
        except ImportError as error:
            raise RuntimeError(
                f"vLLM {_vllm_version()} has neither kv_cache_utils.get_kv_cache_configs "
                "(0.32) nor kv_cache_planning.get_kv_cache_configs (0.33)"
            ) from error
        groups = get_global_kv_cache_groups(vllm_config, [kv_cache_specs])
        configs = get_kv_cache_configs(vllm_config, [kv_cache_specs], [available_memory], groups)
    worker = configs[0]
    scheduler = generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = scheduler.num_blocks
    _, hash_block_size = resolve_kv_cache_block_sizes(scheduler, vllm_config)
    for config in (worker, scheduler):
        config.hash_block_size = hash_block_size
    return worker, scheduler


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))
