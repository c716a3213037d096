"""The admission's slice-based paths equal the block-by-block rules they replace.

``load_plan`` builds each group's blocks as slices of the block table and the
hashes, and ``single_group_hit_tokens`` tests a whole run
of hits with one ``all()``. The oracles here are the rules written one block at a
time, as the reference does; every input (any window, any table: short, null,
repeated ids; any answers) must give the same value or the same error.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Result, Success

from tests.property.strategies import request_hashes, single_group_geometries
from tests.property.test_lookup_properties import scan_like_the_reference
from umbp.core.geometry import NULL_BLOCK_ID, CacheGeometry
from umbp.core.identity import KeySpace, RankTopology
from umbp.core.loads.allocation import load_plan
from umbp.core.lookup.query import build_lookup_query
from umbp.core.lookup.windows import LoadSpec, single_group_hit_tokens
from umbp.core.plans import GroupBlocks, LoadPlan


def load_block_by_block(
    geometry: CacheGeometry,
    spec: LoadSpec,
    table: tuple[tuple[int, ...], ...],
    hashes: Sequence[bytes],
    num_external_tokens: int,
) -> Result[LoadPlan, str]:
    """The positional load rule, one block and one append at a time."""
    prefix = "request r: "
    if num_external_tokens != spec.num_tokens_to_load:
        return Failure(
            f"{prefix}matched {spec.num_tokens_to_load} external tokens "
            f"but {num_external_tokens} were allocated"
        )
    if len(table) != len(geometry.group_ids):
        return Failure(
            f"{prefix}block table has {len(table)} groups, expected {len(geometry.group_ids)}"
        )
    hbs = geometry.hash_block_size
    end = spec.external_tokens
    if end > len(hashes) * hbs:
        return Failure(f"{prefix}the window ends at token {end} but hashes cover {len(hashes) * hbs}")
    rows: list[tuple[int, int, bytes]] = []
    for group_id, size, blocks in zip(geometry.group_ids, geometry.group_block_sizes, table):
        for index in range(spec.local_tokens // size, end // size):
            if index >= len(blocks):
                return Failure(
                    f"{prefix}group {group_id} has {len(blocks)} blocks, "
                    f"the window needs {end // size}"
                )
            rows.append((group_id, blocks[index], hashes[(index + 1) * size // hbs - 1]))
        if end % size:
            if not geometry.partial_hash_hits:
                return Failure(
                    f"{prefix}the window ends inside a block of group {group_id} without partial hits"
                )
            if end % hbs:
                return Failure(f"{prefix}the window end {end} is not hash aligned")
            if end // size >= len(blocks):
                return Failure(f"{prefix}partial hit in group {group_id} has no destination block")
            rows.append((group_id, blocks[end // size], hashes[end // hbs - 1]))
    seen: set[int] = set()
    for group_id, block_id, _ in rows:
        if block_id == NULL_BLOCK_ID:
            return Failure(
                f"{prefix}a pool object maps to a null destination block in group {group_id}"
            )
    for _, block_id, _ in rows:
        if block_id in seen:
            return Failure(f"{prefix}a destination block is written twice")
        seen.add(block_id)
    groups = []
    for group_id, size in zip(geometry.group_ids, geometry.group_block_sizes):
        mine = [row for row in rows if row[0] == group_id]
        if mine:
            groups.append(GroupBlocks(group_id, size, tuple(row[1] for row in mine),
                                      tuple(row[2] for row in mine)))
    ends_mid_block = any(end % size for size in geometry.group_block_sizes)
    return Success(LoadPlan("r", tuple(groups), ends_mid_block))


@st.composite
def positional_loads(
    draw: st.DrawFn,
) -> tuple[CacheGeometry, LoadSpec, tuple[tuple[int, ...], ...], tuple[bytes, ...], int]:
    """Any single-group window over any table: mostly well formed (contiguous
    distinct ids, the fast path's case), sometimes short, null or repeated."""
    geometry = draw(single_group_geometries())
    size, hbs = geometry.block_size, geometry.hash_block_size
    hashes = draw(request_hashes(draw(st.integers(0, 40))))
    local_blocks = draw(st.integers(0, 6))
    local = local_blocks * size
    end = draw(st.integers(local + 1, local + 12 * size))
    if draw(st.booleans()):
        end = end // hbs * hbs or hbs  # mostly hash aligned, as lookups make them
    spec = LoadSpec(local, max(end, local + 1))
    blocks = draw(st.integers(0, 20))
    if draw(st.booleans()):
        first = draw(st.integers(1, 1000))
        ids = list(range(first, first + blocks))
    else:
        ids = draw(st.lists(st.integers(0, 12), min_size=blocks, max_size=blocks))
    tables = (tuple(ids),) if draw(st.integers(0, 9)) else (tuple(ids), tuple(ids))
    allocated = spec.num_tokens_to_load + draw(st.sampled_from([0, 0, 0, 0, -1, 1]))
    return geometry, spec, tables, hashes, allocated


@given(positional_loads())
def test_a_positional_load_plan_is_the_block_by_block_rule(
    case: tuple[CacheGeometry, LoadSpec, tuple[tuple[int, ...], ...], tuple[bytes, ...], int],
) -> None:
    geometry, spec, table, hashes, allocated = case
    assert load_plan("r", geometry, spec, table, hashes, allocated) == load_block_by_block(
        geometry, spec, table, hashes, allocated
    )


@given(single_group_geometries(), st.data())
def test_hit_tokens_of_a_hit_run_then_anything_are_the_reference_scan(
    geometry: CacheGeometry, data: st.DataObject
) -> None:
    """A run of hits (often the whole query: the one-call fast path), then any
    answers: the hit tokens are what the reference's index-by-index scan finds,
    with partial hits and EAGLE as the geometry has them."""
    num_tokens = data.draw(st.integers(geometry.block_size + 1, 30 * geometry.block_size))
    hashes = data.draw(request_hashes(num_tokens // geometry.hash_block_size))
    local = data.draw(st.integers(0, (num_tokens - 2) // geometry.block_size)) * geometry.block_size
    query = build_lookup_query(geometry, KeySpace("ns", RankTopology()), hashes, local, num_tokens)
    count = len(query.object_hashes[0])
    run = data.draw(st.one_of(st.just(count), st.integers(0, count)))
    rest = data.draw(st.lists(st.booleans(), min_size=count - run, max_size=count - run))
    hits = (True,) * run + tuple(rest)
    assert single_group_hit_tokens(geometry, query, (hits,)) == scan_like_the_reference(
        geometry, hits
    )
