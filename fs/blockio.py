"""File data: blocks, replicas, generation stamps, lengths, fsync.

This is the only module that touches both the block map (through the namespace) and the
volumes. Everything here runs in the trio thread and is synchronous except ``fsync`` and
``truncate``, which take the file's lock and push the slow part (fsync of replica files and
of the namespace) to a worker thread. Short reads and writes stay inline: they hit the page
cache of the backing filesystem, and a thread hop would cost more than the I/O.

State of an open file lives in one :class:`OpenFile` per inode, shared by all its handles,
so readers and writers of one inode see the same length at once.

Durability rules (DESIGN.md sections 3-4):
- a new block's replica files are written and fsynced before the namespace refers to them;
- a replica's new generation stamp is on its meta file before any byte of the new version is
  written, and before the namespace records it (so a crash in between leaves the replica
  newer than the namespace, which recovery accepts);
- lengths, sizes and times of open files are kept in memory and persisted on fsync,
  release, when a block fills and by the one-second tick (not at FLUSH, which close()
  sends: see ``Operations.flush``);
- dropped replicas go to the namespace trash in the dropping transaction. Replicas dropped
  from a block that lives on are deleted right after the commit; whole blocks dropped by a
  truncate or an unlink only once that commit is on disk (the next namespace sync, within
  about a second), so that a power loss cannot bring back a namespace that still refers to
  their deleted files (``defer_trash``).
"""

from __future__ import annotations

import errno
import logging
import resource
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import trio

from tierfs.backends.replica import Replica
from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.errors import OUT_OF_DESCRIPTORS, FsError
from tierfs.fs.namespace import Namespace
from tierfs.fs.schema import BlockRecord, Inode
from tierfs.fs.times import AtimeRule, now_ns

log = logging.getLogger(__name__)

# Blocks whose replicas one open file keeps open (two descriptors per replica), least
# recently used closed first: a file of many small blocks written or read through one
# handle would otherwise run the daemon out of descriptors (seen with 1 KiB blocks: a
# 12 MiB file held 24,000).
OPEN_BLOCKS_PER_FILE = 64

# Files no longer open whose blocks written since their last fsync are remembered, so that
# a later open + fsync syncs them. Beyond this many, a task of the mount syncs every
# volume's filesystem and forgets the blocks that made durable (``settle_unsynced``):
# each remembered file costs about 300 bytes, and ``cp -a``, ``tar x`` or ``rsync`` of
# millions of files fsync none of them.
UNSYNCED_FILES_MAX = 20_000

# Descriptors one open replica may hold: its data file, its meta file and the O_DIRECT
# descriptor of large writes.
FDS_PER_REPLICA = 3
# Descriptors left for everything but open replicas: /dev/fuse, the namespace, logs, new
# replicas being created, copies made by the satisfier and re-replication.
RESERVED_FDS = 256

# Chooses the volumes of a new block of inode ``ino`` that will hold ``nbytes`` now;
# returns them with the replication the file wants.
Placer = Callable[[int, int], tuple[list[Volume], int]]


@dataclass(eq=False)
class OpenFile:
    """In-memory state of one inode while it has open handles (or a truncate runs)."""

    ino: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    blocks: dict[int, BlockRecord]
    users: int = 0
    writers: int = 0
    leased: bool = False  # a lease is taken at the first change, not at open
    attrs_dirty: bool = False
    replicas: dict[int, list[Replica]] = field(default_factory=dict)
    writable: set[int] = field(default_factory=set)   # block indexes opened for writing
    bumped: set[int] = field(default_factory=set)     # blocks this write session re-stamped
    dirty: set[int] = field(default_factory=set)      # block lengths not yet persisted
    unsynced: set[int] = field(default_factory=set)   # blocks written since the last fsync
    # Replicas replaced or dropped while the file is open. Each is closed as soon as no
    # worker thread uses it (``pinned``): a thread must never meet a closed descriptor (or
    # its number reused by another file), and a file kept open through many truncates
    # must not pile up descriptors.
    retired: list[Replica] = field(default_factory=list)
    pinned: Counter = field(default_factory=Counter)  # Replica -> worker threads using it
    truncations: int = 0  # shrinks so far: a read that raced one plans again
    lock: trio.Lock = field(default_factory=trio.Lock)


