"""``kv_connector_extra_config`` -> a validated, frozen :class:`ConnectorConfig`.

Validation collects every problem at once: a user who mistyped two options and gave
a third the wrong type learns all three from one engine start. Types are strict
because the values come from JSON or a Python dict written by hand: ``"true"`` is
not a boolean, ``True`` is not an integer and ``2.0`` is not an integer count.
Integers are accepted where a float is expected.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Final, cast

from returns.result import Failure, Result, Success

from umbp.core.identity import check_namespace_override

__all__ = [
    "AVAILABLE_MODES",
    "DEFAULT_CONFIG",
    "FUTURE_MODES",
    "MAX_PAGE_BYTES",
    "MIN_PAGE_BYTES",
    "OPTION_DOCS",
    "OPTION_NAMES",
    "ConfigError",
    "ConnectorConfig",
    "effective_load_async",
    "format_config_errors",
    "parse_connector_config",
]

AVAILABLE_MODES: Final = ("embedded",)
# Accepted by later versions; named so that a user gets "not available yet"
# rather than "invalid".
FUTURE_MODES: Final = ("server", "mooncake", "mori")
MIN_PAGE_BYTES: Final = 4 << 10
MAX_PAGE_BYTES: Final = 64 << 20
MAX_LOOKUP_WORKERS: Final = 64


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's options, validated. Field defaults are the documented defaults."""

    mode: str = "embedded"
    load_async: bool = True
    enable_lookup: bool = True
    lookup_async: bool = False
    save_decode_cache: bool = False
    enable_partial_hash_hits: bool = False
    lookup_workers: int = 2
    kv_event_max_objects: int = 65536
    namespace: str | None = None
    capacity_bytes: int = 1 << 30
    page_bytes: int | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    lookup_timeout_s: float = 5.0


DEFAULT_CONFIG: Final = ConnectorConfig()
OPTION_NAMES: Final = tuple(option.name for option in fields(ConnectorConfig))

OPTION_DOCS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "mode": "where the pool lives; this version offers 'embedded' (in the engine process)",
        "load_async": "restore KV from the pool while the request waits, off the model step "
        "(forced on for several KV cache groups, Mamba-style or sparse-indexer layers)",
        "enable_lookup": "look up prompt prefixes in the pool and restore the hits",
        "lookup_async": "run pool lookups in background threads; the request waits a step",
        "save_decode_cache": "also store blocks produced while decoding, not only the prompt's",
        "enable_partial_hash_hits": "match at the hash block size when it is finer than "
        "the KV block size",
        "lookup_workers": f"threads for asynchronous lookups and residency checks (1-{MAX_LOOKUP_WORKERS})",
        "kv_event_max_objects": "most stored objects tracked for BlockStored/BlockRemoved "
        "KV events (>= 1)",
        "namespace": "explicit key namespace (1-128 of letters, digits, '.', '_', '-'); "
        "default: a fingerprint of model, dtype, cache layout and parallel layout",
        "capacity_bytes": "bytes of host memory the pool may use (>= page_bytes)",
        "page_bytes": "pool page size in bytes, a power of two from 4 KiB to 64 MiB; "
        "null (default): one page per stored object of the smallest cache group",
        "high_watermark": "fill fraction at which the pool starts evicting (0 < low < high <= 1)",
        "low_watermark": "fill fraction eviction brings the pool back down to (0 < low < high)",
        "lookup_timeout_s": "seconds the scheduler waits for a lookup answer from a pool in "
        "another process before counting it a miss (> 0)",
    }
)


@dataclass(frozen=True, slots=True)
class ConfigError:
    """One bad entry of ``kv_connector_extra_config``."""

    key: str
    message: str


# ---------------------------------------------------------------------------
# Value checks. Each returns an error message, or None when the value is fine.

_Check = Callable[[object], "str | None"]


def _show(value: object) -> str:
    """A short repr; never raises (huge ints exceed the int-to-str digit limit)."""
    try:
        text = repr(value)
    except ValueError:
        return "(too long to print)"
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(value: object) -> str:
    return f"{type(value).__name__} {_show(value)}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _boolean(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    return f"expected a boolean (true/false), got {_describe(value)}"


def _integer(low: int, high: int | None) -> _Check:
    bounds = f"between {low} and {high}" if high is not None else f">= {low}"

    def check(value: object) -> str | None:
        if not _is_int(value):
            return f"expected an integer {bounds}, got {_describe(value)}"
        assert isinstance(value, int)
        if value < low or (high is not None and value > high):
            return f"must be {bounds}, got {_show(value)}"
        return None

    return check


def _number(rule: str, accepts: Callable[[float], bool]) -> _Check:
    def check(value: object) -> str | None:
        if not _is_number(value):
            return f"expected a number {rule}, got {_describe(value)}"
        assert isinstance(value, (int, float))
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number) or not accepts(number):
            return f"must be a finite number {rule}, got {_show(value)}"
        return None

    return check


def _mode(value: object) -> str | None:
    if not isinstance(value, str):
        return f"expected a string, one of {', '.join(AVAILABLE_MODES)}; got {_describe(value)}"
    if value in AVAILABLE_MODES:
        return None
    available = ", ".join(AVAILABLE_MODES)
    if value in FUTURE_MODES:
        return f"mode {value!r} is not available in this version; available: {available}"
    return (
        f"mode {value!r} is not a valid mode; valid values: {available} "
        f"({', '.join(FUTURE_MODES)} come in later versions)"
    )


