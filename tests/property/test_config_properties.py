"""Properties of kv_connector_extra_config validation (umbp.core.config).

The option table below is written from the configuration reference, not read
from the implementation, so the two check each other.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st
from returns.result import Failure, Success

from umbp.core.config import (
    DEFAULT_CONFIG,
    OPTION_NAMES,
    ConnectorConfig,
    format_config_errors,
    parse_connector_config,
)

DEFAULTS: dict[str, object] = {
    "mode": "embedded",
    "load_async": None,
    "enable_lookup": True,
    "lookup_async": False,
    "save_decode_cache": False,
    "store_inflight_bytes": 1 << 30,
    "staging_bytes": 128 << 20,
    "enable_partial_hash_hits": False,
    "lookup_workers": 2,
    "kv_event_max_objects": 65536,
    "namespace": None,
    "capacity_bytes": 1 << 30,
    "page_bytes": None,
    "high_watermark": 0.95,
    "low_watermark": 0.85,
    "lookup_timeout_s": 5.0,
    "announced_wait_s": 10.0,
    "endpoint": None,
    "auto_start": False,
    "pool_dir": None,
    "ssd_dir": None,
    "ssd_capacity_bytes": 0,
    "io_timeout_s": 5.0,
    "reconnect_interval_s": 1.0,
    "mooncake_master": None,
    "mooncake_protocol": "tcp",
    "mooncake_device": "",
    "mooncake_local_hostname": None,
    "mooncake_metadata_server": "P2PHANDSHAKE",
    "mooncake_buffer_bytes": 256 << 20,
    "mori_deployment": "embedded",
    "mori_address": None,
}
# Options that belong to one back-end (the reference's "applies to" column); the
# properties below draw valid configs in the default, embedded mode.
OTHER_MODE_OPTIONS = (
    "endpoint", "auto_start", "pool_dir", "ssd_dir", "ssd_capacity_bytes", "io_timeout_s",
    "reconnect_interval_s", "mooncake_master", "mooncake_protocol", "mooncake_device",
    "mooncake_local_hostname", "mooncake_metadata_server", "mooncake_buffer_bytes",
    "mori_deployment", "mori_address",
)
BOOLEAN_OPTIONS = (
    "enable_lookup",
    "lookup_async",
    "save_decode_cache",
    "enable_partial_hash_hits",
    "auto_start",
)
INTEGER_OPTIONS = ("lookup_workers", "kv_event_max_objects", "capacity_bytes", "page_bytes",
                   "ssd_capacity_bytes", "mooncake_buffer_bytes", "store_inflight_bytes",
                   "staging_bytes")
FLOAT_OPTIONS = ("high_watermark", "low_watermark", "lookup_timeout_s", "io_timeout_s",
                 "reconnect_interval_s", "announced_wait_s")
STRING_OPTIONS = ("endpoint", "pool_dir", "ssd_dir", "mooncake_master", "mooncake_protocol",
                  "mooncake_device", "mooncake_local_hostname", "mooncake_metadata_server",
                  "mori_deployment", "mori_address")
NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,128}")
PAGE_SIZES = tuple(1 << shift for shift in range(12, 27))

anything = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.lists(st.integers(), max_size=2)
)


def _number(low: float, high: float, *, low_open: bool, high_open: bool) -> st.SearchStrategy[Any]:
    floats = st.floats(low, high, exclude_min=low_open, exclude_max=high_open)
    ints = [
        n
        for n in range(math.ceil(low), math.floor(high) + 1)
        if (n > low if low_open else n >= low) and (n < high if high_open else n <= high)
    ]
    return floats | st.sampled_from(ints) if ints else floats


VALID: dict[str, st.SearchStrategy[Any]] = {
    "mode": st.just("embedded"),
    **{name: st.booleans() for name in BOOLEAN_OPTIONS if name not in OTHER_MODE_OPTIONS},
    "load_async": st.none() | st.booleans(),
    "lookup_workers": st.integers(1, 64),
    "kv_event_max_objects": st.integers(1, 1 << 40),
    "namespace": st.none() | st.from_regex(NAMESPACE, fullmatch=True),
    "capacity_bytes": st.integers(4 << 10, 1 << 44),
    "page_bytes": st.none() | st.sampled_from(PAGE_SIZES),
    "high_watermark": _number(0, 1, low_open=True, high_open=False),
    "low_watermark": _number(0, 1, low_open=True, high_open=True),
    "lookup_timeout_s": st.floats(min_value=0, exclude_min=True, allow_infinity=False)
    | st.integers(1, 10**9),
    "announced_wait_s": st.floats(min_value=0, exclude_min=True, allow_infinity=False)
    | st.integers(1, 10**9),
    "store_inflight_bytes": st.integers(1 << 20, 1 << 44),
    "staging_bytes": st.integers(1 << 20, 1 << 44),
}

WRONG_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "mode": st.none() | st.booleans() | st.integers() | st.floats(),
    **{
        name: st.none()
        | st.integers()
        | st.floats()
        | st.text(max_size=8)
        | st.sampled_from(["true", "false", "1", "0", "yes"])
        for name in BOOLEAN_OPTIONS
    },
    "load_async": st.integers() | st.floats() | st.sampled_from(["true", "null", "auto", "0"]),
    **{
        name: st.booleans() | st.floats() | st.text(max_size=8) | st.none()
        for name in INTEGER_OPTIONS
    },
    **{
        name: st.booleans() | st.text(max_size=8) | st.none() | st.lists(st.floats(), max_size=2)
        for name in FLOAT_OPTIONS
    },
    "namespace": st.booleans() | st.integers() | st.floats() | st.lists(st.text(), max_size=2),
    **{
        name: st.booleans() | st.integers() | st.floats() | st.lists(st.text(), max_size=2)
        for name in STRING_OPTIONS
    },
}

OUT_OF_RANGE: dict[str, st.SearchStrategy[Any]] = {
    "lookup_workers": st.integers(max_value=0) | st.integers(min_value=65),
    "kv_event_max_objects": st.integers(max_value=0),
    "namespace": st.text(max_size=140)
    | st.from_regex(r"[a-z]{1,8}[:/ ][a-z]{1,8}", fullmatch=True),
    # Below the smallest page: wrong whatever page_bytes is.
    "capacity_bytes": st.integers(max_value=(4 << 10) - 1),
    "page_bytes": st.sampled_from([0, -4096, 1 << 11, 1 << 27, 1 << 30, 3 << 12, (1 << 12) + 1])
    | st.integers(-(1 << 31), 1 << 31),
    "high_watermark": st.floats() | st.integers(),
    "low_watermark": st.floats() | st.integers(),
    "lookup_timeout_s": st.floats(max_value=0)
    | st.sampled_from([math.nan, math.inf])
    | st.integers(max_value=0),
    "announced_wait_s": st.floats(max_value=0)
    | st.sampled_from([math.nan, math.inf])
    | st.integers(max_value=0),
    "store_inflight_bytes": st.integers(max_value=(1 << 20) - 1),
    "staging_bytes": st.integers(max_value=(1 << 20) - 1),
    "mode": st.sampled_from(["Embedded", "local", "redis", ""]) | st.text(max_size=12),
}


def _valid_alone(name: str, value: object) -> bool:
    """The option's own rule, as the configuration reference states it."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "mode":
        return value in ("embedded", "server", "mooncake", "mori")
    if name in STRING_OPTIONS:
        return isinstance(value, str)
    if name == "namespace":
        return value is None or (isinstance(value, str) and NAMESPACE.fullmatch(value) is not None)
    if name == "page_bytes":
        return value is None or (type(value) is int and value in PAGE_SIZES)
    if name == "lookup_workers":
        return type(value) is int and 1 <= value <= 64
    if name == "kv_event_max_objects":
        return type(value) is int and value >= 1
    if name == "capacity_bytes":
        return type(value) is int and value >= 4 << 10
    if name == "high_watermark":
        return number and math.isfinite(value) and 0 < value <= 1  # type: ignore[operator,arg-type]
    if name == "low_watermark":
        return number and math.isfinite(value) and 0 < value < 1  # type: ignore[operator,arg-type]
    if name in ("lookup_timeout_s", "announced_wait_s"):
        return number and math.isfinite(value) and value > 0  # type: ignore[operator,arg-type]
    if name in ("store_inflight_bytes", "staging_bytes"):
        return type(value) is int and value >= 1 << 20
    return isinstance(value, bool)


