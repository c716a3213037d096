"""A real ``umbp serve`` lends objects where they lie in its shared memory and reserves
pages there for objects a client writes in place (`LendsObjects`, `ReservesObjects`):
what a worker copies to and from its KV cache, with no staging copy between."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from umbp.runtime.contract import LoadStatus, StoreUnavailable
from umbp.runtime.server.client import ServerStore
from umbp.testing.faults import stop_process

PAGE = 4096  # the `server` fixture's page


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def object_bytes(memory: np.ndarray, pages: tuple[int, ...], nbytes: int) -> bytes:
    return bytes(np.concatenate([memory[page] for page in pages])[:nbytes])


@pytest.fixture
def store(server: Any) -> Iterator[ServerStore]:
    with ServerStore(server.socket_path, io_timeout_s=5.0) as client:
        yield client


def test_a_loan_lends_each_object_across_its_pages_and_verifies_like_a_get(
    store: ServerStore,
) -> None:
    size = 2 * PAGE + 100  # three pages of the server's
    assert store.put_batch(["a", "b"], [content(1, size), content(2, size)]) == (True, True)
    loan = store.lend(["b", "gone", "a"], size)
    pages_b, missing, pages_a = loan.pages
    assert missing is None and pages_a is not None and pages_b is not None
    assert len(pages_a) == 3
    assert object_bytes(loan.memory, pages_a, size) == content(1, size)
    assert object_bytes(loan.memory, pages_b, size) == content(2, size)
    assert loan.memory.shape[1] == PAGE
    assert loan.verify() == (LoadStatus.HIT, LoadStatus.MISSING, LoadStatus.HIT)
    loan.release()
    other_size = store.lend(["a"], size - 1)
    assert other_size.verify() == (LoadStatus.SIZE_MISMATCH,)
    other_size.release()
    outs = [bytearray(size)]
    assert store.get_batch_into(["a"], outs) == (LoadStatus.HIT,)  # the loan changed nothing
    assert bytes(outs[0]) == content(1, size)


def test_a_corrupt_lent_object_fails_and_the_server_drops_it_on_release(
    store: ServerStore,
) -> None:
    assert store.put_batch(["a"], [content(3, 100)]) == (True,)
    loan = store.lend(["a"], 100)
    (pages,) = loan.pages
    assert pages is not None
    loan.memory[pages[0], 7] ^= 0x10  # damage where the server keeps it
    assert loan.verify() == (LoadStatus.CORRUPT,)
    loan.release()
    assert store.lookup(["a"]) == (False,)


def test_lent_objects_stay_pinned_until_released(store: ServerStore, server: Any) -> None:
    """The server's pool is 16 MiB: fill it twice over while one object is lent; the
    lent object is neither evicted nor overwritten."""
    assert store.put_batch(["kept"], [content(4, PAGE)]) == (True,)
    loan = store.lend(["kept"], PAGE)
    (pages,) = loan.pages
    assert pages is not None
    filler = content(10, 16 * PAGE)
    stored = 0
    for batch in range(2):
        keys = [f"fill-{batch}-{i}" for i in range(256)]  # 16 MiB a batch
        stored += sum(store.put_batch(keys, [filler] * len(keys)))
    assert stored > 256  # the pool turned over: others were evicted
    assert object_bytes(loan.memory, pages, PAGE) == content(4, PAGE)
    assert loan.verify() == (LoadStatus.HIT,)
    loan.release()


def test_a_reservation_written_in_place_is_stored_like_a_put(store: ServerStore) -> None:
    size = PAGE + 10
    assert store.put_batch(["old"], [content(5, size)]) == (True,)
    reservation = store.reserve(["new", "old", "unwritten"], size)
    new_pages, old_pages, unwritten_pages = reservation.pages
    assert old_pages is None  # resident: nothing to write
    assert new_pages is not None and unwritten_pages is not None and len(new_pages) == 2
    assert store.lookup(["new"]) == (False,)  # invisible until committed
    data = content(6, size)
    reservation.memory[new_pages[0]] = np.frombuffer(data[:PAGE], np.uint8)
    reservation.memory[new_pages[1], : size - PAGE] = np.frombuffer(data[PAGE:], np.uint8)
    assert reservation.commit([True, False, False]) == (True, True, False)
    outs = [bytearray(size)]
    assert store.get_batch_into(["new"], outs) == (LoadStatus.HIT,)
    assert bytes(outs[0]) == data
    assert store.lookup(["unwritten"]) == (False,)
    with pytest.raises(RuntimeError, match="exactly once"):
        reservation.commit([True, False, False])


def test_a_server_killed_under_a_loan_loses_nothing_of_the_client(
    store: ServerStore, server: Any,
) -> None:
    """kill -9 with a loan and a reservation out: verify still answers from the mapping
    the client holds, release and commit do not raise (the pins went with the server),
    and the next borrow says the server is unreachable."""
    import signal

    assert store.put_batch(["a"], [content(7, 100)]) == (True,)
    loan = store.lend(["a"], 100)
    reservation = store.reserve(["b"], 100)
    watcher = Watcher()
    store.watch_lent_memory(watcher)
    ((_, address, _),) = watcher.heard
    server.send_signal(signal.SIGKILL)
    server.wait()
    assert loan.verify() == (LoadStatus.HIT,)
    loan.release()
    assert reservation.commit([True]) == (False,)
    with pytest.raises(StoreUnavailable):
        store.lend(["a"], 100)
    # A dead server's pool is let go of at once (nothing of it is lent any more), so
    # that its memory is not held until a new server answers.
    assert watcher.heard[1:] == [("unmapping", address, 0)]


def test_an_idle_client_lets_go_of_a_dead_servers_pool_without_being_asked_anything(
    store: ServerStore, server: Any,
) -> None:
    """An engine with nothing to do sends no request, and a tmpfs pool's pages stay
    allocated while any process maps them: so when its server dies the client lets go of
    the pool at once (its watchers told, the file no longer mapped here, though views of
    it live on), and a new server, which unlinks the old pool, gets that memory back."""
    import signal

    assert store.put_batch(["a"], [content(12, 100)]) == (True,)
    loan = store.lend(["a"], 100)
    assert loan.verify() == (LoadStatus.HIT,)
    loan.release()
    watcher = Watcher()
    store.watch_lent_memory(watcher)
    ((_, address, _),) = watcher.heard
    assert len(_held_pools_of(server.pid)) == 1  # one file, mapped and open
    server.send_signal(signal.SIGKILL)
    server.wait()
    _wait_until_let_go(watcher, server.pid)
    assert watcher.heard[1:] == [("unmapping", address, 0)]
    # The loan's view of the pool outlives its use, as a worker's does until its next
    # restore: the file left this process all the same, and the view reads empty memory.
    assert _held_pools_of(server.pid) == set()
    assert not loan.memory.any()
    with pytest.raises(StoreUnavailable, match="unreachable|refused|No such file"):
        store.lookup(["a"])


def test_a_server_killed_after_it_stopped_answering_is_let_go_of_while_the_client_idles(
    server: Any,
) -> None:
    """A timeout keeps the pool for a reconnection to the same server, with no connection
    left to hear a hang-up on: the server hung, its operator killed it, the engine asks
    nothing more. The client hears the process exit and lets go of its pool then."""
    import signal

    store, watcher = watched_store(server, io_timeout_s=0.5)
    try:
        assert store.put_batch(["a"], [content(13, 100)]) == (True,)
        ((_, address, _),) = watcher.heard
        stop_process(server.pid)
        with pytest.raises(StoreUnavailable, match="TimeoutError"):
            store.lookup(["a"])
        time.sleep(0.3)
        assert watcher.heard[1:] == []  # kept: the server may only be slow
        server.send_signal(signal.SIGKILL)
        server.wait()
        _wait_until_let_go(watcher, server.pid)
        assert watcher.heard[1:] == [("unmapping", address, 0)]
        assert _held_pools_of(server.pid) == set()
    finally:
        store.close()


def _wait_until_let_go(watcher: Watcher, server_pid: int) -> None:
    """Until the watcher heard the end and the pool left this process (in that order:
    a GPU unregisters the pool before it goes), at most 10 s."""
    deadline = time.monotonic() + 10.0
    while (len(watcher.heard) < 2 or _held_pools_of(server_pid)) and time.monotonic() < deadline:
        time.sleep(0.01)


def _held_pools_of(server_pid: int) -> set[str]:
    """The files of the server's pool (named after its pid) that this process maps or
    holds open: either keeps a tmpfs file's pages allocated after it is removed."""
    with open("/proc/self/maps") as maps:
        held = {line.split(maxsplit=5)[5].strip() for line in maps
                if f"/umbp-{server_pid}-" in line}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if f"/umbp-{server_pid}-" in (target := os.readlink(f"/proc/self/fd/{name}")):
                held.add(target)
    return held


