"""Examples of kv_connector_extra_config validation: the exact sentences users see."""

from __future__ import annotations

import math

import pytest
from returns.result import Failure, Success

from umbp.core.config import (
    DEFAULT_CONFIG,
    OPTION_DOCS,
    OPTION_NAMES,
    ConfigError,
    ConnectorConfig,
    borrows_on_model_thread,
    copies_in_place,
    effective_load_async,
    format_config_errors,
    parse_connector_config,
    restores_layer_by_layer,
)


def errors_of(extra: dict[str, object]) -> dict[str, str]:
    result = parse_connector_config(extra)
    assert isinstance(result, Failure), result
    return {error.key: error.message for error in result.failure()}


def test_an_empty_config_gives_the_documented_defaults() -> None:
    assert parse_connector_config({}) == Success(DEFAULT_CONFIG)
    assert DEFAULT_CONFIG == ConnectorConfig(
        mode="embedded",
        load_async=None,
        enable_lookup=True,
        lookup_async=False,
        save_decode_cache=False,
        enable_partial_hash_hits=False,
        lookup_workers=2,
        kv_event_max_objects=65536,
        namespace=None,
        capacity_bytes=1 << 30,
        page_bytes=None,
        high_watermark=0.95,
        low_watermark=0.85,
        lookup_timeout_s=5.0,
        endpoint=None,
        auto_start=False,
        pool_dir=None,
        ssd_dir=None,
        ssd_capacity_bytes=0,
        io_timeout_s=5.0,
        reconnect_interval_s=1.0,
        mooncake_master=None,
        mooncake_protocol="tcp",
        mooncake_device="",
        mooncake_local_hostname=None,
        mooncake_metadata_server="P2PHANDSHAKE",
        mooncake_buffer_bytes=256 << 20,
        mori_deployment="embedded",
        mori_address=None,
    )


def test_a_string_is_not_a_boolean() -> None:
    assert errors_of({"load_async": "true"}) == {
        "load_async": "expected a boolean (true/false) or null, got str 'true'"
    }
    assert errors_of({"enable_lookup": "true"}) == {
        "enable_lookup": "expected a boolean (true/false), got str 'true'"
    }


def test_an_unknown_option_names_the_nearest_valid_one() -> None:
    assert errors_of({"capacity_byte": 1 << 30}) == {
        "capacity_byte": "unknown option 'capacity_byte' (did you mean 'capacity_bytes'?)"
    }


def test_an_invalid_mode_lists_the_valid_values() -> None:
    assert errors_of({"mode": "local"}) == {
        "mode": "'local' is not valid; valid values: embedded, server, mooncake, mori"
    }


def test_each_mode_names_the_option_it_cannot_do_without() -> None:
    assert errors_of({"mode": "server"}) == {"endpoint": "mode 'server' needs endpoint"}
    assert errors_of({"mode": "mooncake"}) == {
        "mooncake_master": "mode 'mooncake' needs mooncake_master"
    }
    assert errors_of({"mode": "mori", "mori_deployment": "distributed"}) == {
        "mori_address": "mori_deployment 'distributed' needs mori_address"
    }


def test_an_option_of_another_mode_is_an_error_not_ignored() -> None:
    assert errors_of({"endpoint": "/run/umbp.sock"}) == {
        "endpoint": "endpoint applies to mode 'server' only, not to mode 'embedded'; remove it"
    }
    assert set(errors_of({"mode": "mooncake", "mooncake_master": "10.0.0.1:50051",
                          "page_bytes": 4096, "mori_address": "x"})) == {
        "page_bytes", "mori_address"}


def test_server_pool_options_need_auto_start() -> None:
    base = {"mode": "server", "endpoint": "/run/umbp.sock"}
    assert set(errors_of({**base, "ssd_dir": "/ssd", "capacity_bytes": 1 << 30,
                          "pool_dir": "/mnt/umbp-pool"})) == {
        "ssd_dir", "capacity_bytes", "pool_dir"}
    started = parse_connector_config({**base, "auto_start": True, "ssd_dir": "/ssd",
                                      "ssd_capacity_bytes": 1 << 30,
                                      "pool_dir": "/mnt/umbp-pool"}).unwrap()
    assert (started.auto_start, started.ssd_dir, started.ssd_capacity_bytes,
            started.pool_dir) == (True, "/ssd", 1 << 30, "/mnt/umbp-pool")
    assert set(errors_of({"mode": "embedded", "pool_dir": "/mnt/umbp-pool"})) == {"pool_dir"}
    assert set(errors_of({**base, "auto_start": True, "pool_dir": ""})) == {"pool_dir"}
    assert errors_of({**base, "auto_start": True, "ssd_capacity_bytes": 1 << 30}) == {
        "ssd_dir": "ssd_capacity_bytes > 0 needs ssd_dir"}