def _consistent(config: dict[str, object]) -> bool:
    """The rules between options, with defaults for absent ones."""
    merged = DEFAULTS | config
    return (
        (merged["page_bytes"] is None or merged["capacity_bytes"] >= merged["page_bytes"])  # type: ignore[operator]
        and merged["low_watermark"] < merged["high_watermark"]  # type: ignore[operator]
    )


valid_configs = st.fixed_dictionaries({}, optional=VALID).filter(_consistent)
EMBEDDED_OPTIONS = tuple(sorted(set(DEFAULTS) - set(OTHER_MODE_OPTIONS)))
unknown_names = st.text(min_size=1, max_size=30).filter(lambda name: name not in DEFAULTS)


def test_the_option_table_matches_the_config_fields() -> None:
    assert set(OPTION_NAMES) == set(DEFAULTS) == set(VALID) | set(OTHER_MODE_OPTIONS)
    assert {name: getattr(DEFAULT_CONFIG, name) for name in OPTION_NAMES} == DEFAULTS


@given(valid_configs)
def test_every_valid_config_is_accepted_with_its_values_and_defaults_elsewhere(
    extra: dict[str, object],
) -> None:
    result = parse_connector_config(extra)
    assert isinstance(result, Success), result
    config = result.unwrap()
    for name in OPTION_NAMES:
        value = getattr(config, name)
        assert value == extra.get(name, DEFAULTS[name])
        if name in FLOAT_OPTIONS:
            assert type(value) is float
        elif value is not None:
            assert type(value) is type(DEFAULTS[name]) or name in ("namespace", "page_bytes", "load_async")


