"""What the server needs of its cold (SSD) tier, and how it opens one.

The server is written against this Protocol rather than a class so that it runs, and is
tested, with DRAM only, and so that the SSD tier's internals stay its own business.
The tier must be thread-safe: the server calls it from several connection threads,
never under its own index lock. Lookups are answered from the server's mirror of the
tier's keys (`keys()` at open, then `put`, `take_evicted_keys` and failed reads), so the
tier's own `lookup` is used only where an exact answer matters (before demoting).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from umbp.runtime.contract import LoadStatus

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ColdTier", "open_cold_tier"]


class ColdTier(Protocol):
    def put_pieces(self, key: str, pieces: Sequence[Buffer], checksum: int | None = None) -> bool:
        """Store under `key` the object whose bytes `pieces` hold in order (a DRAM object's
        pages, written from where they lie; `checksum`: its xxh3-64, which the server has
        verified, so that the tier need not hash it again), evicting the tier's own LRU
        objects for room; False when it cannot (too large, disk full, I/O error)."""
        ...

    def read_pieces_into(self, key: str, pieces: Sequence[Buffer]) -> tuple[LoadStatus, int]:
        """Read the object into `pieces` (its bytes in order: a promotion's DRAM pages,
        which need not be contiguous). HIT, MISSING, CORRUPT (the object was dropped),
        SIZE_MISMATCH or UNAVAILABLE; with HIT the xxh3-64 the bytes in the pieces were
        verified to have (so the server need not hash them again)."""
        ...

    def held(self, key: str) -> AbstractContextManager[bool]:
        """Keep the object from being evicted while the block runs (whether it is
        resident): room made for its promotion must not push it out of the tier."""
        ...

    def size_of(self, key: str) -> int | None:
        ...

    def remove(self, key: str) -> bool:
        ...

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        ...

    def keys(self) -> Iterable[str]:
        ...

    def sizes(self) -> Iterable[tuple[str, int]]:
        """(key, payload bytes) of every resident object."""
        ...

    def take_evicted_keys(self) -> Iterable[str]:
        """Keys the tier evicted or dropped since the last call (not resident now)."""
        ...

    def stats(self) -> Any:
        ...

    def clear(self) -> Any:
        ...

    def close(self) -> None:
        ...


def open_cold_tier(directory: str, capacity_bytes: int) -> ColdTier:
    """The SSD tier in `directory` (created if missing), rebuilt from what a previous
    server left there."""
    from umbp.runtime.ssd.tier import SsdTier  # only servers with an SSD tier need it

    tier: ColdTier = SsdTier(directory, capacity_bytes)
    return tier


def stats_dict(stats: Any) -> dict[str, Any]:
    """The cold tier's stats as a JSON-able dict, whatever shape it reports them in
    (a dataclass, a mapping, or an object with attributes)."""
    if isinstance(stats, Mapping):
        return {str(name): value for name, value in stats.items()}
    fields = getattr(stats, "__dataclass_fields__", None)
    if fields is not None:
        return {name: getattr(stats, name) for name in fields}
    return {
        name: getattr(stats, name)
        for name in dir(stats)
        if not name.startswith("_") and isinstance(getattr(stats, name), (int, float, str))
    }
