"""The conformance harness's fake GPU (umbp/testing/fake_cuda.py) catches each thing it
is there to catch, and only that: each test below breaks one rule on purpose, next to
the same work done right."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from umbp.gpu.copier import BlockCopier
from umbp.testing.fake_cuda import FakeCuda

NUM_BLOCKS = 4


def setup() -> tuple[FakeCuda, BlockCopier, torch.Tensor, np.ndarray]:
    fake = FakeCuda()
    fake.model_thread = threading.get_ident()
    kv = torch.arange(NUM_BLOCKS * 16, dtype=torch.float32).view(NUM_BLOCKS, 16)
    fake.device_memory([kv])
    rows = np.zeros((2, 64), dtype=np.uint8)
    fake.register_host(rows.ctypes.data, rows.nbytes)
    return fake, BlockCopier([kv], NUM_BLOCKS), kv, rows


def block(kv: torch.Tensor, index: int) -> tuple[int, int]:
    start = kv[index].data_ptr()
    return start, start + 64


def test_a_copy_runs_only_when_its_completion_is_asked_for() -> None:
    fake, copier, kv, rows = setup()
    stream = fake.new_stream("s")
    fake.copy(stream, copier.copy([1], rows, to_kv=False))
    assert not rows.any()  # not run yet: the host sees what was there
    done = fake.new_event()
    done.record(stream)
    done.synchronize()
    assert np.array_equal(rows[0], kv[1].numpy().view(np.uint8))
    assert fake.violations == []


def test_a_load_unordered_with_the_forward_pass_races_and_an_ordered_one_does_not() -> None:
    fake, copier, kv, rows = setup()
    fake.forward_op("forward-zero", [block(kv, 2)], lambda: kv[2].zero_())
    mark = fake.new_event()
    mark.record(fake.current_stream())
    ordered = fake.new_stream("ordered")
    ordered.wait_event(mark)
    fake.copy(ordered, copier.copy([2], rows, to_kv=True))
    assert fake.violations == []
    fake.copy(fake.new_stream("unordered"), copier.copy([2], rows, to_kv=True))
    assert any("races with forward-zero" in v for v in fake.violations)
    assert all("on unordered" in v for v in fake.violations)


def test_a_lane_waiting_on_its_own_current_stream_orders_nothing() -> None:
    """The defect the harness exists for: another thread's current stream is its own."""
    fake, copier, kv, rows = setup()
    fake.forward_op("forward-write", [block(kv, 3)], lambda: kv[3].fill_(7.0))

    def lane() -> None:
        fake.bind_thread()
        mark = fake.new_event()
        mark.record(fake.current_stream())  # not the forward stream on this thread
        stream = fake.new_stream("store")
        stream.wait_event(mark)
        fake.copy(stream, copier.copy([3], rows, to_kv=False))

    thread = threading.Thread(target=lane)
    thread.start()
    thread.join()
    assert any("races with forward-write" in v for v in fake.violations)


def test_the_model_thread_synchronizing_in_a_step_is_reported() -> None:
    fake, copier, _, rows = setup()
    stream = fake.new_stream("s")
    fake.copy(stream, copier.copy([0], rows, to_kv=False))
    done = fake.new_event()
    done.record(stream)
    assert done.query()  # polling is fine
    fake.in_step = True
    done.synchronize()
    assert fake.model_thread_syncs == 1 and "synchronized" in fake.violations[-1]


def test_a_copy_from_memory_never_registered_is_reported_pageable() -> None:
    fake, copier, _, _ = setup()
    pageable = np.zeros((1, 64), dtype=np.uint8)
    fake.copy(fake.new_stream("s"), copier.copy([0], pageable, to_kv=False))
    assert "pageable" in fake.violations[0]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FIXED = 0x10


def map_file(path: Path, nbytes: int, at: int | None = None) -> int:
    """The address of `path`'s first `nbytes`, mapped shared (at `at`, replacing what is
    mapped there, when given)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        address = _LIBC.mmap(at, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_SHARED | (_MAP_FIXED if at else 0), fd, 0)
    finally:
        os.close(fd)
    assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    return int(address)


def rows_at(address: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * 128).from_address(address)).reshape(2, 64)


def test_a_registration_outliving_its_mapping_is_reported(tmp_path: Path) -> None:
    """A file's pages registered, then unmapped and another file mapped at the same
    address: a copy through the old registration, and its late unregistration, are
    reported (CUDA would move the pages it locked); unregistering before the unmapping
    and registering the new mapping is not."""
    fake, copier, _, _ = setup()
    stream = fake.new_stream("s")
    done = fake.new_event()
    address = map_file(tmp_path / "first", 4096)
    assert fake.register_host(address, 4096)
    fake.copy(stream, copier.copy([1], rows_at(address), to_kv=False))
    done.record(stream)
    done.synchronize()
    assert fake.violations == []
    _LIBC.munmap(address, 4096)
    assert map_file(tmp_path / "second", 4096, at=address) == address
    fake.copy(stream, copier.copy([2], rows_at(address), to_kv=False))
    assert any("unmapped since" in v for v in fake.violations), fake.violations
    fake.unregister_host(address)
    assert "unmapped before it was unregistered" in fake.violations[-1]
    fake.violations.clear()

    assert fake.register_host(address, 4096)  # the right order: the new mapping registered
    fake.copy(stream, copier.copy([3], rows_at(address), to_kv=False))
    done.record(stream)
    done.synchronize()
    fake.unregister_host(address)
    _LIBC.munmap(address, 4096)
    assert fake.violations == []
    assert fake.registered_bytes == 128  # setup's rows alone


def test_registering_twice_and_unregistering_what_starts_no_registration_are_reported(
) -> None:
    fake, _, _, rows = setup()
    assert not fake.register_host(rows.ctypes.data + 64, 64)
    assert "registered twice" in fake.violations[-1]
    fake.unregister_host(rows.ctypes.data + 64)
    assert "no registration starts" in fake.violations[-1]
    assert fake.registered_bytes == rows.nbytes


def test_a_copy_outside_device_memory_is_a_wild_pointer() -> None:
    fake, _, _, rows = setup()
    elsewhere = torch.zeros(NUM_BLOCKS, 16)
    with pytest.raises(AssertionError, match="outside device memory"):
        fake.copy(fake.new_stream("s"), BlockCopier([elsewhere], NUM_BLOCKS).copy(
            [0], rows, to_kv=True))


def test_a_thread_that_never_bound_the_device_is_reported() -> None:
    fake, copier, _, rows = setup()

    def unbound() -> None:
        fake.copy(fake.new_stream("s"), copier.copy([0], rows, to_kv=False))

    thread = threading.Thread(target=unbound, name="unbound-lane")
    thread.start()
    thread.join()
    assert any("never bound" in v and "unbound-lane" in v for v in fake.violations)


def test_a_store_before_the_sampled_tokens_of_the_step_that_wrote_its_blocks() -> None:
    fake, copier, kv, rows = setup()
    fake.forward_op("forward-write", [block(kv, 1)], lambda: kv[1].fill_(3.0))
    mark = fake.new_event()
    mark.record(fake.current_stream())
    early = fake.new_stream("early")
    early.wait_event(mark)
    fake.copy(early, copier.copy([1], rows, to_kv=False))
    assert "sampled tokens of step 0" in fake.violations[-1]
    fake.violations.clear()
    fake.end_step()
    mark.record(fake.current_stream())
    late = fake.new_stream("late")
    late.wait_event(mark)
    fake.copy(late, copier.copy([1], rows, [1], to_kv=False))
    assert fake.violations == []
