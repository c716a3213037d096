"""``umbp pd-proxy``: disaggregated prefill through the store, as one OpenAI endpoint.

Each completion (``/v1/completions``, ``/v1/chat/completions``) goes first to the
prefill engine (a ``vllm serve`` with ``kv_role: "kv_producer"``) with one output token
and no streaming: it computes the prompt and stores its blocks, and its response's
``kv_transfer_params`` announce them. The original request then goes to the decode
engine (``kv_role: "kv_consumer"``) with that announcement; the decode engine's lookup
waits (up to ``announced_wait_s``) until the pool holds the announced blocks, restores
them and generates; its response (streamed or not) is the client's.

If the prefill engine fails, the request still goes to the decode engine, without an
announcement: it computes the whole prompt (the proxy logs why). Other paths (``GET
/v1/models``...) go to the decode engine; ``/health`` answers 200 only when both
engines do. Standard library only: it runs wherever umbp is installed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
import threading
import urllib.parse
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("umbp.pd_proxy")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def prefill_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The request as the prefill engine gets it: one token, not streamed."""
    prefill = {key: value for key, value in body.items() if key != "stream_options"}
    prefill.update(max_tokens=1, stream=False)
    if chat:
        prefill["max_completion_tokens"] = 1
    return prefill


def decode_body(body: Mapping[str, Any], announced: object) -> dict[str, Any]:
    """The request as the decode engine gets it: the prefill engine's
    ``kv_transfer_params`` (the announcement) merged into the client's own, each
    connector's entry key by key (a client's ``retain_s`` stays beside it)."""
    decode = dict(body)
    if not isinstance(announced, Mapping) or not announced:
        return decode
    own = body.get("kv_transfer_params")
    merged = dict(own) if isinstance(own, Mapping) else {}
    for name, entry in announced.items():
        mine = merged.get(name)
        if isinstance(mine, Mapping) and isinstance(entry, Mapping):
            merged[name] = {**mine, **entry}
        else:
            merged[name] = entry
    decode["kv_transfer_params"] = merged
    return decode


class Upstream:
    """One engine's base URL; a connection per call (the proxy is thread per request)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"an engine URL must be http://host:port, got {url!r}")
        self.url = url
        self._host, self._port = parsed.hostname, parsed.port or 80
        self._timeout_s = timeout_s

    def request(self, method: str, path: str, body: bytes | None,
                headers: Mapping[str, str]) -> tuple[http.client.HTTPConnection,
                                                     http.client.HTTPResponse]:
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        connection.request(method, path, body=body, headers=dict(headers))
        return connection, connection.getresponse()

    def post_json(self, path: str, payload: Mapping[str, Any]) -> tuple[int, Any]:
        connection, answer = self.request(
            "POST", path, json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        try:
            data = answer.read()
            return answer.status, json.loads(data) if data else None
        finally:
            connection.close()


class ProxyHandler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        if self.path == "/health":
            healthy = all(map(self._healthy, (self.server.prefill, self.server.decode)))
            self._answer(200 if healthy else 503, b"")
            return
        self._relay(self.server.decode, "GET", None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path not in COMPLETION_PATHS:
            self._relay(self.server.decode, "POST", raw)
            return
        try:
            body = json.loads(raw)
        except ValueError as error:
            self._refuse(f"the request body is not JSON ({error})")
            return
        if not isinstance(body, dict):
            self._refuse("the request body must be a JSON object")
            return
        announced = self._prefill(body)
        payload = json.dumps(decode_body(body, announced)).encode()
        self._relay(self.server.decode, "POST", payload)

    def _prefill(self, body: dict[str, Any]) -> object:
        """The prefill engine's announcement, or None when it failed (logged)."""
        chat = self.path == COMPLETION_PATHS[1]
        try:
            status, answer = self.server.prefill.post_json(self.path, prefill_body(body, chat))
        except (OSError, http.client.HTTPException, ValueError) as error:
            logger.warning("umbp pd-proxy: prefill engine %s failed (%s); the decode engine "
                           "computes the whole prompt", self.server.prefill.url, error)
            return None
        if status != 200 or not isinstance(answer, dict):
            logger.warning("umbp pd-proxy: prefill engine %s answered %d; the decode engine "
                           "computes the whole prompt", self.server.prefill.url, status)
            return None
        return answer.get("kv_transfer_params")

    def _relay(self, engine: Upstream, method: str, body: bytes | None) -> None:
        """The engine's answer to the client as it comes (a stream stays a stream)."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        try:
            connection, answer = engine.request(method, self.path, body, headers)
        except (OSError, http.client.HTTPException) as error:
            self._answer(502, json.dumps(
                {"error": f"umbp pd-proxy: {engine.url} unreachable: {error}"}).encode())
            return
        try:
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in _HOP_HEADERS:
                    self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := answer.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            connection.close()

    def _refuse(self, problem: str) -> None:
        self._answer(400, json.dumps({"error": f"umbp pd-proxy: {problem}"}).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    @staticmethod
    def _healthy(engine: Upstream) -> bool:
        try:
            connection, answer = engine.request("GET", "/health", None, {})
        except (OSError, http.client.HTTPException):
            return False
        try:
            answer.read()
            return answer.status == 200
        finally:
            connection.close()


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: Upstream, decode: Upstream) -> None:
        super().__init__(address, ProxyHandler)
        self.prefill, self.decode = prefill, decode


def serve(host: str, port: int, prefill_url: str, decode_url: str,
          timeout_s: float) -> ProxyServer:
    """A running proxy (in a thread of its own); ``shutdown()`` stops it."""
    server = ProxyServer((host, port), Upstream(prefill_url, timeout_s),
                         Upstream(decode_url, timeout_s))
    threading.Thread(target=server.serve_forever, name="umbp-pd-proxy", daemon=True).start()
    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True,
                        help="the kv_producer engine, http://host:port")
    parser.add_argument("--decode", required=True,
                        help="the kv_consumer engine, http://host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds an engine may take to answer")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        server = serve(args.host, args.port, args.prefill, args.decode, args.timeout)
    except (ValueError, OSError) as error:
        print(f"umbp pd-proxy: {error}", file=sys.stderr)
        return 2
    logger.info("umbp pd-proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port,
                args.prefill, args.decode)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0
