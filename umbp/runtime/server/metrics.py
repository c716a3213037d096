"""`umbp serve --metrics-port`: the server's figures in Prometheus' text format.

An HTTP endpoint (`GET /metrics`, on 127.0.0.1 unless `--metrics-host` says otherwise:
the figures name every model the server holds) serves, at each scrape:

* per namespace: a lookup's keys held (hits, by tier) and not held (misses), objects
  loaded (by tier) and written, bytes written and read, objects and bytes
  per tier, retained objects and bytes, the retention budget and quota, evictions by
  cause, and an info series carrying the namespace's label;
* per tier: capacity, used bytes, objects; the SSD tier's own evictions;
* totals: demotions (to SSD, dropped), rejected puts, corrupt loads, promotions, SSD
  write failures, prefetches by outcome, connections (open, accepted, refused);
* a latency histogram per op (`umbp_server_request_seconds`): from a request read whole
  to its answer sent (the server's own time; the client's wait adds the socket's).

The text is written here (the server needs no Prometheus library); the tests parse it
with `prometheus_client`'s parser. docs/operations.md lists every series and
docs/grafana-umbp.json charts them beside the engines' `umbp_*` counters.
"""

from __future__ import annotations

import http.server
import logging
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any, Final

from umbp.runtime.server import protocol
from umbp.runtime.server.shares import OTHER_LABEL

__all__ = ["LATENCY_BUCKETS_S", "MetricsEndpoint", "RequestTimes", "render"]

logger = logging.getLogger("umbp.serve")

LATENCY_BUCKETS_S: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)


class RequestTimes:
    """Latency histograms per op; thread-safe (every connection thread observes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, list[int]] = {}
        self._sums: dict[int, float] = {}

    def observe(self, op: int, seconds: float) -> None:
        bucket = bisect_left(LATENCY_BUCKETS_S, seconds)
        with self._lock:
            counts = self._counts.get(op)
            if counts is None:
                counts = self._counts[op] = [0] * (len(LATENCY_BUCKETS_S) + 1)
                self._sums[op] = 0.0
            counts[bucket] += 1
            self._sums[op] += seconds

    def snapshot(self) -> dict[int, tuple[list[int], float]]:
        """Per op: the count in each bucket (the last one past the largest bound) and
        the sum of the seconds."""
        with self._lock:
            return {op: (list(counts), self._sums[op]) for op, counts in self._counts.items()}


class _Text:
    """Prometheus text exposition, one family at a time."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        text = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels.items())
        self.lines.append(f"{name}{{{text}}} {_number(value)}" if text else
                          f"{name} {_number(value)}")

    def series(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[dict[str, str], float]]) -> None:
        self.family(name, kind, help_text)
        for labels, value in samples:
            self.sample(name, labels, value)


def render(
    stats: dict[str, Any], namespaces: list[dict[str, Any]],
    times: dict[int, tuple[list[int], float]], refused_connections: int,
) -> str:
    """The exposition of one scrape: `stats` (`StoreCore.stats`), `namespaces`
    (`StoreCore.namespaces`), `times` (`RequestTimes.snapshot`)."""
    out = _Text()
    _namespace_series(out, namespaces)
    _tier_series(out, stats)
    counters = stats["counters"]
    out.series("umbp_server_demotions_total", "counter",
               "Objects that left the DRAM tier, by where they went.",
               [({"to": "ssd"}, counters["evictions_to_ssd"]),
                ({"to": "dropped"}, counters["evictions_dropped"])])
    for name, key, help_text in (
        ("umbp_server_put_rejects_total", "put_rejects", "Objects a put could not store."),
        ("umbp_server_corrupt_loads_total", "corrupt_loads",
         "Objects found corrupt (checksum mismatch) and dropped."),
        ("umbp_server_promotions_total", "promotions", "Objects read back from SSD to DRAM."),
        ("umbp_server_ssd_put_failures_total", "ssd_put_failures",
         "Writes to the SSD tier it refused (demotions and writes ahead)."),
        ("umbp_server_written_ahead_total", "written_ahead",
         "DRAM objects copied to SSD ahead of their eviction, kept in DRAM."),
        ("umbp_server_connections_accepted_total", "connections",
         "Client connections accepted since start."),
    ):
        out.series(name, "counter", help_text, [({}, counters[key])])
    out.series("umbp_server_prefetches_total", "counter",
               "SSD objects a lookup found, by what became of them: promoted into DRAM "
               "ahead of their load, skipped (the bound), cancelled (their request went "
               "away), claimed (a get read them itself first).",
               [({"outcome": outcome}, counters.get(key, 0)) for outcome, key in (
                   ("promoted", "prefetched"), ("skipped", "prefetch_skipped"),
                   ("cancelled", "prefetch_cancelled"), ("claimed", "prefetch_claimed"))])
    out.series("umbp_server_connections_refused_total", "counter",
               "Client connections refused (the connection limit).",
               [({}, refused_connections)])
    out.series("umbp_server_connections", "gauge", "Client connections open now.",
               [({}, stats["sessions"]["connections"])])
    _latency_series(out, times)
    return "\n".join(out.lines) + "\n"


