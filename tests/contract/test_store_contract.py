"""The store contract (umbp/runtime/contract.py), checked the same way on every back-end.

Each test takes the `backend` fixture (tests/contract/conftest.py), parametrized over the
registry, and never asks which back-end it has.
"""

from __future__ import annotations

import ctypes
import mmap
import random
import threading

import pytest

from tests.contract.conftest import MIB, Backend
from umbp.runtime.contract import (
    LoadStatus,
    RegistersHostMemory,
    SchedulerStore,
    StoreUnavailable,
    WorkerStore,
)

HIT, MISSING = LoadStatus.HIT, LoadStatus.MISSING
SIZES = (1, 7, 4096, 100_003, MIB, 3 * MIB + 5)


def content(seed: int, size: int) -> bytes:
    """Deterministic, seed-specific bytes."""
    return random.Random(seed).randbytes(size)


def load(store: WorkerStore, key: str, size: int) -> tuple[LoadStatus, bytes]:
    out = bytearray(size)
    (status,) = store.get_batch_into([key], [memoryview(out)])
    return status, bytes(out)


def test_store_implements_both_roles(backend: Backend) -> None:
    assert isinstance(backend.store, WorkerStore)
    assert isinstance(backend.store, SchedulerStore)


# ------------------------------------------------------------------ lookup


def test_lookup_of_no_keys_is_empty(backend: Backend) -> None:
    assert backend.store.lookup([]) == ()


def test_lookup_answers_each_key_in_order(backend: Backend) -> None:
    store = backend.store
    assert store.lookup(["a", "b", "c"]) == (False, False, False)
    assert store.put_batch(["b"], [b"bee"]) == (True,)
    assert store.lookup(["a", "b", "c", "b"]) == (False, True, False, True)


