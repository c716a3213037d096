"""A request's key strings: none for a store that answers by hash (the embedded
pool), and built once for a store that asks by string (core.key_memo, kept in its
RequestState): vLLM asks again for a waiting request's external hits on later
steps, and that lookup sends the store the very strings the first one built."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from tests.unit.test_scheduler_lifecycle import BLOCK, prompt
from umbp.core.identity import KeySpace
from umbp.core.key_memo import EMPTY_KEY_MEMO
from umbp.core.rank_keys import HashRuns
from umbp.runtime.contract import HashLookup


class RecordingStore:
    """The scheduler's real store as a store that asks by string (as the server,
    Mooncake and MORI clients do), recording the keys of every lookup."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.asked: list[tuple[str, ...]] = []

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        self.asked.append(tuple(keys))
        answer: tuple[bool, ...] = self.store.lookup(keys)
        return answer

    def clear(self) -> bool:
        cleared: bool = self.store.clear()
        return cleared

    def close(self) -> None:
        self.store.close()


class RecordingHashStore:
    """The scheduler's real store (the embedded pool through RankedLookup), recording
    every lookup by hash and failing any lookup by string."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.asked: list[HashRuns] = []

    def lookup_hashes(self, runs: HashRuns) -> tuple[bool, ...]:
        self.asked.append(runs)
        answer: tuple[bool, ...] = self.store.lookup_hashes(runs)
        return answer

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        raise AssertionError("an admission asked the embedded pool by key string")

    def clear(self) -> bool:
        cleared: bool = self.store.clear()
        return cleared

    def close(self) -> None:
        self.store.close()


def answered(driver: Any, request: Any, local_tokens: int) -> int:
    """vLLM's call, repeated while the lookup runs on the lookup threads (it asks
    again on every step until the answer is there)."""
    for _ in range(5000):
        matched = driver.connector.get_num_new_matched_tokens(request, local_tokens)[0]
        if matched is not None:
            return int(matched)
        time.sleep(0.001)
    raise AssertionError("the lookup never answered")


@pytest.mark.parametrize("load_async", [False, True])
def test_a_first_admission_against_the_embedded_pool_builds_no_key_string(
    make_driver: Any, load_async: bool
) -> None:
    driver = make_driver(extra={"load_async": load_async})
    tokens = prompt(6)
    driver.fill_pool("a", tokens)
    scheduler = driver.connector._scheduler
    assert isinstance(scheduler._store, HashLookup)  # what embedded mode opens
    recording = RecordingHashStore(scheduler._store)
    scheduler._store = recording
    request = driver.add("b", tokens + [9, 9], max_tokens=2)

    matched = answered(driver, request, 0)
    assert matched == 6 * BLOCK
    memo = scheduler._requests["b"].lookups
    assert memo.keys == EMPTY_KEY_MEMO and memo.last_keys is None  # no string built
    assert len(recording.asked) == 1
    runs = recording.asked[0]
    assert runs.hashes == (tuple(request.block_hashes[:6]),)  # the last token is computed
    keyspace: KeySpace = scheduler._keyspace
    rank = keyspace.topology.coords()[0]
    assert list(runs.key_strings()) == [
        keyspace.key(rank, 0, block_hash) for block_hash in request.block_hashes[:6]
    ]

    # vLLM found two blocks locally meanwhile: 4 more from the pool, still by hash.
    assert answered(driver, request, 2 * BLOCK) == 4 * BLOCK
    assert scheduler._requests["b"].lookups.keys == EMPTY_KEY_MEMO

    driver.run(["b"])
    assert driver.cached_tokens("b") == 6 * BLOCK


def test_a_repeated_lookup_by_string_of_a_waiting_request_builds_no_key_again(
    make_driver: Any,
) -> None:
    driver = make_driver()
    tokens = prompt(6)
    driver.fill_pool("a", tokens)
    scheduler = driver.connector._scheduler
    recording = RecordingStore(scheduler._store)
    assert not isinstance(recording, HashLookup)
    scheduler._store = recording
    request = driver.add("b", tokens + [9, 9], max_tokens=2)

    # What vLLM's scheduler does for a request it cannot schedule yet: ask, then
    # ask again on the next step.
    first = driver.connector.get_num_new_matched_tokens(request, 0)
    second = driver.connector.get_num_new_matched_tokens(request, 0)
    assert first == second and first[0] == 6 * BLOCK
    assert len(recording.asked) == 2
    keys_first, keys_second = recording.asked
    assert keys_first == keys_second
    assert all(a is b for a, b in zip(keys_first, keys_second, strict=True))

    # vLLM found a block locally meanwhile: the shorter query is still made of the
    # first one's strings, and they are the keys KeySpace builds.
    third = driver.connector.get_num_new_matched_tokens(request, BLOCK)
    assert third[0] == 5 * BLOCK
    keys_third = recording.asked[2]
    assert all(a is b for a, b in zip(keys_third, keys_first[1:], strict=True))
    keyspace: KeySpace = scheduler._keyspace
    rank = keyspace.topology.coords()[0]
    assert list(keys_first) == [
        keyspace.key(rank, 0, block_hash) for block_hash in request.block_hashes[:6]
    ]

    # The request runs to the end as usual.
    driver.run(["b"])
    assert driver.cached_tokens("b") == 6 * BLOCK
