"""`ServerStore`: the client of a node-local `umbp serve` process.

Bytes move through the server's shared-memory pool, mapped here; only control messages
cross the socket. A put is two round trips (reserve pages, then commit their checksums
once the bytes are written); a get is one round trip plus a one-way unpin.

Batches of any length: the server takes at most `MAX_BATCH` keys and `BODY_LIMITS` bytes
per request (`umbp.runtime.server.schema`), so a longer batch goes as consecutive requests
within both (`umbp.runtime.batches`), answered in key order, exactly as those requests
would be one after another.

Failure semantics: the connection, its pool mapping and reconnects are the link's
(`umbp.runtime.server.link`). A call whose exchange fails answers as the contract says
(`lookup`/`where`/`stats` raise `StoreUnavailable`, `put_batch` answers False,
`get_batch_into` answers UNAVAILABLE) within `io_timeout_s`; for a batch sent as several
requests, each request's keys answer for that request.

Thread-safe: the link serialises the socket; copies into and out of the pool run outside
its lock, so a lookup from another thread waits for a round trip, not for a put's copies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from umbp.runtime.batches import Span, json_key_spans
from umbp.runtime.closing import ClosesOnExit
from umbp.runtime.contract import (
    LabelsNamespaces,
    LendsObjects,
    LentObjects,
    LoadStatus,
    Medium,
    PoolStats,
    PrefetchesOnLookup,
    ReportsTiers,
    ReservedObjects,
    ReservesObjects,
    Retains,
    Retention,
    SchedulerStore,
    StoreRefused,
    StoreUnavailable,
    TierAware,
    WatchesLentMemory,
    WorkerStore,
)
from umbp.runtime.host_memory import byte_views
from umbp.runtime.paged_copy import (
    hashed_per_key,
    object_checksum,
    read_regions,
    write_regions,
)
from umbp.runtime.server import protocol
from umbp.runtime.server.link import Connection, ServerLink, ServerRefused, Stale
from umbp.runtime.server.schema import MAX_BATCH, body_limit

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["REQUEST_BODY_BYTES", "ServerStore", "request_spans"]

logger = logging.getLogger("umbp")

_MEDIA: dict[int, Medium | None] = {
    protocol.WHERE_NONE: None,
    protocol.WHERE_CPU: Medium.CPU,
    protocol.WHERE_DISK: Medium.DISK,
}
REQUEST_BODY_BYTES = min(
    body_limit(op) for op in (protocol.LOOKUP, protocol.WHERE, protocol.BEGIN_PUT,
                              protocol.BEGIN_GET, protocol.RETAIN)
)
"""The largest request body the server reads for a batch of keys."""
_ENVELOPE_BYTES = 64
"""A request's JSON object around its lists (``{"keys":[...],"sizes":[...]}``, or RETAIN's
``"seconds"``), rounded up."""
_SIZE_BYTES = 14
"""An object size in a request (at most 2**40: 13 digits) and its separator."""
_GET_STATUS = {
    protocol.GET_MISSING: LoadStatus.MISSING,
    protocol.GET_CORRUPT: LoadStatus.CORRUPT,
    protocol.GET_SIZE_MISMATCH: LoadStatus.SIZE_MISMATCH,
    protocol.GET_UNAVAILABLE: LoadStatus.UNAVAILABLE,
}


class ServerStore(ClosesOnExit):
    """`SchedulerStore`, `WorkerStore` and `TierAware` over a `umbp serve` socket."""

    batch_limit: int | None = MAX_BATCH
    """The server takes at most this many keys per request (and `BODY_LIMITS` bytes);
    longer batches go as several requests."""

    def __init__(
        self,
        endpoint: str,
        *,
        io_timeout_s: float = 5.0,
        reconnect_interval_s: float = 1.0,
    ) -> None:
        self._link = ServerLink(endpoint, io_timeout_s, reconnect_interval_s)

    # ------------------------------------------------------------- the contract

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        """Residency of each key in either tier (the server counts the keys as its hits
        and misses, and starts bringing those only on SSD into DRAM). Raises
        `StoreUnavailable`."""
        answer = self._ask_per_key(protocol.LOOKUP, keys)
        return tuple([byte != protocol.WHERE_NONE for byte in answer])

    def lookup_where(self, keys: Sequence[str], request_id: str) -> tuple[Medium | None, ...]:
        """`lookup` for the engine's request `request_id`, answered per tier: the objects
        on `Medium.DISK` are on their way into DRAM (until `forget(request_id)`). Raises
        `StoreUnavailable`."""
        answer = self._ask_per_key(protocol.LOOKUP, keys, {"request": request_id})
        return tuple([_MEDIA.get(code) for code in answer])

    def forget(self, request_id: str) -> None:
        """The engine's request went away: its prefetches not yet started are dropped
        (one-way; nothing happens when the server cannot be reached)."""
        try:
            self._link.notify_current(protocol.FORGET, {"request": request_id})
        except (StoreUnavailable, Stale):
            pass

    def where(self, keys: Sequence[str]) -> tuple[Medium | None, ...]:
        """`Medium.CPU`, `Medium.DISK` or None per key. Raises `StoreUnavailable`."""
        answer = self._ask_per_key(protocol.WHERE, keys)
        return tuple([_MEDIA.get(code) for code in answer])

    def put_batch(self, keys: Sequence[str], payloads: Sequence[Buffer]) -> tuple[bool, ...]:
        """Store each payload; False for every key the server did not take (including
        all of a request's keys when it cannot be reached). Raises ValueError for caller
        bugs."""
        sources = byte_views(keys, payloads, writable=False)
        results: list[bool] = []
        for start, end in request_spans(keys, with_sizes=True):
            try:
                results.extend(self._put(keys[start:end], sources[start:end]))
            except (StoreUnavailable, Stale):
                results.extend([False] * (end - start))
        return tuple(results)

    def get_batch_into(
        self, keys: Sequence[str], outs: Sequence[Buffer]
    ) -> tuple[LoadStatus, ...]:
        """Load each object into its buffer, verifying its checksum; UNAVAILABLE for every
        key of a request when the server cannot be reached. Raises ValueError for caller
        bugs."""
        destinations = byte_views(keys, outs, writable=True)
        statuses: list[LoadStatus] = []
        for start, end in request_spans(keys, with_sizes=True):
            try:
                statuses.extend(self._get(keys[start:end], destinations[start:end]))
            except (StoreUnavailable, Stale):
                statuses.extend([LoadStatus.UNAVAILABLE] * (end - start))
        return tuple(statuses)

    def stats(self) -> PoolStats:
        """The DRAM tier's occupancy with the server's counters (evictions: objects that
        left DRAM, to SSD or dropped). Raises `StoreUnavailable`."""
        figures = self.server_stats()
        dram, counters = figures["dram"], figures["counters"]
        return PoolStats(
            capacity_bytes=dram["capacity_bytes"],
            used_bytes=dram["used_bytes"],
            page_bytes=dram["page_bytes"],
            objects=dram["objects"],
            hits=counters["hits"],
            misses=counters["misses"],
            puts=counters["puts"],
            put_rejects=counters["put_rejects"],
            evictions=counters["evictions_to_ssd"] + counters["evictions_dropped"],
            corrupt_loads=counters["corrupt_loads"],
            bytes_written=counters["bytes_written"],
            bytes_read=counters["bytes_read"],
        )

    def server_stats(self) -> dict[str, Any]:
        """Per-tier figures and counters of the server (see `umbp.runtime.server.stats`).
        Raises `StoreUnavailable`."""
        answer = self._link.request_json(protocol.STATS, {})
        if not isinstance(answer, dict):
            raise StoreUnavailable(f"umbp server at {self._link.endpoint}: malformed stats")
        return answer

    def tier_usage(self) -> dict[Medium, tuple[int, int]]:
        """(used bytes, objects) of the DRAM tier and, when the server has one, the SSD
        tier; raises `StoreUnavailable` when the server cannot be reached."""
        figures = self.server_stats()
        dram, ssd = figures["dram"], figures["ssd"]
        usage = {Medium.CPU: (int(dram["used_bytes"]), int(dram["objects"]))}
        if ssd.get("enabled"):
            usage[Medium.DISK] = (int(ssd["used_bytes"]), int(ssd["objects"]))
        return usage

    def clear(self) -> bool:
        """Drop every object in both tiers; False when the server cannot be reached."""
        try:
            return bool(self._link.request_json(protocol.CLEAR, {}))
        except StoreUnavailable:
            return False

    def close(self) -> None:
        self._link.close()

    # --------------------------------------------------------------- namespaces

    def register_namespace(self, namespace: str, label: str) -> None:
        """Tell the server (and every server this client reconnects to) which model
        `namespace` belongs to; never raises."""
        request = {"namespace": namespace, "label": label}
        self._link.greet_with(f"namespace:{namespace}", protocol.REGISTER, request)
        try:
            self._request(protocol.REGISTER, request)
        except (StoreUnavailable, StoreRefused) as error:
            logger.warning("umbp: namespace %s not registered now: %s", namespace, error)

    def retain(self, keys: Sequence[str], seconds: float) -> Retention:
        """Keep the objects under `keys` in the server's DRAM for `seconds`. A batch over
        the server's limit goes in several requests, each checked whole. Raises
        `StoreRefused` (a limit), `StoreUnavailable`."""
        retained = extended = not_retained = 0
        for start, end in request_spans(keys, with_sizes=False):
            answer = self._request(
                protocol.RETAIN, {"keys": list(keys[start:end]), "seconds": seconds})
            retained += int(answer["retained"])
            extended += int(answer["extended"])
            not_retained += int(answer["not_in_dram"]) + int(answer["missing"])
        return Retention(retained, extended, not_retained)

    def namespaces(self) -> list[dict[str, Any]]:
        """One row per namespace the server knows (`umbp ls`). Raises `StoreUnavailable`."""
        answer = self._request(protocol.NAMESPACES, {})
        if not isinstance(answer, list):
            raise StoreUnavailable(f"umbp server at {self._link.endpoint}: malformed listing")
        return answer

    def drop(self, namespace: str | None) -> dict[str, Any]:
        """Drop a namespace's objects (every object for None) but those in use; what was
        dropped. Raises `StoreRefused` (unknown namespace), `StoreUnavailable`."""
        answer = self._request(protocol.DROP, {"namespace": namespace})
        if not isinstance(answer, dict):
            raise StoreUnavailable(f"umbp server at {self._link.endpoint}: malformed answer")
        return answer

    def set_limits(self, namespace: str, **changes: int | None) -> dict[str, Any]:
        """Set `quota_bytes` and/or `retain_budget_bytes` of a namespace (None: no quota,
        the default budget). Raises `StoreRefused`, `StoreUnavailable`."""
        answer = self._request(protocol.LIMITS, {"namespace": namespace, **changes})
        if not isinstance(answer, dict):
            raise StoreUnavailable(f"umbp server at {self._link.endpoint}: malformed answer")
        return answer

    def _request(self, op: int, request: Any) -> Any:
        """One exchange; the server's refusal as `StoreRefused` (it changed nothing)."""
        try:
            return self._link.request_json(op, request)
        except StoreUnavailable as error:
            if isinstance(error.__cause__, ServerRefused):
                raise StoreRefused(str(error.__cause__)) from None
            raise

    @property
    def endpoint(self) -> str:
        return self._link.endpoint

    def connected_server(self) -> tuple[str, int] | None:
        """(server id, pid) of the server this client is connected to, if any: lets an
        operator (and the tests) see that a reconnect reached a new server."""
        return self._link.connected_server()

    def _ask_per_key(
        self, op: int, keys: Sequence[str], fields: dict[str, Any] | None = None
    ) -> bytes:
        """The one-byte-per-key answer of LOOKUP or WHERE for the whole batch, each
        request carrying `fields` beside its keys."""
        if not keys:
            self._link.require_open()
            return b""
        fields = fields or {}
        spans = request_spans(keys, with_sizes=False, body_bytes=REQUEST_BODY_BYTES - len(
            json.dumps(fields)))
        if len(spans) == 1:
            return self._link.request_raw(op, {"keys": list(keys), **fields}, len(keys))
        return b"".join([
            self._link.request_raw(op, {"keys": list(keys[start:end]), **fields}, end - start)
            for start, end in spans
        ])

    # --------------------------------------------------------- copies in place

    def watch_lent_memory(self, watcher: WatchesLentMemory) -> None:
        """`watcher` hears of the server's pool as this client maps it, now if mapped, and
        again after a reconnection to another server (a restarted server's pool is a new
        mapping; the same server's, after a timeout, is still the one it heard of), and
        of each mapping's end once no loan or reservation in it is left."""
        self._link.watch_mappings(watcher)

    def lend(self, keys: Sequence[str], nbytes: int) -> LentObjects:
        """Pin the objects under `keys` in the server's DRAM (one BEGIN_GET, as a get
        does: objects only on SSD are promoted first) and lend their pages where they
        lie in the shared pool (`LendsObjects`): nothing is copied until the caller
        copies out of them. `verify` checks their checksums over those pages; `release`
        unpins them (END_GET, dropping the corrupt ones). Raises `StoreUnavailable`."""
        if len(request_spans(keys, with_sizes=True)) > 1:
            raise StoreUnavailable(f"umbp server: a loan of {len(keys)} keys is larger than "
                                   "one request; read them with get_batch_into")
        try:
            connection, answer = self._link.begin(
                protocol.BEGIN_GET, {"keys": list(keys), "sizes": [nbytes] * len(keys)}
            )
            connection.hold()
        except Stale as error:
            raise StoreUnavailable("umbp server: the connection went away") from error
        return _ServerLoan(self._link, connection, answer, nbytes).lent()

    def reserve(self, keys: Sequence[str], nbytes: int) -> ReservedObjects:
        """Reserve pages of the server's shared pool for the objects under `keys` (one
        BEGIN_PUT, as a put does) for the caller to copy into (`ReservesObjects`);
        `commit` sends their checksums (COMMIT_PUT). Raises `StoreUnavailable`."""
        if len(request_spans(keys, with_sizes=True)) > 1:
            raise StoreUnavailable(f"umbp server: a reservation of {len(keys)} keys is "
                                   "larger than one request; write them with put_batch")
        try:
            connection, answer = self._link.begin(
                protocol.BEGIN_PUT, {"keys": list(keys), "sizes": [nbytes] * len(keys)}
            )
            connection.hold()
        except Stale as error:
            raise StoreUnavailable("umbp server: the connection went away") from error
        return _ServerReservation(self._link, connection, answer, nbytes).reserved()

    # --------------------------------------------------------------------- puts

    def _put(self, keys: Sequence[str], sources: list[memoryview]) -> tuple[bool, ...]:
        connection, answer = self._link.begin(
            protocol.BEGIN_PUT,
            {"keys": list(keys), "sizes": [source.nbytes for source in sources]},
        )
        results = [False] * len(keys)
        reserved: list[int] = []
        checksums: list[int | None] = []
        with self._link.malformed_drops(connection), connection.copying() as view:
            for position, placed in enumerate(answer["answers"]):
                if placed is True:
                    results[position] = True
                elif isinstance(placed, list):
                    reserved.append(position)
                    checksums.append(write_regions(view, placed, sources[position]))
        if reserved:
            committed = self._link.follow_up(
                connection,
                protocol.COMMIT_PUT,
                {"token": answer["token"], "checksums": checksums},
            )
            if not isinstance(committed, list) or len(committed) != len(reserved):
                raise StoreUnavailable("umbp server: malformed commit answer")
            for position, stored in zip(reserved, committed):
                results[position] = bool(stored)
        return tuple(results)

    # --------------------------------------------------------------------- gets

    def _get(self, keys: Sequence[str], destinations: list[memoryview]) -> tuple[LoadStatus, ...]:
        connection, answer = self._link.begin(
            protocol.BEGIN_GET,
            {"keys": list(keys), "sizes": [out.nbytes for out in destinations]},
        )
        statuses: list[LoadStatus] = []
        corrupt: list[int] = []
        with self._link.malformed_drops(connection), connection.copying() as view:
            for position, found in enumerate(answer["answers"]):
                if isinstance(found, str):
                    statuses.append(_GET_STATUS.get(found, LoadStatus.UNAVAILABLE))
                    continue
                nbytes, checksum, regions = found
                destination = destinations[position]
                if (
                    nbytes == destination.nbytes
                    and read_regions(view, regions, destination) == checksum
                ):
                    statuses.append(LoadStatus.HIT)
                else:
                    statuses.append(LoadStatus.CORRUPT)
                    corrupt.append(position)
        # One-way: the server unpins when it reads this; the next request on this
        # connection is ordered after it.
        self._link.notify(
            connection, protocol.END_GET, {"token": answer["token"], "corrupt": corrupt}
        )
        return tuple(statuses)


def _page_rows(connection: Connection) -> npt.NDArray[np.uint8]:
    page_bytes = connection.page_bytes
    pool = np.frombuffer(connection.pool.view, np.uint8)
    pages = pool.shape[0] // page_bytes
    return pool[: pages * page_bytes].reshape(pages, page_bytes)


def _pages_of(regions: Sequence[Sequence[int]], page_bytes: int) -> tuple[int, ...]:
    """The pool pages under an object's regions, in order."""
    pages: list[int] = []
    for offset, length in regions:
        first = int(offset) // page_bytes
        pages.extend(range(first, first + max(1, -(-int(length) // page_bytes))))
    return tuple(pages)


class _ServerLoan:
    """A BEGIN_GET's pinned objects, lent: verified at most once, released exactly once
    (END_GET on the connection that pinned them; if it is gone, so are the pins)."""

    def __init__(self, link: ServerLink, connection: Connection, answer: Any, nbytes: int) -> None:
        self._link, self._connection, self._nbytes = link, connection, nbytes
        self._token = answer["token"]
        self._memory = _page_rows(connection)
        self._found: list[tuple[int, tuple[int, ...]] | None] = []
        self._refusals: list[LoadStatus] = []
        for found in answer["answers"]:
            if isinstance(found, str):
                self._found.append(None)
                self._refusals.append(_GET_STATUS.get(found, LoadStatus.UNAVAILABLE))
            else:
                size, checksum, regions = found
                self._found.append((int(checksum), _pages_of(regions, connection.page_bytes))
                                   if size == nbytes else None)
                self._refusals.append(LoadStatus.HIT if size == nbytes
                                      else LoadStatus.SIZE_MISMATCH)
        self._corrupt: list[int] = []
        self._verified = self._released = False

    def lent(self) -> LentObjects:
        pages = tuple(None if found is None else found[1] for found in self._found)
        return LentObjects(self._memory, pages, self.verify, self.release)

    def verify(self, copied: Sequence[int | None] | None = None) -> tuple[LoadStatus, ...]:
        if self._verified or self._released:
            raise RuntimeError("a loan is verified at most once, before its release")
        hashed = hashed_per_key(copied, len(self._found), "verify")
        self._verified = True
        statuses: list[LoadStatus] = []
        for position, (found, refusal, digest) in enumerate(
            zip(self._found, self._refusals, hashed)
        ):
            if found is None:
                statuses.append(refusal)
            elif object_checksum(self._memory, found[1], self._nbytes, digest) == found[0]:
                statuses.append(LoadStatus.HIT)
            else:
                statuses.append(LoadStatus.CORRUPT)
                self._corrupt.append(position)
        return tuple(statuses)

    def release(self) -> None:
        if self._released:
            raise RuntimeError("a loan is released exactly once")
        self._released = True
        try:  # one-way: the server unpins when it reads this
            self._link.notify(self._connection, protocol.END_GET,
                              {"token": self._token, "corrupt": self._corrupt})
        except (StoreUnavailable, Stale):
            pass  # the connection is gone, and its pins with it
        finally:
            self._connection.let_go()


class _ServerReservation:
    """A BEGIN_PUT's reserved pages: committed exactly once (COMMIT_PUT on the
    connection that reserved them; if it is gone, so is the reservation)."""

    def __init__(self, link: ServerLink, connection: Connection, answer: Any, nbytes: int) -> None:
        self._link, self._connection, self._nbytes = link, connection, nbytes
        self._token = answer["token"]
        self._memory = _page_rows(connection)
        self._answers: list[bool | tuple[int, ...]] = [
            _pages_of(placed, connection.page_bytes) if isinstance(placed, list)
            else placed is True
            for placed in answer["answers"]
        ]
        self._committed = False

    def reserved(self) -> ReservedObjects:
        pages = tuple(placed if isinstance(placed, tuple) else None for placed in self._answers)
        return ReservedObjects(self._memory, pages, self.commit)

    def commit(
        self, written: Sequence[bool], checksums: Sequence[int | None] | None = None
    ) -> tuple[bool, ...]:
        if self._committed:
            raise RuntimeError("a reservation is committed exactly once")
        if len(written) != len(self._answers):
            raise ValueError(f"commit needs one answer per key: {len(self._answers)}, got "
                             f"{len(written)}")
        hashed = hashed_per_key(checksums, len(self._answers), "commit")
        self._committed = True
        try:
            return self._commit(written, hashed)
        finally:
            self._connection.let_go()

    def _commit(
        self, written: Sequence[bool], hashed: Sequence[int | None]
    ) -> tuple[bool, ...]:
        reserved = [position for position, placed in enumerate(self._answers)
                    if isinstance(placed, tuple)]
        results = [placed is True for placed in self._answers]
        if not reserved:
            return tuple(results)
        checksums = [
            object_checksum(self._memory, placed, self._nbytes, hashed[position])
            if written[position] else None
            for position in reserved
            if isinstance(placed := self._answers[position], tuple)
        ]
        try:
            committed = self._link.follow_up(self._connection, protocol.COMMIT_PUT,
                                             {"token": self._token, "checksums": checksums})
        except (StoreUnavailable, Stale):
            return tuple(results)
        if not isinstance(committed, list) or len(committed) != len(reserved):
            return tuple(results)
        for position, stored in zip(reserved, committed):
            results[position] = bool(stored)
        return tuple(results)


def request_spans(
    keys: Sequence[str],
    *,
    with_sizes: bool,
    max_keys: int = MAX_BATCH,
    body_bytes: int = REQUEST_BODY_BYTES,
) -> list[Span]:
    """The requests a batch goes as: each of at most `max_keys` keys in a body of at most
    `body_bytes` (the server's limits unless told), with a size per key when
    `with_sizes` (BEGIN_PUT, BEGIN_GET)."""
    extra = _SIZE_BYTES if with_sizes else 0
    return json_key_spans(keys, max_keys, body_bytes - _ENVELOPE_BYTES, extra)


if TYPE_CHECKING:

    def _server_store_honours_the_contract(
        store: ServerStore,
    ) -> tuple[SchedulerStore, WorkerStore, TierAware, ReportsTiers, Retains, LabelsNamespaces,
               PrefetchesOnLookup, LendsObjects, ReservesObjects]:
        """Never called: makes mypy prove that ServerStore satisfies the protocols."""
        return store, store, store, store, store, store, store, store, store