@pytest.mark.parametrize("address", ["10.0.0.1", "host:", ":50051", "host:70000", "host:x"])
def test_the_mooncake_master_is_host_and_port(address: str) -> None:
    message = errors_of({"mode": "mooncake", "mooncake_master": address})["mooncake_master"]
    assert message.startswith("must be 'host:port'")


def test_a_bad_mode_does_not_blame_the_options_of_the_intended_mode() -> None:
    assert set(errors_of({"mode": "srever", "endpoint": "/run/umbp.sock"})) == {"mode"}


@pytest.mark.parametrize("value", [True, 2.0, "2", None])
def test_integers_are_strict_no_bools_floats_or_strings(value: object) -> None:
    assert set(errors_of({"lookup_workers": value})) == {"lookup_workers"}


@pytest.mark.parametrize("value", [0, 65, -1])
def test_lookup_workers_is_between_1_and_64(value: int) -> None:
    assert "between 1 and 64" in errors_of({"lookup_workers": value})["lookup_workers"]


def test_integers_are_accepted_as_floats_and_become_floats() -> None:
    config = parse_connector_config(
        {"high_watermark": 1, "low_watermark": 0.5, "lookup_timeout_s": 5}
    ).unwrap()
    assert (config.high_watermark, config.low_watermark, config.lookup_timeout_s) == (1.0, 0.5, 5.0)
    assert all(type(v) is float for v in (config.high_watermark, config.lookup_timeout_s))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, 0.0, -1.5])
def test_store_timeout_must_be_a_finite_positive_number(value: float) -> None:
    assert set(errors_of({"lookup_timeout_s": value})) == {"lookup_timeout_s"}


def test_watermarks_need_low_below_high() -> None:
    message = errors_of({"low_watermark": 0.9, "high_watermark": 0.8})["low_watermark"]
    assert "high_watermark" in message
    assert set(errors_of({"low_watermark": 0.96})) == {"low_watermark"}  # default high 0.95
    assert set(errors_of({"high_watermark": 1.01})) == {"high_watermark"}
    assert set(errors_of({"low_watermark": 0})) == {"low_watermark"}
    assert (
        parse_connector_config({"low_watermark": 0.5, "high_watermark": 1}).unwrap().high_watermark
        == 1.0
    )


@pytest.mark.parametrize("page", [4 << 10, 64 << 10, 64 << 20])
def test_page_bytes_accepts_powers_of_two_from_4_kib_to_64_mib(page: int) -> None:
    assert (
        parse_connector_config({"page_bytes": page, "capacity_bytes": 64 << 20}).unwrap().page_bytes
        == page
    )


@pytest.mark.parametrize("page", [2 << 10, 128 << 20, 3 << 12, 0, -4096])
def test_page_bytes_rejects_other_sizes(page: int) -> None:
    assert set(errors_of({"page_bytes": page})) == {"page_bytes"}


def test_capacity_must_hold_at_least_one_page() -> None:
    message = errors_of({"capacity_bytes": 1 << 20, "page_bytes": 2 << 20})["capacity_bytes"]
    assert "page_bytes" in message
    # Below the smallest page size whatever page_bytes is.
    assert set(errors_of({"capacity_bytes": 2 << 10})) == {"capacity_bytes"}
    # A bad page size is reported once, not blamed on the capacity too.
    assert set(errors_of({"capacity_bytes": 1 << 20, "page_bytes": 3})) == {"page_bytes"}


def test_namespace_follows_the_key_namespace_rule() -> None:
    assert parse_connector_config({"namespace": None}).unwrap().namespace is None
    assert parse_connector_config({"namespace": "team-a.v2_1"}).unwrap().namespace == "team-a.v2_1"
    assert set(errors_of({"namespace": "a:b"})) == {"namespace"}
    assert set(errors_of({"namespace": ""})) == {"namespace"}
    assert set(errors_of({"namespace": 7})) == {"namespace"}


def test_every_bad_entry_is_reported_at_once_in_input_order() -> None:
    result = parse_connector_config(
        {"capacity_byte": 1, "load_async": "true", "mode": "serve", "lookup_workers": 0}
    )
    assert [error.key for error in result.failure()] == [
        "capacity_byte",
        "load_async",
        "mode",
        "lookup_workers",
    ]


def test_format_config_errors_names_every_key_with_a_hint() -> None:
    errors = (
        ConfigError(
            "capacity_byte", "unknown option 'capacity_byte' (did you mean 'capacity_bytes'?)"
        ),
        ConfigError("load_async", "expected a boolean (true/false) or null, got str 'true'"),
    )
    message = format_config_errors(errors)
    assert "2 problems" in message
    assert "capacity_byte" in message and "did you mean 'capacity_bytes'" in message
    assert "load_async" in message and OPTION_DOCS["load_async"] in message
    assert "1 problem)" in format_config_errors(errors[:1])


