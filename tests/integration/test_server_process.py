"""`umbp serve` as a real process, with real faults: SIGKILL, SIGSTOP, SIGTERM, bytes
flipped in its shared memory and in its SSD slot file, a disk that fills up, clients that
vanish mid-put. No mocks; no wall-clock performance assertions (the bounds on stalled
calls are liveness bounds, generous by design)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.harness import server_events
from umbp.runtime.contract import LoadStatus, StoreUnavailable
from umbp.runtime.server import (
    ServerStartError,
    ServerStore,
    protocol,
    server_reachable,
    start_server,
)
from umbp.runtime.server.launch import serve_command
from umbp.runtime.ssd.format import SLOT_FILE_NAME
from umbp.testing.faults import stop_process

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KIB = 1 << 10
MIB = 1 << 20


class Servers:
    """Starts servers in a short temporary directory (Unix socket paths are limited to
    108 bytes, pytest's tmp_path can be longer) and kills what is left at the end."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="umbp-t-", dir="/tmp"))
        self.socket = str(self.directory / "run" / "umbp.sock")
        self.ssd_dir = str(self.directory / "ssd")
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, capacity: int = 4 * MIB, **options: Any) -> subprocess.Popen[bytes]:
        process = start_server(self.socket, capacity, page_bytes=options.pop("page_bytes", 4096),
                               log_path=str(self.directory / "serve.log"), **options)
        self.processes.append(process)
        return process

    def start_with_ssd(self, capacity: int, ssd_capacity: int) -> subprocess.Popen[bytes]:
        return self.start(capacity, ssd_dir=self.ssd_dir, ssd_capacity_bytes=ssd_capacity)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        record = Path(self.socket + ".pool")
        if record.exists():  # a server that was SIGKILLed last leaves its pool behind
            Path(record.read_text().strip()).unlink(missing_ok=True)
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def servers() -> Iterator[Servers]:
    started = Servers()
    try:
        yield started
    finally:
        started.close()


def payloads(count: int, nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, nbytes), dtype=np.uint8)


