"""`SharedLock` (umbp/runtime/shared_lock.py): shared holders overlap, a holder alone
excludes everyone, and a waiting holder alone bars new shared holders (no starvation)."""

from __future__ import annotations

import threading

from umbp.runtime.shared_lock import SharedLock

WAIT_S = 30.0


def test_shared_holders_overlap() -> None:
    lock = SharedLock()
    inside = threading.Barrier(3, timeout=WAIT_S)

    def hold_shared() -> None:
        with lock.shared():
            inside.wait()  # all three are inside at once, or this breaks

    threads = [threading.Thread(target=hold_shared) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not inside.broken


def test_a_waiting_writer_bars_new_readers_and_goes_first() -> None:
    lock = SharedLock()
    order: list[str] = []
    first_reader_in = threading.Event()
    release_first_reader = threading.Event()

    def first_reader() -> None:
        with lock.shared():
            first_reader_in.set()
            assert release_first_reader.wait(WAIT_S)
            order.append("first reader out")

    def writer() -> None:
        with lock.alone():
            order.append("writer")

    def late_reader() -> None:
        with lock.shared():
            order.append("late reader")

    reader = threading.Thread(target=first_reader)
    reader.start()
    assert first_reader_in.wait(WAIT_S)
    writing = threading.Thread(target=writer)
    writing.start()
    while not lock._waiting_alone:  # the writer is queued behind the first reader
        threading.Event().wait(0.001)
    late = threading.Thread(target=late_reader)
    late.start()
    late.join(0.2)
    assert late.is_alive(), "a new reader went ahead of a waiting writer"
    release_first_reader.set()
    for thread in (reader, writing, late):
        thread.join(WAIT_S)
    assert order == ["first reader out", "writer", "late reader"]


def test_a_holder_alone_excludes_shared_holders() -> None:
    lock = SharedLock()
    entered = threading.Event()

    def read() -> None:
        with lock.shared():
            entered.set()

    with lock.alone():
        reader = threading.Thread(target=read)
        reader.start()
        assert not entered.wait(0.2), "a shared holder got in beside a holder alone"
    assert entered.wait(WAIT_S)
    reader.join(WAIT_S)
