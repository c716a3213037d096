"""The store step's one residency check: which candidate blocks of the step the
pool may already hold, asked in one batched lookup for every request of the step.

A block whose tokens a request did not compute itself (vLLM's prefix cache served
them, or umbp restored them) was most likely stored before, so it is checked; a
block the request computed is new and planned without a check. Nothing here
remembers an answer beyond the step: an object the pool evicts after the check is
stored again by the next request that computes or caches its block.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import compress

from umbp.core.geometry import NULL_BLOCK_ID, CacheGeometry
from umbp.core.identity import KeySpace, ObjectId
from umbp.core.rank_keys import KeyLayout, RankedKeys, fold_ranks, rank_prefixes, rank_tags
from umbp.core.stores.windows import StoreCandidates

__all__ = ["NO_RESIDENCY_CHECK", "ResidencyCheck", "residency_check", "resident_blocks_from_hits"]


@dataclass(frozen=True, slots=True)
class ResidencyCheck:
    """The cached candidate blocks of one step whose objects may be in the pool,
    each identity once, none an in-flight store already writes.

    ``keys`` are object-major: the ``rank_count`` keys of ``identities[i]`` are
    ``keys[i*rank_count:(i+1)*rank_count]``.
    """

    identities: tuple[ObjectId, ...]
    keys: tuple[str, ...]
    rank_count: int



NO_RESIDENCY_CHECK = ResidencyCheck((), (), 1)
"""Nothing to ask (no key space bound yet, or no cached candidate)."""


def residency_check(
    geometry: CacheGeometry,
    keyspace: KeySpace,
    candidates: Sequence[StoreCandidates],
    reserved: AbstractSet[ObjectId] = frozenset(),
) -> ResidencyCheck:
    """The keys of every selected, non-null, hashed block that ends within its
    request's cached tokens, except identities in ``reserved`` (they are skipped
    anyway). A request with nothing cached adds nothing."""
    hash_block_size = geometry.hash_block_size
    seen: dict[ObjectId, None] = {}
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
) -> frozenset[ObjectId]:
    """The checked identities every rank holds. A wrong-length answer (or none)
    means nothing is known to be resident: storing again is safe, skipping is not."""
    if answers is None or len(answers) != len(check.keys):
        return frozenset()
    every_rank = fold_ranks(KeyLayout.objects(len(check.identities), check.rank_count), answers)
    if every_rank is None:
        return frozenset()
    return frozenset(compress(check.identities, every_rank[0]))

