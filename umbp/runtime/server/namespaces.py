"""What `umbp serve` knows per namespace, for operators: the model each came from, its
use, and its objects on the SSD tier (DRAM's are the index's: `shares`).

An engine registers a readable label with its namespace when it connects (the model as
the operator named it, dtype, parallel layout), so that `umbp ls` can say which model a
fingerprint belongs to. Counters and the time of last use (a load or a put) are kept per
namespace: a lookup's keys found (hits, by tier) and not found (misses), so that hits /
(hits + misses) is the share of asked keys the server held; objects loaded and written,
and their bytes. The SSD tier's objects are counted per namespace in `ColdKeys`, the
server's mirror of the tier's keys.

Mutated under the server's index lock only (not thread-safe by themselves).
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass

from umbp.core.identity import KEY_HEAD, namespace_key_prefix, namespace_of_key
from umbp.runtime.server.protocol import WHERE_CPU, WHERE_DISK, WHERE_NONE
from umbp.runtime.server.shares import OTHER_NAMESPACE

__all__ = [
    "ColdKeys",
    "NamespaceBook",
    "NamespaceCounters",
    "Registration",
    "namespace_of",
    "shared_namespace",
]


def namespace_of(key: str) -> str:
    """The namespace a key is charged to (`OTHER_NAMESPACE` for keys not umbp's)."""
    namespace = namespace_of_key(key)
    return OTHER_NAMESPACE if namespace is None else namespace


def shared_namespace(keys: Sequence[str]) -> str | None:
    """The namespace every key is charged to when it is one and the same (a lookup of one
    engine's prompt, or of keys none of which is umbp's: checked at C speed), else None."""
    if not keys:
        return None
    first = namespace_of_key(keys[0])
    if first is None:
        umbp_keys = any(map(str.startswith, keys, itertools.repeat(KEY_HEAD)))
        return None if umbp_keys else OTHER_NAMESPACE
    prefix = namespace_key_prefix(first)
    return first if all(map(str.startswith, keys, itertools.repeat(prefix))) else None


@dataclass(frozen=True, slots=True)
class Registration:
    label: str
    registered_unix: float


@dataclass(slots=True)
class NamespaceCounters:
    lookup_hits: int = 0
    """Keys a lookup asked that either tier held."""
    lookup_hits_on_ssd: int = 0
    """Of those, the keys held on the SSD tier only."""
    lookup_misses: int = 0
    """Keys a lookup asked that neither tier held."""
    loads: int = 0
    """Objects a client loaded (read out of DRAM and verified)."""
    loads_from_ssd: int = 0
    """Of those, the objects read back from the SSD tier for that load."""
    puts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    last_use_unix: float = 0.0
    """Wall-clock time of the last load or put; 0.0: never used since the server started."""


class NamespaceBook:
    """Labels and counters per namespace."""

    def __init__(self) -> None:
        self.registrations: dict[str, Registration] = {}
        self.counters: dict[str, NamespaceCounters] = {}

    def register(self, namespace: str, label: str, now_unix: float) -> None:
        """The latest label wins (an engine restarted with other settings)."""
        self.registrations[namespace] = Registration(label, now_unix)

    def of(self, namespace: str) -> NamespaceCounters:
        counters = self.counters.get(namespace)
        if counters is None:
            counters = self.counters[namespace] = NamespaceCounters()
        return counters

    def looked_up(self, keys: Sequence[str], codes: bytes, namespace: str | None) -> None:
        """Count a lookup's answers (`WHERE_*` codes, one per key); `namespace`: every
        key's, when `shared_namespace` found one (then counted at C speed)."""
        if namespace is not None:
            self._tally(namespace, codes.count(WHERE_CPU), codes.count(WHERE_DISK),
                        codes.count(WHERE_NONE))
            return
        for key, code in zip(keys, codes):
            self._tally(namespace_of(key), code == WHERE_CPU, code == WHERE_DISK,
                        code == WHERE_NONE)

    def _tally(self, namespace: str, in_dram: int, on_ssd: int, missing: int) -> None:
        counters = self.of(namespace)
        counters.lookup_hits += in_dram + on_ssd
        counters.lookup_hits_on_ssd += on_ssd
        counters.lookup_misses += missing

    def load(self, namespace: str, nbytes: int, from_ssd: bool, now_unix: float) -> None:
        counters = self.of(namespace)
        counters.loads += 1
        counters.loads_from_ssd += from_ssd
        counters.bytes_read += nbytes
        counters.last_use_unix = now_unix

    def put(self, namespace: str, nbytes: int, now_unix: float) -> None:
        counters = self.of(namespace)
        counters.puts += 1
        counters.bytes_written += nbytes
        counters.last_use_unix = now_unix


class ColdKeys:
    """The SSD tier's keys as the server mirrors them (see `tiering`), with each
    object's size, how many objects and bytes each namespace has there, and how many
    of them DRAM holds too (the tiers are inclusive): kept as keys come and go on either
    tier (`dram_gained`, `dram_lost`, called by the DRAM index), never counted."""

    def __init__(
        self, sized: Iterable[tuple[str, int]] = (), dram: Container[str] = frozenset()
    ) -> None:
        self._sizes: dict[str, int] = {}
        self._census: dict[str, list[int]] = {}  # namespace -> [objects, bytes]
        self._dram = dram
        self.in_dram = 0
        """Keys held by DRAM too."""
        for key, nbytes in sized:
            self.add(key, nbytes)

    def track(self, dram: Container[str]) -> None:
        """Count the keys `dram` holds from now on (a mirror built without the index
        lock, then installed under it: one pass over the keys)."""
        self._dram = dram
        self.in_dram = sum(1 for key in self._sizes if key in dram)

    def dram_gained(self, key: str) -> None:
        if key in self._sizes:
            self.in_dram += 1

    def dram_lost(self, key: str) -> None:
        if key in self._sizes:
            self.in_dram -= 1

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sizes)

    def add(self, key: str, nbytes: int) -> None:
        if key in self._sizes:
            return
        self._sizes[key] = nbytes
        self.in_dram += key in self._dram
        census = self._census.setdefault(namespace_of(key), [0, 0])
        census[0] += 1
        census[1] += nbytes

    def discard(self, key: str) -> None:
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:
            return
        self.in_dram -= key in self._dram
        census = self._census[namespace_of(key)]
        census[0] -= 1
        census[1] -= nbytes

    def difference_update(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.discard(key)

    def clear(self) -> None:
        self._sizes.clear()
        self._census.clear()
        self.in_dram = 0

    def size_of(self, key: str) -> int | None:
        return self._sizes.get(key)

    def census(self, namespace: str) -> tuple[int, int]:
        """(objects, payload bytes) of the namespace on the SSD tier."""
        objects, nbytes = self._census.get(namespace, (0, 0))
        return objects, nbytes

    def namespaces(self) -> tuple[str, ...]:
        return tuple(name for name, (objects, _) in self._census.items() if objects)

    def keys_of(self, namespace: str | None) -> tuple[str, ...]:
        """The namespace's keys (every key for None)."""
        if namespace is None:
            return tuple(self._sizes)
        return tuple(key for key in self._sizes if namespace_of(key) == namespace)
