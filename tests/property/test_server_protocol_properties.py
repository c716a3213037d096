"""The protocol boundary of a real `umbp serve`, attacked with generated messages.

Hypothesis drives one attacking connection through a sequence of frames for every op:
well-formed requests (which reserve pages and pin objects), requests with fields of the
wrong type, range or length (floats, NaN, null, nested lists, non-string keys, huge
integers, booleans, missing or unknown fields, sizes and keys that differ in length,
tokens it never got), bodies that are not JSON or not UTF-8, unknown ops, headers that
announce more than an op may carry, and frames cut short before the connection drops.

After each sequence the attacker disconnects, and a good client checks that
* the server is alive and serves exactly the bytes it stored (an object is missing only
  when the attacker legitimately reported it corrupt, never wrong);
* nothing leaked: no connection but the asker's, no reservation, no pin, no pinned
  object, and every used DRAM page belongs to a resident object;
* a fresh put and get round-trips.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import socket
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbp.runtime.contract import LoadStatus
from umbp.runtime.server import ServerStore, protocol
from umbp.runtime.server.launch import probe_server, start_server, stop_server

pytestmark = pytest.mark.integration

PAGE = 4096
GOOD = {f"good-{index}": random.Random(index).randbytes(3 * PAGE + index) for index in range(6)}
ATTACK_KEYS = (*(f"atk-{index}" for index in range(16)), *GOOD)
ALL_OPS = (
    protocol.HELLO, protocol.LOOKUP, protocol.WHERE, protocol.BEGIN_PUT, protocol.COMMIT_PUT,
    protocol.BEGIN_GET, protocol.END_GET, protocol.CLEAR, protocol.STATS,
)
LAST_TOKEN = "$last"  # replaced by the token of the attacker's latest BEGIN_* answer
FIT = "$fit"  # replaced by one checksum (or null) per key the latest BEGIN_PUT reserved
ONE_MORE = "$fit+1"  # one checksum more than that (well-formed, but not this batch's count)
ONE_LESS = "$fit-1"  # one fewer
OUTSIDE = "$outside"  # a corrupt position just past the latest BEGIN_GET's keys


class Server:
    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="umbp-p-", dir="/tmp"))
        self.socket = str(self.directory / "umbp.sock")
        self.process = start_server(
            self.socket, 1 << 20, page_bytes=PAGE, ssd_dir=str(self.directory / "ssd"),
            ssd_capacity_bytes=2 << 20, log_path=str(self.directory / "serve.log"),
            frame_timeout_s=2.0,
        )  # fmt: skip
        self.store = ServerStore(self.socket, io_timeout_s=30.0)
        assert self.store.put_batch(list(GOOD), list(GOOD.values())) == (True,) * len(GOOD)
        self.cases = 0
        self.tally: Counter[str] = Counter()

    def close(self) -> None:
        self.store.close()
        stop_server(self.process, self.socket)
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = Server()
    yield running
    print(f"adversarial sequences run: {running.cases}; {dict(running.tally)}")
    running.close()


# ---------------------------------------------------------------- strategies

junk = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True), st.integers(-(1 << 70), 1 << 70),
    st.text(max_size=8), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
good_key = st.sampled_from(ATTACK_KEYS)
bad_key = st.one_of(
    junk, st.just(""), st.just("x" * 961), st.just("a\x00b"), st.just("\ud800"),
    st.lists(st.text(max_size=2), max_size=2),
)
key_list = st.lists(st.one_of(good_key, good_key, bad_key), max_size=6) | st.lists(
    good_key, max_size=6
)
good_size = st.integers(0, 24 * PAGE)
size_list = st.lists(
    st.one_of(good_size, good_size, st.integers(-5, -1), st.floats(), st.just(1 << 60),
              st.booleans(), st.none()),
    max_size=6,
) | st.lists(good_size, max_size=6)
token = st.one_of(st.just(LAST_TOKEN), st.just(LAST_TOKEN), st.integers(-3, 1 << 64), junk)
checksums = st.just(FIT) | st.lists(
    st.one_of(st.integers(0, (1 << 64) - 1), st.none(), junk), max_size=6
)
positions = st.lists(st.one_of(st.integers(-2, 8), junk), max_size=4)


def with_damage(fields: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """The fields as generated, or with one dropped, one added, or one replaced by junk."""
    names = sorted(fields)
    return st.one_of(
        st.just(fields),
        st.just(fields),
        st.sampled_from(names).map(lambda name: {k: v for k, v in fields.items() if k != name}),
        st.just(fields | {"extra": 1}),
        st.tuples(st.sampled_from(names), junk).map(lambda nj: fields | {nj[0]: nj[1]}),
    ) if names else st.one_of(st.just(fields), st.just({"extra": 1}))


@st.composite
def json_request(draw: st.DrawFn) -> tuple[int, Any]:
    op = draw(st.sampled_from(ALL_OPS))
    if op in (protocol.LOOKUP, protocol.WHERE):
        fields: dict[str, Any] = {"keys": draw(key_list)}
    elif op in (protocol.BEGIN_PUT, protocol.BEGIN_GET):
        keys = draw(key_list)
        same = draw(st.lists(good_size, min_size=len(keys), max_size=len(keys)))
        fields = {"keys": keys, "sizes": draw(st.one_of(st.just(same), size_list))}
        if op == protocol.BEGIN_GET and draw(st.booleans()):
            fields = {"keys": list(GOOD), "sizes": [len(v) for v in GOOD.values()]}
    elif op == protocol.COMMIT_PUT:
        fields = {"token": draw(token), "checksums": draw(checksums)}
    elif op == protocol.END_GET:
        fields = {"token": draw(token), "corrupt": draw(positions)}
    else:
        fields = {}
    request = draw(with_damage(fields))
    if op == protocol.CLEAR and request == {}:
        request = {"keys": []}  # a real CLEAR would drop the good client's objects
    return op, request


def raw_body(value: Any) -> bytes:
    return json.dumps(value).encode()


@st.composite
def valid_request(draw: st.DrawFn) -> tuple[int, Any]:
    """A well-formed request: what reserves pages, pins objects and then commits or
    ends them (or leaves them held when the sequence stops first)."""
    op = draw(st.sampled_from(ALL_OPS[1:7]))
    if op in (protocol.LOOKUP, protocol.WHERE):
        return op, {"keys": draw(st.lists(good_key, max_size=6))}
    if op in (protocol.BEGIN_PUT, protocol.BEGIN_GET):
        keys = draw(st.lists(good_key, min_size=1, max_size=6))
        if op == protocol.BEGIN_GET and draw(st.booleans()):
            return op, {"keys": list(GOOD), "sizes": [len(v) for v in GOOD.values()]}
        return op, {"keys": keys, "sizes": draw(st.lists(good_size, min_size=len(keys),
                                                          max_size=len(keys)))}
    if op == protocol.COMMIT_PUT:
        return op, {"token": LAST_TOKEN, "checksums": FIT}
    return op, {"token": LAST_TOKEN, "corrupt": draw(st.sampled_from([[], [], [], [0]]))}


frame = st.one_of(
    valid_request().map(lambda req: ("json", req[0], req[1])),
    valid_request().map(lambda req: ("json", req[0], req[1])),
    valid_request().map(lambda req: ("json", req[0], req[1])),
    json_request().map(lambda req: ("json", req[0], req[1])),
    json_request().map(lambda req: ("json", req[0], req[1])),
    json_request().map(lambda req: ("json", req[0], req[1])),
    st.tuples(st.sampled_from(ALL_OPS), st.sampled_from(
        [b"{", b"\xff\xfe", b"NaN", b"[1,2]", b"{\"keys\": [NaN]}", b"[" * 5000 + b"]" * 5000,
         b"{\"keys\": [1e999]}", b"{\"token\": 1" + b"0" * 5000 + b"}", b"\"str\"", b"null"]
    )).map(lambda pair: ("bytes", pair[0], pair[1])),
    st.tuples(st.integers(0, 255).filter(lambda op: op not in ALL_OPS), st.binary(max_size=8))
    .map(lambda pair: ("bytes", pair[0], pair[1])),
    st.tuples(st.sampled_from(ALL_OPS), st.sampled_from([64 << 20, (1 << 32) - 1, 17 << 20]))
    .map(lambda pair: ("huge_header", pair[0], pair[1])),
    st.tuples(st.sampled_from(ALL_OPS), st.integers(1, 4)).map(lambda p: ("cut", p[0], p[1])),
)


@st.composite
def transaction(draw: st.DrawFn) -> list[tuple[str, int, Any]]:
    """A put or get that reserves or pins for real, then a closing request that is
    well-formed or damaged (or none: the connection then drops with it held)."""
    keys = draw(st.lists(st.sampled_from(ATTACK_KEYS[:16]), min_size=1, max_size=3))
    if draw(st.booleans()):
        sizes = draw(st.lists(good_size, min_size=len(keys), max_size=len(keys)))
        begin = ("json", protocol.BEGIN_PUT, {"keys": keys, "sizes": sizes})
        counts = st.sampled_from([FIT, FIT, ONE_MORE, ONE_LESS])
        closing = draw(with_damage({"token": LAST_TOKEN, "checksums": draw(counts)}))
        end = ("json", protocol.COMMIT_PUT, closing)
    else:
        begin = ("json", protocol.BEGIN_GET, {"keys": list(GOOD) + keys,
                                              "sizes": [len(v) for v in GOOD.values()]
                                              + [1] * len(keys)})
        corrupt = draw(st.one_of(positions, st.just(OUTSIDE), st.just([])))
        closing = draw(with_damage({"token": LAST_TOKEN, "corrupt": corrupt}))
        end = ("json", protocol.END_GET, closing)
    tail = draw(st.sampled_from([[end], [end], [end], [end, end], []]))
    return [begin, *tail]


actions_strategy = st.lists(
    st.one_of(frame.map(lambda one: [one]), transaction()), min_size=1, max_size=8
).map(lambda groups: [action for group in groups for action in group])


# ------------------------------------------------------------------ the attack


def send_sequence(path: str, actions: list[tuple[str, int, Any]], tally: Counter[str]) -> bool:
    """Play `actions` on one connection; True when the attacker reported corruption on
    a well-formed END_GET (which legitimately drops objects)."""
    reported_corrupt = False
    last_token, last_reserved, last_get_keys = 1, 0, 0
    rng = random.Random(len(actions))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20.0)
    sock.connect(path)
    try:
        for kind, op, payload in actions:
            if kind == "json":
                fit = [None if rng.random() < 0.2 else rng.getrandbits(64)
                       for _ in range(last_reserved + 1)]
                placeholders = {
                    LAST_TOKEN: last_token, FIT: fit[:-1], ONE_MORE: fit,
                    ONE_LESS: fit[:-2], OUTSIDE: [last_get_keys],
                }
                request = {
                    k: placeholders[v] if isinstance(v, str) and v in placeholders else v
                    for k, v in payload.items()
                }
                if op == protocol.END_GET and request.get("corrupt"):
                    reported_corrupt = True
                body = raw_body(request)
            elif kind == "bytes":
                body = payload
            elif kind == "huge_header":
                sock.sendall(struct.pack("<BI", op, payload) + b"{")
                return reported_corrupt  # and hang up with the frame unfinished
            else:  # cut: part of a header or body, then hang up
                sock.sendall(protocol.encode(op, b'{"keys": ["atk-0"]}')[:payload])
                return reported_corrupt
            sock.sendall(protocol.encode(op, body))
            tally["frames"] += 1
            if op in protocol.ONE_WAY:
                continue
            answer_op, answer = protocol.read_frame(sock, protocol.Deadline(20.0))
            tally["ok" if answer_op == protocol.OK else "error"] += 1
            if answer_op == protocol.OK and op in (protocol.BEGIN_PUT, protocol.BEGIN_GET):
                decoded = json.loads(answer)
                last_token = decoded["token"]
                held = sum(isinstance(a, list) for a in decoded["answers"])
                tally["reserved" if op == protocol.BEGIN_PUT else "pinned"] += held
                if op == protocol.BEGIN_PUT:
                    last_reserved = held
                else:
                    last_get_keys = len(decoded["answers"])
            elif answer_op == protocol.OK and op == protocol.COMMIT_PUT:
                tally["committed"] += sum(1 for stored in json.loads(answer) if stored)
    except (ConnectionError, TimeoutError):
        tally["dropped"] += 1  # the server dropped a connection that broke the framing
    finally:
        sock.close()
    return reported_corrupt


def settled(store: ServerStore, wait_s: float = 20.0) -> dict[str, Any]:
    """Stats once the attacker's connection has been released (its handler may still be
    running when the next request arrives) and the server's own copies to SSD (write
    ahead) hold no pin: a pin that outlives `wait_s` is a leak."""
    deadline = time.monotonic() + wait_s
    while True:
        figures = store.server_stats()
        dram = figures["dram"]
        quiet = (figures["sessions"]["connections"] == 0 and dram["pinned_objects"] == 0
                 and dram["retired_pinned_objects"] == 0)
        if quiet or time.monotonic() > deadline:
            return figures
        time.sleep(0.01)


def check_nothing_leaked(figures: dict[str, Any]) -> None:
    sessions, dram = figures["sessions"], figures["dram"]
    assert sessions == {"connections": 0, "reservations": 0, "pins": 0}, figures
    assert dram["pinned_objects"] == 0 and dram["retired_pinned_objects"] == 0, dram
    assert dram["used_bytes"] == dram["resident_bytes"], dram


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=actions_strategy)
def test_no_message_leaks_anything_or_breaks_the_server(
    server: Server, actions: list[tuple[str, int, Any]]
) -> None:
    server.cases += 1
    reported_corrupt = send_sequence(server.socket, actions, server.tally)
    assert server.process.poll() is None, "the server died"
    check_nothing_leaked(settled(server.store))
    outs = [bytearray(len(value)) for value in GOOD.values()]
    statuses = server.store.get_batch_into(list(GOOD), outs)
    for (key, value), status, out in zip(GOOD.items(), statuses, outs):
        if status is LoadStatus.HIT:
            assert bytes(out) == value, key
        else:
            assert status is LoadStatus.MISSING and reported_corrupt, (key, status)
            assert server.store.put_batch([key], [value]) == (True,)
    fresh = f"fresh-{server.cases}"
    payload = random.Random(server.cases).randbytes(5 * PAGE + 7)
    assert server.store.put_batch([fresh], [payload]) == (True,)
    out = bytearray(len(payload))
    assert server.store.get_batch_into([fresh], [out]) == (LoadStatus.HIT,)
    assert bytes(out) == payload
    check_nothing_leaked(settled(server.store))


def test_the_malformed_requests_of_the_issue_change_nothing(server: Server) -> None:
    """The cases found by hand: a float among sizes after a good one, checksums that are
    null / a number / NaN, a key that is a list after a stored one, non-string keys."""
    cases = [
        (protocol.BEGIN_PUT, b'{"keys": ["hand-0", "hand-1"], "sizes": [65536, 1.5]}'),
        (protocol.COMMIT_PUT, b'{"token": 1, "checksums": null}'),
        (protocol.COMMIT_PUT, b'{"token": 1, "checksums": 5}'),
        (protocol.COMMIT_PUT, b'{"token": 1, "checksums": [NaN]}'),
        (protocol.BEGIN_GET, b'{"keys": ["good-0", ["x"]], "sizes": [12288, 1]}'),
        (protocol.BEGIN_PUT, b'{"keys": [5, null], "sizes": [10, 10]}'),
    ]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20.0)
    sock.connect(server.socket)
    try:
        # A real reservation first, so that the bad COMMIT_PUTs have one to damage.
        reserve = {"keys": ["hand-9"], "sizes": [PAGE]}
        sock.sendall(protocol.encode_json(protocol.BEGIN_PUT, reserve))
        op, _ = protocol.read_frame(sock, protocol.Deadline(20.0))
        assert op == protocol.OK
        before = server.store.server_stats()
        for op, body in cases:
            sock.sendall(protocol.encode(op, body))
            answer_op, answer = protocol.read_frame(sock, protocol.Deadline(20.0))
            assert answer_op == protocol.ERROR, (body, answer)
            assert "BadRequest" in json.loads(answer), answer
            after = server.store.server_stats()
            assert after["sessions"] == before["sessions"], body  # one reservation, no pin
            assert after["dram"]["used_bytes"] == before["dram"]["used_bytes"], body
        assert server.store.lookup(["5", "hand-0"]) == (False, False)
    finally:
        sock.close()
    check_nothing_leaked(settled(server.store))


def test_a_64_mib_header_allocates_nothing_and_a_half_frame_times_out(server: Server) -> None:
    """Six connections announce 64 MiB bodies and six more 16 MiB ones (within BEGIN_PUT's
    limit), each sending one byte of it: the first are refused before any body byte is
    read, the others are read only as bytes arrive and dropped at the frame timeout; the
    server's memory grows by neither their 384 MiB nor their 96 MiB. A half header is
    dropped at the frame timeout too, and nothing leaks."""
    rss_before = _rss_kib(server.process.pid)
    refused = [_attacker(server.socket, struct.pack("<BI", protocol.BEGIN_PUT, 64 << 20) + b"{")
               for _ in range(6)]  # fmt: skip
    slow = [_attacker(server.socket, struct.pack("<BI", protocol.BEGIN_PUT, 16 << 20) + b"{")
            for _ in range(6)]  # fmt: skip
    half = _attacker(server.socket, b"\x02\x10")  # two bytes of a five-byte header
    for sock in refused:
        _expect_dropped(sock, "exceeds its limit")
    grown_kib = _rss_kib(server.process.pid) - rss_before
    print(f"server RSS growth with 6 x 64 MiB and 6 x 16 MiB headers pending: {grown_kib} KiB")
    assert grown_kib < 32 << 10, grown_kib
    for sock in [*slow, half]:
        _expect_dropped(sock, "not completed within")
    check_nothing_leaked(settled(server.store))


def _attacker(path: str, data: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60.0)
    sock.connect(path)
    sock.sendall(data)
    return sock


def _expect_dropped(sock: socket.socket, reason: str) -> None:
    """The server answers ERROR naming `reason`, then closes the connection."""
    try:
        op, body = protocol.read_frame(sock, protocol.Deadline(60.0))
        assert op == protocol.ERROR and reason in json.loads(body), body
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass  # closed with our unread bytes pending: also dropped
    finally:
        sock.close()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _hello(path: str) -> tuple[socket.socket, int, bytes]:
    """Connect, say HELLO and read the answer. A refused connection may be closed before
    the HELLO is written (a broken pipe): its reason is read all the same."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20.0)
    sock.connect(path)
    with contextlib.suppress(BrokenPipeError):
        sock.sendall(protocol.encode_json(protocol.HELLO, {}))
    op, body = protocol.read_frame(sock, protocol.Deadline(20.0))
    return sock, op, body


