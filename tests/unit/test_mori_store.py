"""MoriStore against the fake of `mori.umbp` (umbp/testing/fake_mori.py): what the shared
contract suite does not reach (deployments, the documented defects, strict registration,
missing module, a stopped server)."""

from __future__ import annotations

import random
import sys

import pytest

from umbp.runtime.contract import LoadStatus, StoreUnavailable
from umbp.runtime.mori.binding import MoriSetupError, import_mori
from umbp.runtime.mori.store import META_SUFFIX, MoriStore
from umbp.testing.fake_mori import (
    FakeOptions,
    corrupt_object,
    install,
    make_module,
    stop_server,
)

MIB = 1 << 20
HIT, MISSING = LoadStatus.HIT, LoadStatus.MISSING


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def load(store: MoriStore, key: str, size: int) -> tuple[LoadStatus, bytes]:
    out = bytearray(size)
    (status,) = store.get_batch_into([key], [out])
    return status, bytes(out)


def test_a_missing_mori_module_names_the_package_and_rocm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mori", None)  # makes `import mori.umbp` fail
    with pytest.raises(MoriSetupError, match="amd-mori.*ROCm"):
        import_mori()
    with pytest.raises(MoriSetupError, match="mode 'mori'"):
        MoriStore()


def test_install_serves_the_fake_to_an_adapter_that_imports_mori() -> None:
    with install("nightly") as module:
        assert sys.modules["mori.umbp"] is module
        with MoriStore(capacity_bytes=MIB) as store:
            assert store.raw_client.get_deployment_mode() == "embedded"
            assert store.put_batch(["k"], [b"v"]) == (True,)
    assert "mori.umbp" not in sys.modules or sys.modules["mori.umbp"] is not module


def test_the_fake_reproduces_the_1_2_4_clear_defect_and_the_adapter_works_around_it() -> None:
    module = make_module("1.2.4")
    raw = module.UMBPClient(module.UMBPConfig())
    raw.clear()
    assert raw.batch_put_from_ptr(["x"], [0], [0]) == [False], "the defect is emulated"

    store = MoriStore(capacity_bytes=MIB, module=module)
    assert store.put_batch(["a"], [b"1"]) == (True,)
    assert store.clear() is True
    assert store.put_batch(["b"], [b"2"]) == (True,)
    assert load(store, "b", 1) == (HIT, b"2")
    store.close()


def test_nightly_clients_have_no_close_and_the_store_still_closes() -> None:
    module = make_module("nightly")
    store = MoriStore(capacity_bytes=MIB, module=module)
    assert not hasattr(store.raw_client, "close")
    assert store.put_batch(["k"], [b"v"]) == (True,)
    assert store.clear() is True and store.put_batch(["k"], [b"v"]) == (True,)
    store.close()
    store.close()
    with pytest.raises(StoreUnavailable):
        store.lookup(["k"])


def test_embedded_stores_are_private_and_shared_deployments_are_shared() -> None:
    module = make_module()
    first, second = (MoriStore(capacity_bytes=MIB, module=module) for _ in range(2))
    assert first.put_batch(["k"], [b"v"]) == (True,)
    assert second.lookup(["k"]) == (False,)
    for deployment, address in (("standalone", "unix:///tmp/u.sock"), ("distributed", "m:1")):
        a = MoriStore(deployment, address, MIB, module=module)
        b = MoriStore(deployment, address, MIB, module=module)
        assert a.raw_client.get_deployment_mode() == deployment
        assert a.raw_client.is_distributed() is (deployment == "distributed")
        assert a.put_batch(["k"], [b"shared"]) == (True,)
        assert load(b, "k", 6) == (HIT, b"shared")
        a.close()
        b.close()
    first.close()
    second.close()


def test_shared_deployments_need_an_address() -> None:
    with pytest.raises(ValueError, match="address"):
        MoriStore("standalone", None, MIB, module=make_module())
    with pytest.raises(ValueError, match="deployment"):
        MoriStore("cluster", "x", MIB, module=make_module())