@st.composite
def configs_with_bad_entries(draw: st.DrawFn) -> tuple[dict[str, object], set[str]]:
    extra = dict(draw(valid_configs))
    corrupted = draw(st.sets(st.sampled_from(EMBEDDED_OPTIONS)))
    for name in sorted(corrupted):
        kinds = [WRONG_TYPE[name]] + ([OUT_OF_RANGE[name]] if name in OUT_OF_RANGE else [])
        value = draw(st.one_of(kinds).filter(lambda v, name=name: not _valid_alone(name, v)))
        extra[name] = value
    unknown = draw(st.lists(unknown_names, max_size=3, unique=True))
    for name in unknown:
        extra[name] = draw(anything)
    assume(corrupted or unknown)
    return extra, corrupted | set(unknown)


@given(configs_with_bad_entries())
def test_the_error_list_names_exactly_the_bad_keys_once_each(
    case: tuple[dict[str, object], set[str]],
) -> None:
    extra, bad = case
    result = parse_connector_config(extra)
    assert isinstance(result, Failure), (extra, bad)
    errors = result.failure()
    assert sorted(error.key for error in errors) == sorted(bad)
    message = format_config_errors(errors)
    assert all(f"- {key}:" in message for key in bad)


@given(st.sampled_from(sorted(DEFAULTS)), st.data())
def test_each_option_alone_with_a_wrong_type_or_out_of_range_value_is_named(
    name: str, data: st.DataObject
) -> None:
    kinds = [WRONG_TYPE[name]] + ([OUT_OF_RANGE[name]] if name in OUT_OF_RANGE else [])
    value = data.draw(st.one_of(kinds).filter(lambda v: not _valid_alone(name, v)))
    result = parse_connector_config({name: value})
    assert isinstance(result, Failure), (name, value)
    assert [error.key for error in result.failure()] == [name]


@given(st.data())
def test_a_bad_page_size_or_high_watermark_is_not_also_blamed_on_its_partner(
    data: st.DataObject,
) -> None:
    first, second = data.draw(
        st.sampled_from([("page_bytes", "capacity_bytes"), ("high_watermark", "low_watermark")])
    )
    bad = data.draw(
        st.one_of(WRONG_TYPE[first], OUT_OF_RANGE[first]).filter(
            lambda v: not _valid_alone(first, v)
        )
    )
    partner = data.draw(VALID[second])
    result = parse_connector_config({first: bad, second: partner})
    assert [error.key for error in result.failure()] == [first]


@given(st.sampled_from(OPTION_NAMES), st.data())
def test_an_unknown_key_one_typo_from_an_option_gets_a_did_you_mean_suggestion(
    name: str, data: st.DataObject
) -> None:
    position = data.draw(st.integers(0, len(name) - 1))
    letter = data.draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"))
    typo = data.draw(
        st.sampled_from(
            [
                name[:position] + name[position + 1 :],  # deletion
                name[:position] + letter + name[position + 1 :],  # substitution
                name[:position] + letter + name[position:],  # insertion
                name[:position]
                + name[position + 1 : position + 2]
                + name[position : position + 1]
                + name[position + 2 :],  # transposition
            ]
        )
    )
    assume(typo not in DEFAULTS)
    result = parse_connector_config({typo: True})
    assert isinstance(result, Failure)
    (error,) = result.failure()
    assert error.key == typo
    suggested = re.search(r"did you mean '([^']+)'\?", error.message)
    assert suggested is not None, error.message
    assert suggested.group(1) in DEFAULTS
    assert suggested.group(1) == difflib.get_close_matches(typo, OPTION_NAMES, n=1)[0]


@given(unknown_names)
def test_an_unknown_key_far_from_every_option_lists_the_valid_options(name: str) -> None:
    assume(not difflib.get_close_matches(name, OPTION_NAMES, n=1))
    (error,) = parse_connector_config({name: 1}).failure()
    assert "did you mean" not in error.message
    assert all(option in error.message for option in OPTION_NAMES)


@given(valid_configs)
def test_a_valid_config_parses_the_same_twice(extra: dict[str, object]) -> None:
    assert parse_connector_config(extra) == parse_connector_config(dict(extra))
    assert isinstance(parse_connector_config(extra).unwrap(), ConnectorConfig)


@given(st.sampled_from(OTHER_MODE_OPTIONS), st.data())
def test_an_option_of_another_mode_is_named_and_never_ignored(
    name: str, data: st.DataObject
) -> None:
    modes = {"embedded": {}, "server": {"endpoint": "/run/umbp.sock"},
             "mooncake": {"mooncake_master": "10.0.0.1:50051"}, "mori": {}}
    owner = name.split("_")[0] if name.startswith(("mooncake_", "mori_")) else "server"
    mode = data.draw(st.sampled_from(sorted(set(modes) - {owner})))
    value = DEFAULTS[name] if DEFAULTS[name] is not None else "x:1"
    result = parse_connector_config({"mode": mode, **modes[mode], name: value})
    assert isinstance(result, Failure)
    assert [(e.key, f"applies to mode {owner!r} only" in e.message)
            for e in result.failure()] == [(name, True)]
