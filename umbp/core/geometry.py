"""The shape of the KV cache as lookups and plans see it; fixed for an engine.

:class:`CacheGeometry` names the prefix-cacheable groups, their block sizes and the
tokens between two probed objects; block tables align with its groups. The
helpers here read a request's chained block hashes at given token ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

__all__ = [
    "NULL_BLOCK_ID",
    "BlockTable",
    "CacheGeometry",
    "block_table_of",
    "hashes_at_token_ends",
    "lookup_unit",
    "needs_coordinator",
]

NULL_BLOCK_ID: Final = 0
"""vLLM's null block: a placeholder in a block table that holds no KV."""


BlockTable: TypeAlias = tuple[tuple[int, ...], ...]
"""Block ids per prefix-cacheable group, aligned with ``CacheGeometry.group_ids``."""


def block_table_of(block_ids: Sequence[Sequence[int]], group_ids: Sequence[int]) -> BlockTable:
    """The table of ``group_ids`` from vLLM's per-group block lists (indexed by
    group id), copied: vLLM appends to its lists."""
    if len(group_ids) == 1:  # the usual model: no comprehension per request
        return (tuple(block_ids[group_ids[0]]),)
    return tuple([tuple(block_ids[group_id]) for group_id in group_ids])


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """The shape of the cache as lookups and plans see it; fixed for an engine.

    ``group_ids`` are the prefix-cacheable KV cache groups in vLLM's order;
    ``group_block_sizes`` (tokens per block, DCP-resolved) and ``lookup_units``
    (tokens between two probed objects, see :func:`lookup_unit`) align with them.
    ``block_size`` is the scheduler block size (the LCM of the group block sizes),
    ``hash_block_size`` the granularity of ``Request.block_hashes``.
    ``coordinated`` is true when vLLM's KV cache coordinator must decide the
    multi-group hit window (several groups, or one group that is not plain full
    attention).
    """

    group_ids: tuple[int, ...]
    group_block_sizes: tuple[int, ...]
    lookup_units: tuple[int, ...]
    block_size: int
    hash_block_size: int
    partial_hash_hits: bool = False
    use_eagle: bool = False
    coordinated: bool = False

    def __post_init__(self) -> None:
        count = len(self.group_ids)
        if len(self.group_block_sizes) != count or len(self.lookup_units) != count:
            raise ValueError(
                "group_ids, group_block_sizes and lookup_units must align: "
                f"{count}, {len(self.group_block_sizes)}, {len(self.lookup_units)} entries"
            )
        if len(set(self.group_ids)) != count:
            raise ValueError(f"group ids repeat: {self.group_ids}")
        if self.block_size <= 0 or self.hash_block_size <= 0:
            raise ValueError("block_size and hash_block_size must be positive")
        if self.block_size % self.hash_block_size:
            raise ValueError(
                f"hash_block_size {self.hash_block_size} must divide block_size {self.block_size}"
            )
        for group_id, size, unit in zip(self.group_ids, self.group_block_sizes, self.lookup_units):
            if unit <= 0 or unit % self.hash_block_size or size % unit:
                raise ValueError(
                    f"group {group_id}: lookup unit {unit} must be a multiple of "
                    f"hash_block_size {self.hash_block_size} and divide block size {size}"
                )
            if not self.coordinated and self.block_size % size:
                raise ValueError(
                    f"group {group_id}: block size {size} must divide the scheduler "
                    f"block size {self.block_size}"
                )

    @property
    def lookup_alignment(self) -> int:
        """A prompt shorter than this has no object worth looking up."""
        return self.hash_block_size if self.partial_hash_hits else self.block_size

    def position(self, group_id: int) -> int:
        """Index of ``group_id`` in ``group_ids`` (block tables align with it)."""
        return self.group_ids.index(group_id)


def lookup_unit(
    group_block_size: int,
    hash_block_size: int,
    partial_hash_hits: bool,
    coordinator_allows_partial: bool,
) -> int:
    """Tokens between two probed objects of one group.

    With partial hash hits (and a coordinator that can use them, or none), every
    hash boundary is probed so a saved partial tail can be found; otherwise only
    the group's own block ends.
    """
    if partial_hash_hits and coordinator_allows_partial:
        return hash_block_size
    return group_block_size



def needs_coordinator(group_count: int, single_group_is_full_attention: bool) -> bool:
    """Several cache groups, or one that is not plain full attention: vLLM's own
    coordinator decides the hit window from umbp's answers."""
    return group_count > 1 or (group_count == 1 and not single_group_is_full_attention)



def hashes_at_token_ends(
    hashes: Sequence[bytes], first_end: int, last_end: int, step: int, hash_block_size: int
) -> tuple[bytes, ...]:
    """Hashes ending at ``first_end, first_end + step, ...`` up to ``last_end``.

    One strided slice (no per-object Python work) when the ends are hash aligned,
    which they are for every caller that respects the lookup guards.
    """
    if first_end > last_end:
        return ()
    if first_end % hash_block_size or step % hash_block_size:
        raise ValueError(
            f"token ends {first_end} + k*{step} are not aligned to hash_block_size "
            f"{hash_block_size}"
        )
    count = (last_end - first_end) // step + 1
    start = first_end // hash_block_size - 1
    stride = step // hash_block_size
    stop = start + (count - 1) * stride + 1
    if start < 0 or stop > len(hashes):
        raise ValueError(f"request has {len(hashes)} hashes, needs indices {start}..{stop - 1}")
    return tuple(hashes[start:stop:stride])

