"""Properties of a request's retention ask (umbp.core.retention): which
``kv_transfer_params`` ask, which are refused with a sentence, and which keys an ask
names (every key a lookup of the whole request would ask for, on every rank)."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from tests.property.strategies import geometries, keyspaces, request_hashes
from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace
from umbp.core.lookup.query import build_lookup_query
from umbp.core.retention import MAX_RETAIN_S, requested_retention, retention_keys

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6,
)


@given(st.dictionaries(st.text(max_size=8).filter(lambda key: key != "umbp"), json_values,
                       max_size=4) | st.none() | st.integers())
def test_params_without_an_umbp_entry_ask_nothing(params: Any) -> None:
    assert requested_retention(params) == Success(None)


@given(st.integers(1, int(MAX_RETAIN_S)) | st.floats(1e-3, MAX_RETAIN_S), json_values)
def test_a_number_of_seconds_in_range_is_asked_whatever_else_the_params_hold(
    seconds: float, other: Any
) -> None:
    params = {"umbp": {"retain_s": seconds}, "other_connector": other}
    assert requested_retention(params) == Success(float(seconds))


@given(json_values)
def test_an_entry_breaking_the_rule_is_refused_with_a_sentence(value: Any) -> None:
    fine = (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and 0 < value <= MAX_RETAIN_S)
    for entry in ({"retain_s": value}, value, {"retain_s": 1, "extra": value}):
        result = requested_retention({"umbp": entry})
        if entry == {"retain_s": value} and fine:
            assert result == Success(float(value))
        else:
            assert isinstance(result, Failure)
            assert "kv_transfer_params 'umbp'" in result.failure()


@given(geometries(), keyspaces(), st.integers(0, 24).flatmap(request_hashes))
def test_retention_names_every_key_a_lookup_of_the_whole_request_asks_for(
    geometry: CacheGeometry, keyspace: KeySpace, hashes: tuple[bytes, ...]
) -> None:
    keys = retention_keys(geometry, keyspace, hashes)
    covered = len(hashes) * geometry.hash_block_size
    lookup = build_lookup_query(geometry, keyspace, hashes, 0, covered + 1)
    # A replica run's ranks ask its one key (core.replicas): it is retained once.
    assert sorted(keys) == sorted(set(lookup.runs.key_strings()))
    assert len(set(keys)) == len(keys)
    assert len(keys) == sum(
        covered // unit * keyspace.topology.rank_count // keyspace.replica_run(group_id)
        for group_id, unit in zip(geometry.group_ids, geometry.lookup_units)
    )


@given(st.integers(0, 1 << 40), st.none() | st.integers(1, int(MAX_RETAIN_S)), json_values)
def test_an_announcement_is_read_beside_a_retention(
    tokens: int, seconds: int | None, other: Any
) -> None:
    """A decode engine's request carries the prefill engine's announcement, maybe
    beside the client's own retention; both are read, other connectors' entries
    ignored."""
    from umbp.core.request_params import RequestParams, request_params

    entry: dict[str, Any] = {"announced_tokens": tokens}
    if seconds is not None:
        entry["retain_s"] = seconds
    asked = request_params({"umbp": entry, "nixl": other})
    assert asked == Success(RequestParams(None if seconds is None else float(seconds), tokens))
    assert requested_retention({"umbp": entry}) == Success(
        None if seconds is None else float(seconds))


@given(json_values)
def test_an_announcement_that_is_not_a_token_count_is_refused(value: Any) -> None:
    from umbp.core.request_params import request_params

    result = request_params({"umbp": {"announced_tokens": value}})
    if type(value) is int and value >= 0:
        assert isinstance(result, Success)
    else:
        assert isinstance(result, Failure)
        assert "announced_tokens" in result.failure()
