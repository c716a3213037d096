"""Properties of ``umbp.core.key_memo``: a memo never changes an answer, and a key
is built once per request.

A request's state carries its memo from lookup to lookup, as the scheduler keeps it
in ``RequestState``: the prompt grows, vLLM's local prefix moves both ways, the id
may come back as another request (other hashes) and the keyspace may change. Every
query made through the memo must equal the query built from nothing, and every key
the memo holds must be the one ``KeySpace.key`` builds.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.property.strategies import geometries, keyspaces, request_hashes
from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace, RankTopology
from umbp.core.key_memo import EMPTY_KEY_MEMO, KeyMemo, group_keys
from umbp.core.lookup.guards import lookup_skip_reason
from umbp.core.lookup.query import (
    EMPTY_LOOKUP_MEMO,
    build_lookup_query,
    lookup_keys,
    request_lookup_keys,
    request_lookup_query,
)


def memo_keys_are_keyspace_keys(memo: KeyMemo, keyspace: KeySpace, hashes: tuple[bytes, ...]) -> bool:
    if (memo.namespace, memo.topology, memo.replicated) != (
        keyspace.namespace, keyspace.topology, keyspace.replicated
    ):
        return True  # an other keyspace's memo (replication included) is never read for this one
    coords = keyspace.topology.coords()
    for entry in memo.entries:
        if len(entry.per_rank) != len(coords):
            return False
        for offset, block_hash in enumerate(entry.hashes):
            for rank, keys in zip(coords, entry.per_rank):
                if keys[offset] != keyspace.key(rank, entry.group_id, block_hash):
                    return False
    return True


def test_a_memo_built_with_one_replication_is_never_read_for_another() -> None:
    """Replicated groups shape keys (the run's writer names them), so a memo built
    while a group was replicated is not read once it is not (same namespace and
    topology): what `memo_keys_are_keyspace_keys` may therefore skip."""
    hashes = (bytes(8), bytes(7) + b"\1", bytes(7) + b"\2")
    topology = RankTopology(tp_size=2, pcp_size=1, dcp_size=1, pp_size=1)
    replicated, plain = KeySpace("ns", topology, ((0, 2),)), KeySpace("ns", topology, ())
    _entry, memo = group_keys(EMPTY_KEY_MEMO, replicated, 0, 1, 1, hashes, 0, 3)
    assert memo.entry(replicated, 0, 1) is not None and memo.entry(plain, 0, 1) is None
    entry, _memo = group_keys(memo, plain, 0, 1, 1, hashes, 0, 3)
    assert entry.rank_keys(1, 0, 3) == tuple(
        plain.key(plain.topology.coords()[1], 0, h) for h in hashes
    ) != memo.entries[0].rank_keys(1, 0, 3)


@st.composite
def lookup_sequences(
    draw: st.DrawFn,
) -> tuple[CacheGeometry, list[tuple[KeySpace, tuple[bytes, ...], int, int]]]:
    """Lookups of one request id: a growing prompt with any local prefix, now and
    then another request's hashes or another keyspace."""
    geometry = draw(geometries())
    base_keyspace = draw(keyspaces())
    salt_hashes = draw(request_hashes(64))
    other_hashes = draw(request_hashes(64))
    steps: list[tuple[KeySpace, tuple[bytes, ...], int, int]] = []
    num_tokens = draw(st.integers(geometry.block_size + 2, 4 * geometry.block_size))
    for _ in range(draw(st.integers(1, 6))):
        num_tokens += draw(st.integers(0, 2 * geometry.block_size))
        num_tokens = min(num_tokens, 64 * geometry.hash_block_size)
        local = draw(st.integers(0, max(0, (num_tokens - 2) // geometry.block_size)))
        hashes = (other_hashes if draw(st.integers(0, 5)) == 0 else salt_hashes)[
            : num_tokens // geometry.hash_block_size
        ]
        keyspace = draw(keyspaces()) if draw(st.integers(0, 5)) == 0 else base_keyspace
        steps.append((keyspace, hashes, local * geometry.block_size, num_tokens))
    return geometry, steps


@given(lookup_sequences())
def test_every_query_through_the_memo_is_the_query_built_from_nothing(
    case: tuple[CacheGeometry, list[tuple[KeySpace, tuple[bytes, ...], int, int]]],
) -> None:
    geometry, steps = case
    memo = EMPTY_KEY_MEMO
    for keyspace, hashes, local, num_tokens in steps:
        if lookup_skip_reason(geometry, True, len(hashes), num_tokens, local) is not None:
            continue
        query = build_lookup_query(geometry, keyspace, hashes, local, num_tokens)
        keys, memo = lookup_keys(geometry, keyspace, query, memo)
        fresh = query.runs.key_strings()
        assert keys == fresh and keys.layout == fresh.layout == query.layout
        assert keys.rank_tags == fresh.rank_tags
        assert memo_keys_are_keyspace_keys(memo, keyspace, hashes)


@given(lookup_sequences())
def test_a_repeated_lookup_builds_no_key(
    case: tuple[CacheGeometry, list[tuple[KeySpace, tuple[bytes, ...], int, int]]],
) -> None:
    """The same request state asked again returns the very memo (no string is new)
    and its query's keys are the first query's string objects."""
    geometry, steps = case
    keyspace, hashes, local, num_tokens = steps[-1]
    if lookup_skip_reason(geometry, True, len(hashes), num_tokens, local) is not None:
        return
    query = build_lookup_query(geometry, keyspace, hashes, local, num_tokens)
    first, memo = lookup_keys(geometry, keyspace, query, EMPTY_KEY_MEMO)
    again_query = build_lookup_query(geometry, keyspace, list(hashes), local, num_tokens)
    again, memo_again = lookup_keys(geometry, keyspace, again_query, memo)
    if all(local % unit == 0 for unit in geometry.lookup_units):
        assert memo_again is memo
        assert all(a is b for a, b in zip(first, again, strict=True))
    assert again == first and again_query == query


@given(keyspaces(), request_hashes(48), st.data())
def test_group_keys_cover_the_asked_run_with_the_keyspace_keys(
    keyspace: KeySpace, hashes: tuple[bytes, ...], data: st.DataObject
) -> None:
    """Any runs asked in any order (disjoint, overlapping, nested): each answer
    covers its run, and the memo only ever holds KeySpace's keys."""
    hash_block_size = data.draw(st.sampled_from([1, 2, 4]))
    unit = hash_block_size * data.draw(st.sampled_from([1, 2, 3]))
    stride = unit // hash_block_size
    objects = len(hashes) // stride
    memo = EMPTY_KEY_MEMO
    for _ in range(data.draw(st.integers(1, 5))):
        first = data.draw(st.integers(0, objects))
        stop = data.draw(st.integers(first, objects))
        entry, memo = group_keys(memo, keyspace, 3, unit, hash_block_size, hashes, first, stop)
        assert entry.start <= first and stop <= entry.stop or first == stop
        assert entry.object_hashes(first, stop) == tuple(
            hashes[(j + 1) * stride - 1] for j in range(first, stop)
        )
        for rank_index, rank in enumerate(keyspace.topology.coords()):
            assert entry.rank_keys(rank_index, first, stop) == tuple(
                keyspace.key(rank, 3, hashes[(j + 1) * stride - 1]) for j in range(first, stop)
            )
        assert memo_keys_are_keyspace_keys(memo, keyspace, hashes)


@given(lookup_sequences(), geometries(), st.data())
def test_every_request_lookup_through_its_memo_is_the_query_built_from_nothing(
    case: tuple[CacheGeometry, list[tuple[KeySpace, tuple[bytes, ...], int, int]]],
    other_geometry: CacheGeometry,
    data: st.DataObject,
) -> None:
    """The scheduler's calls: the last query is reused only for the same request
    state, geometry and keyspace, every answer equals a fresh query, and the keys of
    a store that asks by string (asked or not, at any lookup) are the fresh query's."""
    geometry, steps = case
    memo = EMPTY_LOOKUP_MEMO
    for keyspace, hashes, local, num_tokens in steps + steps[-1:]:
        for shape in (geometry, other_geometry):
            if lookup_skip_reason(shape, True, len(hashes), num_tokens, local) is not None:
                continue
            before = memo
            query, memo = request_lookup_query(shape, keyspace, list(hashes), local, num_tokens, memo)
            fresh = build_lookup_query(shape, keyspace, hashes, local, num_tokens)
            assert query == fresh and query.layout == fresh.layout
            if before.last is not None and before.geometry == shape and before.keyspace == keyspace \
                    and before.last.describes(local, num_tokens, hashes):
                assert query is before.last and memo is before
            if data.draw(st.booleans()):  # a store that asks by string
                had = memo
                keys, memo = request_lookup_keys(shape, keyspace, query, memo)
                assert keys == fresh.runs.key_strings() and keys.layout == fresh.layout
                if had.last is query and had.last_keys is not None:
                    assert keys is had.last_keys and memo is had
                assert memo.last is query and memo.last_keys is keys
                assert memo_keys_are_keyspace_keys(memo.keys, keyspace, hashes)


@given(lookup_sequences())
def test_a_lookup_by_hash_builds_no_key_string(
    case: tuple[CacheGeometry, list[tuple[KeySpace, tuple[bytes, ...], int, int]]],
) -> None:
    """Queries alone (a store that answers by hash): the memo never holds a string."""
    geometry, steps = case
    memo = EMPTY_LOOKUP_MEMO
    for keyspace, hashes, local, num_tokens in steps:
        if lookup_skip_reason(geometry, True, len(hashes), num_tokens, local) is not None:
            continue
        _query, memo = request_lookup_query(geometry, keyspace, hashes, local, num_tokens, memo)
        assert memo.keys == EMPTY_KEY_MEMO and memo.last_keys is None
