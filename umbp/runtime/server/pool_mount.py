"""Where the server's DRAM tier may live, and whether its pages there are huge.

The pool is a file on a tmpfs that every client maps: `/dev/shm`, or the directory
`umbp serve --pool-dir` names (a container's small `/dev/shm`, a size-limited tmpfs of
its own, huge pages). A tmpfs gives its files transparent huge pages (2 MiB) only when it
is mounted with ``huge=always`` or ``huge=within_size`` (``huge=advise`` would need the
pool's pages allocated through a mapping; `umbp serve` allocates them with
``posix_fallocate``), and ``/dev/shm`` is mounted without a ``huge=`` option on common
distributions: there the pool is on 4 KiB pages. Copies into and out of a pool on huge
pages measured faster (docs/performance.md, "The DRAM tier on huge pages"); the
`populated` start-up event says which pages the pool got.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from umbp.runtime.private_files import check_private_directory

__all__ = ["HUGE_PAGE_POLICIES", "PoolMount", "mount_of", "pool_mount"]

HUGE_PAGE_POLICIES = frozenset({"always", "within_size"})
"""tmpfs ``huge=`` values under which a file allocated with posix_fallocate gets huge
pages (where the kernel has free 2 MiB pages to give)."""

_MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class PoolMount:
    """The mount a pool directory lies on."""

    mount_point: str
    fstype: str
    options: tuple[str, ...]
    """Its per-superblock options (``size=...``, ``huge=...``)."""

    @property
    def huge_policy(self) -> str:
        """Its ``huge=`` option ("never" when it has none)."""
        for option in self.options:
            name, _, value = option.partition("=")
            if name == "huge":
                return value
        return "never"

    @property
    def huge_pages(self) -> bool:
        """Whether a pool allocated here gets transparent huge pages."""
        return self.fstype == "tmpfs" and self.huge_policy in HUGE_PAGE_POLICIES


def mount_of(directory: str, mountinfo: str) -> PoolMount | None:
    """The mount (from the text of a ``/proc/<pid>/mountinfo``) that holds the absolute,
    resolved path `directory`: the one with the longest mount point above it, the last
    mounted where several share that point. None when no line names one."""
    best: PoolMount | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        separator = fields.index("-")
        if separator < 5 or len(fields) < separator + 4:
            continue
        point = _unescape(fields[4])
        if not _contains(point, directory):
            continue
        if best is None or len(point) >= len(best.mount_point):
            best = PoolMount(point, fields[separator + 1],
                             tuple(fields[separator + 3].split(",")))
    return best


def pool_mount(directory: str) -> PoolMount:
    """The mount of the pool directory `directory`, checked: it must exist, be this user's
    or root's and writable by nobody else unless sticky (`check_private_directory`: clients
    map the pool by its path), and be on a tmpfs (a disk filesystem would write the pool
    back to disk; hugetlbfs needs sizes in whole huge pages, which the pool does not
    keep). Raises ValueError, or `UnsafePath` for the ownership rules, naming the problem."""
    resolved = os.path.realpath(directory)
    if not os.path.isdir(resolved):
        raise ValueError(f"pool directory {directory!r} is not a directory")
    check_private_directory(resolved, "pool directory")
    try:
        with open(_MOUNTINFO, encoding="utf-8") as stream:
            mount = mount_of(resolved, stream.read())
    except OSError as error:
        raise ValueError(f"cannot tell the filesystem of pool directory {directory!r}: "
                         f"{error}") from error
    if mount is None or mount.fstype != "tmpfs":
        found = "no mount" if mount is None else f"{mount.fstype} at {mount.mount_point}"
        raise ValueError(
            f"pool directory {directory!r} must be on a tmpfs, found {found} "
            "(e.g. mount -t tmpfs -o huge=within_size,size=<bytes> none <dir>)"
        )
    return mount


def _contains(mount_point: str, path: str) -> bool:
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for escaped, plain in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escaped, plain)
    return field
