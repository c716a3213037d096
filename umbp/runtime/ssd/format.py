"""The SSD tier's on-disk format: where things lie in the slot file, and what a record is.

One file, `<directory>/ssd-tier.slots`, mode 0600; little-endian:

* superblock, bytes [0, 4096): magic ``UMBP-SSD``, format version, header-record size,
  `slot_bytes`, slot count, data-area offset, and an xxh3-64 of those fields. A file whose
  superblock is damaged or whose geometry differs from the one asked for is reset (emptied);
  a file that does not start with the magic is not umbp's and is refused, untouched (umbp
  writes the superblock first into an empty file, so every file it made starts so).
* header area, from byte 4096: one `RECORD_BYTES` (1024-byte) record per slot, in slot
  order. A free slot's record is all zeros. An occupied slot's record holds magic
  ``UMBP-HDR``, format version, key length, the slot's own index (catches a misdirected
  write), part index and part count, object size, generation, payload checksum (xxh3-64 of
  the whole object), the UTF-8 key (at most `MAX_KEY_BYTES`), and in its last 8 bytes an
  xxh3-64 of the rest of the record.
* data area, from the first 4 KiB boundary after the header area: `slot_count` slots of
  `slot_bytes`. An object of n bytes occupies max(1, ceil(n / slot_bytes)) slots (the
  paging rule of every tier, `umbp.runtime.paging.pages_for`), not necessarily
  contiguous; part i holds bytes [i * slot_bytes, (i + 1) * slot_bytes).

Every put draws a fresh generation (greater than any found on disk at open), so records
of different objects never mix even when a stale one survives somewhere. At open only
complete, self-consistent objects are kept (`recover`): every part present once, one
generation, matching key, size, part count and checksum, valid record checksums, data
inside the file. When two complete objects claim one key (only possible after a lost
write), the newer generation wins.

This module knows bytes and offsets only; the tier (`umbp.runtime.ssd.tier`) decides
what to write when.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

from umbp.runtime.paging import pages_for

__all__ = [
    "MAX_KEY_BYTES",
    "RECORD_BYTES",
    "RECORD_MAGIC",
    "SLOT_FILE_NAME",
    "SUPERBLOCK_BYTES",
    "SUPERBLOCK_MAGIC",
    "Extents",
    "Record",
    "Recovered",
    "RecoveredObject",
    "SlotGeometry",
    "build_records",
    "consecutive_runs",
    "count_objects_in_place",
    "encode_key",
    "read_geometry",
    "read_records",
    "recover",
]

SLOT_FILE_NAME = "ssd-tier.slots"
FORMAT_VERSION = 1

SUPERBLOCK_BYTES = 4096
SUPERBLOCK_MAGIC = b"UMBP-SSD"
# magic, version, record bytes, slot bytes, slot count, data offset; then its checksum.
_SUPERBLOCK = struct.Struct("<8sIIQQQ")
_CHECKSUM = struct.Struct("<Q")

RECORD_BYTES = 1024
"""Size of one slot's header record."""
RECORD_MAGIC = b"UMBP-HDR"
# magic, version, key length, slot, part index, part count, object size, generation,
# payload checksum. The key follows; the record's own checksum takes the last 8 bytes.
_RECORD_HEAD = struct.Struct("<8sHHIIIQQQ")
_RECORD_CHECKED_BYTES = RECORD_BYTES - _CHECKSUM.size
MAX_KEY_BYTES = 960
"""Longest key, in UTF-8 bytes, a header record holds (umbp keys are ~110 bytes)."""
assert _RECORD_HEAD.size + MAX_KEY_BYTES <= _RECORD_CHECKED_BYTES

_ALIGNMENT = 4096
_SCAN_CHUNK_RECORDS = 4096  # 4 MiB of header records per read while recovering
_PADDING = bytes(_RECORD_CHECKED_BYTES - _RECORD_HEAD.size)  # sliced after the key
_xxh3_64 = xxhash.xxh3_64_intdigest

