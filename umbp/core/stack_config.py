"""Store options for a serving stack other than vLLM, validated by core.config's rules.

``ConnectorConfig`` mixes two kinds of option: where the store lives and how it is
sized (mode, capacity, endpoint, Mooncake and server options, namespace), which any
stack needs, and how vLLM's connector schedules lookups, loads and KV events, which
only vLLM has. A second stack passes its plug-in's options minus its host's own keys;
vLLM-only options are an error naming the stack, never silently ignored, and every
other rule (types, ranges, options of another mode) is core.config's, reported all
at once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from returns.result import Failure, Result, Success

from umbp.core.config import MODES, ConfigError, ConnectorConfig, parse_connector_config

__all__ = [
    "VLLM_ONLY_OPTIONS",
    "parse_stack_store_config",
]

VLLM_ONLY_OPTIONS = (
    "load_async",
    "enable_lookup",
    "lookup_async",
    "save_decode_cache",
    "store_inflight_bytes",
    "enable_partial_hash_hits",
    "lookup_workers",
    "kv_event_max_objects",
    "lookup_timeout_s",
)


def parse_stack_store_config(
    extra: Mapping[str, object],
    *,
    stack: str,
    host_keys: Collection[str],
    modes: Collection[str],
    refused_modes: Mapping[str, str],
) -> Result[ConnectorConfig, tuple[ConfigError, ...]]:
    """``extra`` without ``host_keys`` (the stack's own plug-in keys), validated as
    store options. ``modes`` are the modes this stack supports; ``refused_modes``
    maps a mode it does not to the sentence saying what to use instead."""
    errors: list[ConfigError] = []
    store_options: dict[str, object] = {}
    for key, value in extra.items():
        if key in host_keys:
            continue
        if key in VLLM_ONLY_OPTIONS:
            errors.append(ConfigError(
                key, f"{key} configures vLLM's connector, not the {stack} storage backend; "
                "remove it"))
            continue
        store_options[key] = value
    mode = store_options.get("mode", "embedded")
    if isinstance(mode, str) and mode in refused_modes:
        errors.append(ConfigError("mode", refused_modes[mode]))
    elif isinstance(mode, str) and mode not in modes and mode in MODES:
        errors.append(ConfigError(
            "mode", f"mode {mode!r} is not offered for {stack}; valid: {', '.join(modes)}"))
    parsed = parse_connector_config(store_options)
    if isinstance(parsed, Failure):
        errors.extend(parsed.failure())
    if errors:
        return Failure(tuple(errors))
    return Success(parsed.unwrap())

