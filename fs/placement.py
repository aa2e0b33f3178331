"""Placement of new blocks: which volumes receive the replicas of a new block.

The storage types come from the file's effective policy and replication through HDFS's
``chooseStorageTypes``; the volume within a type is the one with the most free space
(``VolumeSet.pick``). When a wanted type has no volume with room, every type still needed is
marked unavailable and the policy is asked again, so its creation fallbacks apply (HDFS
``BlockPlacementPolicyDefault.chooseTarget``). Replicas always land on distinct volumes. If
nothing allowed has room the write fails with ENOSPC before any file is created.
"""

from __future__ import annotations

import errno
from typing import Callable

from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.errors import FsError
from tierfs.satisfier.policies import BlockStoragePolicy


def choose_volumes(policy: BlockStoragePolicy, replication: int, volumes: VolumeSet,
                   nbytes: int) -> list[Volume]:
    """Volumes for the replicas of a new block; fewer than ``replication`` when the
    allowed types run out of volumes (the block is then under-replicated, as in HDFS)."""
    chosen: list[Volume] = []
    unavailable: set[StorageType] = set()
    while len(chosen) < replication:
        wanted = policy.choose_storage_types(
            replication, [v.storage_type for v in chosen], unavailable, is_new_block=True)
        if not wanted:
            break
        missing: set[StorageType] = set()
        for storage_type in wanted:
            volume = volumes.pick(storage_type, nbytes, exclude=[v.id for v in chosen])
            if volume is None:
                missing.add(storage_type)
            else:
                chosen.append(volume)
        if not missing or missing <= unavailable:
            break
        unavailable |= missing
    if not chosen:
        raise FsError(errno.ENOSPC, f"no volume allowed by policy {policy.name} has room")
    return chosen


# Resolves the (policy, replication) that apply to an inode.
EffectivePlacement = Callable[[int], tuple[BlockStoragePolicy, int]]


class Placer:
    """The ``BlockIO`` placement callback: effective policy of the inode, then volumes.

    A volume qualifies only with room for a whole block (``nbytes`` is the block size), as
    HDFS's ``chooseStorage4Block`` requires: a block placed on a nearly full volume would
    fail with ENOSPC half-way through although other allowed volumes have room.
    """

    def __init__(self, volumes: VolumeSet, effective: EffectivePlacement):
        self.volumes = volumes
        self.effective = effective

    def __call__(self, ino: int, nbytes: int) -> list[Volume]:
        policy, replication = self.effective(ino)
        if policy.copy_on_create_file and replication == 1:
            # HDFS data-node behaviour for LAZY_PERSIST: the name node asks for DISK (RAM
            # is transient, never asked for), the data node writes to RAM_DISK when it can;
            # the lazy writer persists the block to DISK afterwards.
            ram = self.volumes.pick(StorageType.RAM_DISK, nbytes)
            if ram is not None:
                return [ram]
        return choose_volumes(policy, replication, self.volumes, nbytes)
