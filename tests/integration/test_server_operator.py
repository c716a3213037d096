"""An operator's view and control of a real `umbp serve` process: `umbp ls`, `umbp
clear`, `umbp limits` run as commands, retention asked by a client, and the metrics
endpoint scraped over HTTP and parsed with a Prometheus client library. Clients are
real `ServerStore`s; no engine is needed to prove these (tests/integration/
test_server_namespace_engines.py drives them with engines)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from umbp.runtime.contract import LoadStatus, StoreRefused
from umbp.runtime.server import ServerStore, start_server
from umbp.runtime.server.launch import stop_server

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PAGE = 4096
OBJECT = PAGE - 100
A, B = "a1b2c3d4e5f60718", "sglang.0f1e2d3c4b5a6978"  # a vLLM and an SGLang namespace


def key(namespace: str, serial: int) -> str:
    return f"umbp:1:{namespace}:tp0:pcp0:dcp0:pp0:g0:{serial:08x}"


@pytest.fixture(scope="module")
def server() -> Iterator[dict[str, Any]]:
    """64 pages of DRAM (high 60, low 54), 64 SSD slots of 64 KiB, a metrics port, a quota of 16
    pages on B given at start."""
    directory = Path(tempfile.mkdtemp(prefix="umbp-op-", dir="/tmp"))
    socket_path = str(directory / "run" / "umbp.sock")
    process = start_server(
        socket_path, 64 * PAGE, page_bytes=PAGE, ssd_dir=str(directory / "ssd"),
        ssd_capacity_bytes=64 << 16, log_path=str(directory / "serve.log"),
        extra_args=["--metrics-port", "0", "--quota", f"{B}={16 * PAGE}",
                    "--default-retain-budget", str(8 * PAGE), "--max-retain", "600"],
    )
    try:
        yield {"socket": socket_path, "directory": directory, "pid": process.pid}
    finally:
        stop_server(process, socket_path)


def umbp(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "umbp.cli", *arguments], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


def listing(socket_path: str) -> dict[str, dict[str, Any]]:
    done = umbp("ls", "--socket", socket_path, "--json")
    assert done.returncode == 0, done.stderr
    return {row["namespace"]: row for row in json.loads(done.stdout)}


def scrape(store: ServerStore) -> dict[str, Any]:
    url = store.server_stats()["server"]["metrics"]
    assert url.startswith("http://127.0.0.1:"), url
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = answer.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    name = sample.removesuffix("_total").removesuffix("_bucket").removesuffix(
        "_count").removesuffix("_sum")
    matches = [s.value for s in families[name].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (sample, labels, families[name].samples)
    return float(matches[0])


def test_an_operators_view_and_control_of_two_namespaces(server: dict[str, Any]) -> None:
    socket_path = server["socket"]
    with ServerStore(socket_path) as store:
        store.register_namespace(A, "vllm /models/llama weights files:0a1b float32 tp1")
        payload = memoryview(b"p" * OBJECT)
        assert all(store.put_batch([key(A, i) for i in range(20)], [payload] * 20))
        outs = [bytearray(OBJECT) for _ in range(3)]
        statuses = store.get_batch_into([key(A, 0), key(A, 1), key(A, 999)], outs)
        assert statuses == (LoadStatus.HIT, LoadStatus.HIT, LoadStatus.MISSING)
        retained = store.retain([key(A, i) for i in range(4)], 300.0)
        assert (retained.retained, retained.not_retained) == (4, 0)
        # B bursts past its quota (16 pages): its own objects go to SSD, not A's.
        for start in range(0, 40, 5):
            store.put_batch([key(B, start + i) for i in range(5)], [payload] * 5)

        rows = listing(socket_path)
        a, b = rows[A], rows[B]
        assert a["label"].startswith("vllm /models/llama") and b["label"] is None
        assert a["dram"]["objects"] == 20 and a["retained"]["objects"] == 4
        assert (a["loads"], a["puts"]) == (2, 20)
        assert (a["lookup_hits"], a["lookup_misses"]) == (0, 0), "gets are not lookups"
        assert b["quota_bytes"] == 16 * PAGE and b["dram"]["bytes"] <= 16 * PAGE
        assert b["evictions"]["quota"] > 0 and b["ssd"]["objects"] > 0
        assert a["retained"]["budget_bytes"] == 8 * PAGE
        table = umbp("ls", "--socket", socket_path)
        assert table.returncode == 0 and "vllm /models/llama" in table.stdout
        assert "(no engine has registered this namespace)" in table.stdout

        # Bad requests: a sentence, exit 1, nothing changed.
        with pytest.raises(StoreRefused, match="retention budget"):  # A's: 8 pages
            store.retain([key(A, i) for i in range(4, 16)], 60.0)
        refused = umbp("limits", "--socket", socket_path, "--namespace", A, "--quota", "1G")
        assert refused.returncode == 1 and "high watermark" in refused.stderr
        unknown = umbp("clear", "--socket", socket_path, "--namespace", "ffffffffffffffff")
        assert unknown.returncode == 1 and "unknown namespace 'ffffffffffffffff'" in unknown.stderr
        bad = umbp("clear", "--socket", socket_path, "--namespace", "no spaces")
        assert bad.returncode == 2 and "namespace must be" in bad.stderr
        now = listing(socket_path)
        assert set(now) == set(rows) and now[A]["quota_bytes"] is None, "nothing changed"
        assert now[A]["retained"]["objects"] == 4 and now[A]["dram"] == rows[A]["dram"]

        families = scrape(store)
        assert value(families, "umbp_server_loads_total", namespace=A, tier="dram") == 2
        assert value(families, "umbp_server_misses_total", namespace=A) == 0
        assert value(families, "umbp_server_objects", namespace=B, tier="ssd") == \
            rows[B]["ssd"]["objects"]
        assert value(families, "umbp_server_retained_objects", namespace=A) == 4
        assert value(families, "umbp_server_quota_bytes", namespace=B) == 16 * PAGE
        assert value(families, "umbp_server_evictions_total", namespace=B, cause="quota") == \
            rows[B]["evictions"]["quota"]
        info = [s for s in families["umbp_server_namespace_info"].samples
                if s.labels["namespace"] == A]
        assert info[0].labels["label"].startswith("vllm /models/llama")
        assert value(families, "umbp_server_connections") >= 1
        puts = value(families, "umbp_server_request_seconds_count", op="begin_put")
        assert puts >= 9 and value(families, "umbp_server_request_seconds_bucket",
                                   op="begin_put", le="+Inf") == puts
        assert value(families, "umbp_server_tier_capacity_bytes", tier="dram") == 64 * PAGE

        # Clearing one namespace drops its objects in both tiers, and only them.
        cleared = umbp("clear", "--socket", socket_path, "--namespace", B, "--json")
        assert cleared.returncode == 0, cleared.stderr
        dropped = json.loads(cleared.stdout)
        assert dropped["objects"] == rows[B]["puts"] and dropped["in_use"] == 0
        after = listing(socket_path)
        assert after[B]["dram"]["objects"] == after[B]["ssd"]["objects"] == 0
        assert after[A]["dram"]["objects"] == 20 and after[A]["retained"]["objects"] == 4
        assert store.lookup([key(B, i) for i in range(40)]) == (False,) * 40
        limits = umbp("limits", "--socket", socket_path, "--namespace", B, "--quota", "none")
        assert limits.returncode == 0 and "quota none" in limits.stdout
        everything = umbp("clear", "--socket", socket_path, "--all")
        assert everything.returncode == 0 and "dropped 20 objects of every namespace" in \
            everything.stdout


def test_limits_that_break_the_capacity_stop_the_server_at_start(tmp_path: Path) -> None:
    socket_path = str(tmp_path / "s.sock")
    done = umbp("serve", "--socket", socket_path, "--capacity", "1M",
                "--quota", "abcd=2M")
    assert done.returncode == 1 and "high watermark" in done.stderr
    done = umbp("serve", "--socket", socket_path, "--capacity", "1M",
                "--default-retain-budget", "1M")
    assert done.returncode == 1 and "half the low watermark" in done.stderr


def test_the_documented_hit_rate_query_reads_the_share_of_looked_up_keys_held(
    server: dict[str, Any],
) -> None:
    """A known workload: lookups of which half the keys are held (some on SSD), beside
    residency checks (`where`) and loads, which are not lookups. The hit-rate query of
    docs/operations.md, evaluated over two scrapes of the real server's /metrics as
    Prometheus would (its scrape adds `instance`), reads 0.5 for that namespace."""
    namespace = "c0ffee0123456789"
    query = documented_hit_rate_query()
    with ServerStore(server["socket"]) as store:
        before = scraped_samples(store)
        held = [key(namespace, i) for i in range(30)]
        absent = [key(namespace, 1000 + i) for i in range(30)]
        assert all(store.put_batch(held, [memoryview(b"h" * OBJECT)] * len(held)))
        for round_ in range(3):
            asked = held[10 * round_:10 * round_ + 10] + absent[10 * round_:10 * round_ + 10]
            assert store.lookup(asked) == (True,) * 10 + (False,) * 10
            store.where(absent + held)  # a residency check, not an ask
        outs = [bytearray(OBJECT) for _ in range(4)]
        store.get_batch_into(held[:3] + absent[:1], outs)  # loads, not asks
        after = scraped_samples(store)
    rates = promql(query, before, after, seconds=30.0)
    assert rates[frozenset({("namespace", namespace)})] == pytest.approx(0.5)


def documented_hit_rate_query() -> str:
    text = (REPO / "docs" / "operations.md").read_text()
    found = re.search(r"A namespace's hit rate.*?```promql\n(.*?)```", text, re.DOTALL)
    assert found, "docs/operations.md states the hit-rate query in a promql block"
    return " ".join(found[1].split())


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scraped_samples(store: ServerStore) -> Samples:
    """Every sample of one scrape, labelled as Prometheus stores it (`instance` added)."""
    families = scrape(store)
    return {(s.name, frozenset({**s.labels, "instance": "umbp-serve"}.items())): s.value
            for family in families.values() for s in family.samples}


def promql(query: str, before: Samples, after: Samples, seconds: float
           ) -> dict[frozenset[tuple[str, str]], float]:
    """The subset of PromQL the documented query uses (`sum by (...) (...)`,
    `rate(counter[range])` over two scrapes `seconds` apart, `+ - * /` between vectors
    matched on all their labels, parentheses), evaluated as Prometheus does; anything
    else fails the test rather than being guessed."""
    tokens = re.findall(r"sum|by|rate|[A-Za-z_][A-Za-z0-9_]*|\[[0-9a-z]+\]|[()+\-*/,]", query)
    assert "".join(tokens) == re.sub(r"\s+", "", query), f"unsupported PromQL: {query}"
    position = 0

    def take(expected: str | None = None) -> str:
        nonlocal position
        token = tokens[position]
        assert expected is None or token == expected, (expected, token, query)
        position += 1
        return token

    def expression() -> dict[frozenset[tuple[str, str]], float]:
        left = term()
        while position < len(tokens) and tokens[position] in "+-":
            left = binary(left, take(), term())
        return left

    def term() -> dict[frozenset[tuple[str, str]], float]:
        left = factor()
        while position < len(tokens) and tokens[position] in "*/":
            left = binary(left, take(), factor())
        return left

    def factor() -> dict[frozenset[tuple[str, str]], float]:
        token = take()
        if token == "(":
            inner = expression()
            take(")")
            return inner
        if token == "sum":
            take("by")
            take("(")
            kept = {take()}
            while tokens[position] == ",":
                take(",")
                kept.add(take())
            take(")")
            take("(")
            inner = expression()
            take(")")
            summed: dict[frozenset[tuple[str, str]], float] = {}
            for labels, number in inner.items():
                group = frozenset(item for item in labels if item[0] in kept)
                summed[group] = summed.get(group, 0.0) + number
            return summed
        assert token == "rate", f"unsupported PromQL at {token!r}: {query}"
        take("(")
        name = take()
        take()  # the range: the two scrapes span it
        take(")")
        return {labels: (number - before.get((sample, labels), 0.0)) / seconds
                for (sample, labels), number in after.items() if sample == name}

    def binary(left: dict[frozenset[tuple[str, str]], float], op: str,
               right: dict[frozenset[tuple[str, str]], float]
               ) -> dict[frozenset[tuple[str, str]], float]:
        apply = {"+": float.__add__, "-": float.__sub__, "*": float.__mul__,
                 "/": lambda a, b: a / b if b else float("nan")}[op]
        return {labels: apply(float(left[labels]), float(right[labels]))
                for labels in left.keys() & right.keys()}

    result = expression()
    assert position == len(tokens), f"unsupported PromQL: {query}"
    return result
