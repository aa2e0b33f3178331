"""Timestamp rules: which clock stamps a change, which times tierfs can store, and when a
read moves atime.

The kernel leaves atime to a FUSE filesystem entirely (it marks every FUSE inode
``S_NOATIME``), so tierfs applies relatime itself (unless the mount is ``ro`` or
``noatime``): to files on the reads it serves, to directories when they are listed, to
symlinks when they are read.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from tierfs.fs.errors import FsError
from tierfs.fs.schema import TIME_NS_MAX, TIME_NS_MIN

RELATIME_NS = 24 * 3600 * 10**9

#: Linux's id of the coarse real-time clock; Python 3.11's ``time`` does not name it.
CLOCK_REALTIME_COARSE = 5


class KernelClock:
    """The time to stamp a change with, taken from the kernel, so that tierfs's stamps and
    the kernel's own follow the order of the changes.

    With writeback caching the kernel stamps a cached write's mtime and ctime itself, with
    ``current_time()``: the coarse clock (the time at the last tick) or, since Linux 6.13,
    the latest fine-grained time a multigrain filesystem (ext4, xfs, btrfs, tmpfs) handed
    out, if that is later. Neither of Python's clocks is that. Stamped from the fine clock,
    which runs up to a tick (4 ms) ahead, a file written just after another was created
    looked older than it (2,986 times in 3,000; ``make`` then skips a rebuild) and a write
    to a new file moved its mtime back; from the coarse clock, a file created just after
    another was written looked older than it (2,157 in 3,000).

    So the kernel stamps a memfd (tmpfs) with the time now, and tierfs takes that. The
    memfd's times were read since its last change, so on a multigrain kernel it gets a
    fine-grained time, and that time becomes the floor of every later ``current_time()``:
    every later kernel stamp is at least this one, every earlier one at most. Before 6.13
    it gets ``current_time()`` itself. A stamp costs about 1 µs."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._opening = threading.Lock()

    def now_ns(self) -> int:
        fd = self._fd if self._fd is not None else self._open()
        if fd is None:  # out of descriptors: the coarse clock until one is free
            return time.clock_gettime_ns(CLOCK_REALTIME_COARSE)
        os.utime(fd)
        return os.fstat(fd).st_mtime_ns  # read, so the next stamp is fine-grained again

    def _open(self) -> int | None:
        with self._opening:
            if self._fd is None:
                try:
                    fd = os.memfd_create("tierfs-clock", os.MFD_CLOEXEC)
                except OSError:
                    return None
                os.fstat(fd)
                self._fd = fd
            return self._fd


now_ns = KernelClock().now_ns


def storable_time_ns(value: int) -> int:
    """``value`` if the namespace can keep it exactly, else EINVAL. Refused rather than
    clamped: with writeback caching the kernel keeps the time it asked for in its cache,
    and a clamped copy on disk would show up as a different time after eviction."""
    if not TIME_NS_MIN <= value <= TIME_NS_MAX:
        raise FsError(errno.EINVAL, "time outside what tierfs stores (1677-09-21 to "
                                    "2262-04-11)")
    return value


@dataclass(frozen=True)
class AtimeRule:
    """When a read moves atime: relatime, or never on a mount with ``ro`` or ``noatime``.
    The kernel applies neither flag to a FUSE inode, so they are the daemon's to keep.
    libfuse accepts no other atime option."""

    moves: bool = True

    @classmethod
    def from_mount_options(cls, options: Iterable[str]) -> AtimeRule:
        return cls(moves=not set(options) & {"ro", "noatime"})

    def due(self, atime_ns: int, mtime_ns: int, ctime_ns: int, now_ns: int) -> bool:
        """relatime: a read moves atime only when atime is not newer than mtime or ctime,
        or is more than a day old."""
        return self.moves and (atime_ns <= mtime_ns or atime_ns <= ctime_ns
                               or now_ns - atime_ns > RELATIME_NS)
