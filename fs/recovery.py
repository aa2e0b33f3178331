"""Mount-time recovery: bring a namespace and its volumes back to a clean state.

Runs before the mount serves any request, so nothing else touches the namespace:

1. trash: delete replica files of blocks dropped by committed transactions;
2. leases left by a dead daemon (seed 002, "Lease recovery"): re-verify the file's blocks and
   settle each block's length, take a new generation stamp for the last block, close the lease;
3. orphans: inodes unlinked while open are purged (the kernel has forgotten everything);
4. a scan of every volume removes replica files the namespace does not know (blocks created
   but never recorded, "pre-historic" blocks from a volume that was away, replicas dropped
   while their volume failed) and stale meta files, and records a whole, verified replica
   of a known block at its current stamp that its volume was not recorded as holding (as
   an HDFS block report adds a reported replica to the block map). It runs at every mount,
   not only after an unclean stop: a volume can come back with old blocks after a clean one.

What a crash can leave, and what repairs it:

=====================================  ================================================
crash between ...                      state found, and repair
=====================================  ================================================
block files fsynced / block recorded   orphan files: removed by the volume scan (4)
replica copied / copy recorded         a whole replica not recorded on its volume:
                                       verified and recorded by the volume scan (4)
meta renamed to new GS / GS recorded   replica GS > namespace GS: adopted in (2), or
                                       in (4) when the lease was not on disk either
data pwrite / meta CRC pwrite          a chunk fails its CRC: re-checksummed below the
                                       persisted length, the length stops there above it
block dropped / files deleted          trash entry: files deleted in (1)
unlink while open / last close         orphan inode: purged in (3)
=====================================  ================================================
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field

from tierfs.backends.verify import verify_replica
from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs import schema
from tierfs.fs.errors import FsError
from tierfs.fs.namespace import Namespace
from tierfs.fs.resolver import Resolver
from tierfs.fs.schema import BlockRecord, Inode, Op, u64

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    trash_deleted: int = 0
    leases_recovered: int = 0
    orphans_purged: int = 0
    orphan_replicas_removed: int = 0
    stale_meta_removed: int = 0
    stale_replicas_dropped: int = 0
    newer_replicas_adopted: int = 0
    unrecorded_replicas_adopted: int = 0
    chunks_rechecksummed: int = 0
    missing_replicas: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return ", ".join(f"{k.replace('_', ' ')}: {v if isinstance(v, int) else len(v)}"
                         for k, v in vars(self).items())


def delete_trash(ns: Namespace, volumes: VolumeSet) -> int:
    """Every pending trash row whose volumes are there; returns how many were done. The
    namespace is synced first: files are never deleted before the drop is on disk."""
    ns.sync()
    done = volumes.delete_replicas(ns.trash())
    ns.trash_done(done)
    return len(done)


def recover(ns: Namespace, volumes: VolumeSet) -> RecoveryReport:
    report = RecoveryReport()
    report.trash_deleted = delete_trash(ns, volumes)
    leased = ns.leases()
    for ino in leased:
        recover_lease(ns, volumes, ino, report)
        report.leases_recovered += 1
    for ino in ns.orphans():
        ns.purge(ino)
        report.orphans_purged += 1
    report.trash_deleted += delete_trash(ns, volumes)
    scan_volumes(ns, volumes, report, settled=set(leased))
    return report


def recover_lease(ns: Namespace, volumes: VolumeSet, ino: int, report: RecoveryReport) -> None:
    """Settle a file a dead daemon was writing, then close its lease."""
    try:
        inode = ns.get_inode(ino)
    except FsError:
        ns.drop_lease(ino)
        return
    bs = ns.config.block_size
    blocks = ns.get_blocks(ino)
    truncate_to = ns.lease_truncate_to(ino)
    dropped: dict[int, BlockRecord] = {}
    if truncate_to is not None:
        dropped = _finish_truncate(volumes, blocks, truncate_to, bs)
    settled: dict[int, BlockRecord] = {}
    for index, rec in sorted(blocks.items()):
        cap = None if truncate_to is None else max(0, truncate_to - index * bs)
        settled[index] = settle_block(ns, volumes, ino, index, rec, report, cap=cap)
    last = max(settled, default=None)
    if last is not None and settled[last].volumes:
        gs = ns.reserve("gs")
        for vid in settled[last].volumes:
            replica = volumes.get(vid).open_replica(settled[last].block_id, settled[last].gs,
                                                    writable=True)
            try:
                replica.set_gs(gs)
            finally:
                replica.close()
        settled[last].gs = gs
    size = inode.size
    if truncate_to is not None:
        size = truncate_to
    elif last is not None:
        size = max(size, last * bs + settled[last].length)

    def body(w) -> None:
        txn = w.txn
        current = Inode.unpack(ino, txn.get(u64(ino), db=ns.db["inodes"]))
        current.size = size
        txn.put(u64(ino), current.pack(), db=ns.db["inodes"])
        for index, rec in dropped.items():
            ns._drop_block(w, ino, index, rec)
        for index, rec in settled.items():
            old = blocks[index]
            for vid in set(old.volumes) - set(rec.volumes):
                txn.delete(schema.replica_key(vid, rec.block_id), db=ns.db["replicas"])
            txn.put(schema.block_key(ino, index), rec.pack(), db=ns.db["blocks"])
        txn.delete(u64(ino), db=ns.db["leases"])

    ns.run(Op.RECOVER, (ino, size), body)
    delete_trash(ns, volumes)
    log.info("recovered lease of inode %d: size %d%s", ino, size,
             " (truncate completed)" if truncate_to is not None else "")


def _finish_truncate(volumes: VolumeSet, blocks: dict[int, BlockRecord], size: int,
                     block_size: int) -> dict[int, BlockRecord]:
    """A truncate to ``size`` was under way: remove the blocks past it from ``blocks``
    (returned, for the recovery transaction to drop) and cut the last block's replicas,
    whatever generation stamp each carries, to their part of ``size``."""
    keep = -(-size // block_size)
    dropped = {i: blocks.pop(i) for i in sorted(blocks) if i >= keep}
    last = keep - 1
    rec = blocks.get(last)
    cut = size - last * block_size
    if rec is not None and rec.length > cut:
        for vid in rec.volumes:
            volume = volumes.by_id.get(vid)
            gss = volume.meta_gss(rec.block_id) if volume is not None else []
            if not gss:
                continue
            try:
                replica = volume.open_replica(rec.block_id, max(gss), writable=True)
            except FsError:
                continue  # settle_block judges it
            try:
                if replica.length > cut:
                    replica.truncate(cut)
            except FsError as exc:  # a torn chunk at the cut: settle_block caps and judges
                log.warning("cutting block %d on volume %d: %s", rec.block_id, vid, exc)
            finally:
                replica.close()
        blocks[last] = BlockRecord(rec.block_id, rec.gs, cut, rec.volumes)
    return dropped


def settle_block(ns: Namespace, volumes: VolumeSet, ino: int, index: int, rec: BlockRecord,
                 report: RecoveryReport, cap: int | None = None) -> BlockRecord:
    """One block of a leased file: newest replicas kept, data re-verified, length agreed.

    Replicas are judged against each other before anything is changed. Below the persisted
    length the data was acknowledged: a replica that is shorter there, or has a chunk that
    fails its checksum while another replica is intact, is corrupt and dropped (never the
    intact one cut to match it). Only when no replica is intact below the persisted length
    (a torn overwrite with nothing better, e.g. replication 1) are the torn chunks kept and
    re-checksummed: unsynced data, which POSIX lets a crash leave old, new or mixed. Beyond
    the persisted length data counts while its chunks verify; the length is the smallest
    among the replicas kept (seed 002), and longer ones are cut to it.
    """
    bpc = ns.config.bytes_per_checksum
    found = {}
    for vid in rec.volumes:
        volume = volumes.by_id.get(vid)
        try:
            gss = volume.meta_gss(rec.block_id) if volume is not None else []
        except FsError:
            gss = []
        if not gss or max(gss) < rec.gs:
            report.missing_replicas.append(f"block {rec.block_id} on volume {vid}")
            log.error("replica of block %d on volume %d is missing or stale", rec.block_id, vid)
            continue
        found[vid] = max(gss)
    gs = max(found.values(), default=rec.gs)
    scans: list[_ReplicaScan] = []
    for vid, replica_gs in found.items():
        volume = volumes.get(vid)
        for old_gs in volume.meta_gss(rec.block_id):
            if old_gs < gs:
                os.unlink(volume.meta_path(rec.block_id, old_gs))
                report.stale_meta_removed += 1
        if replica_gs < gs:
            continue  # an older version than a sibling replica: stale
        try:
            scans.append(_scan_replica(volume, rec.block_id, gs, rec.length, bpc))
        except FsError as exc:  # data file gone, meta header damaged: as good as missing
            report.missing_replicas.append(f"block {rec.block_id} on volume {vid}: {exc}")
            log.error("replica of block %d on volume %d unusable: %s", rec.block_id, vid, exc)
    if not scans:
        return BlockRecord(rec.block_id, rec.gs, rec.length, ())
    intact = [r for r in scans if r.data_len >= rec.length and not r.bad_below]
    if intact:
        for r in scans:
            if r not in intact:
                report.missing_replicas.append(f"block {rec.block_id} on volume {r.vid}")
                log.warning("replica of block %d on volume %d is short or torn below the "
                            "persisted length while another is intact: dropped",
                            rec.block_id, r.vid)
        good = intact
    else:
        good = scans
        for r in good:
            _rechecksum(volumes.get(r.vid), rec.block_id, gs, r.bad_below, bpc, report)
    length = min(r.verified_end for r in good)
    if cap is not None:
        length = min(length, cap)  # a truncate to this point was under way
    kept = []
    for r in good:
        replica = volumes.get(r.vid).open_replica(rec.block_id, gs, writable=True)
        try:
            if replica.length > length:
                replica.truncate(length)
            replica.fsync()
            kept.append(r.vid)
        except FsError as exc:  # cannot be cut to the agreed length: not a good replica
            report.missing_replicas.append(f"block {rec.block_id} on volume {r.vid}: {exc}")
            log.warning("replica of block %d on volume %d dropped: %s", rec.block_id,
                        r.vid, exc)
        finally:
            replica.close()
    return BlockRecord(rec.block_id, gs, length, tuple(kept))


@dataclass
class _ReplicaScan:
    """What a read-only pass over one replica of a leased block found."""

    vid: int
    data_len: int
    bad_below: list[int]   # offsets of chunks below the persisted length that fail
    verified_end: int      # end of the data that counts (see settle_block)


def _scan_replica(volume, block_id: int, gs: int, persisted: int, bpc: int) -> _ReplicaScan:
    replica = volume.open_replica(block_id, gs, writable=False)
    try:
        data_len = replica.length
        bad_below: list[int] = []
        offset = 0
        while offset < data_len:
            count = min(bpc, data_len - offset)
            try:
                replica.read(offset, count)
            except FsError:
                if offset >= persisted:
                    break
                bad_below.append(offset)
            offset += count
        return _ReplicaScan(volume.id, data_len, bad_below, min(offset, data_len))
    finally:
        replica.close()


def _rechecksum(volume, block_id: int, gs: int, offsets: list[int], bpc: int,
                report: RecoveryReport) -> None:
    """Accept torn chunks as they are: recompute their checksums from the data."""
    if not offsets:
        return
    replica = volume.open_replica(block_id, gs, writable=True)
    fd = os.open(volume.data_path(block_id), os.O_RDONLY)
    try:
        for offset in offsets:
            replica.write(offset, os.pread(fd, min(bpc, replica.length - offset), offset))
            report.chunks_rechecksummed += 1
    finally:
        os.close(fd)
        replica.close()


def scan_volumes(ns: Namespace, volumes: VolumeSet, report: RecoveryReport,
                 settled: set[int] = frozenset()) -> None:
    """Remove replica files the namespace does not refer to, and stale replicas.

    A replica of a known block whose meta file carries an older generation stamp than the
    namespace's, or that lacks its data or meta file, is never served: its files are
    deleted and the volume is dropped from the block, so the replication monitor restores
    the replica count. Older meta files beside a current one are simply removed.

    A replica with a newer generation stamp than the namespace's was re-stamped by a write
    session whose transactions (the new GS, the lease) did not reach the disk before a
    power loss: its file is settled like a leased one, adopting the newest replicas.

    Files of a known block on a volume the block does not record are kept and recorded
    when the block needs them (``adopt_replica``); anything else of such a block is
    removed. Blocks of the files in ``settled`` (whose leases recovery just settled), and
    of files with a replica newer than the namespace (settled below), are not considered:
    tierfs never copies a block of a file open for writing, and settling may re-stamp or
    cut the block. Files of a block whose record lists their volume, but whose replicas
    index row is missing, are a replica all the same: kept (fsck repairs the index).
    """
    stale: list[tuple[bytes, int, int]] = []  # (block key, volume id, block id)
    newer: set[int] = set()  # inodes with a replica newer than the namespace knows
    unrecorded: list[tuple[bytes, Volume, int]] = []  # (block key, volume, block id)
    trashed = {block_id for block_id, _, _ in ns.trash()}
    owners = _BlockOwners(ns)
    with ns.env.begin() as txn:
        for volume in volumes:
            by_block: dict[int, list] = defaultdict(list)
            try:
                for info in volume.iter_replicas():
                    by_block[info.block_id].append(info)
            except (FsError, OSError) as exc:
                log.error("cannot scan volume %s: %s", volume.path, exc)
                continue
            for block_id, infos in by_block.items():
                owner = txn.get(schema.replica_key(volume.id, block_id), db=ns.db["replicas"])
                if owner is None and block_id not in trashed:
                    key = owners.key_of(txn, block_id)
                    if key is not None and schema.split_block_key(key)[0] not in settled:
                        unrecorded.append((key, volume, block_id))
                        continue
                rec_raw = None if owner is None else txn.get(owner, db=ns.db["blocks"])
                if rec_raw is None:
                    volume.delete_replica(block_id, None)
                    report.orphan_replicas_removed += 1
                    continue
                rec = BlockRecord.unpack(rec_raw)
                gss = {i.gs for i in infos if i.gs is not None}
                if max(gss, default=0) > rec.gs and any(i.data_path for i in infos):
                    newer.add(schema.split_block_key(owner)[0])
                elif rec.gs in gss and any(i.data_path for i in infos):
                    for info in infos:
                        if info.gs is not None and info.gs < rec.gs:
                            _unlink(info.meta_path)
                            report.stale_meta_removed += 1
                elif max(gss, default=0) <= rec.gs:
                    stale.append((bytes(owner), volume.id, block_id))
            report.orphan_replicas_removed += volume.clear_tmp()
    for owner, volume, block_id in unrecorded:
        ino, index = schema.split_block_key(owner)
        rec = ns.get_blocks(ino).get(index)
        if rec is not None and volume.id in rec.volumes:
            log.warning("block %d is recorded on volume %d but the replicas index has no "
                        "row for it: its files are kept (fsck --repair restores the row)",
                        block_id, volume.id)
            continue
        try:
            if ino in newer:  # settled from its newest replicas below
                raise NotAdopted("the file has replicas newer than the namespace")
            adopt_replica(ns, volumes, volume, ino, index, block_id)
        except NotAdopted as exc:
            log.warning("unrecorded files of block %d on volume %d removed: %s", block_id,
                        volume.id, exc)
            volume.delete_replica(block_id, None)
            report.orphan_replicas_removed += 1
        else:
            log.warning("replica of block %d on volume %d was not recorded: it verifies "
                        "against the block, which needs it, and is now recorded", block_id,
                        volume.id)
            report.unrecorded_replicas_adopted += 1
    for owner, volume_id, block_id in stale:
        ino, index = schema.split_block_key(owner)
        ns.drop_replicas(ino, index, (volume_id,))  # its files go through the trash
        report.stale_replicas_dropped += 1
        log.warning("stale replica of block %d on volume %d removed", block_id, volume_id)
    if stale:
        delete_trash(ns, volumes)
    for ino in sorted(newer):
        log.warning("inode %d has replicas newer than the namespace (a write session's "
                    "transactions were lost): settling it from them", ino)
        recover_lease(ns, volumes, ino, report)
        report.newer_replicas_adopted += 1


class _BlockOwners:
    """Which block (its ``blocks`` key) a block id belongs to. The replicas index answers
    for a block recorded on some volume; one whose record lists none (lease recovery found
    no replica) is found by one pass over the block records, made only if such a block
    turns up."""

    def __init__(self, ns: Namespace):
        self.ns = ns
        self.volume_ids = [v.id for v in ns.config.volumes]
        self.by_id: dict[int, bytes] | None = None

    def key_of(self, txn, block_id: int) -> bytes | None:
        for volume_id in self.volume_ids:
            key = txn.get(schema.replica_key(volume_id, block_id), db=self.ns.db["replicas"])
            if key is not None:
                return bytes(key)
        if self.by_id is None:
            self.by_id = {BlockRecord.unpack(raw).block_id: bytes(key)
                          for key, raw in txn.cursor(db=self.ns.db["blocks"])}
        return self.by_id.get(block_id)


class NotAdopted(Exception):
    """Why files found on a volume are not recorded as a replica of their block.
    ``changed``: the block is not what the files were checked against (gone, re-stamped,
    recorded there, or no longer short of replicas), as opposed to files that are not a
    whole replica of it."""

    def __init__(self, reason: str, changed: bool = True):
        super().__init__(reason)
        self.changed = changed


def adopt_replica(ns: Namespace, volumes: VolumeSet, volume: Volume, ino: int, index: int,
                  block_id: int) -> None:
    """Record the files of ``block_id`` on ``volume`` as a replica of block ``index`` of
    ``ino`` (a copy whose recording a crash lost), as an HDFS block report adds a reported
    replica, if the block needs it and they are a whole replica of it as the namespace has
    it now; meta files of other stamps beside them go. Needed: the block has fewer
    servable persistent replicas than its file's replication, so that a copy which may be
    the only good one left is kept, but a surplus one (an excess replica whose deletion a
    power loss undid) is not. Raises NotAdopted otherwise.

    Cheap checks come first (the files' size and stamp, then whether the recorded replicas'
    files are there at all): the recorded replicas are read whole only when they look
    complete and a complete-looking copy turned up, to tell a surplus copy from the one
    good copy of a block whose recorded replica went bad."""
    rec = ns.get_blocks(ino).get(index)
    if rec is None or rec.block_id != block_id:
        raise NotAdopted("the block is gone")
    if volume.id in rec.volumes:
        raise NotAdopted("the block is recorded on this volume already")
    if not _looks_whole(volume, rec):
        raise NotAdopted(f"no data and meta file of {rec.length} bytes at generation stamp "
                         f"{rec.gs}", changed=False)
    try:
        replication = Resolver(ns).replication(ino)
    except FsError:  # a parent loop above the file (fsck reports it): the default, as fsck
        replication = ns.config.replication
    recorded = [volumes.by_id[v] for v in rec.volumes if v in volumes.by_id
                and not volumes.by_id[v].storage_type.transient
                and _looks_whole(volumes.by_id[v], rec, at_least=True)]
    if len(recorded) >= replication:
        serving = [v for v in recorded if verify_replica(v, block_id, rec.gs).serves(rec.length)]
        if len(serving) >= replication:
            raise NotAdopted(f"surplus: the block has {len(serving)} good replica(s) for "
                             f"replication {replication}")
    verdict = verify_replica(volume, block_id, rec.gs)
    if not verdict.is_whole(rec.length):
        raise NotAdopted(f"not a whole replica at generation stamp {rec.gs}: "
                         f"{verdict.corruption() or 'wrong length'}", changed=False)
    if not ns.add_replica(ino, index, block_id, rec.gs, volume.id):
        raise NotAdopted("the block changed meanwhile")
    for gs in volume.meta_gss(block_id):
        if gs != rec.gs:
            _unlink(volume.meta_path(block_id, gs))


def _looks_whole(volume: Volume, rec: BlockRecord, at_least: bool = False) -> bool:
    """Whether a volume has a data file of the block's length (or longer, ``at_least``)
    and a meta file of its stamp, without reading them."""
    try:
        size = os.stat(volume.data_path(rec.block_id)).st_size
        os.stat(volume.meta_path(rec.block_id, rec.gs))
    except OSError:
        return False
    return size >= rec.length if at_least else size == rec.length


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
