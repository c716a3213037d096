"""`umbp serve` as a trust boundary, with real processes, a real second user and a real
full filesystem: who serves at a socket path, which files it touches, what it refuses at
start-up, and how it survives a disk that another file fills.

Tests that need a second user create one (CI runs as root) and drop privileges for the
attacking side with `setpriv`; they skip, saying so, when not run as root.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.harness import server_events
from umbp.runtime.contract import LoadStatus
from umbp.runtime.server import ServerStore
from umbp.runtime.server.launch import (
    ServerStartError,
    server_reachable,
    start_server,
    stop_server,
)
from umbp.runtime.ssd.format import RECORD_BYTES, SLOT_FILE_NAME, SUPERBLOCK_BYTES
from umbp.testing.faults import stop_process
from umbp.testing.tmpfs import CannotMount, small_tmpfs

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KIB, MIB = 1 << 10, 1 << 20
ATTACKER = "umbp-t-attacker"


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short private directory (Unix socket paths are limited to 108 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="umbp-tr-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def serve_fails(*args: str, timeout: float = 120.0) -> str:
    """Run `umbp serve ARGS`, expect it to refuse to start (status 1 or 2); its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "umbp.cli", "serve", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode in (1, 2), (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def wait_until(condition: Callable[[], bool], seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def read_back(store: ServerStore, keys: list[str], size: int) -> list[tuple[LoadStatus, bytes]]:
    outs = [bytearray(size) for _ in keys]
    statuses = store.get_batch_into(keys, outs)
    return [(status, bytes(out)) for status, out in zip(statuses, outs)]


# ------------------------------------------------------- who serves at a path


def test_a_second_serve_never_clobbers_a_stopped_server_with_a_full_backlog(
    workdir: Path,
) -> None:
    """The old connect probe failed against a stopped server whose accept backlog was
    full, and the newcomer deleted the live socket and pool. The lock decides now."""
    path = str(workdir / "umbp.sock")
    live = start_server(path, 1 * MIB, page_bytes=4096, log_path=str(workdir / "a.log"))
    backlog: list[socket.socket] = []
    try:
        with ServerStore(path) as store:
            assert store.put_batch(["kept"], [payload(1, 9000)]) == (True,)
            pool_file = store.server_stats()["server"]["shm_path"]
        stop_process(live.pid)
        while len(backlog) < 1000:  # fill the backlog until connect would block
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(path)
            except BlockingIOError:
                sock.close()
                break
            backlog.append(sock)
        assert len(backlog) < 1000, "the backlog never filled"
        error = serve_fails("--socket", path, "--capacity", "1M")
        assert f"another umbp serve (pid {live.pid}) owns {path}" in error, error
        assert os.path.exists(path) and os.path.exists(pool_file)
        for sock in backlog:
            sock.close()
        backlog.clear()
        os.kill(live.pid, signal.SIGCONT)
        # Until it has drained its backlog a connect may still be refused (the client
        # answers UNAVAILABLE then, never blocks): wait for it to answer.
        assert wait_until(lambda: server_reachable(path, 1.0))
        with ServerStore(path) as store:
            assert read_back(store, ["kept"], 9000) == [(LoadStatus.HIT, payload(1, 9000))]
    finally:
        for sock in backlog:
            sock.close()
        stop_server(live, path)


def test_the_connectors_auto_start_lock_does_not_stop_the_server_it_starts(
    workdir: Path,
) -> None:
    """auto_start holds an flock on `<socket>.lock` while it starts a server; the server's
    own ownership lock is another file, or it would refuse to start under it."""
    import fcntl

    path = str(workdir / "run" / "umbp.sock")
    Path(path).parent.mkdir(mode=0o700)
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        server = start_server(path, 1 * MIB, page_bytes=4096, log_path=str(workdir / "s.log"))
        stop_server(server, path)
    finally:
        os.close(fd)


def test_only_what_is_provably_a_dead_servers_is_deleted(workdir: Path) -> None:
    """A regular file or a symlink at the socket path is refused, not deleted; a planted
    `<socket>.pool` naming a live server's pool deletes nothing; an invalid-UTF-8 record
    does not block start-up; a SIGKILLed server's socket and pool are cleaned up."""
    regular = workdir / "regular.sock"
    regular.write_text("someone's data")
    error = serve_fails("--socket", str(regular), "--capacity", "1M")
    assert "is not a socket left by a umbp server of yours" in error
    assert regular.read_text() == "someone's data"
    target = workdir / "target"
    target.write_text("keep me")
    (workdir / "link.sock").symlink_to(target)
    error = serve_fails("--socket", str(workdir / "link.sock"), "--capacity", "1M")
    assert "is not a socket" in error
    assert target.read_text() == "keep me"

    first, second = str(workdir / "first.sock"), str(workdir / "second.sock")
    live = start_server(first, 1 * MIB, page_bytes=4096, log_path=str(workdir / "a.log"))
    try:
        with ServerStore(first) as store:
            assert store.put_batch(["kept"], [payload(2, 5000)]) == (True,)
            live_pool = store.server_stats()["server"]["shm_path"]
        fd = os.open(second + ".pool", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, (live_pool + "\n").encode())
        os.close(fd)
        other = start_server(second, 1 * MIB, page_bytes=4096, log_path=str(workdir / "b.log"))
        stop_server(other, second)
        assert os.path.exists(live_pool), "a planted record made start-up delete a live pool"
        with ServerStore(first) as store:
            assert read_back(store, ["kept"], 5000) == [(LoadStatus.HIT, payload(2, 5000))]
        fd = os.open(second + ".pool", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"\xff\xfe/dev/shm/umbp-\x80\n")
        os.close(fd)
        other = start_server(second, 1 * MIB, page_bytes=4096, log_path=str(workdir / "b.log"))
        with ServerStore(second) as store:
            killed_pool = store.server_stats()["server"]["shm_path"]
        other.kill()
        other.wait()
        assert os.path.exists(second) and os.path.exists(killed_pool)  # what a kill leaves
        again = start_server(second, 1 * MIB, page_bytes=4096, log_path=str(workdir / "b.log"))
        assert not os.path.exists(killed_pool), "the dead server's pool was not removed"
        stop_server(again, second)
    finally:
        stop_server(live, first)


# ------------------------------------------------------------------- files


def test_the_slot_file_is_never_followed_or_adopted_when_others_can_read_it(
    workdir: Path,
) -> None:
    secret = workdir / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    ssd = workdir / "ssd"
    ssd.mkdir(mode=0o700)
    (ssd / SLOT_FILE_NAME).symlink_to(secret)
    sock = str(workdir / "umbp.sock")
    error = serve_fails("--socket", sock, "--capacity", "1M", "--ssd-dir", str(ssd),
                        "--ssd-capacity", "1M")  # fmt: skip
    assert "is a symbolic link; remove it" in error, error
    assert secret.read_bytes() == b"root only" and secret.stat().st_size == 9
    (ssd / SLOT_FILE_NAME).unlink()
    readable = ssd / SLOT_FILE_NAME
    readable.write_bytes(b"")
    readable.chmod(0o644)
    error = serve_fails("--socket", sock, "--capacity", "1M", "--ssd-dir", str(ssd),
                        "--ssd-capacity", "1M")  # fmt: skip
    assert "is open to other users (mode 0644); run chmod 600" in error, error
    assert not os.path.exists(sock)
    # A private file of ours that umbp did not make (it was emptied and reused before).
    readable.chmod(0o600)
    foreign = random.Random(3).randbytes(100_000)
    readable.write_bytes(foreign)
    error = serve_fails("--socket", sock, "--capacity", "1M", "--ssd-dir", str(ssd),
                        "--ssd-capacity", "1M")  # fmt: skip
    assert f"{readable} is not an umbp SSD slot file" in error, error
    assert "move it away or choose another --ssd-dir" in error, error
    assert readable.read_bytes() == foreign
    assert not os.path.exists(sock)


def test_directories_others_can_write_are_refused_unless_sticky(workdir: Path) -> None:
    shared = workdir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    error = serve_fails("--socket", str(shared / "umbp.sock"), "--capacity", "1M")
    assert "is writable by other users (mode 0777); run chmod go-w" in error, error
    private = workdir / "private"
    private.mkdir(mode=0o700)
    error = serve_fails("--socket", str(private / "umbp.sock"), "--capacity", "1M",
                        "--ssd-dir", str(shared), "--ssd-capacity", "1M")  # fmt: skip
    assert "SSD directory" in error and "writable by other users" in error, error
    sticky = workdir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: nobody can rename or delete another's entries
    path = str(sticky / "umbp.sock")
    server = start_server(path, 1 * MIB, page_bytes=4096, log_path=str(workdir / "s.log"))
    stop_server(server, path)


def test_a_servers_log_is_never_followed_or_shared(workdir: Path) -> None:
    """The log names the pool's file: a symbolic link or a log others may read is
    refused before any server starts, and the error names it."""
    path = str(workdir / "umbp.sock")
    target = workdir / "elsewhere.log"
    link = workdir / "link.log"
    link.symlink_to(target)
    with pytest.raises(ServerStartError, match="is a symbolic link"):
        start_server(path, 1 * MIB, page_bytes=4096, log_path=str(link))
    assert not target.exists()
    shared = workdir / "shared.log"
    shared.write_text("")
    shared.chmod(0o644)
    with pytest.raises(ServerStartError, match="open to other users"):
        start_server(path, 1 * MIB, page_bytes=4096, log_path=str(shared))
    assert not server_reachable(path, 1.0)


# ------------------------------------------------------------ another user


@pytest.fixture(scope="module")
def attacker() -> Iterator[tuple[int, int]]:
    """(uid, gid) of a second, unprivileged user, created for these tests."""
    if os.geteuid() != 0:
        pytest.skip("creating a second user needs root (CI runs as root)")
    created = False
    try:
        pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        ATTACKER], check=True, capture_output=True)  # fmt: skip
        created = True
    entry = pwd.getpwnam(ATTACKER)
    yield entry.pw_uid, entry.pw_gid
    if created:
        subprocess.run(["userdel", ATTACKER], check=False, capture_output=True)


