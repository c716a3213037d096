"""The server's metrics as documented: docs/grafana-umbp.json and docs/operations.md
query only series that `umbp serve` (umbp.runtime.server.metrics) or the engines
(umbp.shell.stats) export, and the exposition parses as Prometheus text."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_server_state import PAGE, Rig
from umbp.runtime.server import protocol
from umbp.runtime.server.metrics import RequestTimes, render
from umbp.runtime.ssd.tier import SsdTier
from umbp.shell.stats import COUNTER_DOCS, GAUGE_DOCS

REPO = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\bumbp_(?:server|worker|scheduler)_[a-z_]+")


def server_series() -> set[str]:
    """Every series of a scrape of a server with an SSD tier and a namespace with a quota."""
    with tempfile.TemporaryDirectory() as directory:
        ssd = SsdTier(Path(directory), 16 * PAGE, slot_bytes=PAGE)
        try:
            return _scraped_series(Rig(8, cold=ssd))
        finally:
            ssd.close()


def _scraped_series(rig: Rig) -> set[str]:
    rig.core.register("aaaa", 'a "quoted" label\\with a backslash')
    rig.put({"umbp:1:aaaa:tp0:pcp0:dcp0:pp0:g0:00": b"x" * PAGE, "plain": b"y"})
    rig.core.set_limits("aaaa", {"quota_bytes": 4 * PAGE})
    times = RequestTimes()
    times.observe(protocol.BEGIN_PUT, 0.0002)
    times.observe(protocol.BEGIN_PUT, 20.0)
    text = render(rig.core.stats(), rig.core.namespaces(), times.snapshot(), 3)
    families = list(text_string_to_metric_families(text))
    info = next(f for f in families if f.name == "umbp_server_namespace_info")
    assert {s.labels["label"] for s in info.samples} == {'a "quoted" label\\with a backslash', ""}
    latency = next(f for f in families if f.name == "umbp_server_request_seconds")
    counts = [s.value for s in latency.samples if s.name.endswith("_count")]
    assert counts == [2]
    return {sample.name for family in families for sample in family.samples}


def engine_series() -> set[str]:
    counters = {f"umbp_{key}_total" for key in COUNTER_DOCS} | {"umbp_worker_load_failures_total"}
    return counters | {f"umbp_{key}" for key in GAUGE_DOCS}


def test_the_dashboard_queries_only_exported_series() -> None:
    dashboard = json.loads((REPO / "docs" / "grafana-umbp.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in METRIC.findall(target["expr"])}
    assert any(name.startswith("umbp_server_") for name in queried)
    assert any(name.startswith("umbp_worker_") for name in queried)
    assert not queried - server_series() - engine_series()


def test_operations_md_names_only_exported_series() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    named = {name.rstrip("_") for name in METRIC.findall(text)}
    known = server_series() | engine_series() | {
        "umbp_server_request_seconds"} | {name.removesuffix("_total") for name in
                                          server_series() | engine_series()}
    assert not named - known, sorted(named - known)
