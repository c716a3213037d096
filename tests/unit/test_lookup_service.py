"""Lookups of a pool in another process: the socket service, its client, and
routing core's keys to the pool of their rank by position."""

from __future__ import annotations

import glob
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace, RankCoord, RankTopology
from umbp.core.lookup.query import build_lookup_query
from umbp.core.rank_keys import HashRuns, KeyLayout, RankedKeys, object_major_keys, rank_tags
from umbp.runtime.contract import HashLookup, StoreUnavailable
from umbp.runtime.lookup_service import (
    LookupClient,
    LookupService,
    RankedLookup,
    decode_hash_runs,
    encode_hash_runs,
)
from umbp.runtime.pool import SlabPool


class _Known:
    """A store that knows a fixed key set (the routing tests need no bytes)."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys
        self.asked: list[str] = []
        self.cleared = False

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        self.asked.extend(keys)
        return tuple(key in self.keys for key in keys)

    def clear(self) -> bool:
        self.cleared = True
        return True

    def close(self) -> None:
        return None


@pytest.fixture
def pool() -> Iterator[SlabPool]:
    with SlabPool(1 << 20, page_bytes=4096) as pool:
        yield pool


def test_client_answers_what_the_pool_holds_and_clears_it(pool: SlabPool) -> None:
    assert pool.put_batch(["a", "b"], [memoryview(b"x" * 10), memoryview(b"y" * 10)]) == (True, True)
    service = LookupService(pool)
    client = LookupClient(service.path, timeout_s=5.0)
    try:
        assert client.lookup(["a", "zz", "b", "a"]) == (True, False, True, True)
        assert client.lookup([]) == ()
        assert client.clear()
        assert client.lookup(["a", "b"]) == (False, False)
    finally:
        client.close()
        service.close()


def test_socket_has_no_file(pool: SlabPool) -> None:
    service = LookupService(pool)
    try:
        assert service.path.startswith("\0")  # abstract namespace: nothing to remove
    finally:
        service.close()


def _lookup_as(uid: int, path: str, answers: multiprocessing.Queue[str]) -> None:  # type: ignore[type-arg]
    os.setuid(uid)
    try:
        answers.put(repr(LookupClient(path, timeout_s=5.0).lookup(["a"])))
    except StoreUnavailable as error:
        answers.put(f"refused: {error}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_gets_no_answer(pool: SlabPool) -> None:
    pool.put_batch(["a"], [memoryview(b"x" * 10)])
    service = LookupService(pool)
    context = multiprocessing.get_context("fork")
    answers: multiprocessing.Queue[str] = context.Queue()
    try:
        child = context.Process(target=_lookup_as, args=(65534, service.path, answers))
        child.start()
        answer = answers.get(timeout=30)
        child.join(30)
        assert answer.startswith("refused"), answer
        own = LookupClient(service.path, timeout_s=5.0)
        assert own.lookup(["a"]) == (True,)
        own.close()
    finally:
        service.close()


def _serve_in_child(path_out: multiprocessing.Queue[str], stop: multiprocessing.Event) -> None:  # type: ignore[type-arg]
    with SlabPool(1 << 20, page_bytes=4096) as pool:
        pool.put_batch(["k1"], [memoryview(b"z" * 100)])
        service = LookupService(pool)
        path_out.put(service.path)
        stop.wait(30)
        service.close()


def test_client_reaches_a_pool_in_another_process() -> None:
    context = multiprocessing.get_context("spawn")
    paths: multiprocessing.Queue[str] = context.Queue()
    stop = context.Event()
    child = context.Process(target=_serve_in_child, args=(paths, stop))
    child.start()
    try:
        client = LookupClient(paths.get(timeout=60), timeout_s=5.0)
        assert client.lookup(["k1", "k2"]) == (True, False)
        client.close()
    finally:
        stop.set()
        child.join(30)


def test_a_vanished_service_raises_store_unavailable(pool: SlabPool) -> None:
    service = LookupService(pool)
    client = LookupClient(service.path, timeout_s=1.0)
    service.close()
    with pytest.raises(StoreUnavailable):
        client.lookup(["a"])


def test_ranked_lookup_asks_each_key_of_the_pool_of_its_rank() -> None:
    keyspace = KeySpace("ns1", RankTopology(tp_size=2))
    rank0, rank1 = RankCoord(0, 0, 0, 0), RankCoord(1, 0, 0, 0)
    h1, h2 = b"\x01" * 8, b"\x02" * 8
    store0 = _Known({keyspace.key(rank0, 0, h1), keyspace.key(rank0, 0, h2)})
    store1 = _Known({keyspace.key(rank1, 0, h1)})
    ranked = RankedLookup(dict(zip(rank_tags(keyspace), (store0, store1), strict=True)))
    keys = object_major_keys(keyspace, [(0, h1), (0, h2)])
    assert list(keys) == [*keyspace.rank_keys(0, h1), *keyspace.rank_keys(0, h2)]
    assert ranked.lookup(keys) == (True, True, True, False)
    assert all(":tp0:" in key for key in store0.asked)
    assert all(":tp1:" in key for key in store1.asked)
    assert ranked.clear() and store0.cleared and store1.cleared


def test_a_key_of_a_rank_nobody_serves_is_a_miss() -> None:
    keyspace = KeySpace("ns1", RankTopology(tp_size=2))
    store0 = _Known({keyspace.key(RankCoord(0, 0, 0, 0), 0, b"\x01")})
    other = _Known(set())
    ranked = RankedLookup({rank_tags(keyspace)[0]: store0,
                           "umbp:1:elsewhere:tp9:pcp0:dcp0:pp0": other})
    assert ranked.lookup(object_major_keys(keyspace, [(0, b"\x01")])) == (True, False)


def test_plain_key_strings_over_several_ranks_are_refused() -> None:
    """Keys are routed by position only: strings without core's layout would
    have to be parsed to find their rank, so they are a caller's error."""
    keyspace = KeySpace("ns1", RankTopology(tp_size=2))
    ranked = RankedLookup({tag: _Known(set()) for tag in rank_tags(keyspace)})
    with pytest.raises(TypeError, match="RankedKeys"):
        ranked.lookup(list(keyspace.rank_keys(0, b"\x01")))
    # One rank: nothing to route, the store answers plain keys as they are.
    single = RankedLookup({"rank-0": _Known({"k"})})
    assert single.lookup(["k", "other"]) == (True, False)