def as_user(user: tuple[int, int], script: str) -> subprocess.CompletedProcess[str]:
    """`script` run by the system Python as `user` (no groups, no capabilities)."""
    uid, gid = user
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "/usr/bin/python3",
         "-c", script],
        capture_output=True, text=True, timeout=60, check=False, cwd="/",
    )  # fmt: skip


def test_another_users_directories_and_files_are_refused(
    workdir: Path, attacker: tuple[int, int]
) -> None:
    uid, gid = attacker
    workdir.chmod(0o755)  # the attacker may reach his own directories below it
    theirs = workdir / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, uid, gid)
    error = serve_fails("--socket", str(theirs / "umbp.sock"), "--capacity", "1M")
    assert f"socket directory {theirs} belongs to uid {uid}, not to you" in error, error
    mine = workdir / "mine"
    mine.mkdir(mode=0o700)
    sock = str(mine / "umbp.sock")
    error = serve_fails("--socket", sock, "--capacity", "1M", "--ssd-dir", str(theirs),
                        "--ssd-capacity", "1M")  # fmt: skip
    assert f"SSD directory {theirs} belongs to uid {uid}" in error, error
    # His slot file (mode 0644: he would read the cached KV, and his bytes would be served)
    # in a directory of ours: refused, not adopted.
    ssd = mine / "ssd"
    ssd.mkdir(mode=0o700)
    planted = ssd / SLOT_FILE_NAME
    planted.write_bytes(b"his bytes")
    os.chown(planted, uid, gid)
    planted.chmod(0o644)
    error = serve_fails("--socket", sock, "--capacity", "1M", "--ssd-dir", str(ssd),
                        "--ssd-capacity", "1M")  # fmt: skip
    assert f"SSD slot file {planted} belongs to uid {uid}" in error, error
    assert planted.read_bytes() == b"his bytes"
    # In a sticky shared directory he may plant a symlink named like our slot file.
    sticky = workdir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    secret = workdir / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    planted_link = as_user(attacker, f"import os; os.symlink({str(secret)!r}, "
                                     f"{str(sticky / SLOT_FILE_NAME)!r})")
    assert planted_link.returncode == 0, planted_link.stderr
    error = serve_fails("--socket", sock, "--capacity", "1M", "--ssd-dir", str(sticky),
                        "--ssd-capacity", "1M")  # fmt: skip
    assert "is a symbolic link" in error, error
    assert secret.read_bytes() == b"root only"


