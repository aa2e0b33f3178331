"""The pyfuse3 request handlers: guards, lookup counts, errno mapping; nothing else.

Handlers delegate to the namespace (metadata) and to ``BlockIO`` (file data). Domain errors
(``FsError``) become ``FUSEError`` in one place, :func:`handler`. Any other exception is a bug:
it is logged with its traceback at ERROR and answered with EIO, because an exception escaping
a pyfuse3 handler would kill the mount.

Kernel caching (DESIGN.md section 10): every change to what the kernel may cache comes
through this daemon (block moves change no attribute and no byte), so entries, negative
entries and attributes are cached for ``CACHE_TIMEOUT`` seconds and the page cache is kept
across opens (``keep_cache``). Background work that changes something visible must call
``pyfuse3.invalidate_inode``.

Lookup counts (DESIGN.md section 10): incremented on every entry reply (lookup, create,
mkdir, mknod, symlink, link, and readdirplus entries other than "." and ".."), decremented in
``forget``. An unlinked inode is purged when its lookup count and open count are both 0.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Callable

import pyfuse3
import trio

from tierfs.fs import caller
from tierfs.fs.blockio import BlockIO, OpenFile
from tierfs.fs.errors import OUT_OF_DESCRIPTORS, FsError, LimitError
from tierfs.fs.lograte import RepeatedWarnings
from tierfs.fs.namespace import NAME_MAX, RENAME_WHITEOUT, Namespace
from tierfs.fs.placement import Placement
from tierfs.fs.policy_xattrs import REPLICATION, PolicyXattrs, is_policy_xattr
from tierfs.fs.schema import ROOT_INO, Inode
from tierfs.fs.times import now_ns, storable_time_ns

log = logging.getLogger(__name__)

CACHE_TIMEOUT = 60.0
IO_BLKSIZE = 128 * 1024
XATTR_VALUE_MAX = 65536        # Linux XATTR_SIZE_MAX
XATTR_LIST_MAX = 65536         # Linux XATTR_LIST_MAX
XATTR_INODE_MAX = 256 * 1024   # names + values stored per inode; beyond it ENOSPC
XATTR_NAMESPACES = (b"user.", b"trusted.", b"security.")
FILE_CAPABILITIES = b"security.capability"
# A write-only open is served uncached (``direct_io``) while a new block of the file could
# not find this much room: each write() then reaches the daemon and gets its ENOSPC. With
# the kernel's writeback cache, write() only fills the page cache and a full volume is
# found at writeback, reported at close or fsync at best (a shell's `echo x > f` never
# sees it), with the kernel keeping the size it assumed. The kernel holds at most the
# FUSE connection's dirty allowance for the whole mount (strictlimit, 1% of the dirty
# threshold: /sys/class/bdi/<dev>/max_bytes, 48 MB on a 24 GiB machine); this is five
# times that. Read-write opens stay cached, so that MAP_SHARED mappings keep working.
WRITEBACK_HEADROOM = 256 << 20
READDIR_BATCH = 256  # entries read from the namespace at a time; a READDIRPLUS reply
                     # (128 KiB) holds about 770 of them


def handler(fn):
    """Turn domain errors into FUSEError; log bugs loudly and answer EIO. A request that
    failed for want of room, descriptors or working storage is logged as a warning, each
    kind of message at most once a minute: a user's loop can repeat it without end."""

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except FsError as exc:
            if (exc.errno in (errno.EIO, errno.ENOSPC, *OUT_OF_DESCRIPTORS)
                    and not isinstance(exc, LimitError)):
                self.failures.warning(f"{fn.__name__}: {exc}")
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:
            log.exception("BUG in %s handler", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


@dataclass(eq=False)
class Handle:
    of: OpenFile
    writer: bool
    # Served uncached (``direct_io``): opened O_DIRECT, or write-only while space is low
    # (WRITEBACK_HEADROOM). The kernel updates a file's mtime and ctime itself on a write()
    # into its page cache and sends them with SETATTR; a direct write it leaves to this
    # daemon. (O_DIRECT is served here, not by the kernel's own O_DIRECT path on a cached
    # handle: that path would let the file be mapped shared, but it sends a write as
    # asynchronous pieces and turns a short one, as at a full volume, into EIO.)
    direct: bool = False
    # A writer's, served uncached: the kernel leaves clearing set-id bits and file
    # capabilities for its writes to this daemon (``_before_uncached_write``).
    privileges: caller.Privileges | None = None


@dataclass(eq=False)
class DirHandle:
    """An open directory, and the entries read for the last reply that did not fit in it.

    A readdirplus reply holds only about 25 entries, so most batches read from the
    namespace have some left over; the next request, which continues where the last reply
    ended, starts with them instead of reading them again. They are used only while the
    namespace is unchanged (same commit count), so they are never staler than a fresh read.
    """

    ino: int
    left_over: list = field(default_factory=list)
    left_over_after: int = -1  # the cookie the left-over entries follow
    left_over_commits: int = -1  # Namespace.commits when they were read from it
    left_over_reach_end: bool = False  # no entries follow them in the directory


class Operations(pyfuse3.Operations):
    """tierfs as seen by the kernel."""

    supports_dot_lookup = True
    enable_writeback_cache = True

    def __init__(self, ns: Namespace, blockio: BlockIO, statfs_source, resolver):
        super().__init__()
        self.ns = ns
        self.resolver = resolver
        self.policy_xattrs = PolicyXattrs(ns, resolver, blockio.volumes, self._blocks_of)
        self.blockio = blockio
        self.statfs_source = statfs_source
        self.failures = RepeatedWarnings(log)
        self.lookups: dict[int, int] = {ROOT_INO: 1}
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, DirHandle] = {}
        self._next_fh = 1
        self.initialized = trio.Event()
        self.nursery: trio.Nursery | None = None  # background work, set by the mount
        # Inodes whose kernel cache a failed write is having invalidated, each mapped to
        # whether another write failed since that invalidation began (``_invalidate_later``).
        self.invalidating: dict[int, bool] = {}
        # ReplicationMonitor.replication_may_change, set by the mount: the replication
        # wanted at or below an inode may have changed.
        self.on_replication_change: Callable[[int], None] = lambda ino: None
        # Files open for writing whose attributes told the kernel 1 block where they had
        # none here (``_attributes``); their true count is due once the last writer goes.
        self.placeholder_blocks: set[int] = set()

    # --- helpers ---------------------------------------------------------------------------

    def _fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _entry(self, inode: Inode) -> pyfuse3.EntryAttributes:
        return self._attributes(inode.ino, inode.fields())

    def _attributes(self, ino: int, fields: tuple) -> pyfuse3.EntryAttributes:
        """Attributes for the kernel from an inode's stored fields (``schema.INODE`` order,
        so readdir can pass a namespace row without building an Inode); an open file's
        in-memory length and times win."""
        mode, uid, gid, nlink, size, rdev, atime, mtime, ctime, _parent, _next_cookie = fields
        of = self.blockio.files.get(ino)
        if of is not None:
            size, atime, mtime, ctime = of.size, of.atime_ns, of.mtime_ns, of.ctime_ns
        e = pyfuse3.EntryAttributes()  # zero-filled: generation 0
        e.st_ino = ino
        e.entry_timeout = CACHE_TIMEOUT
        e.attr_timeout = CACHE_TIMEOUT
        e.st_mode = mode
        e.st_nlink = nlink
        e.st_uid = uid
        e.st_gid = gid
        e.st_rdev = rdev
        e.st_size = size
        e.st_blksize = IO_BLKSIZE
        if stat.S_ISREG(mode):
            if size:
                e.st_blocks = self._allocated(ino, of) // 512
            if not e.st_blocks and of is not None and of.writers:
                # With writeback caching the kernel may hold written pages this daemon has
                # not seen yet. A file of any size with 0 blocks is all holes to some tools
                # (GNU tar --sparse archives none of its bytes), so it is 1 block until its
                # last writer goes.
                e.st_blocks = 1
                self.placeholder_blocks.add(ino)
        e.st_atime_ns = atime
        e.st_mtime_ns = mtime
        e.st_ctime_ns = ctime
        return e

    def _allocated(self, ino: int, of: OpenFile | None) -> int:
        """Bytes a regular file's data takes on disk: what its first replica of each block
        really allocates (holes, also inside a block, take none), so ``du`` tells the truth."""
        blocks = of.blocks if of is not None else self.ns.get_blocks(ino)
        total = 0
        for rec in blocks.values():
            volume = self.blockio.volumes.by_id.get(rec.volumes[0]) if rec.volumes else None
            try:
                total += os.stat(volume.data_path(rec.block_id)).st_blocks * 512
            except (OSError, AttributeError):
                total += -(-rec.length // 4096) * 4096
        return total

    def _blocks_of(self, ino: int):
        of = self.blockio.files.get(ino)
        return of.blocks if of is not None else self.ns.get_blocks(ino)

    def _reply_entry(self, inode: Inode) -> pyfuse3.EntryAttributes:
        self.lookups[inode.ino] = self.lookups.get(inode.ino, 0) + 1
        return self._entry(inode)

    def _busy(self, ino: int) -> bool:
        return self.lookups.get(ino, 0) > 0 or ino in self.blockio.files

    def _maybe_purge(self, ino: int) -> None:
        if self._busy(ino) or ino == ROOT_INO:
            return
        try:
            inode = self.ns.get_inode(ino)
        except FsError:
            return
        if inode.nlink == 0:
            self.ns.purge(ino)
            self.blockio.forget(ino)
            self._after_unlink()

    def _new_owner(self, parent: Inode, mode: int, ctx) -> tuple[int, int, int]:
        """POSIX ownership of a new inode: caller's uid; gid and setgid from the directory."""
        mode &= ~(ctx.umask & 0o777)
        gid = ctx.gid
        if parent.mode & stat.S_ISGID:
            gid = parent.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        mode = caller.strip_new_sgid(mode, parent.mode, gid, ctx)
        return ctx.uid, gid, mode

    def _make(self, parent: int, name: bytes, mode: int, ctx, rdev: int = 0,
              target: bytes | None = None,
              placement: Placement | None = None) -> Inode:
        """``placement``: the parent's policy and replication, when the caller has them
        (only the policy is used here: a LAZY_PERSIST directory stamps its new files)."""
        parent_inode = self.ns.get_inode(parent)
        uid, gid, mode = self._new_owner(parent_inode, mode, ctx)
        stamp = None
        if stat.S_ISREG(mode):
            policy = placement[0] if placement is not None else self.resolver.policy(parent)
            stamp = policy.id if policy.copy_on_create_file else None
        return self.ns.make_node(parent, name, mode, uid, gid, rdev, now_ns(), target,
                                 stamp_policy=stamp)

    # --- lifecycle -------------------------------------------------------------------------

    def init(self) -> None:
        """FUSE_INIT answered: the kernel's connection settings are fixed from here on."""
        log.info("tierfs serving requests")
        self.initialized.set()

    async def forget(self, inode_list) -> None:
        """Never raises: pyfuse3 has no reply for forget, so an exception here would end the
        mount. A purge that fails now (disk full) waits for shutdown or the next mount; the
        orphan row is durable already."""
        for ino, count in inode_list:
            left = self.lookups.get(ino, 0) - count
            if left > 0:
                self.lookups[ino] = left
                continue
            self.lookups.pop(ino, None)
            try:
                self._maybe_purge(ino)
            except Exception:
                log.exception("purge of inode %d deferred", ino)

    # --- names -----------------------------------------------------------------------------

    @handler
    async def lookup(self, parent_inode, name, ctx):
        try:
            inode = self.ns.lookup(parent_inode, name)
        except FsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = CACHE_TIMEOUT
            return negative
        return self._reply_entry(inode)

    @handler
    async def getattr(self, inode, ctx):
        return self._entry(self.ns.get_inode(inode))

    @handler
    async def setattr(self, inode, attr, fields, fh, ctx):
        now = now_ns()
        changes = {}
        # Times are checked first: a request refused with EINVAL must change nothing.
        if fields.update_atime:
            changes["atime_ns"] = storable_time_ns(attr.st_atime_ns)
        if fields.update_mtime:
            changes["mtime_ns"] = storable_time_ns(attr.st_mtime_ns)
        ctime = storable_time_ns(attr.st_ctime_ns) if fields.update_ctime else now
        truncated = None
        if fields.update_size:
            truncated = await self._truncate(inode, attr.st_size, fh)
        of = self.blockio.files.get(inode)
        if fields.update_mode:
            changes["mode"] = attr.st_mode
        if truncated is not None:
            # FUSE's kernel side clears S_ISGID on a truncate only with group execute set;
            # Linux also clears it without, for a caller outside the file's group.
            before = changes.get("mode", truncated.mode)
            mode = caller.mode_after_truncate(before, truncated.gid, ctx)
            if mode != before:
                changes["mode"] = mode
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        times_only = not {"mode", "uid", "gid"} & changes.keys()
        if of is not None and times_only and (changes or fields.update_ctime):
            # An open file's times live in memory until release or the one-second tick;
            # with writeback caching the kernel flushes them here after every write burst,
            # and two transactions each time would double the cost of a small file.
            of.atime_ns = changes.get("atime_ns", of.atime_ns)
            of.mtime_ns = changes.get("mtime_ns", of.mtime_ns)
            of.ctime_ns = ctime
            of.attrs_dirty = True
        elif changes or fields.update_ctime or not fields.update_size:
            # With writeback caching the kernel keeps ctime itself and sends it here; store
            # exactly that, so what stat shows does not move at the next mount.
            self._store_attrs(inode, of, ctime_ns=ctime, **changes)
        return self._entry(self.ns.get_inode(inode))

    def _store_attrs(self, ino: int, of: OpenFile | None, **changes) -> None:
        """One namespace transaction for attribute changes; an open file's in-memory
        length and times are written first and take the stored times back after."""
        if of is not None:
            self.blockio.persist(of)
        updated = self.ns.setattr(ino, **changes)
        if of is not None:
            of.atime_ns, of.mtime_ns, of.ctime_ns = (
                updated.atime_ns, updated.mtime_ns, updated.ctime_ns)

    async def _truncate(self, ino: int, size: int, fh) -> Inode:
        """Truncate a regular file; returns its inode as read before (a truncate changes
        neither its mode nor its owner)."""
        inode = self.ns.get_inode(ino)
        if stat.S_ISDIR(inode.mode):
            raise FsError(errno.EISDIR, "cannot truncate a directory")
        if not stat.S_ISREG(inode.mode):
            raise FsError(errno.EINVAL, "can only truncate regular files")
        of = self.blockio.acquire(ino, writer=True)
        try:
            await self.blockio.truncate(of, size)
        finally:
            self.blockio.release(of, writer=True)
        return inode

    @handler
    async def readlink(self, inode, ctx):
        target = self.ns.readlink(inode)
        self._read_moves_atime(self.ns.get_inode(inode))
        return target

    def _read_moves_atime(self, inode: Inode) -> None:
        """The mount's atime rule for a directory listed or a symlink read
        (``fs/times.py``). Stored at once, and the kernel told to ask for the attributes
        again before the reply goes out (only the attributes: nothing to wait for); a
        namespace that cannot store it (full disk) leaves atime as it was rather than
        failing the read."""
        now = now_ns()
        if not self.blockio.atime_rule.due(inode.atime_ns, inode.mtime_ns, inode.ctime_ns,
                                           now):
            return
        try:
            self.ns.setattr(inode.ino, atime_ns=now, ctime_ns=inode.ctime_ns)
        except FsError as exc:
            log.info("atime of inode %d not updated: %s", inode.ino, exc)
            return
        if self.nursery is not None:
            _invalidate_inode(inode.ino, attr_only=True)

    @handler
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._reply_entry(self._make(parent_inode, name, mode, ctx, rdev=rdev))

    @handler
    async def mkdir(self, parent_inode, name, mode, ctx):
        mode = (mode & 0o7777) | stat.S_IFDIR
        return self._reply_entry(self._make(parent_inode, name, mode, ctx))

    @handler
    async def symlink(self, parent_inode, name, target, ctx):
        inode = self._make(parent_inode, name, stat.S_IFLNK | 0o777, _NoUmask(ctx),
                           target=target)
        return self._reply_entry(inode)

    @handler
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._reply_entry(self.ns.link(inode, new_parent_inode, new_name,
                                              now_ns()))

    @handler
    async def unlink(self, parent_inode, name, ctx):
        self.ns.unlink(parent_inode, name, now_ns(), directory=False, busy=self._busy)
        self._after_unlink()

    def _after_unlink(self) -> None:
        """The files of the blocks the last transaction (unlink, rename, purge) purged are
        deleted once it is on disk (``BlockIO.defer_trash``); what it moved, or the
        hard-linked file whose first name it removed, may want another replication now."""
        self.blockio.defer_trash(self.ns.last_trash)
        for ino in self.ns.last_inherited_changed:
            self.on_replication_change(ino)

    @handler
    async def rmdir(self, parent_inode, name, ctx):
        self.ns.unlink(parent_inode, name, now_ns(), directory=True, busy=self._busy)
        self._after_unlink()

    @handler
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        whiteout_owner = None
        if flags & RENAME_WHITEOUT:  # owned as a new node in the old directory would be
            uid, gid, _ = self._new_owner(self.ns.get_inode(parent_inode_old), stat.S_IFCHR, ctx)
            whiteout_owner = (uid, gid)
        self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags,
                       now_ns(), busy=self._busy, whiteout_owner=whiteout_owner)
        self._after_unlink()

    # --- files -----------------------------------------------------------------------------

    def _open(self, ino: int, flags: int, ctx, created: Inode | None = None,
              placement: Placement | None = None) -> pyfuse3.FileInfo:
        writer = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        direct = bool(flags & os.O_DIRECT) or (
            (flags & os.O_ACCMODE) == os.O_WRONLY
            and not self.blockio.placer.has_room(ino, WRITEBACK_HEADROOM, placement))
        privileges = caller.privileges(ctx) if writer and direct else None
        of = self.blockio.acquire(ino, writer=writer, created=created)
        fh = self._fh()
        self.handles[fh] = Handle(of, writer, direct, privileges)
        fi = pyfuse3.FileInfo(fh=fh)
        if direct:
            fi.direct_io = True
        else:
            fi.keep_cache = True
        return fi

    @handler
    async def open(self, inode, flags, ctx):
        fi = self._open(inode, flags, ctx)
        handle = self.handles[fi.fh]
        if flags & os.O_TRUNC:  # Linux truncates even for O_RDONLY (permission checked)
            try:
                await self._truncate_at_open(handle.of, ctx)
            except BaseException:  # the kernel sends no release for a failed open
                self._release(self.handles.pop(fi.fh))
                raise
            fi.keep_cache = False
        if handle.writer and not handle.of.blocks and self.nursery is not None:
            # The kernel may have cached 0 blocks before this open; from now on the file
            # reports at least 1 (``_attributes``), so it must ask again.
            _invalidate_inode(inode, attr_only=True)
        return fi

    async def _truncate_at_open(self, of: OpenFile, ctx) -> None:
        """open(O_TRUNC). The kernel lets the OPEN truncate (libfuse's atomic O_TRUNC) and
        then skips the SETATTR a truncate sends, so the set-id bits Linux clears on every
        truncate of a regular file, even an empty one, are cleared here."""
        if of.size:
            await self.blockio.truncate(of, 0)
        inode = self.ns.get_inode(of.ino)
        mode = caller.mode_after_truncate(inode.mode, inode.gid, ctx)
        if mode != inode.mode:
            self._store_attrs(of.ino, of, mode=mode, ctime_ns=now_ns())
            if self.nursery is not None:  # mounted: the kernel's cached mode
                _invalidate_inode(of.ino, attr_only=True)

    @handler
    async def create(self, parent_inode, name, mode, flags, ctx):
        # A new file has no inherited op of its own, so its policy and replication are its
        # directory's (its copy-on-create stamp, if any, is that same policy): resolved once.
        placement = self.resolver.placement(parent_inode)
        inode = self._make(parent_inode, name, (mode & 0o7777) | stat.S_IFREG, ctx,
                           placement=placement)
        fi = self._open(inode.ino, flags, ctx, created=inode, placement=placement)
        return fi, self._reply_entry(inode)

    @handler
    async def read(self, fh, off, size):
        return await self.blockio.read(self.handles[fh].of, off, size)

    @handler
    async def write(self, fh, off, buf):
        """With writeback caching a WRITE through a cached handle is the kernel writing its
        pages back, perhaps after it already sent the times of the write() (or sent none:
        a write in the same clock tick as the last change leaves them as they are). Those
        times are the ones stat showed, so such a WRITE keeps them; stamping the daemon's
        clock here made mtime jump forward when the kernel evicted the inode."""
        handle = self.handles[fh]
        of = handle.of
        if handle.privileges is not None:
            self._before_uncached_write(of, handle.privileges)
        try:
            return self.blockio.write(of, off, buf, stamp_times=handle.direct)
        except FsError:
            self._invalidate_later(of.ino)
            raise

    def _before_uncached_write(self, of: OpenFile, privileges: caller.Privileges) -> None:
        """What the kernel does itself before a write into its cache, it leaves to the
        filesystem for an uncached one (``FUSE_WRITE_KILL_SUIDGID``, a flag pyfuse3 does
        not pass on): clear the set-id bits the writer may not keep, and drop file
        capabilities (``security.capability``), which any write drops. Before the write,
        as the kernel does: a file is never changed with the privileges still on it."""
        inode = self.ns.get_inode(of.ino)
        mode = caller.mode_after_write(inode.mode, inode.gid, privileges)
        has_capabilities = FILE_CAPABILITIES in self.ns.list_xattrs(of.ino)
        if mode == inode.mode and not has_capabilities:
            return
        now = now_ns()
        if mode != inode.mode:
            self._store_attrs(of.ino, of, mode=mode, ctime_ns=now)
        if has_capabilities:
            self.ns.remove_xattr(of.ino, FILE_CAPABILITIES, now)
        if self.nursery is not None:  # mounted: the kernel's cached mode
            _invalidate_inode(of.ino, attr_only=True)

    def _invalidate_later(self, ino: int) -> None:
        """A write failed: with writeback caching the kernel still holds the pages and the
        size it assumed, so it must forget them and ask again. Invalidation can wait for
        writeback, which needs this daemon: it runs in a thread, not awaited here.

        One invalidation per inode at a time, run once more if writes failed meanwhile: a
        writer that fills a volume through the cache (``dd`` until it fails) is told
        nothing by write(2), only at close or fsync, and its pages fail to write back by
        the thousand. A task per failure queued without bound for the worker threads (the
        daemon's memory grew from 36 to 290 MB in 10 s of such a ``dd``)."""
        if self.nursery is None:
            return
        if ino in self.invalidating:
            self.invalidating[ino] = True
            return
        self.invalidating[ino] = False
        self.nursery.start_soon(self._invalidate_until_settled, ino)

    async def _invalidate_until_settled(self, ino: int) -> None:
        try:
            while True:
                await trio.to_thread.run_sync(_invalidate_inode, ino)
                if not self.invalidating[ino]:
                    return
                self.invalidating[ino] = False
        finally:
            del self.invalidating[ino]

    async def flush(self, fh):
        """Answered at once, with nothing to do: it is there so that close() reaches the
        daemon. With writeback caching the kernel writes a file's dirty pages back, and
        reports their errors, before it sends FLUSH; the length and times reach the
        namespace at release (which follows the last close) or the one-second tick, and a
        crash before that is completed by lease recovery from the replicas.

        Answering ENOSYS would save this request per close(), but the kernel then stops
        sending FLUSH, and a close() after the daemon died returns 0: the pages it could
        not write back are dropped without an error, so a program that wrote a file and
        closed it is told all went well, and the file reads back empty after the remount.
        An answered FLUSH fails on the dead connection (ENOTCONN) instead."""

    @handler
    async def release(self, fh):
        handle = self.handles.pop(fh)
        self._release(handle)
        self._maybe_purge(handle.of.ino)

    def _release(self, handle: Handle) -> None:
        of = handle.of
        try:
            self.blockio.release(of, writer=handle.writer)
        finally:
            if not of.writers and of.ino in self.placeholder_blocks:
                self.placeholder_blocks.discard(of.ino)  # the kernel may have cached it
                if self.nursery is not None:
                    _invalidate_inode(of.ino, attr_only=True)

    def writers_open(self) -> int:
        """Open handles that may write (a signal's unmount waits for them)."""
        return sum(handle.writer for handle in self.handles.values())

    @handler
    async def fsync(self, fh, datasync):
        await self.blockio.fsync(self.handles[fh].of, datasync=bool(datasync))

    # --- directories -----------------------------------------------------------------------

    @handler
    async def opendir(self, inode, ctx):
        if not stat.S_ISDIR(self.ns.get_inode(inode).mode):
            raise FsError(errno.ENOTDIR, "not a directory")
        fh = self._fh()
        self.dir_handles[fh] = DirHandle(inode)
        return fh

    @handler
    async def readdir(self, fh, start_id, token):
        """Offsets: 1 is ".", 2 is "..", then each entry's stable cookie."""
        handle = self.dir_handles[fh]
        ino = handle.ino
        if start_id < 1:
            self._read_moves_atime(self.ns.get_inode(ino))
            if not pyfuse3.readdir_reply(token, b".", self._entry(self.ns.get_inode(ino)), 1):
                return
        if start_id < 2:
            parent = self.ns.get_inode(self.ns.get_inode(ino).parent)
            if not pyfuse3.readdir_reply(token, b"..", self._entry(parent), 2):
                return
        after = max(start_id, 2)
        batch, reaches_end, read_at = self._left_over(handle, after)
        while True:
            for i, (cookie, name, child, fields) in enumerate(batch):
                if not pyfuse3.readdir_reply(token, name, self._attributes(child, fields),
                                             cookie):
                    handle.left_over = batch[i:]
                    handle.left_over_after = after
                    handle.left_over_commits = read_at
                    handle.left_over_reach_end = reaches_end
                    return
                self.lookups[child] = self.lookups.get(child, 0) + 1
                after = cookie
            if reaches_end:
                return
            read_at = self.ns.commits
            batch = self.ns.readdir(ino, after, READDIR_BATCH)
            reaches_end = len(batch) < READDIR_BATCH

    def _left_over(self, handle: DirHandle, after: int) -> tuple[list, bool, int]:
        """The entries left over from the last reply if this request continues it and the
        namespace has not changed since they were read; else nothing (and not the end).
        Also the namespace's commit count when they were read."""
        batch = handle.left_over
        handle.left_over = []
        if (batch and handle.left_over_after == after
                and handle.left_over_commits == self.ns.commits):
            return batch, handle.left_over_reach_end, handle.left_over_commits
        return [], False, self.ns.commits

    @handler
    async def releasedir(self, fh):
        self.dir_handles.pop(fh, None)

    @handler
    async def fsyncdir(self, fh, datasync):
        await self.blockio.sync_namespace()

    @handler
    async def statfs(self, ctx):
        return self.statfs_source()

    # --- extended attributes -------------------------------------------------------------------

    @staticmethod
    def _check_xattr_name(name: bytes) -> None:
        if len(name) > 255:
            raise FsError(errno.ERANGE, "attribute name too long")
        if not name.startswith(XATTR_NAMESPACES):
            raise FsError(errno.EOPNOTSUPP, "unsupported attribute namespace")
        if name in XATTR_NAMESPACES:
            raise FsError(errno.EINVAL, "attribute name is only a namespace prefix")

    @handler
    async def getxattr(self, inode, name, ctx):
        self._check_xattr_name(name)
        if is_policy_xattr(name):
            return self.policy_xattrs.get(inode, name)
        return self.ns.get_xattr(inode, name)

    @handler
    async def setxattr(self, inode, name, value, ctx):
        self._check_xattr_name(name)
        if is_policy_xattr(name):
            self.policy_xattrs.set(inode, name, value)
            if name == REPLICATION:
                self.on_replication_change(inode)
            return None
        if len(value) > XATTR_VALUE_MAX:
            raise FsError(errno.E2BIG, "attribute value too large")
        try:
            old = len(name) + len(self.ns.get_xattr(inode, name))
        except FsError:
            old = 0
        if self.ns.xattr_bytes(inode) - old + len(name) + len(value) > XATTR_INODE_MAX:
            raise LimitError(errno.ENOSPC, "no room for more extended attributes on this inode")
        if not old and (sum(len(n) + 1 for n in self.ns.list_xattrs(inode)) + len(name) + 1
                        > XATTR_LIST_MAX):
            # Past this the inode could never be listed again (getfattr -d, cp -a).
            raise LimitError(errno.ENOSPC, "no room for another attribute name on this inode")
        self.ns.set_xattr(inode, name, value, now_ns())

    @handler
    async def listxattr(self, inode, ctx):
        names = self.ns.list_xattrs(inode) + self.policy_xattrs.listed(inode)
        if (any(n.startswith(b"trusted.") for n in names)
                and not caller.capable(ctx, caller.CAP_SYS_ADMIN)):  # the Linux rule
            names = [n for n in names if not n.startswith(b"trusted.")]
        if sum(len(n) + 1 for n in names) > XATTR_LIST_MAX:
            raise FsError(errno.E2BIG, "attribute list too large")
        return names

    @handler
    async def removexattr(self, inode, name, ctx):
        self._check_xattr_name(name)
        if is_policy_xattr(name):
            self.policy_xattrs.remove(inode, name)
            if name == REPLICATION:
                self.on_replication_change(inode)
            return None
        self.ns.remove_xattr(inode, name, now_ns())


class _NoUmask:
    """A request context whose umask is ignored (symlinks are always 0777)."""

    def __init__(self, ctx):
        self.uid, self.gid, self.pid, self.umask = ctx.uid, ctx.gid, ctx.pid, 0


def _invalidate_inode(ino: int, attr_only: bool = False) -> None:
    try:
        pyfuse3.invalidate_inode(ino, attr_only)
    except OSError as exc:
        log.info("kernel cache of inode %d not invalidated: %s", ino, exc)


def make_statfs(volumes, ns: Namespace):
    """statfs from the volumes: sizes summed over all volumes, f_namemax enforced."""

    def statfs() -> pyfuse3.StatvfsData:
        st = pyfuse3.StatvfsData()
        total, free = volumes.space()
        st.f_bsize = IO_BLKSIZE
        st.f_frsize = 4096
        st.f_blocks = total // 4096
        st.f_bfree = st.f_bavail = free // 4096
        used_inodes = ns.counts()["inodes"]
        st.f_files = used_inodes + (1 << 32)
        st.f_ffree = st.f_favail = 1 << 32
        st.f_namemax = NAME_MAX
        return st

    return statfs
