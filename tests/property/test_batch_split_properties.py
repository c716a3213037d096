"""Batches longer than a service takes: cut into calls that each fit, answered in order.

`umbp.runtime.batches` cuts a batch into consecutive spans within a key count and a byte
budget; `ServerStore` sends each span as one request. The properties: the spans cover the
batch exactly, in order; each fits both limits (for the server, the request body as it is
actually encoded); each span but the last is as long as the limits allow; and a
`ServerStore` whose requests are cut small answers every key of any batch exactly as a
store that sends it whole (a real `umbp serve` behind both).
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbp.runtime.batches import json_key_spans, json_string_bytes, spans_within
from umbp.runtime.contract import LoadStatus
from umbp.runtime.server import client as server_client
from umbp.runtime.server import protocol
from umbp.runtime.server.client import ServerStore, request_spans
from umbp.runtime.server.launch import start_server, stop_server
from umbp.runtime.server.schema import MAX_OBJECT_BYTES

# Keys as a caller may spell them: umbp's own (printable ASCII) and anything else JSON
# must escape (quotes, backslashes, control characters, non-ASCII, astral characters).
ANY_KEY = st.text(min_size=1, max_size=40)
UMBP_LIKE_KEY = st.text(alphabet="0123456789abcdef:-_tpg", min_size=1, max_size=40)
KEYS = st.lists(st.one_of(ANY_KEY, UMBP_LIKE_KEY), max_size=60)


def covers_in_order(spans: list[tuple[int, int]], total: int) -> bool:
    ends = [0] + [end for _, end in spans]
    return all(start == ends[index] and start < end for index, (start, end) in enumerate(spans)) and (
        ends[-1] == total
    )


@given(
    st.lists(st.integers(min_value=1, max_value=50), max_size=80),
    st.integers(min_value=1, max_value=10),
    st.integers(min_value=50, max_value=200),
)
def test_spans_cover_the_batch_in_order_each_within_both_limits(
    weights: list[int], max_count: int, max_weight: int
) -> None:
    spans = spans_within(weights, max_count, max_weight)
    assert covers_in_order(spans, len(weights))
    for start, end in spans:
        assert end - start <= max_count
        assert sum(weights[start:end]) <= max_weight
    for start, end in spans[:-1]:  # greedy: the next entry would break a limit
        assert end - start == max_count or sum(weights[start : end + 1]) > max_weight


@given(st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=20),
       st.data())
def test_an_entry_heavier_than_a_call_carries_is_refused(
    weights: list[int], data: st.DataObject
) -> None:
    heavy = data.draw(st.integers(min_value=0, max_value=len(weights) - 1))
    weights[heavy] = 10**6
    with pytest.raises(ValueError, match=f"entry {heavy} needs"):
        spans_within(weights, 5, 10**6 - 1)


@given(st.lists(st.one_of(ANY_KEY, UMBP_LIKE_KEY), min_size=1, max_size=30))
def test_json_string_bytes_are_what_json_spends_on_each_key(keys: list[str]) -> None:
    encoded = json.dumps(keys, separators=(",", ":"))
    # The list's brackets, less the separator after the last key.
    assert sum(json_string_bytes(keys)) + 1 == len(encoded)


@given(KEYS, st.integers(min_value=1, max_value=8), st.integers(min_value=0, max_value=14),
       st.integers(min_value=600, max_value=2000))
def test_json_key_spans_fit_their_budget_as_encoded(
    keys: list[str], max_count: int, extra: int, max_bytes: int
) -> None:
    spans = json_key_spans(keys, max_count, max_bytes, extra)
    assert covers_in_order(spans, len(keys))
    for start, end in spans:
        part = keys[start:end]
        assert len(part) <= max_count
        assert len(json.dumps(part, separators=(",", ":"))) + extra * len(part) <= max_bytes + 1


@given(KEYS, st.booleans(), st.integers(min_value=1, max_value=8),
       st.integers(min_value=700, max_value=3000))
def test_every_server_request_body_fits_the_server_limit(
    keys: list[str], with_sizes: bool, max_keys: int, body_bytes: int
) -> None:
    """The bodies ServerStore sends for each span, encoded as the link encodes them,
    with the largest size the schema allows for every key."""
    spans = request_spans(keys, with_sizes=with_sizes, max_keys=max_keys, body_bytes=body_bytes)
    assert covers_in_order(spans, len(keys))
    for start, end in spans:
        part = keys[start:end]
        request: dict[str, object] = {"keys": part}
        if with_sizes:
            request["sizes"] = [MAX_OBJECT_BYTES] * len(part)
        frame = protocol.encode_json(protocol.BEGIN_PUT, request)
        assert len(part) <= max_keys
        assert len(frame) - protocol.HEADER.size <= body_bytes


def test_the_server_limits_hold_a_batch_of_umbp_keys_in_few_requests() -> None:
    """131,072 of umbp's ~100-byte keys go as two requests of 65,536 (the key limit
    binds; their 6.5 MiB of JSON each is well within the body limit)."""
    keys = [f"m-0123456789abcdef:tp0:pp0:g0:{index:064x}" for index in range(131_072)]
    assert request_spans(keys, with_sizes=True) == [(0, 65_536), (65_536, 131_072)]


# ------------------------------------------------------------ through a real server


@pytest.fixture(scope="module")
def stores() -> Iterator[tuple[ServerStore, ServerStore]]:
    """Two clients of one real server: one to send batches whole, one to cut them."""
    directory = Path(tempfile.mkdtemp(prefix="umbp-split-", dir="/tmp"))
    socket_path = str(directory / "umbp.sock")
    process = start_server(socket_path, 8 << 20, page_bytes=256)
    whole = ServerStore(socket_path, io_timeout_s=60.0)
    cut = ServerStore(socket_path, io_timeout_s=60.0)
    try:
        yield whole, cut
    finally:
        whole.close()
        cut.close()
        stop_server(process, socket_path)
        shutil.rmtree(directory, ignore_errors=True)


SMALL_KEYS = st.lists(st.one_of(st.text(min_size=1, max_size=12).filter(
    lambda key: key.isprintable()), st.sampled_from(["a", "b", "c"])), max_size=25)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(put=SMALL_KEYS, ask=SMALL_KEYS, max_keys=st.integers(min_value=1, max_value=4))
def test_a_store_cut_into_small_requests_answers_as_one_that_is_not(
    stores: tuple[ServerStore, ServerStore], put: list[str], ask: list[str], max_keys: int
) -> None:
    """Puts, lookups, wheres and gets through a client whose requests carry at most
    `max_keys` keys in 600 bytes, against the same calls through an uncut client."""
    put = list(dict.fromkeys(put))  # a batch puts each key once
    payloads = {key: random.Random(key).randbytes(1 + len(key) * 37 % 700) for key in put}
    whole, cut = stores
    small = functools.partial(request_spans, max_keys=max_keys, body_bytes=600)
    assert whole.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_client, "request_spans", small)
        assert cut.put_batch(put, [payloads[key] for key in put]) == (True,) * len(put)
        asked = ask + put
        cut_lookup, cut_where = cut.lookup(asked), cut.where(asked)
        outs = [bytearray(len(payloads.get(key, b"?"))) for key in asked]
        cut_get = cut.get_batch_into(asked, outs)
    assert cut_lookup == whole.lookup(asked) == tuple(key in payloads for key in asked)
    assert cut_where == whole.where(asked)
    assert cut_get == tuple(
        LoadStatus.HIT if key in payloads else LoadStatus.MISSING for key in asked
    )
    for key, out in zip(asked, outs):
        if key in payloads:
            assert bytes(out) == payloads[key]