def test_a_lookup_longer_than_any_call_answers_every_key_in_order(backend: Backend) -> None:
    """131,072 keys (a 256-request store step's residency check): more than the store's
    stated `batch_limit` (umbp serve: 65,536) and than the 4,096 objects per call the
    Mooncake and MORI adapters move; residents on both sides of every cut."""
    store = backend.store
    limit = store.batch_limit
    assert limit is None or (isinstance(limit, int) and limit >= 1)
    count = max(131_072, 2 * (limit or 0) + 1)
    keys = [f"long-lookup-{index:07d}" for index in range(count)]
    resident = sorted({0, 4_095, 4_096, 65_535, 65_536, 65_537, count // 2, count - 1})
    assert store.put_batch([keys[i] for i in resident], [b"r"] * len(resident)) == (
        (True,) * len(resident)
    )
    answers = store.lookup(keys)
    assert len(answers) == count
    assert [index for index, found in enumerate(answers) if found] == resident


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("size", SIZES)
def test_put_then_get_is_bit_identical(backend: Backend, size: int) -> None:
    data = content(size, size)
    assert backend.store.put_batch([f"obj-{size}"], [memoryview(data)]) == (True,)
    assert backend.store.lookup([f"obj-{size}"]) == (True,)
    assert load(backend.store, f"obj-{size}", size) == (HIT, data)


def test_a_batch_of_mixed_sizes_round_trips(backend: Backend) -> None:
    keys = [f"mixed-{size}" for size in SIZES]
    data = [content(index, size) for index, size in enumerate(SIZES)]
    assert backend.store.put_batch(keys, data) == (True,) * len(keys)
    outs = [bytearray(size) for size in SIZES]
    assert backend.store.get_batch_into(keys, outs) == (HIT,) * len(keys)
    assert [bytes(out) for out in outs] == data


def test_any_contiguous_buffer_is_a_payload(backend: Backend) -> None:
    """bytes, bytearray, memoryview slices and mmap all export the buffer protocol."""
    mapped = mmap.mmap(-1, 8192)
    mapped[:] = content(9, 8192)
    sources = [content(1, 300), bytearray(content(2, 300)), memoryview(content(3, 600))[100:400]]
    keys = ["bytes", "bytearray", "slice", "mmap"]
    assert backend.store.put_batch(keys, [*sources, mapped]) == (True,) * 4
    outs = [bytearray(300), bytearray(300), bytearray(300), mmap.mmap(-1, 8192)]
    assert backend.store.get_batch_into(keys, outs) == (HIT,) * 4
    assert [bytes(out) for out in outs[:3]] == [bytes(source) for source in sources]
    assert outs[3][:] == mapped[:]


def test_put_of_a_resident_key_answers_true_and_keeps_the_first_content(
    backend: Backend,
) -> None:
    first, second = content(1, 5000), content(2, 5000)
    assert backend.store.put_batch(["k"], [first]) == (True,)
    assert backend.store.put_batch(["k"], [second]) == (True,)
    assert load(backend.store, "k", 5000) == (HIT, first)


# ------------------------------------------------------------------ partial failures


def test_missing_keys_in_a_get_batch_get_their_own_status(backend: Backend) -> None:
    store = backend.store
    data = {key: content(index, 2000) for index, key in enumerate(["a", "c"])}
    assert store.put_batch(list(data), list(data.values())) == (True, True)
    outs = [bytearray(2000) for _ in range(4)]
    statuses = store.get_batch_into(["a", "b", "c", "d"], outs)
    assert statuses == (HIT, MISSING, HIT, MISSING)
    assert (bytes(outs[0]), bytes(outs[2])) == (data["a"], data["c"])
    assert bytes(outs[1]) == bytes(outs[3]) == bytes(2000), "a miss must not touch its buffer"


def test_an_oversize_object_is_rejected_while_the_rest_of_its_batch_is_stored(
    backend: Backend,
) -> None:
    small = [content(1, 1000), content(2, 2000)]
    huge = bytes(backend.oversize_bytes)
    results = backend.store.put_batch(["s1", "huge", "s2"], [small[0], huge, small[1]])
    assert results == (True, False, True)
    assert backend.store.lookup(["s1", "huge", "s2"]) == (True, False, True)
    assert load(backend.store, "s2", 2000) == (HIT, small[1])


@pytest.mark.parametrize("delta", [-1, 1, 4096])
def test_a_buffer_of_the_wrong_size_is_a_size_mismatch_and_stays_untouched(
    backend: Backend, delta: int
) -> None:
    data = content(5, 10_000)
    assert backend.store.put_batch(["k", "ok"], [data, data]) == (True, True)
    wrong = bytearray(b"\xab" * (len(data) + delta))
    right = bytearray(len(data))
    statuses = backend.store.get_batch_into(["k", "ok"], [wrong, right])
    assert statuses == (LoadStatus.SIZE_MISMATCH, HIT)
    assert wrong == bytearray(b"\xab" * (len(data) + delta))
    assert bytes(right) == data
    assert load(backend.store, "k", len(data)) == (HIT, data), "a mismatch drops nothing"


def test_a_corrupted_object_answers_corrupt_once_then_missing(backend: Backend) -> None:
    data = content(6, 300_000)
    other = content(7, 300_000)
    corrupt_before = backend.store.stats().corrupt_loads
    assert backend.store.put_batch(["victim", "other"], [data, other]) == (True, True)
    backend.corrupt("victim")
    outs = [bytearray(len(data)), bytearray(len(other))]
    statuses = backend.store.get_batch_into(["victim", "other"], outs)
    assert statuses == (LoadStatus.CORRUPT, HIT)
    assert bytes(outs[1]) == other
    assert backend.store.lookup(["victim"]) == (False,)
    assert load(backend.store, "victim", len(data))[0] is MISSING
    assert backend.store.stats().corrupt_loads - corrupt_before == 1


def test_mismatched_argument_lengths_raise_value_error(backend: Backend) -> None:
    with pytest.raises(ValueError):
        backend.store.put_batch(["a", "b"], [b"x"])
    with pytest.raises(ValueError):
        backend.store.get_batch_into(["a"], [bytearray(1), bytearray(1)])
    assert backend.store.lookup(["a", "b"]) == (False, False), "nothing was stored"


def test_a_read_only_output_buffer_is_a_caller_error(backend: Backend) -> None:
    assert backend.store.put_batch(["k"], [b"abc"]) == (True,)
    with pytest.raises(ValueError):
        backend.store.get_batch_into(["k"], [b"xyz"])


# ------------------------------------------------------------------ clear, close, stats


def test_clear_drops_every_object(backend: Backend) -> None:
    keys = [f"c{index}" for index in range(20)]
    assert all(backend.store.put_batch(keys, [content(i, 100) for i in range(20)]))
    assert backend.store.clear() is True
    assert backend.store.lookup(keys) == (False,) * 20
    assert load(backend.store, "c0", 100)[0] is MISSING
    assert backend.store.put_batch(["after"], [b"again"]) == (True,), "usable after clear"
    assert load(backend.store, "after", 5) == (HIT, b"again")


def test_close_is_idempotent_and_later_calls_fail_with_contract_values(
    backend: Backend,
) -> None:
    store = backend.store
    assert store.put_batch(["k"], [b"value"]) == (True,)
    store.close()
    store.close()
    with pytest.raises(StoreUnavailable):
        store.lookup(["k"])
    assert store.put_batch(["k2"], [b"v"]) == (False,)
    out = bytearray(5)
    assert store.get_batch_into(["k"], [out]) == (LoadStatus.UNAVAILABLE,)
    assert out == bytearray(5)
    assert store.clear() is False


def test_stats_count_what_happened(backend: Backend) -> None:
    store = backend.store
    before = store.stats()
    assert store.put_batch(["a", "b"], [content(1, 1000), content(2, 3000)]) == (True, True)
    statuses = store.get_batch_into(["a", "zz"], [bytearray(1000), bytearray(1)])
    assert statuses == (HIT, MISSING)
    after = store.stats()
    assert after.puts - before.puts == 2
    assert after.bytes_written - before.bytes_written == 4000
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 1)
    assert after.bytes_read - before.bytes_read == 1000
    assert after.capacity_bytes >= 0 and after.page_bytes >= 1


# ------------------------------------------------------------------ several clients


def test_a_second_client_sees_and_restores_what_the_first_stored(backend: Backend) -> None:
    data = content(11, 2 * MIB)
    assert backend.store.put_batch(["shared"], [data]) == (True,)
    client = backend.open_client()
    try:
        assert client.lookup(["shared", "nope"]) == (True, False)
        assert load(client, "shared", len(data)) == (HIT, data)
        assert client.put_batch(["back"], [data[:100]]) == (True,)
    finally:
        client.close()
    assert load(backend.store, "back", 100) == (HIT, data[:100])


def test_concurrent_clients_in_threads_keep_every_object_intact(backend: Backend) -> None:
    threads_count, objects, size = 4, 25, 20_000
    clients = [backend.open_client() for _ in range(threads_count)]
    failures: list[str] = []

    def work(worker: int) -> None:
        client = clients[worker]
        keys = [f"t{worker}-{index}" for index in range(objects)]
        data = [content(worker * 1000 + index, size) for index in range(objects)]
        for start in range(0, objects, 5):
            if not all(client.put_batch(keys[start : start + 5], data[start : start + 5])):
                failures.append(f"put by {worker}")
            client.lookup([f"t{(worker + 1) % threads_count}-{start}"])
        outs = [bytearray(size) for _ in range(objects)]
        if client.get_batch_into(keys, outs) != (HIT,) * objects:
            failures.append(f"get by {worker}")
        if [bytes(out) for out in outs] != data:
            failures.append(f"content seen by {worker}")

    workers = [threading.Thread(target=work, args=(index,)) for index in range(threads_count)]
    try:
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in workers), "a client hung"
    finally:
        closers = [threading.Thread(target=client.close) for client in clients]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join()
    assert failures == []
    every = [f"t{w}-{i}" for w in range(threads_count) for i in range(objects)]
    assert backend.store.lookup(every) == (True,) * len(every)


