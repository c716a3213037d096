"""``kv_connector_extra_config`` -> a validated, frozen :class:`ConnectorConfig`.

Validation collects every problem at once: a user who mistyped two options and gave
a third the wrong type learns all three from one engine start. Types are strict
because the values come from JSON or a Python dict written by hand: ``"true"`` is
not a boolean, ``True`` is not an integer and ``2.0`` is not an integer count.
Integers are accepted where a float is expected. The generic value checks are in
:mod:`umbp.core.value_checks`; the options, their checks and the rules between
options are here.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Final, cast

from returns.result import Failure, Result, Success

from umbp.core.identity import check_namespace_override
from umbp.core.value_checks import (
    ValueCheck,
    check_boolean,
    check_boolean_or_null,
    check_choice,
    check_integer,
    check_number,
    check_text,
    describe_value,
    is_host_port,
    is_int,
    show_value,
)

__all__ = [
    "DEFAULT_CONFIG",
    "MAX_PAGE_BYTES",
    "MIN_PAGE_BYTES",
    "MODES",
    "MODE_OPTIONS",
    "OPTION_DOCS",
    "OPTION_NAMES",
    "ConfigError",
    "ConnectorConfig",
    "borrows_on_model_thread",
    "copies_in_place",
    "effective_load_async",
    "format_config_errors",
    "parse_connector_config",
    "restores_layer_by_layer",
]

MODES: Final = ("embedded", "server", "mooncake", "mori")
MOONCAKE_PROTOCOLS: Final = ("tcp", "rdma")
MORI_DEPLOYMENTS: Final = ("embedded", "standalone", "distributed")
MIN_PAGE_BYTES: Final = 4 << 10
MAX_PAGE_BYTES: Final = 64 << 20
MAX_LOOKUP_WORKERS: Final = 64


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's options, validated. Field defaults are the documented defaults."""

    mode: str = "embedded"
    load_async: bool | None = None
    enable_lookup: bool = True
    lookup_async: bool = False
    save_decode_cache: bool = False
    store_inflight_bytes: int = 1 << 30
    staging_bytes: int = 128 << 20
    enable_partial_hash_hits: bool = False
    lookup_workers: int = 2
    kv_event_max_objects: int = 65536
    namespace: str | None = None
    capacity_bytes: int = 1 << 30
    page_bytes: int | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    lookup_timeout_s: float = 5.0
    announced_wait_s: float = 10.0
    endpoint: str | None = None
    auto_start: bool = False
    pool_dir: str | None = None
    ssd_dir: str | None = None
    ssd_capacity_bytes: int = 0
    io_timeout_s: float = 5.0
    reconnect_interval_s: float = 1.0
    mooncake_master: str | None = None
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_local_hostname: str | None = None
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    mooncake_buffer_bytes: int = 256 << 20
    mori_deployment: str = "embedded"
    mori_address: str | None = None


DEFAULT_CONFIG: Final = ConnectorConfig()
OPTION_NAMES: Final = tuple(option.name for option in fields(ConnectorConfig))

