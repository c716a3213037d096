"""A loan verified, and a reservation committed, with the checksums the caller's copy
computed as it moved the bytes (`LentObjects.verify(copied)`,
`ReservedObjects.commit(written, checksums)`): the store takes them instead of reading
its pages a second time, on both stores that lend in place (the embedded pool, a real
``umbp serve``). The copy's checksum decides: what the caller copied is what counts,
whatever the pages hold after."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash

from umbp.runtime import LoadStatus, SlabPool
from umbp.runtime.server.client import ServerStore

PAGE = 4096  # the `server` fixture's page, and the pool's here
SIZE = PAGE + 300  # two pages


@pytest.fixture(params=["pool", "server"])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "pool":
        pool = SlabPool(64 * PAGE, page_bytes=PAGE)
        yield pool
        pool.close()
        return
    server = request.getfixturevalue("server")
    with ServerStore(server.socket_path, io_timeout_s=5.0) as client:
        yield client


def content(seed: int) -> bytes:
    return random.Random(seed).randbytes(SIZE)


def write(memory: np.ndarray, pages: tuple[int, ...], data: bytes) -> None:
    flat = np.frombuffer(data, np.uint8)
    for index, page in enumerate(pages):
        piece = flat[index * PAGE : (index + 1) * PAGE]
        memory[page, : len(piece)] = piece


def get(store: Any, key: str) -> tuple[LoadStatus, bytes]:
    out = bytearray(SIZE)
    (status,) = store.get_batch_into([key], [out])
    return status, bytes(out)


def test_a_loan_is_verified_by_the_checksums_of_what_the_copy_read(store: Any) -> None:
    """The copy read intact bytes (its checksum holds) though a page changed after it:
    HIT. The copy's checksum disagrees though the pages are intact: CORRUPT (and the
    store drops the object). No checksum for a key: the store hashes its pages."""
    assert store.put_batch(["a", "b", "c"], [content(1), content(2), content(3)]) == (
        True, True, True)
    loan = store.lend(["a", "b", "c"], SIZE)
    pages_a = loan.pages[0]
    assert pages_a is not None
    loan.memory[pages_a[0], 5] ^= 0x01  # after the caller's copy read "a"
    copied = [xxhash.xxh3_64_intdigest(content(1)), xxhash.xxh3_64_intdigest(b"other"), None]
    assert loan.verify(copied) == (LoadStatus.HIT, LoadStatus.CORRUPT, LoadStatus.HIT)
    loan.release()
    assert store.lookup(["b"]) == (False,)
    assert get(store, "c") == (LoadStatus.HIT, content(3))


def test_a_verify_given_another_count_of_checksums_is_refused(store: Any) -> None:
    assert store.put_batch(["a"], [content(1)]) == (True,)
    loan = store.lend(["a"], SIZE)
    with pytest.raises(ValueError, match="one checksum .or None. per key: 1, got 2"):
        loan.verify([None, None])
    assert loan.verify([None]) == (LoadStatus.HIT,)  # the refused call verified nothing
    loan.release()


def test_a_reservation_stores_the_checksums_the_copy_computed(store: Any) -> None:
    """The store records the copy's checksum as given: a right one reads back HIT, a
    wrong one (bytes the copy did not write) reads back CORRUPT; none: the store hashes
    the pages."""
    reservation = store.reserve(["right", "wrong", "unhashed"], SIZE)
    for seed, pages in enumerate(reservation.pages):
        assert pages is not None
        write(reservation.memory, pages, content(seed))
    checksums = [xxhash.xxh3_64_intdigest(content(0)), xxhash.xxh3_64_intdigest(b"x"), None]
    assert reservation.commit([True, True, True], checksums) == (True, True, True)
    assert get(store, "right") == (LoadStatus.HIT, content(0))
    assert get(store, "wrong")[0] == LoadStatus.CORRUPT
    assert get(store, "unhashed") == (LoadStatus.HIT, content(2))


def test_a_commit_given_another_count_of_checksums_is_refused(store: Any) -> None:
    reservation = store.reserve(["a"], SIZE)
    pages = reservation.pages[0]
    assert pages is not None
    write(reservation.memory, pages, content(4))
    with pytest.raises(ValueError, match="one checksum .or None. per key: 1, got 0"):
        reservation.commit([True], [])
    assert reservation.commit([True], [xxhash.xxh3_64_intdigest(content(4))]) == (True,)
    assert get(store, "a") == (LoadStatus.HIT, content(4))