def test_one_store_shared_by_threads(backend: Backend) -> None:
    store, size = backend.store, 5000
    failures: list[str] = []

    def work(worker: int) -> None:
        for index in range(30):
            key, data = f"s{worker}-{index}", content(worker * 100 + index, size)
            if store.put_batch([key], [data]) != (True,):
                failures.append(f"put {key}")
            if load(store, key, size) != (HIT, data):
                failures.append(f"get {key}")

    workers = [threading.Thread(target=work, args=(index,)) for index in range(4)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=60)
    assert failures == []


# ------------------------------------------------------------------ scale


def test_lookup_of_a_thousand_keys(backend: Backend) -> None:
    stored = [f"many-{index}" for index in range(0, 1000, 3)]
    assert all(backend.store.put_batch(stored, [b"v"] * len(stored)))
    answers = backend.store.lookup([f"many-{index}" for index in range(1000)])
    assert answers == tuple(index % 3 == 0 for index in range(1000))


def test_hundreds_of_objects_in_one_batch(backend: Backend) -> None:
    count, size = 400, 64 << 10  # 25 MiB: more than a Mooncake client's bounce buffer
    keys = [f"bulk-{index}" for index in range(count)]
    data = [content(index, size) for index in range(count)]
    assert backend.store.put_batch(keys, data) == (True,) * count
    outs = [bytearray(size) for _ in range(count)]
    assert backend.store.get_batch_into(keys, outs) == (HIT,) * count
    mismatched = [index for index in range(count) if bytes(outs[index]) != data[index]]
    assert mismatched == []


# ------------------------------------------------------------------ registered memory


def test_buffers_carved_from_one_mapping_round_trip_registered_where_supported(
    backend: Backend,
) -> None:
    # How the worker hands over its staging buffer: slices of one long-lived mapping,
    # registered with transports that need it (Mooncake, MORI).
    store = backend.store
    registers = isinstance(store, RegistersHostMemory)
    region = mmap.mmap(-1, 6 * MIB)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if registers:
        store.register_host_memory(address, len(region))
    try:
        view = memoryview(region)
        data = [content(index, MIB) for index in range(2)]
        view[:MIB] = data[0]
        view[MIB : 2 * MIB] = data[1]
        small = view[2 * MIB : 2 * MIB + 1000]  # small objects may be staged all the same
        small[:] = data[0][:1000]
        sources = [view[:MIB], view[MIB : 2 * MIB], small]
        assert store.put_batch(["r0", "r1", "r2"], sources) == (True, True, True)
        outs = [view[3 * MIB : 4 * MIB], view[4 * MIB : 5 * MIB], view[5 * MIB : 5 * MIB + 1000]]
        assert store.get_batch_into(["r1", "r0", "r2"], outs) == (HIT, HIT, HIT)
        assert [bytes(out) for out in outs] == [data[1], data[0], data[0][:1000]]
        for wrong in (view[3 * MIB : 4 * MIB + 1], view[3 * MIB : 4 * MIB - 1]):
            wrong[:] = b"\xab" * wrong.nbytes
            assert store.get_batch_into(["r0"], [wrong]) == (LoadStatus.SIZE_MISMATCH,)
            assert bytes(wrong) == b"\xab" * wrong.nbytes
        view.release()
    finally:
        if registers:
            store.unregister_host_memory(address)