def test_every_option_has_a_one_line_doc() -> None:
    assert tuple(OPTION_DOCS) == OPTION_NAMES
    assert all(doc and "\n" not in doc for doc in OPTION_DOCS.values())


def test_a_non_string_key_is_an_unknown_option_not_a_crash() -> None:
    result = parse_connector_config({3: True})  # type: ignore[dict-item]
    assert isinstance(result, Failure)
    assert result.failure()[0].key == "3"


@pytest.mark.parametrize("layer_by_layer", [True, False])
def test_load_async_is_kept_when_requested(layer_by_layer: bool) -> None:
    assert effective_load_async(True, layer_by_layer, 3, True, True) == (True, None)
    assert effective_load_async(True, layer_by_layer, 1, False, False) == (True, None)


@pytest.mark.parametrize("layer_by_layer", [True, False])
def test_load_async_false_is_honoured_for_one_plain_group(layer_by_layer: bool) -> None:
    assert effective_load_async(False, layer_by_layer, 1, False, False) == (False, None)


def test_unset_loads_run_layer_by_layer_where_the_worker_says_it_can() -> None:
    assert effective_load_async(None, True, 1, False, False) == (False, None)
    assert effective_load_async(None, False, 1, False, False) == (True, None)


@pytest.mark.parametrize(
    ("mode", "in_place", "on_model_thread"),
    [("embedded", True, True), ("server", True, False), ("mooncake", False, False),
     ("mori", False, False)],
)
def test_the_pool_and_the_server_copy_in_place_and_only_the_pool_without_io(
    mode: str, in_place: bool, on_model_thread: bool
) -> None:
    assert copies_in_place(mode) is in_place
    assert borrows_on_model_thread(mode) is on_model_thread


@pytest.mark.parametrize(
    ("in_place", "kv_in_host_memory", "layer_by_layer"),
    [(True, True, True), (True, False, False), (False, True, False), (False, False, False)],
)
def test_unset_loads_run_layer_by_layer_only_in_place_into_host_memory(
    in_place: bool, kv_in_host_memory: bool, layer_by_layer: bool
) -> None:
    """On a GPU, layer by layer would cost every decode step its full CUDA graph."""
    assert restores_layer_by_layer(in_place, kv_in_host_memory) is layer_by_layer


@pytest.mark.parametrize(
    ("num_groups", "has_mamba", "has_sparse_indexer"),
    [(2, False, False), (1, True, False), (1, False, True)],
)
def test_unset_loads_are_asynchronous_without_a_warning_where_layer_by_layer_is_unsafe(
    num_groups: int, has_mamba: bool, has_sparse_indexer: bool
) -> None:
    assert effective_load_async(None, True, num_groups, has_mamba, has_sparse_indexer) == (
        True, None
    )


@pytest.mark.parametrize(
    ("num_groups", "has_mamba", "has_sparse_indexer", "reason"),
    [
        (2, False, False, "2 KV cache groups"),
        (1, True, False, "Mamba-style layers"),
        (1, False, True, "sparse-attention indexer layers"),
    ],
)
def test_load_async_false_is_overridden_with_a_warning_that_says_why(
    num_groups: int, has_mamba: bool, has_sparse_indexer: bool, reason: str
) -> None:
    load_async, warning = effective_load_async(
        False, True, num_groups, has_mamba, has_sparse_indexer
    )
    assert load_async is True
    assert warning is not None and "load_async=false is ignored" in warning and reason in warning


@pytest.mark.parametrize(
    "name", ["load_async", "lookup_workers", "page_bytes", "lookup_timeout_s", "high_watermark"]
)
def test_a_huge_integer_is_reported_not_raised(name: str) -> None:
    huge = -(10**5000) if name in ("lookup_workers", "page_bytes") else 10**5000
    assert set(errors_of({name: huge})) == {name}
    assert name in format_config_errors(parse_connector_config({name: huge}).failure())


def test_synchronous_loads_ask_vllm_for_piecewise_cuda_graphs() -> None:
    """A full CUDA graph's replay skips wait_for_layer_load, where synchronous loads
    are waited for layer by layer: only load_async false asks for piecewise graphs
    (a bad config asks nothing here; the connector's constructor names its errors)."""
    from umbp.shell.connector import UMBPStoreConnector

    assert UMBPStoreConnector.requires_piecewise_for_cudagraph({"load_async": False})
    assert not UMBPStoreConnector.requires_piecewise_for_cudagraph({})
    assert not UMBPStoreConnector.requires_piecewise_for_cudagraph({"load_async": True})
    assert not UMBPStoreConnector.requires_piecewise_for_cudagraph({"load_async": "no"})
