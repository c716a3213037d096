"""MooncakeStore pieces that need no master (tests/contract/ drives a real one)."""

from __future__ import annotations

import ctypes
import http.server
import mmap
import re
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.runtime.mooncake.operations import mooncake_namespaces, namespace_key_pattern
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


# Keys of this format, of other formats (an older umbp's) and not umbp's at all: what a
# master shared by several umbp versions and other applications lists.
_LISTED_KEYS = st.lists(st.one_of(
    st.builds(lambda ns, rest: f"umbp:1:{ns}:{rest}", st.sampled_from(["a", "b.c", "d-e"]),
              st.text("tp0:g1abcdef", max_size=12)),
    st.builds(lambda fmt, ns: f"umbp:{fmt}:{ns}:tp0:pcp0:dcp0:pp0:g0:ab",
              st.integers(0, 3), st.sampled_from(["a", "b.c"])),
    st.text("umbp:01.abcdg-_", max_size=20),
), max_size=30)


@given(_LISTED_KEYS)
@settings(max_examples=60, deadline=None)
def test_ls_counts_per_namespace_exactly_the_keys_clear_removes(keys: list[str]) -> None:
    """`umbp ls --mooncake-http` (the master's key listing, counted per namespace) and
    `umbp clear --namespace` (Mooncake's remove_by_regex over `namespace_key_pattern`)
    agree on every key: an older format's keys are neither counted nor removed."""
    listed = [key for key in keys if key]
    counts = _counted_over_http("\n".join(listed))
    for namespace in {name for name in counts if name} | {"a", "b.c"}:
        removed = [key for key in listed if re.search(namespace_key_pattern(namespace), key)]
        assert counts.get(namespace, 0) == len(removed), (namespace, listed)
    assert sum(counts.values()) == len(listed)


def _counted_over_http(listing: str) -> dict[str, int]:
    """`mooncake_namespaces` against an HTTP server that answers `/get_all_keys` as
    Mooncake's master does (one key a line), on loopback."""

    class Master(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = listing.encode() if self.path == "/get_all_keys" else b""
            self.send_response(200 if body or self.path == "/get_all_keys" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Master) as master:
        thread = threading.Thread(target=master.serve_forever, daemon=True)
        thread.start()
        try:
            return mooncake_namespaces(f"127.0.0.1:{master.server_address[1]}", timeout_s=10)
        finally:
            master.shutdown()
