"""The conformance harness's fake GPU (umbp/testing/fake_cuda.py) catches each thing it
is there to catch, and only that: each test below breaks one rule on purpose, next to
the same work done right."""

from __future__ import annotations

import threading

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
