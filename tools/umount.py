"""``tierfs umount MNT``: unmount, then wait until the daemon has finished its shutdown, so
that when the command returns the data directory is clean and free for fsck or a new mount.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

from tierfs.fs.errors import FsError
from tierfs.fs.mountlock import MountLock


def find_mount(mountpoint: Path) -> tuple[str, str] | None:
    """(fstype, source) of the mount at ``mountpoint`` from /proc/self/mountinfo."""
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            mount_point = fields[4].replace("\\040", " ")
            if mount_point == target:
                fstype, source = right.split()[:2]
                return fstype, source.replace("\\040", " ")
    return None


def unmount(mountpoint: Path, timeout: float = 120.0) -> None:
    found = find_mount(mountpoint)
    if found is None:
        raise FsError(errno.EINVAL, f"{mountpoint} is not mounted")
    fstype, source = found
    if fstype != "fuse.tierfs":
        raise FsError(errno.EINVAL, f"{mountpoint} is not a tierfs mount ({fstype})")
    result = subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        raise FsError(errno.EBUSY, f"cannot unmount {mountpoint}: {message}")
    lock = MountLock(Path(source))
    deadline = time.monotonic() + timeout
    while lock.holder() is not None:
        if time.monotonic() > deadline:
            raise FsError(errno.ETIMEDOUT,
                          f"unmounted, but the daemon has not finished after {timeout:.0f} s")
        time.sleep(0.05)
