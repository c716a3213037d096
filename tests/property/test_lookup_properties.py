"""Properties of ``umbp.core.lookup``: keys, rank folding and hit windows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.property.strategies import (
    LookupScenario,
    coordinated_geometries,
    lookup_scenarios,
    single_group_geometries,
)
from umbp.core.geometry import CacheGeometry, lookup_unit
from umbp.core.identity import KeySpace, RankTopology
from umbp.core.lookup.guards import LookupSkip, lookup_limit, lookup_skip_reason
from umbp.core.lookup.query import LookupQuery, build_lookup_query
from umbp.core.lookup.windows import (
    LoadSpec,
    coordinator_hit_sets,
    fold_rank_hits,
    hit_window,
    load_runs_async,
    load_spec_from_hits,
    local_object_hashes,
    single_group_hit_tokens,
    single_group_load_spec,
)
from umbp.core.rank_keys import KeyLayout, RankedKeys, fold_ranks, merge_rank_answers


def query_of(scenario: LookupScenario) -> LookupQuery:
    return build_lookup_query(
        scenario.geometry,
        scenario.keyspace,
        scenario.hashes,
        scenario.local_tokens,
        scenario.num_tokens,
    )


def _object_token_end(query: LookupQuery, group_position: int, index: int) -> int:
    """The token where object ``index`` of the query's group ``group_position`` ends
    (what ``object_hashes`` means, stated independently of the code under test)."""
    return query.local_tokens + query.units[group_position] * (index + 1)


def _object_hash_at_token_end(
    hashes: Sequence[bytes], token_end: int, hash_block_size: int
) -> bytes:
    """The hash that identifies the prefix ``[0, token_end)``: the oracle the
    query's object hashes are checked against."""
    index = token_end // hash_block_size - 1
    assert 0 <= index < len(hashes), f"{len(hashes)} hashes, no index {index}"
    return hashes[index]


def _rank_at(layout: KeyLayout, position: int) -> int:
    """The rank whose key sits at ``position``, walked position by position: the
    oracle :meth:`KeyLayout.rank_slices` is checked against."""
    offset = 0
    for count in layout.segment_sizes:
        size = count * layout.rank_count
        if position < offset + size:
            inside = position - offset
            return inside % layout.rank_count if layout.object_major else inside // count
        offset += size
    raise ValueError(f"position {position} is outside {layout.key_count} keys")



def folded_of(scenario: LookupScenario, query: LookupQuery) -> tuple[tuple[bool, ...], ...]:
    folded = fold_rank_hits(query, scenario.pool.answers(query.runs.key_strings()))
    assert folded is not None
    return folded


def scan_like_the_reference(geometry: CacheGeometry, hits: Sequence[bool]) -> int:
    """The reference's index-by-index scan (plus the EAGLE fall-back), as an oracle
    for the slicing implementation."""
    unit = geometry.lookup_units[0]
    per_block = geometry.group_block_sizes[0] // unit
    matched = 0
    for index in range(per_block - 1, len(hits), per_block):
        if not hits[index]:
            break
        matched = index + 1
    for index in range(min(matched + per_block - 1, len(hits)) - 1, matched - 1, -1):
        if hits[index]:
            matched = index + 1
            break
    if geometry.use_eagle:
        matched = max(0, matched - per_block)
        if matched % per_block and not hits[matched - 1]:
            matched -= matched % per_block
    return matched * unit


# ------------------------------------------------------------------ lookup query


@given(lookup_scenarios())
def test_lookup_query_asks_every_rank_for_every_object_past_the_local_tokens(
    scenario: LookupScenario,
) -> None:
    geometry, keyspace = scenario.geometry, scenario.keyspace
    query = query_of(scenario)
    limit = lookup_limit(geometry, scenario.num_tokens, len(scenario.hashes))
    expected_keys: list[str] = []
    for position, (group_id, unit) in enumerate(zip(geometry.group_ids, geometry.lookup_units)):
        ends = range(scenario.local_tokens + unit, limit + 1, unit)
        objects = query.object_hashes[position]
        assert len(objects) == len(ends)
        for index, token_end in enumerate(ends):
            assert _object_token_end(query, position, index) == token_end
            assert objects[index] == _object_hash_at_token_end(
                scenario.hashes, token_end, geometry.hash_block_size
            )
        for rank in keyspace.topology.coords():
            expected_keys.extend(keyspace.key(rank, group_id, h) for h in objects)
    assert query.runs.key_strings() == tuple(expected_keys)
    assert query.rank_count == keyspace.topology.rank_count


