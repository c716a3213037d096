"""The server's request schema (`umbp.runtime.server.schema`): each rule refuses with a
message naming the field, and the C-speed path for plain key batches never accepts what
the exact, key-by-key check refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from umbp.runtime.server import protocol, schema


def parse(op: int, value: Any) -> schema.Request:
    return schema.parse(op, json.dumps(value).encode())


@pytest.mark.parametrize(
    ("op", "body", "message"),
    [
        (protocol.BEGIN_PUT, {"keys": ["a", "b"], "sizes": [65536, 1.5]}, "sizes[1] must be an integer"),
        (protocol.BEGIN_PUT, {"keys": ["a"], "sizes": [-1]}, "sizes[0] must be in"),
        (protocol.BEGIN_PUT, {"keys": ["a"], "sizes": [True]}, "got bool"),
        (protocol.BEGIN_PUT, {"keys": ["a"], "sizes": [1, 2]}, "'sizes' has 2 entries for 1 keys"),
        (protocol.BEGIN_PUT, {"keys": [5, None], "sizes": [1, 1]}, "keys[0] must be a string"),
        (protocol.BEGIN_GET, {"keys": ["k1", ["x"]], "sizes": [1, 1]}, "keys[1] must be a string"),
        (protocol.LOOKUP, {"keys": ["ok", ""]}, "keys[1] has 0 UTF-8 bytes"),
        (protocol.LOOKUP, {"keys": ["x" * 961]}, "keys[0] has 961 UTF-8 bytes"),
        (protocol.LOOKUP, {"keys": ["a\nb"]}, "keys[0] contains a control character"),
        (protocol.LOOKUP, {"keys": "abc"}, "'keys' must be a list"),
        (protocol.LOOKUP, {"keys": ["a"] * (schema.MAX_BATCH + 1)}, "more than 65536"),
        (protocol.LOOKUP, {"keys": [], "more": 1}, "unknown ['more']"),
        (protocol.LOOKUP, {}, "missing ['keys']"),
        (protocol.COMMIT_PUT, {"token": 1, "checksums": None}, "'checksums' must be a list"),
        (protocol.COMMIT_PUT, {"token": 1, "checksums": 5}, "'checksums' must be a list"),
        (protocol.COMMIT_PUT, {"token": 1, "checksums": [1 << 64]}, "checksums[0] must be in"),
        (protocol.COMMIT_PUT, {"token": 0, "checksums": []}, "token must be in [1,"),
        (protocol.COMMIT_PUT, {"token": "1", "checksums": []}, "token must be an integer"),
        (protocol.END_GET, {"token": 1, "corrupt": [0, 0]}, "names a position twice"),
        (protocol.END_GET, {"token": 1, "corrupt": [-1]}, "corrupt[0] must be in"),
        (protocol.STATS, {"x": 1}, "unknown ['x']"),
    ],
)  # fmt: skip
def test_each_rule_refuses_naming_the_field(op: int, body: Any, message: str) -> None:
    with pytest.raises(schema.BadRequest) as refused:
        parse(op, body)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "body",
    [b"{", b"\xff", b"[1]", b"null", b'{"keys": [NaN]}', b"[" * 100_000 + b"]" * 100_000],
)
def test_bodies_that_are_not_a_json_object_are_refused(body: bytes) -> None:
    with pytest.raises(schema.BadRequest):
        schema.parse(protocol.LOOKUP, body)


def test_unknown_ops_and_oversized_bodies_are_framing_errors() -> None:
    with pytest.raises(protocol.ProtocolError, match="unknown op 77"):
        schema.body_limit(77)
    assert schema.body_limit(protocol.HELLO) == 4 << 10
    assert schema.body_limit(protocol.BEGIN_PUT) == 16 << 20


def test_well_formed_requests_come_back_typed() -> None:
    assert parse(protocol.BEGIN_PUT, {"keys": ["a", "é"], "sizes": [0, 5]}) == schema.BeginPut(
        ("a", "é"), (0, 5)
    )
    assert parse(protocol.COMMIT_PUT, {"token": 3, "checksums": [None, 7]}) == schema.CommitPut(
        3, (None, 7)
    )
    assert parse(protocol.END_GET, {"token": 3, "corrupt": [2]}) == schema.EndGet(3, (2,))
    assert schema.parse(protocol.HELLO, b"") == schema.NoFields()


any_key = st.one_of(
    st.text(max_size=300), st.just(""), st.just("\ud800"), st.just("€" * 320),
    st.just("€" * 321), st.integers(), st.none(),
)  # fmt: skip


@given(st.lists(any_key, max_size=5))
def test_the_fast_path_agrees_with_the_exact_check(keys: list[Any]) -> None:
    try:
        exact: tuple[str, ...] | None = schema._checked_keys(keys)
    except schema.BadRequest:
        exact = None
    if schema._plainly_good_keys(keys):
        assert exact == tuple(keys)
    if exact is None:
        with pytest.raises(schema.BadRequest):
            schema._keys(keys)
    else:
        assert schema._keys(keys) == exact


def test_a_lookup_may_name_its_request_and_forget_names_one() -> None:
    """LOOKUP {"keys", "request"} ties the prefetches it starts to an engine's request;
    FORGET {"request"} (one-way) cancels them; WHERE takes no request."""
    keys = json.dumps({"keys": ["k"], "request": "cmpl-1"}).encode()
    assert schema.parse(protocol.LOOKUP, keys) == schema.Keys(("k",), "cmpl-1")
    assert schema.parse(protocol.FORGET, b'{"request": "cmpl-1"}') == schema.Forget("cmpl-1")
    assert protocol.FORGET in protocol.ONE_WAY
    for op, body in ((protocol.WHERE, keys), (protocol.FORGET, b'{"request": ""}'),
                     (protocol.FORGET, b'{"request": "a\\nb"}'),
                     (protocol.LOOKUP, b'{"keys": ["k"], "request": 7}')):
        with pytest.raises(schema.BadRequest):
            schema.parse(op, body)
