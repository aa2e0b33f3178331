"""Room on the namespace's disk held back so that a full disk can still be cleared.

Every LMDB commit writes fresh pages, so when something fills the disk that holds the
namespace, each mutation fails with ENOSPC, rm and truncate included: the one way a user
frees space through the mount stopped working exactly when it was needed. ext4 keeps
blocks back for root for the same reason. tierfs keeps a fully allocated file of
``RESERVE_BYTES`` beside the namespace. A mutation that adds nothing to the namespace
(which ones, and how much of it they may use: ``RESERVE_FOR_REMOVALS`` in
fs/namespace.py) and finds the disk full gives back ``RELEASE_STEP`` of it and tries
again, as often as it needs; the daemon's tick allocates the file again once the disk has
room for all of it.

The file holds no data: it may be deleted at any time, and is made again by the next
mount.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from tierfs.backends.volume import disk_free
from tierfs.fs.lograte import RepeatedWarnings

log = logging.getLogger(__name__)

RESERVE_NAME = "removal.reserve"
RESERVE_BYTES = 8 << 20
"""A removal with its journal record needs a few pages; this is thousands of them."""
RELEASE_STEP = 64 << 10
"""Given back at a time: what the commit does not use, other writers to the disk may take."""


class SpaceReserve:
    """The reserve file of one namespace directory."""

    def __init__(self, namespace_dir: Path, size: int = RESERVE_BYTES):
        self.path = namespace_dir / RESERVE_NAME
        self.size = size
        self.short = True   # not known to be allocated in full until ``refill`` says so
        self.released = False   # some of it went to a removal since it was last whole
        self.warnings = RepeatedWarnings(log)   # a long rm -r releases it many times

    def held(self) -> int:
        """Bytes the reserve holds now (0 when the file is missing)."""
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def release_some(self, keep: int = 0) -> bool:
        """Give ``RELEASE_STEP`` back to the disk, holding on to ``keep`` bytes; False when
        there was nothing above ``keep`` to give."""
        held = self.held()
        if held <= keep:
            return False
        left = max(keep, held - RELEASE_STEP)
        os.truncate(self.path, left)
        self.short = self.released = True
        self.warnings.warning(f"namespace disk full: gave {(held - left) >> 10} KiB of the "
                              f"removal reserve to a removal ({left >> 10} KiB left)")
        return True

    def refill(self) -> bool:
        """Allocate the reserve in full when the disk has room for all of it; True when it
        is full. Never takes part of what is missing: a disk that has only some of it is
        left to the user's writes (which would otherwise fail for a reserve that still
        could not be made whole)."""
        if not self.short:
            return True
        held = self.held()
        try:
            if disk_free(self.path.parent) < self.size - held:
                return False
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError:
                os.ftruncate(fd, held)  # another writer took the room first: keep what was
                raise
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cannot allocate the removal reserve %s: %s", self.path,
                            exc.strerror or exc)
            return False
        if self.released:
            log.info("removal reserve whole again (%d MiB)", self.size >> 20)
        self.short = self.released = False
        return True