@given(lookup_scenarios())
def test_lookup_query_never_probes_the_last_prompt_token_without_eagle_coordination(
    scenario: LookupScenario,
) -> None:
    query = query_of(scenario)
    geometry = scenario.geometry
    ceiling = (
        scenario.num_tokens
        if geometry.use_eagle and geometry.coordinated
        else scenario.num_tokens - 1
    )
    for position, objects in enumerate(query.object_hashes):
        for index in range(len(objects)):
            assert scenario.local_tokens < _object_token_end(query, position, index) <= ceiling


@given(lookup_scenarios())
def test_lookup_query_describes_only_the_request_state_it_was_built_from(
    scenario: LookupScenario,
) -> None:
    query = query_of(scenario)
    assert query.describes(scenario.local_tokens, scenario.num_tokens, scenario.hashes)
    assert not query.describes(scenario.local_tokens + 1, scenario.num_tokens, scenario.hashes)
    assert not query.describes(scenario.local_tokens, scenario.num_tokens + 1, scenario.hashes)
    assert not query.describes(scenario.local_tokens, scenario.num_tokens, scenario.hashes[:-1])


# ------------------------------------------------------------------- rank folding


@given(lookup_scenarios(), st.integers(-3, 3).filter(bool))
def test_fold_rank_hits_with_a_wrong_length_answer_is_none(
    scenario: LookupScenario, delta: int
) -> None:
    query = query_of(scenario)
    assume(query.key_count + delta >= 0)
    assert fold_rank_hits(query, [True] * (query.key_count + delta)) is None


@given(lookup_scenarios())
def test_an_object_hits_exactly_when_every_rank_holds_it(scenario: LookupScenario) -> None:
    query = query_of(scenario)
    folded = folded_of(scenario, query)
    for group_id, objects, hits in zip(scenario.geometry.group_ids, query.object_hashes, folded):
        assert len(hits) == len(objects)
        for block_hash, hit in zip(objects, hits):
            assert hit == scenario.pool.held_by_every_rank(group_id, block_hash)


@given(lookup_scenarios(), st.data())
def test_one_missing_rank_makes_the_object_a_miss(
    scenario: LookupScenario, data: st.DataObject
) -> None:
    query = query_of(scenario)
    assume(query.key_count)
    missing = data.draw(st.integers(0, query.key_count - 1))
    answers = [True] * query.key_count
    answers[missing] = False
    folded = fold_rank_hits(query, answers)
    assert folded is not None
    misses = [
        (group_id, block_hash)
        for group_id, objects, hits in zip(scenario.geometry.group_ids, query.object_hashes, folded)
        for block_hash, hit in zip(objects, hits)
        if not hit
    ]
    assert len(misses) == 1
    group_id, block_hash = misses[0]
    rank_keys = {
        scenario.keyspace.key(rank, group_id, block_hash)
        for rank in scenario.keyspace.topology.coords()
    }
    assert query.runs.key_strings()[missing] in rank_keys


@given(lookup_scenarios())
def test_a_query_layout_names_the_rank_of_every_key(scenario: LookupScenario) -> None:
    query = query_of(scenario)
    coords = scenario.keyspace.topology.coords()
    layout = query.layout
    assert layout.key_count == query.key_count
    assert layout.segment_sizes == tuple(map(len, query.object_hashes))
    keyspace = scenario.keyspace
    tags = query.runs.key_strings().rank_tags
    segments = [s for s, count in enumerate(layout.segment_sizes)
                for _ in range(count * layout.rank_count)]
    for position, key in enumerate(query.runs.key_strings()):
        rank = _rank_at(layout, position)
        group_id = scenario.geometry.group_ids[segments[position]]
        # The tag names the rank; its key is the one it reads: its own, or its replica
        # run's writer's (core.replicas), which is that rank's own key.
        reads = coords.index(keyspace.key_rank(coords[rank], group_id))
        assert key.startswith(tags[reads] + ":g")
        assert key.rsplit(":", 2)[0] == tags[reads]
        assert (reads == rank) == (keyspace.replica_run(group_id) == 1 or keyspace.writes(
            coords[rank], group_id))


