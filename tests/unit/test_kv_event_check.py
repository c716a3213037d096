"""The KV-event residency check folds per-rank answers through core's one fold."""

from __future__ import annotations

from concurrent.futures import Future

from umbp.core.identity import KeySpace, RankTopology
from umbp.core.rank_keys import KeyLayout, object_major_keys
from umbp.runtime.contract import Medium
from umbp.shell.kv_events import _fold


def _answered(value: tuple[bool, ...] | tuple[str | None, ...]) -> Future[tuple[bool, ...] | tuple[str | None, ...]]:
    future: Future[tuple[bool, ...] | tuple[str | None, ...]] = Future()
    future.set_result(value)
    return future


def test_the_check_asks_every_rank_of_each_object_together() -> None:
    keyspace = KeySpace("ns", RankTopology(tp_size=2))
    keys = object_major_keys(keyspace, [(0, b"\x01"), (1, b"\x02")])
    assert keys == (*keyspace.rank_keys(0, b"\x01"), *keyspace.rank_keys(1, b"\x02"))
    assert keys.layout == KeyLayout.objects(2, 2)


def test_an_object_is_resident_only_on_every_rank_and_on_disk_when_any_shard_is() -> None:
    layout = KeyLayout.objects(3, 2)
    tiers = (Medium.CPU, Medium.DISK, Medium.CPU, None, Medium.CPU, Medium.CPU)
    resident, media = _fold(_answered(tiers), layout)
    assert resident == [True, False, True]
    assert media == [Medium.DISK, Medium.CPU, Medium.CPU]


def test_plain_lookup_answers_name_no_medium() -> None:
    assert _fold(_answered((True, True, True, False)), KeyLayout.objects(2, 2)) == (
        [True, False], None)


def test_a_failed_or_wrong_length_check_knows_nothing() -> None:
    failed: Future[tuple[bool, ...] | tuple[str | None, ...]] = Future()
    failed.set_exception(OSError("gone"))
    assert _fold(failed, KeyLayout.objects(2, 2)) == (None, None)
    assert _fold(_answered((True, True, True)), KeyLayout.objects(2, 2)) == (None, None)
