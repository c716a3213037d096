"""The scheduler builds a request's key strings once (core.key_memo, kept in its
RequestState): vLLM asks again for a waiting request's external hits on later
steps, and that lookup sends the pool the very strings the first one built."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tests.unit.test_scheduler_lifecycle import BLOCK, prompt
from umbp.core.identity import KeySpace


class RecordingStore:
    """The scheduler's real store, recording the keys of every lookup."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.asked: list[tuple[str, ...]] = []

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        self.asked.append(tuple(keys))
        answer: tuple[bool, ...] = self.store.lookup(keys)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_repeated_lookup_of_a_waiting_request_builds_no_key_again(make_driver: Any) -> None:
    driver = make_driver()
    tokens = prompt(6)
    driver.fill_pool("a", tokens)
    scheduler = driver.connector._scheduler
    recording = RecordingStore(scheduler._store)
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
