"""Start-up of large pools: populated in steps (several threads where the kernel allows),
progress reported while it lasts, stoppable; `start_server` waits for a server that logs
progress instead of killing it after `wait_s`.

No test asserts a time: progress is made observable by fills that wait for the report of
the step before them.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from umbp.runtime.host_memory import allocate_prefaulted_slab
from umbp.runtime.population import PopulationStopped, Progress, populate
from umbp.runtime.server import shm
from umbp.runtime.server.launch import ServerStartError, _wait_until_answering

MIB = 1 << 20


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_the_steps_cover_the_area_exactly_once(threads: int) -> None:
    total, step = 10 * MIB + 5, MIB
    filled: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fill(offset: int, length: int) -> None:
        with lock:
            filled.append((offset, length))

    final = populate(total, fill, threads=threads, step_bytes=step)
    assert final.finished and final.done_bytes == total
    assert sorted(filled) == [(offset, min(step, total - offset))
                              for offset in range(0, total, step)]


def test_progress_is_reported_after_every_step_while_it_lasts() -> None:
    """Each step waits until the one before it was reported, so every intermediate
    figure must appear, in order (the whole one may too, or only in the returned value)."""
    total, step = 6 * MIB, MIB
    reported: list[int] = []
    seen = threading.Condition()

    def fill(offset: int, length: int) -> None:
        with seen:
            assert seen.wait_for(lambda: offset == 0 or offset in reported, timeout=60)

    def report(progress: Progress) -> None:
        assert progress.total_bytes == total
        with seen:
            if not reported or reported[-1] != progress.done_bytes:
                reported.append(progress.done_bytes)
            seen.notify_all()

    populate(total, fill, threads=1, step_bytes=step, report=report, interval_s=0)
    assert reported[0] == 0 or reported[0] == MIB
    assert [done for done in reported if 0 < done < total] == list(range(MIB, total, MIB))


def test_a_failing_step_stops_the_population_and_is_raised() -> None:
    taken: list[int] = []

    def fill(offset: int, length: int) -> None:
        taken.append(offset)
        if offset == 2 * MIB:
            raise OSError(errno.ENOSPC, "no room")

    with pytest.raises(OSError, match="no room"):
        populate(8 * MIB, fill, threads=1, step_bytes=MIB)
    assert taken == [0, MIB, 2 * MIB]


def test_a_stop_request_ends_it_between_steps() -> None:
    taken: list[int] = []
    with pytest.raises(PopulationStopped, match="stopped after"):
        populate(8 * MIB, lambda offset, length: taken.append(offset), threads=1,
                 step_bytes=MIB, should_stop=lambda: bool(taken))
    assert 1 <= len(taken) < 8


def test_progress_reads_as_an_operator_wants_it() -> None:
    assert Progress(12 << 30, 64 << 30, 4.0).describe() == (
        "12.0 of 64.0 GiB in 4.0 s (3.0 GiB/s, about 17 s left)"
    )
    assert Progress(64 << 30, 64 << 30, 20.0).describe() == "64.0 of 64.0 GiB in 20.0 s (3.2 GiB/s)"


def test_a_prefaulted_slab_is_whole_and_zero() -> None:
    slab = allocate_prefaulted_slab(64 * MIB + 4096)
    try:
        assert len(slab) == 64 * MIB + 4096
        assert slab[:].count(0) == len(slab)
        slab[-1:] = b"\x01"  # writable to its last byte
    finally:
        slab.close()


def test_a_shared_pool_stopped_while_allocated_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(PopulationStopped):
        shm.create_shared_pool(8 * MIB, tmp_path, should_stop=lambda: True)
    assert list(tmp_path.iterdir()) == []
    pool = shm.create_shared_pool(8 * MIB, tmp_path)
    try:
        assert pool.nbytes == 8 * MIB and Path(pool.path).stat().st_blocks * 512 >= 8 * MIB
    finally:
        shm.release_shared_pool(pool)


# ------------------------------------------------------ waiting for a server to answer


def spawn(script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", script])


def test_a_server_that_logs_progress_is_waited_for_beyond_wait_s(tmp_path: Path) -> None:
    """Logs a line every 50 ms for 2.5 s, then exits: with wait_s 1 s it is seen exit,
    not killed for silence."""
    log = tmp_path / "serve.log"
    log.write_text("")
    process = spawn(
        "import time\n"
        f"for i in range(50):\n    open({str(log)!r}, 'a').write('populating\\n'); time.sleep(0.05)\n"
    )
    with pytest.raises(ServerStartError, match="exited with status 0 before answering"):
        _wait_until_answering(process, str(tmp_path / "none.sock"), 1.0, str(log))


def test_a_silent_server_is_killed_after_wait_s(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_text("")
    process = spawn("import time; time.sleep(60)")
    with pytest.raises(ServerStartError, match="nor log anything, for 0.5 s"):
        _wait_until_answering(process, str(tmp_path / "none.sock"), 0.5, str(log))
    assert process.poll() is not None
