"""Storage types: the tiers a volume can stand in for.

The set and its order are HDFS trunk's (``org.apache.hadoop.fs.StorageType``): the enum is
sorted from fastest to slowest, and that order is also the sort order of any list of types
tierfs prints (fsck summaries, reports). Integer values are stable, so they may be stored.
"""

from __future__ import annotations

import enum


class StorageType(enum.IntEnum):
    """One storage tier. ``int(t)`` is stable and orders types fastest first."""

    RAM_DISK = 0
    NVDIMM = 1
    SSD = 2
    DISK = 3
    ARCHIVE = 4
    PROVIDED = 5

    @property
    def transient(self) -> bool:
        """True for RAM_DISK only: its contents do not survive a reboot."""
        return self is StorageType.RAM_DISK

    @property
    def is_ram(self) -> bool:
        """True for the memory-backed types (RAM_DISK, NVDIMM)."""
        return self in (StorageType.RAM_DISK, StorageType.NVDIMM)

    @property
    def movable(self) -> bool:
        """Whether the mover and balancer may move replicas of this type (HDFS: not transient)."""
        return not self.transient

    @classmethod
    def parse(cls, name: str) -> StorageType:
        """The type called ``name``, ignoring case and surrounding blanks.

        Raises ValueError with a one-line message listing the valid names, so a typo in a
        configuration file or on a command line is easy to fix.
        """
        try:
            return cls[name.strip().upper()]
        except KeyError:
            expected = ", ".join(t.name for t in cls)
            raise ValueError(f"unknown storage type {name!r} (expected one of {expected})") from None

    def __str__(self) -> str:
        # IntEnum prints its integer by default; messages and JSON want the HDFS name.
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)
