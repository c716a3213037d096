"""Residency answers folded over ranks: what one check of a KV-event batch says
about each object (resident only when every rank's shard is; on disk when any
shard is), as :func:`umbp.core.events.apply_residency` takes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from umbp.core.rank_keys import KeyLayout, fold_ranks

__all__ = ["fold_residency"]


def fold_residency(
    layout: KeyLayout,
    per_key: Sequence[bool | str | None],
    *,
    disk_medium: str,
    memory_medium: str,
) -> tuple[list[bool], list[str] | None] | None:
    """One residency batch's per-key answers (object-major, every rank's key of an
    object together: ``layout``) as :func:`apply_residency` takes them.

    An object is resident only when every rank's shard is; an answer is a bool
    (``lookup``) or the medium holding the shard, None for missing (a tiered
    store's ``where``). With media, an object's medium is ``disk_medium`` when any
    rank's shard is there (its load would read from disk), else ``memory_medium``;
    plain answers name no medium. None when the answer does not fit the layout:
    nothing is known, as after a failed check.
    """
    resident = fold_ranks(layout, [value is not None and value is not False for value in per_key])
    if resident is None:
        return None
    if not any(isinstance(value, str) for value in per_key):
        return list(resident[0]), None
    on_disk = fold_ranks(layout, [value == disk_medium for value in per_key], any)
    assert on_disk is not None  # the same length as the resident fold's
    return list(resident[0]), [disk_medium if disk else memory_medium for disk in on_disk[0]]