OPTION_DOCS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "mode": "where the pool lives: 'embedded' (in each worker process), 'server' (a "
        "node-local `umbp serve` shared by engines, DRAM then SSD), 'mooncake' (Mooncake "
        "Store across nodes), 'mori' (AMD MORI UMBP)",
        "load_async": "true: restore KV from the pool while the request waits, off the model "
        "step; false: in the step that computes the rest of the prompt, layer by layer; "
        "null (default): false where every object copies straight from the embedded "
        "pool's pages into KV in host memory, true elsewhere, GPUs included (forced true "
        "for several KV cache groups, Mamba-style or sparse-indexer layers)",
        "enable_lookup": "look up prompt prefixes in the pool and restore the hits",
        "lookup_async": "run pool lookups in background threads; the request waits a step",
        "save_decode_cache": "also store blocks produced while decoding, not only the prompt's",
        "store_inflight_bytes": "bytes of stores a worker may have submitted and not finished "
        "(their blocks stay pinned in vLLM meanwhile); stores that would pass it wait in the "
        "worker's queue for a later step, the step itself never waits (>= 1 MiB)",
        "staging_bytes": "host memory each worker allocates at start (page-locked on a GPU "
        "host) for objects on their way to or from a store that does not lend its own "
        "memory (server, mooncake, mori; embedded objects larger than a page); larger "
        "transfers go in pieces (>= 1 MiB and one stored object)",
        "enable_partial_hash_hits": "match at the hash block size when it is finer than "
        "the KV block size",
        "lookup_workers": f"threads for asynchronous lookups and residency checks (1-{MAX_LOOKUP_WORKERS})",
        "kv_event_max_objects": "most stored objects tracked for BlockStored/BlockRemoved "
        "KV events (>= 1)",
        "namespace": "explicit key namespace (1-128 of letters, digits, '.', '_', '-'); "
        "default: a fingerprint of model, dtype, cache layout and parallel layout",
        "capacity_bytes": "bytes of host memory the pool may use (>= page_bytes): per worker "
        "(embedded), of the auto-started server (server), the segment each worker "
        "contributes (mooncake), the DRAM tier (mori)",
        "page_bytes": "pool page size in bytes, a power of two from 4 KiB to 64 MiB; "
        "null (default): one page per stored object of the smallest cache group",
        "high_watermark": "fill fraction at which the pool starts evicting (0 < low < high <= 1)",
        "low_watermark": "fill fraction eviction brings the pool back down to (0 < low < high)",
        "lookup_timeout_s": "seconds the scheduler waits for a lookup answer from a pool in "
        "another process before counting it a miss (> 0)",
        "announced_wait_s": "longest a request waits for blocks its prefill engine "
        "announced (disaggregated prefill, kv_transfer_params) to reach the pool before "
        "the rest is computed (> 0)",
        "endpoint": "server: path of the `umbp serve` Unix socket (required)",
        "auto_start": "server: start `umbp serve` at endpoint when none is there (it "
        "outlives the engine, so others and later engines share it)",
        "pool_dir": "server with auto_start: tmpfs directory of the DRAM tier's shared "
        "file (default /dev/shm; one mounted with huge=within_size gives it huge pages)",
        "ssd_dir": "server with auto_start: directory of the SSD tier's slot file",
        "ssd_capacity_bytes": "server with auto_start: bytes of the SSD tier (>= 0; "
        "0 = no SSD tier; needs ssd_dir)",
        "io_timeout_s": "server: seconds a worker waits for the server before a load "
        "fails (and is recomputed) or a store is dropped (> 0)",
        "reconnect_interval_s": "server: least seconds between attempts to reach a server "
        "that went away (> 0)",
        "mooncake_master": "mooncake: the master's 'host:port' (required)",
        "mooncake_protocol": "mooncake: transport, 'tcp' or 'rdma'",
        "mooncake_device": "mooncake: RDMA device names, comma-separated ('' for tcp)",
        "mooncake_local_hostname": "mooncake: the address other nodes reach this node at; "
        "default: this host's name",
        "mooncake_metadata_server": "mooncake: transfer-engine metadata service "
        "('P2PHANDSHAKE' needs none)",
        "mooncake_buffer_bytes": "mooncake: each worker's registered transfer buffer "
        "(>= 1 MiB)",
        "mori_deployment": "mori: 'embedded', 'standalone' (a umbp_standalone_server on this "
        "node) or 'distributed' (a umbp_master cluster)",
        "mori_address": "mori: the standalone server's 'unix://' socket or the "
        "distributed master's address (required unless embedded)",
    }
)


@dataclass(frozen=True, slots=True)
class ConfigError:
    """One bad entry of ``kv_connector_extra_config``."""

    key: str
    message: str


# ---------------------------------------------------------------------------
# Option checks (umbp.core.value_checks): each returns an error message, or None.


