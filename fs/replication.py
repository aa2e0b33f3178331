"""The replication monitor: keeps every block's persistent replicas up to its replication.

One in-daemon task serves three cases that are the same problem, "a block has fewer good
persistent replicas than its file's replication factor asks for":

- lazy persist: a LAZY_PERSIST block written to RAM_DISK has no persistent replica yet
  (HDFS's lazy writer copies each finished block to DISK; RAM_DISK is transient and counts
  for nothing);
- a replica dropped from a write pipeline because its volume failed (seed 002);
- a replica a read found missing, stale or corrupt: it is dropped from the block (only while
  another replica remains, never the last one) and its files deleted.

New replicas are placed like HDFS re-replication: ``chooseStorageTypes`` with the replicas
already chosen and the *replication* fallbacks, the volume within a type by free space, on a
volume the block does not use yet. A copy is verified and installed durably
(``backends/copy.py``) and recorded only if the block's GS did not change meanwhile. Blocks of
files open for writing wait (the "auth pin" holds off the copy). Work that cannot be done
now (no room, copy failed) is retried with a back-off; fsck reports what remains. So is
an unexpected error, logged with its traceback: background work must never end the mount,
which would lose what open files hold in memory.
"""

from __future__ import annotations

import errno
import heapq
import logging
import stat
import time
from dataclasses import dataclass

import trio

from tierfs.backends.copy import SourceReplicaError, copy_error, copy_replica
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.blockio import BlockIO
from tierfs.fs.errors import OUT_OF_DESCRIPTORS, FsError
from tierfs.fs.namespace import Namespace
from tierfs.fs.placement import beyond_reach, choose_volumes
from tierfs.fs.resolver import Resolver
from tierfs.fs.schema import BlockRecord

log = logging.getLogger(__name__)

ROUND_SECONDS = 0.5
RETRY_SECONDS = 5.0
# A block that keeps failing waits twice as long each time, up to this: a replica that
# answers EIO on every read must not be read whole every few seconds forever.
MAX_RETRY_SECONDS = 300.0
BATCH = 256
YIELD_EVERY = 64


class Unrepairable(FsError):
    """Every replica of the block, as it is now, failed its checksum in a verified copy:
    nothing to copy from. Retried like any failure, but a retry finds the same findings
    and reads nothing, until a writer gives the block a new stamp (the findings are then
    stale) and the copy is tried again. fsck reports the block meanwhile."""

    def __init__(self, block_id: int, ino: int):
        super().__init__(errno.EIO, f"block {block_id} of inode {ino} has no good replica "
                                    f"left: every replica failed its checksum in a "
                                    f"verified copy")


@dataclass
class BadReplica:
    """A replica found bad at one stamp of its block (a rewrite or truncate makes the
    finding stale). Reported by a read, it may have been a passing error: while another
    replica is left it is dropped, and when none is, a verified copy decides. ``corrupt``:
    such a copy from it failed its checksum."""

    block_id: int
    gs: int
    reason: str
    corrupt: bool = False

    def about(self, rec: BlockRecord) -> bool:
        """Whether the finding is about the block as it is now (not stale)."""
        return (self.block_id, self.gs) == (rec.block_id, rec.gs)


