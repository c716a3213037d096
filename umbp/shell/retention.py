"""Retention from a request: when a request that asked (``kv_transfer_params``
``{"umbp": {"retain_s": N}}``, :mod:`umbp.core.retention`) finishes, ask the store to
keep its blocks' objects for that long.

The scheduler reads the ask when vLLM reports the request finished
(:meth:`RequestRetention.wanted`) and makes it (:meth:`RequestRetention.ask`) once no
store of the request is in flight (the workers store after each step, so the last
step's objects may not be there yet when the request finishes). The ask goes to the
store on the scheduler's lookup threads, never on the scheduler's own. A store
without retention (`Retains`: the embedded pool, Mooncake, MORI) is warned about once;
a refusal (over the namespace's budget, longer than the server allows) is logged with
the store's reason. Neither costs the request anything: it has finished.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor
from dataclasses import dataclass

from returns.result import Failure

from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace
from umbp.core.retention import requested_retention, retention_keys
from umbp.runtime.contract import Retains, SchedulerStore, StoreRefused, StoreUnavailable
from umbp.shell.vllm_compat.objects import RequestLike

__all__ = ["RequestRetention", "RetentionCounters"]

logger = logging.getLogger("umbp")


@dataclass(slots=True)
class RetentionCounters:
    asked: int = 0
    """Finished requests that asked for retention."""
    answered: int = 0
    """Of them, those the store has answered (retained, refused or unreachable)."""
    objects_retained: int = 0
    """Objects the store keeps for them (newly, or for longer)."""
    refused: int = 0
    """Asks refused: a bad ``umbp`` entry, or the store's limits."""


class RequestRetention:
    def __init__(self, geometry: CacheGeometry, executor: Executor) -> None:
        self._geometry = geometry
        self._executor = executor
        self._lock = threading.Lock()
        self._warned_store = False
        self.counters = RetentionCounters()

    def wanted(self, request: RequestLike) -> float | None:
        """The seconds the finished request asks its blocks be kept (None: nothing;
        a malformed ask is logged and counted as refused)."""
        asked = requested_retention(request.kv_transfer_params)
        if isinstance(asked, Failure):
            logger.warning("umbp: request %s: %s; nothing retained", request.request_id,
                           asked.failure())
            self._count(refused=1)
            return None
        return asked.unwrap()

    def ask(
        self, request_id: str, hashes: tuple[bytes, ...], seconds: float,
        store: SchedulerStore | None, keyspace: KeySpace | None,
    ) -> None:
        """Ask the store, on the lookup threads, to keep the request's objects (its
        stores must have landed: the scheduler calls this once none is in flight)."""
        if store is None or keyspace is None:
            return
        self._count(asked=1)
        if not isinstance(store, Retains):
            self._count(answered=1)
            if not self._warned_store:
                self._warned_store = True
                logger.warning("umbp: requests ask to retain their blocks, but this mode's "
                               "store cannot retain (mode 'server' can); nothing is retained")
            return
        keys = retention_keys(self._geometry, keyspace, hashes)
        if keys:
            self._executor.submit(self._retain, store, request_id, keys, seconds)
        else:
            self._count(answered=1)

    def _retain(self, store: Retains, request_id: str, keys: tuple[str, ...],
                seconds: float) -> None:
        try:
            answer = store.retain(keys, seconds)
        except StoreRefused as error:
            logger.warning("umbp: the store refused to retain request %s's blocks: %s",
                           request_id, error)
            self._count(answered=1, refused=1)
        except StoreUnavailable as error:
            logger.warning("umbp: request %s's blocks not retained: %s", request_id, error)
            self._count(answered=1)
        else:
            self._count(answered=1, retained=answer.retained + answer.extended)
            logger.debug("umbp: request %s: %d objects retained for %g s, %d not held",
                         request_id, answer.retained + answer.extended, seconds,
                         answer.not_retained)

    def _count(self, asked: int = 0, answered: int = 0, retained: int = 0,
               refused: int = 0) -> None:
        with self._lock:
            self.counters.asked += asked
            self.counters.answered += answered
            self.counters.objects_retained += retained
            self.counters.refused += refused
