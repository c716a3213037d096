"""The embedded deployment: each worker owns a ``SlabPool`` for its rank's
shards, inside its own process, so the memory goes away with the engine.

The scheduler reaches a worker's pool directly when both live in one process
(vLLM's single-worker executor) and through a ``LookupService`` otherwise. The
process-wide registry below is how the scheduler-role connector finds the pool
its worker-role sibling created.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from umbp.core.rank_keys import HashRuns
from umbp.runtime.contract import SchedulerStore
from umbp.runtime.lookup_service import LookupClient, LookupService
from umbp.runtime.pool import SlabPool

_POOLS: dict[str, SlabPool] = {}
_POOLS_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class PoolAddress:
    """How another process or role finds one worker's pool."""

    token: str
    pid: int
    socket_path: str | None


@dataclass(slots=True)
class EmbeddedPool:
    pool: SlabPool
    address: PoolAddress
    service: LookupService | None

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
        with _POOLS_LOCK:
            _POOLS.pop(self.address.token, None)
        self.pool.close()


def open_embedded_pool(pool: SlabPool, serve_other_processes: bool) -> EmbeddedPool:
    token = uuid.uuid4().hex
    with _POOLS_LOCK:
        _POOLS[token] = pool
    service = LookupService(pool) if serve_other_processes else None
    address = PoolAddress(token, os.getpid(), None if service is None else service.path)
    return EmbeddedPool(pool, address, service)


def connect_to_pool(address: PoolAddress, timeout_s: float) -> SchedulerStore:
    """The pool itself when it lives in this process, else a socket client."""
    if address.pid == os.getpid():
        with _POOLS_LOCK:
            pool = _POOLS.get(address.token)
        if pool is not None:
            return _Borrowed(pool)
    if address.socket_path is None:
        raise RuntimeError(
            "umbp embedded pool lives in another process that serves no lookups; "
            "this is a bug in umbp's executor detection"
        )
    return LookupClient(address.socket_path, timeout_s)


class _Borrowed:
    """The scheduler's view of a pool its worker owns: closing the view must not
    close the pool. Answers by hash too (`HashLookup`), as the pool does."""

    batch_limit: int | None = None
    """No limit, as the pool itself."""

    def __init__(self, pool: SlabPool) -> None:
        self._pool = pool

    def lookup(self, keys: Sequence[str]) -> tuple[bool, ...]:
        return self._pool.lookup(keys)

    def lookup_hashes(self, runs: HashRuns) -> tuple[bool, ...]:
        return self._pool.lookup_hashes(runs)

    def clear(self) -> bool:
        return self._pool.clear()

    def close(self) -> None:
        return None


def local_pools() -> tuple[SlabPool, ...]:
    with _POOLS_LOCK:
        return tuple(_POOLS.values())
