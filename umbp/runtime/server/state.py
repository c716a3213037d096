"""What the server does, without the socket: residency, reservations, pins, tiering.

One index lock guards the DRAM index, the sessions' bookkeeping and the counters. It is
never held during cold-tier I/O: demotion victims and promotion targets are pinned (or
reserved) under the lock, moved without it, and settled under it again. Clients copy KV
bytes into and out of the shared pool themselves; the server copies only when it moves
objects between DRAM and SSD.

Tiers are inclusive and a lookup answers True for an object in either tier; `where`
prefers CPU. Making room and moving objects between the tiers: `tiering`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

from umbp.runtime.server import protocol
from umbp.runtime.server.cold import ColdTier, stats_dict
from umbp.runtime.server.index import Entry, PoolIndex, Regions, pages_for
from umbp.runtime.server.labels import LabelFile
from umbp.runtime.server.namespaces import NamespaceBook, namespace_of, shared_namespace
from umbp.runtime.server.operations import (
    DEFAULT_MAX_RETAIN_S,
    check_retention,
    checked_limits,
    namespace_listing,
    require_known,
)
from umbp.runtime.server.prefetch import PREFETCH_READERS, Prefetcher
from umbp.runtime.server.sessions import (
    PinnedGet,
    RequestRefused,
    Reserved,
    ServerCounters,
    Session,
)
from umbp.runtime.server.tiering import GetAnswer, Tiering
from umbp.runtime.server.write_ahead import WriteAhead

__all__ = ["StoreCore"]


class StoreCore:
    """The server's state over one shared pool `view`; thread-safe."""

    def __init__(
        self, view: memoryview, index: PoolIndex, cold: ColdTier | None,
        prefetch_bytes: int = 0, write_ahead_bytes: int = 0,
        prefetch_readers: int = PREFETCH_READERS,
    ) -> None:
        self._index = index
        self._cold = cold
        self._lock = threading.Lock()
        self._counters = ServerCounters()
        self._sessions: list[Session] = []
        self._tiers = Tiering(view, index, cold, self._lock, self._counters)
        self._prefetcher = (Prefetcher(self._prefetch_one, prefetch_bytes, prefetch_readers)
                            if cold is not None and prefetch_bytes > 0 else None)
        """SSD objects a lookup found, brought into DRAM before their load (`prefetch`)."""
        self._tiers.ahead_pages = pages_for(write_ahead_bytes, index.page_bytes)
        self._write_ahead = (WriteAhead(self._tiers.write_ahead, self._cold_is_read)
                             if cold is not None and write_ahead_bytes > 0 else None)
        """DRAM objects next in line for eviction, copied to SSD beforehand (`write_ahead`)."""
        self.book = NamespaceBook()
        """Labels and counters per namespace (`umbp.runtime.server.operations`)."""
        self.max_retain_s = DEFAULT_MAX_RETAIN_S
        """The longest retention a request may ask for."""
        self.label_file: LabelFile | None = None

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
        if self._prefetcher is not None:
            self._prefetcher.cancel(lambda owner: owner[0] == id(session))

    def forget(self, session: Session, request: str) -> None:
        """A request of this connection went away: its prefetches not yet read are
        dropped."""
        if self._prefetcher is not None:
            self._prefetcher.cancel(lambda owner: owner == (id(session), request))

    def close(self) -> None:
        """Stop prefetching and writing ahead (before the cold tier closes and the pool
        is unmapped)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._write_ahead is not None:
            self._write_ahead.close()

    def _dram_gained(self) -> None:
        if self._write_ahead is not None:
            self._write_ahead.poke()

    def _cold_is_read(self) -> bool:
        """A prefetch is queued or reading, or a get is promoting from the SSD tier."""
        prefetcher = self._prefetcher
        return self._tiers.cold_reads > 0 or (prefetcher is not None and prefetcher.busy())

    def _prefetch_one(self, key: str, nbytes: int) -> None:
        self._tiers.prefetch_one(key, nbytes)
        self._dram_gained()

    def _unpin_all_locked(self, get: PinnedGet) -> None:
        for entry in get.pinned:
            if entry is not None:
                self._index.unpin(entry)

    # ----------------------------------------------------------------- residency

    def lookup(
        self, keys: Sequence[str], session: Session | None = None, request: str | None = None
    ) -> bytes:
        """An engine asks what it could load (admission): the tier of each key (`WHERE_*`
        codes), each key counted per namespace as a hit (by tier) or a miss, and the
        objects found only on SSD handed to the prefetcher for `request` of `session`."""
        namespace = shared_namespace(keys)
        prefetcher = self._prefetcher
        with self._lock:
            codes = self._where_locked(keys)
            self.book.looked_up(keys, codes, namespace)
            on_disk = [] if prefetcher is None or protocol.WHERE_DISK not in codes else [
                (key, self._tiers.cold_keys.size_of(key) or 0)
                for key, code in zip(keys, codes) if code == protocol.WHERE_DISK
            ]
        if on_disk:
            assert prefetcher is not None
            prefetcher.submit((None if session is None else id(session), request), on_disk)
        return codes

    def where(self, keys: Sequence[str]) -> bytes:
        """The tier of each key, not counted: the engines' residency checks (of blocks
        to store, of published KV events) are not asks for loads."""
        with self._lock:
            return self._where_locked(keys)

    def _where_locked(self, keys: Sequence[str]) -> bytes:
        codes = bytearray(self._index.residency(keys).translate(_WHERE_OF_RESIDENCY))
        cold_keys = self._tiers.cold_keys
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
            cold_keys = self._tiers.cold_keys
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
        namespaces = {namespace_of(keys[position]) for position in wanted}
        reserved = self._tiers.reserve(
            [sizes[position] for position in wanted],
            namespaces.pop() if len(namespaces) == 1 else None,
        )
        token = next(session.tokens)
        items: list[Reserved] = []
        with self._lock, self._released_on_error(reserved):
            for position, regions in zip(wanted, reserved):
                if regions is None:
                    self._counters.put_rejects += 1
                    continue
                items.append(Reserved(keys[position], regions, sizes[position]))
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
            now = time.time()
            stored = [self._commit_one(item, checksum, now)
                      for item, checksum in zip(items, checksums)]
        self._dram_gained()
        return stored

    def _commit_one(self, item: Reserved, checksum: int | None, now: float) -> bool:
        index = self._index
        if checksum is None:
            index.release(item.regions)
            return False
        if item.key in index:
            index.release(item.regions)  # another client stored it meanwhile
            return True
        entry = index.insert(item.key, item.regions, item.nbytes, checksum)
        self.book.put(entry.namespace, item.nbytes, now)
        self._counters.puts += 1
        self._counters.bytes_written += item.nbytes
        return True

    # ----------------------------------------------------------------------- get

    def begin_get(
        self, session: Session, keys: Sequence[str], sizes: Sequence[int]
    ) -> tuple[int, list[GetAnswer]]:
        _require_same_length(keys, sizes)
        if self._prefetcher is not None:  # what it has not read yet is this get's to read
            self._prefetcher.claim(keys, _PREFETCH_CLAIM_WAIT_S)
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
            get = session.gets[token] = PinnedGet(pinned)
        if cold_positions:
            try:
                self._tiers.promote(session, token, keys, sizes, cold_positions, answers)
            except BaseException:  # the client never learns the token: take its pins back
                with self._lock:
                    if session.gets.pop(token, None) is get:
                        self._unpin_all_locked(get)
                raise
            self._dram_gained()
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
            now = time.time()
            for position, entry in enumerate(get.pinned):
                if entry is None:
                    continue
                if position in corrupt_positions:
                    self._index.retire(entry)
                    counters.corrupt_loads += 1
                else:
                    counters.hits += 1
                    counters.bytes_read += entry.nbytes
                    from_ssd = position in get.from_ssd
                    counters.hits_from_ssd += from_ssd
                    self.book.load(entry.namespace, entry.nbytes, from_ssd, now)
                self._index.unpin(entry)

    # --------------------------------------------------------------------- misc

    def persist_to_cold(self) -> int:
        """Copy every DRAM object the cold tier lacks into it (for shutdown): see
        `Tiering.persist`. Returns how many objects were written."""
        return self._tiers.persist()

    def clear(self) -> bool:
        with self._lock:
            self._index.clear()
            self._tiers.generation += 1
        if self._cold is not None:
            self._cold.clear()
            with self._lock:
                self._tiers.cold_keys.clear()
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
                "resident_bytes": index.resident_pages() * page_bytes,
                "page_bytes": page_bytes,
                "objects": len(index),
                "pinned_objects": index.pinned_objects,
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
            cold_keys = self._tiers.cold_keys
            objects = len(index) + len(cold_keys) - cold_keys.in_dram
        if self._prefetcher is not None:
            counters |= {f"prefetch_{name}": value
                         for name, value in asdict(self._prefetcher.figures()).items()}
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

    # ------------------------------------------------------- namespaces (operators)

    def register(self, namespace: str, label: str) -> None:
        """An engine says which model its namespace is (shown by `umbp ls`); a new label
        is saved beside the SSD tier, when there is one (`labels`)."""
        with self._lock:
            known = self.book.registrations.get(namespace)
            if known is not None and known.label == label:
                return
            self.book.register(namespace, label, time.time())
            registrations = dict(self.book.registrations)
        if self.label_file is not None:
            self.label_file.save(registrations)

    def restore_labels(self, label_file: LabelFile) -> None:
        """Labels a previous server saved, for the namespaces still on the SSD tier;
        later registrations are saved to `label_file`."""
        saved = label_file.load()
        with self._lock:
            on_disk = set(self._tiers.cold_keys.namespaces())
            for namespace, registration in saved.items():
                if namespace in on_disk:
                    self.book.registrations.setdefault(namespace, registration)
            self.label_file = label_file

    def namespaces(self) -> list[dict[str, Any]]:
        """Every namespace this server knows, with its figures (`operations`)."""
        with self._lock:
            now = time.monotonic()
            self._index.expire_retentions(now)
            return namespace_listing(self._index, self._tiers.cold_keys, self.book, now)

    def drop(self, namespace: str | None) -> dict[str, Any]:
        """Drop a namespace's objects (every object for None) from both tiers, except
        those in use (a client is copying them, or they are moving between tiers),
        which are left in place and counted. An unknown namespace changes nothing."""
        with self._lock:
            cold_keys = self._tiers.cold_keys
            if namespace is not None:
                require_known(namespace, self._index, cold_keys, self.book)
            entries = (tuple(self._index.entries()) if namespace is None
                       else self._index.entries_of(namespace))
            ahead = self._tiers.writing_ahead  # pinned only to be copied: not in use
            in_use = {entry.key for entry in entries
                      if entry.leaving or entry.pins > (entry.key in ahead)}
            dropped = [entry for entry in entries if entry.key not in in_use]
            for entry in dropped:
                self._index.retire(entry)
            on_disk = [key for key in cold_keys.keys_of(namespace) if key not in in_use]
            cold_keys.difference_update(on_disk)
        removed = [key for key in on_disk if self._cold is not None and self._cold.remove(key)]
        return {
            "namespace": namespace,
            "objects": len({entry.key for entry in dropped}.union(removed)),
            "dram": len(dropped),
            "ssd": len(removed),
            "in_use": len(in_use),
        }

    def retain(self, keys: Sequence[str], seconds: float) -> dict[str, Any]:
        """Keep the objects of `keys` in DRAM for `seconds` (`shares`): all of them, or
        none when that would break the longest retention or a budget. Keys not in DRAM
        are counted, not retained (an object on SSD only is not promoted for it)."""
        if not 0 < seconds <= self.max_retain_s:
            raise RequestRefused(f"a retention of {seconds:g} s is outside (0, "
                                 f"{self.max_retain_s:g}] s (umbp serve --max-retain)")
        with self._lock:
            index = self._index
            now = time.monotonic()
            index.expire_retentions(now)
            found, not_in_dram, missing = self._retention_candidates_locked(keys)
            check_retention(index, found)
            fresh = sum(index.retain(entry, now + seconds) for entry in found)
        return {"retained": fresh, "extended": len(found) - fresh, "not_in_dram": not_in_dram,
                "missing": missing, "seconds": seconds}

    def _retention_candidates_locked(self, keys: Sequence[str]) -> tuple[list[Entry], int, int]:
        found: dict[str, Entry] = {}
        not_in_dram = missing = 0
        for key in dict.fromkeys(keys):
            entry = self._index.get(key)
            if entry is not None and not entry.leaving:
                found[key] = entry
            elif entry is not None or key in self._tiers.cold_keys:
                not_in_dram += 1
            else:
                missing += 1
        return list(found.values()), not_in_dram, missing

    def configure_retention(
        self, max_seconds: float, default_budget_bytes: int, *, capped: bool
    ) -> None:
        """The longest retention and the default retention budget (`capped`: brought
        down to the cap on all retention instead of refused above it)."""
        with self._lock:
            index = self._index
            pages = default_budget_bytes // index.page_bytes
            if capped:
                pages = min(pages, index.retained_cap_pages)
            elif pages > index.retained_cap_pages:
                raise RequestRefused(
                    f"default retention budget {default_budget_bytes} bytes is over what all "
                    f"namespaces may retain together ({index.retained_cap_pages * index.page_bytes}"
                    " bytes, half the low watermark)"
                )
            index.default_budget_pages = pages
            self.max_retain_s = max_seconds

    def set_limits(
        self, namespace: str, changes: dict[str, int | None], *, require: bool = True
    ) -> dict[str, Any]:
        """Set a namespace's quota and retention budget (`changes`: `quota_bytes`,
        `retain_budget_bytes`; a key left out is unchanged, None removes the quota or
        restores the default budget). Checked whole first (`operations.checked_limits`);
        a budget lowered below what is retained releases the retentions that end
        first. `require`: refuse a namespace the server does not know (at start-up,
        limits may name namespaces no engine has used yet)."""
        with self._lock:
            index = self._index
            if require:
                require_known(namespace, index, self._tiers.cold_keys, self.book)
            page = index.page_bytes
            current_quota = index.quota_pages.get(namespace)
            current_budget = index.budget_pages.get(namespace)
            quota_bytes = changes.get("quota_bytes", None if current_quota is None
                                      else current_quota * page)
            budget_bytes = changes.get("retain_budget_bytes", None if current_budget is None
                                       else current_budget * page)
            quota, budget = checked_limits(index, namespace, quota_bytes, budget_bytes)
            if quota is None:
                index.quota_pages.pop(namespace, None)
            else:
                index.quota_pages[namespace] = quota
            if budget is None:
                index.budget_pages.pop(namespace, None)
            else:
                index.budget_pages[namespace] = budget
            released = index.release_past_budget(namespace)
            return {"namespace": namespace,
                    "quota_bytes": None if quota is None else quota * page,
                    "retain_budget_bytes": index.budget_of(namespace) * page,
                    "released": released}

_WHERE_OF_RESIDENCY = bytes((protocol.WHERE_NONE, protocol.WHERE_CPU)).ljust(256, b"\0")
"""`PoolIndex.residency`'s bytes (0, 1) as `WHERE_*` codes, by `bytes.translate`."""

_PREFETCH_CLAIM_WAIT_S = 30.0
"""Longest a get waits for the prefetch read of one of its keys in progress (one object's
read: far less unless the disk hangs)."""


def _require_same_length(keys: Sequence[str], sizes: Sequence[int]) -> None:
    if len(keys) != len(sizes):
        raise RequestRefused(f"keys and sizes differ in length: {len(keys)} != {len(sizes)}")
