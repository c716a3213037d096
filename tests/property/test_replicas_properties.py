"""Properties of cache groups that runs of TP ranks hold alike (umbp.core.replicas and
the keys :class:`~umbp.core.identity.KeySpace` gives them): one object per run, written
by exactly one rank, read by every rank of the run, and a hit needs that object."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from tests.property.key_format import parse_key
from umbp.core.config import ConnectorConfig
from umbp.core.identity import (
    CacheGroupShape,
    KeySpace,
    NamespaceInputs,
    RankCoord,
    RankTopology,
    bound_keyspace,
    namespace_fingerprint,
)
from umbp.core.plans import GroupBlocks, StoredBlockFacts, StorePlan
from umbp.core.rank_keys import KeyLayout, fold_ranks, object_major_keys
from umbp.core.replicas import (
    group_tp_replicas,
    layer_tp_replicas,
    ranks_share_store,
    replicated_groups,
    stores_rank_writes,
)

# ------------------------------------------------------------------ strategies


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def topologies(draw: st.DrawFn) -> RankTopology:
    tp = draw(st.integers(1, 8))
    return RankTopology(tp, draw(st.integers(1, 2)), draw(st.sampled_from(divisors(tp))),
                        draw(st.integers(1, 2)))


@st.composite
def replicated_keyspaces(draw: st.DrawFn) -> KeySpace:
    """A key space whose groups 0-3 are each replicated over a run dividing tp, or not."""
    topology = draw(topologies())
    runs = [(g, draw(st.sampled_from(divisors(topology.tp_size)))) for g in range(4)]
    return KeySpace(draw(st.sampled_from(["ns", "m-1.x"])), topology,
                    replicated_groups(runs, ranks_share=True))


block_hashes = st.binary(min_size=1, max_size=12)
group_ids = st.integers(0, 3)


def runs_of(keyspace: KeySpace, group_id: int) -> dict[RankCoord, list[RankCoord]]:
    """Every rank, by the rank whose key it reads."""
    runs: dict[RankCoord, list[RankCoord]] = {}
    for rank in keyspace.topology.coords():
        runs.setdefault(keyspace.key_rank(rank, group_id), []).append(rank)
    return runs


# ------------------------------------------------------------------ keys


@given(replicated_keyspaces(), group_ids, block_hashes)
def test_every_rank_of_a_run_has_one_key_and_exactly_one_rank_of_it_writes(
    keyspace: KeySpace, group_id: int, block_hash: bytes
) -> None:
    run = keyspace.replica_run(group_id)
    for writer, ranks in runs_of(keyspace, group_id).items():
        assert len(ranks) == run
        assert {keyspace.key(rank, group_id, block_hash) for rank in ranks} == {
            keyspace.key(writer, group_id, block_hash)
        }
        assert [rank for rank in ranks if keyspace.writes(rank, group_id)] == [writer]
        # The writer's key is the key it had as a rank of its own: only readers change.
        parsed = parse_key(keyspace.key(writer, group_id, block_hash)).unwrap()
        assert parsed.rank == writer and writer in ranks
        # A run is consecutive TP ranks of one PCP and PP rank.
        assert {(r.pcp, r.pp) for r in ranks} == {(writer.pcp, writer.pp)}
        assert sorted(r.tp for r in ranks) == list(range(writer.tp, writer.tp + run))


@given(replicated_keyspaces(), group_ids, block_hashes)
def test_an_object_has_one_key_per_run_and_runs_never_share_a_key(
    keyspace: KeySpace, group_id: int, block_hash: bytes
) -> None:
    keys = keyspace.rank_keys(group_id, block_hash)
    assert len(keys) == keyspace.topology.rank_count
    assert len(set(keys)) == keyspace.topology.rank_count // keyspace.replica_run(group_id)
    assert keys == tuple(keyspace.key(rank, group_id, block_hash)
                         for rank in keyspace.topology.coords())


@given(topologies(), group_ids, block_hashes)
def test_a_group_not_replicated_keeps_one_distinct_key_per_rank(
    topology: RankTopology, group_id: int, block_hash: bytes
) -> None:
    keyspace = KeySpace("ns", topology)
    keys = keyspace.rank_keys(group_id, block_hash)
    assert len(set(keys)) == topology.rank_count
    assert all(keyspace.writes(rank, group_id) for rank in topology.coords())
    assert [parse_key(key).unwrap().rank for key in keys] == list(topology.coords())


@given(replicated_keyspaces(), group_ids, block_hashes, st.data())
def test_the_folded_hit_is_the_writers_object_whatever_other_keys_the_store_holds(
    keyspace: KeySpace, group_id: int, block_hash: bytes, data: st.DataObject
) -> None:
    # Any store: some of this object's per-rank keys of an older layout, some writers'.
    own_keys = KeySpace(keyspace.namespace, keyspace.topology).rank_keys(group_id, block_hash)
    held = set(data.draw(st.lists(st.sampled_from(own_keys), unique=True)))
    keys = object_major_keys(keyspace, [(group_id, block_hash)])
    folded = fold_ranks(keys.layout, [key in held for key in keys])
    assert folded is not None
    writers_held = all(keyspace.key(writer, group_id, block_hash) in held
                       for writer in runs_of(keyspace, group_id))
    assert folded == ((writers_held,),)


# ------------------------------------------------------------------ who writes


@st.composite
def store_plans(draw: st.DrawFn) -> tuple[StorePlan, ...]:
    plans = []
    for index in range(draw(st.integers(0, 3))):
        groups = draw(st.lists(group_ids, unique=True, max_size=4))
        blocks = [
            GroupBlocks(g, 4, tuple(range(n)), tuple(bytes([index, g, i]) for i in range(n)))
            for g in groups for n in [draw(st.integers(1, 3))]
        ]
        facts = None if draw(st.booleans()) else tuple(
            StoredBlockFacts((None,) * len(b), ((g,),) * len(b))
            for b, g in zip(blocks, groups)
        )
        plans.append(StorePlan(f"r{index}", tuple(blocks), facts))
    return tuple(plans)


@given(replicated_keyspaces(), store_plans())
def test_each_key_every_rank_reads_is_written_by_exactly_one_rank(
    keyspace: KeySpace, plans: tuple[StorePlan, ...]
) -> None:
    written: dict[str, list[RankCoord]] = {}
    for rank in keyspace.topology.coords():
        for plan in stores_rank_writes(plans, keyspace, rank):
            assert plan.facts is None or len(plan.facts) == len(plan.groups)
            for group in plan.groups:
                assert keyspace.writes(rank, group.group_id)
                for group_id, block_hash in group.identities():
                    written.setdefault(keyspace.key(rank, group_id, block_hash), []).append(rank)
    read = {
        keyspace.key(rank, group_id, block_hash)
        for plan in plans for group_id, block_hash in plan.identities()
        for rank in keyspace.topology.coords()
    }
    assert set(written) == read
    assert all(len(ranks) == 1 for ranks in written.values())


@given(topologies(), store_plans())
def test_without_replicated_groups_every_rank_writes_every_plan(
    topology: RankTopology, plans: tuple[StorePlan, ...]
) -> None:
    keyspace = KeySpace("ns", topology)
    for rank in topology.coords():
        assert stores_rank_writes(plans, keyspace, rank) == plans


def test_a_plan_keeps_its_other_groups_and_their_facts_aligned() -> None:
    keyspace = KeySpace("ns", RankTopology(tp_size=2), ((1, 2),))
    facts = (StoredBlockFacts((None,), ((1,),)), StoredBlockFacts((None,), ((2,),)))
    plan = StorePlan("r", (GroupBlocks(0, 4, (5,), (b"a",)), GroupBlocks(1, 4, (6,), (b"b",))),
                     facts)
    reader = RankCoord(tp=1, dcp=0)
    assert stores_rank_writes((plan,), keyspace, reader) == (
        StorePlan("r", (plan.groups[0],), (facts[0],)),
    )
    assert stores_rank_writes((plan,), keyspace, RankCoord()) == (plan,)


# ------------------------------------------------------------------ which groups


@given(st.integers(1, 16), st.integers(1, 16), st.none() | st.integers(1, 32), st.booleans())
def test_a_layers_run_follows_vllms_rule(
    tp: int, dcp: int, max_tp_shards: int | None, dcp_sharded: bool
) -> None:
    run = layer_tp_replicas(tp, dcp, max_tp_shards, dcp_sharded)
    if max_tp_shards is None or (dcp_sharded and dcp > 1):
        assert run == 1
    else:
        assert run == max(1, tp // max_tp_shards)


@given(topologies(), st.lists(st.none() | st.integers(1, 16), max_size=4), st.booleans())
def test_a_groups_run_divides_tp_and_every_layers_run_so_a_key_space_takes_it(
    topology: RankTopology, shards: list[int | None], dcp_sharded: bool
) -> None:
    layer_runs = [layer_tp_replicas(topology.tp_size, topology.dcp_size, s, dcp_sharded)
                  for s in shards]
    run = group_tp_replicas(topology.tp_size, layer_runs)
    assert topology.tp_size % run == 0 and all(layer % run == 0 for layer in layer_runs)
    groups = replicated_groups([(0, run), (1, 1)], ranks_share=True)
    assert groups == (((0, run),) if run > 1 else ())
    KeySpace("ns", topology, groups)  # accepted


@given(st.lists(st.tuples(group_ids, st.integers(1, 8)), unique_by=lambda p: p[0]))
def test_a_store_each_worker_owns_keeps_a_copy_per_rank(runs: list[tuple[int, int]]) -> None:
    assert replicated_groups(runs, ranks_share=False) == ()


@pytest.mark.parametrize(("config", "shared"), [
    (ConnectorConfig(mode="embedded"), False),
    (ConnectorConfig(mode="server", endpoint="/s"), True),
    (ConnectorConfig(mode="mooncake", mooncake_master="m:1"), True),
    (ConnectorConfig(mode="mori"), False),
    (ConnectorConfig(mode="mori", mori_deployment="standalone", mori_address="unix:///s"), True),
])
def test_only_a_store_every_rank_reads_shares_objects(config: ConnectorConfig,
                                                      shared: bool) -> None:
    assert ranks_share_store(config) is shared


@pytest.mark.parametrize("replicated", [((0, 1),), ((0, 3),), ((1, 2), (0, 2)), ((0, 2), (0, 2))])
def test_a_key_space_refuses_runs_that_are_not_a_divisor_of_tp_or_not_in_order(
    replicated: tuple[tuple[int, int], ...]
) -> None:
    with pytest.raises(ValueError, match="replicated groups|does not divide"):
        KeySpace("ns", RankTopology(tp_size=4), replicated)


# ------------------------------------------------------------------ the namespace


MLA = CacheGroupShape("MLAAttentionSpec", (("max_tp_shards", "1"), ("dcp_sharded", "True"),
                                           ("head_size", "576")))
BASE = NamespaceInputs(model_id="m", revision=None, kv_dtype="auto/bfloat16", groups=(MLA,),
                       block_size=32, hash_block_size=32, tp_size=2, pcp_size=1, dcp_size=1,
                       pp_size=1, weights="files:" + "0" * 32)
BYTE_SHAPING = {
    "tp_size": 4, "dcp_size": 2, "pcp_size": 2, "kv_dtype": "fp8_e4m3/bfloat16",
    "block_size": 64, "weights": "files:" + "1" * 32,
    "groups": (replace(MLA, fields=(("max_tp_shards", "None"), ("dcp_sharded", "True"),
                                    ("head_size", "576"))),),
}


@given(st.sampled_from(sorted(BYTE_SHAPING)), block_hashes)
def test_a_replicated_groups_key_changes_when_anything_that_shapes_its_bytes_changes(
    field_name: str, block_hash: bytes
) -> None:
    changed = replace(BASE, **{field_name: BYTE_SHAPING[field_name]})
    run = 2
    keys = {
        KeySpace(namespace_fingerprint(inputs), RankTopology(tp_size=2), ((0, run),))
        .key(RankCoord(tp=1), 0, block_hash)
        for inputs in (BASE, changed)
    }
    assert len(keys) == 2


def test_workers_that_disagree_on_the_replicated_groups_do_not_bind() -> None:
    topology = RankTopology(tp_size=2)
    ranks = topology.coords()
    agreed = bound_keyspace(topology, dict.fromkeys(ranks, "ns"), dict.fromkeys(ranks, ((0, 2),)))
    assert agreed == Success(KeySpace("ns", topology, ((0, 2),)))
    disagree = bound_keyspace(topology, dict.fromkeys(ranks, "ns"),
                              {ranks[0]: ((0, 2),), ranks[1]: ()})
    assert isinstance(disagree, Failure) and "share" in disagree.failure()
    assert bound_keyspace(topology, dict.fromkeys(ranks, "ns")) == Success(
        KeySpace("ns", topology)
    )


def test_rank_major_layouts_are_unchanged_by_replication() -> None:
    # The lookup asks one key per rank as before; only the strings coincide.
    keyspace = KeySpace("ns", RankTopology(tp_size=4), ((0, 2),))
    keys = object_major_keys(keyspace, [(0, b"h"), (1, b"h")])
    assert keys.layout == KeyLayout.objects(2, 4)
    assert len(set(keys[:4])) == 2 and len(set(keys[4:])) == 4
