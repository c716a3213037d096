"""A request's ask that the store keep its blocks, and the keys of what it asks for.

A request asks through vLLM's ``kv_transfer_params`` (``vllm serve``'s request body, or
``SamplingParams.extra_args``)::

    {"kv_transfer_params": {"umbp": {"retain_s": 3600}}}

When the request finishes, the scheduler asks the store to keep every object the
request's blocks name, on every rank, for ``retain_s`` seconds (the store bounds the
time and the bytes: docs/operations.md). Other connectors' entries in
```kv_transfer_params`` are theirs; an ``umbp`` entry that breaks its rules
(:mod:`umbp.core.request_params`) is refused with a sentence (and nothing is retained).
"""

from __future__ import annotations

from collections.abc import Sequence

from returns.result import Result

from umbp.core.geometry import CacheGeometry, hashes_at_token_ends
from umbp.core.identity import KeySpace
from umbp.core.request_params import MAX_RETAIN_S, request_params

__all__ = ["MAX_RETAIN_S", "requested_retention", "retention_keys"]


def requested_retention(params: object) -> Result[float | None, str]:
    """The seconds a request asks its blocks be kept: None when it asks nothing, a
    Failure naming the problem when umbp's entry breaks its rules
    (:func:`umbp.core.request_params.request_params`)."""
    return request_params(params).map(lambda asked: asked.retain_s)


def retention_keys(
    geometry: CacheGeometry, keyspace: KeySpace, hashes: Sequence[bytes]
) -> tuple[str, ...]:
    """Every rank's key of every object a request's ``hashes`` name: per cache group,
    the objects at each of its lookup units' ends that the hashes cover. A replica
    run's one key is named once."""
    covered = len(hashes) * geometry.hash_block_size
    ranks = keyspace.topology.coords()
    keys: list[str] = []
    for group_id, unit in zip(geometry.group_ids, geometry.lookup_units):
        objects = hashes_at_token_ends(hashes, unit, covered // unit * unit, unit,
                                       geometry.hash_block_size)
        keys.extend(keyspace.key(rank, group_id, block_hash)
                    for rank in ranks for block_hash in objects)
    return tuple(dict.fromkeys(keys))
