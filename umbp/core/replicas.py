"""Cache groups whose bytes several tensor-parallel ranks hold alike, stored once.

vLLM states how many distinct shards a layer's KV splits into across TP
(``AttentionSpec.max_tp_shards``: 1 for MLA's latent cache, which every TP rank
computes from the same replicated projection); the TP ranks beyond that hold
replicas, in runs of consecutive ranks (vLLM's ``kv_cache_groups_tp_replicas``, whose
rule :func:`layer_tp_replicas` follows). Where every rank reads one store (``server``,
``mooncake``, ``mori`` outside its in-process deployment) such a group is one object
per run: the run's first rank writes it under its own key, every rank of the run reads
that object, and a hit needs it (:class:`~umbp.core.identity.KeySpace` keys it so, and
the per-rank fold over a run's one key is that object's answer). A store each worker
owns alone (``embedded``, MORI in process) keeps a copy per rank: no other rank could
read the writer's.

The namespace is not touched: the group's spec (``max_tp_shards``, ``dcp_sharded``) and
the parallel sizes are in it, so layouts whose bytes differ never share a key.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from math import gcd

from umbp.core.config import ConnectorConfig
from umbp.core.identity import KeySpace, RankCoord, ReplicatedGroups
from umbp.core.plans import StorePlan

__all__ = [
    "group_tp_replicas",
    "layer_tp_replicas",
    "ranks_share_store",
    "replicated_groups",
    "stores_rank_writes",
]


def layer_tp_replicas(
    tp_size: int, dcp_size: int, max_tp_shards: int | None, dcp_sharded: bool
) -> int:
    """How many consecutive TP ranks hold one layer's KV alike: 1 where the spec does
    not say (``max_tp_shards`` None) or where decode context parallelism splits it
    across the TP group's ranks; else ``tp_size // max_tp_shards`` (at least 1)."""
    if max_tp_shards is None or (dcp_sharded and dcp_size > 1):
        return 1
    return max(1, tp_size // max_tp_shards)


def group_tp_replicas(tp_size: int, layer_replicas: Iterable[int]) -> int:
    """A cache group's run: the largest that every layer's run and ``tp_size`` are
    multiples of (a group with no layer: 1)."""
    runs = tuple(layer_replicas)
    if not runs:
        return 1
    return gcd(tp_size, *runs)


def ranks_share_store(config: ConnectorConfig) -> bool:
    """Whether every rank of the engine reads the one store its peers write: not an
    embedded pool (each worker's own) nor MORI deployed in process."""
    if config.mode == "embedded":
        return False
    return not (config.mode == "mori" and config.mori_deployment == "embedded")


def replicated_groups(
    group_runs: Iterable[tuple[int, int]], ranks_share: bool
) -> ReplicatedGroups:
    """The ``(group id, run)`` pairs a :class:`KeySpace` keys once per run: the groups
    whose run is longer than one rank, in a store every rank reads; none otherwise."""
    if not ranks_share:
        return ()
    return tuple(sorted((group_id, run) for group_id, run in group_runs if run > 1))


def stores_rank_writes(
    plans: Sequence[StorePlan], keyspace: KeySpace, rank: RankCoord
) -> tuple[StorePlan, ...]:
    """The part of the step's store plans that ``rank`` writes: without the groups
    another rank of its replica run writes (a plan left with none is dropped). What is
    left out is not a failure: the writer reports its own, as every worker reports
    every store event."""
    if not keyspace.replicated:
        return tuple(plans)
    kept: list[StorePlan] = []
    for plan in plans:
        keep = tuple(keyspace.writes(rank, group.group_id) for group in plan.groups)
        if all(keep):
            kept.append(plan)
        elif any(keep):
            kept.append(replace(
                plan,
                groups=tuple(g for g, k in zip(plan.groups, keep) if k),
                facts=None if plan.facts is None
                else tuple(f for f, k in zip(plan.facts, keep) if k),
            ))
    return tuple(kept)
