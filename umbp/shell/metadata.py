"""What the scheduler-role connector tells its workers each step, and what the
workers answer. Both cross process boundaries (pickled by vLLM), so they hold
plain immutable values only."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from umbp.core.identity import RankCoord, ReplicatedGroups
from umbp.core.plans import LoadPlan, StorePlan
from umbp.core.stores.acks import StoreEventResult, merge_store_results
from umbp.runtime.embedded import PoolAddress


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    """Loads and stores for one step. Each worker builds its own rank's keys
    from the (group, block hash) identities in the plans."""

    loads: list[LoadPlan] = field(default_factory=list)
    # Requests waiting in WAITING_FOR_REMOTE_KVS: vLLM expects them back as finished
    # receives; synchronous loads must not be reported so.
    async_loads: frozenset[str] = frozenset()
    # Loads that could not be planned: their blocks are reported failed at once.
    unplanned_loads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stores: tuple[StorePlan, ...] = ()
    # Per storing request, the requests whose synchronous load this step fills
    # blocks it reads: if one fails, the worker stores nothing of the request.
    stores_over_loads: dict[str, frozenset[str]] = field(default_factory=dict)
    # Requests whose failed load the scheduler has acted on (or finished, or
    # preempted) before this step: the worker may store for them again.
    resolved_load_failures: frozenset[str] = frozenset()
    store_event: int | None = None
    preempted_request_ids: frozenset[str] = frozenset()
    # No tokens scheduled: the engine loop only polls (asynchronous loads, among others).
    idle_step: bool = False


@dataclass
class UMBPWorkerMetadata(KVConnectorWorkerMetadata):
    """Per store event, what this worker (or the workers merged so far) did."""

    store_results: dict[int, StoreEventResult] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, UMBPWorkerMetadata):
            return self
        merged = dict(self.store_results)
        for event, result in other.store_results.items():
            previous = merged.get(event)
            merged[event] = result if previous is None else merge_store_results(previous, result)
        return UMBPWorkerMetadata(merged)


@dataclass
class UMBPHandshake(KVConnectorHandshakeMetadata):
    """What only a worker knows, for the scheduler: the namespace it stores
    under, its rank, (embedded mode) how to reach its pool for lookups, the cache
    groups it keys once per replica run of TP ranks, and whether its restores run layer
    by layer when ``load_async`` is unset
    (:func:`umbp.core.config.restores_layer_by_layer`)."""

    namespace: str
    rank: RankCoord
    pool: PoolAddress | None
    replicated: ReplicatedGroups = ()
    restores_layer_by_layer: bool = False
