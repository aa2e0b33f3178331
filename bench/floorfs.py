#!/usr/bin/env python3
"""The least a pyfuse3 filesystem does: the benchmark's ``--floor`` reference.

    python bench/floorfs.py STORE MNT

A passthrough with nothing of tierfs's own work in it: the namespace is a dict in memory
(no LMDB, no journal, nothing durable), each file's data is one plain file in STORE named by
its inode number (no blocks, no checksums, no replicas), and every request is answered in
the request loop itself. It is served the way tierfs is served: pyfuse3 and trio with
tierfs's request loop (``tierfs.fs.fuseloop``), the same mount options, writeback cache,
kernel cache timeouts and readahead. So the ratio it reaches against the backing directory
in the same run is what the stack tierfs is built on (FUSE, pyfuse3, Python, trio, this
machine) allows before tierfs does any work of its own: where tierfs misses a target that
this file also misses, the target is beyond the stack on that machine.

That holds for the metadata workloads (create, stat, readdir, rename, unlink, mkdir), where a
dict is as little as can be done. Its data path is the plain one of pyfuse3's passthrough
example, a pread or pwrite in the request loop, with none of tierfs's readahead or worker
threads: tierfs's cold sequential reads are faster than this file's (README, "Speed").

It keeps only what the benchmark's workloads need (no links, no symlinks, no xattrs, no
permission checks beyond the kernel's ``default_permissions``) and forgets everything at
unmount. It is not a filesystem to keep data in.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
from dataclasses import dataclass

import pyfuse3
import trio

from tierfs.fs import fuseloop
from tierfs.fs.kernel_mount import tune_readahead
from tierfs.fs.operations import CACHE_TIMEOUT, IO_BLKSIZE


SETATTR_FIELDS = {"mode": "mode", "uid": "uid", "gid": "gid",
                  "atime": "atime_ns", "mtime": "mtime_ns", "ctime": "ctime_ns"}
"""setattr's ``fields.update_X`` -> the ``Node`` field it sets from ``attr.st_<field>``."""


@dataclass
class Node:
    """One inode; ``children`` only for a directory."""

    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    size: int = 0
    children: dict[bytes, int] | None = None

    @classmethod
    def new(cls, mode: int, uid: int, gid: int) -> Node:
        now = time.time_ns()
        return cls(mode, uid, gid, now, now, now,
                   children={} if stat.S_ISDIR(mode) else None)


@dataclass
class Handle:
    ino: int
    fd: int | None = None