def _namespace(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        return f"expected a string or null, got {_describe(value)}"
    return check_namespace_override(value).swap().value_or(None)


def _page_bytes(value: object) -> str | None:
    rule = "a power of two between 4096 (4 KiB) and 67108864 (64 MiB)"
    if value is None:
        return None
    if not _is_int(value):
        return f"expected an integer, {rule}, got {_describe(value)}"
    assert isinstance(value, int)
    if not MIN_PAGE_BYTES <= value <= MAX_PAGE_BYTES or value & (value - 1):
        return f"must be {rule}, got {_show(value)}"
    return None


_CHECKS: Final[Mapping[str, _Check]] = MappingProxyType(
    {
        "mode": _mode,
        "load_async": _boolean,
        "enable_lookup": _boolean,
        "lookup_async": _boolean,
        "save_decode_cache": _boolean,
        "enable_partial_hash_hits": _boolean,
        "lookup_workers": _integer(1, MAX_LOOKUP_WORKERS),
        "kv_event_max_objects": _integer(1, None),
        "namespace": _namespace,
        # At least one smallest page; compared with page_bytes below.
        "capacity_bytes": _integer(MIN_PAGE_BYTES, None),
        "page_bytes": _page_bytes,
        "high_watermark": _number("in (0, 1]", lambda x: 0.0 < x <= 1.0),
        "low_watermark": _number("in (0, 1)", lambda x: 0.0 < x < 1.0),
        "lookup_timeout_s": _number("> 0", lambda x: x > 0.0),
    }
)
assert tuple(_CHECKS) == OPTION_NAMES == tuple(OPTION_DOCS)
_FLOAT_OPTIONS: Final = frozenset(
    option.name for option in fields(ConnectorConfig) if option.type == "float"
)


def _unknown_option(key: object) -> ConfigError:
    name = key if isinstance(key, str) else _show(key)
    close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
    if close:
        return ConfigError(name, f"unknown option {_show(name)} (did you mean {close[0]!r}?)")
    return ConfigError(
        name, f"unknown option {_show(name)}; valid options: {', '.join(OPTION_NAMES)}"
    )


def _cross_field_errors(values: Mapping[str, object]) -> tuple[ConfigError, ...]:
    """Rules between options, checked only among individually valid values."""
    errors: list[ConfigError] = []
    capacity = values.get("capacity_bytes")
    page = values.get("page_bytes")
    if isinstance(capacity, int) and isinstance(page, int) and capacity < page:
        errors.append(
            ConfigError(
                "capacity_bytes",
                f"capacity_bytes {capacity} must be at least page_bytes {page}",
            )
        )
    low = values.get("low_watermark")
    high = values.get("high_watermark")
    if isinstance(low, float) and isinstance(high, float) and not low < high:
        errors.append(
            ConfigError(
                "low_watermark",
                f"low_watermark {low} must be below high_watermark {high}",
            )
        )
    return tuple(errors)


def parse_connector_config(
    extra: Mapping[str, object],
) -> Result[ConnectorConfig, tuple[ConfigError, ...]]:
    """Validate ``kv_connector_extra_config``; every bad entry is reported, in input order."""
    errors: list[ConfigError] = []
    # Any: each value has just passed the check for its option's type.
    given: dict[str, Any] = {}
    for key, value in extra.items():
        check = _CHECKS.get(key) if isinstance(key, str) else None
        if check is None:
            errors.append(_unknown_option(key))
            continue
        message = check(value)
        if message is not None:
            errors.append(ConfigError(key, message))
            continue
        given[key] = float(cast(float, value)) if key in _FLOAT_OPTIONS else value
    # Cross rules see defaults for absent options, and skip options already wrong.
    bad = {error.key for error in errors}
    merged = {
        name: given.get(name, getattr(DEFAULT_CONFIG, name))
        for name in OPTION_NAMES
        if name not in bad
    }
    errors.extend(_cross_field_errors(merged))
    if errors:
        return Failure(tuple(errors))
    return Success(replace(DEFAULT_CONFIG, **given))


def format_config_errors(errors: Sequence[ConfigError]) -> str:
    """One message naming every bad key, with the option's documentation as a hint."""
    count = len(errors)
    noun = "problem" if count == 1 else "problems"
    lines = [f"invalid UMBP kv_connector_extra_config ({count} {noun}):"]
    for error in errors:
        lines.append(f"  - {error.key}: {error.message}")
        doc = OPTION_DOCS.get(error.key)
        if doc is not None:
            lines.append(f"      ({error.key}: {doc})")
    return "\n".join(lines)


def effective_load_async(
    requested: bool, num_groups: int, has_mamba: bool, has_sparse_indexer: bool
) -> tuple[bool, str | None]:
    """Whether loads are asynchronous, and the warning when the user's ``False`` is overridden.

    vLLM accepts only request-level load failures when a model has several KV cache
    groups, and acts on them only while the request waits for an asynchronous load.
    Mamba-style and sparse-attention indexer layers read restored state before any
    ``wait_for_layer_load``. Either way a synchronous, layer-by-layer load is unsafe.
    """
    if requested:
        return True, None
    reasons = tuple(
        reason
        for reason, applies in (
            (f"{num_groups} KV cache groups", num_groups > 1),
            ("Mamba-style layers", has_mamba),
            ("sparse-attention indexer layers", has_sparse_indexer),
        )
        if applies
    )
    if not reasons:
        return False, None
    return True, (
        "UMBP loads asynchronously for models with several KV cache groups, "
        "Mamba-style or sparse-attention indexer layers; load_async=false is ignored "
        f"(this model has {' and '.join(reasons)})"
    )
