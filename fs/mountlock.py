"""The mount lock: one daemon per filesystem, and a way for tools to see whether it runs.

``DATA/namespace/mount.lock`` is held with ``flock`` by the daemon for its whole life and
holds its pid and mount point. The kernel drops the lock when the daemon dies, even by
kill -9, so a stale file never blocks a new mount.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from tierfs.fs.errors import FsError

LOCK_NAME = "mount.lock"


class MountLock:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.path = data_dir / "namespace" / LOCK_NAME
        self._fd: int | None = None
        self._frozen = False

    def acquire(self, mountpoint: Path, *, frozen: bool = False) -> None:
        """Take the lock or fail with a one-line message naming the holder. ``frozen``: DATA
        cannot be written, so the lock is taken on the file as it is (flock needs no write
        access) and names no holder; a DATA never mounted before has no file to lock, and
        nothing could change it anyway."""
        try:
            fd = os.open(self.path, (os.O_RDONLY if frozen else os.O_RDWR | os.O_CREAT)
                         | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            if frozen:
                return
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self.holder()
            where = f" (pid {holder[0]} on {holder[1]})" if holder and holder[0] else ""
            raise FsError(errno.EBUSY, f"{self.data_dir} is already mounted{where}") from None
        self._frozen = frozen
        if not frozen:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode() + os.fsencode(mountpoint) + b"\n", 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            if not self._frozen:
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def holder(self) -> tuple[int, str] | None:
        """(pid, mount point) of the running daemon, or None if nobody holds the lock."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pid, _, mountpoint = os.pread(fd, 8192, 0).partition(b"\n")
                if pid.isdigit() and mountpoint.endswith(b"\n"):  # the mount point may
                    return int(pid), os.fsdecode(mountpoint[:-1])  # hold newlines itself
                return 0, "?"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)