class ReplicationMonitor:
    def __init__(self, ns: Namespace, volumes: VolumeSet, blockio: BlockIO, resolver: Resolver):
        self.ns = ns
        self.volumes = volumes
        self.blockio = blockio
        self.resolver = resolver
        # Every block that may need a copy is pending; it is either ready (looked at in the
        # next round) or backing off until retry_at, in the heap ``waiting``. A round only
        # touches ready blocks and the waiting ones that came due, so after a lost volume
        # with no room elsewhere a million blocks backing off cost nothing per round.
        self.pending: set[tuple[int, int]] = set()
        self.ready: set[tuple[int, int]] = set()
        self.retry_at: dict[tuple[int, int], float] = {}
        self.attempts: dict[tuple[int, int], int] = {}  # failed tries in a row
        self.waiting: list[tuple[float, tuple[int, int]]] = []  # heap; stale entries skipped
        self.bad: dict[tuple[int, int], dict[int, BadReplica]] = {}
        self.failures: dict[tuple[int, int], str] = {}
        # Volumes where a copy of a block failed (e.g. leftovers of a dropped replica that
        # could not be deleted yet): the next attempt goes elsewhere.
        self.avoid: dict[tuple[int, int], set[int]] = {}
        # Inodes whose files' wanted replication may have changed (an ordered set).
        self.changed: dict[int, None] = {}
        blockio.on_needs_replication = self.note
        blockio.on_bad_replica = self.report_bad

    # --- intake ----------------------------------------------------------------------------

    def note(self, ino: int, index: int) -> None:
        """Look at this block in the next round, whatever back-off it was in."""
        self.pending.add((ino, index))
        self.ready.add((ino, index))
        self.retry_at.pop((ino, index), None)

    def _back_off(self, key: tuple[int, int]) -> None:
        attempts = self.attempts.get(key, 0)
        self.attempts[key] = attempts + 1
        due = time.monotonic() + min(RETRY_SECONDS * 2 ** min(attempts, 16), MAX_RETRY_SECONDS)
        self.retry_at[key] = due
        heapq.heappush(self.waiting, (due, key))

    def _take_due(self, now: float) -> None:
        """Move the backed-off blocks whose time has come to ``ready``. A heap entry whose
        block was noted again, or backed off anew, since it was pushed is stale: skipped."""
        while self.waiting and self.waiting[0][0] <= now:
            due, key = heapq.heappop(self.waiting)
            if self.retry_at.get(key) == due:
                del self.retry_at[key]
                self.ready.add(key)

    def report_bad(self, ino: int, index: int, volume_id: int, reason: str) -> None:
        """A read found this replica bad (``BlockIO.on_bad_replica``). The block is looked
        at in the next round unless it is backing off from a failed repair: then when it
        is due (every read of a bad block would otherwise start another repair)."""
        rec = self._record(ino, index)
        if rec is not None:
            self._mark_bad((ino, index), rec, volume_id, reason)
        if (ino, index) not in self.retry_at:
            self.note(ino, index)

    def _mark_bad(self, key: tuple[int, int], rec: BlockRecord, volume_id: int, reason: str,
                  corrupt: bool = False) -> None:
        marks = self.bad.setdefault(key, {})
        old = marks.get(volume_id)
        if old is not None and old.corrupt and old.about(rec):
            return  # a verified finding stands
        marks[volume_id] = BadReplica(rec.block_id, rec.gs, reason, corrupt)

    def _current_marks(self, key: tuple[int, int], rec: BlockRecord) -> dict[int, BadReplica]:
        """The findings about the block as it is now; stale ones are forgotten."""
        marks = {v: m for v, m in self.bad.pop(key, {}).items()
                 if v in rec.volumes and m.about(rec)}
        if marks:
            self.bad[key] = marks
        return marks

    async def scan(self) -> int:
        """Background scan of every block for under-replication (at mount). Returns how
        many blocks it queued; yields to other tasks between batches."""
        queued = 0
        for batch in self.ns.iter_block_batches(BATCH):
            for ino, index, rec in batch:
                queued += self._note_if_short(ino, index, rec, self._replication(ino))
            await trio.sleep(0)
        return queued

    def replication_may_change(self, ino: int) -> None:
        """The replication wanted at or below ``ino`` may have changed: a replication set
        or removed there, or ``ino`` renamed (it takes its new place's value). Its files
        are looked at again in the background, as HDFS's setReplication queues a file's
        blocks at once. A lowered replication leaves the surplus (fsck --repair removes
        it)."""
        self.changed[ino] = None

    async def walk_changed(self) -> int:
        """Queue the under-replicated blocks of every file at or below the inodes noted by
        ``replication_may_change`` so far; returns how many. Notes that arrive meanwhile
        wait for the next round, so that a stream of them (setfattr or mv in a loop over a
        big tree) cannot hold off the copies. Yields every BATCH inodes, directories
        included, so a subtree of any size is walked without holding up requests."""
        queued = 0
        roots = list(self.changed)
        self.changed.clear()
        for count, (ino, mode) in enumerate(self._inodes_below(roots), 1):
            if stat.S_ISREG(mode):
                queued += self._note_short_blocks(ino)
            if count % BATCH == 0:
                await trio.sleep(0)
        return queued

    def _inodes_below(self, roots: list[int]):
        """(inode, mode) of ``roots`` and of everything below them, depth first, reading
        one readdir batch at a time (no transaction held between them): what is removed
        meanwhile is simply not met. Only directories wait on the stack."""
        stack = []
        for ino in roots:
            try:
                stack.append((ino, self.ns.get_inode(ino).mode))
            except FsError:
                pass  # removed meanwhile
        while stack:
            ino, mode = stack.pop()
            yield ino, mode
            cookie = 0
            while stat.S_ISDIR(mode) and (rows := self.ns.readdir(ino, cookie, BATCH)):
                for cookie, _name, child, fields in rows:
                    if stat.S_ISDIR(fields[0]):
                        stack.append((child, fields[0]))
                    else:
                        yield child, fields[0]

    def _note_short_blocks(self, ino: int) -> int:
        replication = self._replication(ino)
        return sum(self._note_if_short(ino, index, rec, replication)
                   for index, rec in self.ns.get_blocks(ino).items())

    def _note_if_short(self, ino: int, index: int, rec: BlockRecord, replication: int) -> bool:
        """Queue the block if it has fewer persistent replicas than ``replication``."""
        short = self._persistent_count(rec) < replication
        if short:
            self.note(ino, index)
        return short

    # --- the task ----------------------------------------------------------------------------

    async def run(self) -> None:
        await self.scan()
        while True:
            await trio.sleep(ROUND_SECONDS)
            try:
                await self.walk_changed()
            except Exception:  # noqa: BLE001 - background work must not end the mount
                log.exception("looking at files whose replication changed failed; the next "
                              "mount's scan finds what they still need")
            await self.round()

    async def round(self) -> int:
        """One pass over the ready blocks; returns how many replicas it added. It lets
        requests run every YIELD_EVERY blocks: blocks that need no copy (already repaired,
        or deleted) take no await, and after a lost volume there may be a million of them.

        A block noted again while its repair awaited (a read found another bad replica,
        say) stays ready for the next round rather than being forgotten with this one."""
        added = 0
        self._take_due(time.monotonic())
        for count, key in enumerate(sorted(self.ready), 1):
            if count % YIELD_EVERY == 0:
                await trio.sleep(0)
            ino, index = key
            of = self.blockio.files.get(ino)
            if of is not None and of.writers:
                continue  # stays ready: looked at again once the writers are gone
            self.ready.discard(key)
            try:
                added += await self._repair(ino, index)
            except Exception as exc:  # noqa: BLE001 - background work must not end the mount
                reason = copy_error(exc)
                if not isinstance(exc, FsError):
                    log.exception("replication of block %d of inode %d failed unexpectedly",
                                  index, ino)
                elif self.failures.get(key) != reason:
                    level = logging.ERROR if isinstance(exc, Unrepairable) else logging.WARNING
                    log.log(level, "replication of block %d of inode %d: %s", index, ino,
                            reason)
                self.failures[key] = reason
                if key not in self.ready:
                    self._back_off(key)
                continue
            if key not in self.ready:
                self._forget(key)
        return added

    def _forget(self, key: tuple[int, int]) -> None:
        self.pending.discard(key)
        self.avoid.pop(key, None)
        self.failures.pop(key, None)
        self.bad.pop(key, None)
        self.attempts.pop(key, None)

    # --- one block ----------------------------------------------------------------------------

    async def _repair(self, ino: int, index: int) -> int:
        rec = self._record(ino, index)
        if rec is None:
            return 0
        rec = self._drop_bad(ino, index, rec)
        replication = self._replication(ino)
        if self._persistent_count(rec) >= replication:
            return 0
        policy = self.resolver.policy(ino)
        source = self._source(rec, ino, index)
        existing = [self.volumes.get(v) for v in rec.volumes]
        targets = choose_volumes(policy, replication, self.volumes, rec.length, existing,
                                 avoid=self.avoid.get((ino, index), ()))
        for target in targets:
            await self._copy(ino, index, rec, source, target)
        if targets and any(m.corrupt for m in self._current_marks((ino, index), rec).values()):
            # A good copy exists now: the next round drops the corrupt replicas (and
            # replaces them), which would otherwise count as good ones.
            self.note(ino, index)
        if self._persistent_count(rec) < replication:
            why = (beyond_reach(policy, replication, self.volumes)
                   or f"no other volume allowed by {policy.name} has room")
            raise FsError(errno.ENOSPC, f"only {self._persistent_count(rec)} of {replication} "
                                        f"replicas placeable: {why}")
        return len(targets)

    def _record(self, ino: int, index: int) -> BlockRecord | None:
        of = self.blockio.files.get(ino)
        if of is not None:
            return of.blocks.get(index)
        try:
            return self.ns.get_blocks(ino).get(index)
        except FsError:
            return None

    def _replication(self, ino: int) -> int:
        try:
            return self.resolver.replication(ino)
        except FsError:
            return 0

    def _persistent_count(self, rec: BlockRecord) -> int:
        return sum(1 for v in rec.volumes if v in self.volumes.by_id
                   and not self.volumes.get(v).storage_type.transient)

    def _drop_bad(self, ino: int, index: int, rec: BlockRecord) -> BlockRecord:
        """Drop replicas found bad while another is left. When every replica was found
        bad, all are kept (a last replica is never deleted: it may be readable in part,
        or have met a passing error), and a verified copy, if one is needed, decides."""
        bad = self._current_marks((ino, index), rec)
        if not bad:
            return rec
        keep = [v for v in rec.volumes if v not in bad]
        if not keep:
            if self.failures.get((ino, index)) is None:
                log.error("block %d of inode %d has no good replica left (%s)", rec.block_id,
                          ino, "; ".join(m.reason for m in bad.values()))
            return rec
        del self.bad[(ino, index)]
        self.ns.drop_replicas(ino, index, tuple(bad))
        self.blockio.delete_trash(self.ns.last_trash)
        log.warning("dropped bad replica(s) of block %d on volume(s) %s", rec.block_id,
                    sorted(bad))
        rec.volumes = tuple(keep)
        self._refresh_open_file(ino, index, rec.volumes)
        return rec

    def _source(self, rec: BlockRecord, ino: int, index: int):
        """The fastest replica not yet found corrupt by a verified copy; Unrepairable when
        every replica has been."""
        corrupt = {v for v, m in self._current_marks((ino, index), rec).items() if m.corrupt}
        for volume in self.volumes.sorted_for_read(rec.volumes):
            if volume.id not in corrupt:
                return volume
        if not rec.volumes:
            raise FsError(errno.EIO, f"block {rec.block_id} of inode {ino} has no replica")
        raise Unrepairable(rec.block_id, ino)

    async def _copy(self, ino: int, index: int, rec: BlockRecord, source, target) -> None:
        # ``rec`` may be the open file's live record, which a writer re-stamps in place
        # while the copy runs: record the copy only against the stamp actually copied.
        block_id, gs = rec.block_id, rec.gs
        try:
            await trio.to_thread.run_sync(copy_replica, source, target, block_id, gs)
        except FsError as exc:
            now = self._record(ino, index)
            if now is None or now.gs != gs:  # a writer re-stamped it (and renamed its files)
                raise FsError(errno.EAGAIN, "block changed during the copy; retrying") from exc
            if exc.errno in OUT_OF_DESCRIPTORS:
                raise  # neither side's fault: retried as it is
            if isinstance(exc, SourceReplicaError):
                # Only recorded, not noted (that would make the block ready again and retry
                # it every round): the next try copies from another replica, or gives the
                # block up when every one failed its checksum.
                self._mark_bad((ino, index), now, source.id, str(exc), corrupt=exc.corrupt)
                if exc.corrupt:
                    self._source(now, ino, index)  # Unrepairable if that was the last one
            else:
                self.avoid.setdefault((ino, index), set()).add(target.id)
            raise
        if not self.ns.add_replica(ino, index, block_id, gs, target.id):
            target.delete_replica(block_id, gs)
            raise FsError(errno.EAGAIN, "block changed during the copy; retrying")
        rec.volumes = rec.volumes + (target.id,)
        self._refresh_open_file(ino, index, rec.volumes)
        marks = self.bad.get((ino, index), {})
        if source.id in marks and not marks[source.id].corrupt:
            del marks[source.id]  # read whole and verified: whatever a read met has passed

    def _refresh_open_file(self, ino: int, index: int, volumes: tuple[int, ...]) -> None:
        of = self.blockio.files.get(ino)
        if of is not None and index in of.blocks:
            of.blocks[index].volumes = volumes
            self.blockio.retire_replicas(of, [index])  # reopened with the new set
