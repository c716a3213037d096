"""MooncakeStore pieces that need no master (tests/contract/ drives a real one)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest

from umbp.runtime.mooncake.store import MooncakeSetupError, MooncakeStore, parse_address
from umbp.runtime.registered_memory import HostArea, RegisteredRanges, buffer_address, plan_chunks


def test_registered_ranges_contain_only_whole_buffers() -> None:
    ranges = RegisteredRanges()
    ranges.add(1000, 100)
    ranges.add(5000, 10)
    assert ranges.contains(1000, 100) and ranges.contains(1050, 50)
    assert not ranges.contains(1050, 51) and not ranges.contains(999, 2)
    assert ranges.contains(5000, 10) and not ranges.contains(2000, 1)
    assert ranges.remove(1000) and not ranges.remove(1000)
    assert not ranges.contains(1000, 1)
    assert ranges.spans() == ((5000, 5010),)


def test_buffer_address_agrees_with_ctypes_and_reads_read_only_buffers() -> None:
    writable = bytearray(64)
    assert buffer_address(memoryview(writable)) == ctypes.addressof(
        ctypes.c_char.from_buffer(writable)
    )
    assert buffer_address(memoryview(writable)[10:]) == buffer_address(memoryview(writable)) + 10
    frozen = bytes(64)
    assert buffer_address(memoryview(frozen)) != 0


def test_parse_address() -> None:
    assert parse_address("10.0.0.1:50051") == ("10.0.0.1", 50051)
    assert parse_address("[::1]:7") == ("::1", 7)
    for bad in ("10.0.0.1", ":50051", "host:port"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_plan_chunks_bounces_unregistered_buffers_and_respects_limits() -> None:
    bounce = HostArea(mmap.PAGESIZE)
    registered = bytearray(5000)
    ranges = RegisteredRanges()
    ranges.add(buffer_address(memoryview(registered)), len(registered))
    views = [
        memoryview(registered)[:100],  # direct
        memoryview(bytearray(3000)),  # staged
        memoryview(bytearray(3000)),  # staged, but no room left: a new chunk
        memoryview(bytearray(10_000)),  # larger than the bounce: alone, temporary
        memoryview(b""),  # empty: direct
    ]
    chunks = list(plan_chunks(views, ranges, bounce, max_keys=8))
    shapes = [[(p.index, p.staged is not None, p.temporary) for p in c] for c in chunks]
    assert shapes == [
        [(0, False, False), (1, True, False)],
        [(2, True, False)],
        [(3, False, True)],
        [(4, False, False)],
    ]
    assert chunks[0][1].pointer == bounce.address and chunks[1][0].pointer == bounce.address
    assert [len(c) for c in plan_chunks([memoryview(b"x")] * 5, ranges, bounce, 2)] == [2, 2, 1]
    bounce.release()


def test_plan_chunks_stages_small_registered_payloads_with_room_for_a_trailer() -> None:
    bounce = HostArea(mmap.PAGESIZE)
    registered = bytearray(8192)
    ranges = RegisteredRanges()
    ranges.add(buffer_address(memoryview(registered)), len(registered))
    small, large = memoryview(registered)[:100], memoryview(registered)[4096:]
    (chunk,) = plan_chunks([small, large], ranges, bounce, 8, stage_below=1000, trailer_bytes=8)
    assert chunk[0].staged is not None and chunk[0].staged.nbytes == 108
    assert chunk[1].staged is None and chunk[1].pointer == buffer_address(large)
    # Without a bounce buffer (the lookup-only client) small registered payloads go direct.
    (alone,) = plan_chunks([small], ranges, None, 8, stage_below=1000, trailer_bytes=8)
    assert alone[0].staged is None and not alone[0].temporary
    bounce.release()


def test_bad_arguments_are_refused_before_any_connection() -> None:
    with pytest.raises(ValueError, match="protocol"):
        MooncakeStore("127.0.0.1:1", local_hostname="127.0.0.1", protocol="udp")
    with pytest.raises(ValueError, match="global_segment_bytes"):
        MooncakeStore("127.0.0.1:1", local_hostname="127.0.0.1", global_segment_bytes=-1)


def test_a_missing_mooncake_package_is_a_setup_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.store", raising=False)
    monkeypatch.setitem(sys.modules, "mooncake", None)  # makes `import mooncake.store` fail
    with pytest.raises(MooncakeSetupError, match="mooncake-transfer-engine"):
        MooncakeStore("127.0.0.1:1", local_hostname="127.0.0.1")