def keys_of(count: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{index}" for index in range(count)]


def load(
    store: ServerStore, keys: list[str], nbytes: int, batch: int = 4
) -> tuple[tuple[LoadStatus, ...], np.ndarray]:
    """Gets in batches of `batch` (a batch of cold objects must fit in DRAM at once: they
    are promoted there and pinned until copied out)."""
    outs = np.zeros((len(keys), nbytes), dtype=np.uint8)
    statuses: list[LoadStatus] = []
    for start in range(0, len(keys), batch):
        part = range(start, min(start + batch, len(keys)))
        statuses += store.get_batch_into([keys[i] for i in part], [outs[i] for i in part])
    return tuple(statuses), outs


def wait_until(condition: Callable[[], bool], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def shm_path(store: ServerStore) -> str:
    return str(store.server_stats()["server"]["shm_path"])


def answers_lookup(store: ServerStore, keys: list[str]) -> bool:
    try:
        store.lookup(keys)
    except StoreUnavailable:
        return False
    return True


# ------------------------------------------------------------------ the basics


def test_roundtrip_is_bit_identical_and_the_bytes_live_in_the_shared_pool(
    servers: Servers,
) -> None:
    servers.start(4 * MIB)
    sizes = [1, 4095, 4096, 4097, 100 * KIB]
    with ServerStore(servers.socket, io_timeout_s=5.0) as store:
        for size in sizes:
            data = payloads(3, size, seed=size)
            keys = keys_of(3, f"s{size}-")
            assert store.put_batch(keys, [data[i] for i in range(3)]) == (True, True, True)
            statuses, outs = load(store, keys, size)
            assert statuses == (LoadStatus.HIT,) * 3
            assert np.array_equal(outs, data)
        pool_file = shm_path(store)
        assert stat.S_IMODE(os.stat(servers.socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(Path(servers.socket).parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(pool_file).st_mode) == 0o600
        big = payloads(3, 100 * KIB, seed=100 * KIB)
        assert big[1].tobytes() in Path(pool_file).read_bytes(), "the payload is in shm"
        assert store.lookup(["s1-0", "nope"]) == (True, False)
        assert store.where(["s1-0", "nope"]) == ("CPU", None)
        assert store.put_batch(["s1-0"], [memoryview(b"\x00")]) == (True,), "resident: True"
        statuses, _ = load(store, ["s1-0"], 2)
        assert statuses == (LoadStatus.SIZE_MISMATCH,)
        stats = store.stats()
        assert stats.puts == 3 * len(sizes) and stats.hits == 3 * len(sizes)
        assert store.clear() and store.lookup(["s1-0"]) == (False,)


def test_a_pool_dir_holds_the_pool_and_a_killed_servers_pool_is_removed_from_it(
    servers: Servers,
) -> None:
    """`--pool-dir` (here a directory on /dev/shm's tmpfs): the pool file lies there, the
    `populated` event says which pages it got, and the next server at the socket removes
    the pool a SIGKILLed one left there."""
    pool_dir = Path(tempfile.mkdtemp(prefix="umbp-pool-", dir="/dev/shm"))
    try:
        first = servers.start(4 * MIB, pool_dir=str(pool_dir))
        data = payloads(2, 100 * KIB, seed=7)
        with ServerStore(servers.socket, io_timeout_s=5.0) as store:
            assert store.put_batch(["a", "b"], [data[0], data[1]]) == (True, True)
            statuses, outs = load(store, ["a", "b"], 100 * KIB)
            assert statuses == (LoadStatus.HIT,) * 2 and np.array_equal(outs, data)
            left = shm_path(store)
        assert Path(left).parent == pool_dir and data[1].tobytes() in Path(left).read_bytes()
        (populated,) = server_events(servers.directory / "serve.log", "populated")
        assert populated["pool_mount"] == "/dev/shm"
        assert populated["huge_pages"] == (populated["huge"] in ("always", "within_size"))
        assert ("note" in populated) == (not populated["huge_pages"])
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert Path(left).exists(), "a killed server cannot remove its pool"
        servers.start(4 * MIB, pool_dir=str(pool_dir))
        assert not Path(left).exists()
        with ServerStore(servers.socket, io_timeout_s=5.0) as store:
            assert Path(shm_path(store)).parent == pool_dir
            assert store.lookup(["a"]) == (False,)
    finally:
        servers.close()
        shutil.rmtree(pool_dir, ignore_errors=True)


def test_kv_bytes_never_cross_the_socket(servers: Servers) -> None:
    """A raw protocol client: the put answer names regions of the pool, the commit carries
    only a checksum, and what a get reads back was written straight into the pool file."""
    servers.start(1 * MIB)
    pool_file = None
    with ServerStore(servers.socket) as store:
        pool_file = shm_path(store)
    marker = os.urandom(64 * KIB)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(servers.socket)
    deadline = protocol.Deadline(10.0)
    sent = 0

    def call(op: int, body: Any) -> Any:
        nonlocal sent
        frame = protocol.encode_json(op, body)
        sent += len(frame)
        protocol.send_all(sock, frame, deadline)
        _, answer = protocol.read_frame(sock, deadline)
        return json.loads(answer)

    answer = call(protocol.BEGIN_PUT, {"keys": ["m"], "sizes": [len(marker)]})
    (offset, _length), = answer["answers"][0]
    with open(pool_file, "r+b") as pool:
        pool.seek(offset)
        pool.write(marker)
    import xxhash

    assert call(protocol.COMMIT_PUT, {"token": answer["token"],
                                      "checksums": [xxhash.xxh3_64_intdigest(marker)]}) == [True]
    sock.close()
    assert sent < 1024, "a 64 KiB put sent only control messages"
    with ServerStore(servers.socket) as store:
        out = bytearray(len(marker))
        assert store.get_batch_into(["m"], [memoryview(out)]) == (LoadStatus.HIT,)
        assert bytes(out) == marker


def test_two_client_processes_share_objects(servers: Servers) -> None:
    servers.start(4 * MIB)
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        from umbp.runtime.server import ServerStore
        data = np.random.default_rng(1).integers(0, 256, size=(4, 30000), dtype=np.uint8)
        with ServerStore({servers.socket!r}) as store:
            ok = store.put_batch(["p0", "p1", "p2", "p3"], [data[i] for i in range(4)])
            sys.exit(0 if all(ok) else 1)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode()
    with ServerStore(servers.socket) as store:
        statuses, outs = load(store, ["p0", "p1", "p2", "p3"], 30000)
    assert statuses == (LoadStatus.HIT,) * 4
    assert np.array_equal(outs, payloads(4, 30000, seed=1))


def test_sigterm_shuts_down_cleanly(servers: Servers) -> None:
    process = servers.start(1 * MIB)
    with ServerStore(servers.socket) as store:
        assert store.put_batch(["a"], [memoryview(b"a" * 100)]) == (True,)
        pool_file = shm_path(store)
        assert os.path.exists(pool_file)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not os.path.exists(servers.socket)
        assert not os.path.exists(pool_file)
        assert not os.path.exists(servers.socket + ".pool")
        with pytest.raises(StoreUnavailable):
            store.lookup(["a"])


def test_sigint_shuts_down_cleanly(servers: Servers) -> None:
    process = servers.start(1 * MIB)
    with ServerStore(servers.socket) as store:
        pool_file = shm_path(store)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0
    assert not os.path.exists(servers.socket) and not os.path.exists(pool_file)


# ------------------------------------------------------------------- failures


def test_sigkill_fails_calls_cleanly_and_a_restarted_server_is_found_again(
    servers: Servers,
) -> None:
    process = servers.start(1 * MIB)
    data = payloads(2, 5000)
    store = ServerStore(servers.socket, io_timeout_s=2.0, reconnect_interval_s=0.2)
    try:
        assert store.put_batch(["a", "b"], [data[0], data[1]]) == (True, True)
        old_pool = shm_path(store)
        old_server = store.connected_server()
        process.kill()
        process.wait()
        with pytest.raises(StoreUnavailable):
            store.lookup(["a"])
        with pytest.raises(StoreUnavailable):
            store.where(["a"])
        assert store.put_batch(["c"], [data[0]]) == (False,)
        statuses, _ = load(store, ["a", "b"], 5000)
        assert statuses == (LoadStatus.UNAVAILABLE,) * 2
        assert store.connected_server() is None, "the dead server's mapping was dropped"

        servers.start(1 * MIB)
        assert not os.path.exists(old_pool), "the restarted server removed the orphan pool"
        assert wait_until(lambda: answers_lookup(store, ["a"]))
        assert store.connected_server() not in (None, old_server)
        assert store.lookup(["a", "b"]) == (False, False), "DRAM does not survive a restart"
        assert store.put_batch(["a"], [data[0]]) == (True,)
        statuses, outs = load(store, ["a"], 5000)
        assert statuses == (LoadStatus.HIT,) and np.array_equal(outs[0], data[0])
    finally:
        store.close()


def test_reconnects_are_throttled(servers: Servers) -> None:
    """With no server, calls fail fast and attempts happen at most once per interval: the
    server that appears meanwhile sees no connection from this client until it is due."""
    store = ServerStore(servers.socket, io_timeout_s=2.0, reconnect_interval_s=3600.0)
    try:
        with pytest.raises(StoreUnavailable):
            store.lookup(["a"])  # the first attempt: nothing there
        servers.start(1 * MIB)
        with ServerStore(servers.socket) as other:
            accepted = other.server_stats()["counters"]["connections"]
            for _ in range(20):
                with pytest.raises(StoreUnavailable, match="next attempt"):
                    store.lookup(["a"])
            assert other.server_stats()["counters"]["connections"] == accepted
    finally:
        store.close()


def test_a_stalled_server_costs_at_most_the_io_timeout(servers: Servers) -> None:
    process = servers.start(1 * MIB)
    timeout = 1.0
    bound = timeout * 3 + 2  # liveness, not performance
    data = payloads(1, 5000)
    store = ServerStore(servers.socket, io_timeout_s=timeout, reconnect_interval_s=0.0)
    try:
        assert store.put_batch(["a"], [data[0]]) == (True,)
        stop_process(process.pid)
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.lookup(["a"])
            assert time.monotonic() - started < bound
            started = time.monotonic()
            assert store.put_batch(["b"], [data[0]]) == (False,)
            assert time.monotonic() - started < bound
            started = time.monotonic()
            statuses, _ = load(store, ["a"], 5000)
            assert statuses == (LoadStatus.UNAVAILABLE,)
            assert time.monotonic() - started < bound
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.where(["a"])
            assert time.monotonic() - started < bound
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert wait_until(lambda: answers_lookup(store, ["a"]))
        statuses, outs = load(store, ["a"], 5000)
        assert statuses == (LoadStatus.HIT,) and np.array_equal(outs[0], data[0])
        assert wait_until(
            lambda: store.server_stats()["sessions"]["pins"] == 0
            and store.server_stats()["sessions"]["reservations"] == 0
        ), "the abandoned connections' pins and reservations were released"
    finally:
        store.close()


def test_bytes_flipped_in_shared_memory_answer_corrupt_and_are_never_served(
    servers: Servers,
) -> None:
    servers.start(1 * MIB)
    data = payloads(2, 20000, seed=3)
    with ServerStore(servers.socket) as store:
        assert store.put_batch(["bad", "good"], [data[0], data[1]]) == (True, True)
        pool_file = shm_path(store)
        image = Path(pool_file).read_bytes()
        offset = image.index(data[0].tobytes()[:4096]) + 1234
        with open(pool_file, "r+b") as pool:
            pool.seek(offset)
            pool.write(bytes([image[offset] ^ 0x5A]))
        statuses, outs = load(store, ["bad", "good"], 20000)
        assert statuses == (LoadStatus.CORRUPT, LoadStatus.HIT)
        assert np.array_equal(outs[1], data[1])
        assert store.lookup(["bad", "good"]) == (False, True), "the corrupt object was dropped"
        statuses, _ = load(store, ["bad"], 20000)
        assert statuses == (LoadStatus.MISSING,)
        assert store.stats().corrupt_loads == 1


def test_a_client_that_drops_mid_put_or_mid_get_leaks_nothing(servers: Servers) -> None:
    servers.start(1 * MIB)
    with ServerStore(servers.socket) as store:
        assert store.put_batch(["held"], [memoryview(b"h" * 8192)]) == (True,)
        used_before = store.server_stats()["dram"]["used_bytes"]
    script = textwrap.dedent(f"""
        import os, signal, socket
        from umbp.runtime.server import protocol
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect({servers.socket!r})
        deadline = protocol.Deadline(10.0)
        for op, body in ((protocol.BEGIN_PUT, {{"keys": ["x", "y"], "sizes": [9000, 100000]}}),
                         (protocol.BEGIN_GET, {{"keys": ["held"], "sizes": [8192]}})):
            protocol.send_all(sock, protocol.encode_json(op, body), deadline)
            protocol.read_frame(sock, deadline)
        print("reserved and pinned", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          timeout=60, check=False)
    assert done.returncode == -signal.SIGKILL and b"reserved and pinned" in done.stdout
    with ServerStore(servers.socket) as store:
        # "connections" counts the others: the asking connection is not among them.
        assert wait_until(lambda: store.server_stats()["sessions"]["connections"] == 0)
        figures = store.server_stats()
        assert figures["sessions"]["reservations"] == 0
        assert figures["sessions"]["pins"] == 0
        assert figures["dram"]["used_bytes"] == used_before
        assert figures["dram"]["pinned_objects"] == 0
        assert store.lookup(["x", "y", "held"]) == (False, False, True)


# ---------------------------------------------------------------- the SSD tier


def test_objects_move_to_ssd_past_the_watermark_and_come_back_bit_identical(
    servers: Servers,
) -> None:
    servers.start_with_ssd(256 * KIB, 8 * MIB)
    data = payloads(24, 20 * KIB, seed=5)
    keys = keys_of(24)
    with ServerStore(servers.socket) as store:
        for index in range(24):
            assert store.put_batch([keys[index]], [data[index]]) == (True,)
        where = store.where(keys)
        assert "DISK" in where and "CPU" in where
        assert all(medium is not None for medium in where), "nothing was dropped"
        assert all(store.lookup(keys))
        figures = store.server_stats()
        assert figures["objects"] == 24 and figures["pid"] == servers.processes[-1].pid
        assert figures["counters"]["evictions_to_ssd"] > 0
        assert figures["counters"]["evictions_dropped"] == 0
        assert figures["ssd"]["enabled"] and figures["ssd"]["objects"] > 0
        statuses, outs = load(store, keys, 20 * KIB)
        assert statuses == (LoadStatus.HIT,) * 24
        assert np.array_equal(outs, data)
        assert store.server_stats()["counters"]["promotions"] > 0


def test_a_restarted_server_serves_what_its_predecessor_put_on_ssd(servers: Servers) -> None:
    # Without write-ahead: what never left DRAM has no SSD copy.
    process = servers.start(128 * KIB, ssd_dir=servers.ssd_dir, ssd_capacity_bytes=8 * MIB,
                            extra_args=["--write-ahead-bytes", "0"])
    data = payloads(16, 20 * KIB, seed=6)
    keys = keys_of(16)
    with ServerStore(servers.socket) as store:
        for index in range(16):
            assert store.put_batch([keys[index]], [data[index]]) == (True,)
        where = store.where(keys)
    on_disk = [key for key, medium in zip(keys, where) if medium == "DISK"]
    in_dram_only = [key for key, medium in zip(keys, where) if medium == "CPU"]
    assert on_disk and in_dram_only
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    servers.start_with_ssd(128 * KIB, 8 * MIB)
    with ServerStore(servers.socket) as store:
        assert store.where(on_disk) == ("DISK",) * len(on_disk)
        assert store.lookup(in_dram_only) == (False,) * len(in_dram_only), "DRAM is lost"
        positions = [keys.index(key) for key in on_disk]
        statuses, outs = load(store, on_disk, 20 * KIB)
        assert statuses == (LoadStatus.HIT,) * len(on_disk)
        assert np.array_equal(outs, data[positions])


def test_objects_written_ahead_outlive_a_restart_beside_those_evicted(servers: Servers) -> None:
    process = servers.start_with_ssd(128 * KIB, 8 * MIB)
    data = payloads(16, 20 * KIB, seed=6)
    keys = keys_of(16)
    with ServerStore(servers.socket) as store:
        for index in range(16):
            assert store.put_batch([keys[index]], [data[index]]) == (True,)
        evicted = [key for key, medium in zip(keys, store.where(keys)) if medium == "DISK"]
        figures = store.server_stats()
        deadline = time.monotonic() + 10.0
        while True:  # until the write-ahead thread has nothing left to write
            time.sleep(0.2)
            settled, figures = figures, store.server_stats()
            if settled["counters"]["written_ahead"] == figures["counters"]["written_ahead"]:
                break
            assert time.monotonic() < deadline, "the write-ahead never settled"
        on_ssd = figures["ssd"]["objects"]
    assert figures["counters"]["written_ahead"] > 0 and on_ssd > len(evicted) > 0
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    servers.start_with_ssd(128 * KIB, 8 * MIB)
    with ServerStore(servers.socket) as store:
        held = [key for key, found in zip(keys, store.lookup(keys)) if found]
        assert len(held) == on_ssd and set(evicted) <= set(held)
        statuses, outs = load(store, held, 20 * KIB)
        assert statuses == (LoadStatus.HIT,) * len(held)
        assert np.array_equal(outs, data[[keys.index(key) for key in held]])


def test_persist_on_exit_hands_the_dram_tier_to_the_next_server(servers: Servers) -> None:
    process = servers.start(1 * MIB, ssd_dir=servers.ssd_dir, ssd_capacity_bytes=4 * MIB,
                            persist_on_exit=True)
    data = payloads(5, 10 * KIB, seed=9)
    keys = keys_of(5)
    with ServerStore(servers.socket) as store:
        assert store.put_batch(keys, [data[i] for i in range(5)]) == (True,) * 5
        assert store.where(keys) == ("CPU",) * 5
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    servers.start_with_ssd(1 * MIB, 4 * MIB)
    with ServerStore(servers.socket) as store:
        assert store.where(keys) == ("DISK",) * 5
        statuses, outs = load(store, keys, 10 * KIB)
        assert statuses == (LoadStatus.HIT,) * 5 and np.array_equal(outs, data)


def test_bytes_flipped_in_the_ssd_slot_file_answer_corrupt_and_are_dropped(
    servers: Servers,
) -> None:
    servers.start_with_ssd(128 * KIB, 8 * MIB)
    data = payloads(12, 20 * KIB, seed=7)
    keys = keys_of(12)
    with ServerStore(servers.socket) as store:
        for index in range(12):
            assert store.put_batch([keys[index]], [data[index]]) == (True,)
        victim = store.where(keys).index("DISK")
        slot_file = Path(servers.ssd_dir) / SLOT_FILE_NAME
        image = slot_file.read_bytes()
        offset = image.index(data[victim].tobytes()[:4096]) + 777
        with open(slot_file, "r+b") as slots:
            slots.seek(offset)
            slots.write(bytes([image[offset] ^ 0xFF]))
        statuses, _ = load(store, [keys[victim]], 20 * KIB)
        assert statuses == (LoadStatus.CORRUPT,)
        assert store.lookup([keys[victim]]) == (False,)
        statuses, _ = load(store, [keys[victim]], 20 * KIB)
        assert statuses == (LoadStatus.MISSING,)
        others = [key for index, key in enumerate(keys) if index != victim]
        statuses, outs = load(store, others, 20 * KIB)
        assert statuses == (LoadStatus.HIT,) * len(others)
        assert np.array_equal(outs, np.delete(data, victim, axis=0))


def with_file_size_limit(limit: int, command: list[str]) -> list[str]:
    """`command` run under RLIMIT_FSIZE = `limit` (set by a small exec wrapper rather than
    preexec_fn, which is unsafe in a process with threads)."""
    wrapper = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", wrapper, *command]


def test_a_file_size_limit_below_the_ssd_tier_fails_start_up_clearly(
    servers: Servers,
) -> None:
    """Behaviour changed (issue 11): the slot file may not grow past 200 KiB
    (RLIMIT_FSIZE), so its 4 MiB cannot be reserved, and the server no longer starts with
    a tier that collapses at the first EFBIG: it exits 1 saying what to do, and leaves no
    socket behind."""
    Path(servers.socket).parent.mkdir(mode=0o700, parents=True)
    command = serve_command(servers.socket, 128 * KIB, ssd_dir=servers.ssd_dir,
                            ssd_capacity_bytes=4 * MIB, page_bytes=4096)
    done = subprocess.run(with_file_size_limit(200 * KIB, command), cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    assert "cannot reserve" in done.stderr and "--ssd-capacity" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not os.path.exists(servers.socket)


# --------------------------------------------------------- launching and stats


def test_umbp_stats_prints_a_table_and_json(servers: Servers) -> None:
    servers.start_with_ssd(256 * KIB, 4 * MIB)
    with ServerStore(servers.socket) as store:
        store.put_batch(["a"], [memoryview(b"a" * 1000)])
        load(store, ["a", "zz"], 1000)
    command = [sys.executable, "-m", "umbp.cli", "stats", "--socket", servers.socket]
    table = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60,
                           check=False)
    assert table.returncode == 0, table.stderr
    for label in ("capacity", "used", "objects", "loads that hit", "loads that missed",
                  "evictions to SSD",
                  "evictions dropped", "bytes to SSD"):
        assert label in table.stdout
    raw = subprocess.run(command + ["--json"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=False)
    figures = json.loads(raw.stdout)
    assert figures["dram"]["objects"] == 1 and figures["ssd"]["enabled"]
    assert (figures["counters"]["hits"], figures["counters"]["misses"]) == (1, 1)
    missing = subprocess.run(command[:-1] + [servers.socket + ".none"], cwd=REPO,
                             capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 1 and "umbp stats:" in missing.stderr


def test_start_server_reports_a_server_that_dies_with_its_log(servers: Servers) -> None:
    """Its log lies beside its socket unless named, and the error quotes it."""
    with pytest.raises(ServerStartError, match="capacity") as failed:
        start_server(servers.socket, 100, page_bytes=4096, wait_s=30.0)
    log = servers.socket + ".log"
    assert f"log {log}:" in str(failed.value)
    assert "capacity" in Path(log).read_text()
    assert Path(log).stat().st_mode & 0o077 == 0  # it names the pool's file
    servers.start(1 * MIB)
    with pytest.raises(ServerStartError, match="already answers"):
        start_server(servers.socket, 1 * MIB, page_bytes=4096, wait_s=30.0,
                     log_path=str(servers.directory / "second.log"))
    assert server_reachable(servers.socket, 2.0)
    assert not server_reachable(servers.socket + ".none", 2.0)


def test_a_detached_server_outlives_its_session(servers: Servers) -> None:
    process = servers.start(1 * MIB, detach=True)
    assert os.getsid(process.pid) == process.pid
    assert os.getsid(process.pid) != os.getsid(0)


def test_one_client_shared_by_threads_keeps_every_answer_right(servers: Servers) -> None:
    """Worker threads put and get their own objects while scheduler threads look up, all
    through one `ServerStore`; every answer must be right."""
    servers.start(8 * MIB)
    errors: list[str] = []
    store = ServerStore(servers.socket, io_timeout_s=10.0)

    def worker(seed: int) -> None:
        data = payloads(8, 9000 + seed, seed=seed)
        keys = keys_of(8, f"t{seed}-")
        for _ in range(10):
            if store.put_batch(keys, [data[i] for i in range(8)]) != (True,) * 8:
                errors.append(f"put {seed}")
            statuses, outs = load(store, keys, 9000 + seed, batch=8)
            if statuses != (LoadStatus.HIT,) * 8 or not np.array_equal(outs, data):
                errors.append(f"get {seed}: {statuses}")

    def scheduler() -> None:
        for _ in range(50):
            answer = store.lookup(["t0-0", "never"])
            if answer[1]:
                errors.append("lookup says a never-stored key is resident")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    threads += [threading.Thread(target=scheduler) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors[:5]
        figures = store.server_stats()
        assert figures["sessions"]["pins"] == 0 and figures["sessions"]["reservations"] == 0
    finally:
        store.close()


def test_a_server_killed_under_concurrent_traffic_fails_every_call_cleanly(
    servers: Servers,
) -> None:
    """Threads keep putting, getting and looking up through one client while the server
    is SIGKILLed and restarted: no call raises anything but `StoreUnavailable` (lookups),
    no get ever delivers wrong bytes, and the client ends up working on the new server."""
    process = servers.start(4 * MIB)
    store = ServerStore(servers.socket, io_timeout_s=2.0, reconnect_interval_s=0.05)
    errors: list[str] = []
    running = threading.Event()
    running.set()

    def worker(seed: int) -> None:
        data = payloads(4, 12000, seed=seed)
        keys = keys_of(4, f"w{seed}-")
        while running.is_set():
            try:
                store.put_batch(keys, [data[i] for i in range(4)])
                statuses, outs = load(store, keys, 12000)
            except Exception as error:  # noqa: BLE001 - the point of the test
                errors.append(f"worker raised {error!r}")
                return
            for index, status in enumerate(statuses):
                if status is LoadStatus.HIT and not np.array_equal(outs[index], data[index]):
                    errors.append(f"wrong bytes for {keys[index]}")
                elif status not in (LoadStatus.HIT, LoadStatus.MISSING, LoadStatus.UNAVAILABLE):
                    errors.append(f"unexpected {status}")

    def scheduler() -> None:
        while running.is_set():
            try:
                store.lookup(["w0-0", "w1-0"])
            except StoreUnavailable:
                pass
            except Exception as error:  # noqa: BLE001
                errors.append(f"lookup raised {error!r}")
                return

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(2)]
    threads.append(threading.Thread(target=scheduler))
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # let traffic flow (not a timing assertion)
        process.kill()
        process.wait()
        time.sleep(0.3)
        servers.start(4 * MIB)
        assert wait_until(lambda: answers_lookup(store, ["w0-0"]))
        assert wait_until(lambda: store.lookup(["w0-0"]) == (True,)), "puts resumed"
    finally:
        running.clear()
        for thread in threads:
            thread.join(timeout=60)
        store.close()
    assert not errors, errors[:5]