def test_a_stopped_server_gives_contract_failures_then_recovers() -> None:
    module = make_module()
    store = MoriStore("standalone", "unix:///tmp/s.sock", MIB, module=module)
    assert store.put_batch(["k"], [b"value"]) == (True,)
    stop_server(module, "unix:///tmp/s.sock")
    with pytest.raises(StoreUnavailable, match="standalone"):
        store.lookup(["k"])
    assert store.put_batch(["k2"], [b"v"]) == (False,)
    out = bytearray(5)
    assert store.get_batch_into(["k"], [out]) == (LoadStatus.UNAVAILABLE,)
    assert out == bytearray(5)
    assert store.clear() is False
    stop_server(module, "unix:///tmp/s.sock", stopped=False)
    assert load(store, "k", 5) == (HIT, b"value")
    store.close()


@pytest.mark.parametrize("staging_bytes", [0, MIB])
def test_only_registered_pointers_reach_a_strict_mori(staging_bytes: int) -> None:
    """The fake refuses unregistered pointers here, so success proves that the adapter
    bounces or registers every buffer (objects above the staging size included)."""
    module = make_module(options=FakeOptions(require_registered=True))
    store = MoriStore(capacity_bytes=16 * MIB, staging_bytes=staging_bytes, module=module)
    data = [content(1, 1000), content(2, 3 * MIB)]
    assert store.put_batch(["small", "large"], data) == (True, True)
    outs = [bytearray(1000), bytearray(3 * MIB)]
    assert store.get_batch_into(["small", "large"], outs) == (HIT, HIT)
    assert [bytes(out) for out in outs] == data
    store.close()


def test_each_client_detects_a_corrupt_object_by_itself() -> None:
    module = make_module()
    a = MoriStore("distributed", "m:1", MIB, module=module)
    b = MoriStore("distributed", "m:1", MIB, module=module)
    data = content(3, 4000)
    assert a.put_batch(["k"], [data]) == (True,)
    corrupt_object(a.raw_client, "k", offset=123)
    assert load(a, "k", 4000)[0] is LoadStatus.CORRUPT
    assert a.lookup(["k"]) == (False,)
    assert load(a, "k", 4000)[0] is MISSING
    assert load(b, "k", 4000)[0] is LoadStatus.CORRUPT, "no remove call: b checks for itself"
    a.close()
    b.close()


def test_an_evicted_sidecar_reads_as_missing() -> None:
    module = make_module()
    store = MoriStore("distributed", "m:1", MIB, module=module)
    assert store.put_batch(["k"], [b"payload"]) == (True,)
    backing = store.raw_client._backing
    del backing.objects["k" + META_SUFFIX]
    assert store.lookup(["k"]) == (True,)
    assert load(store, "k", 7)[0] is MISSING
    store.close()


def test_objects_beyond_capacity_evict_the_least_recently_used() -> None:
    module = make_module()
    store = MoriStore(capacity_bytes=MIB, module=module)
    keys = [f"k{index}" for index in range(5)]
    assert store.put_batch(keys, [content(index, 300_000) for index in range(5)]) == (True,) * 5
    assert store.lookup(keys)[:2] == (False, False)
    assert store.lookup(keys)[-1] is True
    store.close()


def test_fake_batch_calls_answer_lists_of_bool() -> None:
    module = make_module()
    raw = module.UMBPClient(module.UMBPConfig())
    buffer = bytearray(b"abc")
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert raw.batch_put_from_ptr(["a", "b"], [address, address], [3, 3]) == [True, True]
    assert raw.batch_exists(["a", "x", "b"]) == [True, False, True]
    assert raw.batch_exists_consecutive(["a", "b", "x", "a"]) == 2
    assert raw.batch_get_into_ptr(["a", "a"], [address, address], [3, 2]) == [True, False]
    assert raw.exists("a") is True and raw.get_into_ptr("x", address, 3) is False
