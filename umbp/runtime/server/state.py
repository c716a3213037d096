"""What the server does, without the socket: residency, reservations, pins, tiering.

One index lock guards the DRAM index, the sessions' bookkeeping and the counters. It is
never held during cold-tier I/O: demotion victims and promotion targets are pinned (or
reserved) under the lock, moved without it, and settled under it again. Clients copy KV
bytes into and out of the shared pool themselves; the server copies only when it moves
objects between DRAM and SSD.

Tiers are inclusive: an object promoted from SSD keeps its SSD copy, so demoting it again
costs no write (the SSD tier evicts its own LRU objects when it needs room). A lookup
answers True for an object in either tier; `where` prefers CPU.

Lookups never wait for the disk: the SSD tier holds its own lock during its I/O, so the
server keeps a mirror of the SSD tier's key set under the index lock, updated on every
demotion, promotion failure and clear, and pruned with the keys the SSD tier reports as
evicted after each write. The mirror may briefly still name a key the SSD tier has just
evicted: that lookup says True and the get that follows answers MISSING, a miss, never
wrong bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from umbp.runtime.contract import LoadStatus
from umbp.runtime.paged_copy import write_regions
from umbp.runtime.server import protocol
from umbp.runtime.server.cold import ColdTier, stats_dict
from umbp.runtime.server.index import Entry, PoolIndex, Regions, pages_for

__all__ = ["MAX_BATCHES_IN_FLIGHT", "RequestRefused", "Session", "StoreCore"]

logger = logging.getLogger("umbp.serve")


@dataclass(frozen=True, slots=True)
class _Reserved:
    """Pages handed to a client for one key of a put, not yet visible to lookups."""

    key: str
    regions: Regions
    nbytes: int


@dataclass(slots=True)
class _Get:
    """The pins of one BEGIN_GET, by request position, until its END_GET."""

    pinned: list[Entry | None]
    from_ssd: set[int] = field(default_factory=set)
    """Positions promoted from the SSD tier by this get (their hits are SSD hits)."""


MAX_BATCHES_IN_FLIGHT = 256
"""Puts not yet committed plus gets not yet ended, per connection. The client has one in
flight at a time; a peer that opens batches without closing them is refused more."""


class RequestRefused(ValueError):
    """A well-formed request that does not fit this connection's state (unknown token,
    wrong count); nothing was changed."""


@dataclass(slots=True)
class Session:
    """One client connection's reservations and pins, released when it drops."""

    reservations: dict[int, list[_Reserved]] = field(default_factory=dict)
    gets: dict[int, _Get] = field(default_factory=dict)
    tokens: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def require_room(self) -> None:
        if len(self.reservations) + len(self.gets) >= MAX_BATCHES_IN_FLIGHT:
            raise RequestRefused(
                f"{MAX_BATCHES_IN_FLIGHT} batches already in flight on this connection; "
                "commit or end them first"
            )


@dataclass(slots=True)
class _Counters:
    """Monotonic counters; mutated only under the index lock."""

    hits: int = 0
    hits_from_ssd: int = 0
    misses: int = 0
    puts: int = 0
    put_rejects: int = 0
    corrupt_loads: int = 0
    evictions_to_ssd: int = 0
    evictions_dropped: int = 0
    ssd_put_failures: int = 0
    promotions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_to_ssd: int = 0
    bytes_from_ssd: int = 0
    connections: int = 0


GetAnswer = str | tuple[int, int, Regions]


