"""What operators ask of `umbp serve` per namespace: the listing (`umbp ls`), and the
checks of their requests (limits, retention) that must pass before anything changes.

Every function here reads the index and the SSD mirror under the server's index lock
(the caller holds it) and changes nothing; `StoreCore` applies what they allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Final

from umbp.runtime.server.index import Entry, PoolIndex
from umbp.runtime.server.namespaces import ColdKeys, NamespaceBook, NamespaceCounters
from umbp.runtime.server.sessions import RequestRefused
from umbp.runtime.server.shares import OTHER_LABEL

__all__ = [
    "DEFAULT_MAX_RETAIN_S",
    "check_retention",
    "checked_limits",
    "known_namespaces",
    "namespace_listing",
    "require_known",
]

DEFAULT_MAX_RETAIN_S: Final = 24 * 3600.0
"""The longest retention a request may ask for unless `umbp serve --max-retain` says."""



def known_namespaces(index: PoolIndex, cold: ColdKeys, book: NamespaceBook) -> set[str]:
    """Namespaces with objects in either tier, a registration, counters or limits."""
    in_dram = {name for name in index.namespaces() if _usage_pages(index, name)}
    return (in_dram | set(cold.namespaces()) | set(book.registrations) | set(book.counters)
            | set(index.quota_pages) | set(index.budget_pages))


def require_known(namespace: str, index: PoolIndex, cold: ColdKeys, book: NamespaceBook) -> None:
    known = known_namespaces(index, cold, book)
    if namespace not in known:
        names = ", ".join(sorted(_shown(name) for name in known)) or "none"
        raise RequestRefused(f"unknown namespace {namespace!r}: this server knows {names} "
                             "(see `umbp ls`)")


def checked_limits(
    index: PoolIndex, namespace: str, quota_bytes: int | None, budget_bytes: int | None
) -> tuple[int | None, int | None]:
    """(quota pages, budget pages) for the requested bytes, or `RequestRefused` naming
    the limit broken: a quota of less than a page or over the DRAM tier's high
    watermark, a budget over the quota or over what every namespace may retain
    together. Sizes round down to whole pages."""
    page = index.page_bytes
    high_bytes = index.high_pages * page
    quota_pages = None if quota_bytes is None else quota_bytes // page
    if quota_pages is not None and not 1 <= quota_pages <= index.high_pages:
        raise RequestRefused(
            f"quota {quota_bytes} bytes for namespace {_shown(namespace)} is outside one page "
            f"({page} bytes) .. the DRAM tier's high watermark ({high_bytes} bytes)"
        )
    budget_pages = None if budget_bytes is None else budget_bytes // page
    if budget_pages is not None:
        cap = index.retained_cap_pages
        if budget_pages > cap:
            raise RequestRefused(
                f"retention budget {budget_bytes} bytes for namespace {_shown(namespace)} is "
                f"over what all namespaces may retain together ({cap * page} bytes, half the "
                "low watermark)"
            )
        if quota_pages is not None and budget_pages > quota_pages:
            raise RequestRefused(
                f"retention budget {budget_bytes} bytes for namespace {_shown(namespace)} is "
                f"over its quota ({quota_pages * page} bytes)"
            )
    return quota_pages, budget_pages


def check_retention(index: PoolIndex, entries: Sequence[Entry]) -> None:
    """`RequestRefused` naming the limit when retaining `entries` (resident, not
    leaving) would take a namespace past its retention budget, or everything retained
    past half the low watermark."""
    page = index.page_bytes
    new_pages: dict[str, int] = {}
    for entry in entries:
        if not entry.retained_until:
            new_pages[entry.namespace] = new_pages.get(entry.namespace, 0) + len(entry.pages)
    for name, pages in new_pages.items():
        usage = index.usage(name)
        held = 0 if usage is None else usage.retained_pages
        budget = index.budget_of(name)
        if held + pages > budget:
            raise RequestRefused(
                f"retaining {pages * page} more bytes of namespace {_shown(name)} would pass "
                f"its retention budget of {budget * page} bytes ({held * page} retained); "
                "retain fewer blocks, or raise the budget: umbp limits --retain-budget"
            )
    total = sum(new_pages.values())
    if index.retained_pages + total > index.retained_cap_pages:
        raise RequestRefused(
            f"retaining {total * page} more bytes would pass what all namespaces may retain "
            f"together ({index.retained_cap_pages * page} bytes, half the low watermark; "
            f"{index.retained_pages * page} retained)"
        )


def namespace_listing(
    index: PoolIndex, cold: ColdKeys, book: NamespaceBook, now: float
) -> list[dict[str, Any]]:
    """One row per known namespace, most recently used first (see `umbp.runtime.server.stats`
    for the fields). `now`: monotonic seconds, for the retentions' time left."""
    page = index.page_bytes
    rows = []
    for name in known_namespaces(index, cold, book):
        usage = index.usage(name)
        counters = book.counters.get(name)
        registration = book.registrations.get(name)
        ssd_objects, ssd_bytes = cold.census(name)
        quota = index.quota_pages.get(name)
        longest = index.longest_retention(name)
        rows.append({
            "namespace": name,
            "label": None if registration is None else registration.label,
            "registered_unix": None if registration is None else registration.registered_unix,
            "dram": {
                "objects": 0 if usage is None else usage.objects,
                "bytes": 0 if usage is None else usage.pages * page,
            },
            "ssd": {"objects": ssd_objects, "bytes": ssd_bytes},
            "retained": {
                "objects": 0 if usage is None else usage.retained_objects,
                "bytes": 0 if usage is None else usage.retained_pages * page,
                "budget_bytes": index.budget_of(name) * page,
                "longest_s": max(0.0, longest - now) if longest else 0.0,
            },
            "quota_bytes": None if quota is None else quota * page,
            "evictions": {} if usage is None else {
                str(cause): count for cause, count in usage.evictions.items()
            },
            **_counter_fields(counters),
        })
    rows.sort(key=_last_use, reverse=True)
    return rows


def _counter_fields(counters: NamespaceCounters | None) -> dict[str, Any]:
    """A namespace's counters as listing fields (all zero for one never counted)."""
    figures = asdict(NamespaceCounters() if counters is None else counters)
    figures["last_use_unix"] = figures["last_use_unix"] or None
    return figures


def _last_use(row: dict[str, Any]) -> float:
    last: float | None = row["last_use_unix"]
    return 0.0 if last is None else last


def _usage_pages(index: PoolIndex, name: str) -> int:
    usage = index.usage(name)
    return 0 if usage is None else usage.objects


def _shown(namespace: str) -> str:
    return repr(namespace) if namespace else OTHER_LABEL