@st.composite
def key_layouts(draw: st.DrawFn) -> KeyLayout:
    ranks = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    if draw(st.booleans()):
        return KeyLayout.objects(sum(sizes), ranks)
    return KeyLayout.rank_major(sizes, ranks)


def objects_by_position(layout: KeyLayout) -> list[tuple[int, int, int]]:
    """(segment, object, rank) of every position, written out one position at a time
    from the layout's definition: the oracle for the slicing code."""
    cells: list[tuple[int, int, int]] = []
    for segment, count in enumerate(layout.segment_sizes):
        if layout.object_major:
            cells.extend((segment, obj, rank) for obj in range(count) for rank in range(layout.rank_count))
        else:
            cells.extend((segment, obj, rank) for rank in range(layout.rank_count) for obj in range(count))
    return cells


@given(key_layouts(), st.data())
def test_the_fold_is_the_per_rank_and_over_positions_for_every_layout(
    layout: KeyLayout, data: st.DataObject
) -> None:
    answers = data.draw(st.lists(st.booleans(), min_size=layout.key_count, max_size=layout.key_count))
    cells = objects_by_position(layout)
    assert [rank for _, _, rank in cells] == [_rank_at(layout, p) for p in range(layout.key_count)]
    every = fold_ranks(layout, answers)
    some = fold_ranks(layout, answers, any)
    assert every is not None and some is not None
    for segment, count in enumerate(layout.segment_sizes):
        assert len(every[segment]) == len(some[segment]) == count
        for obj in range(count):
            shards = [answers[p] for p, cell in enumerate(cells) if cell[:2] == (segment, obj)]
            assert len(shards) == layout.rank_count
            assert every[segment][obj] == all(shards)
            assert some[segment][obj] == any(shards)
    assert fold_ranks(layout, tuple(answers)) == every


@given(key_layouts(), st.integers(-3, 3).filter(bool))
def test_a_wrong_length_answer_folds_to_none_for_every_layout(layout: KeyLayout, delta: int) -> None:
    assume(layout.key_count + delta >= 0)
    assert fold_ranks(layout, [True] * (layout.key_count + delta)) is None


@given(key_layouts(), st.data())
def test_routing_by_position_gives_each_rank_exactly_its_keys(
    layout: KeyLayout, data: st.DataObject
) -> None:
    # Keys with no structure at all (and repeats): routing never reads them.
    keys = data.draw(st.lists(st.sampled_from(["", "x", "k:1", "??"]),
                              min_size=layout.key_count, max_size=layout.key_count))
    ranked = RankedKeys(keys, layout, [f"rank{r}" for r in range(layout.rank_count)])
    positions = {rank: [p for p in range(layout.key_count) if _rank_at(layout, p) == rank]
                 for rank in range(layout.rank_count)}
    for rank, owned in positions.items():
        assert ranked.keys_of_rank(rank) == tuple(keys[p] for p in owned)
    # Each rank answers its own keys; a rank nobody serves answers None (a miss).
    served = data.draw(st.lists(st.booleans(), min_size=layout.rank_count,
                                max_size=layout.rank_count))
    per_rank = [
        tuple(data.draw(st.booleans()) for _ in positions[rank]) if served[rank] else None
        for rank in range(layout.rank_count)
    ]
    merged = merge_rank_answers(layout, per_rank)
    expected = [False] * layout.key_count
    for rank, owned in positions.items():
        answer = per_rank[rank]
        for index, position in enumerate(owned):
            expected[position] = False if answer is None else answer[index]
    assert merged == tuple(expected)


def test_ranked_keys_are_an_immutable_tuple_that_keeps_its_layout() -> None:
    import pickle

    layout = KeyLayout.rank_major((2,), 2)
    ranked = RankedKeys(["a", "b", "c", "d"], layout, ["t0", "t1"])
    assert ranked == ("a", "b", "c", "d") and isinstance(ranked, tuple)
    copy = pickle.loads(pickle.dumps(ranked))
    assert copy == ranked and copy.layout == layout and copy.rank_tags == ("t0", "t1")
    with pytest.raises(AttributeError):
        ranked.layout = KeyLayout.objects(2, 2)
    with pytest.raises(ValueError):
        RankedKeys(["a"], layout, ["t0", "t1"])
    with pytest.raises(ValueError):
        RankedKeys(["a", "b", "c", "d"], layout, ["t0"])


