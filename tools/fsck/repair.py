"""``--repair``'s fixes (:class:`_Repairer`): each problem's action, one journaled namespace
transaction (through :class:`_Rows`) that first checks the problem is still there, replica
files deleted after the commit, re-replication and removal of excess replicas."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import lmdb

from tierfs.backends.copy import copy_error, copy_replica
from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs import schema
from tierfs.fs.errors import FsError
from tierfs.fs.namespace import Namespace
from tierfs.fs.placement import choose_volumes
from tierfs.fs.recovery import (NotAdopted, RecoveryReport, adopt_replica, delete_trash,
                                recover_lease)
from tierfs.fs.resolver import Resolver
from tierfs.fs.schema import BlockRecord, Inode, Op, ROOT_INO, u64
from tierfs.fs.times import now_ns
from tierfs.satisfier.policies import BlockStoragePolicy
from tierfs.tools.fsck.report import Problem
from tierfs.tools.fsck.snapshot import _show
from tierfs.tools.progress import Silent

if TYPE_CHECKING:
    from tierfs.tools.fsck import Progress

LOST_FOUND = b"lost+found"


class _Unchanged(Exception):
    """A fix found its problem gone (fixed by an earlier fix): nothing was written."""


class _Rows:
    """In-transaction access for repairs, through the schema codecs."""

    def __init__(self, ns: Namespace, txn: lmdb.Transaction):
        self.ns = ns
        self.txn = txn
        self.db = ns.db

    def inode(self, ino: int) -> Inode | None:
        raw = self.txn.get(u64(ino), db=self.db["inodes"])
        return None if raw is None else Inode.unpack(ino, raw)

    def put_inode(self, inode: Inode) -> None:
        self.txn.put(u64(inode.ino), inode.pack(), db=self.db["inodes"])

    def dentry(self, parent: int, name: bytes) -> tuple[int, int] | None:
        raw = self.txn.get(schema.dentry_key(parent, name), db=self.db["dentries"])
        return None if raw is None else schema.parse_dentry_value(raw)

    def prefixed(self, dbname: str, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        with self.txn.cursor(db=self.db[dbname]) as cur:
            if not cur.set_range(prefix):
                return
            for key, value in cur:
                if key[:len(prefix)] != prefix:
                    return
                yield bytes(key), bytes(value)

    def delete_prefix(self, dbname: str, prefix: bytes) -> None:
        for key in [k for k, _ in self.prefixed(dbname, prefix)]:
            self.txn.delete(key, db=self.db[dbname])

    def links(self, ino: int) -> list[tuple[int, bytes]]:
        """Names of ``ino``: backlinks whose dentry exists, names it, in a directory."""
        out = []
        for key, _ in self.prefixed("backlinks", u64(ino)):
            _, parent, name = schema.split_backlink_key(key)
            entry = self.dentry(parent, name)
            pinode = self.inode(parent)
            if entry and entry[0] == ino and pinode and stat.S_ISDIR(pinode.mode):
                out.append((parent, name))
        return out

    def reaches_root(self, ino: int) -> bool:
        """Whether names lead from ``ino`` up to the root (no loop, no nameless ancestor)."""
        seen = set()
        while ino != ROOT_INO:
            links = self.links(ino)
            if not links or ino in seen:
                return False
            seen.add(ino)
            ino = links[0][0]
        return self.inode(ROOT_INO) is not None

    def children(self, ino: int) -> list[tuple[bytes, int, int]]:
        out = []
        for key, value in self.prefixed("dentries", u64(ino)):
            child, cookie = schema.parse_dentry_value(value)
            out.append((schema.split_dentry_key(key)[1], child, cookie))
        return out

    def is_orphan(self, ino: int) -> bool:
        return self.txn.get(u64(ino), db=self.db["orphans"]) is not None

    def expected_nlink(self, inode: Inode) -> int:
        """nlink by the schema's rules, from the rows as they are now."""
        if inode.ino != ROOT_INO and self.is_orphan(inode.ino) and not self.links(inode.ino):
            return 0
        if stat.S_ISDIR(inode.mode):
            kids = [self.inode(child) for _, child, _ in self.children(inode.ino)]
            return 2 + sum(1 for k in kids if k is not None and stat.S_ISDIR(k.mode))
        return len(self.links(inode.ino))

    def recount(self, ino: int) -> None:
        """Set a directory's nlink from its rows (parents after a name came or went)."""
        inode = self.inode(ino)
        if inode is not None and stat.S_ISDIR(inode.mode):
            inode.nlink = self.expected_nlink(inode)
            self.put_inode(inode)

    def remove_dentry(self, parent: int, name: bytes) -> int:
        child, cookie = self.dentry(parent, name)
        self.txn.delete(schema.dentry_key(parent, name), db=self.db["dentries"])
        cookie_key = schema.cookie_key(parent, cookie)
        if self.cookie_row(parent, cookie)[1:] == (name,):
            self.txn.delete(cookie_key, db=self.db["dircookies"])
        self.txn.delete(schema.backlink_key(child, parent, name), db=self.db["backlinks"])
        return child

    def cookie_row(self, parent: int, cookie: int) -> tuple[int, bytes] | tuple[()]:
        """(child, name) of a dircookies row, or () when there is none."""
        raw = self.txn.get(schema.cookie_key(parent, cookie), db=self.db["dircookies"])
        return () if raw is None else schema.parse_cookie_value(raw)

    def free_cookie(self, parent: Inode) -> int:
        """The directory's next cookie, skipping any a damaged ``next_cookie`` left in use."""
        cookie = parent.next_cookie
        while self.txn.get(schema.cookie_key(parent.ino, cookie),
                           db=self.db["dircookies"]) is not None:
            cookie += 1
        return cookie

    def add_dentry(self, parent: Inode, name: bytes, child: int) -> None:
        cookie = self.free_cookie(parent)
        parent.next_cookie = cookie + 1
        self.txn.put(schema.dentry_key(parent.ino, name), schema.dentry_value(child, cookie),
                     db=self.db["dentries"])
        self.txn.put(schema.cookie_key(parent.ino, cookie), schema.cookie_value(child, name),
                     db=self.db["dircookies"])
        self.txn.put(schema.backlink_key(child, parent.ino, name), b"",
                     db=self.db["backlinks"])
        self.put_inode(parent)

    def block(self, ino: int, index: int) -> BlockRecord | None:
        raw = self.txn.get(schema.block_key(ino, index), db=self.db["blocks"])
        return None if raw is None else BlockRecord.unpack(raw)

    def put_block(self, ino: int, index: int, rec: BlockRecord) -> None:
        self.txn.put(schema.block_key(ino, index), rec.pack(), db=self.db["blocks"])


