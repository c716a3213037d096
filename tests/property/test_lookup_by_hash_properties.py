"""A lookup asked by hash answers what the same lookup asked by key string answers.

The scheduler asks the embedded pool a query's prefixes and raw hashes
(``HashRuns``, ``lookup_hashes``) and every other store its key strings (built
through the request's memo). Here one ``SlabPool`` per rank holds what a drawn
pool holds, the scheduler reaches them as it does in embedded mode
(``connect_to_pool`` -> ``RankedLookup``), some ranks only through a store that
reads strings, one perhaps served by nobody; any rank count, one group or several.
Both ways must give the same answers, folds and hit windows, and both must be the
model pool's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.property.strategies import LookupScenario, lookup_scenarios
from umbp.core.key_memo import EMPTY_KEY_MEMO
from umbp.core.lookup.query import LookupQuery, build_lookup_query, lookup_keys
from umbp.core.lookup.windows import coordinator_hit_sets, fold_rank_hits, single_group_load_spec
from umbp.core.rank_keys import rank_tags
from umbp.runtime.contract import HashLookup, SchedulerStore
from umbp.runtime.embedded import connect_to_pool, open_embedded_pool
from umbp.runtime.lookup_service import RankedLookup
from umbp.runtime.pool import SlabPool


class StringsOnly:
    """A rank's store that reads only key strings (a socket client, say)."""

    def __init__(self, store: SchedulerStore) -> None:
        self._store = store

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        return self._store.lookup(keys)

    def clear(self) -> bool:
        return self._store.clear()

    def close(self) -> None:
        self._store.close()


@contextmanager
def scheduler_store(
    scenario: LookupScenario, string_ranks: frozenset[int], unserved: int | None
) -> Iterator[RankedLookup]:
    """Each rank's keys of the drawn pool in that rank's own SlabPool, reached as the
    scheduler reaches embedded pools."""
    tags = rank_tags(scenario.keyspace)
    with ExitStack() as stack:
        stores: dict[str, SchedulerStore] = {}
        for rank, tag in enumerate(tags):
            keys = sorted(key for key in scenario.pool.keys if key.startswith(tag + ":g"))
            pool = SlabPool(len(keys) + 2, page_bytes=1, high_watermark=1.0, low_watermark=0.9)
            embedded = open_embedded_pool(pool, serve_other_processes=False)
            stack.callback(embedded.close)
            assert all(pool.put_batch(keys, [memoryview(b"x")] * len(keys)))
            if rank == unserved:
                continue
            store = connect_to_pool(embedded.address, timeout_s=5.0)  # never waited out
            assert isinstance(store, HashLookup)
            stores[tag] = StringsOnly(store) if rank in string_ranks else store
        yield RankedLookup(stores)


def windows(scenario: LookupScenario, query: LookupQuery, answers: tuple[bool, ...]) -> object:
    folded = fold_rank_hits(query, answers)
    assert folded is not None
    if scenario.geometry.coordinated:
        return folded, coordinator_hit_sets(query, folded)
    return folded, single_group_load_spec(scenario.geometry, query, folded)


@settings(max_examples=150, deadline=None)
# Pools each rank owns never share an object among ranks (core.replicas), so their
# key spaces have no replicated group.
@given(lookup_scenarios().filter(lambda scenario: not scenario.keyspace.replicated), st.data())
def test_a_lookup_by_hash_answers_and_hits_as_the_key_strings(
    scenario: LookupScenario, data: st.DataObject
) -> None:
    query = build_lookup_query(
        scenario.geometry, scenario.keyspace, scenario.hashes, scenario.local_tokens,
        scenario.num_tokens,
    )
    ranks = query.rank_count
    string_ranks = frozenset(data.draw(st.sets(st.integers(0, ranks - 1))))
    unserved = data.draw(st.none() | st.integers(0, ranks - 1))
    keys, _memo = lookup_keys(scenario.geometry, scenario.keyspace, query, EMPTY_KEY_MEMO)
    with scheduler_store(scenario, string_ranks, unserved) as store:
        by_hash = store.lookup_hashes(query.runs)
        by_string = store.lookup(keys)
    expected = tuple(
        key in scenario.pool.keys and (unserved is None or position not in
                                       _positions_of_rank(query, unserved))
        for position, key in enumerate(keys)
    )
    assert by_hash == by_string == expected
    assert windows(scenario, query, by_hash) == windows(scenario, query, by_string)


def _positions_of_rank(query: LookupQuery, rank: int) -> set[int]:
    return {
        position for part in query.layout.rank_slices(rank)
        for position in range(part.start, part.stop, part.step or 1)
    }
