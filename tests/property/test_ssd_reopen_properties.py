"""Reopening the SSD tier: the index rebuilt from the header records, fast path and all,
is exactly what reading every record on its own gives.

`umbp.runtime.ssd.format.recover` takes an object whose parts lie in consecutive slots in
one comparison of bytes instead of parsing each part's record. The oracle here parses
every record by itself, as the format's docstring describes it, and applies the rules
plainly. After a random history of puts (objects of one to five slots, so runs and
fragmented objects both occur), removals and evictions, the header area is damaged at
random (bits flipped, records zeroed, overwritten with garbage or with another slot's
record, the file cut short) and read in chunks of any size, so that runs cross chunk
boundaries. Both must keep the same objects in the same order, zero the same records and
count the same losses.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.runtime.ssd import format as ssd_format
from umbp.runtime.ssd.format import (
    RECORD_BYTES,
    RECORD_MAGIC,
    SLOT_FILE_NAME,
    SlotGeometry,
    recover,
)
from umbp.runtime.ssd.tier import SsdTier

SLOT = 512
HEAD = struct.Struct("<8sHHIIIQQQ")  # the record layout of format.py's docstring
CHECKED = RECORD_BYTES - 8


def oracle_record(slot: int, raw: bytes) -> tuple[str, int, int, int, int, int] | None:
    """(key, part index, part count, size, generation, checksum) of a whole record."""
    if len(raw) != RECORD_BYTES:
        return None
    if xxhash.xxh3_64_intdigest(raw[:CHECKED]) != int.from_bytes(raw[CHECKED:], "little"):
        return None
    magic, version, key_bytes, own_slot, part, parts, size, generation, checksum = (
        HEAD.unpack_from(raw)
    )
    if (magic != RECORD_MAGIC or version != 1 or own_slot != slot or key_bytes > 960
            or parts != max(1, -(-size // SLOT)) or part >= parts or generation == 0):
        return None
    try:
        key = raw[HEAD.size : HEAD.size + key_bytes].decode()
    except UnicodeDecodeError:
        return None
    return key, part, parts, size, generation, checksum


def oracle_recover(fd: int, geometry: SlotGeometry, file_bytes: int) -> tuple[object, ...]:
    groups: dict[int, list[tuple[int, tuple[str, int, int, int, int, int]]]] = {}
    to_zero: list[int] = []
    dropped = 0
    for slot in range(geometry.total_slots):
        raw = os.pread(fd, RECORD_BYTES, geometry.record_offset(slot))
        if not raw.strip(b"\0"):
            continue
        parsed = oracle_record(slot, raw)
        if parsed is None:
            to_zero.append(slot)
            dropped += 1
        else:
            groups.setdefault(parsed[4], []).append((slot, parsed))
    newest: dict[str, tuple[str, tuple[int, ...], int, int, int]] = {}
    for generation in sorted(groups):
        records = groups[generation]
        key, _, parts, size, _, checksum = records[0][1]
        by_part = sorted(records, key=lambda item: item[1][1])
        slots = tuple(slot for slot, _ in by_part)
        whole = (
            len(records) == parts
            and all(fields[0] == key and fields[2:4] == (parts, size) and fields[5] == checksum
                    for _, fields in records)
            and [fields[1] for _, fields in by_part] == list(range(parts))
            and all(offset + length <= file_bytes
                    for offset, _, length in geometry.extents(slots, size))
        )
        if not whole:
            dropped += 1
            to_zero.extend(slot for slot, _ in records)
            continue
        if key in newest:
            dropped += 1
            to_zero.extend(newest[key][1])
        newest[key] = (key, slots, size, checksum, generation)
    objects = tuple(sorted(newest.values(), key=lambda found: found[4]))
    return objects, sorted(to_zero), dropped, max(groups, default=0) + 1


DAMAGE = st.lists(
    st.tuples(st.sampled_from(["flip", "zero", "garbage", "copy", "cut"]),
              st.integers(min_value=0, max_value=10**6), st.integers(min_value=0, max_value=10**6)),
    max_size=4,
)


@settings(max_examples=60)
@given(
    total_slots=st.integers(min_value=4, max_value=40),
    history=st.lists(st.tuples(st.sampled_from(["put", "remove"]),
                               st.integers(min_value=0, max_value=30),
                               st.integers(min_value=1, max_value=5 * SLOT)), max_size=40),
    damage=DAMAGE,
    chunk_records=st.integers(min_value=1, max_value=9),
)
def test_the_rebuilt_index_is_what_reading_each_record_gives(
    total_slots: int, history: list[tuple[str, int, int]],
    damage: list[tuple[str, int, int]], chunk_records: int,
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="umbp-reopen-"))
    try:
        tier = SsdTier(directory, total_slots * SLOT, SLOT)
        for action, key, size in history:
            if action == "put":
                tier.put(f"key-{key}", random.Random(key * 7919 + size).randbytes(size))
            else:
                tier.remove(f"key-{key}")
        tier.close()
        path = directory / SLOT_FILE_NAME
        geometry = SlotGeometry(SLOT, total_slots)
        damaged(path, geometry, damage)
        fd = os.open(path, os.O_RDONLY)
        try:
            file_bytes = os.fstat(fd).st_size
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(ssd_format, "_SCAN_CHUNK_RECORDS", chunk_records)
                found = recover(fd, geometry, file_bytes)
            expected = oracle_recover(fd, geometry, file_bytes)
        finally:
            os.close(fd)
        got = (
            tuple((o.key, o.slots, o.nbytes, o.checksum, o.generation) for o in found.objects),
            sorted(found.slots_to_zero), found.dropped, found.next_generation,
        )
        assert got == expected
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def damaged(path: Path, geometry: SlotGeometry, damage: list[tuple[str, int, int]]) -> None:
    """Apply each (kind, a, b) to the header area (slots a and b modulo the slot count)."""
    with open(path, "r+b") as file:
        for kind, a, b in damage:
            slot = a % geometry.total_slots
            offset = geometry.record_offset(slot)
            if kind == "flip":
                file.seek(offset + b % RECORD_BYTES)
                value = file.read(1)
                if value:
                    file.seek(offset + b % RECORD_BYTES)
                    file.write(bytes([value[0] ^ (1 << b % 8)]))
            elif kind == "zero":
                file.seek(offset)
                file.write(bytes(RECORD_BYTES))
            elif kind == "garbage":
                file.seek(offset + b % 64)
                file.write(random.Random(b).randbytes(100))
            elif kind == "copy":  # another slot's record, verbatim
                file.seek(geometry.record_offset(b % geometry.total_slots))
                record = file.read(RECORD_BYTES)
                file.seek(offset)
                file.write(record)
            else:
                file.truncate(geometry.record_offset(0) + (a + b) % geometry.file_bytes)
