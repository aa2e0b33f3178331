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
from collections import Counter
from typing import Callable, Iterable, TypeVar

from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.errors import FsError
from tierfs.satisfier.policies import BlockStoragePolicy

T = TypeVar("T")


def choose_volumes(policy: BlockStoragePolicy, replication: int, volumes: VolumeSet,
                   nbytes: int, existing: list[Volume] | None = None,
                   avoid: Iterable[int] = ()) -> list[Volume]:
    """Volumes for the replicas a block still needs.

    A new block (``existing`` None) uses the policy's creation fallbacks and fails with
    ENOSPC when nothing allowed has room. Re-replication (``existing``: the volumes of the
    block's good replicas) uses the replication fallbacks and may return nothing; transient
    replicas (RAM_DISK) count for nothing, as in HDFS. Either way the result can be shorter
    than what is missing when the allowed types run out of volumes: the block is then
    under-replicated, as in HDFS. ``avoid``: volume ids not to use (a copy there failed).
    """
    new_block = existing is None
    existing = existing or []
    used = [v.id for v in existing] + list(avoid)

    def take(storage_type: StorageType) -> Volume | None:
        volume = volumes.pick(storage_type, nbytes, exclude=used)
        if volume is not None:
            used.append(volume.id)
        return volume

    chosen_types = [v.storage_type for v in existing if not v.storage_type.transient]
    added = _fill(policy, replication, chosen_types, new_block, take)
    if new_block and not added:
        raise FsError(errno.ENOSPC, f"no volume allowed by policy {policy.name} has room")
    return added


def replicas_placeable(policy: BlockStoragePolicy, replication: int,
                       volume_types: Iterable[StorageType]) -> int:
    """How many persistent replicas of a block the policy can keep on volumes of these
    types, one per volume, free space aside (the replication fallbacks, as re-replication
    uses them). Below ``replication``, the blocks can never be fully replicated here:
    what mkfs warns of, and what ``user.tierfs.satisfied`` and the log say instead of
    "awaiting re-replication" or "no room"."""
    left = Counter(t for t in volume_types if not t.transient)

    def take(storage_type: StorageType) -> StorageType | None:
        if left[storage_type] == 0:
            return None
        left[storage_type] -= 1
        return storage_type

    return len(_fill(policy, replication, [], False, take))


def beyond_reach(policy: BlockStoragePolicy, replication: int,
                 volumes: VolumeSet) -> str | None:
    """Why ``replication`` replicas can never be kept on these volumes, or None."""
    most = replicas_placeable(policy, replication, (v.storage_type for v in volumes))
    if most >= replication:
        return None
    return (f"{policy.name} can keep at most {most} replica{'s' * (most != 1)} on these "
            f"volumes (one per volume)")


def wanted_beyond_volumes(policy: BlockStoragePolicy, replication: int,
                          volume_types: Iterable[StorageType]) -> str | None:
    """Why no move can ever place a block of ``replication`` replicas as the policy wants
    on volumes of these types, or None: the policy's own types, one replica per volume,
    need more volumes of some type than there are (HOT's two DISK replicas on one DISK
    volume). Such a block waits for a volume to be added, not for the satisfier."""
    wanted = Counter(policy.choose_storage_types(replication))
    have = Counter(volume_types)
    short = [f"{have[t]} {t.name} volume{'s' * (have[t] != 1)}"
             for t in sorted(wanted) if have[t] < wanted[t]]
    if not short:
        return None
    return f"these volumes cannot hold that (only {', '.join(short)})"


def _fill(policy: BlockStoragePolicy, replication: int, chosen_types: list[StorageType],
          new_block: bool, take: Callable[[StorageType], T | None]) -> list[T]:
    """HDFS's ``chooseTarget`` loop: ask the policy for the types still needed, ``take`` a
    volume of each; types that had none become unavailable and the policy is asked again
    (its fallbacks), until enough are chosen or nothing new can be tried."""
    chosen_types = list(chosen_types)
    added: list[T] = []
    unavailable: set[StorageType] = set()
    while len(chosen_types) < replication:
        wanted = policy.choose_storage_types(replication, chosen_types, unavailable,
                                             is_new_block=new_block)
        if not wanted:
            break
        missing: set[StorageType] = set()
        for storage_type in wanted:
            taken = take(storage_type)
            if taken is None:
                missing.add(storage_type)
                continue
            added.append(taken)
            chosen_types.append(storage_type)
        if not missing or missing <= unavailable:
            break
        unavailable |= missing
    return added


# Resolves the (policy, replication) that apply to an inode.
Placement = tuple[BlockStoragePolicy, int]
"""A file's effective storage policy and replication factor."""
EffectivePlacement = Callable[[int], Placement]


class Placer:
    """The ``BlockIO`` placement callback: effective policy of the inode, then volumes.

    A volume qualifies only with room for a whole block (``nbytes`` is the block size), as
    HDFS's ``chooseStorage4Block`` requires: a block placed on a nearly full volume would
    fail with ENOSPC half-way through although other allowed volumes have room.
    """

    def __init__(self, volumes: VolumeSet, effective: EffectivePlacement):
        self.volumes = volumes
        self.effective = effective

    def __call__(self, ino: int, nbytes: int) -> tuple[list[Volume], int]:
        """The volumes for a new block, and how many persistent replicas it should have:
        the file's replication, capped by what re-replication could ever add to the
        volumes chosen. More than the volumes chosen when too few had room, or when only
        the policy's replication fallbacks can take the rest (HOT, replication 2, one
        DISK volume: the second replica goes to ARCHIVE, as in HDFS): the caller queues
        the block for the replication monitor."""
        policy, replication = self.effective(ino)
        chosen = self._choose(policy, replication, nbytes)
        persistent = sum(not v.storage_type.transient for v in chosen)
        if persistent < replication:  # room, or no more volumes of the allowed types?
            more = choose_volumes(policy, replication, self.volumes, 0, existing=chosen)
            replication = persistent + sum(not v.storage_type.transient for v in more)
        return chosen, replication

    def has_room(self, ino: int, nbytes: int,
                 placement: Placement | None = None) -> bool:
        """Whether a new block of the file could be placed now on volumes that each have
        ``nbytes`` free (no side effect: nothing is reserved). ``placement``: the file's
        policy and replication when the caller has them already."""
        policy, replication = placement if placement is not None else self.effective(ino)
        try:
            return bool(self._choose(policy, replication, nbytes))
        except FsError:
            return False

    def _choose(self, policy: BlockStoragePolicy, replication: int,
                nbytes: int) -> list[Volume]:
        if policy.copy_on_create_file and replication == 1:
            # HDFS data-node behaviour for LAZY_PERSIST: the name node asks for DISK (RAM
            # is transient, never asked for), the data node writes to RAM_DISK when it can;
            # the lazy writer persists the block to DISK afterwards.
            ram = self.volumes.pick(StorageType.RAM_DISK, nbytes)
            if ram is not None:
                return [ram]
        return choose_volumes(policy, replication, self.volumes, nbytes)