class BlockIO:
    """Reads and writes file data for a mounted filesystem."""

    def __init__(self, ns: Namespace, volumes: VolumeSet, placer: Placer, session: bytes,
                 *, max_open_replicas: int | None = None, atime_rule: AtimeRule = AtimeRule()):
        """``max_open_replicas``: replicas kept open across all open files, least recently
        used closed first (default: what the process's descriptor limit leaves, see
        ``replica_budget``). ``atime_rule``: from the mount options."""
        self.ns = ns
        self.atime_rule = atime_rule
        self.volumes = volumes
        self.placer = placer
        self.session = session
        self.block_size = ns.config.block_size
        self.bpc = ns.config.bytes_per_checksum
        self.files: dict[int, OpenFile] = {}
        # Blocks written since their last fsync, per inode. Outlives OpenFile: a later
        # open + fsync (``sync FILE``) must sync what an earlier, closed handle wrote.
        self.unsynced: dict[int, set[int]] = {}
        # While ``settle_unsynced`` waits for its syncfs: the inodes opened meanwhile,
        # whose remembered blocks it must leave alone (they may be written again).
        self._opened_while_settling: set[int] | None = None
        # Why a syncfs of the volumes failed, once one did: from then on nothing is
        # forgotten by syncfs (see ``settle_unsynced``).
        self.settling_failed: str | None = None
        # Told about blocks that need replication work: (ino, index), e.g. a new block
        # placed only on transient volumes, or a replica dropped from a write pipeline.
        self.on_needs_replication: Callable[[int, int], None] = lambda ino, index: None
        # Replicas that failed an fsync whose drop from their block failed in turn, per
        # inode: block index -> volume ids. The kernel reports a write-back error to one
        # fsync only, so the next fsync counts them as failed whatever their retry says.
        self.failed_syncs: dict[int, dict[int, set[int]]] = {}
        # Trash rows of whole blocks dropped by commits not yet synced (``defer_trash``).
        self.deferred_trash: list = []
        # Told about a replica a read could not use: (ino, index, volume id, reason).
        self.on_bad_replica: Callable[[int, int, int, str], None] = lambda *a: None
        self.max_open_replicas = (replica_budget() if max_open_replicas is None
                                  else max_open_replicas)
        # Every block some open file keeps replicas of, (ino, index) -> how many replicas,
        # least recently used first: many open files together must not run the daemon
        # out of descriptors either (seen: 30 open files of 64 KiB blocks, read with the
        # usual limit of 1,024 descriptors, answered EIO).
        self.open_blocks: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.open_replicas = 0

    # --- open and close ---------------------------------------------------------------------

    def acquire(self, ino: int, *, writer: bool, created: Inode | None = None) -> OpenFile:
        """Open state of ``ino`` for one more user. ``created``: the inode the same request
        just made (O_CREAT), which has no blocks yet, so nothing needs reading back."""
        if self._opened_while_settling is not None:
            self._opened_while_settling.add(ino)
        of = self.files.get(ino)
        if of is None:
            inode = created if created is not None else self.ns.get_inode(ino)
            blocks = {} if created is not None else self.ns.get_blocks(ino)
            of = OpenFile(ino, inode.size, inode.atime_ns, inode.mtime_ns, inode.ctime_ns,
                          blocks, unsynced=self.unsynced.setdefault(ino, set()))
            self.files[ino] = of
        of.users += 1
        of.writers += int(writer)
        return of

    def _lease(self, of: OpenFile) -> None:
        """The first change of a write session takes the lease (seed 002): from here a
        crash leaves a lease that the next mount recovers. A file opened for writing but
        never changed needs no recovery, so open and close cost no lease transactions.
        A first change that adds a block takes it in that block's transaction instead
        (``_write_new_block``): until then a crash leaves only orphan replica files."""
        if not of.leased:
            self.ns.take_lease(of.ino, self.session, now_ns())
            of.leased = True

    def release(self, of: OpenFile, *, writer: bool) -> None:
        """One user is done; once no writer is left, the lease (taken by a write or by a
        truncate, which a read-only O_TRUNC open also does) is persisted away."""
        of.users -= 1
        of.writers -= int(writer)
        try:
            if of.writers == 0 and of.leased:
                self.persist(of, drop_lease=True)
                of.leased = False
                of.bumped.clear()
            elif of.attrs_dirty or of.dirty:
                self.persist(of)
        finally:  # a failed persist (disk full) must not keep the file open forever
            if of.users == 0:
                self.retire_replicas(of)
                del self.files[of.ino]
                if not of.unsynced:
                    self.unsynced.pop(of.ino, None)

    def retire_replicas(self, of: OpenFile, indexes=None) -> None:
        """Stop using the open replicas of these blocks (all: None); the next use of a
        block opens them afresh."""
        for index in list(of.replicas) if indexes is None else indexes:
            self._retire(of, of.replicas.pop(index, []))
            of.writable.discard(index)
            self.open_replicas -= self.open_blocks.pop((of.ino, index), 0)

    def _count_open(self, of: OpenFile, index: int) -> None:
        """``of.replicas[index]`` was just set (opened, or fewer after a failure): count
        it, as the most recently used block."""
        key = (of.ino, index)
        self.open_replicas += len(of.replicas[index]) - self.open_blocks.pop(key, 0)
        self.open_blocks[key] = len(of.replicas[index])

    def _close_least_used(self, of: OpenFile) -> None:
        """Keep at most OPEN_BLOCKS_PER_FILE blocks of this file and ``max_open_replicas``
        replicas of all files open. Called when a request is done with its replicas (a
        read plan holds several blocks' replicas at once). A replica a worker thread is
        still reading is closed when that read is done (``_pinned``)."""
        while len(of.replicas) > OPEN_BLOCKS_PER_FILE:
            self.retire_replicas(of, [next(iter(of.replicas))])
        while self.open_replicas > self.max_open_replicas and self.open_blocks:
            ino, index = next(iter(self.open_blocks))
            owner = self.files.get(ino)
            if owner is None or index not in owner.replicas:  # cannot happen; never loop
                self.open_replicas -= self.open_blocks.pop((ino, index))
                continue
            self.retire_replicas(owner, [index])

    def _stop_using(self, of: OpenFile, index: int, replicas: list[Replica],
                    leaving: list[Replica]) -> list[Replica]:
        """The open ``replicas`` of a block without ``leaving``, which are closed: what the
        block is read and written through from now on (returned)."""
        kept = [r for r in replicas if r not in leaving]
        of.replicas[index] = kept
        self._count_open(of, index)
        self._retire(of, leaving)
        return kept

    def _retire(self, of: OpenFile, replicas: list[Replica]) -> None:
        of.retired.extend(replicas)
        self._close_retired(of)

    def _close_retired(self, of: OpenFile) -> None:
        """Close every retired replica that no worker thread is using now."""
        if of.retired:
            busy = [r for r in of.retired if of.pinned[r]]
            for replica in of.retired:
                if not of.pinned[replica]:
                    replica.close()
            of.retired = busy

    @contextmanager
    def _pinned(self, of: OpenFile, replicas):
        """Keep ``replicas`` open while a worker thread uses them, even if retired meanwhile
        (the trio thread goes on serving writes and truncates of the file)."""
        of.pinned.update(replicas)
        try:
            yield
        finally:
            for replica in replicas:
                of.pinned[replica] -= 1
                if not of.pinned[replica]:
                    del of.pinned[replica]
            self._close_retired(of)

    # --- persistence --------------------------------------------------------------------------

    def persist(self, of: OpenFile, *, drop_lease: bool = False) -> None:
        """Write the in-memory length, times and dirty block lengths in one transaction."""
        blocks = {i: of.blocks[i] for i in of.dirty if i in of.blocks}
        self.ns.persist_file(of.ino, size=of.size, mtime_ns=of.mtime_ns,
                             ctime_ns=of.ctime_ns, atime_ns=of.atime_ns, blocks=blocks,
                             drop_lease=drop_lease)
        of.dirty.clear()
        of.attrs_dirty = False

    def persist_all(self) -> None:
        """The one-second tick: every open file's metadata reaches the namespace. A file
        that cannot be persisted does not hold up the others; the first error is raised
        after all were tried."""
        first_error = None
        for of in list(self.files.values()):
            if of.attrs_dirty or of.dirty:
                try:
                    self.persist(of)
                except Exception as exc:  # noqa: BLE001 - re-raised below
                    first_error = first_error or exc
        if first_error is not None:
            raise first_error

    async def fsync(self, of: OpenFile, *, datasync: bool = False) -> None:
        """Make the file's data and all metadata durable before returning; with
        ``datasync`` (``fdatasync``, ``O_DSYNC``), the data and what finding it again needs.

        ``fdatasync`` of a file whose size and blocks the namespace already holds, durably,
        syncs only the replicas: its new times reach the namespace within a second, as
        other metadata does, and a namespace sync (an LMDB commit and fsync) is saved.

        A replica that cannot be synced (a failing disk, a file deleted behind the daemon's
        back) does not fail the fsync while its block has another replica that synced: it
        leaves the block, whose other replicas get a new stamp, as an HDFS write pipeline
        goes on without a failed DataNode, and the monitor makes a new one. A block none of
        whose replicas synced fails the fsync and stays unsynced, so that a later fsync
        tries it again. That retry succeeds once the disks do: the kernel reports a lost
        write-back to one fsync only, and the data it lost is lost, as on any Linux
        filesystem; the failed fsync is what tells the writer."""
        async with of.lock:
            replicas_only = datasync and self._namespace_has_durably(of)
            if not replicas_only:
                self.persist(of)
            blocks = [i for i in sorted(of.unsynced) if i in of.blocks]
            replicas = [(i, r) for i in blocks if i in of.replicas for r in of.replicas[i]]
            closed = [(i, self.volumes.get(v), of.blocks[i].block_id, of.blocks[i].gs)
                      for i in blocks if i not in of.replicas
                      for v in of.blocks[i].volumes if v in self.volumes.by_id]
            of.unsynced.clear()
            try:
                with self._pinned(of, [replica for _, replica in replicas]):
                    if replicas_only:
                        failed = await trio.to_thread.run_sync(self._fsync_replicas,
                                                               replicas, closed)
                    else:
                        failed = await self._sync_namespace_after(self._fsync_replicas,
                                                                  replicas, closed)
            except BaseException:
                of.unsynced.update(blocks)  # nothing is known to be durable
                raise
            failed += self._failed_before(of)
            if failed:
                tried = Counter(i for i, _ in replicas) + Counter(i for i, *_ in closed)
                restamped, error = self._after_failed_fsyncs(of, tried, failed)
                if restamped:
                    await self.sync_namespace()  # the new stamps, before anything returns
                if error is not None:
                    raise error

    def _failed_before(self, of: OpenFile) -> list[tuple[int, int, FsError]]:
        """Replicas an earlier fsync found failing and could not drop (``failed_syncs``),
        as failures of this one, while their block still lists them."""
        failed = []
        for index, volume_ids in self.failed_syncs.pop(of.ino, {}).items():
            rec = of.blocks.get(index)
            for volume_id in sorted(volume_ids & set(rec.volumes if rec else ())):
                failed.append((index, volume_id, FsError(
                    errno.EIO, "failed an earlier fsync (the kernel reports that once)")))
        return failed

    def _namespace_has_durably(self, of: OpenFile) -> bool:
        """Whether the namespace holds the file's size and blocks as they are in memory,
        and nothing committed is waiting for a namespace sync."""
        blocks = {i: of.blocks[i] for i in of.dirty if i in of.blocks}
        return self.ns.all_synced and self.ns.records_file(of.ino, of.size, blocks)

    @staticmethod
    def _fsync_replicas(replicas: list, closed: list) -> list[tuple[int, int, FsError]]:
        """Open replicas through their descriptors, the others (closed since they were
        written, see OPEN_BLOCKS_PER_FILE) by name; returns (block index, volume id, error)
        of each that failed. Running out of descriptors is nobody's fault: it is raised."""
        failed = []
        for index, replica in replicas:
            try:
                replica.fsync()
            except FsError as exc:
                failed.append((index, replica.volume.id, exc))
        for index, volume, block_id, gs in closed:
            try:
                volume.sync_replica(block_id, gs)
            except FsError as exc:
                if exc.errno in OUT_OF_DESCRIPTORS:
                    raise
                failed.append((index, volume.id, exc))
        return failed

    def _after_failed_fsyncs(self, of: OpenFile, tried: Counter,
                             failed: list[tuple[int, int, FsError]]
                             ) -> tuple[bool, FsError | None]:
        """A block some of whose replicas synced goes on without the others, as a write
        pipeline does: they may hold an older version at the same stamp, which a power
        loss would leave looking intact beside the synced one. A block none of whose
        replicas synced stays unsynced, its replicas go to the monitor, and the fsync
        fails (ENOSPC if that is what every one of them met). Returns whether blocks were
        re-stamped (the namespace must be synced before the fsync returns) and the error
        to raise, if any."""
        failed_volumes: dict[int, set[int]] = {}
        for index, volume_id, exc in failed:
            log.error("fsync of inode %d, block index %d: replica on volume %d failed: %s",
                      of.ino, index, volume_id, exc)
            failed_volumes.setdefault(index, set()).add(volume_id)
        lost = sorted(index for index, volumes in failed_volumes.items()
                      if len(volumes) == tried[index])
        of.unsynced.update(lost)
        for index, volume_id, exc in failed:
            if index in lost:
                self.on_bad_replica(of.ino, index, volume_id, str(exc))
        restamped = False
        partly = [i for i in failed_volumes if i not in lost and i in of.blocks]
        for n, index in enumerate(partly):
            try:
                restamped |= self._drop_unsynced(of, index, failed_volumes[index])
            except BaseException:
                # The failed replicas are still in these blocks: the next fsync syncs
                # every recorded replica again (by name) and drops these whatever that
                # sync says; the monitor hears of them too, should no fsync come.
                of.unsynced.update(partly[n:])
                self.retire_replicas(of, [index])
                remembered = self.failed_syncs.setdefault(of.ino, {})
                for later in partly[n:]:
                    remembered.setdefault(later, set()).update(failed_volumes[later])
                    for volume_id in failed_volumes[later]:
                        self.on_bad_replica(of.ino, later, volume_id, "failed to sync")
                raise
        if not lost:
            return restamped, None
        errors = [exc for index, _, exc in failed if index in lost]
        code = errno.ENOSPC if all(e.errno == errno.ENOSPC for e in errors) else errno.EIO
        return restamped, FsError(code, f"no replica of block(s) {lost} of inode {of.ino} "
                                        f"could be synced: {errors[0]}")

    def _drop_unsynced(self, of: OpenFile, index: int, volume_ids: set[int]) -> bool:
        """Take the replicas on ``volume_ids``, which failed to sync, out of the block:
        the others get a new generation stamp (opened for it if they were closed), so
        the failed ones are stale from now on. Returns whether the block changed."""
        gs = of.blocks[index].gs
        replicas = self._replicas(of, index, writable=True)
        volume_ids = volume_ids & set(of.blocks[index].volumes)  # opening may drop some
        if volume_ids:
            bad = [r for r in replicas if r.volume.id in volume_ids]
            good = self._stop_using(of, index, replicas, bad) if bad else replicas
            self._drop_from_pipeline(of, index, good, sorted(volume_ids))
            if not of.leased:
                # No write session: the next one must take a stamp of its own, or a copy
                # the monitor makes meanwhile (it waits only for writers) would be
                # recorded at this stamp with the data from before that session's writes.
                of.bumped.discard(index)
        return of.blocks[index].gs != gs

    def closed_unsynced_files(self) -> int:
        """Files no longer open whose unsynced blocks are remembered (every open file has
        an entry in ``unsynced`` too)."""
        return len(self.unsynced) - len(self.files)

    async def settle_unsynced(self) -> int:
        """Forget the unsynced blocks of files no longer open, once a syncfs of every
        volume has made them durable; returns how many files were forgotten. A file opened
        while the syncfs runs keeps its record (it may have been written again since).

        A failed syncfs disables this for the rest of the mount: the kernel reports a
        write-back error to one syncfs only, so a later one would succeed and forget blocks
        that never reached the disk, and a later fsync of their file would succeed too.
        (Nor does a kernel before 5.8 report write-back errors through syncfs at all.)
        """
        if self.settling_failed is not None:
            return 0
        settled = {ino: set(blocks) for ino, blocks in self.unsynced.items()
                   if ino not in self.files}
        if not settled:
            return 0
        self._opened_while_settling = opened = set()
        try:
            await trio.to_thread.run_sync(self.volumes.sync_filesystems)
        except FsError as exc:
            self.settling_failed = str(exc)
            log.error("%s: the unsynced blocks of closed files stay remembered until "
                      "they are fsynced or unlinked", exc)
            return 0
        finally:
            self._opened_while_settling = None
        forgotten = 0
        for ino, blocks in settled.items():
            remembered = self.unsynced.get(ino)
            if remembered is None or ino in opened or ino in self.files:
                continue
            remembered -= blocks
            if not remembered:
                del self.unsynced[ino]
                forgotten += 1
        return forgotten

    async def sync_all(self) -> None:
        """syncfs: every open file's data and the whole namespace."""
        for of in list(self.files.values()):
            await self.fsync(of)
        await self.sync_namespace()

    async def sync_namespace(self) -> None:
        """Make every committed transaction durable (fsyncdir, the one-second tick)."""
        await self._sync_namespace_after(lambda: None)

    async def _sync_namespace_after(self, work: Callable, *args):
        """In a worker thread: ``work(*args)``, then sync the namespace; returns what
        ``work`` returned."""
        with self._deleting_deferred_trash_after_sync():
            return await trio.to_thread.run_sync(_then_sync, work, args, self.ns)

    def sync_namespace_now(self) -> bool:
        """The same, in the event loop: for a write that found no room while deleted
        blocks still hold space. Returns whether any files were deleted."""
        if not self.deferred_trash:
            return False
        with self._deleting_deferred_trash_after_sync():
            self.ns.sync()
        return True

    @contextmanager
    def _deleting_deferred_trash_after_sync(self):
        """Around a namespace sync: the whole blocks dropped before it began are deleted
        once it succeeded (a failure to delete is not the caller's: the trash rows stay,
        and the next mount deletes them); if it failed, they wait for the next one."""
        synced, self.deferred_trash = self.deferred_trash, []
        try:
            yield
        except BaseException:
            self.deferred_trash[:0] = synced
            raise
        try:
            self.delete_trash(synced)
        except FsError as exc:
            log.warning("replica files of dropped blocks left for the next mount: %s", exc)

    # --- replicas ------------------------------------------------------------------------------

    def _replicas(self, of: OpenFile, index: int, *, writable: bool) -> list[Replica]:
        """Open replicas of a block (fastest storage type first), cached while open.

        A replica that cannot be opened (missing, stale: its meta file has another GS,
        unreadable volume) is reported; for writing it is dropped from the pipeline. When
        the daemon is out of descriptors (EMFILE, ENFILE) nothing is wrong with the
        replica: the request fails with that error and the replica stays as it is.
        """
        if index in of.replicas and (not writable or index in of.writable):
            if index != next(reversed(of.replicas)):
                of.replicas[index] = of.replicas.pop(index)  # most recently used: last
            self.open_blocks.move_to_end((of.ino, index))
            return of.replicas[index]
        self.retire_replicas(of, [index])
        rec = of.blocks[index]
        opened, failed = [], []
        for volume in self.volumes.sorted_for_read(rec.volumes):
            try:
                opened.append(volume.open_replica(rec.block_id, rec.gs, writable=writable))
            except FsError as exc:
                if exc.errno in OUT_OF_DESCRIPTORS:
                    for replica in opened:
                        replica.close()
                    raise
                log.error("replica of block %d on %s unusable: %s", rec.block_id,
                          volume.path, exc)
                failed.append(volume.id)
                self.on_bad_replica(of.ino, index, volume.id, str(exc))
        of.replicas[index] = opened
        self._count_open(of, index)
        if writable:
            of.writable.add(index)
            if failed:
                self._drop_from_pipeline(of, index, opened, failed)
        return opened

    def _drop_from_pipeline(self, of: OpenFile, index: int, good: list[Replica],
                            failed: list[int]) -> None:
        """Replicas failed during a write: the survivors get a new GS (so the failed ones
        are stale from now on), the block record loses the failed volumes, and the block
        is handed over for re-replication. No survivor: the write fails with EIO."""
        self._restamp(of, index, good, leaving=failed)
        log.warning("block %d of inode %d continues on %d replica(s) without volume(s) %s",
                    of.blocks[index].block_id, of.ino, len(good), failed)

    # --- read ----------------------------------------------------------------------------------

    async def read(self, of: OpenFile, offset: int, size: int):
        """Verified data (bytes-like); holes and the unwritten tail of a block read as zeros.

        The plan (which replicas, which ranges) is made here in the trio thread. A read the
        page cache can serve runs right here; one that would wait for a disk (or more than a
        millisecond for the lock of a block another thread is reading) goes to a worker
        thread, so a cached read pays for no thread hop and a disk read does not hold up
        other requests (measured: README, "Speed").
        """
        while True:
            truncations = of.truncations
            plan = self._plan_read(of, offset, size)
            if not plan:
                return b""
            self._touch_atime(of)
            bad: list[tuple[int, int, str]] = []
            short: list[tuple[int, int, int]] = []
            try:
                data = _execute_read(plan, of.ino, bad, short, nowait=True)
                if data is None:
                    bad.clear()  # the thread tries every replica again and reports anew
                    short.clear()
                    with self._pinned(of, _plan_replicas(plan)):
                        data = await trio.to_thread.run_sync(_execute_read, plan, of.ino,
                                                             bad, short)
                return data
            except _ShortRead as exc:
                if of.truncations != truncations:
                    continue  # truncated (perhaps regrown) while the read ran: plan again
                raise FsError(errno.EIO, f"no complete replica of block {exc.block_id} of "
                                         f"inode {of.ino}") from None
            finally:
                self._report_read_failures(of, bad, short, of.truncations != truncations)
                self._close_least_used(of)

    def _report_read_failures(self, of: OpenFile, bad: list, short: list,
                              truncated: bool) -> None:
        """Bad replicas go to the monitor. A replica shorter than planned is bad only if
        the file was not truncated meanwhile (a truncate racing a read is not damage, even
        when the file grew back before the read returned)."""
        for index, volume_id, reason in bad:
            self.on_bad_replica(of.ino, index, volume_id, reason)
        if truncated:
            return
        for index, volume_id, planned_end in short:
            if index in of.blocks:
                rec = of.blocks[index]
                reason = f"replica shorter than its block's {rec.length} bytes"
                log.error("read of block %d (index %d) of inode %d from volume %d failed: %s",
                          rec.block_id, index, of.ino, volume_id, reason)
                self.on_bad_replica(of.ino, index, volume_id, reason)

    def _plan_read(self, of: OpenFile, offset: int, size: int) -> list:
        """Segments in order: an int is that many zero bytes; else (replicas, boff, count,
        wanted) reads ``count`` bytes and pads them with zeros to ``wanted``."""
        end = min(offset + size, of.size)
        plan: list = []
        pos = offset
        bs = self.block_size
        while pos < end:
            index, boff = divmod(pos, bs)
            count = min(bs - boff, end - pos)
            rec = of.blocks.get(index)
            if rec is None or boff >= rec.length:
                plan.append(count)
            else:
                # a tuple: a write may change the block's list while a thread reads
                replicas = tuple(self._replicas(of, index, writable=index in of.writable))
                plan.append((replicas, boff, min(count, rec.length - boff), count,
                             rec.block_id, index))
            pos += count
        return plan

    def _touch_atime(self, of: OpenFile) -> None:
        """The mount's atime rule (``fs/times.py``), kept in memory with the file's other
        times."""
        now = now_ns()
        if self.atime_rule.due(of.atime_ns, of.mtime_ns, of.ctime_ns, now):
            of.atime_ns = now
            of.attrs_dirty = True

    # --- write ---------------------------------------------------------------------------------

    def write(self, of: OpenFile, offset: int, data, *, stamp_times: bool = True) -> int:
        """Write ``data`` at ``offset``; returns the byte count (all or an error).
        ``stamp_times``: set mtime and ctime to now (False where the caller owns them)."""
        view = memoryview(data)
        total = len(view)
        pos = 0
        bs = self.block_size
        try:
            while pos < total:
                index, boff = divmod(offset + pos, bs)
                count = min(bs - boff, total - pos)
                piece = view[pos:pos + count]
                try:
                    self._write_piece(of, index, boff, piece)
                except FsError as exc:
                    # no room: maybe only until the blocks a truncate or unlink just
                    # dropped are deleted (they wait for the namespace sync)
                    if exc.errno != errno.ENOSPC or not self.sync_namespace_now():
                        raise
                    self._write_piece(of, index, boff, piece)
                of.dirty.add(index)
                of.unsynced.add(index)
                self._close_least_used(of)
                pos += count
        except FsError:
            if pos == 0:
                raise
            # A later block failed (no room): report the bytes that are written, as a
            # short write (POSIX), so the size covers every block already recorded.
            log.warning("short write to inode %d: %d of %d bytes", of.ino, pos, total)
        if offset + pos > of.size:
            of.size = offset + pos
        if stamp_times:
            of.mtime_ns = of.ctime_ns = now_ns()
        of.attrs_dirty = True
        if (offset + pos) % bs == 0:
            self.persist(of)  # a block filled: its length reaches the namespace
        return pos

    def _write_piece(self, of: OpenFile, index: int, boff: int, piece) -> None:
        if index in of.blocks:
            self._write_existing(of, index, boff, piece)
        else:
            self._write_new_block(of, index, boff, piece)

    def _write_existing(self, of: OpenFile, index: int, boff: int, piece) -> None:
        self._lease(of)
        rec = of.blocks[index]
        replicas = self._replicas(of, index, writable=True)
        if not replicas:
            raise FsError(errno.EIO, f"block {rec.block_id} has no writable replica")
        growth = max(0, boff + len(piece) - rec.length)
        good, failed = [], []
        for replica in replicas:
            try:
                room = not growth or replica.volume.has_room(growth)
            except FsError as exc:  # the volume vanished: this replica leaves the pipeline
                log.error("volume %s of block %d unusable: %s", replica.volume.path,
                          rec.block_id, exc)
                failed.append(replica)
                continue
            if not room:
                raise FsError(errno.ENOSPC, f"volume {replica.volume.path} is full")
        if failed:
            replicas = self._stop_using(of, index, replicas, failed)
            self._drop_from_pipeline(of, index, replicas, [r.volume.id for r in failed])
            failed = []
        if index not in of.bumped:
            self._restamp(of, index, replicas)  # first change this session
        for replica in replicas:
            try:
                replica.write(boff, piece)
                good.append(replica)
            except FsError as exc:
                if len(replicas) == 1:
                    raise
                log.error("write to block %d on %s failed: %s", rec.block_id,
                          replica.volume.path, exc)
                failed.append(replica)
        if failed:
            good = self._stop_using(of, index, replicas, failed)
            self._drop_from_pipeline(of, index, good, [r.volume.id for r in failed])
        if boff + len(piece) > rec.length:
            rec.length = boff + len(piece)

    def _restamp(self, of: OpenFile, index: int, replicas: list[Replica],
                 leaving: Sequence[int] = ()) -> None:
        """A new generation stamp for a block: on the meta files of ``replicas`` first,
        then in the namespace, in the transaction that also drops the volumes in
        ``leaving``. A replica whose meta file cannot take it leaves as well, and the
        others carry on (``replicas`` is updated in place); none left: EIO. Any replica
        left behind at the old stamp is stale from then on, and the block goes to the
        monitor for new copies."""
        rec = of.blocks[index]
        gs = self.ns.reserve("gs")
        failed = []
        for replica in replicas:
            try:
                replica.set_gs(gs)
            except FsError as exc:
                log.error("new generation stamp for block %d on %s failed: %s",
                          rec.block_id, replica.volume.path, exc)
                failed.append(replica)
        if len(failed) == len(replicas):
            raise FsError(errno.EIO, f"no replica of block {rec.block_id} is left to take "
                                     f"a new generation stamp")
        if failed:
            replicas[:] = self._stop_using(of, index, replicas, failed)
        dropped = tuple(leaving) + tuple(r.volume.id for r in failed)
        try:
            if dropped:
                self.ns.drop_replicas(of.ino, index, dropped, gs)
            else:
                self.ns.set_block_gs(of.ino, index, gs)
        except BaseException:
            # The namespace keeps the old stamp: so must the replicas, or the next open
            # at that stamp would take them for missing and drop the good ones.
            for replica in replicas:
                try:
                    replica.set_gs(rec.gs)
                except FsError as exc:
                    log.error("generation stamp of block %d on %s not put back: %s",
                              rec.block_id, replica.volume.path, exc)
            raise
        if dropped:
            rec.volumes = tuple(v for v in rec.volumes if v not in dropped)
            self.delete_trash(self.ns.last_trash)
            self.on_needs_replication(of.ino, index)
        rec.gs = gs
        of.bumped.add(index)

    def _write_new_block(self, of: OpenFile, index: int, boff: int, piece) -> None:
        """Create the replicas (durably: files and directory fsynced), write the first data,
        then record the block. The data itself becomes durable on fsync, like any write."""
        volumes, replication = self.placer(of.ino, self.block_size)
        block_id = self.ns.reserve("next_block_id")
        gs = self.ns.reserve("gs")
        replicas: list[Replica] = []
        try:
            for volume in volumes:
                replica = volume.create_replica(block_id, gs, self.bpc)
                replicas.append(replica)
                replica.write(boff, piece)
            rec = BlockRecord(block_id, gs, boff + len(piece), tuple(v.id for v in volumes))
            lease = None if of.leased else (self.session, now_ns())
            self.ns.add_block(of.ino, index, rec, lease)
            of.leased = True
        except BaseException:
            for replica, volume in zip(replicas, volumes):
                replica.close()
                volume.delete_replica(block_id, gs)
            raise
        of.blocks[index] = rec
        of.replicas[index] = sorted(replicas, key=lambda r: int(r.volume.storage_type))
        self._count_open(of, index)
        if sum(not v.storage_type.transient for v in volumes) < replication:
            # lazy persist (RAM_DISK only), or too few allowed volumes had room
            self.on_needs_replication(of.ino, index)
        of.writable.add(index)
        of.bumped.add(index)

    # --- truncate ------------------------------------------------------------------------------

    async def truncate(self, of: OpenFile, new_size: int) -> None:
        """Shrink (drop whole blocks, cut the last under a new GS) or grow (a hole)."""
        async with of.lock:
            self._lease(of)
            now = now_ns()
            if new_size < of.size:
                # The lease first records the target size, so a crash at any step is
                # completed by recovery to exactly that size (never the old size with
                # zeros where cut data was); persist() clears the mark with the size. A
                # block cut in place needs that record on disk first: a power loss could
                # otherwise keep the cut replica and lose the truncate.
                self.ns.take_lease(of.ino, self.session, now, truncate_to=new_size)
                if self._cut_in_place(of, new_size) is not None:
                    await trio.to_thread.run_sync(self.ns.sync)
                self._shrink(of, new_size, now)
            if new_size != of.size:  # to the same size the kernel shows no new times either
                of.mtime_ns = of.ctime_ns = now
            of.size = new_size
            self.persist(of)

    def _cut_in_place(self, of: OpenFile, new_size: int) -> int | None:
        """Index of the block a truncate to ``new_size`` cuts short (None: it only drops
        whole blocks)."""
        last = -(-new_size // self.block_size) - 1
        rec = of.blocks.get(last)
        cut_at = new_size - last * self.block_size
        return last if rec is not None and rec.length > cut_at else None

    def _shrink(self, of: OpenFile, new_size: int, now: int) -> None:
        """Cut the file to ``new_size`` (the lease already records the target)."""
        of.truncations += 1
        bs = self.block_size
        keep = -(-new_size // bs)
        last = self._cut_in_place(of, new_size)
        if last is not None:
            rec = of.blocks[last]
            cut_at = new_size - last * bs
            replicas = self._replicas(of, last, writable=True)
            if last not in of.bumped:
                self._restamp(of, last, replicas)  # first change this session
            for replica in replicas:
                replica.truncate(cut_at)
            rec.length = cut_at
            of.dirty.add(last)
            of.unsynced.add(last)
        dropped = [i for i in of.blocks if i >= keep]
        self.retire_replicas(of, dropped)
        for index in dropped:
            del of.blocks[index]
            of.dirty.discard(index)
            of.unsynced.discard(index)
            of.bumped.discard(index)
        if dropped:
            self.defer_trash(self.ns.truncate_blocks(of.ino, keep, new_size, now))

    # --- deletion of replica files ---------------------------------------------------------------

    def forget(self, ino: int) -> None:
        """The inode is purged: nothing of it is left to sync."""
        self.unsynced.pop(ino, None)
        self.failed_syncs.pop(ino, None)

    def delete_trash(self, trash) -> None:
        """Delete the files of replicas the namespace already dropped, then forget them."""
        if trash:
            self.ns.trash_done(self.volumes.delete_replicas(trash))

    def defer_trash(self, trash) -> None:
        """Whole blocks dropped: delete their files after the next namespace sync."""
        self.deferred_trash.extend(trash)


def replica_budget() -> int:
    """How many replicas the daemon may keep open: what its soft limit of descriptors
    leaves after RESERVED_FDS, at FDS_PER_REPLICA each (at least 16, so that a tiny limit
    still lets a read span a few blocks; the mount raises the limit first)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, (soft - RESERVED_FDS) // FDS_PER_REPLICA)


def _then_sync(work: Callable, args: tuple, ns: Namespace):
    result = work(*args)
    ns.sync()
    return result


def _plan_replicas(plan: list) -> list[Replica]:
    return [r for segment in plan if not isinstance(segment, int) for r in segment[0]]


class _ShortRead(Exception):
    """Every replica of a block was unreadable and some were shorter than planned."""

    def __init__(self, index: int, block_id: int, planned_end: int):
        super().__init__(index)
        self.index, self.block_id, self.planned_end = index, block_id, planned_end


def _execute_read(plan: list, ino: int, bad: list, short: list, nowait: bool = False):
    """Carry out a read plan; fails over between replicas, EIO when none is readable.

    Runs in the trio thread or a worker thread: it touches only the replicas it was given
    (thread-safe, and never closed while the file is open). Replicas that failed are
    appended to ``bad`` as (block index, volume id, reason), replicas shorter than planned
    to ``short`` as (block index, volume id, planned end), for the caller to judge. With
    ``nowait``, None as soon as a replica's data is not in the page cache.
    """
    pieces = []
    for segment in plan:
        if isinstance(segment, int):
            pieces.append(bytes(segment))
            continue
        replicas, boff, count, wanted, block_id, index = segment
        was_short = False
        for replica in replicas:
            try:
                data = replica.read(boff, count, nowait=nowait)
            except FsError as exc:
                log.error("read of block %d from %s failed: %s", block_id,
                          replica.volume.path, exc)
                bad.append((index, replica.volume.id, str(exc)))
                continue
            if data is None:
                return None
            if len(data) == count:
                break
            # Shorter than planned: the replica lost data, or the block was truncated
            # meanwhile (the caller tells which). Never serve the missing bytes as zeros.
            short.append((index, replica.volume.id, boff + count))
            was_short = True
        else:
            if was_short:
                raise _ShortRead(index, block_id, boff + count)
            raise FsError(errno.EIO, f"no readable replica of block {block_id} of inode {ino}")
        pieces.append(data if len(data) == wanted else bytes(data) + bytes(wanted - len(data)))
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