def test_ranked_lookup_routes_core_keys_by_position_without_reading_them() -> None:
    """Keys that carry their layout go to the store of their position's rank, even
    when no rank could be read from them."""
    layout = KeyLayout.rank_major((2, 1), 2)  # group 0: 2 objects, group 1: 1 object
    keys = RankedKeys(["a0", "a1", "b0", "b1", "c", "d"], layout, ["rank-0", "rank-1"])
    # rank 0 owns positions 0, 1, 4; rank 1 owns 2, 3, 5
    store0, store1 = _Known({"a0", "c", "d"}), _Known({"b1", "d"})
    ranked = RankedLookup({"rank-0": store0, "rank-1": store1})
    assert ranked.lookup(keys) == (True, False, False, True, True, True)
    assert store0.asked == ["a0", "a1", "c"] and store1.asked == ["b0", "b1", "d"]
    lonely = RankedLookup({"rank-1": store1})  # rank 0 served by nobody: misses
    assert lonely.lookup(keys) == (False, False, False, True, False, True)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_lookup_query_routed_by_position_matches_routing_by_the_rank_in_each_key(
    tp: int,
) -> None:
    keyspace = KeySpace("ns1", RankTopology(tp_size=tp))
    geometry = CacheGeometry((0, 1), (16, 32), (16, 32), 32, 16)
    hashes = [bytes([index]) * 32 for index in range(12)]
    query = build_lookup_query(geometry, keyspace, hashes, 32, 12 * 16)
    coords = keyspace.topology.coords()
    # The scheduler names each rank's store with core's tag of that rank: the
    # part of each of the rank's keys before the group.
    tags = tuple(keyspace.key(rank, 0, b"").rsplit(":", 2)[0] for rank in coords)
    assert query.runs.key_strings().rank_tags == tags == rank_tags(keyspace)
    held = {key for index, key in enumerate(query.runs.key_strings()) if index % 3 and index % 7}
    by_position = RankedLookup({tag: _Known(held) for tag in tags})
    assert by_position.lookup(query.runs.key_strings()) == tuple(k in held for k in query.runs.key_strings())
    for tag, store in zip(tags, by_position._stores.values()):
        assert isinstance(store, _Known) and all(key.startswith(tag + ":") for key in store.asked)


def _serve_and_die(path_out: multiprocessing.Queue[str]) -> None:  # type: ignore[type-arg]
    pool = SlabPool(1 << 20, page_bytes=4096)
    service = LookupService(pool)
    path_out.put(service.path)
    time.sleep(60)  # killed before it could close anything


