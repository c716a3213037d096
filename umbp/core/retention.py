"""A request's ask that the store keep its blocks, and the keys of what it asks for.

A request asks through vLLM's ``kv_transfer_params`` (``vllm serve``'s request body, or
``SamplingParams.extra_args``)::

    {"kv_transfer_params": {"umbp": {"retain_s": 3600}}}

When the request finishes, the scheduler asks the store to keep every object the
request's blocks name, on every rank, for ``retain_s`` seconds (the store bounds the
time and the bytes: docs/operations.md). Other connectors' entries in
``kv_transfer_params`` are theirs; an ``umbp`` entry that breaks the rule below is
refused with a sentence (and nothing is retained).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

from returns.result import Failure, Result, Success

from umbp.core.geometry import CacheGeometry, hashes_at_token_ends
from umbp.core.identity import KeySpace

__all__ = ["MAX_RETAIN_S", "RETENTION_ENTRY", "requested_retention", "retention_keys"]

RETENTION_ENTRY: Final = "umbp"
"""umbp's entry in ``kv_transfer_params``."""
MAX_RETAIN_S: Final = 1e7
"""The longest retention a request may write (a store allows at most its own longest)."""
_FIELDS: Final = ("retain_s",)


def requested_retention(params: object) -> Result[float | None, str]:
    """The seconds a request asks its blocks be kept: None when it asks nothing (no
    ``umbp`` entry), a Failure naming the problem when the entry breaks its rule
    (an object with exactly ``retain_s``, a number in (0, ``MAX_RETAIN_S``])."""
    if not isinstance(params, Mapping) or RETENTION_ENTRY not in params:
        return Success(None)
    entry = params[RETENTION_ENTRY]
    if not isinstance(entry, Mapping):
        return Failure(f"kv_transfer_params {RETENTION_ENTRY!r} must be an object such as "
                       f'{{"retain_s": 3600}}, got {type(entry).__name__}')
    unknown = sorted(str(name) for name in entry if name not in _FIELDS)
    if unknown or "retain_s" not in entry:
        return Failure(f"kv_transfer_params {RETENTION_ENTRY!r} takes exactly "
                       f"{list(_FIELDS)}, got {sorted(map(str, entry))}")
    seconds = entry["retain_s"]
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not math.isfinite(seconds) or not 0 < seconds <= MAX_RETAIN_S:
        return Failure(f"kv_transfer_params {RETENTION_ENTRY!r} retain_s must be a number of "
                       f"seconds in (0, {MAX_RETAIN_S:g}], got {seconds!r:.40}")
    return Success(float(seconds))


def retention_keys(
    geometry: CacheGeometry, keyspace: KeySpace, hashes: Sequence[bytes]
) -> tuple[str, ...]:
    """Every rank's key of every object a request's ``hashes`` name: per cache group,
    the objects at each of its lookup units' ends that the hashes cover."""
    covered = len(hashes) * geometry.hash_block_size
    ranks = keyspace.topology.coords()
    keys: list[str] = []
    for group_id, unit in zip(geometry.group_ids, geometry.lookup_units):
        objects = hashes_at_token_ends(hashes, unit, covered // unit * unit, unit,
                                       geometry.hash_block_size)
        keys.extend(keyspace.key(rank, group_id, block_hash)
                    for rank in ranks for block_hash in objects)
    return tuple(keys)