def test_another_user_can_neither_connect_nor_map_the_pool(
    workdir: Path, attacker: tuple[int, int]
) -> None:
    workdir.chmod(0o755)
    sock = str(workdir / "run" / "umbp.sock")
    server = start_server(sock, 1 * MIB, page_bytes=4096, log_path=str(workdir / "s.log"))
    try:
        with ServerStore(sock) as store:
            pool = store.server_stats()["server"]["shm_path"]
        script = f"""
import os, socket
results = []
try:
    s = socket.socket(socket.AF_UNIX); s.connect({sock!r}); results.append("connected")
except OSError as error:
    results.append(type(error).__name__)
try:
    os.open({pool!r}, os.O_RDONLY); results.append("opened")
except OSError as error:
    results.append(type(error).__name__)
print(",".join(results))
"""
        done = as_user(attacker, script)
        assert done.stdout.strip() == "PermissionError,PermissionError", (done.stdout, done.stderr)
    finally:
        stop_server(server, sock)


# ---------------------------------------------------------------- full disk


@pytest.fixture
def small_filesystem(workdir: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (root only); unmounted after, lazily if something holds it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        with small_tmpfs(workdir / "small", "2m") as mount_point:
            yield mount_point
    except CannotMount as reason:
        pytest.skip(str(reason))


def test_a_full_disk_costs_the_ssd_tier_nothing_once_it_started(
    workdir: Path, small_filesystem: Path
) -> None:
    """8 MiB asked of a 2 MiB filesystem: start-up fails, naming the figures (it used to
    start, grow as written and lose slots at every ENOSPC: 54 of 480 gets hit). 1 MiB
    fits, is reserved at start, and another file then filling the disk costs nothing."""
    sock = str(workdir / "run" / "umbp.sock")
    ssd = small_filesystem / "ssd"
    error = serve_fails("--socket", sock, "--capacity", "128K", "--page-bytes", "4096",
                        "--ssd-dir", str(ssd), "--ssd-capacity", "8M")  # fmt: skip
    assert "the SSD tier needs" in error and "lower --ssd-capacity or free space" in error, error
    server = start_server(sock, 128 * KIB, page_bytes=4096, ssd_dir=str(ssd),
                          ssd_capacity_bytes=1 * MIB, log_path=str(workdir / "s.log"))
    try:
        with open(small_filesystem / "filler", "ab", buffering=0) as filler:
            try:
                while True:
                    filler.write(bytes(64 * KIB))
            except OSError as full:
                assert full.errno == errno.ENOSPC
        keys = [f"obj-{index}" for index in range(40)]
        with ServerStore(sock) as store:
            for index, key in enumerate(keys):
                assert store.put_batch([key], [payload(index, 20 * KIB)]) == (True,)
            # One at a time: a batch larger than DRAM would find its own pins in the way.
            answers = [read_back(store, [key], 20 * KIB)[0] for key in keys]
            figures = store.server_stats()
        hits = [i for i, (status, data) in enumerate(answers) if status is LoadStatus.HIT]
        for index, (status, data) in enumerate(answers):
            assert status in (LoadStatus.HIT, LoadStatus.MISSING), status
            if status is LoadStatus.HIT:
                assert data == payload(index, 20 * KIB), keys[index]
        assert figures["counters"]["ssd_put_failures"] == 0, figures["counters"]
        assert figures["ssd"]["capacity_bytes"] == 1 * MIB  # no slot retired
        assert len(hits) >= 16, len(hits)  # every one of the 16 SSD slots still works
        print(f"full disk: {len(hits)} of {len(keys)} objects hit, 0 SSD write failures")
    finally:
        stop_server(server, sock)


# -------------------------------------------------------- start-up values


def test_absurd_sizes_are_refused_with_a_clear_error(workdir: Path) -> None:
    sock = str(workdir / "umbp.sock")
    assert "not a byte count: 'infG'" in serve_fails("--socket", sock, "--capacity", "infG")
    assert "is outside [0, 1125899906842624] bytes" in serve_fails(
        "--socket", sock, "--capacity", "1M", "--ssd-dir", str(workdir / "ssd"),
        "--ssd-capacity", "1EiB")
    assert "not a whole number of bytes" in serve_fails("--socket", sock, "--capacity", "1.5")
    assert "/dev/shm has" in serve_fails("--socket", sock, "--capacity", "1P")
    assert "the SSD tier needs" in serve_fails(
        "--socket", sock, "--capacity", "1M", "--ssd-dir", str(workdir / "ssd"),
        "--ssd-capacity", "1P")
    assert "outside (0, 1]" in serve_fails("--socket", sock, "--capacity", "1M",
                                           "--high-watermark", "nan")
    assert not os.path.exists(sock)


# ----------------------------------------------------------- lost at restart


def test_objects_lost_at_restart_are_logged_and_counted(workdir: Path) -> None:
    sock = str(workdir / "run" / "umbp.sock")
    ssd = workdir / "ssd"
    log = workdir / "s.log"
    keys = [f"obj-{index}" for index in range(10)]

    def start() -> subprocess.Popen[bytes]:
        return start_server(sock, 1 * MIB, page_bytes=4096, ssd_dir=str(ssd),
                            ssd_capacity_bytes=4 * MIB, log_path=str(log), persist_on_exit=True)

    server = start()
    with ServerStore(sock) as store:
        for index, key in enumerate(keys):
            assert store.put_batch([key], [payload(index, 20 * KIB)]) == (True,)
    stop_server(server, sock)
    slot_file = ssd / SLOT_FILE_NAME
    with open(slot_file, "r+b") as raw:  # garbage over three records (not zeros, no magic)
        raw.seek(SUPERBLOCK_BYTES)
        raw.write(random.Random(7).randbytes(3 * RECORD_BYTES))
    log.write_bytes(b"")
    server = start()
    try:
        with ServerStore(sock) as store:
            figures = store.server_stats()
            answers = read_back(store, keys, 20 * KIB)
        assert figures["ssd"]["dropped_at_open"] == 3, figures["ssd"]
        assert sum(status is LoadStatus.HIT for status, _ in answers) == 7
        events = server_events(log, "ssd_opened")
        assert events == [{"event": "ssd_opened", "objects": 7, "dropped_at_open": 3}], events
        assert "dropped 3 damaged or incomplete entries" in log.read_text()
    finally:
        stop_server(server, sock)
    os.truncate(slot_file, 100)  # into the superblock's 4 KiB (its fields survive)
    log.write_bytes(b"")
    server = start()
    try:
        with ServerStore(sock) as store:
            assert store.server_stats()["ssd"]["dropped_at_open"] >= 1
        text = log.read_text()
        assert "was truncated to 100 of its" in text and "are lost" in text, text
    finally:
        stop_server(server, sock)
    os.truncate(slot_file, 20)  # through the superblock's fields
    log.write_bytes(b"")
    server = start()
    try:
        with ServerStore(sock) as store:
            assert store.server_stats()["ssd"]["dropped_at_open"] >= 1
        assert "damaged or truncated superblock" in log.read_text()
    finally:
        stop_server(server, sock)


# ------------------------------------------------------------------ stats


def test_umbp_stats_after_a_restart_served_from_ssd_shows_hits_not_misses(
    workdir: Path,
) -> None:
    """Everything restored from SSD after a restart: hits (all of them SSD hits), no
    misses, and `umbp stats` does not count its own connection."""
    sock = str(workdir / "run" / "umbp.sock")
    keys = [f"obj-{index}" for index in range(12)]

    def start() -> subprocess.Popen[bytes]:
        return start_server(sock, 1 * MIB, page_bytes=4096, ssd_dir=str(workdir / "ssd"),
                            ssd_capacity_bytes=4 * MIB, log_path=str(workdir / "s.log"),
                            persist_on_exit=True)

    server = start()
    with ServerStore(sock) as store:
        assert store.put_batch(keys, [payload(i, 10 * KIB) for i in range(12)]) == (True,) * 12
    stop_server(server, sock)
    server = start()
    try:
        with ServerStore(sock) as store:
            answers = read_back(store, keys, 10 * KIB)
        assert answers == [(LoadStatus.HIT, payload(i, 10 * KIB)) for i in range(12)]
        command = [sys.executable, "-m", "umbp.cli", "stats", "--socket", sock]
        raw = subprocess.run([*command, "--json"], cwd=REPO, capture_output=True, text=True,
                             timeout=60, check=True)  # fmt: skip
        figures = json.loads(raw.stdout)
        counters = figures["counters"]
        assert (counters["hits"], counters["hits_from_ssd"], counters["misses"]) == (12, 12, 0)
        assert figures["sessions"]["connections"] == 0
        table = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60,
                               check=True).stdout  # fmt: skip
        assert any(line.split() == ["other", "connections", "now", "0", "(puts", "in",
                                    "flight", "0,", "gets", "in", "flight", "0)"]
                   for line in table.splitlines()), table  # fmt: skip
        assert any(line.split() == ["of", "them", "from", "SSD", "12"]
                   for line in table.splitlines()), table
    finally:
        stop_server(server, sock)
