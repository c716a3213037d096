"""Files and directories that only this user may touch: the server's socket directory,
its lock and pool record, the SSD tier's directory and slot file.

The rules (docs/operations.md, "Threat model"): a directory must belong to this user
(or root) and must not be writable by group or others unless it is sticky (like /tmp,
where nobody can rename or delete another's entries); a file is opened without following
symlinks, must be a regular file of this user's, readable and writable by nobody else,
and is created 0600. Every refusal is an `UnsafePath` whose message says in one
sentence what is wrong and what to do.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["UnsafePath", "check_private_directory", "open_private_file", "prepare_directory"]


class UnsafePath(PermissionError):
    """A path another user owns or could change; nothing was read or written there."""


def prepare_directory(path: str | os.PathLike[str], purpose: str) -> Path:
    """`path` as a directory fit for private files: created 0700 (with its parents) when
    missing, checked with `check_private_directory` when present."""
    directory = Path(path)
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)  # mkdir's mode passes through the umask
    check_private_directory(directory, purpose)
    return directory


def check_private_directory(directory: str | os.PathLike[str], purpose: str) -> None:
    info = os.stat(directory)  # a symlinked directory (/var/run -> /run) is judged by its target
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(f"the {purpose} {directory} is not a directory; give a directory")
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        raise UnsafePath(
            f"the {purpose} {directory} belongs to uid {info.st_uid}, not to you (uid {me}); "
            "use a directory you own"
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            f"the {purpose} {directory} is writable by other users "
            f"(mode {stat.S_IMODE(info.st_mode):04o}); run chmod go-w on it or use a private one"
        )


def open_private_file(path: str | os.PathLike[str], flags: int, purpose: str) -> int:
    """A descriptor for `path` (opened with `flags` plus O_NOFOLLOW and O_CLOEXEC; a file
    that O_CREAT makes is 0600). Refuses a symlink, anything but a regular file, a file
    of another user's, and one that group or others may read or write."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        # ELOOP from O_NOFOLLOW; EACCES where fs.protected_symlinks refuses another user's
        # link in a sticky directory before O_NOFOLLOW is looked at.
        if error.errno == errno.ELOOP or _is_symlink(path):
            raise UnsafePath(
                f"the {purpose} {path} is a symbolic link; remove it (umbp never follows one)"
            ) from None
        raise
    try:
        check_private_descriptor(fd, path, purpose)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private_descriptor(fd: int, path: str | os.PathLike[str], purpose: str) -> None:
    info = os.fstat(fd)
    me = os.geteuid()
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePath(f"the {purpose} {path} is not a regular file; remove it")
    if info.st_uid != me:
        raise UnsafePath(
            f"the {purpose} {path} belongs to uid {info.st_uid}, not to you (uid {me}); "
            "remove it (its contents cannot be trusted)"
        )
    if info.st_mode & 0o077:
        raise UnsafePath(
            f"the {purpose} {path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}); "
            "run chmod 600 on it if its contents are yours, else remove it"
        )


def _is_symlink(path: str | os.PathLike[str]) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False