def _held_connection(path: str, attempts: int = 200) -> socket.socket:
    """A served connection (HELLO answered OK). A client that closed its connection
    holds its slot until the server's thread for it has seen the close (start_server's
    readiness probe, just before): the server says so, and the client tries again."""
    for _ in range(attempts):
        sock, op, body = _hello(path)
        if op == protocol.OK:
            return sock
        sock.close()
        assert op == protocol.ERROR and "limit of 4 connections" in json.loads(body), body
        time.sleep(0.05)
    raise AssertionError(f"no slot came free in {attempts} attempts")


def test_connections_beyond_the_limit_are_refused_with_a_reason() -> None:
    directory = Path(tempfile.mkdtemp(prefix="umbp-c-", dir="/tmp"))
    path = str(directory / "umbp.sock")
    process = start_server(path, 1 << 20, page_bytes=PAGE, max_connections=4,
                           log_path=str(directory / "serve.log"))
    try:
        held = [_held_connection(path) for _ in range(4)]
        # Four served connections hold all four slots: the fifth is refused for sure.
        # An engine's start-up probe finds the server there (it starts, and misses
        # until a slot comes free), and says why it was not served.
        probe = probe_server(path, 20.0)
        assert probe.listening and probe.hello is None
        assert "limit of 4 connections" in probe.problem, probe
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        extra.settimeout(20.0)
        extra.connect(path)
        op, body = protocol.read_frame(extra, protocol.Deadline(20.0))
        assert op == protocol.ERROR and "limit of 4 connections" in json.loads(body)
        extra.close()
        held.pop().close()  # a slot comes free: the next client is served
        with ServerStore(path, io_timeout_s=20.0) as store:
            deadline = time.monotonic() + 20
            while True:
                try:
                    figures = store.server_stats()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            assert figures["sessions"]["connections"] == 3  # the asker is not counted
            assert figures["limits"]["refused_connections"] >= 1
        for sock in held:
            sock.close()
    finally:
        stop_server(process, path)
        shutil.rmtree(directory, ignore_errors=True)
