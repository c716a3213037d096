"""The store contract and its back-ends (see `umbp.runtime.contract` for the contract).

`SlabPool` is the embedded DRAM tier: a prefaulted, paged slab with LRU eviction and a
checksum on every object.
"""

from umbp.runtime.contract import (
    LoadStatus,
    PoolStats,
    SchedulerStore,
    StoreUnavailable,
    WorkerStore,
)
from umbp.runtime.pool import SlabPool

__all__ = [
    "LoadStatus",
    "PoolStats",
    "SchedulerStore",
    "SlabPool",
    "StoreUnavailable",
    "WorkerStore",
]
