"""Timestamp rules: which clock stamps a change, which times tierfs can store, and when a
read moves atime.

The kernel leaves atime to a FUSE filesystem entirely (it marks every FUSE inode
``S_NOATIME``), so tierfs applies relatime itself (unless the mount is ``ro`` or
``noatime``): to files on the reads it serves, to directories when they are listed, to
symlinks when they are read.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass
from typing import Iterable

from tierfs.fs.errors import FsError
from tierfs.fs.schema import TIME_NS_MAX, TIME_NS_MIN

RELATIME_NS = 24 * 3600 * 10**9

#: Linux's id of the coarse real-time clock; Python 3.11's ``time`` does not name it.
CLOCK_REALTIME_COARSE = 5


def now_ns() -> int:
    """The time to stamp a change with: the kernel's coarse clock (``CLOCK_REALTIME_COARSE``,
    the time at the last tick). With writeback caching the kernel stamps a cached write's
    mtime and ctime itself, from that clock; were the daemon to read the fine clock, which
    runs up to a tick (4 ms) ahead, a file written just after another was created would look
    older than it (``make`` then skips a rebuild), and a write to a file just created would
    move its mtime back. On one clock, times follow the order of the changes (ties within a
    tick, as on ext4 before multigrain timestamps)."""
    return time.clock_gettime_ns(CLOCK_REALTIME_COARSE)


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
