"""Whether a request is looked up at all, and how far a lookup may probe."""

from __future__ import annotations

import enum

from umbp.core.geometry import CacheGeometry

__all__ = ["LookupSkip", "lookup_limit", "lookup_skip_reason"]


class LookupSkip(enum.Enum):
    """Why a request is not looked up at all (each answers ``0, False``)."""

    DISABLED = "lookup disabled"
    NO_HASHES = "request has no block hashes"
    PROMPT_SHORTER_THAN_ALIGNMENT = "request is shorter than one lookup alignment"
    LOCAL_NOT_BLOCK_ALIGNED = "locally computed tokens are not block aligned"
    NO_CACHEABLE_GROUPS = "no prefix-cacheable KV cache group"
    NO_TOKEN_LEFT_TO_LOAD = "every token but the last is already local"


def lookup_skip_reason(
    geometry: CacheGeometry,
    enabled: bool,
    num_hashes: int,
    num_tokens: int,
    local_tokens: int,
) -> LookupSkip | None:
    """The first guard that rules out a lookup, in the reference's order, or None.

    ``enabled`` folds together the user's switch and the runtime being bound.
    On any skip the caller also forgets an earlier load spec of the request: the
    answer is then 0 tokens, so an older window no longer describes what vLLM
    allocates (the reference forgets it only on ``NO_TOKEN_LEFT_TO_LOAD``).
    """
    if not enabled:
        return LookupSkip.DISABLED
    if num_hashes <= 0:
        return LookupSkip.NO_HASHES
    if num_tokens < geometry.lookup_alignment:
        return LookupSkip.PROMPT_SHORTER_THAN_ALIGNMENT
    if local_tokens % geometry.block_size:
        return LookupSkip.LOCAL_NOT_BLOCK_ALIGNED
    if not geometry.group_ids:
        return LookupSkip.NO_CACHEABLE_GROUPS
    # vLLM must execute at least the final prompt token.
    if num_tokens - 1 <= local_tokens:
        return LookupSkip.NO_TOKEN_LEFT_TO_LOAD
    return None


def lookup_limit(geometry: CacheGeometry, num_tokens: int, num_hashes: int) -> int:
    """The last token end worth probing.

    ``num_tokens - 1`` (the last token is always computed), except that with EAGLE
    the coordinator must see the block that ends at the prompt's end: it matches it
    and then drops back a block itself. Never past the hashes' coverage, since an
    object without a hash has no identity.
    """
    covered = num_hashes * geometry.hash_block_size
    if geometry.use_eagle and geometry.coordinated:
        return min(num_tokens, covered)
    return min(num_tokens - 1, covered)