Extents = tuple[tuple[int, int, int], ...]
"""(file offset, offset in the object, length) of each run of consecutive slots."""


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    """Where the areas of a slot file of `total_slots` slots of `slot_bytes` lie."""

    slot_bytes: int
    total_slots: int
    data_offset: int = field(init=False)
    """File offset of slot 0's payload: the first 4 KiB boundary after the records."""

    def __post_init__(self) -> None:
        end_of_records = SUPERBLOCK_BYTES + self.total_slots * RECORD_BYTES
        object.__setattr__(self, "data_offset", -(-end_of_records // _ALIGNMENT) * _ALIGNMENT)

    @property
    def header_offset(self) -> int:
        return SUPERBLOCK_BYTES

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.total_slots * self.slot_bytes

    def record_offset(self, slot: int) -> int:
        """File offset of a slot's header record."""
        return SUPERBLOCK_BYTES + slot * RECORD_BYTES

    def slot_offset(self, slot: int) -> int:
        """File offset of a slot's payload bytes."""
        return self.data_offset + slot * self.slot_bytes

    def slot_at(self, offset: int) -> int:
        """The slot whose record or payload holds file `offset`."""
        data_offset = self.data_offset
        if offset >= data_offset:
            return (offset - data_offset) // self.slot_bytes
        return max(0, offset - SUPERBLOCK_BYTES) // RECORD_BYTES

    def superblock(self) -> bytes:
        fields = _SUPERBLOCK.pack(
            SUPERBLOCK_MAGIC,
            FORMAT_VERSION,
            RECORD_BYTES,
            self.slot_bytes,
            self.total_slots,
            self.data_offset,
        )
        return fields + _CHECKSUM.pack(_xxh3_64(fields))

    def extents(self, slots: tuple[int, ...], nbytes: int) -> Extents:
        """(file offset, object offset, length) per run of consecutive slots, so that a
        read or write is one syscall per run rather than per slot."""
        slot_bytes = self.slot_bytes
        if len(slots) == 1:  # the common case for KV blocks, kept off the generic path
            return ((self.slot_offset(slots[0]), 0, nbytes),) if nbytes else ()
        extents: list[tuple[int, int, int]] = []
        part = 0
        for run in consecutive_runs(slots):
            start = part * slot_bytes
            length = min(len(run) * slot_bytes, nbytes - start)
            if length > 0:
                extents.append((self.slot_offset(run[0]), start, length))
            part += len(run)
        return tuple(extents)


def read_geometry(superblock: bytes) -> tuple[int, int, int]:
    """(slot bytes, slot count, data offset) as a superblock states them, unchecked: for
    tools that read a file another process owns."""
    _, _, _, slot_bytes, total_slots, data_offset = _SUPERBLOCK.unpack_from(superblock)
    return slot_bytes, total_slots, data_offset


def consecutive_runs(slots: Sequence[int]) -> Sequence[tuple[int, ...]]:
    """Split `slots` (in the given order) into runs of consecutive ascending indices."""
    if len(slots) <= 1:
        return (tuple(slots),) if slots else ()
    runs = []
    start = 0
    for index in range(1, len(slots)):
        if slots[index] != slots[index - 1] + 1:
            runs.append(tuple(slots[start:index]))
            start = index
    runs.append(tuple(slots[start:]))
    return runs


def encode_key(key: str) -> bytes | None:
    """The key as stored, or None when it cannot be (too long, unencodable)."""
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return encoded if len(encoded) <= MAX_KEY_BYTES else None


# --------------------------------------------------------------------- records


def build_records(
    run: tuple[int, ...],
    slots: tuple[int, ...],
    encoded_key: bytes,
    nbytes: int,
    generation: int,
    checksum: int,
) -> bytes:
    """The header records of one run of consecutive slots of an object on `slots`, back
    to back. Built by concatenating bytes: faster in CPython than packing a bytearray."""
    key_and_padding = encoded_key + _PADDING[len(encoded_key) :]
    part_count = len(slots)
    first_part = 0 if part_count == 1 else slots.index(run[0])
    pack_head, pack_checksum, digest = _RECORD_HEAD.pack, _CHECKSUM.pack, _xxh3_64
    records = []
    for position, slot in enumerate(run):
        body = (
            pack_head(
                RECORD_MAGIC,
                FORMAT_VERSION,
                len(encoded_key),
                slot,
                first_part + position,
                part_count,
                nbytes,
                generation,
                checksum,
            )
            + key_and_padding
        )
        records.append(body + pack_checksum(digest(body)))
    return records[0] if len(records) == 1 else b"".join(records)


class Record(NamedTuple):
    """A header record that passed its own checks; with `run` > 1, the first record of
    an object whose `run` parts lie in consecutive slots from `slot`, every one of those
    records exactly as umbp writes it (so each is whole and self-consistent)."""

    slot: int
    key: str
    part_index: int
    part_count: int
    nbytes: int
    generation: int
    checksum: int
    run: int = 1

    def each_part(self) -> tuple[Record, ...]:
        """One record per slot: a run's records as they lie in the file."""
        if self.run == 1:
            return (self,)
        return tuple(
            self._replace(slot=self.slot + part, part_index=part, run=1)
            for part in range(self.run)
        )


def read_records(fd: int, geometry: SlotGeometry) -> Iterator[tuple[int, Record | None]]:
    """(slot, record) for every header record that is not all zeros (a free slot's): the
    parsed `Record` when it is whole and self-consistent, None for garbage, a damaged
    record or one cut short by the end of the file, so that damage is counted rather than
    taken for a free slot. An object's first record whose other parts follow in the next
    slots, their records exactly as umbp writes them, comes as one `Record` whose `run`
    covers them all (compared as bytes, not parsed record by record: a KV block spans
    8-32 slots of 64 KiB, and a reopen reads every slot's record). Reads
    `_SCAN_CHUNK_RECORDS` records per pread and skips an all-zero chunk, or record, at C
    speed."""
    total = geometry.total_slots
    slot_bytes = geometry.slot_bytes
    for first in range(0, total, _SCAN_CHUNK_RECORDS):
        count = min(_SCAN_CHUNK_RECORDS, total - first)
        chunk = os.pread(fd, count * RECORD_BYTES, geometry.record_offset(first))
        if not chunk.strip(b"\0"):
            continue
        view = memoryview(chunk)
        whole = len(chunk) // RECORD_BYTES
        index = 0
        while index < whole:
            at = index * RECORD_BYTES
            if chunk.startswith(RECORD_MAGIC, at):
                record = _parsed(view, at, first + index, slot_bytes)
                if record is not None and index + record.part_count <= whole:
                    record = _whole_run(chunk, at, record)
                yield first + index, record
                index += 1 if record is None else record.run
                continue
            if chunk.count(0, at, at + RECORD_BYTES) != RECORD_BYTES:
                yield first + index, None
            index += 1
        cut = whole * RECORD_BYTES
        if chunk.count(0, cut) != len(chunk) - cut:
            yield first + whole, None


def _whole_run(chunk: bytes, at: int, record: Record) -> Record:
    """`record` with `run` set to its part count when it is part 0 of an object of
    several parts whose other records follow it in `chunk` exactly as `build_records`
    makes them, else `record` unchanged."""
    parts = record.part_count
    if parts == 1 or record.part_index != 0:
        return record
    slots = tuple(range(record.slot, record.slot + parts))
    key_start = at + _RECORD_HEAD.size
    encoded_key = chunk[key_start : key_start + len(record.key.encode())]
    expected = build_records(
        slots, slots, encoded_key, record.nbytes, record.generation, record.checksum
    )
    if chunk[at : at + parts * RECORD_BYTES] != expected:
        return record
    return record._replace(run=parts)



def _parsed(view: memoryview, at: int, slot: int, slot_bytes: int) -> Record | None:
    """The record at `view[at:at + RECORD_BYTES]` of `slot` when it is whole and
    self-consistent, else None."""
    (stored_checksum,) = _CHECKSUM.unpack_from(view, at + _RECORD_CHECKED_BYTES)
    if _xxh3_64(view[at : at + _RECORD_CHECKED_BYTES]) != stored_checksum:
        return None
    (_, version, key_bytes, own_slot, part_index, part_count, nbytes, generation,
     checksum) = _RECORD_HEAD.unpack_from(view, at)  # fmt: skip
    if (
        version != FORMAT_VERSION
        or own_slot != slot
        or key_bytes > MAX_KEY_BYTES
        or part_count != pages_for(nbytes, slot_bytes)
        or part_index >= part_count
        or generation == 0
    ):
        return None
    start = at + _RECORD_HEAD.size
    try:
        key = str(view[start : start + key_bytes], "utf-8")
    except UnicodeDecodeError:
        return None
    return Record(slot, key, part_index, part_count, nbytes, generation, checksum)


# -------------------------------------------------------------------- recovery


class RecoveredObject(NamedTuple):
    """A complete object found in place (a tuple: a reopen builds one per object)."""

    key: str
    slots: tuple[int, ...]
    """Slot of each part, in object order."""
    nbytes: int
    checksum: int
    generation: int


@dataclass(frozen=True, slots=True)
class Recovered:
    """What the header area of a slot file holds whole."""

    objects: tuple[RecoveredObject, ...]
    """Complete objects, oldest generation first (the LRU order to rebuild)."""
    slots_to_zero: tuple[int, ...]
    """Slots whose records describe nothing servable: zero them before reuse."""
    dropped: int
    """Damaged records, incomplete or inconsistent objects, superseded copies."""
    next_generation: int


def recover(fd: int, geometry: SlotGeometry, file_bytes: int) -> Recovered:
    """Read every record and keep the complete, self-consistent objects whose bytes lie
    inside the file's first `file_bytes` (see the module docstring). Only the header area
    is read, never an object's bytes (their checksums are verified on every read)."""
    first_of: dict[int, Record] = {}  # generation -> its first record
    others: dict[int, list[Record]] = {}  # generations with more than one record
    to_zero: list[int] = []
    dropped = 0
    for slot, parsed in read_records(fd, geometry):
        if parsed is None:
            to_zero.append(slot)
            dropped += 1
            continue
        first = first_of.setdefault(parsed.generation, parsed)
        if first is not parsed:
            others.setdefault(parsed.generation, [first]).append(parsed)
    complete: list[RecoveredObject] = []
    for generation, first in first_of.items():
        records = others.get(generation)
        slots: tuple[int, ...] | None
        if records is None and first.run == first.part_count:
            # Every part in consecutive slots, each record checked (one slot: every KV
            # block that fits one; a run: read_records compared them): complete when the
            # bytes lie inside the file.
            inside = geometry.slot_offset(first.slot) + first.nbytes <= file_bytes
            slots = tuple(range(first.slot, first.slot + first.run)) if inside else None
        else:
            records = [part for record in records or [first] for part in record.each_part()]
            slots = _complete_object_slots(records, geometry, file_bytes)
        if slots is None:
            dropped += 1
            to_zero.extend(
                part.slot for record in records or [first] for part in record.each_part()
            )
        else:
            complete.append(
                RecoveredObject(first.key, slots, first.nbytes, first.checksum, generation)
            )
    complete.sort(key=_generation_of)
    newest: dict[str, RecoveredObject] = {}
    for found in complete:
        previous = newest.pop(found.key, None)
        if previous is not None:  # a lost write left two copies; the newer one wins
            dropped += 1
            to_zero.extend(previous.slots)
        newest[found.key] = found  # re-inserted: the dict stays in generation order
    return Recovered(
        objects=tuple(newest.values()),
        slots_to_zero=tuple(to_zero),
        dropped=dropped,
        next_generation=max(first_of, default=0) + 1,
    )


def _generation_of(found: RecoveredObject) -> int:
    return found.generation


def count_objects_in_place(fd: int, geometry: SlotGeometry, file_bytes: int) -> int:
    """Objects whose records, read with `geometry`, are intact: what a reset of a file
    with a damaged superblock loses (0 when nothing readable is left)."""
    if file_bytes <= geometry.header_offset:
        return 0
    generations = set()
    try:
        for _, parsed in read_records(fd, geometry):
            if parsed is not None:
                generations.add(parsed.generation)
    except OSError:
        return 0
    return len(generations)


def _complete_object_slots(
    records: list[Record], geometry: SlotGeometry, file_bytes: int
) -> tuple[int, ...] | None:
    """Slots in part order when `records` (one generation) form a whole object whose
    bytes lie inside the file, else None."""
    first = records[0]
    identity = (first.key, first.part_count, first.nbytes, first.checksum)
    if len(records) != first.part_count or any(
        (record.key, record.part_count, record.nbytes, record.checksum) != identity
        for record in records
    ):
        return None
    by_part = sorted(records, key=lambda record: record.part_index)
    if [record.part_index for record in by_part] != list(range(first.part_count)):
        return None
    slots = tuple(record.slot for record in by_part)
    extents = geometry.extents(slots, first.nbytes)
    if any(offset + length > file_bytes for offset, _, length in extents):
        return None
    return slots
