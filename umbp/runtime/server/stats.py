"""`umbp stats`: a server's figures as a readable table.

The stats dict (`ServerStore.server_stats()`, `umbp stats --json`) has these parts:
* "objects": distinct objects resident in either tier; "pid": the server's process id;
* "dram": capacity_bytes, used_bytes, resident_bytes (pages of resident objects: with
  nothing in flight it equals used_bytes), page_bytes, objects, pinned_objects (held by
  gets in flight, and for a moment by the server's own copies to SSD: demotion, write
  ahead), retired_pinned_objects, high_watermark_bytes, low_watermark_bytes;
* "ssd": enabled, and when enabled whatever the SSD tier reports (capacity, usage,
  objects, its own counters, dropped_at_open);
* "sessions": connections (other than the one asking), reservations (puts in flight),
  pins (gets in flight);
* "counters" (since the server started): hits (loads that found their object, all
  tiers), hits_from_ssd (of those, the objects promoted from SSD for that get), misses
  (loads that found nothing: what every store's `PoolStats` counts; a namespace's
  lookups are counted in the listing, `umbp ls`), puts, put_rejects, corrupt_loads,
  evictions_to_ssd, evictions_dropped, written_ahead (objects copied to SSD before their
  eviction, `write_ahead`), ssd_put_failures, promotions, prefetched (of the
  promotions, those made ahead of their load), and with an SSD tier prefetch_queued_bytes,
  prefetch_skipped, prefetch_cancelled, prefetch_claimed (`prefetch`), bytes_written,
  bytes_read, bytes_to_ssd, bytes_from_ssd, connections (accepted in all);
* "server": server_id, pid, shm_path, shm_bytes, page_bytes, ssd_dir;
* "limits": max_connections, frame_timeout_s, refused_connections, body_limits.
"""

from __future__ import annotations

from typing import Any

__all__ = ["format_stats", "human_bytes"]

_TIER_ROWS = (
    ("capacity", "capacity_bytes", True),
    ("used", "used_bytes", True),
    ("objects", "objects", False),
)
_COUNTER_ROWS = (
    ("loads that hit", "hits", False),
    ("  of them from SSD", "hits_from_ssd", False),
    ("loads that missed", "misses", False),
    ("puts", "puts", False),
    ("put rejects", "put_rejects", False),
    ("corrupt loads (dropped)", "corrupt_loads", False),
    ("evictions to SSD", "evictions_to_ssd", False),
    ("evictions dropped", "evictions_dropped", False),
    ("written ahead to SSD", "written_ahead", False),
    ("SSD write failures", "ssd_put_failures", False),
    ("promotions from SSD", "promotions", False),
    ("  of them prefetched", "prefetched", False),
    ("bytes written", "bytes_written", True),
    ("bytes read", "bytes_read", True),
    ("bytes to SSD", "bytes_to_ssd", True),
    ("bytes from SSD", "bytes_from_ssd", True),
)


def format_stats(stats: dict[str, Any]) -> str:
    dram, ssd = stats.get("dram", {}), stats.get("ssd", {})
    server = stats.get("server", {})
    lines = [f"umbp server pid {server.get('pid', '?')}, pool {server.get('shm_path', '?')}"]
    lines.append(f"objects resident (either tier): {stats.get('objects', '?')}")
    lines.append(f"{'tier':<26}{'DRAM':>16}{'SSD':>16}")
    for label, name, is_bytes in _TIER_ROWS:
        ssd_value = _cell(ssd.get(name), is_bytes) if ssd.get("enabled") else "off"
        lines.append(f"{label:<26}{_cell(dram.get(name), is_bytes):>16}{ssd_value:>16}")
    if dram.get("capacity_bytes"):
        share = 100.0 * dram.get("used_bytes", 0) / dram["capacity_bytes"]
        lines.append(f"{'DRAM used':<26}{share:>15.1f}%")
    counters = stats.get("counters", {})
    lines.append("")
    for label, name, is_bytes in _COUNTER_ROWS:
        lines.append(f"{label:<26}{_cell(counters.get(name), is_bytes):>16}")
    if ssd.get("enabled"):
        # The SSD tier's own LRU evictions: objects that left the node for good.
        lines.append(f"{'evictions from SSD':<26}{_cell(ssd.get('evictions'), False):>16}")
        lines.append(f"{'lost at SSD open':<26}{_cell(ssd.get('dropped_at_open'), False):>16}")
    sessions = stats.get("sessions", {})
    lines.append(
        f"{'other connections now':<26}{sessions.get('connections', 0):>16}"
        f"  (puts in flight {sessions.get('reservations', 0)}, "
        f"gets in flight {sessions.get('pins', 0)})"
    )
    return "\n".join(lines)


def _cell(value: Any, is_bytes: bool) -> str:
    if value is None:
        return "-"
    if is_bytes and isinstance(value, int):
        return human_bytes(value)
    return str(value)


def human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"
