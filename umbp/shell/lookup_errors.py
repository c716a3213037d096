"""How the scheduler reports a store lookup that raised (admission's and the
store step's residency check): any exception is an unanswered lookup, so a
miss or "nothing known resident" (docs/failure-behaviour.md). umbp must never
be the reason a request fails, so the call sites catch everything; what differs
is how loudly.
"""

from __future__ import annotations

import logging
from concurrent.futures import CancelledError

from umbp.runtime.contract import StoreUnavailable

__all__ = ["log_failed_lookup"]

logger = logging.getLogger("umbp")

# What a lookup is expected to raise: the contract's one exception (the back-end
# cannot be reached), a socket's error, and a lookup thread's future cancelled at
# shut-down. Anything else is a back-end breaking the store contract.
_EXPECTED = (StoreUnavailable, OSError, CancelledError)


def log_failed_lookup(what: str, error: Exception) -> None:
    """A debug line for an expected failure; a warning naming the exception for
    one that breaks the contract (it is a bug somewhere, and must be seen)."""
    if isinstance(error, _EXPECTED):
        logger.debug("umbp %s failed: %s", what, error)
    else:
        logger.warning("umbp %s raised %s (a store breaking its contract), counted as "
                       "unanswered: %s", what, type(error).__name__, error)
