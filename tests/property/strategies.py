"""Hypothesis strategies shared by the properties of ``umbp.core``.

Sizes are small (hash blocks of 1-4 tokens, prompts of a few dozen tokens) so that
every interesting boundary (block ends, partial tails, the last prompt token) is
hit often; the arithmetic does not depend on scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from umbp.core.geometry import NULL_BLOCK_ID, CacheGeometry, lookup_unit
from umbp.core.identity import KeySpace, RankCoord, RankTopology
from umbp.core.plans import GroupBlocks, LoadPlan, StorePlan

ObjectId = tuple[int, bytes]


def request_hashes(count: int) -> st.SearchStrategy[tuple[bytes, ...]]:
    """``count`` distinct chained-looking hashes (a random salt plus the index)."""
    return st.binary(min_size=4, max_size=4).map(
        lambda salt: tuple(salt + index.to_bytes(4, "big") for index in range(count))
    )


def topologies() -> st.SearchStrategy[RankTopology]:
    return st.builds(
        RankTopology,
        tp_size=st.integers(1, 4),
        pcp_size=st.integers(1, 2),
        dcp_size=st.just(1),
        pp_size=st.integers(1, 2),
    )


@st.composite
def keyspaces(draw: st.DrawFn) -> KeySpace:
    """Sometimes with groups a run of TP ranks shares (one key per run, core.replicas)."""
    topology = draw(topologies())
    runs = [run for run in range(2, topology.tp_size + 1) if topology.tp_size % run == 0]
    replicated = tuple(sorted(draw(st.dictionaries(
        st.integers(0, 7), st.sampled_from(runs), max_size=3
    )).items())) if runs else ()
    return KeySpace(draw(st.sampled_from(["ns", "model-a.1", "x_y"])), topology, replicated)


@st.composite
def single_group_geometries(draw: st.DrawFn) -> CacheGeometry:
    """One plain full-attention group: vLLM's scheduler block equals the group's."""
    hash_block_size = draw(st.sampled_from([1, 2, 4]))
    units_per_block = draw(st.sampled_from([1, 2, 4]))
    block_size = hash_block_size * units_per_block
    partial = draw(st.booleans())
    return CacheGeometry(
        group_ids=(draw(st.integers(0, 3)),),
        group_block_sizes=(block_size,),
        lookup_units=(lookup_unit(block_size, hash_block_size, partial, True),),
        block_size=block_size,
        hash_block_size=hash_block_size,
        partial_hash_hits=partial,
        use_eagle=draw(st.booleans()),
        coordinated=False,
    )


@st.composite
def coordinated_geometries(draw: st.DrawFn) -> CacheGeometry:
    """Several groups with different block sizes, decided by vLLM's coordinator."""
    hash_block_size = draw(st.sampled_from([1, 2, 4]))
    factors = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3))
    sizes = tuple(hash_block_size * factor for factor in factors)
    partial = draw(st.booleans())
    group_ids = tuple(
        sorted(draw(st.sets(st.integers(0, 7), min_size=len(sizes), max_size=len(sizes))))
    )
    return CacheGeometry(
        group_ids=group_ids,
        group_block_sizes=sizes,
        lookup_units=tuple(lookup_unit(size, hash_block_size, partial, True) for size in sizes),
        block_size=math.lcm(*sizes),
        hash_block_size=hash_block_size,
        partial_hash_hits=partial,
        use_eagle=draw(st.booleans()),
        coordinated=True,
    )


def geometries() -> st.SearchStrategy[CacheGeometry]:
    return st.one_of(single_group_geometries(), coordinated_geometries())


@dataclass(frozen=True)
class Pool:
    """What each rank holds, as the set of keys a runtime would answer for."""

    keyspace: KeySpace
    keys: frozenset[str]

    def answers(self, keys: Sequence[str]) -> tuple[bool, ...]:
        return tuple(key in self.keys for key in keys)

    def held_by_every_rank(self, group_id: int, block_hash: bytes) -> bool:
        return all(
            self.keyspace.key(rank, group_id, block_hash) in self.keys
            for rank in self.keyspace.topology.coords()
        )


@st.composite
def pools(
    draw: st.DrawFn,
    keyspace: KeySpace,
    geometry: CacheGeometry,
    hashes: tuple[bytes, ...],
) -> Pool:
    """A pool shaped like real ones: per group a stored prefix of full blocks, a
    few sparse partial tails, and per rank a few holes (objects a rank lost)."""
    keys: set[str] = set()
    coords = keyspace.topology.coords()
    for group_id, block_size in zip(geometry.group_ids, geometry.group_block_sizes):
        per_block = block_size // geometry.hash_block_size
        full_blocks = len(hashes) // per_block
        stored_blocks = draw(st.one_of(st.just(full_blocks), st.integers(0, full_blocks)))
        identities = {hashes[(index + 1) * per_block - 1] for index in range(stored_blocks)}
        tail_start = stored_blocks * per_block
        tail_room = min(per_block - 1, len(hashes) - tail_start)
        if tail_room > 0 and draw(st.integers(0, 3)):
            # A saved partial tail inside the first block that is not stored whole.
            identities.add(hashes[tail_start + draw(st.integers(0, tail_room - 1))])
        if hashes:
            identities |= set(draw(st.lists(st.sampled_from(hashes), max_size=4)))
        holes: dict[RankCoord, frozenset[bytes]] = {
            rank: frozenset(draw(st.lists(st.sampled_from(hashes), max_size=2)))
            if hashes and draw(st.integers(0, 3)) == 0
            else frozenset()
            for rank in coords
        }
        for block_hash in identities:
            for rank in coords:
                if block_hash not in holes[rank]:
                    keys.add(keyspace.key(rank, group_id, block_hash))
    return Pool(keyspace, frozenset(keys))


