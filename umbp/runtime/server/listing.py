"""`umbp ls`, `umbp clear` and `umbp limits`: the server's answers as readable text.

A row of the listing (`ServerStore.namespaces()`, `umbp ls --json`):
* "namespace" (`""`: objects whose keys are not umbp's, shown `(other)`), "label" (the
  model its engine registered; null until one did), "registered_unix";
* "dram": objects, bytes (whole pages: what its quota counts); "ssd": objects, bytes
  (payload);
* "retained": objects, bytes, budget_bytes, longest_s (time left of the longest
  retention); "quota_bytes" (null: none);
* "evictions" by cause (`quota`, `share`, `lru`: `umbp.runtime.server.shares`);
* since the server started: "lookup_hits" (keys a lookup asked that either tier held),
  "lookup_hits_on_ssd" (of those, held on SSD only), "lookup_misses" (keys a lookup
  asked that neither held), "loads" (objects a client loaded), "loads_from_ssd" (of
  those, read back from SSD for that load), "puts", "bytes_written", "bytes_read";
  "last_use_unix" (the last load or put; null: none since start).
"""

from __future__ import annotations

import time
from typing import Any

from umbp.runtime.server.shares import OTHER_LABEL
from umbp.runtime.server.stats import human_bytes

__all__ = ["format_drop", "format_limits", "format_namespaces"]


def format_namespaces(rows: list[dict[str, Any]], now_unix: float | None = None) -> str:
    if not rows:
        return "no namespaces: this server holds no objects and no engine registered"
    now = time.time() if now_unix is None else now_unix
    header = (f"{'namespace':<20}{'dram':>18}{'ssd':>18}{'retained (budget)':>28}"
              f"{'quota':>11}{'hits':>9}{'misses':>9}  last use")
    lines = [header]
    for row in rows:
        retained = row["retained"]
        kept = (f"{retained['objects']} / {human_bytes(retained['bytes'])} "
                f"({human_bytes(retained['budget_bytes'])})")
        quota = "-" if row["quota_bytes"] is None else human_bytes(row["quota_bytes"])
        last = row["last_use_unix"]
        lines.append(
            f"{row['namespace'] or OTHER_LABEL:<20}{_tier(row['dram']):>18}{_tier(row['ssd']):>18}"
            f"{kept:>28}{quota:>11}{row['lookup_hits']:>9}{row['lookup_misses']:>9}  "
            f"{'never' if last is None else _ago(now - last)}"
        )
        lines.append(f"  {row['label'] or '(no engine has registered this namespace)'}")
    return "\n".join(lines)


def format_drop(answer: dict[str, Any]) -> str:
    namespace = answer["namespace"]
    what = "every namespace" if namespace is None else f"namespace {namespace}"
    text = (f"dropped {answer['objects']} objects of {what} "
            f"({answer['dram']} from DRAM, {answer['ssd']} from SSD)")
    if answer["in_use"]:
        text += (f"; {answer['in_use']} in use (being read or moved between tiers) were left "
                 "in place: run it again once they are not")
    return text


def format_limits(answer: dict[str, Any]) -> str:
    quota = answer["quota_bytes"]
    text = (f"namespace {answer['namespace']}: quota "
            f"{'none' if quota is None else human_bytes(quota)}, retention budget "
            f"{human_bytes(answer['retain_budget_bytes'])}")
    if answer["released"]:
        text += f"; {answer['released']} retained objects released to fit the budget"
    return text


def _tier(figures: dict[str, int]) -> str:
    return f"{figures['objects']} / {human_bytes(figures['bytes'])}"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{max(0.0, seconds):.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"