# ------------------------------------------------------------ single-group window


@given(lookup_scenarios(single_group_geometries()))
def test_hit_window_never_reaches_the_last_prompt_token_nor_starts_before_local_tokens(
    scenario: LookupScenario,
) -> None:
    query = query_of(scenario)
    spec = single_group_load_spec(scenario.geometry, query, folded_of(scenario, query))
    if spec is None:
        return
    assert spec.local_tokens == scenario.local_tokens
    assert scenario.local_tokens < spec.external_tokens <= scenario.num_tokens - 1
    assert spec.external_tokens % scenario.geometry.hash_block_size == 0


@given(lookup_scenarios(single_group_geometries()))
def test_hit_window_covers_only_objects_every_rank_holds(scenario: LookupScenario) -> None:
    """Every object whose bytes the window claims (each full block, and the hash at
    the window's end for a partial tail) is on every rank."""
    geometry = scenario.geometry
    query = query_of(scenario)
    spec = single_group_load_spec(geometry, query, folded_of(scenario, query))
    if spec is None:
        return
    group_id, block_size = geometry.group_ids[0], geometry.group_block_sizes[0]
    read_ends = [
        (block + 1) * block_size
        for block in range(spec.local_tokens // block_size, spec.external_tokens // block_size)
    ]
    if spec.external_tokens % block_size:
        read_ends.append(spec.external_tokens)
    for token_end in read_ends:
        block_hash = _object_hash_at_token_end(scenario.hashes, token_end, geometry.hash_block_size)
        assert scenario.pool.held_by_every_rank(group_id, block_hash)


@given(lookup_scenarios(single_group_geometries()))
def test_single_group_hit_tokens_match_the_reference_scan(scenario: LookupScenario) -> None:
    query = query_of(scenario)
    folded = folded_of(scenario, query)
    assert single_group_hit_tokens(scenario.geometry, query, folded) == scan_like_the_reference(
        scenario.geometry, folded[0]
    )


@given(lookup_scenarios(single_group_geometries()))
def test_eagle_hit_is_at_least_one_block_shorter_than_the_plain_hit(
    scenario: LookupScenario,
) -> None:
    query = query_of(scenario)
    folded = folded_of(scenario, query)
    plain = single_group_hit_tokens(replace(scenario.geometry, use_eagle=False), query, folded)
    eagle = single_group_hit_tokens(replace(scenario.geometry, use_eagle=True), query, folded)
    assert eagle <= max(0, plain - scenario.geometry.group_block_sizes[0])


@given(single_group_geometries(), st.data())
def test_contiguous_full_block_hits_all_load(geometry: CacheGeometry, data: st.DataObject) -> None:
    """A pool holding every block answers the whole prompt but its last token, less
    the EAGLE block: the window is as long as the rules allow."""
    keyspace = KeySpace("ns", RankTopology(tp_size=2))
    block_size = geometry.block_size
    blocks = data.draw(st.integers(1, 8))
    extra = data.draw(st.integers(1, block_size))
    num_tokens = blocks * block_size + extra
    hashes = tuple(
        index.to_bytes(4, "big") for index in range(num_tokens // geometry.hash_block_size)
    )
    query = build_lookup_query(geometry, keyspace, hashes, 0, num_tokens)
    folded = fold_rank_hits(query, [True] * query.key_count)
    assert folded is not None
    hit = single_group_hit_tokens(geometry, query, folded)
    if geometry.lookup_units[0] < block_size:
        expected = (num_tokens - 1) // geometry.hash_block_size * geometry.hash_block_size
    else:
        expected = (num_tokens - 1) // block_size * block_size
    if geometry.use_eagle:
        expected = max(0, expected - block_size)
    assert hit == expected


# ------------------------------------------------------------- coordinated path


@given(lookup_scenarios(coordinated_geometries()), st.data())
def test_coordinator_hit_sets_hold_only_objects_every_rank_holds_or_vllm_has_locally(
    scenario: LookupScenario, data: st.DataObject
) -> None:
    geometry = scenario.geometry
    query = query_of(scenario)
    local = local_object_hashes(geometry, scenario.hashes, scenario.local_tokens)
    local_hits = tuple(
        frozenset(data.draw(st.lists(st.sampled_from(group), max_size=3))) if group else frozenset()
        for group in local
    )
    sets = coordinator_hit_sets(query, folded_of(scenario, query), local_hits)
    for group_id, hit_set, local_set, local_group in zip(
        geometry.group_ids, sets, local_hits, local
    ):
        assert local_set <= hit_set
        assert set(local_set) <= set(local_group)
        for block_hash in hit_set - local_set:
            assert scenario.pool.held_by_every_rank(group_id, block_hash)


@given(lookup_scenarios(coordinated_geometries()), st.integers(-5, 400))
def test_coordinated_hit_window_never_reaches_the_last_prompt_token_nor_starts_before_local(
    scenario: LookupScenario, hit_end: int
) -> None:
    query = query_of(scenario)
    spec = load_spec_from_hits(query, hit_end, ((None,),) * len(scenario.geometry.group_ids))
    if spec is None:
        assert min(hit_end, scenario.num_tokens - 1) <= scenario.local_tokens
        return
    assert spec.local_tokens == scenario.local_tokens
    assert spec.local_tokens < spec.external_tokens <= scenario.num_tokens - 1


@given(st.integers(0, 64), st.integers(1, 64), st.integers(-8, 80))
def test_hit_window_is_empty_or_inside_local_tokens_and_the_last_prompt_token(
    local_tokens: int, num_tokens: int, hit_end: int
) -> None:
    window = hit_window(local_tokens, num_tokens, hit_end)
    assert window.step == 1
    if window:
        assert window.start == local_tokens
        assert window.stop <= num_tokens - 1


@given(coordinated_geometries(), st.data())
def test_load_runs_synchronously_when_no_coordinator_hash_lies_past_the_local_blocks(
    geometry: CacheGeometry, data: st.DataObject
) -> None:
    local_tokens = data.draw(st.integers(0, 4)) * geometry.block_size
    hashes_by_group = tuple(
        tuple(
            data.draw(st.one_of(st.none(), st.just(b"h")))
            if index < local_tokens // size
            else (b"x" if data.draw(st.booleans()) else None)
            for index in range(local_tokens // size + data.draw(st.integers(0, 3)))
        )
        for size in geometry.group_block_sizes
    )
    spec = LoadSpec(local_tokens, local_tokens + 1, hashes_by_group)
    past_local = any(
        block_hash is not None
        for size, group in zip(geometry.group_block_sizes, hashes_by_group)
        for block_hash in group[local_tokens // size :]
    )
    assert load_runs_async(True, spec, geometry) == past_local
    assert load_runs_async(False, spec, geometry) is False
    assert load_runs_async(True, LoadSpec(local_tokens, local_tokens + 1), geometry) is True


# ------------------------------------------------------------------------ guards


GEOMETRY = CacheGeometry(
    group_ids=(0,), group_block_sizes=(16,), lookup_units=(16,), block_size=16, hash_block_size=16
)


@pytest.mark.parametrize(
    ("geometry", "enabled", "num_hashes", "num_tokens", "local_tokens", "reason"),
    [
        (GEOMETRY, False, 0, 0, 3, LookupSkip.DISABLED),
        (GEOMETRY, True, 0, 8, 3, LookupSkip.NO_HASHES),
        (GEOMETRY, True, 1, 15, 3, LookupSkip.PROMPT_SHORTER_THAN_ALIGNMENT),
        (GEOMETRY, True, 2, 40, 3, LookupSkip.LOCAL_NOT_BLOCK_ALIGNED),
        (
            CacheGeometry((), (), (), block_size=16, hash_block_size=16),
            True,
            2,
            40,
            16,
            LookupSkip.NO_CACHEABLE_GROUPS,
        ),
        (GEOMETRY, True, 2, 33, 32, LookupSkip.NO_TOKEN_LEFT_TO_LOAD),
        (GEOMETRY, True, 2, 32, 32, LookupSkip.NO_TOKEN_LEFT_TO_LOAD),
        (GEOMETRY, True, 2, 34, 32, None),
        (GEOMETRY, True, 1, 16, 0, None),
    ],
)
def test_lookup_skip_reason_applies_the_guards_in_the_reference_order(
    geometry: CacheGeometry,
    enabled: bool,
    num_hashes: int,
    num_tokens: int,
    local_tokens: int,
    reason: LookupSkip | None,
) -> None:
    assert lookup_skip_reason(geometry, enabled, num_hashes, num_tokens, local_tokens) == reason


@given(lookup_scenarios())
def test_a_request_that_passes_the_guards_has_a_token_left_to_compute(
    scenario: LookupScenario,
) -> None:
    geometry = scenario.geometry
    reason = lookup_skip_reason(
        geometry, True, len(scenario.hashes), scenario.num_tokens, scenario.local_tokens
    )
    assert reason is None
    assert scenario.local_tokens < scenario.num_tokens - 1


def test_partial_hash_hits_lower_the_prompt_alignment_to_the_hash_block() -> None:
    geometry = CacheGeometry(
        (0, 1),
        (16, 64),
        (16, 16),
        block_size=64,
        hash_block_size=16,
        partial_hash_hits=True,
        coordinated=True,
    )
    assert lookup_skip_reason(geometry, True, 1, 17, 0) is None
    assert (
        lookup_skip_reason(
            CacheGeometry(
                (0, 1), (16, 64), (16, 64), block_size=64, hash_block_size=16, coordinated=True
            ),
            True,
            1,
            17,
            0,
        )
        is LookupSkip.PROMPT_SHORTER_THAN_ALIGNMENT
    )


def test_lookup_unit_is_the_hash_block_only_when_partial_hits_are_usable() -> None:
    assert lookup_unit(64, 16, True, True) == 16
    assert lookup_unit(64, 16, True, False) == 64
    assert lookup_unit(64, 16, False, True) == 64


def test_eagle_with_the_coordinator_probes_up_to_the_prompt_end() -> None:
    coordinated = CacheGeometry(
        (0, 1),
        (16, 16),
        (16, 16),
        block_size=16,
        hash_block_size=16,
        use_eagle=True,
        coordinated=True,
    )
    assert lookup_limit(coordinated, 64, 4) == 64
    assert lookup_limit(coordinated, 70, 4) == 64
    assert lookup_limit(GEOMETRY, 64, 4) == 63
    # Never past the hashes: an object without a hash has no identity.
    assert lookup_limit(GEOMETRY, 64, 2) == 32


def test_geometry_rejects_units_that_do_not_tile_the_blocks() -> None:
    with pytest.raises(ValueError):
        CacheGeometry((0,), (16,), (12,), block_size=16, hash_block_size=4)
    with pytest.raises(ValueError):
        CacheGeometry((0,), (16,), (16, 16), block_size=16, hash_block_size=16)
    with pytest.raises(ValueError):
        CacheGeometry((0,), (32,), (32,), block_size=16, hash_block_size=16)


def test_eagle_falls_back_to_a_block_start_rather_than_read_an_unreported_object() -> None:
    """Blocks 0 and 1 are stored whole and a partial tail ends at unit 10. EAGLE
    drops a block: 10 - 4 = unit 6, inside block 1, whose object at unit 6 was never
    reported; the window falls back to block 1's start unless that object hit."""
    geometry = CacheGeometry(
        (0,),
        (16,),
        (4,),
        block_size=16,
        hash_block_size=4,
        partial_hash_hits=True,
        use_eagle=True,
    )
    keyspace = KeySpace("ns", RankTopology())
    hashes = tuple(bytes([index]) for index in range(16))
    query = build_lookup_query(geometry, keyspace, hashes, 0, 64)
    held = {3, 7, 9}
    folded = fold_rank_hits(query, [index in held for index in range(query.key_count)])
    assert folded is not None
    assert single_group_hit_tokens(replace(geometry, use_eagle=False), query, folded) == 40
    assert single_group_hit_tokens(geometry, query, folded) == 16
    held.add(5)
    folded = fold_rank_hits(query, [index in held for index in range(query.key_count)])
    assert folded is not None
    assert single_group_hit_tokens(geometry, query, folded) == 24