def test_a_killed_owner_leaves_nothing_behind() -> None:
    """vLLM SIGKILLs its workers at shutdown: no socket file may outlive them."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "umbp-lookup-*")))
    context = multiprocessing.get_context("spawn")
    paths: multiprocessing.Queue[str] = context.Queue()
    child = context.Process(target=_serve_and_die, args=(paths,))
    child.start()
    path = paths.get(timeout=60)
    assert LookupClient(path, timeout_s=5.0).lookup(["k"]) == (False,)
    child.kill()
    child.join(30)
    with pytest.raises(StoreUnavailable):
        LookupClient(path, timeout_s=5.0).lookup(["k"])
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "umbp-lookup-*"))) == before


def _hash_runs(tags: tuple[str, ...], segments: int, per_segment: int) -> HashRuns:
    return HashRuns.of_segments(
        tags,
        tuple(tuple(f"umbp:f:{tag}:g{group}:" for tag in tags) for group in range(segments)),
        tuple(tuple(bytes([group, index]) * 16 for index in range(per_segment * (group + 1)))
              for group in range(segments)),
    )


def test_a_lookup_by_hash_crosses_the_socket_as_hashes_and_answers_as_the_keys(
    pool: SlabPool,
) -> None:
    runs = _hash_runs(("r0", "r1"), segments=3, per_segment=4)
    keys = runs.key_strings()
    held = [key for index, key in enumerate(keys) if index % 3]
    assert all(pool.put_batch(held, [memoryview(b"x")] * len(held)))
    service = LookupService(pool)
    client = LookupClient(service.path, timeout_s=5.0)
    try:
        assert isinstance(client, HashLookup)
        assert encode_hash_runs(runs) is not None  # sent as hashes, not as strings
        assert client.lookup_hashes(runs) == pool.lookup(keys) == tuple(k in held for k in keys)
        assert client.lookup_hashes(_hash_runs(("r0",), segments=0, per_segment=1)) == ()
        # Hashes of several lengths in one segment go as key strings, same answer.
        mixed = HashRuns.of_segments(("r0",), (("umbp:f:r0:g0:",),), ((b"\x00" * 16, b"\x01"),))
        assert encode_hash_runs(mixed) is None
        assert client.lookup_hashes(mixed) == pool.lookup(mixed.key_strings())
    finally:
        client.close()
        service.close()


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=4),
       st.integers(1, 3), st.sampled_from(["", "α", "tag"]))
def test_hash_runs_decode_to_what_was_encoded(
    segments: list[tuple[int, int]], ranks: int, name: str
) -> None:
    tags = tuple(f"{name}{rank}" for rank in range(ranks))
    runs = HashRuns.of_segments(
        tags,
        tuple(tuple(f"p{name}:{group}:{tag}:" for tag in tags) for group in range(len(segments))),
        tuple(tuple(bytes([index]) * length for index in range(count))
              for length, count in segments),
    )
    payload = encode_hash_runs(runs)
    assert payload is not None
    assert decode_hash_runs(payload) == runs


@pytest.mark.parametrize("payload", [
    b"", b"\x05\x00\x00\x00{}", b"\x02\x00\x00\x00{}",
    b"\x3c\x00\x00\x00" + b'{"tags": ["a"], "prefixes": [["a:"]], "counts": [2], "hash_bytes": [4]}'[:60],
    b"\x02\x00\x00\x00[]",
])
def test_a_lookup_by_hash_that_does_not_decode_reaches_no_store(payload: bytes) -> None:
    with pytest.raises(ConnectionError):
        decode_hash_runs(payload)


def test_malformed_lookups_by_hash_are_refused_and_the_service_keeps_serving(
    pool: SlabPool,
) -> None:
    header = b'{"tags": ["a"], "prefixes": [["nocolon"]], "counts": [1], "hash_bytes": [2]}'
    bad = [
        len(header).to_bytes(4, "little") + header + b"\x01\x02",  # prefix without ':'
        len(header).to_bytes(4, "little") + header + b"\x01",  # a byte short
        b"\xff\x00\x00\x00not json",
    ]
    assert pool.put_batch(["nocolon0102", "a:0102"], [memoryview(b"x")] * 2) == (True, True)
    service = LookupService(pool)
    try:
        for payload in bad:
            client = LookupClient(service.path, timeout_s=5.0)
            with pytest.raises(StoreUnavailable):
                client._call(b"H", payload, 1)
            client.close()
        client = LookupClient(service.path, timeout_s=5.0)
        runs = HashRuns.of_segments(("a",), (("a:",),), ((b"\x01\x02", b"\x03\x04"),))
        assert client.lookup_hashes(runs) == (True, False)
        client.close()
    finally:
        service.close()


class _OpsRecorded(LookupClient):
    """A real client that records the op of every request it sends."""

    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__(path, timeout_s)
        self.ops: list[bytes] = []

    def _call(self, op: bytes, payload: bytes, answer_size: int) -> bytes:
        self.ops.append(op)
        return super()._call(op, payload, answer_size)


def test_ranked_lookup_over_sockets_asks_by_hash() -> None:
    """TP>1 with the scheduler in another process: every rank's pool is asked its
    prefixes and hashes over its socket, and answers as its key strings."""
    runs = _hash_runs(("r0", "r1"), segments=2, per_segment=3)
    keys = runs.key_strings()
    pools = [SlabPool(1 << 16, page_bytes=64) for _ in range(2)]
    services = [LookupService(p) for p in pools]
    clients = [_OpsRecorded(s.path, timeout_s=5.0) for s in services]
    try:
        for rank, p in enumerate(pools):
            mine = keys.keys_of_rank(rank)[rank:]  # rank 1 lacks its first object
            assert all(p.put_batch(mine, [memoryview(b"x")] * len(mine)))
        ranked = RankedLookup(dict(zip(("r0", "r1"), clients, strict=True)))
        by_hash = ranked.lookup_hashes(runs)
        assert [client.ops for client in clients] == [[b"H"], [b"H"]]
        assert by_hash == ranked.lookup(keys)
        assert by_hash.count(False) == 1
    finally:
        for client in clients:
            client.close()
        for service in services:
            service.close()
        for p in pools:
            p.close()
