"""``umbp pd-proxy``'s two request rewrites (the HTTP path between two real
``vllm serve`` is in tests/integration/test_vllm_serve.py)."""

from __future__ import annotations

import pytest

from umbp.pd_proxy import Upstream, decode_body, prefill_body


def test_the_prefill_engine_computes_the_prompt_and_one_token_unstreamed() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    assert prefill_body(body, chat=False) == {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": False, "temperature": 0,
    }
    chat = prefill_body({"messages": [], "max_completion_tokens": 9}, chat=True)
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    assert body["max_tokens"] == 50, "the client's request is not changed"


def test_the_decode_engine_gets_the_announcement_over_the_clients_params() -> None:
    announced = {"umbp": {"announced_tokens": 1024}}
    body = {"prompt": [1], "kv_transfer_params": {"other": 1, "umbp": {"retain_s": 5}}}
    assert decode_body(body, announced)["kv_transfer_params"] == {
        "other": 1, "umbp": {"retain_s": 5, "announced_tokens": 1024},
    }
    # A prefill engine that announced nothing (or failed): the request as it came.
    assert decode_body(body, None) == body
    assert decode_body({"prompt": [1]}, {}) == {"prompt": [1]}


@pytest.mark.parametrize("url", ["https://host:1", "host:8000", "http://:80"])
def test_an_engine_url_must_be_plain_http(url: str) -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        Upstream(url, 1.0)


@pytest.mark.parametrize("raw, problem", [
    (b"{not json", "not JSON"),
    (b'"a JSON string"', "must be a JSON object"),
])
def test_a_bad_completion_body_is_refused_before_any_engine_is_asked(
    raw: bytes, problem: str
) -> None:
    import http.client
    import json

    from umbp.pd_proxy import serve

    server = serve("127.0.0.1", 0, "http://127.0.0.1:9", "http://127.0.0.1:9", 5.0)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        connection.request("POST", "/v1/completions", body=raw,
                           headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        assert answer.status == 400
        assert problem in json.loads(answer.read())["error"]
    finally:
        server.shutdown()
        server.server_close()
