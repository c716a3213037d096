"""`HostRegistrations`: host memory registered with a device by the mapping it lies in,
in pieces, each unregistered exactly once (checked by the conformance harness's fake
GPU, which reports a double registration, an unregistration where none starts, and a
registration outliving its mapping)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from umbp.gpu import registrations
from umbp.gpu.registrations import HostRegistrations
from umbp.testing.fake_cuda import FakeCuda


@pytest.fixture
def fake() -> FakeCuda:
    device = FakeCuda()
    device.model_thread = threading.get_ident()
    return device


def test_a_mapping_is_registered_in_pieces_and_unregistered_whole(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registrations, "REGISTER_CHUNK_BYTES", 4096)
    memory = np.zeros(10_000, np.uint8)
    held = HostRegistrations(fake)
    held.mapped(memory.ctypes.data, memory.nbytes)
    assert fake.registered_bytes == 10_000  # pieces of 4096, 4096 and 1808
    held.mapped(memory.ctypes.data, memory.nbytes)  # told twice: registered once
    assert fake.registered_bytes == 10_000
    held.unmapping(memory.ctypes.data)
    assert fake.registered_bytes == 0
    held.unmapping(memory.ctypes.data)  # nothing left to unregister
    assert fake.violations == []


def test_close_unregisters_every_mapping_and_ignores_later_ones(fake: FakeCuda) -> None:
    first, second, late = (np.zeros(4096, np.uint8) for _ in range(3))
    held = HostRegistrations(fake)
    held.mapped(first.ctypes.data, first.nbytes)
    held.mapped(second.ctypes.data, second.nbytes)
    held.close()
    assert fake.registered_bytes == 0
    held.mapped(late.ctypes.data, late.nbytes)  # a reconnection racing shutdown
    held.unmapping(first.ctypes.data)
    assert fake.registered_bytes == 0
    assert fake.violations == []


def test_a_refused_piece_leaves_the_rest_unregistered_and_undoes_only_what_was_done(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registrations, "REGISTER_CHUNK_BYTES", 4096)
    memory = np.zeros(3 * 4096, np.uint8)
    refused_at = memory.ctypes.data + 4096
    register = fake.register_host

    def refusing(address: int, nbytes: int) -> bool:
        return address != refused_at and register(address, nbytes)

    monkeypatch.setattr(fake, "register_host", refusing)
    held = HostRegistrations(fake)
    held.mapped(memory.ctypes.data, memory.nbytes)
    assert fake.registered_bytes == 4096  # the first piece; copies from the rest pageable
    held.unmapping(memory.ctypes.data)
    assert fake.registered_bytes == 0
    assert fake.violations == []
