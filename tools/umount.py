"""``tierfs umount MNT``: unmount, then wait until the daemon has finished its shutdown, so
that when the command returns the data directory is clean and free for fsck or a new mount.
DATA may be given for MNT, as ``umount`` takes a device for its mount point.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

from tierfs.fs.errors import FsError
from tierfs.fs.mountlock import MountLock
from tierfs.tools.mountinfo import FSTYPE, mount_at, tierfs_mount_of


def unmount(mountpoint: Path, timeout: float = 120.0) -> None:
    found = mount_at(str(mountpoint))
    if found is None or found.fstype != FSTYPE:
        found = tierfs_mount_of(str(mountpoint)) or found  # DATA given for MNT
    if found is None:
        raise FsError(errno.EINVAL, f"{mountpoint} is not mounted")
    if found.fstype != FSTYPE:
        raise FsError(errno.EINVAL, f"{mountpoint} is not a tierfs mount ({found.fstype})")
    source = found.data_dir
    # The mount point as mounted: fusermount3 refuses a symlink to it (EINVAL).
    result = subprocess.run(["fusermount3", "-u", found.mount_point], capture_output=True,
                            text=True)
    if result.returncode != 0:
        message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        raise FsError(errno.EBUSY, f"cannot unmount {mountpoint}: {message}")
    lock = MountLock(Path(source))
    deadline = time.monotonic() + timeout
    while _serves(lock.holder(), found.mount_point):
        if time.monotonic() > deadline:
            raise FsError(errno.ETIMEDOUT,
                          f"unmounted, but the daemon has not finished after {timeout:g} s")
        time.sleep(0.05)


def _serves(holder: tuple[int, str] | None, mount_point: str) -> bool:
    """Whether the lock's holder is the daemon of this mount, so there is a shutdown to
    wait for. A dead mount (its daemon was killed) may be unmounted while its DATA is
    mounted elsewhere or being repaired: that holder will not let go for this unmount.
    An unreadable holder ("?") is waited for, as before there were names."""
    if holder is None:
        return False
    return holder[1] == "?" or os.path.realpath(holder[1]) == os.path.realpath(mount_point)