def _namespace(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        return f"expected a string or null, got {describe_value(value)}"
    return check_namespace_override(value).swap().value_or(None)


def _page_bytes(value: object) -> str | None:
    rule = "a power of two between 4096 (4 KiB) and 67108864 (64 MiB)"
    if value is None:
        return None
    if not is_int(value):
        return f"expected an integer, {rule}, got {describe_value(value)}"
    assert isinstance(value, int)
    if not MIN_PAGE_BYTES <= value <= MAX_PAGE_BYTES or value & (value - 1):
        return f"must be {rule}, got {show_value(value)}"
    return None


_CHECKS: Final[Mapping[str, ValueCheck]] = MappingProxyType(
    {
        "mode": check_choice(MODES),
        "load_async": check_boolean_or_null,
        "enable_lookup": check_boolean,
        "lookup_async": check_boolean,
        "save_decode_cache": check_boolean,
        "store_inflight_bytes": check_integer(1 << 20, None),
        "staging_bytes": check_integer(1 << 20, None),
        "enable_partial_hash_hits": check_boolean,
        "lookup_workers": check_integer(1, MAX_LOOKUP_WORKERS),
        "kv_event_max_objects": check_integer(1, None),
        "namespace": _namespace,
        # At least one smallest page; compared with page_bytes below.
        "capacity_bytes": check_integer(MIN_PAGE_BYTES, None),
        "page_bytes": _page_bytes,
        "high_watermark": check_number("in (0, 1]", lambda x: 0.0 < x <= 1.0),
        "low_watermark": check_number("in (0, 1)", lambda x: 0.0 < x < 1.0),
        "lookup_timeout_s": check_number("> 0", lambda x: x > 0.0),
        "announced_wait_s": check_number("> 0", lambda x: x > 0.0),
        "endpoint": check_text("a non-empty socket path", bool, nullable=True),
        "auto_start": check_boolean,
        "pool_dir": check_text("a non-empty directory path", bool, nullable=True),
        "ssd_dir": check_text("a non-empty directory path", bool, nullable=True),
        "ssd_capacity_bytes": check_integer(0, None),
        "io_timeout_s": check_number("> 0", lambda x: x > 0.0),
        "reconnect_interval_s": check_number("> 0", lambda x: x > 0.0),
        "mooncake_master": check_text("'host:port'", is_host_port, nullable=True),
        "mooncake_protocol": check_choice(MOONCAKE_PROTOCOLS),
        "mooncake_device": check_text("a string", lambda _: True, nullable=False),
        "mooncake_local_hostname": check_text("a non-empty host name or address", bool,
                                         nullable=True),
        "mooncake_metadata_server": check_text("a non-empty string", bool, nullable=False),
        "mooncake_buffer_bytes": check_integer(1 << 20, None),
        "mori_deployment": check_choice(MORI_DEPLOYMENTS),
        "mori_address": check_text("a non-empty address", bool, nullable=True),
    }
)
# Options that mean something only for some modes; given with another mode they are an
# error, never silently ignored.
MODE_OPTIONS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "page_bytes": ("embedded", "server"),
        "high_watermark": ("embedded", "server"),
        "low_watermark": ("embedded", "server"),
        "endpoint": ("server",),
        "auto_start": ("server",),
        "pool_dir": ("server",),
        "ssd_dir": ("server",),
        "ssd_capacity_bytes": ("server",),
        "io_timeout_s": ("server",),
        "reconnect_interval_s": ("server",),
        **{name: ("mooncake",) for name in OPTION_NAMES if name.startswith("mooncake_")},
        **{name: ("mori",) for name in OPTION_NAMES if name.startswith("mori_")},
    }
)
assert tuple(_CHECKS) == OPTION_NAMES == tuple(OPTION_DOCS)
_FLOAT_OPTIONS: Final = frozenset(
    option.name for option in fields(ConnectorConfig) if option.type == "float"
)


def _unknown_option(key: object) -> ConfigError:
    name = key if isinstance(key, str) else show_value(key)
    close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
    if close:
        return ConfigError(name, f"unknown option {show_value(name)} (did you mean {close[0]!r}?)")
    return ConfigError(
        name, f"unknown option {show_value(name)}; valid options: {', '.join(OPTION_NAMES)}"
    )


