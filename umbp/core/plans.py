"""Transfer plans: the values the scheduler role hands to its workers each step.

A plan names one request's blocks grouped by cache group, as vLLM's own
``GPULoadStoreSpec`` does: per group its block size, the device block ids and the
hashes of the objects they hold, aligned. Every layer below (the worker, its
copiers and staging buffers, the store) works one group at a time, so a plan is
never flattened into per-block rows that a later layer must regroup. Plans carry
object identities ``(group_id, block_hash)``, never key strings: each worker builds
its own rank's keys (:class:`~umbp.core.identity.KeySpace`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, repeat

from umbp.core.identity import ObjectId

__all__ = ["GroupBlocks", "LoadPlan", "StorePlan", "StoredBlockFacts", "plan_block_ids"]


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """One cache group's part of a plan: block ``block_ids[i]`` holds the object
    ``(group_id, block_hashes[i])``; every block of the group has ``block_size``
    tokens."""

    group_id: int
    block_size: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]

    def __len__(self) -> int:
        return len(self.block_ids)

    def identities(self) -> Iterator[ObjectId]:
        return zip(repeat(self.group_id), self.block_hashes)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Objects to read from the pool into one request's blocks, a group at most
    once."""

    request_id: str
    groups: tuple[GroupBlocks, ...]

    def __len__(self) -> int:
        return sum(map(len, self.groups))


@dataclass(frozen=True, slots=True)
class StoredBlockFacts:
    """What a KV event announces of each block of one stored group, aligned with
    its blocks: the hash of the block before it (None for a first block) and its
    token ids (empty for a state page, which is not token-addressable)."""

    parent_hashes: tuple[bytes | None, ...]
    token_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Blocks of one request to copy into the pool, a group at most once.

    ``facts`` feed KV events: one per group when events are enabled, else None
    (nothing per block is built for a value nobody reads)."""

    request_id: str
    groups: tuple[GroupBlocks, ...]
    facts: tuple[StoredBlockFacts, ...] | None = None

    def __len__(self) -> int:
        return sum(map(len, self.groups))

    def identities(self) -> Iterator[ObjectId]:
        return chain.from_iterable(group.identities() for group in self.groups)


def plan_block_ids(plan: LoadPlan | StorePlan) -> tuple[int, ...]:
    """Every block id of the plan, group after group (ids of different groups may
    coincide: a block id is unique only within its group)."""
    if len(plan.groups) == 1:
        return plan.groups[0].block_ids
    return tuple(chain.from_iterable(group.block_ids for group in plan.groups))