class FloorOperations(pyfuse3.Operations):
    enable_writeback_cache = True

    def __init__(self, store: str):
        super().__init__()
        self.store = store
        root = Node.new(stat.S_IFDIR | 0o755, os.getuid(), os.getgid())
        self.nodes: dict[int, Node] = {pyfuse3.ROOT_INODE: root}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.handles: dict[int, Handle] = {}
        self.next_fh = 1
        self.initialized = trio.Event()

    def init(self) -> None:
        self.initialized.set()

    # --- helpers -----------------------------------------------------------------------------

    def _entry(self, ino: int) -> pyfuse3.EntryAttributes:
        node = self.nodes[ino]
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = ino
        entry.st_mode = node.mode
        entry.st_nlink = 2 if node.children is not None else 1
        entry.st_uid, entry.st_gid = node.uid, node.gid
        entry.st_size = node.size
        entry.st_blocks = (node.size + 511) // 512
        entry.st_blksize = IO_BLKSIZE
        entry.st_atime_ns = node.atime_ns
        entry.st_mtime_ns = node.mtime_ns
        entry.st_ctime_ns = node.ctime_ns
        entry.entry_timeout = entry.attr_timeout = CACHE_TIMEOUT
        return entry

    def _new(self, parent: int, name: bytes, mode: int, ctx) -> int:
        children = self._dir(parent)
        if name in children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        ino = self.next_ino
        self.next_ino += 1
        self.nodes[ino] = Node.new(mode, ctx.uid, ctx.gid)
        children[name] = ino
        return ino

    def _dir(self, ino: int) -> dict[bytes, int]:
        children = self.nodes[ino].children
        if children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return children

    def _child(self, parent: int, name: bytes) -> int:
        try:
            return self._dir(parent)[name]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def _data(self, ino: int) -> str:
        return os.path.join(self.store, str(ino))

    def _handle(self, ino: int) -> pyfuse3.FileInfo:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = Handle(ino)
        return pyfuse3.FileInfo(fh=fh)

    def _fd(self, fh: int) -> int:
        """The handle's descriptor of the file's data, opened when first needed: a create
        makes no file in STORE, as tierfs makes no block before the first write."""
        handle = self.handles[fh]
        if handle.fd is None:
            handle.fd = os.open(self._data(handle.ino), os.O_RDWR | os.O_CREAT, 0o600)
        return handle.fd

    def _remove(self, parent: int, name: bytes) -> None:
        """The node stays (the kernel may still send requests for it until it forgets it);
        its data goes when its last handle closes, as for an open-unlinked file."""
        ino = self._dir(parent).pop(name)
        if self.nodes[ino].children is None:
            try:
                os.unlink(self._data(ino))
            except FileNotFoundError:
                pass

    # --- requests ----------------------------------------------------------------------------

    async def lookup(self, parent_inode, name, ctx):
        ino = self._dir(parent_inode).get(name)
        if ino is None:
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = CACHE_TIMEOUT
            return negative
        return self._entry(ino)

    async def getattr(self, inode, ctx):
        return self._entry(inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self.nodes[inode]
        if fields.update_size:
            fd = os.open(self._data(inode), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, attr.st_size)
            finally:
                os.close(fd)
            node.size = attr.st_size
        for flag, name in SETATTR_FIELDS.items():
            if getattr(fields, f"update_{flag}"):
                setattr(node, name, getattr(attr, f"st_{name}"))
        return self._entry(inode)

    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._entry(self._new(parent_inode, name, stat.S_IFDIR | mode, ctx))

    async def create(self, parent_inode, name, mode, flags, ctx):
        ino = self._new(parent_inode, name, stat.S_IFREG | mode, ctx)
        return self._handle(ino), self._entry(ino)

    async def open(self, inode, flags, ctx):
        info = self._handle(inode)
        if flags & os.O_TRUNC:
            os.ftruncate(self._fd(info.fh), 0)
            self.nodes[inode].size = 0
        info.keep_cache = not flags & os.O_TRUNC
        return info

    async def read(self, fh, off, size):
        return os.pread(self._fd(fh), size, off)

    async def write(self, fh, off, buf):
        written = os.pwrite(self._fd(fh), buf, off)
        node = self.nodes[self.handles[fh].ino]
        node.size = max(node.size, off + written)
        return written

    async def fsync(self, fh, datasync):
        (os.fdatasync if datasync else os.fsync)(self._fd(fh))

    async def flush(self, fh):
        """Nothing to do: data goes to STORE as each WRITE comes (tierfs answers at once too)."""

    async def release(self, fh):
        handle = self.handles.pop(fh)
        if handle.fd is not None:
            os.close(handle.fd)

    async def unlink(self, parent_inode, name, ctx):
        self._child(parent_inode, name)
        self._remove(parent_inode, name)

    async def rmdir(self, parent_inode, name, ctx):
        if self.nodes[self._child(parent_inode, name)].children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        self._remove(parent_inode, name)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)
        ino = self._child(parent_inode_old, name_old)
        if name_new in self._dir(parent_inode_new):
            self._remove(parent_inode_new, name_new)
        del self._dir(parent_inode_old)[name_old]
        self._dir(parent_inode_new)[name_new] = ino

    async def opendir(self, inode, ctx):
        self._dir(inode)
        return inode

    async def readdir(self, fh, start_id, token):
        """Offsets are positions in the listing: good enough for a directory that does not
        change while it is listed, which is all the benchmark does."""
        for offset, (name, ino) in enumerate(list(self._dir(fh).items())[start_id:],
                                             start_id + 1):
            if not pyfuse3.readdir_reply(token, name, self._entry(ino), offset):
                return

    async def releasedir(self, fh):
        """Nothing to do: opendir keeps no state (the handle is the directory's inode)."""

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def listxattr(self, inode, ctx):
        return []

    async def statfs(self, ctx):
        st = os.statvfs(self.store)
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):
            setattr(out, name, getattr(st, name))
        return out


async def serve(ops: FloorOperations, mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_tune_after_init, ops, mountpoint)
        fuseloop.install()
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _tune_after_init(ops: FloorOperations, mountpoint: str) -> None:
    await ops.initialized.wait()
    await trio.to_thread.run_sync(tune_readahead, mountpoint)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: floorfs.py STORE MNT", file=sys.stderr)
        return 2
    store, mountpoint = argv
    os.makedirs(store, exist_ok=True)
    ops = FloorOperations(store)
    pyfuse3.init(ops, mountpoint, set(pyfuse3.default_options) | {"fsname=floorfs"})
    try:
        trio.run(serve, ops, mountpoint)
    finally:
        pyfuse3.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
