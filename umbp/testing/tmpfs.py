"""A real, small tmpfs for full-disk tests (mounting needs root, as CI runs)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class CannotMount(RuntimeError):
    """This machine (or this user) cannot mount a tmpfs: the test that needs one skips."""


@contextmanager
def small_tmpfs(mount_point: Path, size: str, *, mode: str = "0700") -> Iterator[Path]:
    """Mount a `size` tmpfs at `mount_point` (made 0700) for the block's duration;
    unmounted after, lazily if a failed test still holds a file open there, so no
    mount is ever left behind."""
    mount_point.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(mount_point)],
        capture_output=True, text=True, check=False,
    )
    if mounted.returncode != 0:
        raise CannotMount(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)