# The order fixes run in within one pass: what the next mount's recovery would do first,
# then rows that make names consistent, then names, counts and blocks, then volume files,
# and the clean state last.
_ORDER = ("make_root", "delete_trash", "drop_replica_leased", "recover_lease", "delete_cookie",
          "delete_backlink", "remove_dentry", "add_backlink", "fix_next_cookie", "fix_cookie",
          "remove_orphan_row", "relink", "purge", "clear_symlink", "fix_nlink", "fix_parent",
          "fix_symlink_size", "delete_rows", "drop_block", "fix_size", "index_set",
          "index_delete", "adopt_replica", "drop_replica", "truncate_replica", "unlink_meta",
          "delete_paths", "clear_tmp", "drop_excess", "replicate", "raise_counter", "set_clean")


def _priority(problem: Problem) -> int:
    name = problem.action[0]
    if name == "drop_replica" and problem.action[-1] == ():
        name = "drop_replica_leased"
    return _ORDER.index(name)


class _Repairer:
    """Applies the actions of one check's problems; each fix re-checks its condition."""

    def __init__(self, ns: Namespace, volumes: VolumeSet, progress: Progress | None = None):
        self.ns = ns
        self.volumes = volumes
        self.progress = progress or Silent()
        self.adopted: dict[int, set[int]] = {}   # block id -> volumes recorded by this pass

    def apply(self, problems: list[Problem]) -> None:
        work = sum(p.work for p in problems)
        if work:
            self.progress.phase("re-replicating", work)
        try:
            for problem in sorted(problems, key=_priority):
                name, *args = problem.action
                try:
                    problem.outcome = "repaired: " + getattr(self, f"fix_{name}")(*args)
                    problem.repaired = True
                except _Unchanged as exc:
                    problem.outcome = f"repaired by an earlier fix: {exc}"
                    problem.repaired = True
                except FsError as exc:
                    problem.outcome = f"not repaired: {exc}"
        finally:
            self.progress.close()
        delete_trash(self.ns, self.volumes)

    def _txn(self, action: tuple, body: Callable[[_Rows], str]) -> str:
        return self.ns.run(Op.REPAIR, action, lambda w: body(_Rows(self.ns, w.txn)))

    # --- recovery work -------------------------------------------------------------------

    def fix_delete_trash(self) -> str:
        return f"deleted the files of {delete_trash(self.ns, self.volumes)} dropped blocks"

    def fix_recover_lease(self, ino: int) -> str:
        recover_lease(self.ns, self.volumes, ino, RecoveryReport())
        return "lease recovered"

    def fix_purge(self, ino: int) -> str:
        self.ns.purge(ino)
        with self.ns.env.begin() as txn:
            if txn.get(u64(ino), db=self.ns.db["inodes"]) is not None:
                raise FsError(errno.EBUSY, f"inode {ino} still has links")
        return "purged"

    def fix_set_clean(self) -> str:
        def body(rows: _Rows) -> str:
            rows.txn.put(b"state", schema.pack_meta("clean"), db=rows.db["meta"])
            return "state set to clean"
        return self._txn(("set_clean",), body)

    def fix_make_root(self) -> str:
        def body(rows: _Rows) -> str:
            if rows.inode(ROOT_INO) is not None:
                raise _Unchanged("the root exists")
            now = now_ns()
            root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), 2, 0, 0,
                         now, now, now, ROOT_INO)
            root.next_cookie = 1 + max((c for _, _, c in rows.children(ROOT_INO)),
                                       default=schema.FIRST_COOKIE - 1)
            rows.put_inode(root)
            rows.recount(ROOT_INO)
            return "root directory recreated"
        return self._txn(("make_root",), body)

    # --- names ---------------------------------------------------------------------------

    def fix_remove_dentry(self, parent: int, name: bytes, reason: str) -> str:
        """Remove a bad name, if ``reason`` still holds: its directory is missing or not a
        directory (``non_dir``), its inode is missing (``dangling``), or it is an extra
        name of a directory (``dir_link``). A child that loses its last name goes to
        lost+found in the next pass (its nlink is left alone, so it is never purged)."""
        def body(rows: _Rows) -> str:
            entry = rows.dentry(parent, name)
            if entry is None:
                raise _Unchanged("the entry is gone")
            pinode, child = rows.inode(parent), rows.inode(entry[0])
            still = {
                "non_dir": pinode is None or not stat.S_ISDIR(pinode.mode),
                "dangling": child is None,
                "dir_link": child is not None and stat.S_ISDIR(child.mode)
                and (child.ino == ROOT_INO or len(rows.links(child.ino)) > 1),
            }[reason]
            if not still:
                raise _Unchanged("the entry is no longer wrong")
            rows.remove_dentry(parent, name)
            rows.recount(parent)
            return "entry removed"
        return self._txn(("remove_dentry", parent, name, reason), body)

    def fix_delete_cookie(self, parent: int, cookie: int) -> str:
        def body(rows: _Rows) -> str:
            row = rows.cookie_row(parent, cookie)
            entry = rows.dentry(parent, row[1]) if row else None
            if not row or (entry and entry[1] == cookie):
                raise _Unchanged("no longer stray")
            rows.txn.delete(schema.cookie_key(parent, cookie), db=rows.db["dircookies"])
            return "row deleted"
        return self._txn(("delete_cookie", parent, cookie), body)

    def fix_delete_backlink(self, child: int, parent: int, name: bytes) -> str:
        def body(rows: _Rows) -> str:
            entry = rows.dentry(parent, name)
            if entry and entry[0] == child:
                raise _Unchanged("no longer stray")
            rows.txn.delete(schema.backlink_key(child, parent, name), db=rows.db["backlinks"])
            return "row deleted"
        return self._txn(("delete_backlink", child, parent, name), body)

    def fix_add_backlink(self, child: int, parent: int, name: bytes) -> str:
        def body(rows: _Rows) -> str:
            entry = rows.dentry(parent, name)
            if not entry or entry[0] != child:
                raise _Unchanged("the entry changed")
            rows.txn.put(schema.backlink_key(child, parent, name), b"",
                         db=rows.db["backlinks"])
            return "backlink added"
        return self._txn(("add_backlink", child, parent, name), body)

    def fix_fix_cookie(self, parent: int, name: bytes) -> str:
        """Give the entry its dircookies row, with a fresh cookie if another name holds its
        own; a row with the right name but the wrong inode is corrected in place."""
        def body(rows: _Rows) -> str:
            entry = rows.dentry(parent, name)
            if entry is None:
                raise _Unchanged("the entry is gone")
            child, cookie = entry
            held = rows.cookie_row(parent, cookie)
            if held == (child, name):
                raise _Unchanged("the row exists")
            pinode = rows.inode(parent)
            if (held and held[1] != name) or cookie < schema.FIRST_COOKIE:
                cookie = rows.free_cookie(pinode)
                rows.txn.put(schema.dentry_key(parent, name),
                             schema.dentry_value(child, cookie), db=rows.db["dentries"])
            pinode.next_cookie = max(pinode.next_cookie, cookie + 1)
            rows.put_inode(pinode)
            rows.txn.put(schema.cookie_key(parent, cookie), schema.cookie_value(child, name),
                         db=rows.db["dircookies"])
            return f"cookie {cookie} recorded"
        return self._txn(("fix_cookie", parent, name), body)

    def fix_fix_next_cookie(self, parent: int) -> str:
        def body(rows: _Rows) -> str:
            pinode = rows.inode(parent)
            used = [c for _, _, c in rows.children(parent)]
            used += [schema.split_cookie_key(k)[1]
                     for k, _ in rows.prefixed("dircookies", u64(parent))]
            if pinode is None or pinode.next_cookie > max(used, default=0):
                raise _Unchanged("next_cookie is fine")
            pinode.next_cookie = max(used) + 1
            rows.put_inode(pinode)
            return f"next_cookie set to {pinode.next_cookie}"
        return self._txn(("fix_next_cookie", parent), body)

    def fix_remove_orphan_row(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            if not rows.links(ino):
                raise _Unchanged("the inode has no name")
            rows.txn.delete(u64(ino), db=rows.db["orphans"])
            return "removed from orphans"
        return self._txn(("remove_orphan_row", ino), body)

    def fix_relink(self, ino: int) -> str:
        """Give a nameless inode (or one directory of a loop) the name ``#<ino>`` in
        ``/lost+found``, as e2fsck does, so its data survives."""
        lost_found = self._lost_found()

        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if inode is None:
                raise _Unchanged("the inode is gone")
            old = rows.links(ino)
            if old and (not stat.S_ISDIR(inode.mode) or rows.reaches_root(ino)):
                raise _Unchanged("the inode has a name")
            for parent, old_name in old:
                rows.remove_dentry(parent, old_name)
            name = f"#{ino}".encode()
            while rows.dentry(lost_found, name) is not None:
                name += b"+"
            rows.add_dentry(rows.inode(lost_found), name, ino)
            inode = rows.inode(ino)
            inode.parent = lost_found
            inode.nlink = rows.expected_nlink(inode)
            rows.put_inode(inode)
            for parent in {lost_found, *(p for p, _ in old)}:
                rows.recount(parent)
            return f"moved to /{LOST_FOUND.decode()}/{_show(name)}"
        return self._txn(("relink", ino), body)

    def _lost_found(self) -> int:
        with self.ns.env.begin() as txn:
            raw = txn.get(schema.dentry_key(ROOT_INO, LOST_FOUND), db=self.ns.db["dentries"])
        if raw is None:
            inode = self.ns.make_node(ROOT_INO, LOST_FOUND, stat.S_IFDIR | 0o700, os.getuid(),
                                      os.getgid(), 0, now_ns())
            return inode.ino
        ino = schema.parse_dentry_value(raw)[0]
        if not stat.S_ISDIR(self.ns.get_inode(ino).mode):
            raise FsError(errno.ENOTDIR, "/lost+found is not a directory")
        return ino

    # --- inode fields ----------------------------------------------------------------------

    def fix_fix_nlink(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if inode is None:
                raise _Unchanged("the inode is gone")
            expected = rows.expected_nlink(inode)
            if expected == 0 and not rows.is_orphan(ino):
                raise _Unchanged("no name left: lost+found takes it")
            if inode.nlink == expected:
                raise _Unchanged("nlink is right")
            inode.nlink = expected
            rows.put_inode(inode)
            return f"nlink set to {expected}"
        return self._txn(("fix_nlink", ino), body)

    def fix_fix_parent(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if inode is None:
                raise _Unchanged("the inode is gone")
            parents = [p for p, _ in rows.links(ino)] if ino != ROOT_INO else [ROOT_INO]
            if not parents or inode.parent in parents:
                raise _Unchanged("parent is right")
            old, inode.parent = inode.parent, parents[0]
            rows.put_inode(inode)
            return f"parent {old} -> {inode.parent}"
        return self._txn(("fix_parent", ino), body)

    def fix_fix_symlink_size(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            target = rows.txn.get(u64(ino), db=rows.db["symlinks"])
            if inode is None or target is None or inode.size == len(target):
                raise _Unchanged("size is right")
            inode.size = len(target)
            rows.put_inode(inode)
            return f"size set to {inode.size}"
        return self._txn(("fix_symlink_size", ino), body)

    def fix_clear_symlink(self, ino: int) -> str:
        """A symlink without a target cannot be repaired; like e2fsck, clear it."""
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if inode is None or rows.txn.get(u64(ino), db=rows.db["symlinks"]) is not None:
                raise _Unchanged("no longer a symlink without target")
            for parent, name in rows.links(ino):
                rows.remove_dentry(parent, name)
            inode.nlink = 0
            rows.put_inode(inode)
            rows.txn.put(u64(ino), b"", db=rows.db["orphans"])
            return "unlinked"
        result = self._txn(("clear_symlink", ino), body)
        self.ns.purge(ino)
        return result + " and purged"

    def fix_fix_size(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            bs = self.ns.config.block_size
            ends = [schema.split_block_key(k)[1] * bs + BlockRecord.unpack(v).length
                    for k, v in rows.prefixed("blocks", u64(ino))]
            if inode is None or inode.size >= max(ends, default=0):
                raise _Unchanged("size covers the blocks")
            old, inode.size = inode.size, max(ends)
            rows.put_inode(inode)
            return f"size {old} -> {inode.size}"
        return self._txn(("fix_size", ino), body)

    def fix_delete_rows(self, dbname: str, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if dbname == "symlinks" and inode is not None and stat.S_ISLNK(inode.mode):
                raise _Unchanged("the inode is a symlink")
            if dbname in ("xattrs", "inherited") and inode is not None:
                raise _Unchanged("the inode exists")
            if dbname == "orphans" and inode is not None:
                raise _Unchanged("the inode exists")
            if dbname in ("xattrs", "inherited"):
                rows.delete_prefix(dbname, u64(ino))
            else:
                rows.txn.delete(u64(ino), db=rows.db[dbname])
            return f"'{dbname}' rows deleted"
        return self._txn(("delete_rows", dbname, ino), body)

    # --- block records and the replicas index -------------------------------------------------

    def fix_drop_block(self, ino: int, index: int) -> str:
        """Drop a block of a missing or non-regular inode; its files go through the trash."""
        def body(rows: _Rows) -> str:
            rec = rows.block(ino, index)
            inode = rows.inode(ino)
            if rec is None or (inode is not None and stat.S_ISREG(inode.mode)):
                raise _Unchanged("the block is gone or its file exists")
            rows.txn.delete(schema.block_key(ino, index), db=rows.db["blocks"])
            for vid in rec.volumes:
                rows.txn.delete(schema.replica_key(vid, rec.block_id), db=rows.db["replicas"])
            rows.txn.put(u64(rec.block_id), schema.trash_value(rec.gs, rec.volumes),
                         db=rows.db["trash"])
            return "block dropped, files trashed"
        return self._txn(("drop_block", ino, index), body)

    def fix_index_set(self, vid: int, bid: int, ino: int, index: int) -> str:
        def body(rows: _Rows) -> str:
            rec = rows.block(ino, index)
            if rec is None or rec.block_id != bid or vid not in rec.volumes:
                raise _Unchanged("the block record changed")
            rows.txn.put(schema.replica_key(vid, bid), schema.block_key(ino, index),
                         db=rows.db["replicas"])
            return "index row written"
        return self._txn(("index_set", vid, bid, ino, index), body)

    def fix_index_delete(self, vid: int, bid: int) -> str:
        def body(rows: _Rows) -> str:
            raw = rows.txn.get(schema.replica_key(vid, bid), db=rows.db["replicas"])
            if raw is None:
                raise _Unchanged("the row is gone")
            rec = rows.block(*schema.split_block_key(raw))
            if rec is not None and rec.block_id == bid and vid in rec.volumes:
                raise _Unchanged("the row matches a block record")
            rows.txn.delete(schema.replica_key(vid, bid), db=rows.db["replicas"])
            return "index row deleted"
        return self._txn(("index_delete", vid, bid), body)

    def fix_raise_counter(self, name: str, minimum: int) -> str:
        """Counters only grow. ``txid`` numbers the repair's own journal record, so it is
        raised in a plain transaction first and the raise is journaled right after."""
        if name == "txid":
            with self.ns.env.begin(write=True) as txn:
                current = schema.read_u64(txn.get(b"txid", db=self.ns.db["meta"]))
                if current < minimum:
                    txn.put(b"txid", u64(minimum), db=self.ns.db["meta"])
            self._txn(("raise_counter", name, current, minimum), lambda rows: "")
            return f"txid {current} -> {minimum}"

        def body(rows: _Rows) -> str:
            current = schema.read_u64(rows.txn.get(name.encode(), db=rows.db["meta"]) or u64(0))
            if current >= minimum:
                raise _Unchanged(f"{name} is {current}")
            rows.txn.put(name.encode(), u64(minimum), db=rows.db["meta"])
            return f"{name} {current} -> {minimum}"
        return self._txn(("raise_counter", name, minimum), body)

    # --- replica files ------------------------------------------------------------------------

    def fix_adopt_replica(self, ino: int, index: int, bid: int, vid: int) -> str:
        """Record a whole replica on a volume the block was not recorded on, as the next
        mount's volume scan would (``tierfs.fs.recovery.adopt_replica`` checks it again)."""
        volume = self.volumes.get(vid)
        try:
            adopt_replica(self.ns, self.volumes, volume, ino, index, bid)
        except NotAdopted as exc:
            if exc.changed:
                raise _Unchanged(str(exc)) from None
            raise FsError(errno.EIO, str(exc)) from None
        self.adopted.setdefault(bid, set()).add(vid)
        return f"recorded as a replica on {volume.path}"

    def fix_drop_replica(self, ino: int, index: int, bid: int, gs: int, vid: int,
                         good: tuple[int, ...]) -> str:
        """Stop recording a bad replica, then delete its files. ``good`` names replicas known
        good when checked; one must still be recorded (an empty ``good`` is for leased
        blocks, whose lease recovery would drop an unopenable replica anyway)."""
        def body(rows: _Rows) -> str:
            rec = rows.block(ino, index)
            if rec is None or rec.block_id != bid or vid not in rec.volumes:
                raise _Unchanged("the replica is no longer recorded")
            if good and (rec.gs != gs or not set(good) & set(rec.volumes)):
                raise FsError(errno.EIO, "no other good replica is left")
            rec.volumes = tuple(v for v in rec.volumes if v != vid)
            rows.put_block(ino, index, rec)
            rows.txn.delete(schema.replica_key(vid, bid), db=rows.db["replicas"])
            return "replica dropped"
        result = self._txn(("drop_replica", ino, index, bid, gs, vid), body)
        volume = self.volumes.by_id.get(vid)
        if volume is not None:
            volume.delete_replica(bid, None)
            return result + ", files deleted"
        return result

    def fix_truncate_replica(self, ino: int, index: int, bid: int, gs: int, vid: int,
                             length: int) -> str:
        """Cut a replica longer than its block: the bytes past the recorded length were
        never acknowledged (reads stop at the recorded length)."""
        rec = self.ns.get_blocks(ino).get(index)
        if rec is None or rec.block_id != bid or rec.gs != gs or rec.length != length:
            raise _Unchanged("the block record changed")
        with self.volumes.get(vid).open_replica(bid, gs, writable=True) as replica:
            replica.truncate(length)
            replica.fsync()
        self._txn(("truncate_replica", ino, index, bid, gs, vid, length), lambda rows: "")
        return f"replica cut to {length} bytes"

    def fix_unlink_meta(self, vid: int, bid: int, gs: int) -> str:
        volume = self.volumes.get(vid)
        with self.ns.env.begin() as txn:
            owner = txn.get(schema.replica_key(vid, bid), db=self.ns.db["replicas"])
            raw = None if owner is None else txn.get(owner, db=self.ns.db["blocks"])
        if raw is not None and BlockRecord.unpack(raw).gs == gs:
            raise _Unchanged("the meta file is current")
        self._txn(("unlink_meta", vid, bid, gs), lambda rows: "")
        _unlink(volume.meta_path(bid, gs))
        return "meta file deleted"

    def fix_delete_paths(self, vid: int, bid: int | None, paths: list[str]) -> str:
        """Delete orphan replica files, unless the block is now recorded on the volume
        (files at their layout paths would then be its replica)."""
        volume = self.volumes.get(vid)
        if bid is not None:
            with self.ns.env.begin() as txn:
                if txn.get(schema.replica_key(vid, bid), db=self.ns.db["replicas"]):
                    raise _Unchanged("the block is recorded on this volume")
        self._txn(("delete_paths", vid, bid, [str(p) for p in paths]), lambda rows: "")
        for path in paths:
            _unlink(Path(path))
        return f"{len(paths)} file(s) deleted from {volume.path}"

    def fix_clear_tmp(self, vid: int, name: str) -> str:
        path = self.volumes.get(vid).tmp_dir / name
        self._txn(("clear_tmp", vid, name), lambda rows: "")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            _unlink(path)
        return "deleted"

    # --- replication -----------------------------------------------------------------------

    def fix_replicate(self, ino: int, index: int, bid: int, gs: int, good: tuple[int, ...],
                      avoid: tuple[int, ...]) -> str:
        """Copy a good replica to the volumes ``choose_volumes`` picks, as the daemon's
        replication monitor does; ``avoid`` (volumes that held bad or unrecorded files of
        the block) only when nothing else qualifies. Each copy is recorded with
        ``add_replica``, which refuses it if the block changed meanwhile."""
        rec = self.ns.get_blocks(ino).get(index)
        if rec is None or rec.block_id != bid or rec.gs != gs:
            raise _Unchanged("the block changed")
        policy, replication = Resolver(self.ns).placement(ino)
        good = [*good, *self.adopted.get(bid, ())]
        good = [v for v in good if v in rec.volumes and v in self.volumes.by_id]
        if not good:
            raise FsError(errno.EIO, "no good replica is left to copy")
        existing = [self.volumes.get(v) for v in good]
        have = sum(not v.storage_type.transient for v in existing)
        if have >= replication:
            raise _Unchanged(f"{have} persistent replicas")
        targets = self._targets(policy, replication, rec, existing, set(avoid))
        added: list[Volume] = []
        try:
            for target in targets:
                self._copy(ino, index, rec, existing, target)
                added.append(target)
                self.progress.advance(rec.length)
        except FsError as exc:
            done = f"{_added(added)}; then " if added else ""
            raise FsError(exc.errno, f"{done}{copy_error(exc)}") from None
        if have + len(added) < replication:
            done = f"{_added(added)}; " if added else ""
            raise FsError(errno.ENOSPC, f"{done}only {have + len(added)} of {replication} "
                                        f"replicas placeable: no other volume allowed by "
                                        f"{policy.name} has room")
        return _added(added)

    def _targets(self, policy: BlockStoragePolicy, replication: int, rec: BlockRecord,
                 existing: list[Volume], avoid: set[int]) -> list[Volume]:
        """``choose_volumes`` on the volumes the block is not on; those in ``avoid`` join
        only if the others cannot take every replica still needed."""
        have = sum(not v.storage_type.transient for v in existing)
        kept = {v.id for v in existing}
        free = [v for v in self.volumes if v.id not in rec.volumes or v.id in kept]
        preferred = choose_volumes(policy, replication,
                                   VolumeSet(v for v in free if v.id not in avoid),
                                   rec.length, existing)
        if have + len(preferred) >= replication or not avoid & {v.id for v in free}:
            return preferred
        anywhere = choose_volumes(policy, replication, VolumeSet(free), rec.length, existing)
        return anywhere if len(anywhere) > len(preferred) else preferred

    def _copy(self, ino: int, index: int, rec: BlockRecord, sources: list[Volume],
              target: Volume) -> None:
        """One verified copy from the first source that reads, then its record."""
        error: FsError | None = None
        for source in self.volumes.sorted_for_read(v.id for v in sources):
            try:
                copy_replica(source, target, rec.block_id, rec.gs)
                break
            except FsError as exc:
                error = exc
        else:
            raise error or FsError(errno.EIO, "no replica to copy")
        if not self.ns.add_replica(ino, index, rec.block_id, rec.gs, target.id):
            target.delete_replica(rec.block_id, rec.gs)
            raise FsError(errno.EAGAIN, "the block changed during the copy")

    def fix_drop_excess(self, ino: int, index: int, bid: int, gs: int,
                        good: tuple[int, ...]) -> str:
        """Drop the surplus replicas of an over-replicated block, never going below its
        replication: of the types ``policy.choose_excess`` names, the replica on the
        fullest volume first. Files go through the trash (deleted after the commit)."""
        policy, replication = Resolver(self.ns).placement(ino)

        def body(rows: _Rows) -> str:
            rec = rows.block(ino, index)
            if rec is None or rec.block_id != bid or rec.gs != gs:
                raise _Unchanged("the block changed")
            persistent = [self.volumes.by_id[v] for v in good if v in rec.volumes
                          and v in self.volumes.by_id
                          and not self.volumes.by_id[v].storage_type.transient]
            surplus = len(persistent) - replication
            if surplus <= 0:
                raise _Unchanged(f"{len(persistent)} persistent replicas")
            victims: list[Volume] = []
            for storage_type in policy.choose_excess(
                    replication, [v.storage_type for v in persistent])[:surplus]:
                candidates = [v for v in persistent
                              if v.storage_type == storage_type and v not in victims]
                victims.append(min(candidates, key=lambda v: (v.free_bytes(), -v.id)))
            dropped = tuple(v.id for v in victims)
            rec.volumes = tuple(v for v in rec.volumes if v not in dropped)
            rows.put_block(ino, index, rec)
            for vid in dropped:
                rows.txn.delete(schema.replica_key(vid, bid), db=rows.db["replicas"])
            raw = rows.txn.get(u64(bid), db=rows.db["trash"])
            earlier = schema.parse_trash_value(raw)[1] if raw is not None else ()
            rows.txn.put(u64(bid), schema.trash_value(gs, tuple(sorted({*earlier, *dropped}))),
                         db=rows.db["trash"])
            where = ", ".join(f"{v.path} ({v.storage_type.name})" for v in victims)
            return f"{len(victims)} excess replica(s) dropped from {where}"
        return self._txn(("drop_excess", ino, index, bid, gs, good), body)


def _added(volumes: list[Volume]) -> str:
    where = ", ".join(f"{v.path} ({v.storage_type.name})" for v in volumes)
    return f"{len(volumes)} replica(s) added on {where}"


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise FsError(exc.errno or errno.EIO, f"cannot delete {path}: {exc.strerror}") from None
