"""The set of volumes of one filesystem, and the choice of volumes for a new replica."""

from __future__ import annotations

import errno
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume import Volume, syncfs
from tierfs.fs.errors import FsError

log = logging.getLogger(__name__)


def resolve_volume_path(data_dir: Path, recorded: str) -> Path:
    """Volume paths inside DATA are recorded relative to it, so DATA can be moved."""
    path = Path(recorded)
    return path if path.is_absolute() else data_dir / path


class VolumeSet:
    """All volumes of a mounted (or inspected) filesystem, by id and by storage type."""

    def __init__(self, volumes: Iterable[Volume]):
        self.by_id: dict[int, Volume] = {v.id: v for v in volumes}

    @classmethod
    def open(cls, data_dir: Path, fs_uuid: str, configs: Sequence) -> "VolumeSet":
        """Open every recorded volume, checking its identity file (clear errors if not)."""
        return cls(
            Volume.open(resolve_volume_path(data_dir, c.path), fs_uuid=fs_uuid,
                        volume_uuid=c.uuid, volume_id=c.id,
                        storage_type=StorageType.parse(c.storage_type),
                        capacity=c.capacity)
            for c in configs)

    def __iter__(self):
        return iter(self.by_id.values())

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, volume_id: int) -> Volume:
        try:
            return self.by_id[volume_id]
        except KeyError:
            raise FsError(errno.EIO, f"unknown volume id {volume_id}") from None

    def sync_filesystems(self) -> None:
        """syncfs once on each filesystem that holds a volume: everything written to any
        replica so far is durable afterwards. Raises FsError(EIO) naming the volume."""
        synced: set[int] = set()
        for volume in self.by_id.values():
            try:
                device = os.stat(volume.path).st_dev
                if device not in synced:
                    syncfs(volume.path)
                    synced.add(device)
            except OSError as e:
                raise FsError(errno.EIO, f"cannot sync volume {volume.path}: "
                                         f"{e.strerror or e}") from e

    def types(self) -> set[StorageType]:
        return {v.storage_type for v in self.by_id.values()}

    def of_type(self, storage_type: StorageType) -> list[Volume]:
        return [v for v in self.by_id.values() if v.storage_type == storage_type]

    def pick(self, storage_type: StorageType, nbytes: int,
             exclude: Iterable[int] = ()) -> Volume | None:
        """The volume of that type with the most free space that has room for ``nbytes``.

        Distinct replicas of a block never share a volume (``exclude``). Each disk's free
        space is read once, so volumes sharing a disk compare equal and the first (lowest
        id) wins: placement does not flip with writes landing between two statvfs calls.
        """
        excluded = set(exclude)
        free = {}
        disk_free: dict[int, int] = {}
        for volume in self.of_type(storage_type):
            if volume.id in excluded:
                continue
            try:
                device = os.stat(volume.path).st_dev
                if device not in disk_free:
                    disk_free[device] = volume._disk_free()
                room = volume.free_bytes(disk_free[device])
            except (OSError, FsError) as exc:  # vanished or unreadable: not a candidate
                log.warning("volume %s unusable for new replicas: %s", volume.path, exc)
                continue
            if room >= nbytes:
                free[volume.id] = (room, volume)
        if not free:
            return None
        return max(free.values(), key=lambda pair: pair[0])[1]

    def delete_replicas(self, entries) -> list[int]:
        """Delete the files of dropped replicas, ``entries`` being (block id, gs, volume
        ids) trash rows; returns the block ids fully done. A row whose volume cannot
        delete now (failed, moved away) stays pending for a later attempt."""
        done = []
        for block_id, _gs, volume_ids in entries:
            try:
                for volume_id in volume_ids:
                    volume = self.by_id.get(volume_id)
                    if volume is not None:
                        volume.delete_replica(block_id, None)
            except (FsError, OSError) as exc:
                log.warning("replica files of block %d not deleted yet: %s", block_id, exc)
                continue
            done.append(block_id)
        return done

    def space(self) -> tuple[int, int]:
        """(total, free) bytes over all volumes, counting each disk's free space once.

        Volumes often share a disk (the default layout puts all three on DATA's); summing
        their free space would promise that space several times over.
        """
        groups: dict[int, list[Volume]] = defaultdict(list)
        for volume in self.by_id.values():
            try:
                groups[os.stat(volume.path).st_dev].append(volume)
            except OSError:
                continue  # a vanished volume offers no space

        total = free = 0
        for members in groups.values():
            disk_free = min(v.free_bytes() if v.capacity is None else v._disk_free()
                            for v in members)
            capped = sum(v.free_bytes() for v in members if v.capacity is not None)
            uncapped = any(v.capacity is None for v in members)
            group_free = min(disk_free, capped + (disk_free if uncapped else 0))
            free += group_free
            total += sum(v.used_bytes() for v in members) + group_free
        return total, free

    def sorted_for_read(self, volume_ids: Iterable[int]) -> list[Volume]:
        """Replicas in read preference order: fastest storage type first."""
        vols = [self.by_id[v] for v in volume_ids if v in self.by_id]
        return sorted(vols, key=lambda v: (int(v.storage_type), v.id))
