"""The lazy writer: persists LAZY_PERSIST blocks from RAM_DISK to DISK in the background.

HDFS's data node writes a LAZY_PERSIST block to a RAM_DISK volume when it has one, and a lazy
writer later copies each finished block to persistent storage; until then the block has no
persistent replica and counts as under-replicated. Here a block is finished when no handle
has its file open for writing. The copy is verified and installed durably
(``backends/copy.py``) and recorded only if the block's generation stamp did not change
meanwhile; otherwise the copy is deleted and the block waits for the next round. The RAM_DISK
replica stays as a fast copy (reads prefer it).
"""

from __future__ import annotations

import errno
import logging

import trio

from tierfs.backends.copy import copy_error, copy_replica
from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.blockio import BlockIO
from tierfs.fs.errors import FsError
from tierfs.fs.namespace import Namespace
from tierfs.fs.resolver import Resolver

log = logging.getLogger(__name__)

ROUND_SECONDS = 0.5


class LazyWriter:
    def __init__(self, ns: Namespace, volumes: VolumeSet, blockio: BlockIO, resolver: Resolver):
        self.ns = ns
        self.volumes = volumes
        self.blockio = blockio
        self.resolver = resolver
        self.pending: set[tuple[int, int]] = set()
        self.failures: dict[tuple[int, int], str] = {}
        blockio.on_transient_block = self.note

    def note(self, ino: int, index: int) -> None:
        self.pending.add((ino, index))

    def rebuild(self) -> None:
        """At mount: every block whose replicas are all transient is pending again."""
        for volume in self.volumes:
            if volume.storage_type.transient:
                self.pending.update(self.ns.blocks_on_volume(volume.id))

    async def run(self) -> None:
        while True:
            await trio.sleep(ROUND_SECONDS)
            await self.round()

    async def round(self) -> int:
        """One pass over the pending blocks; returns how many were persisted."""
        done = 0
        for ino, index in sorted(self.pending):
            of = self.blockio.files.get(ino)
            if of is not None and of.writers:
                continue  # still being written: the auth pin holds off the copy
            try:
                if await self._persist(ino, index):
                    done += 1
                self.pending.discard((ino, index))
                self.failures.pop((ino, index), None)
            except FsError as exc:
                reason = copy_error(exc)
                if self.failures.get((ino, index)) != reason:
                    log.warning("lazy persist of block %d of inode %d failed: %s",
                                index, ino, reason)
                self.failures[(ino, index)] = reason
        return done

    async def _persist(self, ino: int, index: int) -> bool:
        rec = self.ns.get_blocks(ino).get(index) if self._exists(ino) else None
        if rec is None:
            return False  # deleted or truncated meanwhile
        types = {self.volumes.get(v).storage_type for v in rec.volumes}
        if any(not t.transient for t in types):
            return False  # already persistent
        target = self._target(ino, rec)
        source = self.volumes.get(rec.volumes[0])
        await trio.to_thread.run_sync(copy_replica, source, target, rec.block_id, rec.gs)
        if not self.ns.add_replica(ino, index, rec.block_id, rec.gs, target.id):
            target.delete_replica(rec.block_id, rec.gs)
            raise FsError(errno.EAGAIN, "block changed during the copy; retrying")
        of = self.blockio.files.get(ino)
        if of is not None and index in of.blocks:
            of.blocks[index].volumes = rec.volumes + (target.id,)
            self.blockio.retire_replicas(of, [index])  # reopened with the new replica
        return True

    def _exists(self, ino: int) -> bool:
        try:
            self.ns.get_inode(ino)
            return True
        except FsError:
            return False

    def _target(self, ino: int, rec):
        policy, replication = self.resolver.placement(ino)
        wanted = policy.choose_storage_types(max(1, replication)) or [StorageType.DISK]
        for storage_type in list(dict.fromkeys(wanted)) + list(policy.replication_fallbacks):
            volume = self.volumes.pick(storage_type, rec.length, exclude=rec.volumes)
            if volume is not None:
                return volume
        raise FsError(errno.ENOSPC, "no persistent volume has room for a lazy-persist block")
