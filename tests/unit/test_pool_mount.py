"""Which mount a pool directory lies on, whether a pool there gets huge pages, and the
directories `umbp serve --pool-dir` refuses (a real `umbp serve` on a pool directory:
tests/integration/test_server_process.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from umbp.runtime.server.pool_mount import PoolMount, mount_of, pool_mount

MOUNTINFO = """\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
30 22 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,size=24683792k,inode64
41 22 0:40 / /mnt/umbp\\040pool rw,relatime shared:20 - tmpfs none rw,size=2097152k,huge=within_size
42 22 0:41 / /mnt/advised rw,relatime shared:21 - tmpfs none rw,size=1048576k,huge=advise
43 22 0:42 / /mnt/umbp rw,relatime shared:22 - tmpfs none rw,size=1048576k
44 43 0:43 / /mnt/umbp rw,relatime shared:23 - tmpfs none rw,size=1048576k,huge=always
45 22 0:44 / /dev/hugepages rw,relatime shared:24 - hugetlbfs hugetlbfs rw,pagesize=2M
"""


@pytest.mark.parametrize(
    ("directory", "point", "fstype", "huge", "huge_pages"),
    [
        ("/dev/shm", "/dev/shm", "tmpfs", "never", False),
        ("/dev/shm/pools/a", "/dev/shm", "tmpfs", "never", False),
        ("/mnt/umbp pool/x", "/mnt/umbp pool", "tmpfs", "within_size", True),
        ("/mnt/advised", "/mnt/advised", "tmpfs", "advise", False),
        ("/mnt/umbp", "/mnt/umbp", "tmpfs", "always", True),  # the later of two mounts there
        ("/mnt/umbpx", "/", "ext4", "never", False),  # a name that only starts like a mount
        ("/dev/hugepages", "/dev/hugepages", "hugetlbfs", "never", False),
    ],
)  # fmt: skip
def test_the_deepest_mount_holds_a_directory_and_its_huge_option_decides(
    directory: str, point: str, fstype: str, huge: str, huge_pages: bool
) -> None:
    mount = mount_of(directory, MOUNTINFO)
    assert mount is not None
    assert (mount.mount_point, mount.fstype, mount.huge_policy, mount.huge_pages) == (
        point, fstype, huge, huge_pages)


def test_a_huge_option_on_a_filesystem_other_than_tmpfs_gives_no_huge_pages() -> None:
    assert not PoolMount("/x", "ramfs", ("rw", "huge=always")).huge_pages
    assert PoolMount("/x", "tmpfs", ("rw", "huge=always")).huge_pages


def test_no_mount_line_names_no_mount() -> None:
    assert mount_of("/anything", "") is None
    assert mount_of("/anything", "not a mountinfo line\n") is None


def test_dev_shm_is_accepted_and_its_mount_read_from_this_machine() -> None:
    mount = pool_mount("/dev/shm")
    assert (mount.fstype, mount.mount_point) == ("tmpfs", "/dev/shm")
    assert mount.huge_pages == (mount.huge_policy in ("always", "within_size"))


def test_a_directory_not_on_a_tmpfs_is_refused_naming_what_it_is_on() -> None:
    with pytest.raises(ValueError, match=r"'/proc' must be on a tmpfs, found proc at /proc"):
        pool_mount("/proc")


def test_a_missing_directory_or_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        pool_mount(str(tmp_path / "absent"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        pool_mount(str(tmp_path / "file"))


def test_a_recorded_pool_path_is_trusted_only_as_a_pool_file_name_on_a_tmpfs() -> None:
    """What a restarted server may delete after a kill (`<socket>.pool` names it): never a
    file elsewhere, whatever the record says."""
    from umbp.runtime.server.ownership import _names_a_pool

    assert _names_a_pool("/dev/shm/umbp-123-0a1b2c3d4e5f")
    assert not _names_a_pool("/proc/umbp-123-0a1b2c3d4e5f")  # not on a tmpfs
    assert not _names_a_pool("/dev/shm/absent-dir/umbp-123-0a1b2c3d4e5f")
    assert not _names_a_pool("/dev/shm/umbp-123-0a1b2c3d4e5f.bak")
    assert not _names_a_pool("/dev/shm/someone-elses-file")
    assert not _names_a_pool("umbp-123-0a1b2c3d4e5f")  # relative


def test_a_pool_directory_others_may_write_to_is_refused() -> None:
    """Clients map the pool by its path: another user who could rename files in the
    directory (not sticky) could put their own file there under that name."""
    from umbp.runtime.private_files import UnsafePath

    shared = Path(tempfile.mkdtemp(prefix="umbp-open-", dir="/dev/shm"))
    try:
        os.chmod(shared, 0o777)
        with pytest.raises(UnsafePath, match="writable by other users"):
            pool_mount(str(shared))
        os.chmod(shared, 0o1777)  # sticky, as /dev/shm itself
        assert pool_mount(str(shared)).fstype == "tmpfs"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
