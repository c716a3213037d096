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

from umbp.core.identity import RankCoord
from umbp.runtime.embedded import PoolAddress


@dataclass(frozen=True, slots=True)
class ObjectTransfer:
    """Objects to move for one request: each is (group, block id, block hash).
    A worker builds its own rank's key from the group and hash."""

    request_id: str
    group_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """One worker's (or several merged workers') answer for one store event."""

    completed_workers: int
    failed: frozenset[tuple[int, bytes]]

    def merged(self, other: StoreOutcome) -> StoreOutcome:
        return StoreOutcome(
            self.completed_workers + other.completed_workers, self.failed | other.failed
        )


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    loads: list[ObjectTransfer] = field(default_factory=list)
    stores: list[ObjectTransfer] = field(default_factory=list)
    store_event: int | None = None
    preempted_request_ids: frozenset[str] = frozenset()


@dataclass
class UMBPWorkerMetadata(KVConnectorWorkerMetadata):
    store_outcomes: dict[int, StoreOutcome] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, UMBPWorkerMetadata):
            return self
        merged = dict(self.store_outcomes)
        for event, outcome in other.store_outcomes.items():
            previous = merged.get(event)
            merged[event] = outcome if previous is None else previous.merged(outcome)
        return UMBPWorkerMetadata(merged)


@dataclass
class UMBPHandshake(KVConnectorHandshakeMetadata):
    """What only a worker knows, for the scheduler: the namespace it stores
    under, its rank, and how to reach its pool for lookups."""

    namespace: str
    rank: RankCoord
    pool: PoolAddress
