"""Mooncake beyond the shared contract: two processes acting as two nodes, and a master
that dies under its clients. Each test starts a master of its own, so the in-place fault
injection of the shared suite (which assumes every segment on the session master belongs
to this process) stays valid."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from umbp.runtime.contract import LoadStatus, StoreUnavailable

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None, reason="mooncake is not installed"
    ),
]

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
SIZES = (100, 64 << 10, 3 * MIB + 1)

NODE = """
import random, sys
from umbp.runtime.contract import LoadStatus
from umbp.runtime.mooncake.store import MooncakeStore

def content(seed, size):
    return random.Random(seed).randbytes(size)

store = MooncakeStore(sys.argv[1], local_hostname="127.0.0.1",
                      global_segment_bytes=64 << 20, local_buffer_bytes=8 << 20)
sizes = [int(size) for size in sys.argv[2].split(",")]
ok = all(store.put_batch([f"from-child-{s}" for s in sizes], [content(s, s) for s in sizes]))
print("stored" if ok else "put failed", flush=True)
sys.stdin.readline()  # the parent has read ours and stored its own
outs = [bytearray(s) for s in sizes]
statuses = store.get_batch_into([f"from-parent-{s}" for s in sizes], outs)
good = all(status is LoadStatus.HIT for status in statuses) and all(
    bytes(out) == content(s + 1, s) for out, s in zip(outs, sizes))
print("restored" if good else f"bad {statuses}", flush=True)
sys.stdin.readline()  # keep the segment mounted until the parent is done
store.close()
"""


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Any]:
    from umbp.testing.mooncake_master import MooncakeMaster

    with MooncakeMaster.start(log=tmp_path / "master.log") as running:
        yield running


def open_store(address: str, segment_bytes: int) -> Any:
    from umbp.runtime.mooncake.store import MooncakeStore

    return MooncakeStore(
        address,
        local_hostname="127.0.0.1",
        global_segment_bytes=segment_bytes,
        local_buffer_bytes=8 * MIB,
    )


def test_two_processes_restore_each_others_objects_bit_identically(master: Any) -> None:
    """The parent contributes no memory, so everything it stores and loads lives in the
    child's segment and crosses process boundaries through Mooncake's transfer engine."""
    child = subprocess.Popen(
        [sys.executable, "-c", NODE, master.address, ",".join(map(str, SIZES))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdin is not None and child.stdout is not None
    parent = open_store(master.address, segment_bytes=0)
    try:
        assert child.stdout.readline().strip() == "stored"
        keys = [f"from-child-{size}" for size in SIZES]
        assert parent.lookup(keys) == (True,) * len(SIZES)
        outs = [bytearray(size) for size in SIZES]
        assert parent.get_batch_into(keys, outs) == (LoadStatus.HIT,) * len(SIZES)
        assert [bytes(out) for out in outs] == [content(size, size) for size in SIZES]

        mine = [f"from-parent-{size}" for size in SIZES]
        assert all(parent.put_batch(mine, [content(size + 1, size) for size in SIZES]))
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "restored"
        child.stdin.write("exit\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()  # reaps it and closes the pipes
        parent.close()


def test_a_dead_master_gives_contract_failures_not_exceptions_or_hangs(master: Any) -> None:
    store = open_store(master.address, segment_bytes=32 * MIB)
    try:
        data = content(1, 5000)
        assert store.put_batch(["k"], [data]) == (True,)
        master.stop()
        assert not master.running()
        with pytest.raises(StoreUnavailable, match=master.address):
            store.lookup(["k"])
        assert store.put_batch(["k2"], [data]) == (False,)
        out = bytearray(len(data))
        assert store.get_batch_into(["k"], [out]) == (LoadStatus.UNAVAILABLE,)
        assert store.clear() is False
        assert store.stats().put_rejects == 1
    finally:
        store.close()
    store.close()


@pytest.mark.timeout(60)  # Mooncake alone retries for ~90 s; the probe answers at once
def test_setup_against_no_master_fails_fast_naming_the_address() -> None:
    from umbp.runtime.mooncake.store import MooncakeSetupError
    from umbp.testing.mooncake_master import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(MooncakeSetupError, match=address):
        open_store(address, segment_bytes=0)


def test_the_lookup_client_contributes_nothing_and_sees_everything(master: Any) -> None:
    from umbp.runtime.mooncake.store import MooncakeStore

    worker = open_store(master.address, segment_bytes=32 * MIB)
    scheduler = MooncakeStore.lookup_only(master.address, local_hostname="127.0.0.1")
    try:
        assert scheduler.stats().capacity_bytes == 0
        assert worker.put_batch(["a", "b"], [b"1", b"2"]) == (True, True)
        assert scheduler.lookup(["a", "x", "b"]) == (True, False, True)
        assert scheduler.put_batch(["c"], [content(3, 2 * MIB)]) == (True,)
        out = bytearray(2 * MIB)
        assert worker.get_batch_into(["c"], [out]) == (LoadStatus.HIT,)
        assert bytes(out) == content(3, 2 * MIB)
    finally:
        scheduler.close()
        worker.close()


def test_umbp_ls_and_clear_see_and_drop_one_namespace_of_a_mooncake_cluster(
    master: Any,
) -> None:
    """What Mooncake's API allows an operator (umbp.runtime.mooncake.operations): objects
    per namespace from the master's HTTP listing, and one namespace's objects removed
    (those under a lease stay, counted), run as the `umbp` commands."""
    import json

    keys = {namespace: [f"umbp:1:{namespace}:tp0:pcp0:dcp0:pp0:g0:{i:04x}" for i in range(3)]
            for namespace in ("0123456789abcdef", "sglang.fedcba9876543210")}
    http = f"127.0.0.1:{master.metrics_port}"
    store = open_store(master.address, segment_bytes=32 * MIB)
    try:
        everything = [key for group in keys.values() for key in group] + ["not-umbp"]
        assert all(store.put_batch(everything, [b"x" * 100] * len(everything)))

        def umbp(*arguments: str) -> Any:
            done = subprocess.run([sys.executable, "-m", "umbp.cli", *arguments, "--json"],
                                  cwd=REPO, capture_output=True, text=True, timeout=60,
                                  check=False)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        assert umbp("ls", "--mooncake-http", http) == {
            "0123456789abcdef": 3, "sglang.fedcba9876543210": 3, "": 1}
        dropped = umbp("clear", "--mooncake-master", master.address, "--namespace",
                       "0123456789abcdef", "--mooncake-http", http)
        assert dropped["objects"] + dropped["in_use"] == 3 and dropped["objects"] > 0
        assert store.lookup(keys["sglang.fedcba9876543210"]) == (True,) * 3
        assert store.lookup(["not-umbp"]) == (True,)
        assert sum(store.lookup(keys["0123456789abcdef"])) == dropped["in_use"]
    finally:
        store.close()