def _namespace_series(out: _Text, rows: list[dict[str, Any]]) -> None:
    def each(value: Callable[[dict[str, Any]], float], **extra: str
             ) -> list[tuple[dict[str, str], float]]:
        return [({"namespace": _shown(row), **extra}, value(row)) for row in rows]

    out.series("umbp_server_namespace_info", "gauge",
               "1 per namespace; its label says which model it holds.",
               [({"namespace": _shown(row), "label": row["label"] or ""}, 1) for row in rows])
    out.series("umbp_server_hits_total", "counter",
               "Keys a lookup asked that the server held, by the tier holding them.",
               each(lambda r: r["lookup_hits"] - r["lookup_hits_on_ssd"], tier="dram")
               + each(lambda r: r["lookup_hits_on_ssd"], tier="ssd"))
    out.series("umbp_server_misses_total", "counter",
               "Keys a lookup asked that the server did not hold.",
               each(lambda r: r["lookup_misses"]))
    out.series("umbp_server_loads_total", "counter",
               "Objects loaded, by the tier they came from.",
               each(lambda r: r["loads"] - r["loads_from_ssd"], tier="dram")
               + each(lambda r: r["loads_from_ssd"], tier="ssd"))
    out.series("umbp_server_puts_total", "counter", "Objects written.", each(lambda r: r["puts"]))
    out.series("umbp_server_written_bytes_total", "counter", "Payload bytes written.",
               each(lambda r: r["bytes_written"]))
    out.series("umbp_server_read_bytes_total", "counter", "Payload bytes loaded.",
               each(lambda r: r["bytes_read"]))
    out.series("umbp_server_objects", "gauge", "Objects held, per tier.",
               each(lambda r: r["dram"]["objects"], tier="dram")
               + each(lambda r: r["ssd"]["objects"], tier="ssd"))
    out.series("umbp_server_bytes", "gauge",
               "Bytes held per tier (DRAM: whole pages; SSD: payload).",
               each(lambda r: r["dram"]["bytes"], tier="dram")
               + each(lambda r: r["ssd"]["bytes"], tier="ssd"))
    out.series("umbp_server_retained_objects", "gauge", "Objects retained in DRAM.",
               each(lambda r: r["retained"]["objects"]))
    out.series("umbp_server_retained_bytes", "gauge", "Bytes retained in DRAM.",
               each(lambda r: r["retained"]["bytes"]))
    out.series("umbp_server_retain_budget_bytes", "gauge", "What a namespace may retain.",
               each(lambda r: r["retained"]["budget_bytes"]))
    out.series("umbp_server_quota_bytes", "gauge", "A namespace's DRAM quota (when it has one).",
               [({"namespace": _shown(row)}, row["quota_bytes"]) for row in rows
                if row["quota_bytes"] is not None])
    out.series("umbp_server_evictions_total", "counter",
               "Objects chosen to leave DRAM, by cause (quota, share, lru).",
               [({"namespace": _shown(row), "cause": cause}, row["evictions"].get(cause, 0))
                for row in rows for cause in ("quota", "share", "lru")])


def _tier_series(out: _Text, stats: dict[str, Any]) -> None:
    dram, ssd = stats["dram"], stats["ssd"]
    tiers = [("dram", dram)] + ([("ssd", ssd)] if ssd.get("enabled") else [])
    for name, key, help_text in (
        ("umbp_server_tier_capacity_bytes", "capacity_bytes", "Bytes a tier can hold."),
        ("umbp_server_tier_used_bytes", "used_bytes", "Bytes a tier holds now."),
        ("umbp_server_tier_objects", "objects", "Objects a tier holds now."),
    ):
        out.series(name, "gauge", help_text,
                   [({"tier": tier}, figures[key]) for tier, figures in tiers])
    if ssd.get("enabled"):
        out.series("umbp_server_ssd_evictions_total", "counter",
                   "Objects the SSD tier evicted for room (gone from the node).",
                   [({}, ssd.get("evictions", 0))])


def _latency_series(out: _Text, times: dict[int, tuple[list[int], float]]) -> None:
    name = "umbp_server_request_seconds"
    out.family(name, "histogram", "Seconds from a request read to its answer sent, per op.")
    for op, (counts, total) in sorted(times.items()):
        labels = {"op": protocol.OP_NAMES.get(op, str(op))}
        cumulative = 0
        for bound, count in zip(LATENCY_BUCKETS_S, counts):
            cumulative += count
            out.sample(f"{name}_bucket", {**labels, "le": _number(bound)}, cumulative)
        cumulative += counts[-1]
        out.sample(f"{name}_bucket", {**labels, "le": "+Inf"}, cumulative)
        out.sample(f"{name}_sum", labels, total)
        out.sample(f"{name}_count", labels, cumulative)


class MetricsEndpoint:
    """The HTTP listener of `--metrics-port`, on a thread of its own."""

    def __init__(self, host: str, port: int, scrape: Callable[[], str]) -> None:
        handler = _handler_for(scrape)
        self._server = http.server.ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name="umbp-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler_for(scrape: Callable[[], str]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "umbp serve answers GET /metrics only")
                return
            try:
                body = scrape().encode()
            except Exception:  # a scrape must never take the server down
                logger.exception("umbp serve: a metrics scrape failed")
                self.send_error(500, "the scrape failed; see the server's log")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # scrapes every few seconds would flood the server's log

    return Handler


def _shown(row: dict[str, Any]) -> str:
    return str(row["namespace"]) or OTHER_LABEL


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
