"""What a worker's stores leave unwritten: the plans it does not store this step, and
the objects a store did not write (neither is announced in KV events)."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from umbp.core.identity import ObjectId
from umbp.core.plans import StorePlan

__all__ = ["failed_store_identities", "stores_past_failed_loads"]


def failed_store_identities(
    identities: Sequence[ObjectId], stored: Sequence[bool] | None
) -> frozenset[ObjectId]:
    """The objects a group's store did not write. ``stored`` None (the group could
    not be written) or an answer of another length than the keys (a store breaking
    its contract) fails them all: an object reported stored that is not would be
    published in KV events and never stored again."""
    if stored is None or len(stored) != len(identities):
        return frozenset(identities)
    return frozenset(identity for identity, ok in zip(identities, stored) if not ok)


def stores_past_failed_loads(
    stores: Sequence[StorePlan], computed_over_failures: AbstractSet[str]
) -> tuple[tuple[StorePlan, ...], frozenset[ObjectId]]:
    """The step's store plans without those of the requests
    :func:`still_computing_over_failures` names, and the identities left out. A
    put of a resident key writes nothing, so a wrong object stored once would be
    served until evicted; vLLM recomputes those blocks and the scheduler plans
    them again (:func:`umbp.core.loads.failures.after_failed_load`). The
    identities count as not stored: no KV event announces them."""
    if not computed_over_failures:
        return tuple(stores), frozenset()
    kept = tuple(p for p in stores if p.request_id not in computed_over_failures)
    dropped = frozenset(
        identity
        for plan in stores if plan.request_id in computed_over_failures
        for identity in plan.identities()
    )
    return kept, dropped

