"""Who serves at a socket path: the one process holding an flock on `<socket>.owner`.

(Not `<socket>.lock`: that one is the connector's auto_start lock, held while it starts a
server, which must then be able to take this one.)

A connect probe cannot decide this (a live server that is stopped, or whose accept
backlog is full, does not answer, and deleting its socket and pool would orphan every
client). The lock can: the kernel drops it when its holder dies, however it dies, and
never while it lives. So a server takes the lock first and only then looks at what is
at the socket path; holding it, whatever it finds there was left by a dead holder, and
it removes only what is provably that: a socket of this user's at the path, and the
shared-memory file named in `<socket>.pool` when that file is this user's and no live
server holds it locked (`remove_stale_pool`). Anything else (a regular file at the socket
path, a symlink, another user's file) is refused with a message, never deleted.

The lock file stays after shutdown (removing a lock file lets two processes hold "the"
lock on two different files); it holds the holder's pid, for the refusal message only.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat

from umbp.runtime.private_files import UnsafePath, open_private_file, prepare_directory
from umbp.runtime.server.pool_mount import pool_mount
from umbp.runtime.server.shm import remove_stale_pool

__all__ = ["OWNER_SUFFIX", "AlreadyServed", "SocketOwnership"]

logger = logging.getLogger("umbp.serve")

_POOL_FILE_NAME = re.compile(r"^umbp-\d+-[0-9a-f]+$")
_RECORD_LIMIT = 4096
OWNER_SUFFIX = ".owner"


class AlreadyServed(RuntimeError):
    """Another live process holds the socket path's lock."""


class SocketOwnership:
    """The lock on one socket path, and the clean-up only its holder may do."""

    def __init__(self, socket_path: str, lock_fd: int) -> None:
        self.socket_path = socket_path
        self._lock_fd = lock_fd
        self._socket_inode: tuple[int, int] | None = None

    @property
    def lock_path(self) -> str:
        return self.socket_path + OWNER_SUFFIX

    @property
    def record_path(self) -> str:
        return self.socket_path + ".pool"

    # -------------------------------------------------------------- acquiring

    @classmethod
    def acquire(cls, socket_path: str) -> SocketOwnership:
        """Take the lock (the socket's directory is created 0700 or checked first);
        raises `AlreadyServed` naming the holder, or `UnsafePath`."""
        ownership = cls.try_acquire(socket_path)
        if ownership is None:
            holder = _read_pid(socket_path + OWNER_SUFFIX)
            raise AlreadyServed(
                f"another umbp serve{f' (pid {holder})' if holder else ''} owns {socket_path}; "
                "stop it first or choose another --socket"
            )
        return ownership

    @classmethod
    def try_acquire(cls, socket_path: str) -> SocketOwnership | None:
        prepare_directory(os.path.dirname(socket_path) or ".", "socket directory")
        path = socket_path + OWNER_SUFFIX
        fd = open_private_file(path, os.O_RDWR | os.O_CREAT, "owner lock file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(socket_path, fd)

    # --------------------------------------------------------------- clean-up

    def clear_leftovers(self, strict: bool = True) -> None:
        """Remove what a dead holder left: its socket and its pool file. With `strict`
        anything at the socket path that is not such a socket is refused (`UnsafePath`);
        without, it is left alone and logged (for a best-effort clean-up after tests)."""
        try:
            self._remove_stale_socket()
        except UnsafePath:
            if strict:
                raise
            logger.warning("umbp serve: left %s alone: not a socket of ours", self.socket_path)
        self._remove_recorded_pool()

    def _remove_stale_socket(self) -> None:
        try:
            info = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
            raise UnsafePath(
                f"{self.socket_path} exists and is not a socket left by a umbp server of "
                "yours; remove it yourself or choose another --socket"
            )
        os.unlink(self.socket_path)

    def _remove_recorded_pool(self) -> None:
        recorded = self._read_record()
        if recorded is not None and _names_a_pool(recorded):
            if remove_stale_pool(recorded):
                logger.info("umbp serve: removed %s, left by a dead server", recorded)
            else:
                logger.warning(
                    "umbp serve: %s names %s, which is not a dead server's pool of yours; "
                    "left alone", self.record_path, recorded,
                )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.record_path)  # a symlink is unlinked, never followed

    def _read_record(self) -> str | None:
        try:
            fd = open_private_file(self.record_path, os.O_RDONLY, "pool record")
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("umbp serve: ignoring %s: %s", self.record_path, error)
            return None
        try:
            raw = os.read(fd, _RECORD_LIMIT)
        finally:
            os.close(fd)
        try:
            return raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            logger.warning("umbp serve: ignoring %s: not UTF-8", self.record_path)
            return None

    # ----------------------------------------------------------- the holder's

    def record_pool(self, pool_path: str) -> None:
        """Name the live pool beside the socket, for the next holder after a kill."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.record_path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = open_private_file(self.record_path, flags, "pool record")
        with os.fdopen(fd, "w") as out:
            out.write(pool_path + "\n")

    def bound(self) -> None:
        """Remember the socket just bound, so that release removes that one only."""
        info = os.lstat(self.socket_path)
        self._socket_inode = (info.st_dev, info.st_ino)

    def release(self) -> None:
        """Remove our socket (if it is still the one we bound) and record; drop the lock."""
        if self._socket_inode is not None:
            with contextlib.suppress(OSError):
                info = os.lstat(self.socket_path)
                if (info.st_dev, info.st_ino) == self._socket_inode:
                    os.unlink(self.socket_path)
        with contextlib.suppress(OSError):
            os.unlink(self.record_path)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def _read_pid(lock_path: str) -> int | None:
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 32).decode(errors="replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


def _names_a_pool(path: str) -> bool:
    """Whether a recorded path can be a pool file a server made: an absolute path to a
    file named as `create_shared_pool` names them, in a directory on a tmpfs (where
    `--pool-dir` may put one)."""
    if not os.path.isabs(path) or not _POOL_FILE_NAME.match(os.path.basename(path)):
        return False
    try:
        pool_mount(os.path.dirname(path))
    except (ValueError, OSError):  # OSError: UnsafePath, or the directory is gone
        return False
    return True