def watched_store(server: Any, io_timeout_s: float) -> tuple[ServerStore, Watcher]:
    """A client of `server` that reconnects at once, and what its pool watcher hears."""
    watcher = Watcher()
    store = ServerStore(server.socket_path, io_timeout_s=io_timeout_s,
                        reconnect_interval_s=0.01)
    store.watch_lent_memory(watcher)
    return store, watcher


class Watcher:
    """Records what a `WatchesLentMemory` hears, in order."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, int, int]] = []

    def mapped(self, address: int, nbytes: int) -> None:
        self.heard.append(("mapped", address, nbytes))

    def unmapping(self, address: int) -> None:
        self.heard.append(("unmapping", address, 0))


def test_a_watcher_hears_of_each_pool_mapped_and_of_the_old_ones_end_after_its_loans(
    server: Any, tmp_path: Any,
) -> None:
    """What a GPU worker registers with its copy engines: the first server's pool when
    the client connects, the restarted server's pool when it reconnects (before anything
    in it is lent), and the end of the first one's mapping only once the loan and the
    reservation made in it are settled, so nothing registered is unmapped under a copy."""
    import signal

    from umbp.runtime.server.launch import start_server, stop_server

    store, watcher = watched_store(server, io_timeout_s=5.0)
    assert watcher.heard == []  # not connected yet
    assert store.put_batch(["a"], [content(8, 100)]) == (True,)
    ((kind, first, nbytes),) = watcher.heard
    assert (kind, nbytes) == ("mapped", 16 << 20)
    loan = store.lend(["a"], 100)
    reservation = store.reserve(["b"], 100)
    assert first <= int(loan.memory.ctypes.data) < first + nbytes
    server.send_signal(signal.SIGKILL)
    server.wait()
    second_server = start_server(server.socket_path, 32 << 20, page_bytes=PAGE,
                                 log_path=str(tmp_path / "second.log"))
    try:
        assert store.lookup(["a"]) == (False,)  # reconnected at once: the new, empty pool
        assert store.put_batch(["c"], [content(9, 100)]) == (True,)
        assert len(watcher.heard) == 2
        kind, second, nbytes = watcher.heard[1]
        assert (kind, nbytes) == ("mapped", 32 << 20) and second != first
        loan.release()
        assert len(watcher.heard) == 2  # the reservation is still out in the first pool
        assert reservation.commit([True]) == (False,)
        assert watcher.heard[2:] == [("unmapping", first, 0)]
        store.close()
        assert watcher.heard[3:] == [("unmapping", second, 0)]
    finally:
        store.close()
        stop_server(second_server, server.socket_path)


def test_a_server_that_was_only_slow_keeps_its_pool_mapped_across_the_reconnection(
    server: Any,
) -> None:
    """A timed-out exchange drops the connection, but the server may be alive: when the
    same server answers the reconnection, its pool is taken up as it was, not mapped (and,
    on a GPU, registered) a second time; a loan made before goes on in it. Letting go
    comes once no connection holds it, at close."""
    import signal

    store, watcher = watched_store(server, io_timeout_s=0.5)
    try:
        assert store.put_batch(["a"], [content(10, 100)]) == (True,)
        ((_, address, nbytes),) = watcher.heard
        loan = store.lend(["a"], 100)
        stop_process(server.pid)
        try:
            with pytest.raises(StoreUnavailable, match="TimeoutError"):
                store.lookup(["a"])
        finally:
            server.send_signal(signal.SIGCONT)
        assert store.put_batch(["b"], [content(11, 100)]) == (True,)  # reconnected
        again = store.lend(["b"], 100)
        assert address <= int(again.memory.ctypes.data) < address + nbytes
        (pages,) = again.pages
        assert pages is not None and object_bytes(again.memory, pages, 100) == content(11, 100)
        assert again.verify() == (LoadStatus.HIT,)
        again.release()
        loan.release()  # its connection's end: the link still holds the mapping
        assert watcher.heard == [("mapped", address, nbytes)]
        store.close()
        assert watcher.heard[1:] == [("unmapping", address, 0)]
    finally:
        store.close()


def test_a_watcher_added_while_connected_hears_of_the_pool_at_once(store: ServerStore) -> None:
    assert store.lookup(["x"]) == (False,)
    watcher = Watcher()
    store.watch_lent_memory(watcher)
    ((kind, address, nbytes),) = watcher.heard
    assert (kind, nbytes) == ("mapped", 16 << 20)
    loan = store.lend(["x"], 100)
    assert address <= int(loan.memory.ctypes.data) < address + nbytes
    loan.release()