class StoreCore:
    """The server's state over one shared pool `view`; thread-safe."""

    def __init__(self, view: memoryview, index: PoolIndex, cold: ColdTier | None) -> None:
        self._view = view
        self._index = index
        self._cold = cold
        self._cold_keys: set[str] = set(cold.keys()) if cold is not None else set()
        self._lock = threading.Lock()
        self._counters = _Counters()
        self._sessions: list[Session] = []
        # Bumped by clear: a demotion or promotion that straddles a clear must not bring
        # back what the clear dropped.
        self._generation = 0

    # ------------------------------------------------------------------ sessions

    def open_session(self) -> Session:
        session = Session()
        with self._lock:
            self._sessions.append(session)
            self._counters.connections += 1
        return session

    def close_session(self, session: Session) -> None:
        """Release everything a dropped connection held: reservations and pins."""
        with self._lock:
            for reserved in session.reservations.values():
                for item in reserved:
                    self._index.release(item.regions)
            for get in session.gets.values():
                self._unpin_all_locked(get)
            session.reservations.clear()
            session.gets.clear()
            self._sessions.remove(session)

    def _unpin_all_locked(self, get: _Get) -> None:
        for entry in get.pinned:
            if entry is not None:
                self._index.unpin(entry)

    # ----------------------------------------------------------------- residency

    def lookup(self, keys: Sequence[str]) -> bytes:
        codes = self.where(keys)
        return codes.translate(_RESIDENT)

    def where(self, keys: Sequence[str]) -> bytes:
        with self._lock:
            index = self._index
            codes = bytearray(
                protocol.WHERE_CPU if key in index else protocol.WHERE_NONE for key in keys
            )
            cold_keys = self._cold_keys
            if cold_keys:
                for position, code in enumerate(codes):
                    if not code and keys[position] in cold_keys:
                        codes[position] = protocol.WHERE_DISK
        return bytes(codes)

    # ----------------------------------------------------------------------- put

    def begin_put(
        self, session: Session, keys: Sequence[str], sizes: Sequence[int]
    ) -> tuple[int, list[bool | Regions]]:
        _require_same_length(keys, sizes)
        answers: list[bool | Regions] = [False] * len(keys)
        wanted: list[int] = []
        with self._lock:
            session.require_room()
            index = self._index
            cold_keys = self._cold_keys
            for position, (key, size) in enumerate(zip(keys, sizes)):
                entry = index.get(key)
                if entry is not None:
                    index.touch(entry)
                    answers[position] = True
                elif key in cold_keys:
                    answers[position] = True
                elif size < 0 or not index.fits(pages_for(size, index.page_bytes)):
                    self._counters.put_rejects += 1
                else:
                    wanted.append(position)
        reserved = self._reserve([sizes[position] for position in wanted])
        token = next(session.tokens)
        items: list[_Reserved] = []
        with self._lock, self._released_on_error(reserved):
            for position, regions in zip(wanted, reserved):
                if regions is None:
                    self._counters.put_rejects += 1
                    continue
                items.append(_Reserved(keys[position], regions, sizes[position]))
                answers[position] = regions
            if items:  # nothing reserved: nothing to commit, no token to remember
                session.reservations[token] = items
        return token, answers

    @contextlib.contextmanager
    def _released_on_error(self, reserved: list[Regions | None]) -> Iterator[None]:
        """Under the lock: pages reserved for a batch come back if registering it fails,
        so that a put either holds its reservation in the session or holds nothing."""
        try:
            yield
        except BaseException:
            for regions in reserved:
                if regions is not None:
                    self._index.release(regions)
            raise

    def commit_put(
        self, session: Session, token: int, checksums: Sequence[int | None]
    ) -> list[bool]:
        """All or nothing: a wrong count or an unknown token changes nothing (the
        reservation stays until a correct commit or the connection drops)."""
        with self._lock:
            items = session.reservations.get(token)
            if items is None:
                if checksums:
                    raise RequestRefused(f"no put in flight with token {token} on this connection")
                return []  # a put that reserved nothing
            if len(checksums) != len(items):
                raise RequestRefused(f"{len(checksums)} checksums for {len(items)} reserved keys")
            del session.reservations[token]
            return [self._commit_one(item, checksum) for item, checksum in zip(items, checksums)]

    def _commit_one(self, item: _Reserved, checksum: int | None) -> bool:
        index = self._index
        if checksum is None:
            index.release(item.regions)
            return False
        if item.key in index:
            index.release(item.regions)  # another client stored it meanwhile
            return True
        index.insert(item.key, item.regions, item.nbytes, checksum)
        self._counters.puts += 1
        self._counters.bytes_written += item.nbytes
        return True

    # ----------------------------------------------------------------------- get

    def begin_get(
        self, session: Session, keys: Sequence[str], sizes: Sequence[int]
    ) -> tuple[int, list[GetAnswer]]:
        _require_same_length(keys, sizes)
        answers: list[GetAnswer] = [protocol.GET_MISSING] * len(keys)
        pinned: list[Entry | None] = [None] * len(keys)
        cold_positions: list[int] = []
        with self._lock:
            session.require_room()
            index = self._index
            for position, key in enumerate(keys):
                entry = index.get(key)
                if entry is None:
                    if self._cold is None:
                        self._counters.misses += 1
                    else:
                        cold_positions.append(position)
                elif entry.nbytes != sizes[position]:
                    answers[position] = protocol.GET_SIZE_MISMATCH
                else:
                    index.pin(entry)
                    index.touch(entry)
                    pinned[position] = entry
                    answers[position] = (entry.nbytes, entry.checksum, entry.regions)
            token = next(session.tokens)
            get = session.gets[token] = _Get(pinned)
        if cold_positions:
            try:
                self._promote(session, token, keys, sizes, cold_positions, answers)
            except BaseException:  # the client never learns the token: take its pins back
                with self._lock:
                    if session.gets.pop(token, None) is get:
                        self._unpin_all_locked(get)
                raise
        return token, answers

    def end_get(self, session: Session, token: int, corrupt: Sequence[int]) -> None:
        """Unpin a get's objects, dropping those the client found corrupt. An unknown
        token or a position outside the get changes nothing."""
        corrupt_positions = set(corrupt)
        with self._lock:
            get = session.gets.get(token)
            if get is None:
                raise RequestRefused(f"no get in flight with token {token} on this connection")
            outside = [p for p in corrupt_positions if not 0 <= p < len(get.pinned)]
            if outside:
                raise RequestRefused(
                    f"corrupt positions {sorted(outside)[:5]} are outside a get of "
                    f"{len(get.pinned)} keys"
                )
            del session.gets[token]
            counters = self._counters
            for position, entry in enumerate(get.pinned):
                if entry is None:
                    continue
                if position in corrupt_positions:
                    self._index.retire(entry)
                    counters.corrupt_loads += 1
                else:
                    counters.hits += 1
                    counters.bytes_read += entry.nbytes
                    if position in get.from_ssd:
                        counters.hits_from_ssd += 1
                self._index.unpin(entry)

    # --------------------------------------------------------------------- misc

    def clear(self) -> bool:
        with self._lock:
            self._index.clear()
            self._generation += 1
        if self._cold is not None:
            self._cold.clear()
            with self._lock:
                self._cold_keys.clear()
        return True

    def stats(self, asking: Session | None = None) -> dict[str, Any]:
        """The figures; `asking` (the connection that asks) is not counted among the
        connections: `umbp stats` should not see itself."""
        with self._lock:
            index = self._index
            page_bytes = index.page_bytes
            dram = {
                "capacity_bytes": index.total_pages * page_bytes,
                "used_bytes": index.used_pages * page_bytes,
                "resident_bytes": sum(len(entry.pages) for entry in index.entries())
                * page_bytes,
                "page_bytes": page_bytes,
                "objects": len(index),
                "pinned_objects": sum(1 for entry in index.entries() if entry.pins),
                "retired_pinned_objects": index.pinned_retired,
                "high_watermark_bytes": index.high_pages * page_bytes,
                "low_watermark_bytes": index.low_pages * page_bytes,
            }
            others = [s for s in self._sessions if s is not asking]
            sessions = {
                "connections": len(others),
                "reservations": sum(
                    len(items) for s in self._sessions for items in s.reservations.values()
                ),
                "pins": sum(
                    1
                    for s in self._sessions
                    for get in s.gets.values()
                    for entry in get.pinned
                    if entry is not None
                ),
            }
            counters = asdict(self._counters)
            objects = len(index) + sum(1 for key in self._cold_keys if key not in index)
        ssd = {"enabled": False}
        if self._cold is not None:
            ssd = {"enabled": True} | stats_dict(self._cold.stats())
        return {
            "objects": objects,
            "dram": dram,
            "ssd": ssd,
            "sessions": sessions,
            "counters": counters,
        }

    def persist_to_cold(self) -> int:
        """Copy every DRAM object the cold tier lacks into it, least recently used first
        (so that, should the cold tier run out of room, it keeps the most recent ones).
        For shutdown: the next server at the same SSD directory then serves them. Returns
        how many objects were written."""
        cold = self._cold
        if cold is None:
            return 0
        with self._lock:
            entries = [entry for entry in self._index.entries() if not entry.leaving]
            for entry in entries:
                self._index.pin(entry)
        written = 0
        try:
            present = cold.lookup([entry.key for entry in entries])
            for entry, there in zip(entries, present):
                if not there and self._demote_one(cold, entry) == "demoted":
                    written += 1
        finally:
            on_disk = tuple(cold.keys())
            with self._lock:
                for entry in entries:
                    self._index.unpin(entry)
                self._cold_keys = set(on_disk)
        return written

    # ---------------------------------------------------------- room and tiers

    def _reserve(self, sizes: Sequence[int]) -> list[Regions | None]:
        """Pages for each size (None where they ran out), making room first when the
        batch would cross the high watermark: LRU objects are dropped (DRAM only) or
        demoted to the cold tier, the latter without the index lock."""
        if not sizes:
            return []
        needed = sum(pages_for(size, self._index.page_bytes) for size in sizes)
        with self._lock:
            victims = self._choose_victims_locked(needed)
            if not victims:
                return [self._index.reserve(size) for size in sizes]
        self._demote(victims)
        with self._lock:
            return [self._index.reserve(size) for size in sizes]

    def _choose_victims_locked(self, pages_needed: int) -> list[Entry]:
        index = self._index
        if not index.needs_room(pages_needed):
            return []
        victims = index.choose_victims(pages_needed)
        if self._cold is not None:
            return victims
        for victim in victims:
            index.finish_leaving(victim)
            self._counters.evictions_dropped += 1
        return []

    def _demote(self, victims: list[Entry]) -> None:
        """Copy each victim to the cold tier (unless it is there already), then retire it
        from DRAM. A victim whose DRAM bytes fail their checksum is dropped, not demoted:
        the cold tier would checksum the damage and later serve it as good."""
        cold = self._cold
        assert cold is not None
        generation = self._generation
        outcomes: list[str] = []
        try:
            already: Sequence[bool] = cold.lookup([victim.key for victim in victims])
        except Exception:  # then each victim is written (a put of a resident key is free)
            logger.exception("umbp serve: the SSD tier's lookup failed")
            already = [False] * len(victims)
        for victim, present in zip(victims, already):
            # One victim's failure costs that victim only, never the rest of the batch,
            # and never leaks its pin.
            try:
                outcomes.append("present" if present else self._demote_one(cold, victim))
            except Exception:
                logger.exception("umbp serve: demoting %r to the SSD tier failed", victim.key)
                outcomes.append("failed")
        evicted = self._evicted_from_cold(cold)
        with self._lock:
            for victim, outcome in zip(victims, outcomes):
                self._settle_victim_locked(victim, outcome)
            cleared = self._generation != generation
            self._cold_keys.difference_update(evicted)
            if cleared:
                self._cold_keys.difference_update(victim.key for victim in victims)
        if cleared:
            for victim, outcome in zip(victims, outcomes):
                if outcome == "demoted":
                    cold.remove(victim.key)

    @staticmethod
    def _evicted_from_cold(cold: ColdTier) -> tuple[str, ...]:
        try:
            return tuple(cold.take_evicted_keys())
        except Exception:  # a mirror a little stale costs a miss, never wrong bytes
            logger.exception("umbp serve: the SSD tier did not report its evictions")
            return ()

    def _demote_one(self, cold: ColdTier, victim: Entry) -> str:
        payload = self._gather(victim)
        if int(xxhash.xxh3_64_intdigest(payload)) != victim.checksum:
            return "corrupt"
        return "demoted" if cold.put(victim.key, payload) else "failed"

    def _settle_victim_locked(self, victim: Entry, outcome: str) -> None:
        counters = self._counters
        self._index.finish_leaving(victim)
        if outcome in ("present", "demoted"):
            self._cold_keys.add(victim.key)
            counters.evictions_to_ssd += 1
            if outcome == "demoted":
                counters.bytes_to_ssd += victim.nbytes
            return
        counters.evictions_dropped += 1
        if outcome == "corrupt":
            counters.corrupt_loads += 1
        else:
            counters.ssd_put_failures += 1

    def _promote(
        self,
        session: Session,
        token: int,
        keys: Sequence[str],
        sizes: Sequence[int],
        positions: list[int],
        answers: list[GetAnswer],
    ) -> None:
        """Read cold objects into fresh DRAM pages and pin them like DRAM hits."""
        cold = self._cold
        assert cold is not None
        generation = self._generation
        found: list[int] = []
        for position in positions:
            size = self._cold_size(cold, keys[position])
            if size is None:
                answers[position] = protocol.GET_MISSING
                with self._lock:
                    self._cold_keys.discard(keys[position])
            elif size != sizes[position]:
                answers[position] = protocol.GET_SIZE_MISMATCH
            else:
                found.append(position)
        loaded: list[tuple[int, Regions, int]] = []
        for position in found:
            key = keys[position]
            status, regions, checksum = self._load_cold(cold, key, sizes[position])
            if regions is not None:
                loaded.append((position, regions, checksum))
                continue
            answers[position] = _COLD_ANSWERS.get(status, protocol.GET_UNAVAILABLE)
            if status in (LoadStatus.CORRUPT, LoadStatus.MISSING):
                with self._lock:
                    self._cold_keys.discard(key)
        with self._lock:
            get = session.gets.get(token)
            for position, regions, checksum in loaded:
                entry = self._settle_promotion_locked(
                    keys[position], regions, sizes[position], checksum, generation
                )
                if entry is None or get is None:
                    answers[position] = protocol.GET_MISSING
                    continue
                self._index.pin(entry)
                get.pinned[position] = entry
                get.from_ssd.add(position)
                answers[position] = (entry.nbytes, entry.checksum, entry.regions)
            # Counted once every answer is final: a position answers MISSING until its
            # promotion settles, and a promoted object is a hit (of the SSD tier).
            for position in positions:
                if answers[position] == protocol.GET_MISSING:
                    self._counters.misses += 1
                elif answers[position] == protocol.GET_CORRUPT:
                    self._counters.corrupt_loads += 1

    def _settle_promotion_locked(
        self, key: str, regions: Regions, nbytes: int, checksum: int, generation: int
    ) -> Entry | None:
        index = self._index
        if generation != self._generation:
            index.release(regions)  # cleared while reading: the object is gone
            return None
        existing = index.get(key)
        if existing is not None:
            index.release(regions)  # promoted or stored again by another client
            return existing if existing.nbytes == nbytes else None
        self._counters.promotions += 1
        self._counters.bytes_from_ssd += nbytes
        return index.insert(key, regions, nbytes, checksum)

    @staticmethod
    def _cold_size(cold: ColdTier, key: str) -> int | None:
        try:
            return cold.size_of(key)
        except OSError:
            return None

    def _load_cold(
        self, cold: ColdTier, key: str, nbytes: int
    ) -> tuple[LoadStatus, Regions | None, int]:
        """Copy a cold object into fresh DRAM pages: (status, its regions when HIT, xxh3 of
        the bytes now in those pages). Straight into the pages when they are free without
        making room; otherwise through a staging buffer read *before* making room, since
        making room demotes other objects, and their writes may make the SSD tier evict
        this very one."""
        with self._lock:
            index = self._index
            direct = not index.needs_room(pages_for(nbytes, index.page_bytes))
            regions = index.reserve(nbytes) if direct else None
        try:
            if regions is not None and len(regions) <= 1:
                target = self._region_view(regions)
                status = cold.get_into(key, target)
                if status is LoadStatus.HIT:
                    return status, regions, int(xxhash.xxh3_64_intdigest(target))
            else:
                staging = bytearray(nbytes)
                status = cold.get_into(key, staging)
                if status is LoadStatus.HIT:
                    if regions is None:
                        regions = self._reserve([nbytes])[0]
                    if regions is None:
                        return LoadStatus.UNAVAILABLE, None, 0  # DRAM is all pinned
                    return status, regions, write_regions(self._view, regions, staging)
        except Exception:  # the reserved pages must come back
            logger.exception("umbp serve: promotion of %r failed", key)
            status = LoadStatus.UNAVAILABLE
        if regions is not None:
            with self._lock:
                self._index.release(regions)
        return status, None, 0

    def _gather(self, entry: Entry) -> memoryview | bytes:
        """The bytes of a pinned entry as one buffer (a view when it is one region)."""
        if len(entry.regions) <= 1:
            return self._region_view(entry.regions)
        view = self._view
        return b"".join(view[offset : offset + length] for offset, length in entry.regions)

    def _region_view(self, regions: Regions) -> memoryview:
        if not regions:
            return memoryview(bytearray())
        offset, length = regions[0]
        return self._view[offset : offset + length]


_RESIDENT = bytes([0, 1, 1]) + bytes(253)

_COLD_ANSWERS = {
    LoadStatus.MISSING: protocol.GET_MISSING,
    LoadStatus.CORRUPT: protocol.GET_CORRUPT,
    LoadStatus.SIZE_MISMATCH: protocol.GET_SIZE_MISMATCH,
}


def _require_same_length(keys: Sequence[str], sizes: Sequence[int]) -> None:
    if len(keys) != len(sizes):
        raise RequestRefused(f"keys and sizes differ in length: {len(keys)} != {len(sizes)}")