def _mode_errors(
    given: Mapping[str, object], mode: object, present: Collection[object]
) -> list[ConfigError]:
    """Options of another mode, and the options a mode cannot do without (``given``: the
    valid entries; ``present``: every key the user wrote, valid or not)."""
    if not isinstance(mode, str):
        return []
    errors = [
        ConfigError(name, f"{name} applies to mode {' or '.join(map(repr, modes))} only, "
                    f"not to mode {mode!r}; remove it")
        for name, modes in MODE_OPTIONS.items()
        if name in given and mode not in modes
    ]
    required = {"server": "endpoint", "mooncake": "mooncake_master"}.get(mode)
    if required is not None and required not in present:
        errors.append(ConfigError(required, f"mode {mode!r} needs {required}"))
    if mode == "mori" and given.get("mori_deployment", "embedded") != "embedded" \
            and "mori_address" not in present:
        errors.append(ConfigError("mori_address", "mori_deployment "
                                  f"{given.get('mori_deployment')!r} needs mori_address"))
    if mode == "server" and given.get("ssd_capacity_bytes", 0) and "ssd_dir" not in present:
        errors.append(ConfigError("ssd_dir", "ssd_capacity_bytes > 0 needs ssd_dir"))
    if mode == "server" and not given.get("auto_start", False):
        errors.extend(
            ConfigError(name, f"{name} configures an auto-started server; set auto_start: "
                        "true, or give it to `umbp serve` instead")
            for name in ("pool_dir", "ssd_dir", "ssd_capacity_bytes", "capacity_bytes",
                         "page_bytes",
                         "high_watermark", "low_watermark")
            if name in given
        )
    return errors


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
    mode_given_but_bad = "mode" in extra and "mode" not in given
    if not mode_given_but_bad:
        errors.extend(_mode_errors(given, given.get("mode", DEFAULT_CONFIG.mode), extra.keys()))
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


def copies_in_place(mode: str) -> bool:
    """Whether objects move straight between the KV cache and the store's own memory, one
    copy per byte: the embedded pool (this process's slab) and the node-local server
    (its shared memory, mapped in every engine) lend their pages to loads and reserve
    pages for stores. Mooncake and MORI move bytes themselves: their objects go
    through the staging area."""
    return mode in ("embedded", "server")


def borrows_on_model_thread(mode: str) -> bool:
    """Whether a store lends and reserves without I/O (an in-process index operation), so
    vLLM's model thread may borrow its pages itself; the server answers over its socket,
    so its pages are borrowed on umbp's I/O lanes."""
    return mode == "embedded"


def restores_layer_by_layer(in_place: bool, kv_in_host_memory: bool) -> bool:
    """Whether loads run layer by layer in the step when ``load_async`` is unset.

    Where objects copy in place (:func:`copies_in_place`) and the KV cache is in host
    memory, a layer of an object is ready after one layer's copy: running requests
    wait for the first layer only, and the restored request gets its first token steps
    sooner than an asynchronous load allows. Where objects are staged first, a
    layer-by-layer restore holds the forward pass for the whole read. On a GPU the
    default stays asynchronous even in place: vLLM runs a connector that waits layer by
    layer with piecewise CUDA graphs only, so every decode step would lose its full
    graph."""
    return in_place and kv_in_host_memory


def effective_load_async(
    requested: bool | None, layer_by_layer: bool,
    num_groups: int, has_mamba: bool, has_sparse_indexer: bool,
) -> tuple[bool, str | None]:
    """Whether loads are asynchronous, and the warning when the user's ``False`` is overridden.

    Unset (None), loads are synchronous exactly where :func:`restores_layer_by_layer`
    says (``layer_by_layer``): restored layer by layer in the step, the request gets
    its first token steps sooner, and running requests wait only for the first
    layer's copy. vLLM accepts only request-level load failures when a
    model has several KV cache groups, and acts on them only while the request waits
    for an asynchronous load. Mamba-style and sparse-attention indexer layers read
    restored state before any ``wait_for_layer_load``. Either way a synchronous,
    layer-by-layer load is unsafe.
    """
    if requested is True:
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
    if requested is None:
        return bool(reasons) or not layer_by_layer, None
    if not reasons:
        return False, None
    return True, (
        "UMBP loads asynchronously for models with several KV cache groups, "
        "Mamba-style or sparse-attention indexer layers; load_async=false is ignored "
        f"(this model has {' and '.join(reasons)})"
    )
