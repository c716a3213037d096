"""Room in the server's DRAM and the moves between its tiers.

Making room: a put (or a promotion) that would cross the high watermark, or its
namespace's quota, first takes victims (`umbp.runtime.server.shares`: quota, even share,
LRU; retained objects never); without a cold tier they are dropped, with one they are
demoted to it, without the index lock. Promotion reads an object from the cold tier
into fresh DRAM pages and pins it like a DRAM hit.

Tiers are inclusive: an object promoted from SSD keeps its SSD copy, so demoting it again
costs no write (the SSD tier evicts its own LRU objects when it needs room); the objects
next in line for eviction are copied ahead for the same reason (`write_ahead`). Lookups never
wait for the disk: the SSD tier holds its own lock during its I/O, so `cold_keys` mirrors
its key set under the index lock, updated on every demotion, promotion failure and clear,
and pruned with the keys the SSD tier reports as evicted after each write. The mirror may
briefly still name a key the SSD tier has just evicted: that lookup says True and the get
that follows answers MISSING, a miss, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import xxhash

from umbp.runtime.contract import LoadStatus
from umbp.runtime.server import protocol
from umbp.runtime.server.cold import ColdTier
from umbp.runtime.server.index import Entry, PoolIndex, Regions, pages_for
from umbp.runtime.server.namespaces import ColdKeys, namespace_of
from umbp.runtime.server.sessions import ServerCounters, Session

__all__ = ["Demotion", "GetAnswer", "Tiering"]

logger = logging.getLogger("umbp.serve")

ROOM_WAIT_S = 2.0
"""How long a reservation that found no free page waits for the pages of victims another
thread is demoting (room-making writes them to the SSD tier first: ~70-140 ms for a
round of ~50 victims here) before it answers that nothing fits."""

GetAnswer = str | tuple[int, int, Regions]


class Demotion(enum.Enum):
    """What became of one victim on its way to the cold tier."""

    WRITTEN = "written"
    """Copied to the cold tier now."""
    PRESENT = "present"
    """The cold tier had it already (tiers are inclusive): nothing to write."""
    FAILED = "failed"
    """The cold tier refused it or raised: dropped from DRAM all the same."""
    CORRUPT = "corrupt"
    """Its DRAM bytes failed their checksum: dropped, never demoted."""


class Tiering:
    """The DRAM index's room and its cold tier, under the server's index `lock` (shared
    with `StoreCore`, which holds it around everything else)."""

    def __init__(
        self,
        view: memoryview,
        index: PoolIndex,
        cold: ColdTier | None,
        lock: threading.Lock,
        counters: ServerCounters,
    ) -> None:
        self._view = view
        self._index = index
        self._cold = cold
        self._lock = lock
        self._room_made = threading.Condition(lock)
        """Notified when victims' pages come free (`_demote`)."""
        self._counters = counters
        self.cold_keys = ColdKeys(cold.sizes() if cold is not None else (), dram=index)
        """The cold tier's keys and sizes, read under the lock (see the module docstring)."""
        index.cold_mirror = self.cold_keys
        self.generation = 0
        """Bumped by a clear: a demotion or promotion that straddles a clear must not
        bring back what the clear dropped."""
        self.ahead_pages = 0
        """How many of the least recently used pages `write_ahead` keeps on the cold
        tier, less those free below the high watermark."""
        self.writing_ahead: set[str] = set()
        """Keys `write_ahead` has pinned: in use by no client (a drop may take them)."""
        self.cold_reads = 0
        """Gets promoting from the cold tier now: `write_ahead` gives way to them."""

    @property
    def cold(self) -> ColdTier | None:
        return self._cold

    def persist(self) -> int:
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
                if not there and self._demote_one(cold, entry) is Demotion.WRITTEN:
                    written += 1
        finally:
            on_disk = ColdKeys(cold.sizes())
            with self._lock:
                for entry in entries:
                    self._index.unpin(entry)
                on_disk.track(self._index)
                self._index.cold_mirror = self.cold_keys = on_disk
        return written

    def reserve(self, sizes: Sequence[int], namespace: str | None) -> list[Regions | None]:
        """Pages for each size (None where they ran out, or past `namespace`'s quota),
        making room first when the batch would cross the high watermark or the quota:
        victims are dropped (DRAM only) or demoted to the cold tier, the latter without
        the index lock."""
        if not sizes:
            return []
        needed = sum(pages_for(size, self._index.page_bytes) for size in sizes)
        with self._lock:
            victims = self._choose_victims_locked(needed, namespace)
            if not victims:
                return self._reserve_or_wait_locked(sizes, namespace)
        self._demote(victims)
        with self._lock:
            return self._reserve_locked(sizes, namespace)

    def _reserve_or_wait_locked(
        self, sizes: Sequence[int], namespace: str | None
    ) -> list[Regions | None]:
        """Reserve without making room; where pages ran out while another thread's
        victims are leaving (their pages count as free already, so no room was made
        here), wait for them (at most `ROOM_WAIT_S`) and try again, rather than fail
        what fits once they are gone."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            reserved = self._reserve_locked(sizes, namespace)
            left = deadline - time.monotonic()
            if None not in reserved or not self._index.leaving_pages or left <= 0:
                return reserved
            for regions in reserved:  # all or nothing again, after the wait
                if regions is not None:
                    self._index.release(regions)
            self._room_made.wait(left)

    def _reserve_locked(self, sizes: Sequence[int], namespace: str | None) -> list[Regions | None]:
        index = self._index
        room = None if namespace is None else index.quota_room(namespace)
        if room is None:
            return [index.reserve(size) for size in sizes]
        reserved: list[Regions | None] = []
        for size in sizes:
            pages = pages_for(size, index.page_bytes)
            regions = index.reserve(size) if pages <= room else None
            room -= pages if regions is not None else 0
            reserved.append(regions)
        return reserved

    def _choose_victims_locked(self, pages_needed: int, namespace: str | None) -> list[Entry]:
        index = self._index
        if not index.needs_room_for(namespace, pages_needed):
            return []
        victims = index.choose_victims_for(namespace, pages_needed, time.monotonic())
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
        generation = self.generation
        outcomes: list[Demotion] = []
        try:
            already: Sequence[bool] = cold.lookup([victim.key for victim in victims])
        except Exception:  # then each victim is written (a put of a resident key is free)
            logger.exception("umbp serve: the SSD tier's lookup failed")
            already = [False] * len(victims)
        for victim, present in zip(victims, already):
            # One victim's failure costs that victim only, never the rest of the batch,
            # and never leaks its pin.
            try:
                outcomes.append(Demotion.PRESENT if present else self._demote_one(cold, victim))
            except Exception:
                logger.exception("umbp serve: demoting %r to the SSD tier failed", victim.key)
                outcomes.append(Demotion.FAILED)
        evicted = self._evicted_from_cold(cold)
        with self._lock:
            for victim, outcome in zip(victims, outcomes):
                self._settle_victim_locked(victim, outcome)
            self._room_made.notify_all()
            cleared = self.generation != generation
            self.cold_keys.difference_update(evicted)
            if cleared:
                self.cold_keys.difference_update(victim.key for victim in victims)
        if cleared:
            for victim, outcome in zip(victims, outcomes):
                if outcome is Demotion.WRITTEN:
                    cold.remove(victim.key)

    @staticmethod
    def _evicted_from_cold(cold: ColdTier) -> tuple[str, ...]:
        try:
            return tuple(cold.take_evicted_keys())
        except Exception:  # a mirror a little stale costs a miss, never wrong bytes
            logger.exception("umbp serve: the SSD tier did not report its evictions")
            return ()

    def _demote_one(self, cold: ColdTier, victim: Entry) -> Demotion:
        pieces = self._region_views(victim.regions)
        if _xxh3_of(pieces) != victim.checksum:
            return Demotion.CORRUPT
        # The tier writes what the hash just read, from where it lies, and keeps its
        # checksum.
        return (Demotion.WRITTEN if cold.put_pieces(victim.key, pieces, victim.checksum)
                else Demotion.FAILED)

    def write_ahead(self, limit: int, give_way: Callable[[], bool]) -> tuple[int, bool]:
        """Copy to the cold tier at most `limit` of the DRAM objects next in line for
        eviction that it lacks (`umbp.runtime.server.write_ahead`); they stay in DRAM.
        Stops before the next object once `give_way()`: a read of the cold tier (a
        prefetch, a get promoting) waits for the tier's lock, held through each write.
        Returns (objects written or refused, whether the cold tier refused one)."""
        cold = self._cold
        assert cold is not None
        with self._lock:
            chosen = self._next_to_write_locked(limit)
            for entry in chosen:
                self._index.pin(entry)
                self.writing_ahead.add(entry.key)
            generation = self.generation
        outcomes: list[Demotion] = []
        for entry in chosen:
            if give_way():
                break
            try:
                outcomes.append(self._demote_one(cold, entry))
            except Exception:
                logger.exception("umbp serve: writing %r ahead to the SSD tier failed", entry.key)
                outcomes.append(Demotion.FAILED)
        evicted = self._evicted_from_cold(cold)
        stale: list[str] = []
        with self._lock:
            for position, entry in enumerate(chosen):
                self.writing_ahead.discard(entry.key)
                if position < len(outcomes) and not self._settle_written_ahead_locked(
                        entry, outcomes[position], generation):
                    stale.append(entry.key)
                self._index.unpin(entry)
            self.cold_keys.difference_update(evicted)
            self.cold_keys.difference_update(stale)
        for key in stale:  # dropped or cleared while written: its copy must not outlive it
            cold.remove(key)
        return len(outcomes), Demotion.FAILED in outcomes

    def _next_to_write_locked(self, limit: int) -> list[Entry]:
        """The least recently used evictable objects covering `ahead_pages` less the free
        pages below the high watermark: the first `limit` of them the cold tier lacks."""
        index = self._index
        room = self.ahead_pages - max(0, index.high_pages - index.used_pages)
        chosen: list[Entry] = []
        covered = 0
        for entry in index.entries():  # least recently used first
            if covered >= room or len(chosen) >= limit:
                break
            if entry.pins or entry.leaving or entry.retained_until:
                continue
            covered += len(entry.pages)
            if entry.key not in self.cold_keys:
                chosen.append(entry)
        return chosen

    def _settle_written_ahead_locked(
        self, entry: Entry, outcome: Demotion, generation: int
    ) -> bool:
        """Count one object `write_ahead` took; False when it was written but is no longer
        the resident object (dropped, cleared): then its copy goes."""
        resident = generation == self.generation and self._index.get(entry.key) is entry
        counters = self._counters
        if outcome is Demotion.WRITTEN:
            counters.written_ahead += 1
            counters.bytes_to_ssd += entry.nbytes
            if not resident:
                return False
            self.cold_keys.add(entry.key, entry.nbytes)
        elif outcome is Demotion.CORRUPT and resident:
            self._index.retire(entry)  # a get would find the damage: dropped now
            counters.corrupt_loads += 1
        elif outcome is Demotion.FAILED:
            counters.ssd_put_failures += 1
        return True

    def _settle_victim_locked(self, victim: Entry, outcome: Demotion) -> None:
        counters = self._counters
        self._index.finish_leaving(victim)
        if outcome in (Demotion.PRESENT, Demotion.WRITTEN):
            self.cold_keys.add(victim.key, victim.nbytes)
            counters.evictions_to_ssd += 1
            if outcome is Demotion.WRITTEN:
                counters.bytes_to_ssd += victim.nbytes
            return
        counters.evictions_dropped += 1
        if outcome is Demotion.CORRUPT:
            counters.corrupt_loads += 1
        else:
            counters.ssd_put_failures += 1

    def promote(
        self,
        session: Session,
        token: int,
        keys: Sequence[str],
        sizes: Sequence[int],
        positions: list[int],
        answers: list[GetAnswer],
    ) -> None:
        """Read cold objects into fresh DRAM pages and pin them like DRAM hits."""
        with self._reading_cold():
            cold = self._cold
            assert cold is not None
            generation = self.generation
            found: list[int] = []
            for position in positions:
                size = self._cold_size(cold, keys[position])
                if size is None:
                    answers[position] = protocol.GET_MISSING
                    with self._lock:
                        self.cold_keys.discard(keys[position])
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
                        self.cold_keys.discard(key)
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

    @contextlib.contextmanager
    def _reading_cold(self) -> Iterator[None]:
        """Counted in `cold_reads` while it lasts: `write_ahead` gives way to it."""
        with self._lock:
            self.cold_reads += 1
        try:
            yield
        finally:
            with self._lock:
                self.cold_reads -= 1

    def prefetch_one(self, key: str, nbytes: int) -> None:
        """Bring one cold object into DRAM ahead of its load (`prefetch`): unpinned, most
        recently used; nothing when DRAM holds it already or the SSD tier no longer
        does."""
        cold = self._cold
        assert cold is not None
        with self._lock:
            if key in self._index or key not in self.cold_keys:
                return
            generation = self.generation
        status, regions, checksum = self._load_cold(cold, key, nbytes)
        with self._lock:
            if regions is None:
                if status in (LoadStatus.CORRUPT, LoadStatus.MISSING):
                    self.cold_keys.discard(key)
                    self._counters.corrupt_loads += status is LoadStatus.CORRUPT
                return
            fresh = key not in self._index
            entry = self._settle_promotion_locked(key, regions, nbytes, checksum, generation)
            self._counters.prefetched += entry is not None and fresh

    def _settle_promotion_locked(
        self, key: str, regions: Regions, nbytes: int, checksum: int, generation: int
    ) -> Entry | None:
        index = self._index
        if generation != self.generation:
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
        """Read a cold object straight into fresh DRAM pages, wherever they lie (one copy
        per byte): (status, its regions when HIT, xxh3 of the bytes now in those pages,
        hashed once, as the SSD tier read them). The SSD tier holds the object while room
        is made for it: those demotions' writes may evict its other objects, never this
        one."""
        with cold.held(key) as resident:
            if not resident:
                return LoadStatus.MISSING, None, 0
            regions = self.reserve([nbytes], namespace_of(key))[0]
            if regions is None:
                return LoadStatus.UNAVAILABLE, None, 0  # DRAM all pinned, or past the quota
            try:
                status, checksum = cold.read_pieces_into(key, self._region_views(regions))
                if status is LoadStatus.HIT:
                    return status, regions, checksum
            except Exception:  # the reserved pages must come back
                logger.exception("umbp serve: promotion of %r failed", key)
                status = LoadStatus.UNAVAILABLE
        with self._lock:
            self._index.release(regions)
        return status, None, 0

    def _region_views(self, regions: Regions) -> list[memoryview]:
        view = self._view
        return [view[offset : offset + length] for offset, length in regions]


def _xxh3_of(pieces: Sequence[memoryview]) -> int:
    """xxh3-64 of the bytes the pieces hold in order."""
    if len(pieces) == 1:
        return int(xxhash.xxh3_64_intdigest(pieces[0]))
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    return int(hasher.intdigest())


_COLD_ANSWERS = {
    LoadStatus.MISSING: protocol.GET_MISSING,
    LoadStatus.CORRUPT: protocol.GET_CORRUPT,
    LoadStatus.SIZE_MISMATCH: protocol.GET_SIZE_MISMATCH,
}
