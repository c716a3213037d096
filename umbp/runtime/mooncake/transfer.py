"""How an object and its checksum trailer travel through Mooncake, and how a load is
verified.

Mooncake has no integrity check, so every stored object is the payload followed by an
8-byte trailer, the little-endian xxh3-64 of the payload. For a direct (zero-copy) object
the trailer sits in a small registered area and travels as a second piece of the same
object; a staged object has it right after the payload in the bounce buffer (one piece).
A load whose bytes do not hash to their trailer answers CORRUPT and removes the object
(forced: a plain `remove` answers OBJECT_HAS_LEASE for 10 s after any read). The hash
rides the copies umbp makes (into and out of the bounce buffer, `paged_copy.copy_hashing`);
a direct object is copied by Mooncake itself, so hashing its source on put and its
destination on get is the one pass over its bytes umbp adds; none where the worker's
copy into or out of its registered staging rows hashed them (`ChecksumsFromCopy`: the put
takes those checksums, an unchecked get hands the trailers to the copy's check).

Sizes: a staged load lands in the bounce buffer, so the transfer's answer shows a wrong
size harmlessly (BUFFER_OVERFLOW-style -600 when the object is longer, TRANSFER_FAIL -800
when it is shorter, told apart from a real transfer failure by asking the size). A direct
load asks the stored sizes first (`batch_get_replica_desc`, one master round trip per
batch), because a plain `batch_get_into` copies a shorter object into a longer buffer.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any

from umbp.runtime.contract import LoadStatus
from umbp.runtime.counters import PoolCounters
from umbp.runtime.mooncake.binding import (
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    REPLICA_IS_NOT_READY,
    RPC_FAIL,
    TRANSFER_FAIL,
    MasterHealth,
    MooncakeClient,
    complete_memory_size,
    quietly,
)
from umbp.runtime.paged_copy import copy_bytes, copy_hashing
from umbp.runtime.registered_memory import HostArea, Piece, checksum, temporarily_registered

__all__ = ["TRAILER_BYTES", "TRAILER_SLOTS", "TrailerTransfers"]

_log = logging.getLogger("umbp.runtime.mooncake")

TRAILER_BYTES = 8
_TRAILER = struct.Struct("<Q")
TRAILER_SLOTS = 4096  # keys per Mooncake call; larger batches are cut into chunks


class TrailerTransfers:
    """Puts and gets of chunks of at most `TRAILER_SLOTS` objects, each with its trailer
    (`trailers` holds one trailer slot per object of a direct chunk). Not thread-safe:
    the store calls it under its lock."""

    def __init__(
        self,
        client: MooncakeClient,
        trailers: HostArea,
        counters: PoolCounters,
        health: MasterHealth,
    ) -> None:
        self._client = client
        self._trailers = trailers
        self._counters = counters
        self._health = health

    def put_chunk(
        self, keys: Sequence[str], chunk: list[Piece], results: list[bool],
        checksums: Sequence[int] | None = None,
    ) -> None:
        """``checksums``: per batch index, the payload's xxh3-64 as the caller's copy
        computed it (None: hashed here, while staging or as a pass of its own)."""
        trailers = self._trailers
        for slot, piece in enumerate(chunk):
            nbytes = piece.view.nbytes
            given = None if checksums is None else checksums[piece.index]
            if piece.staged is not None:
                if given is None:  # hashed as it is copied into the bounce buffer
                    given = copy_hashing(piece.staged[:nbytes], piece.view)
                else:
                    copy_bytes(piece.staged[:nbytes], piece.view)
                _TRAILER.pack_into(piece.staged, nbytes, given)
            else:
                _TRAILER.pack_into(trailers.view, slot * TRAILER_BYTES,
                                   checksum(piece.view) if given is None else given)
        codes = self._transfer(
            self._client.batch_put_from_multi_buffers, [keys[p.index] for p in chunk], chunk
        )
        for piece, code in zip(chunk, codes):
            accepted = code == 0 or code == OBJECT_ALREADY_EXISTS
            results[piece.index] = accepted
            if accepted:
                self._counters.puts += 1
                self._counters.bytes_written += piece.view.nbytes
            else:
                self._counters.put_rejects += 1

    def get_chunk(
        self, keys: Sequence[str], chunk: list[Piece], statuses: list[LoadStatus],
        stored: list[int | None] | None = None,
    ) -> None:
        """Load a chunk, each arrived object verified against its trailer; or, given
        ``stored`` (per batch index), unverified: an arrived object answers HIT with its
        trailer in ``stored``, for the caller's copy out of the buffer to check
        (`settle_unchecked`)."""
        chunk_keys = [keys[piece.index] for piece in chunk]
        codes = self._transfer(self._client.batch_get_into_multi_buffers, chunk_keys, chunk)
        trailers = self._trailers.view
        unclear: list[Piece] = []
        for slot, (key, piece, code) in enumerate(zip(chunk_keys, chunk, codes)):
            nbytes = piece.view.nbytes
            if code == nbytes + TRAILER_BYTES:
                staged = piece.staged
                (expected,) = (_TRAILER.unpack_from(trailers, slot * TRAILER_BYTES)
                               if staged is None else _TRAILER.unpack_from(staged, nbytes))
                if stored is not None:  # the caller's copy out of its buffer checks it
                    stored[piece.index] = expected
                    if staged is not None:
                        copy_bytes(piece.view, staged[:nbytes])
                    statuses[piece.index] = LoadStatus.HIT
                    continue
                # Hashed as it is copied out of the bounce, or, copied in place by
                # Mooncake, hashed after: the one pass left.
                arrived = (checksum(piece.view) if staged is None
                           else copy_hashing(piece.view, staged[:nbytes]))
                statuses[piece.index] = self._settle(key, nbytes, arrived == expected)
            elif code >= 0 and piece.staged is not None:  # a shorter object, in the bounce
                statuses[piece.index] = LoadStatus.SIZE_MISMATCH
            elif code >= 0:  # shorter than its descriptor said
                statuses[piece.index] = self._corrupt(key)
            elif code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
                statuses[piece.index] = LoadStatus.MISSING
            elif code == INVALID_PARAMS:  # the stored object is larger than the buffer
                statuses[piece.index] = LoadStatus.SIZE_MISMATCH
            elif code == TRANSFER_FAIL and piece.staged is not None:
                unclear.append(piece)
            else:
                statuses[piece.index] = LoadStatus.UNAVAILABLE
        if unclear:
            # A staged get skipped the size query; this code means either a shorter
            # object or a failed transfer, and only the stored size tells which.
            wanted = [(piece.index, piece.view) for piece in unclear]
            decided = self.check_sizes(keys, wanted, statuses)
            for index, _ in wanted:
                if index not in decided:
                    statuses[index] = LoadStatus.UNAVAILABLE

    def _transfer(self, call: Any, keys: list[str], chunk: list[Piece]) -> list[int]:
        """One multi-buffer call. A staged object is one piece (payload and trailer side
        by side in the bounce buffer); a direct one is two, the caller's buffer and the
        chunk's trailer slot. Temporary registrations wrap the call; an exception or a
        malformed answer reads as a failure code for every key."""
        trailer_base = self._trailers.address
        pointers: list[list[int]] = []
        sizes: list[list[int]] = []
        for slot, piece in enumerate(chunk):
            nbytes = piece.view.nbytes
            trailer = trailer_base + slot * TRAILER_BYTES
            if piece.staged is not None:
                pointers.append([piece.pointer])
                sizes.append([nbytes + TRAILER_BYTES])
            elif nbytes:
                pointers.append([piece.pointer, trailer])
                sizes.append([nbytes, TRAILER_BYTES])
            else:
                pointers.append([trailer])
                sizes.append([TRAILER_BYTES])
        failed = [-1] * len(chunk)
        try:
            with temporarily_registered(
                chunk,
                lambda address, nbytes: self._client.register_buffer(address, nbytes) == 0,
                lambda address: quietly(self._client.unregister_buffer, address),
            ) as registered:
                if not registered:
                    return failed
                codes = call(keys, pointers, sizes)
                if not isinstance(codes, list) or len(codes) != len(keys):
                    return failed
                if RPC_FAIL in codes:
                    self._health.suspect = True
                return [int(code) for code in codes]
        except Exception:  # noqa: BLE001 - no binding error may reach the caller
            _log.warning("Mooncake batch call raised", exc_info=True)
            return failed

    def check_sizes(
        self,
        keys: Sequence[str],
        wanted: list[tuple[int, memoryview]],
        statuses: list[LoadStatus],
    ) -> set[int]:
        """Settle the (batch index, buffer) pairs whose stored size rules a load out
        (missing, wrong size, unreachable master); returns the indices settled."""
        if not wanted:
            return set()
        sizes = self._stored_sizes([keys[index] for index, _ in wanted])
        if sizes is None:
            return {index for index, _ in wanted}  # UNAVAILABLE stays
        decided: set[int] = set()
        for (index, view), stored in zip(wanted, sizes):
            if stored is None:
                statuses[index] = LoadStatus.MISSING
            elif stored < TRAILER_BYTES:  # not written by this adapter: unverifiable
                statuses[index] = self._corrupt(keys[index])
            elif stored - TRAILER_BYTES != view.nbytes:
                statuses[index] = LoadStatus.SIZE_MISMATCH
            else:
                continue
            decided.add(index)
        return decided

    def _stored_sizes(self, keys: Sequence[str]) -> list[int | None] | None:
        """Stored size of each key (None: not resident), or None for the whole batch when
        the master cannot be reached. A key without a complete replica counts as missing;
        keys absent from the descriptors are confirmed with `batch_is_exist`, because an
        unreachable master also yields an empty answer."""
        try:
            descriptors = self._client.batch_get_replica_desc(list(keys))
            sizes = [complete_memory_size(descriptors.get(key, ())) for key in keys]
            absent = [key for key, size in zip(keys, sizes) if size is None]
            codes = self._client.batch_is_exist(absent) if absent else []
        except Exception:  # noqa: BLE001 - no binding error may reach the caller
            _log.warning("Mooncake size query raised", exc_info=True)
            return None
        if len(codes) != len(absent) or any(code < 0 for code in codes):
            self._health.suspect = True
            return None
        return sizes

    def settle_unchecked(
        self, keys: Sequence[str], nbytes: Sequence[int], arrived: list[LoadStatus],
        stored: Sequence[int | None], copied: Sequence[int | None],
    ) -> tuple[LoadStatus, ...]:
        """The final statuses of an unverified load (`get_chunk` given ``stored``): an
        arrived object is HIT where the caller's copy hashed it to its trailer, CORRUPT
        (dropped) where to anything else, UNAVAILABLE where the copy did not hash it."""
        final = list(arrived)
        for index, status in enumerate(arrived):
            if status is not LoadStatus.HIT:
                continue
            if copied[index] is None:
                final[index] = LoadStatus.UNAVAILABLE
            else:
                final[index] = self._settle(keys[index], nbytes[index],
                                            copied[index] == stored[index])
        return tuple(final)

    def _settle(self, key: str, nbytes: int, holds: bool) -> LoadStatus:
        """HIT (counted) where an arrived object's checksum holds, else CORRUPT."""
        if not holds:
            return self._corrupt(key)
        self._counters.hits += 1
        self._counters.bytes_read += nbytes
        return LoadStatus.HIT

    def _corrupt(self, key: str) -> LoadStatus:
        """Drop an object that failed verification (forced past any read lease)."""
        self._counters.corrupt_loads += 1
        quietly(self._client.remove, key, True)
        return LoadStatus.CORRUPT
