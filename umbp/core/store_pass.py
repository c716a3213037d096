"""The store pass of one scheduler step: which candidate blocks the pool may
already hold, and the store batches that leave out those it does hold.

A block whose tokens a request did not compute itself (vLLM's prefix cache served
them, or umbp restored them) was most likely stored before, so it is checked; a
block the request computed is new and planned without a check. The check covers
every request of the step in one batched lookup (:func:`residency_check`), and
:func:`plan_stores` turns its answers into the step's batches.

Nothing here remembers an answer beyond the step: an object the pool evicts after
the check is stored again by the next request that computes or caches its block.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import compress

from umbp.core.identity import Identity, KeySpace
from umbp.core.lookup import NULL_BLOCK_ID, BlockTable, LookupGeometry
from umbp.core.rank_keys import KeyLayout, RankedKeys, fold_ranks, rank_prefixes, rank_tags
from umbp.core.store_plans import StoreBatch, StoreSelection, store_batch, whole_run_batch

__all__ = [
    "ResidencyCheck",
    "StoreCandidates",
    "StorePass",
    "plan_stores",
    "residency_check",
    "resident_blocks_from_hits",
]


@dataclass(frozen=True, slots=True)
class StoreCandidates:
    """One request's blocks chosen for storing this step (after vLLM's masks).

    ``cached_tokens``: the tokens the request had when it was scheduled without
    computing them (vLLM's prefix-cache hits plus umbp's restored window). Its
    blocks that end at or below that count may already be in the pool.
    """

    request_id: str
    selected: StoreSelection
    block_table: BlockTable
    block_hashes: tuple[bytes, ...]
    cached_tokens: int = 0
    token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class ResidencyCheck:
    """The cached candidate blocks of one step whose objects may be in the pool,
    each identity once, none an in-flight store already writes.

    ``keys`` are object-major: the ``rank_count`` keys of ``identities[i]`` are
    ``keys[i*rank_count:(i+1)*rank_count]``.
    """

    identities: tuple[Identity, ...]
    keys: tuple[str, ...]
    rank_count: int


@dataclass(frozen=True, slots=True)
class StorePass:
    """The step's store batches (non-empty, request order) and how many distinct
    objects were left out because every rank already holds them."""

    batches: tuple[StoreBatch, ...]
    skipped_resident: int


def residency_check(
    geometry: LookupGeometry,
    keyspace: KeySpace,
    candidates: Sequence[StoreCandidates],
    reserved: AbstractSet[Identity] = frozenset(),
) -> ResidencyCheck:
    """The keys of every selected, non-null, hashed block that ends within its
    request's cached tokens, except identities in ``reserved`` (they are skipped
    anyway). A request with nothing cached adds nothing."""
    hash_block_size = geometry.hash_block_size
    seen: dict[Identity, None] = {}
    for candidate in candidates:
        if candidate.cached_tokens < hash_block_size:
            continue
        request_hashes = candidate.block_hashes
        cached = min(candidate.cached_tokens, len(request_hashes) * hash_block_size)
        for group_id, indices in candidate.selected:
            position = geometry.position(group_id)
            block_size = geometry.group_block_sizes[position]
            table = candidate.block_table[position]
            limit = min(cached // block_size, len(table))
            per_block = block_size // hash_block_size
            for index in indices:
                if index >= limit or table[index] == NULL_BLOCK_ID:
                    continue
                identity = (group_id, request_hashes[index * per_block + per_block - 1])
                if identity not in reserved:
                    seen[identity] = None
    identities = tuple(seen)
    rank_count = keyspace.topology.rank_count
    prefixes = {group_id: rank_prefixes(keyspace, group_id) for group_id in geometry.group_ids}
    keys: list[str] = []
    for group_id, block_hash in identities:
        digest = block_hash.hex()
        keys.extend(prefix + digest for prefix in prefixes[group_id])
    # Object-major with its layout, so a per-rank router slices it and never
    # parses a key.
    ranked = RankedKeys(keys, KeyLayout.objects(len(identities), rank_count), rank_tags(keyspace))
    return ResidencyCheck(identities, ranked, rank_count)


def resident_blocks_from_hits(
    check: ResidencyCheck, answers: Sequence[bool] | None
) -> frozenset[Identity]:
    """The checked identities every rank holds. A wrong-length answer (or none)
    means nothing is known to be resident: storing again is safe, skipping is not."""
    if answers is None or len(answers) != len(check.keys):
        return frozenset()
    every_rank = fold_ranks(KeyLayout.objects(len(check.identities), check.rank_count), answers)
    if every_rank is None:
        return frozenset()
    return frozenset(compress(check.identities, every_rank[0]))


def plan_stores(
    geometry: LookupGeometry,
    candidates: Sequence[StoreCandidates],
    check: ResidencyCheck,
    answers: Sequence[bool] | None,
    reserved: AbstractSet[Identity] = frozenset(),
    *,
    events_enabled: bool = False,
) -> StorePass:
    """The step's store batches given the answers to ``check`` (built from the
    same candidates and reservations; None when the lookup failed).

    An identity is planned once, by the first request that selects it, unless it
    is reserved or every rank holds it; null blocks and blocks past the hashes are
    never planned (see :func:`umbp.core.store_plans.store_batch`).
    """
    resident = resident_blocks_from_hits(check, answers)
    planned: dict[int, set[bytes]] = {}
    batches: list[StoreBatch] = []
    # With nothing to leave out but repeats, a one-group request's whole run takes
    # the short path (the usual step: new requests, nothing in flight).
    whole_runs = not (resident or reserved or events_enabled)
    for candidate in candidates:
        batch = whole_run_batch(
            candidate.request_id, geometry, candidate.selected, candidate.block_table,
            candidate.block_hashes, planned,
        ) if whole_runs else None
        if batch is None:
            batch = store_batch(
                candidate.request_id, geometry, candidate.selected, candidate.block_table,
                candidate.block_hashes, planned=planned, resident=resident, reserved=reserved,
                events_enabled=events_enabled, token_ids=candidate.token_ids,
            )
        if batch.block_ids:
            batches.append(batch)
    return StorePass(tuple(batches), len(resident))
