"""`StoreCore` per namespace, without its socket: the listing, dropping one namespace,
retention within budgets, limits, and bad requests that change nothing (the server's
side; tests/integration/test_server_operator.py drives the same through `umbp`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_server_state import PAGE, Rig
from umbp.runtime.server import state as state_module
from umbp.runtime.server.labels import LabelFile
from umbp.runtime.server.sessions import RequestRefused
from umbp.runtime.ssd.tier import SsdTier


def key(namespace: str, serial: int) -> str:
    return f"umbp:1:{namespace}:tp0:pcp0:dcp0:pp0:g0:{serial:04x}"


def objects(namespace: str, count: int, start: int = 0) -> dict[str, bytes]:
    return {key(namespace, start + i): bytes([start + i + 1]) * (PAGE - 7) for i in range(count)}


@pytest.fixture
def ssd(tmp_path: Path) -> Iterator[SsdTier]:
    tier = SsdTier(tmp_path / "ssd", 64 * PAGE, slot_bytes=PAGE)
    yield tier
    tier.close()


def row(rig: Rig, namespace: str) -> dict[str, Any]:
    return next(r for r in rig.core.namespaces() if r["namespace"] == namespace)


def test_the_listing_counts_each_namespace_per_tier_with_its_label_and_use(
    ssd: SsdTier,
) -> None:
    rig = Rig(20, cold=ssd)  # high 19 pages, low 10
    rig.core.register("aaaa", "vllm /models/a float32 tp1")
    assert all(rig.put(objects("aaaa", 12)))
    assert all(rig.put(objects("bbbb", 12)))
    assert all(rig.put({"not-umbp": b"x"}))
    rig.get([key("aaaa", 0), key("aaaa", 99)], [PAGE - 7, 1])
    a, b, other = row(rig, "aaaa"), row(rig, "bbbb"), row(rig, "")
    assert a["label"] == "vllm /models/a float32 tp1" and b["label"] is None
    for r, count in ((a, 12), (b, 12), (other, 1)):
        assert r["dram"]["objects"] + r["ssd"]["objects"] >= count
        assert r["puts"] == count
    assert (a["loads"], a["loads_from_ssd"]) == (1, 1), "aaaa:0 was demoted"
    assert (a["lookup_hits"], a["lookup_misses"]) == (0, 0), "a get is not a lookup"
    assert a["ssd"]["objects"] > 0 and a["ssd"]["bytes"] == a["ssd"]["objects"] * (PAGE - 7)
    dram_total = sum(r["dram"]["bytes"] for r in rig.core.namespaces())
    assert dram_total == rig.core.stats()["dram"]["used_bytes"]
    assert a["last_use_unix"] is not None and b["loads"] == 0


def test_dropping_a_namespace_leaves_the_others_and_what_is_in_use(ssd: SsdTier) -> None:
    rig = Rig(20, cold=ssd)
    rig.put(objects("aaaa", 14))
    rig.put(objects("bbbb", 4))
    reader = rig.core.open_session()
    _, answers = rig.core.begin_get(reader, [key("aaaa", 13)], [PAGE - 7])
    assert isinstance(answers[0], tuple), "pinned by a get in flight"
    before = row(rig, "aaaa")
    dropped = rig.core.drop("aaaa")
    assert dropped["in_use"] == 1
    assert dropped["dram"] == before["dram"]["objects"] - 1
    assert dropped["ssd"] == before["ssd"]["objects"]
    assert dropped["objects"] == 13
    keys_a = [key("aaaa", i) for i in range(14)]
    assert rig.core.lookup(keys_a) == bytes(13) + b"\x01"
    assert rig.core.lookup([key("bbbb", i) for i in range(4)]) == b"\x01" * 4
    assert ssd.lookup(keys_a[:13]) == (False,) * 13
    rig.core.close_session(reader)
    everything = rig.core.drop(None)
    assert everything["objects"] == 5 and everything["in_use"] == 0
    assert rig.core.stats()["objects"] == 0


def test_an_unknown_namespace_is_refused_and_nothing_changes() -> None:
    rig = Rig(20)
    rig.put(objects("aaaa", 3))
    with pytest.raises(RequestRefused, match="unknown namespace 'zzzz'.*'aaaa'"):
        rig.core.drop("zzzz")
    with pytest.raises(RequestRefused, match="unknown namespace"):
        rig.core.set_limits("zzzz", {"quota_bytes": 4 * PAGE})
    assert row(rig, "aaaa")["dram"]["objects"] == 3
    assert [r["namespace"] for r in rig.core.namespaces()] == ["aaaa"]


def test_limits_past_the_capacity_or_the_quota_are_refused_whole() -> None:
    rig = Rig(20)  # high watermark 19 pages; all retention together: 10 // 2 = 5 pages
    rig.put(objects("aaaa", 1))
    with pytest.raises(RequestRefused, match="high watermark"):
        rig.core.set_limits("aaaa", {"quota_bytes": 20 * PAGE})
    with pytest.raises(RequestRefused, match="over what all namespaces may retain together"):
        rig.core.set_limits("aaaa", {"retain_budget_bytes": 6 * PAGE})
    with pytest.raises(RequestRefused, match="over its quota"):
        rig.core.set_limits("aaaa", {"quota_bytes": 2 * PAGE, "retain_budget_bytes": 3 * PAGE})
    assert row(rig, "aaaa")["quota_bytes"] is None
    answer = rig.core.set_limits("aaaa", {"quota_bytes": 4 * PAGE})
    assert answer["quota_bytes"] == 4 * PAGE


def test_a_quota_keeps_a_namespace_to_it_by_evicting_its_own(ssd: SsdTier) -> None:
    rig = Rig(20, cold=ssd)
    rig.put(objects("bbbb", 3))
    rig.core.set_limits("bbbb", {"quota_bytes": 4 * PAGE})
    for start in range(3, 12):
        assert rig.put(objects("bbbb", 1, start)) == [True]
        assert row(rig, "bbbb")["dram"]["bytes"] <= 4 * PAGE
    assert row(rig, "bbbb")["evictions"]["quota"] == 8
    assert rig.core.lookup([key("bbbb", 0)]) == b"\x02", "on SSD, not lost"
    assert rig.core.where([key("bbbb", 0)]) == b"\x02"


def test_retained_objects_outlive_another_namespaces_burst_until_their_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(state_module.time, "monotonic", lambda: clock[0])
    rig = Rig(20)  # DRAM only: evicted objects are gone
    rig.core.configure_retention(60.0, 5 * PAGE, capped=False)
    rig.put(objects("aaaa", 8))
    kept = [key("aaaa", i) for i in range(4)]
    answer = rig.core.retain([*kept, key("aaaa", 99)], 30.0)
    assert answer == {"retained": 4, "extended": 0, "not_in_dram": 0, "missing": 1,
                      "seconds": 30.0}
    for start in range(0, 40, 4):  # bbbb bursts through DRAM many times over
        rig.put(objects("bbbb", 4, start))
        assert rig.core.lookup(kept) == b"\x01" * 4
    a = row(rig, "aaaa")
    # aaaa was over an even share (10 // 2 pages): its 3 oldest unretained objects went.
    assert a["retained"]["objects"] == 4 and a["dram"]["objects"] == 5
    assert a["evictions"] == {"share": 3}
    clock[0] += 31.0  # past their time: evictable again ...
    for start in range(40, 80, 4):
        rig.put(objects("bbbb", 4, start))
    a = row(rig, "aaaa")
    # ... but aaaa holds its even share, so bbbb's burst evicts bbbb's own objects.
    assert a["retained"]["objects"] == 0 and a["dram"]["objects"] == 5


def test_a_retention_over_its_budget_or_too_long_is_refused_and_retains_nothing() -> None:
    rig = Rig(20)
    rig.core.configure_retention(60.0, 2 * PAGE, capped=False)
    rig.put(objects("aaaa", 4))
    keys = [key("aaaa", i) for i in range(3)]
    with pytest.raises(RequestRefused, match="retention budget of 8192 bytes"):
        rig.core.retain(keys, 10.0)
    with pytest.raises(RequestRefused, match=r"outside \(0, 60\] s"):
        rig.core.retain(keys[:1], 61.0)
    assert row(rig, "aaaa")["retained"]["objects"] == 0
    assert rig.core.retain(keys[:2], 10.0)["retained"] == 2
    assert rig.core.retain(keys[:2], 20.0) == {"retained": 0, "extended": 2, "not_in_dram": 0,
                                               "missing": 0, "seconds": 20.0}
    # Lowering the budget releases what no longer fits, the retentions ending first.
    answer = rig.core.set_limits("aaaa", {"retain_budget_bytes": PAGE})
    assert answer["released"] == 1 and row(rig, "aaaa")["retained"]["objects"] == 1


def test_labels_come_back_for_namespaces_still_on_ssd_and_a_damaged_file_is_ignored(
    ssd: SsdTier, tmp_path: Path
) -> None:
    labels = LabelFile(str(tmp_path))
    rig = Rig(8, cold=ssd)
    rig.core.restore_labels(labels)
    rig.core.register("aaaa", "model a")
    rig.core.register("bbbb", "model b")
    for start in range(9):  # more than DRAM holds: some go to SSD
        rig.put(objects("aaaa", 1, start))
    again = Rig(8, cold=ssd)
    again.core.restore_labels(labels)
    assert {r["namespace"]: r["label"] for r in again.core.namespaces()} == {"aaaa": "model a"}
    labels.path.write_text("{not json")
    assert LabelFile(str(tmp_path)).load() == {}


def test_a_lookups_keys_are_counted_per_namespace_as_hits_by_tier_and_misses(
    ssd: SsdTier,
) -> None:
    """hits + misses of a namespace = the keys its lookups asked; a residency check
    (`where`) and a get count neither, so hits / (hits + misses) is the share held."""
    rig = Rig(20, cold=ssd)  # high 19 pages, low 10: a's first objects go to SSD
    assert all(rig.put(objects("aaaa", 18)))
    assert all(rig.put(objects("bbbb", 2)))
    on_ssd = [k for k in objects("aaaa", 18) if rig.core.where([k]) == bytes([2])]
    assert on_ssd, "some of aaaa's objects were demoted"
    asked_a = [key("aaaa", i) for i in range(36)]  # 18 held, 18 never stored
    assert rig.core.lookup(asked_a) == rig.core.where(asked_a[:18]) + bytes(18)
    # One lookup over two namespaces and a key not umbp's: each counted to its own.
    mixed = [key("bbbb", 0), key("bbbb", 7), key("aaaa", 0), "not-umbp", "umbp:0:bbbb:x"]
    assert [bool(code) for code in rig.core.lookup(mixed)] == [True, False, True, False, False]
    # Keys none of which is umbp's are counted all at once; a lookup that starts with one
    # and goes on with umbp's keys, key by key.
    assert all(rig.put({"held-not-umbp": b"h" * 9}))
    assert [bool(c) for c in rig.core.lookup(["held-not-umbp", "umbp:0:aaaa:y"])] == [True, False]
    assert [bool(c) for c in rig.core.lookup(["elsewhere", key("bbbb", 1)])] == [False, True]
    rig.core.where(asked_a + mixed)
    rig.get([key("aaaa", 30)], [PAGE - 7])
    a, b, other = row(rig, "aaaa"), row(rig, "bbbb"), row(rig, "")
    assert (a["lookup_hits"], a["lookup_misses"]) == (19, 18)
    assert a["lookup_hits_on_ssd"] == len(on_ssd) + (key("aaaa", 0) in on_ssd)
    assert (b["lookup_hits"], b["lookup_misses"], b["lookup_hits_on_ssd"]) == (2, 1, 0)
    assert (other["lookup_hits"], other["lookup_misses"]) == (1, 4), "an older format's too"
