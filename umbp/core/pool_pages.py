"""The embedded pool's page size, decided from the worker's object sizes."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DEFAULT_AUTO_PAGE_BYTES", "PAGE_ALIGN_BYTES", "auto_page_bytes", "pool_page_bytes"]


PAGE_ALIGN_BYTES = 4096
"""Pages are whole 4 KiB OS pages."""


DEFAULT_AUTO_PAGE_BYTES = 256 * 1024
"""The page size when the worker has no cache group to size it by."""


def auto_page_bytes(object_sizes: Sequence[int]) -> int:
    """One page per object of the smallest group, rounded up to 4 KiB: its objects
    waste no page space beyond the rounding, larger groups' objects span several
    pages (the pool stores an object on ceil(size / page) pages). Not sized for the
    largest object: a page that large would waste most of every smaller group's."""
    smallest = min(object_sizes) if object_sizes else DEFAULT_AUTO_PAGE_BYTES
    return max(PAGE_ALIGN_BYTES, -(-smallest // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES)


def pool_page_bytes(configured: int | None, object_sizes: Sequence[int]) -> int:
    """The embedded pool's page size: ``page_bytes`` when configured (validated with
    the config), otherwise :func:`auto_page_bytes` of the worker's objects."""
    return configured if configured is not None else auto_page_bytes(object_sizes)

