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
        self._named = False   # this holder wrote its name (DATA is writable)

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
        if not frozen:
            try:
                self._name_holder(fd, mountpoint)
            except OSError:
                os.close(fd)
                raise
        self._named = not frozen
        self._fd = fd

    @staticmethod
    def _name_holder(fd: int, mountpoint: Path) -> None:
        """Cut to one byte, not to none, and written over: the file keeps the disk space
        it has, so a mount on a disk that something else filled (to free space through
        it) does not fail for want of a page here. Cut first, so that ``holder`` never
        reads the new pid with the end of a longer old mount point."""
        holder = f"{os.getpid()}\n".encode() + os.fsencode(mountpoint) + b"\n"
        os.ftruncate(fd, 1)
        os.pwrite(fd, holder, 0)

    def release(self) -> None:
        """The name is cleared down to one byte, not to none, so that the file keeps its
        first page for the next holder (``_name_holder``); a holder that cannot write the
        file (read-only DATA) then shows as no name, as before any mount."""
        if self._fd is not None:
            if self._named:
                os.ftruncate(self._fd, 1)
                os.pwrite(self._fd, b"\n", 0)
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
