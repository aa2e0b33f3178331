"""One check (:class:`_Checker`): the namespace's structure against itself, then the files in
scope against the volumes (replicas, data, replication and placement), then what is left
on the volumes; every finding becomes a :class:`Problem` with the action that fixes it."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.errors import FsError, UsageError
from tierfs.fs.namespace import Namespace
from tierfs.fs.placement import wanted_beyond_volumes
from tierfs.fs.resolver import Resolver
from tierfs.fs.schema import BlockRecord, Inode, ROOT_INO
from tierfs.satisfier.policies import BlockStoragePolicy, storage_type_summary
from tierfs.satisfier.summary import StoragePolicySummary
from tierfs.tools.fsck.replicas import Found, ReplicaState, scan_volume
from tierfs.tools.fsck.report import FsckReport, Problem
from tierfs.tools.fsck.snapshot import Snapshot, _show

if TYPE_CHECKING:
    from tierfs.tools.fsck import Fsck

ORPHAN_GRACE = 60.0
"""Beside a daemon, replica files younger than this (ctime) are not called orphans: a new
block's files exist, and are fsynced, before the namespace records them, and on a loaded
machine that can outlast both passes of the check."""

# Listing levels (--files, --blocks, --locations).
LIST_FILES, LIST_BLOCKS, LIST_LOCATIONS = 1, 2, 3

_REPLICA_KINDS = {"missing": "MISSING_REPLICA", "corrupt": "CORRUPT_REPLICA",
                  "stale": "STALE_REPLICA", "newer": "NEWER_REPLICA",
                  "short": "WRONG_LENGTH", "long": "WRONG_LENGTH"}


class _Checker:
    """One check: the snapshot's structure, then the files in scope and the volumes."""

    def __init__(self, fsck: "Fsck", ns: Namespace, volumes: VolumeSet, mounted: bool):
        self.fsck = fsck
        self.ns = ns
        self.volumes = volumes
        self.mounted = mounted
        self.progress = fsck.progress
        self.snap = Snapshot.load(ns)
        self.report = FsckReport(fsck.data_dir, fsck.path, mounted,
                                 storage_policies=fsck.storage_policies)
        self.report.stats.default_replication = ns.config.replication
        self.report.stats.volumes = len(volumes)
        self.whole = fsck.path == "/"
        self.resolver = Resolver(ns)
        self.report.placement = StoragePolicySummary(self.resolver.suite)
        self.found: dict[tuple[int, int], Found] = {}
        self.holders: dict[int, set[int]] = {}     # block id -> volumes with its files
        self.misplaced: dict[int, list[Path]] = {}
        # block id -> [servable persistent replicas, the file's replication]
        self.serving: dict[int, list[int]] = {}
        self.newer_files: set[int] = set()   # files with a replica newer than the namespace
        self.unverified_leases: set[int] = set()  # leased files with a bad replica chunk

    def problem(self, kind: str, where: str, message: str, key: tuple,
                action: tuple | None = None, **extra) -> None:
        self.report.problems.append(Problem(kind, where, message, (kind, *key), action,
                                            **extra))

    def note(self, text: str) -> None:
        self.report.notes.append(text)

    def run(self) -> FsckReport:
        start = time.monotonic()
        top = self.snap.resolve(self.fsck.path)
        if top is None and not self.whole:
            raise UsageError(f"path '{self.fsck.path}' does not exist in "
                             f"{self.fsck.data_dir}")
        holder = self.fsck.holder() if self.mounted else None
        if holder:
            daemon = f"daemon pid {holder[0]} on {holder[1]}" if holder[0] else "read-only DATA"
            self.note(f"mounted ({daemon}): checked beside it; "
                      "blocks open for writing are not verified")
        if self.whole:
            self.check_structure()
        self.scan_volumes()
        scope = self.snap.subtree(top) if not self.whole else self._all_inodes()
        self.check_files(scope)
        if self.whole:
            self.check_volume_leftovers()
        self._damage_under_dead_leases()
        self.report.elapsed = time.monotonic() - start
        return self.report

    def _damage_under_dead_leases(self) -> None:
        """A dead daemon's lease is recovery the next mount does, unless a replica of the
        file fails its checksum: lease recovery takes a bad chunk for a write cut short and
        checksums it again, but it may as well be damage to data that was fsynced, so the
        filesystem is not called HEALTHY then (as before leases counted as recovery)."""
        for problem in self.report.problems:
            if problem.kind == "LEASE_PENDING" and problem.key[1] in self.unverified_leases:
                problem.recovery = False
                problem.message += ("; a replica fails its checksum, which lease recovery "
                                    "cannot tell from damage")

    def _all_inodes(self) -> list[int]:
        """Reachable inodes in tree order, then the rest (orphans, detached)."""
        order = [i for i in self.snap.subtree(ROOT_INO) if i in self.snap.inodes]
        reached = set(order)
        return order + sorted(set(self.snap.inodes) - reached)

    # ----------------------------------------------------------------- structure

    def check_structure(self) -> None:
        self.check_root()
        self.check_dentries()
        self.check_cookie_rows()
        self.check_backlink_rows()
        self.check_inodes()
        self.check_loops()
        self.check_keyed_rows()
        self.check_block_records()
        self.check_replica_index()
        self.check_counters()
        self.check_pending()

    def check_root(self) -> None:
        root = self.snap.inodes.get(ROOT_INO)
        if root is None:
            self.problem("ROOT_MISSING", "/", "the root inode is missing", (),
                         ("make_root",))
        elif not stat.S_ISDIR(root.mode):
            self.problem("ROOT_NOT_DIR", "/", f"the root inode has mode {root.mode:o}", ())

    def check_dentries(self) -> None:
        snap = self.snap
        stale_next = set()
        for (parent, name), (child, cookie) in snap.dentries.items():
            where = snap.entry_path(parent, name)
            pinode = snap.inodes.get(parent)
            if pinode is None or not stat.S_ISDIR(pinode.mode):
                what = "a missing inode" if pinode is None else "a non-directory"
                if parent != ROOT_INO:   # a missing root is recreated, keeping its entries
                    self.problem("DENTRY_IN_NON_DIR", where,
                                 f"entry for inode {child} lives in {what} ({parent})",
                                 (parent, name), ("remove_dentry", parent, name, "non_dir"))
                continue
            if child not in snap.inodes:
                self.problem("DANGLING_DENTRY", where, f"names inode {child}, which does "
                             "not exist", (parent, name), ("remove_dentry", parent, name, "dangling"))
                continue
            if snap.cookies.get((parent, cookie)) != (child, name):
                self.problem("MISSING_COOKIE", where, f"readdir cookie {cookie} has no "
                             f"dircookies row naming inode {child}", (parent, name),
                             ("fix_cookie", parent, name))
            if (child, parent, name) not in snap.backlinks:
                self.problem("MISSING_BACKLINK", where, f"inode {child} has no backlink "
                             "for this name", (parent, name),
                             ("add_backlink", child, parent, name))
            if cookie >= pinode.next_cookie:
                stale_next.add(parent)
        for parent in sorted(stale_next):
            self.problem("BAD_NEXT_COOKIE", snap.path_of(parent),
                         f"next_cookie {snap.inodes[parent].next_cookie} is not above every "
                         "cookie in use", (parent,), ("fix_next_cookie", parent))

    def check_cookie_rows(self) -> None:
        for (parent, cookie), (_, name) in self.snap.cookies.items():
            entry = self.snap.dentries.get((parent, name))
            if entry is None or entry[1] != cookie:
                self.problem("STRAY_COOKIE", self.snap.entry_path(parent, name),
                             f"dircookies row {cookie} has no matching dentry",
                             (parent, cookie), ("delete_cookie", parent, cookie))

    def check_backlink_rows(self) -> None:
        for child, parent, name in self.snap.backlinks:
            entry = self.snap.dentries.get((parent, name))
            if entry is None or entry[0] != child:
                self.problem("STRAY_BACKLINK", self.snap.entry_path(parent, name),
                             f"backlink of inode {child} has no matching dentry",
                             (child, parent, name), ("delete_backlink", child, parent, name))

    def check_inodes(self) -> None:
        snap = self.snap
        subdirs = {p: sum(snap.is_dir(c) for _, c in kids)
                   for p, kids in snap.children.items()}
        for ino, inode in snap.inodes.items():
            links = snap.links.get(ino, [])
            if ino == ROOT_INO:
                self._check_root_links(inode, links, subdirs.get(ino, 0))
            elif not links:
                self._check_nameless(ino, inode)
            else:
                self._check_named(ino, inode, links, subdirs.get(ino, 0))
            self._check_symlink(ino, inode)

    def _check_root_links(self, root: Inode, links, subdirs: int) -> None:
        for parent, name in links:
            self.problem("DIR_HARDLINK", self.snap.entry_path(parent, name),
                         "names the root directory", (parent, name),
                         ("remove_dentry", parent, name, "dir_link"))
        if root.parent != ROOT_INO:
            self.problem("WRONG_PARENT", "/", f"parent is {root.parent}, not itself",
                         (ROOT_INO,), ("fix_parent", ROOT_INO))
        if stat.S_ISDIR(root.mode) and root.nlink != 2 + subdirs:
            self.problem("WRONG_NLINK", "/", f"nlink is {root.nlink}, expected "
                         f"{2 + subdirs}", (ROOT_INO,), ("fix_nlink", ROOT_INO))

    def _check_nameless(self, ino: int, inode: Inode) -> None:
        """An inode no dentry names: an orphan, a leftover to purge, or lost."""
        where = f"<inode {ino}>"
        if ino in self.snap.orphans:
            if inode.nlink != 0:
                self.problem("ORPHAN_NLINK", where, f"listed as orphan but nlink is "
                             f"{inode.nlink} > 0", (ino,), ("fix_nlink", ino))
        elif inode.nlink == 0:
            self.problem("UNLISTED_UNLINKED", where, "nlink 0 and no name, but not listed "
                         "in orphans", (ino,), ("purge", ino))
        else:
            kind = "directory" if stat.S_ISDIR(inode.mode) else "inode"
            self.problem("NAMELESS_INODE", where, f"{kind} with nlink {inode.nlink} is "
                         "named by no dentry", (ino,), ("relink", ino))

    def _check_named(self, ino: int, inode: Inode, links, subdirs: int) -> None:
        snap = self.snap
        where = snap.path_of(ino)
        is_dir = stat.S_ISDIR(inode.mode)
        if ino in snap.orphans:
            self.problem("ORPHAN_LINKED", where, f"listed in orphans but named by "
                         f"{len(links)} dentries", (ino,), ("remove_orphan_row", ino))
        if is_dir and len(links) > 1:
            keep = snap.primary_link(ino)
            for parent, name in links:
                if (parent, name) != keep:
                    self.problem("DIR_HARDLINK", snap.entry_path(parent, name),
                                 f"second name of directory {where}", (parent, name),
                                 ("remove_dentry", parent, name, "dir_link"))
        expected = 2 + subdirs if is_dir else len(links)
        if inode.nlink != expected:
            self.problem("WRONG_NLINK", where, f"nlink is {inode.nlink}, expected "
                         f"{expected}", (ino,), ("fix_nlink", ino))
        if inode.parent not in {parent for parent, _ in links}:
            self.problem("WRONG_PARENT", where, f"parent field is {inode.parent}, which "
                         "holds no dentry of it", (ino,), ("fix_parent", ino))

    def _check_symlink(self, ino: int, inode: Inode) -> None:
        target = self.snap.symlinks.get(ino)
        where = self.snap.path_of(ino)
        if stat.S_ISLNK(inode.mode):
            if target is None:
                self.problem("SYMLINK_NO_TARGET", where, "symlink without a target record",
                             (ino,), ("clear_symlink", ino))
            elif inode.size != len(target):
                self.problem("WRONG_SIZE", where, f"symlink size {inode.size}, target is "
                             f"{len(target)} bytes", (ino,), ("fix_symlink_size", ino))
        elif target is not None:
            self.problem("STRAY_SYMLINK", where, "symlink target record on a "
                         "non-symlink", (ino,), ("delete_rows", "symlinks", ino))

    def check_loops(self) -> None:
        """Directories named only from inside their own subtree: a loop the root cannot
        reach. (Subtrees below a nameless directory are covered by that directory.)"""
        snap = self.snap
        reached = set(snap.subtree(ROOT_INO))
        done: set[int] = set()
        for ino in sorted(snap.inodes):
            if ino in reached or ino in done or not snap.is_dir(ino) or not snap.links.get(ino):
                continue
            chain: dict[int, int] = {}
            cur = ino
            while cur not in done and cur not in chain and snap.links.get(cur):
                chain[cur] = len(chain)
                cur = snap.primary_link(cur)[0]
            if cur in chain:
                cycle = list(chain)[chain[cur]:]
                victim = min(cycle)
                self.problem("DIRECTORY_LOOP", f"<inode {victim}>",
                             f"directories {', '.join(map(str, cycle))} name each other and "
                             "are unreachable from the root", (victim,), ("relink", victim))
            done.update(chain)

    def check_keyed_rows(self) -> None:
        snap = self.snap
        for name, inos in [*snap.keyed.items(), ("symlinks", set(snap.symlinks)),
                           ("orphans", snap.orphans)]:
            for ino in sorted(inos - snap.inodes.keys()):
                self.problem("STRAY_ROWS", f"<inode {ino}>", f"'{name}' rows of a missing "
                             "inode", (name, ino), ("delete_rows", name, ino))

    def check_block_records(self) -> None:
        snap = self.snap
        past_eof = set()
        for (ino, index), rec in snap.blocks.items():
            inode = snap.inodes.get(ino)
            if inode is None or not stat.S_ISREG(inode.mode):
                what = "missing inode" if inode is None else "non-regular inode"
                self.problem("BLOCK_OF_NON_FILE", f"<inode {ino}>",
                             f"block {index} (blk_{rec.block_id}) belongs to a {what}",
                             (ino, index), ("drop_block", ino, index))
            elif (ino not in snap.leases
                  and index * snap.block_size + rec.length > inode.size):
                past_eof.add(ino)
        for ino in sorted(past_eof):
            end = max(i * snap.block_size + r.length for i, r in snap.blocks_of[ino])
            self.problem("BLOCK_PAST_EOF", snap.path_of(ino), f"size is "
                         f"{snap.inodes[ino].size} but its blocks reach {end}", (ino,),
                         ("fix_size", ino))

    def check_replica_index(self) -> None:
        snap = self.snap
        expected: dict[tuple[int, int], tuple[int, int]] = {}
        for (ino, index), rec in snap.blocks.items():
            for vid in rec.volumes:
                expected.setdefault((vid, rec.block_id), (ino, index))
        for (vid, bid), target in expected.items():
            if snap.replicas.get((vid, bid)) != target:
                self.problem("REPLICA_INDEX", self.snap.path_of(target[0]),
                             f"replicas index lacks blk_{bid} on volume {vid}", (vid, bid),
                             ("index_set", vid, bid, *target))
        for vid, bid in sorted(snap.replicas.keys() - expected.keys()):
            self.problem("REPLICA_INDEX", f"volume {vid}", f"replicas index row for "
                         f"blk_{bid} matches no block record", (vid, bid),
                         ("index_delete", vid, bid))

    def check_counters(self) -> None:
        snap = self.snap
        ids = [r.block_id for r in snap.blocks.values()] + list(snap.trash)
        stamps = [r.gs for r in snap.blocks.values()] + [g for g, _ in snap.trash.values()]
        need = {"next_ino": max(snap.inodes, default=ROOT_INO) + 1,
                "next_block_id": max(ids, default=0) + 1,
                "gs": max(stamps, default=0), "txid": snap.last_journal}
        for name, minimum in need.items():
            if snap.counters[name] < minimum:
                self.problem("COUNTER_BEHIND", "meta", f"{name} is {snap.counters[name]}, "
                             f"must be at least {minimum}", (name,),
                             ("raise_counter", name, minimum))

    @property
    def unclean(self) -> bool:
        """No daemon runs, and the last one did not stop cleanly: its half-done moves in a
        volume's tmp/ are what a crash leaves, and the next mount clears them. (Replica
        files the namespace does not know stay problems: a crash can leave them, but so can
        a namespace restored from an old copy or a lost block record, and the mount would
        delete them.)"""
        return not self.mounted and self.snap.state != "clean"

    def check_pending(self) -> None:
        """Leases, orphans and trash: in use beside a daemon; without one, recovery work that
        the next mount does before it serves anything (``tierfs.fs.recovery``). A stop by
        kill -9 or a crash leaves it, and loses nothing by it, so it is reported but leaves
        the filesystem HEALTHY, as HDFS's fsck treats files still open for writing."""
        snap = self.snap
        pending = []
        for ino in sorted(snap.leases):
            if self.mounted:
                self.note(f"{snap.path_of(ino)}: open for writing (lease held)")
            else:
                pending.append(("LEASE_PENDING", snap.path_of(ino), "lease left by a dead "
                                "daemon: needs lease recovery", (ino,), ("recover_lease", ino)))
        for ino in sorted(snap.orphans & snap.inodes.keys()):
            if snap.links.get(ino) or snap.inodes[ino].nlink:
                continue
            if self.mounted:
                self.note(f"<inode {ino}>: unlinked but still open (orphan in use)")
            else:
                pending.append(("ORPHAN_PENDING", f"<inode {ino}>", "unlinked inode left by "
                                "a dead daemon: to purge", (ino,), ("purge", ino)))
        if snap.trash:
            if self.mounted:
                self.note(f"{len(snap.trash)} dropped blocks waiting for file deletion")
            else:
                pending.append(("TRASH_PENDING", "trash", f"{len(snap.trash)} dropped blocks "
                                "still have replica files to delete", (), ("delete_trash",)))
        if self.unclean:
            pending.append(("UNCLEAN_STATE", "meta", f"state is '{snap.state}' but no daemon "
                            "runs (not unmounted cleanly)", (), ("set_clean",)))
        for kind, where, message, key, action in pending:
            self.problem(kind, where, message, key, action, recovery=True)
        if pending:
            self.note("the daemon did not stop cleanly: the next mount completes its recovery "
                      "(the lines above) by itself, or fsck --repair does it now")

    # ----------------------------------------------------------------- volumes and files

    def scan_volumes(self) -> None:
        self.progress.phase("scanning volumes", len(self.volumes), unit="vol")
        for volume in self.volumes:
            found, misplaced = scan_volume(volume)
            for bid, entry in found.items():
                self.found[(volume.id, bid)] = entry
                self.holders.setdefault(bid, set()).add(volume.id)
            self.misplaced[volume.id] = misplaced
            self.progress.advance(1)

    def check_files(self, scope: list[int]) -> None:
        snap = self.snap
        total = sum(r.length * len(r.volumes) for ino in scope
                    for _, r in snap.blocks_of.get(ino, ()))
        self.progress.phase("verifying replicas", total)
        for ino in scope:
            inode = snap.inodes[ino]
            if stat.S_ISDIR(inode.mode):
                self.report.stats.dirs += 1
                self._list(ino, f"{snap.path_of(ino)} <dir>")
            elif stat.S_ISLNK(inode.mode):
                self.report.stats.symlinks += 1
                target = _show(snap.symlinks.get(ino, b"?"))
                self._list(ino, f"{snap.path_of(ino)} <symlink> -> {target}")
            else:
                self.check_file(ino, inode)

    def _list(self, ino: int, line: str, blocks: list[str] = ()) -> None:
        level = self.fsck.listing
        if level >= LIST_FILES:
            self.report.listing.append((self.snap.path_of(ino),
                                        [line, *(blocks if level >= LIST_BLOCKS else ())]))

    def check_file(self, ino: int, inode: Inode) -> None:
        stats = self.report.stats
        stats.files += 1
        stats.total_size += inode.size
        blocks = self.snap.blocks_of.get(ino, []) if stat.S_ISREG(inode.mode) else []
        policy, target = self._placement(ino)
        before = len(self.report.problems)
        lines = [self.check_block(ino, index, rec, policy, target) for index, rec in blocks]
        kinds = sorted({p.kind for p in self.report.problems[before:] if p.health})
        status = " ".join(kinds) if kinds else "OK"
        self._list(ino, f"{self.snap.path_of(ino)} {inode.size} bytes, replication="
                        f"{target}, {len(blocks)} block(s):  {status}", lines)

    def _placement(self, ino: int) -> tuple[BlockStoragePolicy, int]:
        """The file's effective policy and replication; the defaults where the chain is
        broken (a parent loop is reported by the structure checks)."""
        try:
            return self.resolver.placement(ino)
        except FsError:
            return self.resolver.suite.default, self.ns.config.replication

    def check_block(self, ino: int, index: int, rec: BlockRecord, policy: BlockStoragePolicy,
                    target: int) -> str:
        """Judge every replica of one block; returns its listing line."""
        leased = ino in self.snap.leases
        path = self.snap.path_of(ino)
        states = [self.judge_replica(rec, vid, leased) for vid in rec.volumes]
        if any(s.status == "newer" for s in states):
            self.newer_files.add(ino)
        good = [s.volume_id for s in states if s.good]
        for state in states:
            self._report_replica(path, ino, index, rec, state, good, leased)
        self._check_extra_metas(path, rec, leased)
        self._count_block(rec, states, good)
        if not good and not leased:
            why = "no replica recorded" if not rec.volumes else "no good replica"
            self.problem("LOST_BLOCK", path, f"blk_{rec.block_id}_{rec.gs} (block {index}) "
                         f"has {why}: reads of it give EIO", (rec.block_id,))
        self._check_placement(path, ino, index, rec, states, policy, target, leased)
        return self._block_line(index, rec, states)

    def _count_block(self, rec: BlockRecord, states: list[ReplicaState],
                     good: list[int]) -> None:
        stats = self.report.stats
        stats.blocks += 1
        stats.block_bytes += rec.length
        stats.recorded_replicas += len(rec.volumes)
        stats.missing_replicas += sum(s.status == "missing" for s in states)
        stats.good_replicas += len(good)
        stats.minimally_replicated += bool(good)
        stats.corrupt_blocks += not good

    def _check_placement(self, path: str, ino: int, index: int, rec: BlockRecord,
                         states: list[ReplicaState], policy: BlockStoragePolicy, target: int,
                         leased: bool) -> None:
        """Replication and placement of the good replicas (``satisfier/summary.py``'s rule):
        counted for the summary and the ``--storagepolicies`` tables, and, for blocks not
        under a lease (their writer is placing them), findings with their fixes."""
        good = [s.volume_id for s in states if s.good and s.volume_id in self.volumes.by_id]
        types = [self.volumes.by_id[v].storage_type for v in good]
        verdict = self.report.placement.add(types, policy, target)
        self.serving[rec.block_id] = [verdict.persistent, target]
        if leased:
            return
        stats = self.report.stats
        block = f"blk_{rec.block_id}_{rec.gs} (block {index})"
        found = (f"Target Replicas is {target} but found {verdict.persistent} live "
                 f"persistent replica(s)")
        transient = len(types) - verdict.persistent
        if transient:
            found += f" and {transient} on RAM_DISK"
        key = (ino, index, rec.block_id, rec.gs)
        if verdict.under_replicated:
            stats.under_replicated += 1
            # Volumes holding bad or unrecorded files of the block: targets of last resort.
            avoid = tuple(sorted(({s.volume_id for s in states if not s.good}
                                  | self.holders.get(rec.block_id, set())) - set(good)))
            self.problem("UNDER_REPLICATED", path, f"Under replicated {block}. {found}.", key,
                         ("replicate", ino, index, rec.block_id, rec.gs, tuple(good), avoid),
                         health=False, work=rec.length * (target - verdict.persistent))
        if verdict.over_replicated:
            stats.over_replicated += 1
            self.problem("OVER_REPLICATED", path, f"Over replicated {block}. {found}.", key,
                         ("drop_excess", ino, index, rec.block_id, rec.gs, tuple(good)),
                         health=False)
        if verdict.misplaced:
            stats.misplaced += 1
            wanted = storage_type_summary(policy.choose_storage_types(target))
            have = storage_type_summary(t for t in types if not t.transient)
            why = (wanted_beyond_volumes(policy, target, (v.storage_type for v in self.volumes))
                   or "moving it is the satisfier's work")
            self.problem("MISPLACED", path, f"Mis-placed {block}. Replicas on {have}, policy "
                         f"{policy.name} wants {wanted}: {why}.", key, health=False)

    def _block_line(self, index: int, rec: BlockRecord, states: list[ReplicaState]) -> str:
        line = (f"{index}. blk_{rec.block_id}_{rec.gs} len={rec.length} "
                f"Live_repl={sum(s.good for s in states)}")
        if self.fsck.listing >= LIST_LOCATIONS:
            for state in states:
                volume = self.volumes.by_id.get(state.volume_id)
                where = (f"[{volume.path},{volume.uuid},{volume.storage_type.name}]"
                         if volume else f"[unknown volume {state.volume_id}]")
                mark = "" if state.good else f"({state.status.upper()})"
                line += f" {where}{mark}"
        return line

    def judge_replica(self, rec: BlockRecord, vid: int, leased: bool) -> ReplicaState:
        """The state of the replica of ``rec`` recorded on volume ``vid``."""
        volume = self.volumes.by_id.get(vid)
        if volume is None:
            return ReplicaState(vid, "missing", f"recorded on volume id {vid}, which this "
                                "filesystem does not have")
        found = self.found.get((vid, rec.block_id))
        if found is None:
            return ReplicaState(vid, "missing", "no replica files")
        if found.data_path is None:
            return ReplicaState(vid, "missing", "data file missing", unopenable=True)
        if not found.metas:
            return ReplicaState(vid, "missing", "meta file missing")
        if rec.gs not in found.metas:
            newest = max(found.metas)
            if newest < rec.gs:
                return ReplicaState(vid, "stale", f"generation stamp {newest} is older than "
                                    f"the namespace's {rec.gs}")
            return ReplicaState(vid, "newer", f"generation stamp {newest} is newer than the "
                                f"namespace's {rec.gs}")
        if leased and self.mounted:
            return ReplicaState(vid, "unverified", "open for writing: not verified")
        return self._judge_data(volume, rec, found)

    def _judge_data(self, volume: Volume, rec: BlockRecord, found: Found) -> ReplicaState:
        verdict = self.fsck.verify(volume, rec.block_id, rec.gs, found, self.progress.advance)
        vid = volume.id
        corruption = verdict.corruption()
        if corruption:
            return ReplicaState(vid, "corrupt", corruption,
                                unopenable=verdict.error is not None)
        if verdict.crc_count > verdict.chunks:
            return ReplicaState(vid, "short", f"data file is {verdict.length} bytes but its "
                                f"checksums cover {verdict.crc_count} chunks")
        if verdict.length < rec.length:
            return ReplicaState(vid, "short", f"data file is {verdict.length} bytes, the "
                                f"block is {rec.length}")
        if verdict.length > rec.length:
            return ReplicaState(vid, "long", f"data file is {verdict.length} bytes, the "
                                f"block is {rec.length}")
        return ReplicaState(vid, "ok")

    def _report_replica(self, path: str, ino: int, index: int, rec: BlockRecord,
                        state: ReplicaState, good: list[int], leased: bool) -> None:
        """A problem (or, for a leased block, a note) for a replica that is not ok."""
        if state.status in ("ok", "unverified"):
            return
        volume = self.volumes.by_id.get(state.volume_id)
        where_vol = volume.path if volume else f"volume id {state.volume_id}"
        text = f"replica blk_{rec.block_id}_{rec.gs} on {where_vol}: {state.reason}"
        kind = _REPLICA_KINDS[state.status]
        key = (state.volume_id, rec.block_id, rec.gs)
        drop = ("drop_replica", ino, index, rec.block_id, rec.gs, state.volume_id)
        if leased:
            if state.unopenable:
                self.problem(kind, path, text + " (lease recovery cannot open it)", key,
                             (*drop, ()))
            else:
                self.note(f"{path}: {text} (under a lease: lease recovery settles it)")
                self.unverified_leases.add(ino)
            return
        if state.status == "long":
            self.problem(kind, path, text, key, ("truncate_replica", ino, index, rec.block_id,
                                                 rec.gs, state.volume_id, rec.length))
            return
        others = tuple(v for v in good if v != state.volume_id)
        if others:
            self.problem(kind, path, text, key, (*drop, others))
        else:
            self.problem(kind, path, text + " (no other good replica: kept)", key)

    def _check_extra_metas(self, path: str, rec: BlockRecord, leased: bool) -> None:
        """Meta files of other stamps beside a replica of the current one."""
        for vid in rec.volumes:
            found = self.found.get((vid, rec.block_id))
            if found is None or rec.gs not in found.metas:
                continue
            for gs, meta_path in found.metas.items():
                if gs == rec.gs:
                    continue
                if gs > rec.gs and leased:
                    self.note(f"{path}: {meta_path} is newer than the namespace (under a "
                              "lease: lease recovery adopts it)")
                    continue
                self.problem("STALE_META", path, f"{meta_path}: generation stamp {gs}, the "
                             f"namespace has {rec.gs}", (vid, rec.block_id, gs),
                             ("unlink_meta", vid, rec.block_id, gs))

    def check_volume_leftovers(self) -> None:
        """Replica files nobody refers to, misplaced files and ``tmp/`` leftovers."""
        snap = self.snap
        expected = {(vid, r.block_id) for r in snap.blocks.values() for vid in r.volumes}
        known = {r.block_id: (key, r) for key, r in snap.blocks.items()}
        for (vid, bid), found in sorted(self.found.items()):
            if (vid, bid) in expected:
                continue
            if bid in snap.trash:
                continue   # reported with TRASH_PENDING (or in use beside a daemon)
            volume = self.volumes.by_id[vid]
            if bid in known and not self._recent(found.paths()):
                if self._unrecorded(volume, found, *known[bid]):
                    continue
            why = "not recorded on this volume" if bid in known else "unknown block"
            self._orphan(volume, bid, found.paths(), f"blk_{bid}: {why}")
        for vid, paths in self.misplaced.items():
            for path in paths:
                self._orphan(self.volumes.by_id[vid], None, [str(path)],
                             f"{path.name} is outside its layout directory")
        for volume in self.volumes:
            self._check_tmp(volume)

    def _unrecorded(self, volume: Volume, found: Found, key: tuple[int, int],
                    rec: BlockRecord) -> bool:
        """Files of a known block on a volume it does not record (a copy whose recording
        was lost): a whole replica at the block's stamp that the block needs is no damage,
        and the next mount's volume scan records it, as --repair does now; the rule is
        ``tierfs.fs.recovery.adopt_replica``'s. Not for files under a lease, unlinked ones
        the mount purges, or files with a replica newer than the namespace: their recovery
        comes first and may re-stamp, cut or purge the block."""
        ino = key[0]
        serving = self.serving.get(rec.block_id)
        snap = self.snap
        inode = snap.inodes.get(ino)
        if inode is None or serving is None or ino in snap.leases or ino in self.newer_files:
            return False
        if ino in snap.orphans and not snap.links.get(ino) and not inode.nlink:
            return False
        if serving[0] >= serving[1] or found.data_len != rec.length:
            return False
        if found.data_path is None or rec.gs not in found.metas:
            return False
        verdict = self.fsck.verify(volume, rec.block_id, rec.gs, found, lambda count: None)
        if not verdict.is_whole(rec.length):
            return False
        serving[0] += not volume.storage_type.transient
        self.problem("UNRECORDED_REPLICA", str(volume.path),
                     f"blk_{rec.block_id}_{rec.gs}: a whole replica the namespace does not "
                     "record on this volume, which the block needs: the next mount records "
                     "it", (volume.id, rec.block_id),
                     ("adopt_replica", *key, rec.block_id, volume.id), recovery=True)
        return True

    def _recent(self, paths: list[str]) -> bool:
        """Beside a daemon, files that may belong to a block being created or copied."""
        return self.mounted and _newest_ctime(paths) > time.time() - ORPHAN_GRACE

    def _orphan(self, volume: Volume, bid: int | None, paths: list[str], text: str) -> None:
        if self._recent(paths):
            self.note(f"{volume.path}: {text}: recent files, maybe a block being created")
            return
        self.report.stats.orphan_replicas += 1
        self.problem("ORPHAN_REPLICA", str(volume.path), f"{text} ({', '.join(paths)})",
                     (volume.id, bid, *paths), ("delete_paths", volume.id, bid, paths))

    def _check_tmp(self, volume: Volume) -> None:
        try:
            names = sorted(os.listdir(volume.tmp_dir))
        except FileNotFoundError:
            return
        for name in names:
            if self.mounted:
                self.note(f"{volume.tmp_dir}/{name}: in tmp/ (a move in progress?)")
            else:
                self.problem("TMP_LEFTOVER", str(volume.tmp_dir), f"{name} left by an "
                             "interrupted move", (volume.id, name),
                             ("clear_tmp", volume.id, name), recovery=self.unclean)


def _newest_ctime(paths: list[str]) -> float:
    """Newest ctime among files (a vanished one counts as new: it was just deleted)."""
    newest = 0.0
    for path in paths:
        try:
            newest = max(newest, os.stat(path).st_ctime)
        except FileNotFoundError:
            return time.time()
    return newest
