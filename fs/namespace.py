"""The namespace: every metadata read and write transaction of tierfs.

Operations never see LMDB keys; they call the methods here. Each mutating method is one
LMDB write transaction that takes the next TxID and appends one journal record in the same
transaction (``_mutate``). A transaction never spans an ``await``: every method is
synchronous, so inside the trio thread a mutation is atomic with respect to every other
request.

Write transactions are retried after growing the map when LMDB reports the map full; a
full disk becomes ``FsError(ENOSPC)``. Bodies of mutations therefore change nothing
outside the transaction: in-memory state is updated by the caller after the method returns.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import lmdb

from tierfs.backends.volume import disk_free
from tierfs.fs import inherited, schema
from tierfs.fs.errors import FsError
from tierfs.fs.schema import BlockRecord, Inherited, Inode, Op, ROOT_INO, SatisfyReason, u64
from tierfs.fs.space_reserve import SpaceReserve

log = logging.getLogger(__name__)

NAME_MAX = 255
INITIAL_MAP_SIZE = 64 << 20
MAX_MAP_SIZE = 1 << 40
# Below this much free space on the namespace's disk, a failed write is taken for a full
# disk: LMDB writes a commit's dirty pages (a few to a few hundred KiB) in one go.
NEARLY_FULL_BYTES = 16 << 20
MAX_READERS = 256
# On a full disk (fs/space_reserve.py), removals may use all of the removal reserve: they
# are how a user frees space. Mutations that add nothing lasting but their journal record
# (attribute changes, the sizes and leases of open files, recovery) may use its first half
# only, so that a chmod loop or a file kept open cannot use up what rm needs. Mutations
# that add names, inodes, attributes, blocks or replicas may not use it: they fill disks.
RESERVE_FOR_REMOVALS = frozenset({
    Op.UNLINK, Op.RENAME, Op.REMOVEXATTR, Op.TRUNCATE, Op.PURGE, Op.TRASH_DONE, Op.MOUNT})
RESERVE_HALF_FOR = frozenset({Op.SETATTR, Op.UPDATE_BLOCKS, Op.LEASE, Op.RECOVER})
# A commit is retried on the reserve only while the disk is this close to full: a failed
# commit with more room left is not short of space, and must not use the reserve up.
RESERVE_RETRY_FREE = 1 << 20
# The size LMDB gives its lock file: a 192-byte header holding the first reader slot, and
# 64 bytes for each other (measured with py-lmdb's LMDB: 1 reader 192, 256 readers 16,512).
LOCK_FILE_BYTES = (MAX_READERS - 1) * 64 + 192
# Block ids and generation stamps are reserved from the durable counters in batches so a
# new block costs one transaction; skipped numbers are simply never used. Each batch is
# synced before use: numbers handed out reach replica files (names, meta headers) on disk,
# and must never be handed out again after a power loss.
ID_BATCH = 256


@dataclass
class VolumeConfig:
    """A volume as recorded in the namespace at mkfs."""

    id: int
    uuid: str
    storage_type: str
    path: str
    capacity: int | None = None

    def to_dict(self) -> dict:
        return {"id": self.id, "uuid": self.uuid, "storage_type": self.storage_type,
                "path": self.path, "capacity": self.capacity}


@dataclass
class FsConfig:
    """Settings chosen at mkfs; fixed for the life of the filesystem."""

    fs_uuid: str
    block_size: int
    bytes_per_checksum: int
    replication: int
    default_policy: str
    rename_mode: str
    volumes: list[VolumeConfig] = field(default_factory=list)


def check_name(name: bytes) -> None:
    """Names are enforced here so that f_namemax in statfs is the truth."""
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
    if not name or b"/" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL, f"invalid name {name!r}")


def _enoent(what: str) -> FsError:
    return FsError(errno.ENOENT, what)


class _Write:
    """The context handed to a mutation body: the transaction, its TxID, its record."""

    __slots__ = ("txn", "txid", "args", "trash", "inherited_changed")

    def __init__(self, txn: lmdb.Transaction, txid: int, args: tuple):
        self.txn = txn
        self.txid = txid
        self.args = args
        # Replicas dropped by this transaction: (block_id, gs, volumes) to delete after commit.
        self.trash: list[tuple[int, int, tuple[int, ...]]] = []
        # Inodes at or below which inherited values may have changed without a set:
        # moved by a rename in follow mode, or a hard link whose first name (``parent``,
        # which decides its values) this transaction removed.
        self.inherited_changed: list[int] = []


class Namespace:
    """An open LMDB namespace. One per process; tools may open it beside a mount."""

    def __init__(self, path: Path, env: lmdb.Environment, readonly: bool):
        self.path = path
        self.env = env
        self.readonly = readonly
        self.db = {name: env.open_db(name.encode(), create=not readonly)
                   for name in schema.DATABASES}
        self.config = self._load_config()
        self._reserved: dict[str, list[int]] = {"next_block_id": [0, 0], "gs": [0, 0]}
        # Mutations committed through this object. A mount is the only writer (the mount
        # lock keeps repairs out), so an unchanged count means an unchanged namespace.
        self.commits = 0
        # The count a namespace sync last made durable (``sync``): equal to ``commits``,
        # every committed mutation is on disk.
        self.synced_commits = 0
        self.last_inherited_changed: list[int] = []  # of the last mutation (``_Write``)
        # Allocated by the mount (``refill``); tools that write use what a mount left.
        self.space_reserve = None if readonly else SpaceReserve(path)

    # --- opening ------------------------------------------------------------------------

    @staticmethod
    def _open_env(path: Path, readonly: bool, frozen: bool = False) -> lmdb.Environment:
        """``frozen``: the namespace's directory cannot be written at all (read-only media),
        so LMDB cannot use its lock file either; nothing else can write it, so none is
        needed."""
        if not frozen:  # read-only opens register as readers in the lock file too
            _allocate_lock_file(path / "lock.mdb")
        size = INITIAL_MAP_SIZE
        data = path / "data.mdb"
        if data.exists():
            size = max(size, data.stat().st_size * 2)
        # As bytes: py-lmdb encodes a str path as strict UTF-8, which a name that is
        # not valid UTF-8 (surrogate-escaped by Python) cannot be.
        return lmdb.open(os.fsencode(path), map_size=size, max_dbs=len(schema.DATABASES) + 2,
                         subdir=True, readonly=readonly, sync=False, metasync=False,
                         readahead=False, max_readers=MAX_READERS, lock=not frozen)

    @classmethod
    def create(cls, path: Path, config: FsConfig, *, uid: int, gid: int, now_ns: int,
               root_mode: int = 0o755) -> "Namespace":
        """Write a new namespace: configuration, counters and the root directory."""
        try:
            return cls._create(path, config, uid=uid, gid=gid, now_ns=now_ns,
                               root_mode=root_mode)
        except lmdb.Error as exc:
            raise lmdb_failure(path, exc) from None

    @classmethod
    def _create(cls, path: Path, config: FsConfig, *, uid: int, gid: int, now_ns: int,
                root_mode: int) -> "Namespace":
        path.mkdir(parents=True, exist_ok=True)
        env = cls._open_env(path, readonly=False)
        try:
            with env.begin(write=True) as txn:
                meta = env.open_db(b"meta", txn=txn)
                if txn.get(b"fs_uuid", db=meta) is not None:
                    raise FsError(errno.EEXIST, f"{path} already holds a tierfs namespace")
                values = {
                    "fs_uuid": config.fs_uuid, "layout_version": schema.LAYOUT_VERSION,
                    "block_size": config.block_size,
                    "bytes_per_checksum": config.bytes_per_checksum,
                    "replication": config.replication, "default_policy": config.default_policy,
                    "rename_mode": config.rename_mode, "state": "clean",
                    "volumes": [v.to_dict() for v in config.volumes],
                }
                for key, value in values.items():
                    txn.put(key.encode(), schema.pack_meta(value), db=meta)
                for key, first in schema.COUNTERS.items():
                    txn.put(key.encode(), u64(first), db=meta)
            ns = cls(path, env, readonly=False)
            root = Inode(ROOT_INO, stat.S_IFDIR | root_mode, uid, gid, 2, 0, 0,
                         now_ns, now_ns, now_ns, ROOT_INO)

            def body(w: _Write) -> None:
                w.txn.put(u64(ROOT_INO), root.pack(), db=ns.db["inodes"])

            ns._mutate(Op.MKFS, (config.fs_uuid,), body)
            ns.sync()
            return ns
        except BaseException:
            env.close()
            raise

    @classmethod
    def open(cls, path: Path, *, readonly: bool = False, frozen: bool = False) -> "Namespace":
        """``frozen``: the directory cannot be written at all; opened read-only."""
        readonly = readonly or frozen
        if not (path / "data.mdb").exists():
            raise FsError(errno.ENOENT, f"{path} holds no tierfs namespace")
        try:
            env = cls._open_env(path, readonly, frozen)
        except lmdb.Error as exc:
            raise FsError(errno.EIO, f"cannot open namespace {path}: {exc}") from None
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO, f"cannot open namespace {path}: "
                          f"{exc.strerror or exc}") from None
        return cls(path, env, readonly)

    def close(self) -> None:
        self.env.close()

    def sync(self) -> None:
        """Force every committed transaction to disk (fsync, syncfs, the 1 s tick). A
        read-only namespace has none."""
        if self.readonly:
            return
        commits = self.commits  # committed before the sync starts: made durable by it
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            raise lmdb_failure(self.path, exc) from None
        self.synced_commits = commits

    @property
    def all_synced(self) -> bool:
        """Whether every committed mutation is durable. Syncs run in worker threads while
        the mount commits; one that finishes after a later one can set ``synced_commits``
        back, which only makes this False too soon."""
        return self.synced_commits == self.commits

    def _load_config(self) -> FsConfig:
        with self.env.begin() as txn:
            def get(key: str):
                raw = txn.get(key.encode(), db=self.db["meta"])
                if raw is None:
                    raise FsError(errno.EIO, f"namespace {self.path} lacks '{key}'")
                return schema.unpack_meta(raw)
            version = get("layout_version")
            if version != schema.LAYOUT_VERSION:
                raise FsError(errno.EIO, f"unsupported layout version {version}")
            return FsConfig(
                fs_uuid=get("fs_uuid"), block_size=get("block_size"),
                bytes_per_checksum=get("bytes_per_checksum"),
                replication=get("replication"), default_policy=get("default_policy"),
                rename_mode=get("rename_mode"),
                volumes=[VolumeConfig(**v) for v in get("volumes")])

    # --- the write transaction ------------------------------------------------------------

    def _mutate(self, op: int, args: tuple, body: Callable[[_Write], object]):
        """Run ``body`` in one write transaction with a fresh TxID and a journal record.

        Returns ``(result, trash)``-free: the body's result. Replicas the body trashed are
        available through ``self.last_trash`` for deletion after the commit, and inodes
        whose inherited values may have changed through ``self.last_inherited_changed``.
        """
        while True:
            txn = self.env.begin(write=True)
            committing = False
            try:
                txid = self._take(txn, "txid") + 1
                w = _Write(txn, txid, args)
                result = body(w)
                txn.put(u64(txid), schema.journal_record(op, w.args), db=self.db["journal"])
                committing = True
                txn.commit()
            except lmdb.MapFullError:
                txn.abort()
                self._grow_map()
                continue
            except lmdb.Error as exc:
                txn.abort()
                failure = lmdb_failure(self.path, exc)
                if (committing and failure.errno == errno.ENOSPC
                        and self._release_reserve_for(op, args)):
                    continue
                raise failure from None
            except BaseException:
                txn.abort()
                raise
            self.commits += 1
            self.last_trash = w.trash
            self.last_inherited_changed = w.inherited_changed
            return result

    def _release_reserve_for(self, op: int, args: tuple) -> bool:
        """Give part of the removal reserve back to the full disk when ``op`` may use it
        (``RESERVE_FOR_REMOVALS``); True when the mutation should be tried again. Only a
        failed commit comes here (errors of the body itself are not retried), and a disk
        with room left means some failure other than a want of room."""
        reserve = self.space_reserve
        if reserve is None or _disk_free(self.path) >= RESERVE_RETRY_FREE:
            return False
        makes_whiteout = op == Op.RENAME and args[4] & RENAME_WHITEOUT
        if op in RESERVE_FOR_REMOVALS and not makes_whiteout:
            keep = 0
        elif op in RESERVE_HALF_FOR:
            keep = reserve.size // 2
        else:
            return False
        try:
            return reserve.release_some(keep)
        except OSError as exc:
            log.warning("cannot release the removal reserve: %s", exc.strerror or exc)
            return False

    def _grow_map(self) -> None:
        size = self.env.info()["map_size"]
        if size >= MAX_MAP_SIZE:
            raise FsError(errno.ENOSPC, "namespace reached its maximum size")
        self.env.set_mapsize(size * 2)
        log.info("namespace map grown to %d MiB", size * 2 >> 20)

    def _take(self, txn: lmdb.Transaction, counter: str, count: int = 1) -> int:
        """Advance a durable counter by ``count``; returns its value before the advance."""
        key = counter.encode()
        value = schema.read_u64(txn.get(key, db=self.db["meta"]))
        txn.put(key, u64(value + count), db=self.db["meta"])
        return value

    def last_txid(self) -> int:
        with self.env.begin() as txn:
            return schema.read_u64(txn.get(b"txid", db=self.db["meta"]))

    # --- small transaction helpers ----------------------------------------------------------

    def _inode(self, txn, ino: int) -> Inode:
        raw = txn.get(u64(ino), db=self.db["inodes"])
        if raw is None:
            raise _enoent(f"inode {ino} does not exist")
        return Inode.unpack(ino, raw)

    def _put_inode(self, txn, inode: Inode) -> None:
        txn.put(u64(inode.ino), inode.pack(), db=self.db["inodes"])

    def _dir(self, txn, ino: int) -> Inode:
        inode = self._inode(txn, ino)
        if not stat.S_ISDIR(inode.mode):
            raise FsError(errno.ENOTDIR, f"inode {ino} is not a directory")
        if inode.nlink == 0:
            raise _enoent(f"directory {ino} was removed")
        return inode

    def _child(self, txn, parent: int, name: bytes) -> tuple[int, int] | None:
        raw = txn.get(schema.dentry_key(parent, name), db=self.db["dentries"])
        return None if raw is None else schema.parse_dentry_value(raw)

    def _add_dentry(self, txn, parent: Inode, name: bytes, child: int) -> None:
        cookie = parent.next_cookie
        parent.next_cookie += 1
        txn.put(schema.dentry_key(parent.ino, name), schema.dentry_value(child, cookie),
                db=self.db["dentries"])
        txn.put(schema.cookie_key(parent.ino, cookie), schema.cookie_value(child, name),
                db=self.db["dircookies"])
        txn.put(schema.backlink_key(child, parent.ino, name), b"", db=self.db["backlinks"])

    def _remove_dentry(self, txn, parent: int, name: bytes) -> int:
        child, cookie = self._child(txn, parent, name)
        txn.delete(schema.dentry_key(parent, name), db=self.db["dentries"])
        txn.delete(schema.cookie_key(parent, cookie), db=self.db["dircookies"])
        txn.delete(schema.backlink_key(child, parent, name), db=self.db["backlinks"])
        return child

    def _any_backlink(self, txn, ino: int) -> int | None:
        with txn.cursor(db=self.db["backlinks"]) as cur:
            if cur.set_range(u64(ino)):
                child, parent, _ = schema.split_backlink_key(cur.key())
                if child == ino:
                    return parent
        return None

    def _is_empty_dir(self, txn, ino: int) -> bool:
        with txn.cursor(db=self.db["dentries"]) as cur:
            if cur.set_range(u64(ino)):
                return schema.split_dentry_key(cur.key())[0] != ino
        return True

    def _unlinked(self, w: _Write, inode: Inode, busy: bool) -> None:
        """An inode lost its last link: keep it as an orphan while in use, else purge."""
        if busy:
            w.txn.put(u64(inode.ino), b"", db=self.db["orphans"])
        else:
            self._purge(w, inode.ino)

    def _purge(self, w: _Write, ino: int) -> None:
        """Delete an inode and everything hanging off it; its replicas go to the trash."""
        txn = w.txn
        for index, rec in self._blocks(txn, ino):
            self._drop_block(w, ino, index, rec)
        for dbname in ("xattrs", "inherited"):
            self._delete_prefix(txn, dbname, u64(ino))
        for dbname in ("inodes", "symlinks", "leases", "orphans"):
            txn.delete(u64(ino), db=self.db[dbname])

    def _delete_prefix(self, txn, dbname: str, prefix: bytes) -> None:
        with txn.cursor(db=self.db[dbname]) as cur:
            if not cur.set_range(prefix):
                return
            while cur.key()[:len(prefix)] == prefix:
                if not cur.delete():
                    break

    def _drop_block(self, w: _Write, ino: int, index: int, rec: BlockRecord) -> None:
        txn = w.txn
        txn.delete(schema.block_key(ino, index), db=self.db["blocks"])
        for vol in rec.volumes:
            txn.delete(schema.replica_key(vol, rec.block_id), db=self.db["replicas"])
        txn.put(u64(rec.block_id), schema.trash_value(rec.gs, rec.volumes), db=self.db["trash"])
        w.trash.append((rec.block_id, rec.gs, rec.volumes))

    def _blocks(self, txn, ino: int) -> Iterator[tuple[int, BlockRecord]]:
        prefix = u64(ino)
        with txn.cursor(db=self.db["blocks"]) as cur:
            if not cur.set_range(prefix):
                return
            for key, value in cur:
                if key[:8] != prefix:
                    break
                yield schema.split_block_key(key)[1], BlockRecord.unpack(value)

    def _ops_chain(self, txn, ino: int, attr: int) -> list[inherited.Op | None]:
        """The inherited-xattr ops of ``ino`` and its ancestors (root last)."""
        ops = []
        db = self.db["inherited"]
        for _ in range(100_000):
            raw = txn.get(schema.inherited_key(ino, attr), db=db)
            ops.append(None if raw is None else inherited.Op.from_bytes(bytes(raw)))
            if ino == ROOT_INO:
                return ops
            ino = self._inode(txn, ino).parent
        raise FsError(errno.EIO, "parent loop in the namespace")

    def _put_op(self, txn, ino: int, attr: int, op: inherited.Op | None) -> None:
        key = schema.inherited_key(ino, attr)
        if op is None:
            txn.delete(key, db=self.db["inherited"])
        else:
            txn.put(key, op.to_bytes(), db=self.db["inherited"])

    def _index_subtree(self, w: _Write, ino: int, reason: int) -> None:
        """The subtree's effective placement changed: tell the satisfier, same txn."""
        w.txn.put(schema.satisfier_key(w.txid, ino), bytes((reason,)), db=self.db["satisfier"])

    @property
    def rename_mode(self) -> inherited.RenameMode:
        return inherited.RenameMode(self.config.rename_mode)

    def _moved(self, w: _Write, inode: Inode, new_parent: int) -> list:
        """Before a rename of ``inode`` into ``new_parent``: its new ops, and whether its
        own value changes (computed from the chains before anything moves).

        Fast path: a non-directory in rename-affected mode has no subtree, so "take the
        destination's value" is "have no op of its own"; the chains are walked only when
        the parent changes, to tell the satisfier whether the file's value changed.
        """
        txn, mode = w.txn, self.rename_mode
        plans = []
        simple = mode is inherited.RenameMode.FOLLOW and not stat.S_ISDIR(inode.mode)
        for attr in Inherited.ALL:
            if simple:
                changed = inode.parent != new_parent and (
                    inherited.resolve(self._ops_chain(txn, inode.ino, attr), mode).value
                    != inherited.resolve([None] + self._ops_chain(txn, new_parent, attr),
                                         mode).value)
                plans.append((attr, None, changed))
                continue
            old_chain = self._ops_chain(txn, inode.ino, attr)
            parent_chain = self._ops_chain(txn, new_parent, attr)
            op = inherited.op_for_rename(old_chain, parent_chain, w.txid, mode)
            changed = (inherited.resolve(old_chain, mode).value
                       != inherited.resolve([op] + parent_chain, mode).value)
            plans.append((attr, op, changed))
        return plans

    def _apply_moved(self, w: _Write, inode: Inode, plans: list) -> None:
        """Store the moved inode's ops and tell the satisfier about the subtree.

        A rename-affected move of a directory can change the value of any inode below it,
        even when the directory's own value stays, and the subtree cannot be inspected in
        O(1): it is always indexed. A file's subtree is itself: indexed when its value
        changes. A keep-mode move changes no value.
        """
        for attr, op, _ in plans:
            self._put_op(w.txn, inode.ino, attr, op)
        if self.rename_mode is not inherited.RenameMode.FOLLOW:
            return
        if stat.S_ISDIR(inode.mode) or any(changed for _, _, changed in plans):
            self._index_subtree(w, inode.ino, SatisfyReason.RENAME)
            w.inherited_changed.append(inode.ino)

    # --- reads ------------------------------------------------------------------------------

    def get_inode(self, ino: int) -> Inode:
        with self.env.begin() as txn:
            return self._inode(txn, ino)

    def lookup(self, parent: int, name: bytes) -> Inode:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
        with self.env.begin() as txn:
            if name == b".":
                return self._inode(txn, parent)
            if name == b"..":
                return self._inode(txn, self._inode(txn, parent).parent)
            found = self._child(txn, parent, name)
            if found is None:
                raise _enoent(f"{name!r} not found in {parent}")
            return self._inode(txn, found[0])

    def readdir(self, parent: int, after_cookie: int, limit: int) -> list[schema.DirRow]:
        """At most ``limit`` rows for entries with cookie > after_cookie, in cookie order."""
        out: list[schema.DirRow] = []
        if limit <= 0:
            return out
        prefix = u64(parent)
        dir_row, child_key = schema.dir_row, schema.cookie_value_child_key
        # The transaction's default database is ``inodes``, so the per-entry get needs no
        # keyword argument; listing large directories is paid per entry.
        with self.env.begin(db=self.db["inodes"]) as txn, \
                txn.cursor(db=self.db["dircookies"]) as cur:
            if not cur.set_range(schema.cookie_key(parent, after_cookie + 1)):
                return out
            get = txn.get
            for key, value in cur:
                if key[:8] != prefix:
                    break
                out.append(dir_row(key, value, get(child_key(value))))
                if len(out) == limit:
                    break
        return out

    def readlink(self, ino: int) -> bytes:
        with self.env.begin() as txn:
            target = txn.get(u64(ino), db=self.db["symlinks"])
        if target is None:
            raise FsError(errno.EINVAL, f"inode {ino} is not a symlink")
        return bytes(target)

    def get_xattr(self, ino: int, name: bytes) -> bytes:
        with self.env.begin() as txn:
            value = txn.get(schema.xattr_key(ino, name), db=self.db["xattrs"])
        if value is None:
            raise FsError(errno.ENODATA, "no such attribute")
        return bytes(value)

    def list_xattrs(self, ino: int) -> list[bytes]:
        prefix = u64(ino)
        names = []
        with self.env.begin() as txn, txn.cursor(db=self.db["xattrs"]) as cur:
            if cur.set_range(prefix):
                for key in cur.iternext(keys=True, values=False):
                    if key[:8] != prefix:
                        break
                    names.append(bytes(key[8:]))
        return names

    def xattr_bytes(self, ino: int) -> int:
        prefix = u64(ino)
        total = 0
        with self.env.begin() as txn, txn.cursor(db=self.db["xattrs"]) as cur:
            if cur.set_range(prefix):
                for key, value in cur:
                    if key[:8] != prefix:
                        break
                    total += len(key) - 8 + len(value)
        return total

    def get_blocks(self, ino: int) -> dict[int, BlockRecord]:
        with self.env.begin() as txn:
            return dict(self._blocks(txn, ino))

    def records_file(self, ino: int, size: int, blocks: dict[int, BlockRecord]) -> bool:
        """Whether the namespace holds this size and these blocks (stamp, length, volumes)
        for the file, with no truncate waiting to be completed in its lease: what an
        ``fdatasync`` needs recorded for the data to be found again."""
        with self.env.begin() as txn:
            raw = txn.get(u64(ino), db=self.db["inodes"])
            if raw is None or Inode.unpack(ino, raw).size != size:
                return False
            lease = txn.get(u64(ino), db=self.db["leases"])
            if lease is not None and schema.lease_truncate_to(bytes(lease)) is not None:
                return False
            for index, rec in blocks.items():
                stored = txn.get(schema.block_key(ino, index), db=self.db["blocks"])
                if stored is None or BlockRecord.unpack(bytes(stored)) != rec:
                    return False
        return True

    def parent_chain(self, ino: int) -> list[int]:
        """The inode and its ancestors up to the root (inherited xattrs, rename checks)."""
        chain = [ino]
        with self.env.begin() as txn:
            while chain[-1] != ROOT_INO:
                chain.append(self._inode(txn, chain[-1]).parent)
                if len(chain) > 100_000:
                    raise FsError(errno.EIO, f"parent loop above inode {ino}")
        return chain

    def inherited_chain(self, ino: int, attr: int) -> tuple[list[int], list[bytes | None]]:
        """Inodes from ``ino`` up to the root and their raw inherited-xattr ops (O(depth))."""
        inos, ops = self.inherited_chains(ino, (attr,))
        return inos, ops[0]

    def inherited_chains(self, ino: int, attrs: tuple[int, ...]
                         ) -> tuple[list[int], list[list[bytes | None]]]:
        """``inherited_chain`` for several attributes in one walk (one list per attribute):
        placement needs both policy and replication, and a walk per attribute cost the create
        handler 13% (with the policy resolved a third time for the copy-on-create stamp)."""
        inos: list[int] = []
        ops: list[list[bytes | None]] = [[] for _ in attrs]
        inherited_db = self.db["inherited"]
        with self.env.begin() as txn:
            while True:
                inos.append(ino)
                for attr, chain in zip(attrs, ops):
                    raw = txn.get(schema.inherited_key(ino, attr), db=inherited_db)
                    chain.append(None if raw is None else bytes(raw))
                if ino == ROOT_INO:
                    return inos, ops
                ino = self._inode(txn, ino).parent
                if len(inos) > 100_000:
                    raise FsError(errno.EIO, f"parent loop above inode {inos[0]}")

    def policy_stamp(self, ino: int) -> inherited.Op | None:
        """The file's own copy-on-create policy (HDFS file header), if it has one."""
        with self.env.begin() as txn:
            raw = txn.get(schema.inherited_key(ino, Inherited.POLICY_STAMP),
                          db=self.db["inherited"])
        return None if raw is None else inherited.Op.from_bytes(bytes(raw))

    def orphans(self) -> list[int]:
        with self.env.begin() as txn:
            return [schema.read_u64(k) for k in
                    txn.cursor(db=self.db["orphans"]).iternext(values=False)]

    def leases(self) -> dict[int, tuple[bytes, int]]:
        with self.env.begin() as txn:
            return {schema.read_u64(k): schema.parse_lease_value(v)
                    for k, v in txn.cursor(db=self.db["leases"])}

    def trash(self) -> list[tuple[int, int, tuple[int, ...]]]:
        with self.env.begin() as txn:
            return [(schema.read_u64(k), *schema.parse_trash_value(v))
                    for k, v in txn.cursor(db=self.db["trash"])]

    def counts(self) -> dict[str, int]:
        """Number of inodes and bytes used by the namespace (statfs)."""
        stats = self.env.stat()
        info = self.env.info()
        with self.env.begin() as txn:
            inodes = txn.stat(self.db["inodes"])["entries"]
        return {"inodes": inodes, "map_size": info["map_size"],
                "used": (info["last_pgno"] + 1) * stats["psize"]}

    def get_state(self) -> str:
        with self.env.begin() as txn:
            return schema.unpack_meta(txn.get(b"state", db=self.db["meta"]))

    # --- namespace mutations ------------------------------------------------------------------

    def make_node(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int,
                  now_ns: int, target: bytes | None = None,
                  stamp_policy: int | None = None) -> Inode:
        """Create a file, directory, symlink, FIFO, socket or device node.

        ``stamp_policy``: a copy-on-create policy (LAZY_PERSIST) the new file records as its
        own, as HDFS stamps it into the file header; not explicit, so listxattr does not
        show it and ``cp -a`` does not try to set it on a copy.
        """
        check_name(name)

        def body(w: _Write) -> Inode:
            txn = w.txn
            dir_inode = self._dir(txn, parent)
            if self._child(txn, parent, name) is not None:
                raise FsError(errno.EEXIST, f"{name!r} exists")
            ino = self._take(txn, "next_ino")
            is_dir = stat.S_ISDIR(mode)
            inode = Inode(ino, mode, uid, gid, 2 if is_dir else 1,
                          len(target) if target is not None else 0, rdev,
                          now_ns, now_ns, now_ns, parent)
            self._add_dentry(txn, dir_inode, name, ino)
            if is_dir:
                dir_inode.nlink += 1
            dir_inode.mtime_ns = dir_inode.ctime_ns = now_ns
            self._put_inode(txn, dir_inode)
            self._put_inode(txn, inode)
            if target is not None:
                txn.put(u64(ino), target, db=self.db["symlinks"])
            if stamp_policy is not None:
                self._put_op(txn, ino, Inherited.POLICY_STAMP,
                             inherited.Op(stamp_policy, (w.txid,), w.txid, explicit=False))
            w.args = (parent, name, ino, mode, uid, gid, rdev, target, stamp_policy)
            return inode

        return self._mutate(Op.MKNOD, (), body)

    def link(self, ino: int, parent: int, name: bytes, now_ns: int) -> Inode:
        check_name(name)

        def body(w: _Write) -> Inode:
            txn = w.txn
            inode = self._inode(txn, ino)
            if stat.S_ISDIR(inode.mode):
                raise FsError(errno.EPERM, "hard links to directories are not allowed")
            if inode.nlink == 0:
                raise _enoent("the file was removed")
            dir_inode = self._dir(txn, parent)
            if self._child(txn, parent, name) is not None:
                raise FsError(errno.EEXIST, f"{name!r} exists")
            self._add_dentry(txn, dir_inode, name, ino)
            dir_inode.mtime_ns = dir_inode.ctime_ns = now_ns
            inode.nlink += 1
            inode.ctime_ns = now_ns
            self._put_inode(txn, dir_inode)
            self._put_inode(txn, inode)
            return inode

        return self._mutate(Op.LINK, (ino, parent, name), body)

    def unlink(self, parent: int, name: bytes, now_ns: int, *, directory: bool,
               busy: Callable[[int], bool]) -> int:
        """Remove a name (unlink or rmdir); returns the inode it named.

        ``busy(ino)`` tells whether the kernel or an open handle still holds the inode; such
        an inode becomes an orphan and is purged later, else it is purged now.
        """

        def body(w: _Write) -> int:
            txn = w.txn
            dir_inode = self._dir(txn, parent)
            found = self._child(txn, parent, name)
            if found is None:
                raise _enoent(f"{name!r} not found")
            child = self._inode(txn, found[0])
            child_is_dir = stat.S_ISDIR(child.mode)
            if directory and not child_is_dir:
                raise FsError(errno.ENOTDIR, f"{name!r} is not a directory")
            if not directory and child_is_dir:
                raise FsError(errno.EISDIR, f"{name!r} is a directory")
            if child_is_dir and not self._is_empty_dir(txn, child.ino):
                raise FsError(errno.ENOTEMPTY, f"{name!r} is not empty")
            self._remove_dentry(txn, parent, name)
            dir_inode.mtime_ns = dir_inode.ctime_ns = now_ns
            if child_is_dir:
                dir_inode.nlink -= 1
            self._put_inode(txn, dir_inode)
            self._drop_link(w, child, parent, now_ns, busy)
            return child.ino

        return self._mutate(Op.UNLINK, (parent, name, directory), body)

    def _drop_link(self, w: _Write, child: Inode, parent: int, now_ns: int,
                   busy: Callable[[int], bool]) -> None:
        """Account for one removed dentry of ``child`` (already deleted from ``parent``)."""
        child.nlink = 0 if stat.S_ISDIR(child.mode) else child.nlink - 1
        child.ctime_ns = now_ns
        if child.nlink > 0 and child.parent == parent:
            other = self._any_backlink(w.txn, child.ino)
            if other is not None:
                child.parent = other
                w.inherited_changed.append(child.ino)
        self._put_inode(w.txn, child)
        if child.nlink == 0:
            self._unlinked(w, child, busy(child.ino))

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int, now_ns: int, *, busy: Callable[[int], bool],
               whiteout_owner: tuple[int, int] | None = None) -> int | None:
        """rename(2) with RENAME_NOREPLACE, RENAME_EXCHANGE and RENAME_WHITEOUT; returns a
        replaced inode.

        RENAME_WHITEOUT (overlayfs's upper layer, fsstress) leaves a whiteout at the old
        name in the same transaction: a character device 0:0 with mode 0, owned by
        ``whiteout_owner`` (uid, gid), as ext4 makes it. Since Linux 5.8 anyone may make one
        (it is no device), as on ext4."""
        check_name(new_name)
        noreplace = bool(flags & RENAME_NOREPLACE)
        exchange = bool(flags & RENAME_EXCHANGE)
        whiteout = bool(flags & RENAME_WHITEOUT)
        if (flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT)
                or (exchange and (noreplace or whiteout))
                or (whiteout and whiteout_owner is None)):
            raise FsError(errno.EINVAL, "unsupported rename flags")

        def body(w: _Write) -> int | None:
            txn = w.txn
            src_dir = self._dir(txn, old_parent)
            dst_dir = src_dir if new_parent == old_parent else self._dir(txn, new_parent)
            found = self._child(txn, old_parent, old_name)
            if found is None:
                raise _enoent(f"{old_name!r} not found")
            src = self._inode(txn, found[0])
            dst_found = self._child(txn, new_parent, new_name)
            dst = None if dst_found is None else self._inode(txn, dst_found[0])
            if stat.S_ISDIR(src.mode):
                self._check_not_inside(txn, src.ino, new_parent)
            if exchange:
                if dst is None:
                    raise _enoent(f"{new_name!r} not found")
                if stat.S_ISDIR(dst.mode):
                    self._check_not_inside(txn, dst.ino, old_parent)
                plans = (self._moved(w, src, new_parent), self._moved(w, dst, old_parent))
                self._exchange(txn, src_dir, old_name, src, dst_dir, new_name, dst, now_ns)
                self._apply_moved(w, src, plans[0])
                self._apply_moved(w, dst, plans[1])
                return None
            if dst is not None and noreplace:
                raise FsError(errno.EEXIST, f"{new_name!r} exists")
            if dst is not None and dst.ino == src.ino:
                return None  # POSIX: both names link the same file; nothing happens
            if dst is not None:
                self._check_replaceable(txn, src, dst, new_name)
                self._remove_dentry(txn, new_parent, new_name)
                if stat.S_ISDIR(dst.mode):
                    dst_dir.nlink -= 1
            plans = self._moved(w, src, new_parent)
            self._remove_dentry(txn, old_parent, old_name)
            self._add_dentry(txn, dst_dir, new_name, src.ino)
            self._apply_moved(w, src, plans)
            if whiteout:
                ino = self._take(txn, "next_ino")
                self._put_inode(txn, Inode(ino, stat.S_IFCHR, *whiteout_owner, 1, 0, 0,
                                           now_ns, now_ns, now_ns, old_parent))
                self._add_dentry(txn, src_dir, old_name, ino)
                w.args = (*w.args, ino, *whiteout_owner)
            if stat.S_ISDIR(src.mode) and dst_dir is not src_dir:
                src_dir.nlink -= 1
                dst_dir.nlink += 1
            src.parent = new_parent
            src.ctime_ns = now_ns
            for d in {id(src_dir): src_dir, id(dst_dir): dst_dir}.values():
                d.mtime_ns = d.ctime_ns = now_ns
                self._put_inode(txn, d)
            self._put_inode(txn, src)
            if dst is not None:
                self._drop_link(w, dst, new_parent, now_ns, busy)
                return dst.ino
            return None

        return self._mutate(Op.RENAME, (old_parent, old_name, new_parent, new_name, flags),
                            body)

    def _check_not_inside(self, txn, moved_dir: int, target_parent: int) -> None:
        """A directory cannot move into itself or its own subtree (EINVAL)."""
        ino = target_parent
        while True:
            if ino == moved_dir:
                raise FsError(errno.EINVAL, "cannot move a directory into its own subtree")
            if ino == ROOT_INO:
                return
            ino = self._inode(txn, ino).parent

    def _check_replaceable(self, txn, src: Inode, dst: Inode, name: bytes) -> None:
        if stat.S_ISDIR(src.mode):
            if not stat.S_ISDIR(dst.mode):
                raise FsError(errno.ENOTDIR, f"{name!r} is not a directory")
            if not self._is_empty_dir(txn, dst.ino):
                raise FsError(errno.ENOTEMPTY, f"{name!r} is not empty")
        elif stat.S_ISDIR(dst.mode):
            raise FsError(errno.EISDIR, f"{name!r} is a directory")

    def _exchange(self, txn, src_dir: Inode, old_name: bytes, src: Inode,
                  dst_dir: Inode, new_name: bytes, dst: Inode, now_ns: int) -> None:
        """RENAME_EXCHANGE: both names stay where they are (same cookies), inodes swap."""
        old_key = schema.dentry_key(src_dir.ino, old_name)
        new_key = schema.dentry_key(dst_dir.ino, new_name)
        _, old_cookie = schema.parse_dentry_value(txn.get(old_key, db=self.db["dentries"]))
        _, new_cookie = schema.parse_dentry_value(txn.get(new_key, db=self.db["dentries"]))
        txn.put(old_key, schema.dentry_value(dst.ino, old_cookie), db=self.db["dentries"])
        txn.put(new_key, schema.dentry_value(src.ino, new_cookie), db=self.db["dentries"])
        cookies = self.db["dircookies"]
        txn.put(schema.cookie_key(src_dir.ino, old_cookie), schema.cookie_value(dst.ino, old_name),
                db=cookies)
        txn.put(schema.cookie_key(dst_dir.ino, new_cookie), schema.cookie_value(src.ino, new_name),
                db=cookies)
        backlinks = self.db["backlinks"]
        txn.delete(schema.backlink_key(src.ino, src_dir.ino, old_name), db=backlinks)
        txn.delete(schema.backlink_key(dst.ino, dst_dir.ino, new_name), db=backlinks)
        txn.put(schema.backlink_key(src.ino, dst_dir.ino, new_name), b"", db=backlinks)
        txn.put(schema.backlink_key(dst.ino, src_dir.ino, old_name), b"", db=backlinks)
        if src_dir is not dst_dir:
            shift = int(stat.S_ISDIR(src.mode)) - int(stat.S_ISDIR(dst.mode))
            src_dir.nlink -= shift
            dst_dir.nlink += shift
        src.parent, dst.parent = dst_dir.ino, src_dir.ino
        src.ctime_ns = dst.ctime_ns = now_ns
        for d in {id(src_dir): src_dir, id(dst_dir): dst_dir}.values():
            d.mtime_ns = d.ctime_ns = now_ns
            self._put_inode(txn, d)
        self._put_inode(txn, src)
        self._put_inode(txn, dst)

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None, ctime_ns: int) -> Inode:
        """Change metadata other than the size (the size goes through the block layer)."""

        def body(w: _Write) -> Inode:
            inode = self._inode(w.txn, ino)
            if mode is not None:
                inode.mode = (inode.mode & ~0o7777) | (mode & 0o7777)
            if uid is not None:
                inode.uid = uid
            if gid is not None:
                inode.gid = gid
            if atime_ns is not None:
                inode.atime_ns = atime_ns
            if mtime_ns is not None:
                inode.mtime_ns = mtime_ns
            inode.ctime_ns = ctime_ns
            self._put_inode(w.txn, inode)
            return inode

        return self._mutate(Op.SETATTR, (ino, mode, uid, gid, atime_ns, mtime_ns, ctime_ns),
                            body)

    def set_xattr(self, ino: int, name: bytes, value: bytes, now_ns: int) -> None:
        def body(w: _Write) -> None:
            inode = self._inode(w.txn, ino)
            w.txn.put(schema.xattr_key(ino, name), value, db=self.db["xattrs"])
            inode.ctime_ns = now_ns
            self._put_inode(w.txn, inode)

        self._mutate(Op.SETXATTR, (ino, name, value), body)

    def remove_xattr(self, ino: int, name: bytes, now_ns: int) -> None:
        def body(w: _Write) -> None:
            inode = self._inode(w.txn, ino)
            if not w.txn.delete(schema.xattr_key(ino, name), db=self.db["xattrs"]):
                raise FsError(errno.ENODATA, "no such attribute")
            inode.ctime_ns = now_ns
            self._put_inode(w.txn, inode)

        self._mutate(Op.REMOVEXATTR, (ino, name), body)

    def set_inherited(self, ino: int, attr: int, value: int | None, now_ns: int) -> None:
        """Set (``value``) or unset (None) an inherited xattr on ``ino`` and its subtree.

        One op row whatever the subtree's size; the satisfier index gets the subtree in the
        same transaction when its effective value changes.
        """

        def body(w: _Write) -> None:
            txn, mode = w.txn, self.rename_mode
            inode = self._inode(txn, ino)
            chain = self._ops_chain(txn, ino, attr)
            if value is None:
                op = inherited.op_for_unset(chain, w.txid, mode)
            else:
                op = inherited.op_for_set(chain, value, w.txid, mode)
            self._put_op(txn, ino, attr, op)
            # Below a directory, inodes with older settings of their own change too, even
            # when the directory's value does not: the satisfier always gets the subtree.
            if stat.S_ISDIR(inode.mode) or (inherited.resolve(chain, mode).value
                                            != inherited.resolve([op] + chain[1:], mode).value):
                self._index_subtree(w, ino, SatisfyReason.UNSET if value is None
                                    else SatisfyReason.SET)
            inode.ctime_ns = now_ns
            self._put_inode(txn, inode)

        self._mutate(Op.SET_INHERITED, (ino, attr, value), body)

    def satisfier_entries(self) -> list[tuple[int, int, int]]:
        """(txid, ino, reason) of the subtrees waiting for the satisfier, oldest first."""
        with self.env.begin() as txn:
            return [(*schema.split_satisfier_key(k), v[0])
                    for k, v in txn.cursor(db=self.db["satisfier"])]

    def path_of(self, ino: int) -> str:
        """A path of ``ino`` (its primary link), for messages and policy_source."""
        names = []
        with self.env.begin() as txn:
            while ino != ROOT_INO and len(names) < 100_000:
                inode = self._inode(txn, ino)
                name = None
                with txn.cursor(db=self.db["backlinks"]) as cur:
                    prefix = schema.U64X2.pack(ino, inode.parent)
                    if cur.set_range(prefix) and cur.key()[:16] == prefix:
                        name = bytes(cur.key()[16:])
                if name is None:
                    return "(unlinked)"
                names.append(name.decode(errors="surrogateescape"))
                ino = inode.parent
        return "/" + "/".join(reversed(names))

    def purge(self, ino: int) -> None:
        """Delete an orphan inode the kernel has forgotten and nobody holds open."""

        def body(w: _Write) -> None:
            raw = w.txn.get(u64(ino), db=self.db["inodes"])
            if raw is not None and Inode.unpack(ino, raw).nlink == 0:
                self._purge(w, ino)

        self._mutate(Op.PURGE, (ino,), body)

    # --- blocks, generation stamps, leases ------------------------------------------------------

    def reserve(self, counter: str) -> int:
        """Next block id or generation stamp, from a durable batch reserved in one txn."""
        nxt, end = self._reserved[counter]
        if nxt >= end:
            def body(w: _Write) -> int:
                return self._take(w.txn, counter, ID_BATCH)
            first = self._mutate(Op.SET_GS, (counter, ID_BATCH), body)
            self.sync()
            if counter == "gs":
                first += 1  # the counter holds the last stamp handed out
            nxt, end = first, first + ID_BATCH
        self._reserved[counter] = [nxt + 1, end]
        return nxt

    def add_block(self, ino: int, index: int, rec: BlockRecord,
                  lease: tuple[bytes, int] | None = None) -> None:
        """Record a new block whose replica files already exist and are fsynced.

        ``lease`` (holder, time) takes the file's lease in the same transaction: when a
        write session's first change is a new block, as it is for every new file, that
        saves a transaction of its own (the journal record carries the holder).
        """

        def body(w: _Write) -> None:
            txn = w.txn
            self._inode(txn, ino)
            key = schema.block_key(ino, index)
            if txn.get(key, db=self.db["blocks"]) is not None:
                raise FsError(errno.EIO, f"block {index} of inode {ino} already exists")
            txn.put(key, rec.pack(), db=self.db["blocks"])
            for vol in rec.volumes:
                txn.put(schema.replica_key(vol, rec.block_id), key, db=self.db["replicas"])
            if lease is not None:
                txn.put(u64(ino), schema.lease_value(*lease), db=self.db["leases"])

        self._mutate(Op.ADD_BLOCK, (ino, index, rec.block_id, rec.gs, rec.volumes,
                                    lease[0] if lease else None), body)

    def add_replica(self, ino: int, index: int, block_id: int, gs: int, volume_id: int) -> bool:
        """Record a copied replica, only if the block is unchanged since the copy began
        (same block id and GS). False: the copy is stale and must be deleted."""

        def body(w: _Write) -> bool:
            key = schema.block_key(ino, index)
            raw = w.txn.get(key, db=self.db["blocks"])
            if raw is None:
                return False
            rec = BlockRecord.unpack(raw)
            if rec.block_id != block_id or rec.gs != gs or volume_id in rec.volumes:
                return False
            rec.volumes = rec.volumes + (volume_id,)
            w.txn.put(key, rec.pack(), db=self.db["blocks"])
            w.txn.put(schema.replica_key(volume_id, block_id), key, db=self.db["replicas"])
            return True

        return self._mutate(Op.SET_REPLICAS, (ino, index, block_id, gs, volume_id), body)

    def drop_replicas(self, ino: int, index: int, volume_ids: tuple[int, ...],
                      gs: int | None = None) -> bool:
        """Remove replicas from a block (failed in a write, corrupt, stale, excess); with
        ``gs`` the block takes that new generation stamp in the same transaction. Their
        files go to the trash. False if the block is gone."""

        def body(w: _Write) -> bool:
            key = schema.block_key(ino, index)
            raw = w.txn.get(key, db=self.db["blocks"])
            if raw is None:
                return False
            rec = BlockRecord.unpack(raw)
            dropped = tuple(v for v in rec.volumes if v in volume_ids)
            rec.volumes = tuple(v for v in rec.volumes if v not in volume_ids)
            if gs is not None:
                rec.gs = gs
            w.txn.put(key, rec.pack(), db=self.db["blocks"])
            for vol in dropped:
                w.txn.delete(schema.replica_key(vol, rec.block_id), db=self.db["replicas"])
            if dropped:
                # Merge with a pending row: an earlier drop whose files are not deleted yet
                # (its volume failed) must not be forgotten.
                pending = w.txn.get(u64(rec.block_id), db=self.db["trash"])
                if pending is not None:
                    dropped = tuple(sorted(set(dropped) | set(schema.parse_trash_value(pending)[1])))
                w.txn.put(u64(rec.block_id), schema.trash_value(rec.gs, dropped),
                          db=self.db["trash"])
                w.trash.append((rec.block_id, rec.gs, dropped))
            return True

        return self._mutate(Op.SET_REPLICAS, (ino, index, volume_ids, gs), body)

    def iter_block_batches(self, size: int) -> Iterator[list[tuple[int, int, BlockRecord]]]:
        """Every block as (ino, index, record), in batches each read in its own short
        transaction (long read transactions stop LMDB from reusing pages)."""
        last: bytes | None = None
        while True:
            batch = []
            with self.env.begin() as txn, txn.cursor(db=self.db["blocks"]) as cur:
                found = cur.set_range(last) if last is not None else cur.first()
                while found and len(batch) < size:
                    key = bytes(cur.key())
                    if key != last:
                        batch.append((*schema.split_block_key(key),
                                      BlockRecord.unpack(cur.value())))
                    last = key
                    found = cur.next()
            if not batch:
                return
            yield batch

    def blocks_on_volume(self, volume_id: int) -> list[tuple[int, int]]:
        """(ino, index) of every block with a replica on the volume."""
        prefix = schema.U32.pack(volume_id)
        out = []
        with self.env.begin() as txn, txn.cursor(db=self.db["replicas"]) as cur:
            if cur.set_range(prefix):
                for key, value in cur:
                    if key[:4] != prefix:
                        break
                    out.append(schema.split_block_key(value))
        return out

    def set_block_gs(self, ino: int, index: int, gs: int) -> None:
        """Record a block's new generation stamp (its replicas were renamed first)."""

        def body(w: _Write) -> None:
            key = schema.block_key(ino, index)
            raw = w.txn.get(key, db=self.db["blocks"])
            if raw is None:
                raise _enoent(f"block {index} of inode {ino} is gone")
            rec = BlockRecord.unpack(raw)
            rec.gs = gs
            w.txn.put(key, rec.pack(), db=self.db["blocks"])

        self._mutate(Op.SET_GS, (ino, index, gs), body)

    def persist_file(self, ino: int, *, size: int, mtime_ns: int, ctime_ns: int,
                     atime_ns: int, blocks: dict[int, BlockRecord],
                     drop_lease: bool = False) -> None:
        """Persist an open file's in-memory length, times and block lengths in one txn."""

        def body(w: _Write) -> None:
            txn = w.txn
            raw = txn.get(u64(ino), db=self.db["inodes"])
            if raw is None:
                return  # purged meanwhile: nothing to persist
            inode = Inode.unpack(ino, raw)
            inode.size, inode.mtime_ns, inode.ctime_ns = size, mtime_ns, ctime_ns
            inode.atime_ns = atime_ns
            self._put_inode(txn, inode)
            for index, rec in blocks.items():
                key = schema.block_key(ino, index)
                if txn.get(key, db=self.db["blocks"]) is not None:
                    txn.put(key, rec.pack(), db=self.db["blocks"])
            lease = txn.get(u64(ino), db=self.db["leases"])
            if drop_lease:
                txn.delete(u64(ino), db=self.db["leases"])
            elif lease is not None and schema.lease_truncate_to(bytes(lease)) is not None:
                # the new size is recorded now: the truncate in progress is complete
                txn.put(u64(ino), bytes(lease)[:24], db=self.db["leases"])

        self._mutate(Op.UPDATE_BLOCKS,
                     (ino, size, [(i, r.gs, r.length) for i, r in blocks.items()]), body)

    def truncate_blocks(self, ino: int, keep_blocks: int, size: int, now_ns: int) -> list:
        """Drop every block with index >= keep_blocks and set the size; returns the trash."""

        def body(w: _Write) -> None:
            txn = w.txn
            inode = self._inode(txn, ino)
            for index, rec in list(self._blocks(txn, ino)):
                if index >= keep_blocks:
                    self._drop_block(w, ino, index, rec)
            inode.size = size
            inode.mtime_ns = inode.ctime_ns = now_ns
            self._put_inode(txn, inode)

        self._mutate(Op.TRUNCATE, (ino, keep_blocks, size), body)
        return self.last_trash

    def take_lease(self, ino: int, holder: bytes, now_ns: int,
                   truncate_to: int | None = None) -> None:
        """Take (or re-take) the lease; ``truncate_to`` marks a shrinking truncate."""
        def body(w: _Write) -> None:
            w.txn.put(u64(ino), schema.lease_value(holder, now_ns, truncate_to),
                      db=self.db["leases"])

        self._mutate(Op.LEASE, (ino, holder, True, truncate_to), body)

    def lease_truncate_to(self, ino: int) -> int | None:
        with self.env.begin() as txn:
            raw = txn.get(u64(ino), db=self.db["leases"])
        return None if raw is None else schema.lease_truncate_to(bytes(raw))

    def drop_lease(self, ino: int) -> None:
        def body(w: _Write) -> None:
            w.txn.delete(u64(ino), db=self.db["leases"])

        self._mutate(Op.LEASE, (ino, b"", False), body)

    def trash_done(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        if not ids:
            return

        def body(w: _Write) -> None:
            for block_id in ids:
                w.txn.delete(u64(block_id), db=self.db["trash"])

        self._mutate(Op.TRASH_DONE, (ids,), body)

    def set_state(self, state: str, session: bytes | None = None) -> None:
        """``mounted`` while a daemon serves the filesystem, ``clean`` after unmount."""

        def body(w: _Write) -> None:
            w.txn.put(b"state", schema.pack_meta(state), db=self.db["meta"])

        self._mutate(Op.MOUNT, (state, session or b""), body)
        self.sync()

    def run(self, op: int, args: tuple, body: Callable[[_Write], object]):
        """A custom mutation for recovery and repair code that needs several steps in one txn."""
        return self._mutate(op, args, body)


RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4


def new_session_id() -> bytes:
    return uuidlib.uuid4().bytes


def lmdb_failure(path: Path, exc: lmdb.Error) -> FsError:
    """ENOSPC when the namespace's disk is full, else EIO (logged). LMDB reports a write cut
    short by a full disk as EIO, so the disk's free space tells the two apart."""
    text = str(exc)
    if "No space" in text or "ENOSPC" in text or _disk_nearly_full(path):
        return FsError(errno.ENOSPC, "no space left for the namespace")
    log.error("namespace I/O error: %s", text)
    return FsError(errno.EIO, f"namespace error: {text}")


def _disk_nearly_full(path: Path) -> bool:
    return _disk_free(path) < NEARLY_FULL_BYTES


def _disk_free(path: Path) -> int:
    """Bytes free on the disk of ``path``; as if plenty when it cannot be told."""
    try:
        return disk_free(path)
    except OSError:
        return MAX_MAP_SIZE


def _allocate_lock_file(path: Path) -> None:
    """Give LMDB's lock file all its disk space before LMDB maps it.

    LMDB makes the lock file (its table of readers) with ``ftruncate``, a sparse file, and
    writes it through a shared mapping: a reader slot first used while the disk is full is a
    page that cannot be allocated, and the process dies of SIGBUS (mkfs on a nearly full
    tmpfs did). Allocated here, the same lack of room is an ENOSPC from
    ``posix_fallocate``. The size is never changed from what LMDB chose (a lock file it
    made keeps its size; a new one gets the size LMDB would give it): LMDB sizes its table
    of readers by the file, and processes sharing it must agree."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return  # a reader without write access: LMDB answers for itself
        raise
    try:
        st = os.fstat(fd)
        size = st.st_size or LOCK_FILE_BYTES
        if st.st_blocks * 512 < size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