@dataclass(frozen=True)
class LookupScenario:
    geometry: CacheGeometry
    keyspace: KeySpace
    hashes: tuple[bytes, ...]
    num_tokens: int
    local_tokens: int
    pool: Pool


@st.composite
def lookup_scenarios(
    draw: st.DrawFn, geometry_strategy: st.SearchStrategy[CacheGeometry] | None = None
) -> LookupScenario:
    """A request that passes every lookup guard, and a pool to look it up in."""
    geometry = draw(geometry_strategy if geometry_strategy is not None else geometries())
    keyspace = draw(keyspaces())
    block_size = geometry.block_size
    num_tokens = draw(st.integers(block_size + 1, block_size * 8 + 3))
    local_blocks = draw(st.integers(0, (num_tokens - 2) // block_size))
    local_tokens = local_blocks * block_size
    hashes = draw(request_hashes(num_tokens // geometry.hash_block_size))
    pool = draw(pools(keyspace, geometry, hashes))
    return LookupScenario(geometry, keyspace, hashes, num_tokens, local_tokens, pool)


@st.composite
def block_tables(
    draw: st.DrawFn,
    geometry: CacheGeometry,
    num_tokens: int,
    null_probability_one_in: int = 0,
) -> tuple[tuple[int, ...], ...]:
    """Per group, enough distinct non-null block ids to hold ``num_tokens`` (plus
    maybe one spare); with ``null_probability_one_in`` some ids become null."""
    needed = sum(-(-num_tokens // size) + 1 for size in geometry.group_block_sizes)
    ids = draw(st.permutations(range(1, needed + 1)))
    tables: list[tuple[int, ...]] = []
    offset = 0
    for size in geometry.group_block_sizes:
        count = -(-num_tokens // size) + draw(st.integers(0, 1))
        group = list(ids[offset : offset + count])
        offset += count
        if null_probability_one_in:
            group = [
                NULL_BLOCK_ID if draw(st.integers(0, null_probability_one_in - 1)) == 0 else block
                for block in group
            ]
        tables.append(tuple(group))
    return tuple(tables)


def identities_from(
    hashes: Sequence[bytes], group_ids: Sequence[int]
) -> st.SearchStrategy[frozenset[ObjectId]]:
    if not hashes:
        return st.just(frozenset())
    return st.frozensets(
        st.tuples(st.sampled_from(list(group_ids)), st.sampled_from(list(hashes))), max_size=4
    )


@dataclass(frozen=True)
class StoreScenario:
    """One request at one scheduler step, as store planning sees it."""

    geometry: CacheGeometry
    keyspace: KeySpace
    hashes: tuple[bytes, ...]
    num_tokens: int
    total_tokens: int
    previous_saved: int
    block_table: tuple[tuple[int, ...], ...]
    restored_tokens: int | None
    boundary_groups: frozenset[int]
    reserved: frozenset[ObjectId]
    pool: Pool


@st.composite
def store_scenarios(draw: st.DrawFn) -> StoreScenario:
    geometry = draw(geometries())
    keyspace = draw(keyspaces())
    hbs = geometry.hash_block_size
    num_tokens = draw(st.integers(1, geometry.block_size * 6 + 3))
    # Scheduled speculative tokens have no hash yet: coverage may fall short.
    num_hashes = draw(st.just(num_tokens // hbs) | st.integers(0, num_tokens // hbs))
    hashes = draw(request_hashes(num_hashes))
    previous_saved = draw(st.just(0) | st.integers(0, num_tokens // hbs)) * hbs
    return StoreScenario(
        geometry=geometry,
        keyspace=keyspace,
        hashes=hashes,
        num_tokens=num_tokens,
        total_tokens=draw(st.just(num_tokens) | st.integers(0, num_tokens + 3)),
        previous_saved=previous_saved,
        block_table=draw(block_tables(geometry, num_tokens, null_probability_one_in=6)),
        restored_tokens=draw(st.none() | st.just(num_tokens) | st.integers(0, num_tokens)),
        boundary_groups=frozenset(
            draw(st.just(set()) | st.sets(st.sampled_from(geometry.group_ids)))
        ),
        reserved=draw(identities_from(hashes, geometry.group_ids)),
        pool=draw(pools(keyspace, geometry, hashes)),
    )


def one_group_load(
    request_id: str, block_ids: Sequence[int], hashes: Sequence[bytes] | None = None,
    group_id: int = 0, block_size: int = 16,
) -> LoadPlan:
    """A load plan of one group's blocks (hashes made up when not given)."""
    if hashes is None:
        hashes = [index.to_bytes(4, "big") for index in range(len(block_ids))]
    return LoadPlan(request_id, (GroupBlocks(group_id, block_size, tuple(block_ids),
                                             tuple(hashes)),) if block_ids else ())


def plan_rows(plan: LoadPlan | StorePlan) -> list[tuple[int, int, bytes]]:
    """``(group_id, block_id, block_hash)`` of every block of a plan, in order."""
    return [
        (group.group_id, block_id, block_hash)
        for group in plan.groups
        for block_id, block_hash in zip(group.block_ids, group.block_hashes, strict=True)
    ]
