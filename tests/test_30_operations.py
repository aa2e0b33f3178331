"""The pyfuse3 Operations driven directly, without a kernel mount (S3QL's test layer 3).

The objects come from ``mount.prepare`` itself (mount lock, namespace, volumes, recovery,
resolver, placer, block I/O, Operations), on a filesystem made with a 64 KiB block size and
4 KiB checksum chunks so that block boundaries are cheap to cross. Handlers are called with
``trio.run`` and a small request context. At the end of every test the fixture shuts down
as the daemon does after an unmount and fsck must find the filesystem healthy; a handler
that logged an ERROR (a bug answered with EIO) fails the test.

Only ``pyfuse3.readdir_reply`` is replaced (by a collector with a fixed capacity): it writes
into the kernel's reply buffer, which does not exist without a mount.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import random
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import pytest
import trio

from tierfs import mount
from tierfs.fs import operations, replication, serving
from tierfs.backends.replica import Replica
from tierfs.fs.errors import FsError
from tierfs.fs.operations import XATTR_INODE_MAX, XATTR_VALUE_MAX
from tierfs.fs.replication import ReplicationMonitor
from tierfs.fs.schema import ROOT_INO, Op, parse_journal_record, u64
from tierfs.tools.fsck import Fsck
from tierfs.backends.storage_types import StorageType
from tierfs.tools.mkfs import VolumeSpec, make_filesystem
from tests.conftest import evict

BS = 64 << 10
BPC = 4096


@dataclass
class Ctx:
    """A FUSE request context (what pyfuse3 passes as ``ctx``)."""

    uid: int = os.getuid()
    gid: int = os.getgid()
    pid: int = os.getpid()
    umask: int = 0o022


@dataclass
class Fields:
    """The ``fields`` argument of setattr: which attributes to change."""

    update_size: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_atime: bool = False
    update_mtime: bool = False
    update_ctime: bool = False


class FS:
    """A prepared (not kernel-mounted) tierfs and helpers to call its handlers."""

    def __init__(self, data: Path, mountpoint: Path):
        self.data = data
        self.mountpoint = mountpoint
        self.ctx = Ctx()
        self.stack = None
        self.start()

    def start(self) -> None:
        args = argparse.Namespace(data=str(self.data), mountpoint=str(self.mountpoint),
                                  options=[])
        self.stack, self.ops, self.blockio, self.ns = mount.prepare(args)

    def stop(self) -> None:
        """What the daemon does after the kernel unmounted (every inode forgotten)."""
        mount.shutdown(self.ops, self.blockio, self.ns)
        self.stack.close()
        self.stack = None

    def call(self, handler, *args):
        return trio.run(lambda: handler(*args))

    def errno_of(self, handler, *args) -> int:
        """The errno a handler answers with; only FUSEError may leave a handler."""
        try:
            self.call(handler, *args)
        except pyfuse3.FUSEError as exc:
            return exc.errno
        raise AssertionError(f"{handler.__name__}{args} succeeded")

    # shorthands for the common requests
    def create(self, name: bytes, parent: int = ROOT_INO, flags: int = os.O_RDWR,
               mode: int = 0o644):
        fi, entry = self.call(self.ops.create, parent, name, mode, flags, self.ctx)
        return fi.fh, entry.st_ino

    def mkdir(self, name: bytes, parent: int = ROOT_INO) -> int:
        return self.call(self.ops.mkdir, parent, name, 0o755, self.ctx).st_ino

    def open(self, ino: int, flags: int = os.O_RDWR) -> int:
        return self.call(self.ops.open, ino, flags, self.ctx).fh

    def write(self, fh: int, off: int, data: bytes) -> int:
        return self.call(self.ops.write, fh, off, data)

    def read(self, fh: int, off: int, size: int) -> bytes:
        return self.call(self.ops.read, fh, off, size)

    def release(self, fh: int) -> None:
        self.call(self.ops.release, fh)

    def forget(self, ino: int, count: int = 1) -> None:
        self.call(self.ops.forget, [(ino, count)])

    def sync_namespace_then_gone(self, files: set) -> None:
        """Files of dropped blocks stay until the drop is on disk (a power loss must not
        bring back a namespace that refers to deleted files); the sync deletes them."""
        assert files and files <= self.replica_files(), "deleted before the drop was synced"
        self.call(self.blockio.sync_namespace)
        assert not files & self.replica_files()

    def getattr(self, ino: int):
        return self.call(self.ops.getattr, ino, self.ctx)

    def truncate(self, ino: int, size: int, fh: int | None = None):
        attr = pyfuse3.EntryAttributes()
        attr.st_size = size
        return self.call(self.ops.setattr, ino, attr, Fields(update_size=True), fh, self.ctx)

    def lookups(self, ino: int) -> int:
        return self.ops.lookups.get(ino, 0)

    def replica_files(self) -> set[str]:
        """Names of every replica data and meta file on every volume."""
        return {p.name for p in self.data.rglob("blk_*")
                if p.is_file() and "namespace" not in p.parts}

    def block_files(self, ino: int) -> set[str]:
        """The data file names of an inode's blocks, from the namespace."""
        return {f"blk_{rec.block_id}" for rec in self.ns.get_blocks(ino).values()}


def _serve(data: Path, caplog):
    """A prepared FS on ``data``; afterwards: shut down, no ERROR logged, fsck healthy."""
    mnt = data.parent / "mnt"
    mnt.mkdir()
    caplog.set_level(logging.WARNING)
    tierfs = FS(data, mnt)
    yield tierfs
    if tierfs.stack is not None:
        tierfs.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, "logged errors:\n" + "\n".join(r.getMessage() for r in errors)
    report = Fsck(data).check()
    assert report.healthy, report.render()


@pytest.fixture
def fs(tmp_path, caplog):
    data = tmp_path / "data"
    make_filesystem(data, block_size=BS, bytes_per_checksum=BPC)
    yield from _serve(data, caplog)


def _serve_disks(tmp_path: Path, caplog, volumes: int, replication: int):
    """A prepared FS on DISK volumes d1, d2, ... (as ``_serve``)."""
    data = tmp_path / "data"
    make_filesystem(data, [VolumeSpec(StorageType.DISK, data / f"d{i}")
                           for i in range(1, volumes + 1)],
                    block_size=BS, bytes_per_checksum=BPC, replication=replication)
    yield from _serve(data, caplog)


@pytest.fixture
def replicated_fs(tmp_path, caplog):
    """Two DISK volumes, d1 and d2, and replication 2: every block has two replicas."""
    yield from _serve_disks(tmp_path, caplog, volumes=2, replication=2)


@pytest.fixture
def three_volume_fs(tmp_path, caplog):
    """Three DISK volumes and replication 2: room for a new copy beside both replicas."""
    yield from _serve_disks(tmp_path, caplog, volumes=3, replication=2)


@pytest.fixture
def triple_fs(tmp_path, caplog):
    """Three DISK volumes, d1 to d3, and replication 3."""
    yield from _serve_disks(tmp_path, caplog, volumes=3, replication=3)


class ReaddirCollector:
    """Stands in for the kernel's readdir buffer: takes ``capacity`` entries."""

    def __init__(self, capacity: int = 1 << 30):
        self.capacity = capacity
        self.entries: list[tuple[bytes, int, int]] = []  # name, st_ino, next offset

    def __call__(self, token, name, attr, next_id) -> bool:
        assert token is self
        if len(self.entries) >= self.capacity:
            return False
        self.entries.append((bytes(name), attr.st_ino, next_id))
        return True


@pytest.fixture
def readdir_buffer(monkeypatch):
    """readdir(fs, ino, start, capacity) -> [(name, st_ino, next offset)]."""
    def readdir(fs: FS, ino: int, start: int = 0, capacity: int = 1 << 30):
        buffer = ReaddirCollector(capacity)
        monkeypatch.setattr(pyfuse3, "readdir_reply", buffer)
        fh = fs.call(fs.ops.opendir, ino, fs.ctx)
        try:
            fs.call(fs.ops.readdir, fh, start, buffer)
        finally:
            fs.call(fs.ops.releasedir, fh)
        return buffer.entries

    return readdir


# --- lookup counts ----------------------------------------------------------------------------

def test_every_entry_reply_counts_a_lookup_and_forget_takes_it_back(fs):
    ctx = fs.ctx
    assert fs.lookups(ROOT_INO) == 1
    fh, f = fs.create(b"f")
    fs.release(fh)
    assert fs.lookups(f) == 1
    d = fs.mkdir(b"d")
    assert fs.lookups(d) == 1
    s = fs.call(fs.ops.symlink, ROOT_INO, b"s", b"target", ctx).st_ino
    n = fs.call(fs.ops.mknod, ROOT_INO, b"fifo", stat.S_IFIFO | 0o600, 0, ctx).st_ino
    assert fs.lookups(s) == 1 and fs.lookups(n) == 1
    entry = fs.call(fs.ops.link, f, d, b"hard", ctx)
    assert entry.st_ino == f and entry.st_nlink == 2
    assert fs.lookups(f) == 2
    for _ in range(3):
        assert fs.call(fs.ops.lookup, ROOT_INO, b"f", ctx).st_ino == f
    assert fs.call(fs.ops.lookup, d, b"hard", ctx).st_ino == f
    assert fs.lookups(f) == 6
    # getattr and a negative lookup count nothing
    fs.getattr(f)
    fs.call(fs.ops.lookup, ROOT_INO, b"missing", ctx)
    assert fs.lookups(f) == 6
    fs.call(fs.ops.forget, [(f, 4), (s, 1), (n, 1)])
    assert fs.lookups(f) == 2 and fs.lookups(s) == 0 and fs.lookups(n) == 0
    fs.forget(f, 2)
    assert f not in fs.ops.lookups
    # forgotten inodes that still have names are not purged
    assert fs.getattr(f).st_nlink == 2
    assert fs.call(fs.ops.lookup, ROOT_INO, b"s", ctx).st_ino == s
    assert fs.call(fs.ops.readlink, s, ctx) == b"target"


def test_negative_lookup_is_a_cached_entry_with_inode_zero(fs):
    entry = fs.call(fs.ops.lookup, ROOT_INO, b"nothing", fs.ctx)
    assert entry.st_ino == 0
    assert entry.entry_timeout > 0
    assert 0 not in fs.ops.lookups
    fh, f = fs.create(b"file")
    fs.release(fh)
    # below a file, or after an unlink: negative too
    assert fs.call(fs.ops.lookup, f, b"x", fs.ctx).st_ino == 0
    fs.call(fs.ops.unlink, ROOT_INO, b"file", fs.ctx)
    assert fs.call(fs.ops.lookup, ROOT_INO, b"file", fs.ctx).st_ino == 0


def test_lookup_of_dot_and_dotdot(fs):
    d = fs.mkdir(b"d")
    e = fs.mkdir(b"e", parent=d)
    assert fs.call(fs.ops.lookup, e, b".", fs.ctx).st_ino == e
    assert fs.call(fs.ops.lookup, e, b"..", fs.ctx).st_ino == d
    assert fs.call(fs.ops.lookup, ROOT_INO, b"..", fs.ctx).st_ino == ROOT_INO
    assert fs.lookups(d) == 2 and fs.lookups(e) == 2


def test_readdir_lists_dot_dotdot_and_entries_with_stable_offsets(fs, readdir_buffer):
    d = fs.mkdir(b"d")
    inos = {}
    for i in range(10):
        fh, ino = fs.create(b"f%d" % i, parent=d)
        fs.release(fh)
        inos[b"f%d" % i] = ino
        fs.forget(ino)
    sub = fs.mkdir(b"sub", parent=d)
    fs.forget(sub)
    inos[b"sub"] = sub
    assert all(fs.lookups(i) == 0 for i in inos.values())
    listing = readdir_buffer(fs, d)
    assert listing[0][:2] == (b".", d) and listing[1][:2] == (b"..", ROOT_INO)
    assert {name: ino for name, ino, _ in listing[2:]} == inos
    offsets = [off for _, _, off in listing]
    assert offsets == sorted(set(offsets))
    # readdirplus: every entry other than . and .. counted one lookup
    assert all(fs.lookups(i) == 1 for i in inos.values())
    assert fs.lookups(d) == 1  # from mkdir only, not from "."
    # a full buffer: the refused entry is not counted, and the listing resumes after the
    # last accepted offset without repeating or skipping
    for ino in inos.values():
        fs.forget(ino)
    first = readdir_buffer(fs, d, 0, capacity=5)
    assert len(first) == 5
    second = readdir_buffer(fs, d, first[-1][2], capacity=4)
    third = readdir_buffer(fs, d, second[-1][2])
    names = [n for n, _, _ in first + second + third]
    assert names == [n for n, _, _ in listing]
    assert all(fs.lookups(i) == 1 for i in inos.values())
    # an offset past the end gives nothing
    assert readdir_buffer(fs, d, listing[-1][2]) == []


def test_readdir_resumes_correctly_while_entries_come_and_go(fs, readdir_buffer):
    d = fs.mkdir(b"d")
    for i in range(600):  # more than one READDIR_BATCH
        fs.call(fs.ops.mknod, d, b"n%03d" % i, stat.S_IFREG | 0o644, 0, fs.ctx)
    seen = []
    offset = 0
    step = 0
    while batch := readdir_buffer(fs, d, offset, capacity=37):
        seen += [n for n, _, _ in batch]
        offset = batch[-1][2]
        step += 1
        if step <= 10:  # later listings must reach an end
            fs.call(fs.ops.unlink, d, b"n%03d" % (599 - step), fs.ctx)  # not listed yet
            fs.call(fs.ops.mknod, d, b"new%d" % step, stat.S_IFREG | 0o644, 0, fs.ctx)
    removed = {b"n%03d" % (599 - s) for s in range(1, 11)}
    assert {b"new%d" % s for s in range(1, 11)} <= set(seen)
    stayed = {b"n%03d" % i for i in range(600)} - removed
    for name in stayed:
        assert seen.count(name) == 1
    assert not removed & set(seen[:37])  # the first batch preceded every removal
    assert len(seen) == len(set(seen))


def test_one_listing_whose_replies_hold_ever_different_numbers_of_entries(fs, monkeypatch):
    """One open directory read by requests whose reply buffers hold 1, 60, 3, 25, ... entries
    (names of very different lengths do that to the kernel's buffer): entries read for one
    reply and left over start the next, and every entry still comes exactly once, in order."""
    d = fs.mkdir(b"d")
    names = [b"n%04d" % i + b"x" * (i % 200) for i in range(300)]
    for name in names:
        fs.call(fs.ops.mknod, d, name, stat.S_IFREG | 0o644, 0, fs.ctx)
    capacities = [1, 60, 3, 25, 2, 90, 7, 40, 1, 1, 20]
    fh = fs.call(fs.ops.opendir, d, fs.ctx)
    seen: list[bytes] = []
    offset, step = 0, 0
    try:
        while True:
            buffer = ReaddirCollector(capacities[step % len(capacities)])
            monkeypatch.setattr(pyfuse3, "readdir_reply", buffer)
            fs.call(fs.ops.readdir, fh, offset, buffer)
            if not buffer.entries:
                break
            seen += [n for n, _, _ in buffer.entries]
            offset = buffer.entries[-1][2]
            step += 1
    finally:
        fs.call(fs.ops.releasedir, fh)
    assert seen == [b".", b".."] + sorted(names, key=names.index)
    assert step > len(capacities)  # every capacity was used, some twice


def test_left_over_entries_are_not_served_after_a_change_or_a_seek(fs, monkeypatch):
    """The entries left over from a full reply start the next one, without reading them
    again, but only while nothing in the namespace changed and the request continues the
    last reply: after a chmod and an unlink
    the listing shows the new mode and not the removed name, and a request that goes back to
    an earlier offset (rewinddir, seekdir) gets the entries from there."""
    d = fs.mkdir(b"d")
    names = [b"f%03d" % i for i in range(100)]
    inos = {}
    for name in names:
        inos[name] = fs.call(fs.ops.mknod, d, name, stat.S_IFREG | 0o644, 0, fs.ctx).st_ino

    class ModeCollector(ReaddirCollector):
        def __call__(self, token, name, attr, next_id) -> bool:
            accepted = super().__call__(token, name, attr, next_id)
            if accepted:
                self.modes = getattr(self, "modes", {}) | {bytes(name): attr.st_mode}
            return accepted

    fh = fs.call(fs.ops.opendir, d, fs.ctx)

    def request(offset: int, capacity: int) -> ModeCollector:
        buffer = ModeCollector(capacity)
        monkeypatch.setattr(pyfuse3, "readdir_reply", buffer)
        fs.call(fs.ops.readdir, fh, offset, buffer)
        return buffer

    reads = []
    real_readdir = fs.ns.readdir
    monkeypatch.setattr(fs.ns, "readdir", lambda *a: reads.append(a) or real_readdir(*a))
    try:
        first = request(0, 5)
        assert [n for n, _, _ in first.entries] == [b".", b"..", b"f000", b"f001", b"f002"]
        reads.clear()
        nxt = request(first.entries[-1][2], 4)
        assert [n for n, _, _ in nxt.entries] == [b"f003", b"f004", b"f005", b"f006"]
        assert reads == [], "the left-over entries were read again"
        again = request(first.entries[2][2], 3)  # back to just after f000
        assert [n for n, _, _ in again.entries] == [b"f001", b"f002", b"f003"]
        first = request(0, 5)
        attr = pyfuse3.EntryAttributes()
        attr.st_mode = stat.S_IFREG | 0o600
        fs.call(fs.ops.setattr, inos[b"f010"], attr, Fields(update_mode=True), None, fs.ctx)
        fs.call(fs.ops.unlink, d, b"f020", fs.ctx)
        rest = request(first.entries[-1][2], 1000)
        assert [n for n, _, _ in rest.entries] == [n for n in names[3:] if n != b"f020"]
        assert stat.S_IMODE(rest.modes[b"f010"]) == 0o600
    finally:
        fs.call(fs.ops.releasedir, fh)


# --- purge of unlinked inodes -----------------------------------------------------------------

@pytest.mark.parametrize("order", ["release-then-forget", "forget-then-release"])
def test_unlinked_file_is_purged_when_closed_and_forgotten(fs, order):
    fh, f = fs.create(b"f")
    payload = os.urandom(BS + 1000)  # two blocks
    assert fs.write(fh, 0, payload) == len(payload)
    blocks = fs.block_files(f)
    assert len(blocks) == 2 and blocks <= fs.replica_files()
    fs.call(fs.ops.unlink, ROOT_INO, b"f", fs.ctx)
    assert fs.ns.orphans() == [f]
    assert blocks <= fs.replica_files(), "replicas deleted while the file is open"
    if order == "release-then-forget":
        fs.release(fh)
        assert blocks <= fs.replica_files(), "replicas deleted while the kernel knows it"
        assert fs.ns.orphans() == [f]
        fs.forget(f)
    else:
        fs.forget(f)
        assert blocks <= fs.replica_files(), "replicas deleted while the file is open"
        assert fs.ns.orphans() == [f]
        fs.release(fh)
    assert fs.ns.orphans() == []
    fs.sync_namespace_then_gone(blocks)
    assert fs.replica_files() == set()
    assert fs.ns.trash() == []
    assert fs.errno_of(fs.ops.getattr, f, fs.ctx) == errno.ENOENT


def test_unlink_of_an_unused_file_deletes_its_replicas_once_the_unlink_is_synced(fs):
    fh, f = fs.create(b"f")
    fs.write(fh, 0, b"x" * 100)
    fs.release(fh)
    fs.forget(f)
    keep_fh, keep = fs.create(b"keep")
    fs.write(keep_fh, 0, b"k")
    fs.release(keep_fh)
    gone = fs.block_files(f)
    assert gone | fs.block_files(keep) <= fs.replica_files()
    fs.call(fs.ops.unlink, ROOT_INO, b"f", fs.ctx)
    assert fs.ns.orphans() == []
    fs.sync_namespace_then_gone(gone)
    assert fs.block_files(keep) <= fs.replica_files()
    assert len(fs.replica_files()) == 2  # keep's data and meta file
    assert fs.ns.trash() == []


def test_a_file_replaced_by_rename_lives_until_forgotten(fs):
    fh, old = fs.create(b"old")
    fs.write(fh, 0, b"old data")
    fs.release(fh)
    fh, new = fs.create(b"new")
    fs.write(fh, 0, b"new data")
    fs.release(fh)
    old_blocks = fs.block_files(old)
    fs.call(fs.ops.rename, ROOT_INO, b"new", ROOT_INO, b"old", 0, fs.ctx)
    assert fs.call(fs.ops.lookup, ROOT_INO, b"old", fs.ctx).st_ino == new
    assert fs.ns.orphans() == [old]
    assert old_blocks <= fs.replica_files()
    assert fs.getattr(old).st_nlink == 0
    fs.forget(old)
    assert fs.ns.orphans() == []
    fs.sync_namespace_then_gone(old_blocks)
    fh = fs.open(new, os.O_RDONLY)
    assert fs.read(fh, 0, 100) == b"new data"
    fs.release(fh)


def test_rename_over_an_unused_file_deletes_its_replicas_once_the_rename_is_synced(fs):
    fh, old = fs.create(b"old")
    fs.write(fh, 0, b"old data")
    fs.release(fh)
    fs.forget(old)
    fh, new = fs.create(b"new")
    fs.write(fh, 0, b"new data")
    old_blocks = fs.block_files(old)
    assert old_blocks <= fs.replica_files()
    fs.call(fs.ops.rename, ROOT_INO, b"new", ROOT_INO, b"old", 0, fs.ctx)
    assert fs.ns.orphans() == []
    fs.sync_namespace_then_gone(old_blocks)
    assert fs.ns.trash() == []
    assert fs.errno_of(fs.ops.getattr, old, fs.ctx) == errno.ENOENT
    assert fs.read(fh, 0, 100) == b"new data"
    fs.release(fh)


def test_removed_directory_is_purged_when_forgotten(fs):
    d = fs.mkdir(b"d")
    fs.call(fs.ops.rmdir, ROOT_INO, b"d", fs.ctx)
    assert fs.ns.orphans() == [d]
    assert fs.getattr(d).st_nlink == 0
    assert fs.getattr(ROOT_INO).st_nlink == 2
    assert fs.errno_of(fs.ops.mkdir, d, b"x", 0o755, fs.ctx) == errno.ENOENT
    assert fs.errno_of(fs.ops.create, d, b"x", 0o644, os.O_RDWR, fs.ctx) == errno.ENOENT
    fs.forget(d)
    assert fs.ns.orphans() == []
    assert fs.errno_of(fs.ops.getattr, d, fs.ctx) == errno.ENOENT


def test_open_unlinked_file_stays_readable_and_writable(fs):
    fh, f = fs.create(b"f")
    fs.write(fh, 0, b"a" * 5000)
    reader = fs.open(f, os.O_RDONLY)
    fs.call(fs.ops.unlink, ROOT_INO, b"f", fs.ctx)
    assert fs.call(fs.ops.lookup, ROOT_INO, b"f", fs.ctx).st_ino == 0
    assert fs.read(reader, 0, 5000) == b"a" * 5000
    # overwrite, extend into a new block, both handles see it
    fs.write(fh, 10, b"B" * 10)
    fs.write(fh, BS + 5, b"tail")
    assert fs.getattr(f).st_size == BS + 9
    assert fs.getattr(f).st_nlink == 0
    expected = b"a" * 10 + b"B" * 10 + b"a" * 4980 + bytes(BS + 5 - 5000) + b"tail"
    assert fs.read(reader, 0, 2 * BS) == expected
    assert fs.read(fh, 0, 2 * BS) == expected
    fs.call(fs.ops.fsync, fh, False)
    assert len(fs.block_files(f)) == 2
    blocks = fs.block_files(f)
    fs.release(fh)
    assert fs.read(reader, BS, 100) == b"\0" * 5 + b"tail"
    assert blocks <= fs.replica_files()
    fs.release(reader)
    fs.forget(f)
    assert fs.ns.orphans() == []
    fs.sync_namespace_then_gone(blocks)
    assert fs.replica_files() == set()


def test_orphans_left_at_unmount_are_purged_by_shutdown(fs):
    fh, f = fs.create(b"f")
    fs.write(fh, 0, b"data")
    fs.call(fs.ops.unlink, ROOT_INO, b"f", fs.ctx)
    fs.stop()  # the kernel forgot everything; the handle is gone with the mount
    assert fs.replica_files() == set()
    fs.start()
    assert fs.ns.orphans() == []
    assert fs.errno_of(fs.ops.getattr, f, fs.ctx) == errno.ENOENT


# --- errors -----------------------------------------------------------------------------------

def _bad_inputs(fs: FS):
    """(description, handler, args, errno) for inputs a caller can get wrong."""
    ctx = fs.ctx
    fh, f = fs.create(b"file")
    fs.release(fh)
    d = fs.mkdir(b"dir")
    fs.mkdir(b"child", parent=d)
    fs.call(fs.ops.symlink, ROOT_INO, b"link", b"file", ctx)
    long = b"n" * 256
    ops = fs.ops
    return [
        ("lookup long name", ops.lookup, (ROOT_INO, long, ctx), errno.ENAMETOOLONG),
        ("getattr missing inode", ops.getattr, (424242, ctx), errno.ENOENT),
        ("create existing", ops.create, (ROOT_INO, b"file", 0o644, os.O_RDWR, ctx),
         errno.EEXIST),
        ("create long name", ops.create, (ROOT_INO, long, 0o644, os.O_RDWR, ctx),
         errno.ENAMETOOLONG),
        ("create in a file", ops.create, (f, b"x", 0o644, os.O_RDWR, ctx), errno.ENOTDIR),
        ("mkdir existing", ops.mkdir, (ROOT_INO, b"dir", 0o755, ctx), errno.EEXIST),
        ("mkdir in missing dir", ops.mkdir, (424242, b"x", 0o755, ctx), errno.ENOENT),
        ("mknod long name", ops.mknod, (ROOT_INO, long, stat.S_IFIFO | 0o600, 0, ctx),
         errno.ENAMETOOLONG),
        ("symlink existing", ops.symlink, (ROOT_INO, b"file", b"t", ctx), errno.EEXIST),
        ("link a directory", ops.link, (d, ROOT_INO, b"d2", ctx), errno.EPERM),
        ("link onto existing", ops.link, (f, ROOT_INO, b"dir", ctx), errno.EEXIST),
        ("link missing inode", ops.link, (424242, ROOT_INO, b"x", ctx), errno.ENOENT),
        ("unlink missing", ops.unlink, (ROOT_INO, b"missing", ctx), errno.ENOENT),
        ("unlink a directory", ops.unlink, (ROOT_INO, b"dir", ctx), errno.EISDIR),
        ("rmdir a file", ops.rmdir, (ROOT_INO, b"file", ctx), errno.ENOTDIR),
        ("rmdir non-empty", ops.rmdir, (ROOT_INO, b"dir", ctx), errno.ENOTEMPTY),
        ("rmdir missing", ops.rmdir, (ROOT_INO, b"missing", ctx), errno.ENOENT),
        ("rename missing", ops.rename, (ROOT_INO, b"missing", ROOT_INO, b"x", 0, ctx),
         errno.ENOENT),
        ("rename into own subtree", ops.rename, (ROOT_INO, b"dir", d, b"x", 0, ctx),
         errno.EINVAL),
        ("rename both flags", ops.rename,
         (ROOT_INO, b"file", ROOT_INO, b"link", 3, ctx), errno.EINVAL),
        ("rename noreplace", ops.rename, (ROOT_INO, b"file", ROOT_INO, b"link", 1, ctx),
         errno.EEXIST),
        ("rename exchange missing", ops.rename,
         (ROOT_INO, b"file", ROOT_INO, b"none", 2, ctx), errno.ENOENT),
        ("rename file onto dir", ops.rename, (ROOT_INO, b"file", ROOT_INO, b"dir", 0, ctx),
         errno.EISDIR),
        ("rename dir onto file", ops.rename, (d, b"child", ROOT_INO, b"file", 0, ctx),
         errno.ENOTDIR),
        ("rename long name", ops.rename, (ROOT_INO, b"file", ROOT_INO, long, 0, ctx),
         errno.ENAMETOOLONG),
        ("readlink of a file", ops.readlink, (f, ctx), errno.EINVAL),
        ("opendir of a file", ops.opendir, (f, ctx), errno.ENOTDIR),
        ("opendir missing", ops.opendir, (424242, ctx), errno.ENOENT),
        ("open missing", ops.open, (424242, os.O_RDONLY, ctx), errno.ENOENT),
        ("truncate a directory", ops.setattr,
         (d, pyfuse3.EntryAttributes(), Fields(update_size=True), None, ctx), errno.EISDIR),
        ("setattr missing", ops.setattr,
         (424242, pyfuse3.EntryAttributes(), Fields(update_mode=True), None, ctx),
         errno.ENOENT),
        ("setxattr missing inode", ops.setxattr, (424242, b"user.a", b"v", ctx),
         errno.ENOENT),
        ("getxattr missing", ops.getxattr, (f, b"user.none", ctx), errno.ENODATA),
    ]


def test_bad_inputs_answer_the_right_errno_and_change_nothing(fs):
    cases = _bad_inputs(fs)
    for description, handler, args, expected in cases:
        txid = fs.ns.last_txid()
        got = fs.errno_of(handler, *args)
        assert got == expected, (
            f"{description}: {errno.errorcode.get(got)} instead of {errno.errorcode[expected]}")
        assert fs.ns.last_txid() == txid, f"{description} changed the namespace"
    # nothing was created, moved or lost by the failed calls
    listing = {n: fs.call(fs.ops.lookup, ROOT_INO, n, fs.ctx).st_ino
               for n in (b"file", b"dir", b"link")}
    assert all(listing.values())
    assert fs.call(fs.ops.lookup, listing[b"dir"], b"child", fs.ctx).st_ino


def test_truncate_of_a_symlink_is_einval(fs):
    s = fs.call(fs.ops.symlink, ROOT_INO, b"s", b"target", fs.ctx).st_ino
    assert fs.errno_of(fs.ops.setattr, s, pyfuse3.EntryAttributes(),
                       Fields(update_size=True), None, fs.ctx) == errno.EINVAL
    assert fs.call(fs.ops.readlink, s, fs.ctx) == b"target"


# --- extended attributes ----------------------------------------------------------------------

def test_xattr_round_trip(fs):
    fh, f = fs.create(b"f")
    fs.release(fh)
    ctx = fs.ctx
    fs.call(fs.ops.setxattr, f, b"user.one", b"1", ctx)
    fs.call(fs.ops.setxattr, f, b"user.bin", bytes(range(256)), ctx)
    fs.call(fs.ops.setxattr, f, b"user.empty", b"", ctx)
    assert fs.call(fs.ops.getxattr, f, b"user.one", ctx) == b"1"
    assert fs.call(fs.ops.getxattr, f, b"user.bin", ctx) == bytes(range(256))
    assert fs.call(fs.ops.getxattr, f, b"user.empty", ctx) == b""
    assert {b"user.one", b"user.bin", b"user.empty"} <= set(
        fs.call(fs.ops.listxattr, f, ctx))
    fs.call(fs.ops.removexattr, f, b"user.one", ctx)
    assert fs.errno_of(fs.ops.getxattr, f, b"user.one", ctx) == errno.ENODATA
    assert b"user.one" not in fs.call(fs.ops.listxattr, f, ctx)


def test_placement_in_one_walk_is_policy_and_replication_each_resolved(three_volume_fs):
    """``Resolver.placement`` (one walk up the tree, used for every new block and every
    write-only open) answers what ``policy`` and ``replication`` answer one by one, through
    sets at several levels, an unset, a rename and a LAZY_PERSIST file's own stamp; and a
    new file takes its directory's, which ``create`` relies on to resolve once."""
    fs = three_volume_fs
    ctx, resolver = fs.ctx, fs.ops.resolver
    a = fs.mkdir(b"a")
    b = fs.mkdir(b"b", parent=a)
    c = fs.mkdir(b"c")
    fs.call(fs.ops.setxattr, a, b"user.tierfs.storage_policy", b"COLD", ctx)
    fs.call(fs.ops.setxattr, b, b"user.tierfs.replication", b"1", ctx)  # the default is 2
    fs.call(fs.ops.setxattr, c, b"user.tierfs.storage_policy", b"LAZY_PERSIST", ctx)
    fs.call(fs.ops.setxattr, c, b"user.tierfs.replication", b"3", ctx)
    files = {}
    for name, parent in ((b"fa", a), (b"fb", b), (b"fc", c), (b"froot", ROOT_INO)):
        fh, files[name] = fs.create(name, parent=parent)
        fs.release(fh)
        assert resolver.placement(files[name]) == resolver.placement(parent)
    fs.call(fs.ops.removexattr, a, b"user.tierfs.storage_policy", ctx)
    fs.call(fs.ops.rename, c, b"fc", b, b"moved", 0, ctx)  # keeps its LAZY_PERSIST stamp
    expected = {ROOT_INO: ("HOT", 2), a: ("HOT", 2), b: ("HOT", 1), c: ("LAZY_PERSIST", 3),
                files[b"fa"]: ("HOT", 2), files[b"fb"]: ("HOT", 1),
                files[b"fc"]: ("LAZY_PERSIST", 1), files[b"froot"]: ("HOT", 2)}
    for ino, (policy_name, factor) in expected.items():
        assert (resolver.policy(ino).name, resolver.replication(ino)) == (policy_name, factor)
        assert resolver.placement(ino) == (resolver.policy(ino), resolver.replication(ino))


@pytest.fixture
def cold_full_fs(tmp_path, caplog):
    """A roomy DISK volume and a 1 MiB ARCHIVE one: COLD files have no room for the
    writeback cache, HOT ones do."""
    data = tmp_path / "data"
    make_filesystem(data, [VolumeSpec(StorageType.DISK, data / "disk"),
                           VolumeSpec(StorageType.ARCHIVE, data / "archive", 1 << 20)],
                    block_size=BS, bytes_per_checksum=BPC)
    yield from _serve(data, caplog)


def test_a_write_only_create_is_uncached_where_its_directory_s_policy_lacks_room(cold_full_fs):
    """create decides cached or uncached (``WRITEBACK_HEADROOM``) from the directory's
    policy, resolved once for the new file: uncached under COLD, whose ARCHIVE volume is
    nearly full, cached beside it under the HOT default."""
    fs = cold_full_fs
    cold = fs.mkdir(b"cold")
    fs.call(fs.ops.setxattr, cold, b"user.tierfs.storage_policy", b"COLD", fs.ctx)
    for parent, name, uncached in ((cold, b"c", True), (ROOT_INO, b"h", False)):
        fi, _ = fs.call(fs.ops.create, parent, name, 0o644, os.O_WRONLY, fs.ctx)
        assert bool(fi.direct_io) is uncached, name
        assert fs.ops.handles[fi.fh].direct is uncached
        fs.release(fi.fh)


def test_xattr_value_size_limit(fs):
    fh, f = fs.create(b"f")
    fs.release(fh)
    ctx = fs.ctx
    assert XATTR_VALUE_MAX == 65536
    assert fs.errno_of(fs.ops.setxattr, f, b"user.big", b"v" * 65537, ctx) == errno.E2BIG
    assert fs.errno_of(fs.ops.getxattr, f, b"user.big", ctx) == errno.ENODATA
    fs.call(fs.ops.setxattr, f, b"user.big", b"v" * 65536, ctx)
    assert fs.call(fs.ops.getxattr, f, b"user.big", ctx) == b"v" * 65536


def test_xattr_total_per_inode_limit(fs, caplog):
    fh, f = fs.create(b"f")
    fs.release(fh)
    ctx = fs.ctx
    names = [b"user.%d" % i for i in range(4)]
    value = b"x" * (XATTR_INODE_MAX // 4 - len(names[0]))
    for name in names:  # names + values fill the per-inode room exactly
        fs.call(fs.ops.setxattr, f, name, value, ctx)
    assert fs.errno_of(fs.ops.setxattr, f, b"user.more", b"", ctx) == errno.ENOSPC
    assert fs.errno_of(fs.ops.setxattr, f, names[0], value + b"!", ctx) == errno.ENOSPC
    # Any user can reach the limit at will: the answer is the errno, not a log line.
    assert not [r for r in caplog.records if "room" in r.getMessage()]
    fs.call(fs.ops.setxattr, f, names[0], value[::-1], ctx)  # same size: fits
    fs.call(fs.ops.removexattr, f, names[1], ctx)
    fs.call(fs.ops.setxattr, f, b"user.more", b"fits now", ctx)
    assert fs.call(fs.ops.getxattr, f, b"user.more", ctx) == b"fits now"
    # the limit is per inode: another file is not affected
    fh, g = fs.create(b"g")
    fs.release(fh)
    fs.call(fs.ops.setxattr, g, names[0], value, ctx)


def test_xattr_unknown_namespace_and_long_names(fs):
    fh, f = fs.create(b"f")
    fs.release(fh)
    ctx = fs.ctx
    for name in (b"foo.bar", b"system.posix_acl_default_x", b"user", b"x"):
        assert fs.errno_of(fs.ops.setxattr, f, name, b"v", ctx) == errno.EOPNOTSUPP
        assert fs.errno_of(fs.ops.removexattr, f, name, ctx) == errno.EOPNOTSUPP
    ok = b"user." + b"n" * 250
    assert len(ok) == 255
    fs.call(fs.ops.setxattr, f, ok, b"v", ctx)
    assert fs.call(fs.ops.getxattr, f, ok, ctx) == b"v"
    long = ok + b"n"
    assert fs.errno_of(fs.ops.setxattr, f, long, b"v", ctx) == errno.ERANGE
    assert fs.errno_of(fs.ops.getxattr, f, long, ctx) == errno.ERANGE
    assert fs.errno_of(fs.ops.removexattr, f, long, ctx) == errno.ERANGE
    assert fs.errno_of(fs.ops.removexattr, f, b"user.missing", ctx) == errno.ENODATA
    assert fs.errno_of(fs.ops.getxattr, f, b"trusted.missing", ctx) == errno.ENODATA
    for bare in (b"user.", b"trusted.", b"security."):  # ext4: EINVAL (getxattr was ENODATA)
        assert fs.errno_of(fs.ops.getxattr, f, bare, ctx) == errno.EINVAL
        assert fs.errno_of(fs.ops.setxattr, f, bare, b"v", ctx) == errno.EINVAL
        assert fs.errno_of(fs.ops.removexattr, f, bare, ctx) == errno.EINVAL
    for name in (b"foo.bar", b"user"):
        assert fs.errno_of(fs.ops.getxattr, f, name, ctx) == errno.EOPNOTSUPP


def test_xattrs_on_directories_and_symlinks(fs):
    d = fs.mkdir(b"d")
    s = fs.call(fs.ops.symlink, ROOT_INO, b"s", b"d", fs.ctx).st_ino
    for ino in (d, s, ROOT_INO):
        fs.call(fs.ops.setxattr, ino, b"trusted.k", b"%d" % ino, fs.ctx)
    for ino in (d, s, ROOT_INO):
        assert fs.call(fs.ops.getxattr, ino, b"trusted.k", fs.ctx) == b"%d" % ino


# --- statfs -----------------------------------------------------------------------------------

def test_statfs(fs):
    st = fs.call(fs.ops.statfs, fs.ctx)
    assert st.f_namemax == 255
    assert st.f_bsize > 0 and st.f_frsize > 0
    assert 0 < st.f_bavail <= st.f_blocks
    assert st.f_files > st.f_ffree > 0
    fs.mkdir(b"d")
    assert fs.call(fs.ops.statfs, fs.ctx).f_files == st.f_files + 1


# --- data -------------------------------------------------------------------------------------

def test_write_read_round_trip_across_block_boundaries(fs):
    fh, f = fs.create(b"f")
    payload = os.urandom(3 * BS + 123)
    # written in pieces that straddle block and checksum-chunk boundaries
    pos = 0
    for size in (BS - 100, 200, 5000, BS, BS - 5100 + 123):
        assert fs.write(fh, pos, payload[pos:pos + size]) == size
        pos += size
    assert pos == len(payload)
    assert fs.read(fh, 0, len(payload)) == payload
    assert fs.read(fh, BS - 50, 100) == payload[BS - 50:BS + 50]
    assert fs.read(fh, 2 * BS - 1, 2) == payload[2 * BS - 1:2 * BS + 1]
    assert fs.read(fh, len(payload) - 10, 100) == payload[-10:]
    assert fs.read(fh, len(payload), 100) == b""
    assert fs.read(fh, len(payload) + BS, 100) == b""
    assert len(fs.blockio.files[f].blocks) == 4
    fs.release(fh)
    assert sorted(fs.ns.get_blocks(f)) == [0, 1, 2, 3]
    assert [r.length for _, r in sorted(fs.ns.get_blocks(f).items())] == [BS, BS, BS, 123]
    assert fs.getattr(f).st_size == len(payload)
    # after a restart (a new mount) the data is the same
    fs.stop()
    fs.start()
    fh = fs.open(f, os.O_RDONLY)
    assert fs.read(fh, 0, 4 * BS) == payload
    fs.release(fh)


def test_reads_wait_for_a_disk_only_in_a_worker_thread(fs, monkeypatch):
    """A read whose replica pages are not in the page cache goes to a worker thread (a slow
    volume must not stall the event loop); once they are cached, the same read is served
    in the event loop, without the thread hop. Both give the same bytes, including a
    range that spans two blocks and a hole."""
    hops = []
    real_run_sync = trio.to_thread.run_sync

    async def counting_run_sync(fn, *args, **kwargs):
        hops.append(fn.__name__)
        return await real_run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting_run_sync)
    fh, f = fs.create(b"f")
    payload = os.urandom(2 * BS + 100)
    fs.write(fh, 0, payload)
    fs.write(fh, 4 * BS, b"end")  # blocks 2.. hold a hole before it
    fs.release(fh)
    expected = payload + bytes(2 * BS - 100) + b"end"
    for path in fs.data.rglob("blk_*"):
        if path.is_file() and "namespace" not in path.parts:
            evict(path)
    fh = fs.open(f, os.O_RDONLY)
    hops.clear()
    assert fs.read(fh, 0, len(expected)) == expected
    assert hops == ["_execute_read"]
    hops.clear()
    assert fs.read(fh, 0, len(expected)) == expected
    assert fs.read(fh, BS - 10, 20) == payload[BS - 10:BS + 10]
    assert hops == []
    fs.release(fh)


def _open_replica_count(fs) -> int:
    """Replicas the open files hold, counted from the files themselves."""
    return sum(len(replicas) for of in fs.blockio.files.values()
               for replicas in of.replicas.values())


def test_open_files_together_keep_a_bounded_number_of_replicas_open(fs):
    """Every open file keeps the replicas of the blocks it used open (two descriptors
    each), at most OPEN_BLOCKS_PER_FILE per file; many such files together ran the daemon
    out of descriptors (30 files of 64 blocks each, read with the usual limit of 1,024,
    answered EIO). Across all files, the least recently used blocks are closed beyond
    ``max_open_replicas``, whether the file read or wrote them, and reopened when used
    again; every byte stays right."""
    fs.blockio.max_open_replicas = 8
    payloads, handles = {}, {}
    for i in range(5):
        fh, ino = fs.create(f"f{i}".encode())
        payloads[ino] = os.urandom(6 * BS + i)
        for off in range(0, len(payloads[ino]), BS // 2):
            fs.write(fh, off, payloads[ino][off:off + BS // 2])
            assert fs.blockio.open_replicas <= 8
        handles[ino] = fh
    assert fs.blockio.open_replicas == _open_replica_count(fs) == 8
    for _ in range(2):  # all five files stay open; every block is reopened in turn
        for ino, fh in handles.items():
            for off in range(0, len(payloads[ino]), BS):
                assert fs.read(fh, off, BS) == payloads[ino][off:off + BS]
                assert fs.blockio.open_replicas == _open_replica_count(fs) <= 8
    for fh in handles.values():
        fs.release(fh)
    assert fs.blockio.open_replicas == 0 and not fs.blockio.open_blocks


def test_the_least_recently_used_block_of_all_files_is_closed_first(fs, monkeypatch):
    """A block used again and again stays open while blocks of other files come and go
    (the budget is least recently used, not first opened)."""
    fs.blockio.max_open_replicas = 2
    handles, blocks = {}, {}
    for name in (b"hot", b"a", b"b", b"c"):
        fh, ino = fs.create(name)
        fs.write(fh, 0, name * 10)
        fs.release(fh)
        handles[name] = fs.open(ino, os.O_RDONLY)
        blocks[name] = fs.ns.get_blocks(ino)[0].block_id
    opened = []
    for volume in fs.blockio.volumes:
        real = volume.open_replica
        monkeypatch.setattr(volume, "open_replica", lambda block_id, gs, *, writable,
                            real=real: opened.append(block_id) or real(block_id, gs,
                                                                       writable=writable))
    for name in (b"a", b"b", b"c", b"a", b"b", b"c"):
        assert fs.read(handles[b"hot"], 0, 30) == b"hot" * 10
        assert fs.read(handles[name], 0, 10) == name * 10
    # hot once, then a, b and c twice each: each evicts the other two, never hot
    assert opened == [blocks[b"hot"]] + [blocks[n] for n in (b"a", b"b", b"c")] * 2
    for fh in handles.values():
        fs.release(fh)


def test_running_out_of_descriptors_fails_the_request_but_blames_no_replica(replicated_fs,
                                                                            monkeypatch):
    """EMFILE while opening a replica says the daemon has too many files open, not that
    the replica is bad: the read or write fails with EMFILE, the replica already opened on
    the other volume is closed again, no replica is reported to the replication monitor or
    dropped from its block's pipeline, and once descriptors are free again the same handle
    reads and writes as before."""
    fs = replicated_fs
    fh, ino = fs.create(b"f")
    payload = os.urandom(2 * BS)
    fs.write(fh, 0, payload)
    fs.release(fh)
    volumes_before = {i: rec.volumes for i, rec in fs.ns.get_blocks(ino).items()}
    reported = []
    monkeypatch.setattr(fs.blockio, "on_bad_replica", lambda *a: reported.append(a))
    real_open = os.open

    second_volume = str(fs.data / "d2")

    def out_of_descriptors(path, *args, **kwargs):
        if os.fspath(path).startswith(second_volume) and "blk_" in os.fspath(path):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), os.fspath(path))
        return real_open(path, *args, **kwargs)

    fh = fs.open(ino, os.O_RDWR)
    descriptors = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "open", out_of_descriptors)
    assert fs.errno_of(fs.ops.read, fh, 0, 100) == errno.EMFILE
    assert fs.errno_of(fs.ops.write, fh, BS + 5, b"new") == errno.EMFILE
    monkeypatch.setattr(os, "open", real_open)
    assert len(os.listdir("/proc/self/fd")) == descriptors
    assert all(len(rec.volumes) == 2 for rec in fs.ns.get_blocks(ino).values())
    assert reported == []
    assert {i: rec.volumes for i, rec in fs.ns.get_blocks(ino).items()} == volumes_before
    assert fs.read(fh, 0, 2 * BS) == payload
    fs.write(fh, BS + 5, b"new")
    fs.release(fh)
    fh = fs.open(ino, os.O_RDONLY)
    assert fs.read(fh, 0, 2 * BS) == payload[:BS + 5] + b"new" + payload[BS + 8:]
    fs.release(fh)


def test_overwrite_in_a_later_session(fs):
    fh, f = fs.create(b"f")
    payload = bytearray(os.urandom(2 * BS))
    fs.write(fh, 0, bytes(payload))
    fs.release(fh)
    fh = fs.open(f, os.O_WRONLY)
    fs.write(fh, BS - 3, b"XXXXXX")
    payload[BS - 3:BS + 3] = b"XXXXXX"
    fs.release(fh)
    fh = fs.open(f, os.O_RDONLY)
    assert fs.read(fh, 0, 2 * BS) == bytes(payload)
    fs.release(fh)


def test_holes_read_as_zeros(fs):
    fh, f = fs.create(b"sparse")
    fs.write(fh, 3 * BS + 10, b"end")
    assert fs.getattr(f).st_size == 3 * BS + 13
    assert fs.read(fh, 0, 3 * BS + 13) == bytes(3 * BS + 10) + b"end"
    assert fs.read(fh, BS + 7, 10) == bytes(10)
    fs.release(fh)
    assert sorted(fs.ns.get_blocks(f)) == [3]  # holes have no block
    assert len(fs.replica_files()) == 2
    attr = fs.getattr(f)
    assert attr.st_blocks * 512 < attr.st_size
    # a hole inside a block (written at its start and far into it)
    fh = fs.open(f, os.O_RDWR)
    fs.write(fh, 0, b"a")
    fs.write(fh, 40000, b"b")
    assert fs.read(fh, 0, 40001) == b"a" + bytes(39999) + b"b"
    fs.release(fh)


def test_a_file_open_for_writing_with_nothing_stored_reports_one_block(fs):
    """The kernel may hold pages written to it that this daemon has not seen; 0 blocks
    would tell tools such as tar --sparse that a non-empty file is all holes."""
    fh, f = fs.create(b"f")
    assert fs.getattr(f).st_blocks == 1
    fs.release(fh)
    assert fs.getattr(f).st_blocks == 0
    reader = fs.open(f, os.O_RDONLY)
    assert fs.getattr(f).st_blocks == 0, "a reader holds no unseen pages"
    writer = fs.open(f, os.O_WRONLY)
    fs.truncate(f, 10 * BS)  # a hole: still nothing stored
    assert fs.getattr(f).st_blocks == 1
    fs.write(writer, 0, b"x" * 5000)
    assert fs.getattr(f).st_blocks * 512 == 8192, "what is stored counts, as ever"
    fs.release(writer)
    fs.release(reader)
    assert fs.getattr(f).st_blocks * 512 == 8192


def test_truncate_down_and_up(fs):
    fh, f = fs.create(b"f")
    payload = os.urandom(3 * BS)
    fs.write(fh, 0, payload)
    fs.release(fh)
    dropped = fs.block_files(f)
    # down into the middle of the first block (no handle: the path is truncated)
    entry = fs.truncate(f, 1000)
    assert entry.st_size == 1000
    kept = fs.block_files(f)
    assert len(kept) == 1
    fs.sync_namespace_then_gone(dropped - kept)
    fh = fs.open(f, os.O_RDWR)
    assert fs.read(fh, 0, BS) == payload[:1000]
    # up: the new range reads as zeros, also the part of the cut block
    assert fs.truncate(f, 2 * BS + 5, fh).st_size == 2 * BS + 5
    assert fs.read(fh, 0, 3 * BS) == payload[:1000] + bytes(2 * BS + 5 - 1000)
    # write after the cut, inside the cut block: the old bytes stay gone
    fs.write(fh, 3000, b"new")
    data = fs.read(fh, 0, 2 * BS + 5)
    assert data[:1000] == payload[:1000]
    assert data[1000:3000] == bytes(2000) and data[3000:3003] == b"new"
    assert data[3003:] == bytes(2 * BS + 5 - 3003)
    # to zero: no block left
    cut = fs.block_files(f)
    fs.truncate(f, 0, fh)
    assert fs.read(fh, 0, 100) == b""
    fs.release(fh)
    assert fs.ns.get_blocks(f) == {}
    fs.sync_namespace_then_gone(cut)
    assert fs.replica_files() == set()
    assert fs.getattr(f).st_size == 0


def test_truncate_to_a_block_boundary(fs):
    fh, f = fs.create(b"f")
    payload = os.urandom(2 * BS + 10)
    fs.write(fh, 0, payload)
    fs.truncate(f, BS, fh)
    assert sorted(fs.ns.get_blocks(f)) == [0]
    assert fs.read(fh, 0, 3 * BS) == payload[:BS]
    fs.write(fh, BS, b"next")
    assert fs.read(fh, BS - 2, 10) == payload[BS - 2:BS] + b"next"
    fs.release(fh)


def test_open_with_o_trunc(fs):
    fh, f = fs.create(b"f")
    fs.write(fh, 0, os.urandom(BS + 10))
    fs.release(fh)
    old = fs.block_files(f)
    fh = fs.open(f, os.O_WRONLY | os.O_TRUNC)
    assert fs.getattr(f).st_size == 0
    fs.sync_namespace_then_gone(old)
    assert fs.replica_files() == set()
    fs.write(fh, 0, b"fresh")
    fs.release(fh)
    fh = fs.open(f, os.O_RDONLY)
    assert fs.read(fh, 0, 100) == b"fresh"
    fs.release(fh)
    # Linux truncates for O_RDONLY|O_TRUNC too (the kernel checked write permission)
    fh = fs.open(f, os.O_RDONLY | os.O_TRUNC)
    assert fs.getattr(f).st_size == 0
    assert fs.read(fh, 0, 100) == b""
    fs.release(fh)
    assert fs.ns.get_inode(f).size == 0 and fs.ns.get_blocks(f) == {}
    # a reader that opened before sees the new length at once
    fh = fs.open(f, os.O_RDWR)
    fs.write(fh, 0, b"again")
    reader = fs.open(f, os.O_RDONLY)
    truncating = fs.open(f, os.O_WRONLY | os.O_TRUNC)
    assert fs.read(reader, 0, 100) == b""
    for h in (fh, reader, truncating):
        fs.release(h)


def test_getattr_shows_the_in_memory_size_of_a_file_open_for_writing(fs):
    fh, f = fs.create(b"f")
    fs.write(fh, 0, b"x" * 1000)
    assert fs.getattr(f).st_size == 1000
    assert fs.ns.get_inode(f).size == 0  # not persisted yet: the daemon holds the length
    fs.write(fh, 1000, b"y" * (BS - 1000))  # a block filled: persisted
    assert fs.ns.get_inode(f).size == BS
    fs.write(fh, BS, b"z" * 7)
    assert fs.getattr(f).st_size == BS + 7
    assert fs.call(fs.ops.lookup, ROOT_INO, b"f", fs.ctx).st_size == BS + 7
    assert fs.ns.get_inode(f).size == BS
    # a second handle sees the same length
    reader = fs.open(f, os.O_RDONLY)
    assert fs.read(reader, BS, 100) == b"z" * 7
    fs.write(fh, BS + 7, b"w")
    fs.release(fh)  # the last writer persists
    assert fs.ns.get_inode(f).size == BS + 8
    assert fs.getattr(f).st_size == BS + 8
    fs.release(reader)
    assert f not in fs.blockio.files


def test_flush_is_answered_and_release_persists(fs):
    """FLUSH is answered (so that close() reaches the daemon: test_70's close after the
    daemon died) and does nothing else; the length and times of the last writer reach the
    namespace at release."""
    fh, f = fs.create(b"f")
    fs.write(fh, 0, b"abc")
    mtime = fs.getattr(f).st_mtime_ns
    assert fs.call(fs.ops.flush, fh) is None
    assert fs.ns.get_inode(f).size == 0
    assert f in fs.ns.leases()
    fs.release(fh)
    inode = fs.ns.get_inode(f)
    assert (inode.size, inode.mtime_ns) == (3, mtime)
    assert f not in fs.ns.leases()


def test_failed_writes_invalidate_the_kernel_cache_one_at_a_time(fs, monkeypatch):
    """A writer that fills a volume through the kernel's cache fails its writebacks by the
    thousand, and each failure asks the kernel to drop the file's cache (which waits for
    writeback, in a worker thread). One invalidation per inode runs at a time, and once
    more if writes failed while it ran: a task per failure queued without bound (the
    daemon grew from 36 to 290 MB in 10 s of ``dd`` onto a full volume)."""
    fh, f = fs.create(b"f")
    invalidated, writeback_done = [], threading.Event()

    def invalidate(ino, attr_only=False):
        invalidated.append(ino)
        writeback_done.wait(10)

    def no_room(*args, **kwargs):  # the fault: every write meets a full volume
        raise FsError(errno.ENOSPC, "volume full")

    monkeypatch.setattr(operations, "_invalidate_inode", invalidate)
    monkeypatch.setattr(fs.blockio, "write", no_room)

    async def until(condition):
        with trio.fail_after(10):
            while not condition():
                await trio.sleep(0.01)

    async def writer_fills_the_volume():
        async with trio.open_nursery() as nursery:
            fs.ops.nursery = nursery
            for i in range(1000):
                with pytest.raises(pyfuse3.FUSEError) as failed:
                    await fs.ops.write(fh, i * 4096, b"x" * 4096)
                assert failed.value.errno == errno.ENOSPC
            await until(lambda: invalidated)
            assert invalidated == [f] and len(nursery.child_tasks) == 1
            writeback_done.set()
            await until(lambda: not fs.ops.invalidating)
        fs.ops.nursery = None

    trio.run(writer_fills_the_volume)
    assert invalidated == [f, f]  # the one in flight, and one for the failures after it


def test_a_new_file_takes_its_lease_with_its_first_block(fs):
    """The first write of a new file is one namespace transaction: the block and the
    lease together, journalled as one ADD_BLOCK that names the holder."""
    warm, _ = fs.create(b"warm")  # a mount's first block reserves id and GS batches
    fs.write(warm, 0, b"w")
    fs.release(warm)
    fh, f = fs.create(b"f")
    before = fs.ns.last_txid()
    fs.write(fh, 0, b"abc")
    assert fs.ns.last_txid() == before + 1
    with fs.ns.env.begin() as txn:
        record = parse_journal_record(txn.get(u64(before + 1), db=fs.ns.db["journal"]))
    assert record[0] == Op.ADD_BLOCK and record[-1] == fs.blockio.session
    assert fs.ns.leases()[f][0] == fs.blockio.session
    fs.write(fh, 3, b"def")  # same block, same session: no transaction at all
    assert fs.ns.last_txid() == before + 1
    fs.release(fh)
    assert f not in fs.ns.leases()


def test_fsync_persists_size_and_mtime(fs):
    fh, f = fs.create(b"f")
    fs.write(fh, 0, b"abc")
    mtime = fs.getattr(f).st_mtime_ns
    fs.call(fs.ops.fsync, fh, False)
    inode = fs.ns.get_inode(f)
    assert inode.size == 3 and inode.mtime_ns == mtime
    fs.release(fh)


def _count_syncs(fs, monkeypatch) -> dict[str, int]:
    """How often the namespace and the open replicas are synced from here on."""
    counts = {"namespace": 0, "replica": 0}
    real_ns_sync, real_replica_fsync = fs.ns.sync, Replica.fsync

    def ns_sync():
        counts["namespace"] += 1
        real_ns_sync()

    def replica_fsync(replica):
        counts["replica"] += 1
        real_replica_fsync(replica)

    monkeypatch.setattr(fs.ns, "sync", ns_sync)
    monkeypatch.setattr(Replica, "fsync", replica_fsync)
    return counts


def test_fdatasync_of_an_overwrite_syncs_only_the_replicas(fs, monkeypatch):
    """fdatasync needs durable what finding the data again takes: the replicas, and the
    size and blocks in the namespace. When the namespace already holds those durably,
    only the replicas are synced, and the new times wait for the tick."""
    fh, f = fs.create(b"f")
    fs.write(fh, 0, os.urandom(BS + 100))
    fs.call(fs.ops.fsync, fh, False)
    counts = _count_syncs(fs, monkeypatch)
    commits = fs.ns.commits
    fs.write(fh, 10, b"inside the first block")
    fs.call(fs.ops.fsync, fh, True)
    assert counts == {"namespace": 0, "replica": 1}
    assert fs.ns.commits == commits  # nothing persisted: the times wait for the tick
    fs.write(fh, BS + 100, b"an append")  # a new size: the namespace must have it
    fs.call(fs.ops.fsync, fh, True)
    assert counts == {"namespace": 1, "replica": 2}
    assert fs.ns.get_inode(f).size == BS + 109
    other, _ = fs.create(b"other")  # a commit not yet synced, of another file
    fs.write(fh, 0, b"x")
    fs.call(fs.ops.fsync, fh, True)
    assert counts == {"namespace": 2, "replica": 3}
    fs.write(fh, 0, b"y")
    commits = fs.ns.commits
    fs.call(fs.ops.fsync, fh, False)  # fsync: the times too
    assert counts == {"namespace": 3, "replica": 4} and fs.ns.commits == commits + 1
    fs.release(other)
    fs.release(fh)


def test_fdatasync_after_a_new_generation_stamp_syncs_the_namespace(fs, monkeypatch):
    """The first write of a later session stamps the block anew, in the namespace too:
    that record is what finds the replica again, so fdatasync must sync it."""
    fh, f = fs.create(b"f")
    fs.write(fh, 0, os.urandom(1000))
    fs.release(fh)
    fs.call(fs.blockio.sync_namespace)
    gs = fs.ns.get_blocks(f)[0].gs
    counts = _count_syncs(fs, monkeypatch)
    fh = fs.open(f, os.O_RDWR)
    fs.write(fh, 0, b"new")
    fs.call(fs.ops.fsync, fh, True)
    assert counts == {"namespace": 1, "replica": 1}
    assert fs.ns.get_blocks(f)[0].gs > gs and fs.ns.all_synced
    fs.release(fh)


def test_setattr_mode_owner_and_times(fs):
    fh, f = fs.create(b"f")
    attr = pyfuse3.EntryAttributes()
    attr.st_mode = stat.S_IFREG | 0o4750
    attr.st_uid = 1234
    attr.st_gid = 5678
    attr.st_atime_ns = 1_000_000_000
    attr.st_mtime_ns = 2_000_000_000
    entry = fs.call(fs.ops.setattr, f, attr,
                    Fields(update_mode=True, update_uid=True, update_gid=True,
                           update_atime=True, update_mtime=True), fh, fs.ctx)
    assert stat.S_IMODE(entry.st_mode) == 0o4750 and stat.S_ISREG(entry.st_mode)
    assert (entry.st_uid, entry.st_gid) == (1234, 5678)
    assert (entry.st_atime_ns, entry.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
    assert entry.st_ctime_ns > 2_000_000_000
    # the open file's in-memory times follow, and survive the release
    fs.release(fh)
    attr2 = fs.getattr(f)
    assert (attr2.st_atime_ns, attr2.st_mtime_ns) == (1_000_000_000, 2_000_000_000)


def test_setattr_with_a_time_out_of_range_changes_nothing(fs):
    """EINVAL for a time the namespace cannot hold, before anything else of the request
    is applied (the size was truncated first, then the time refused)."""
    fh, f = fs.create(b"f")
    fs.write(fh, 0, b"abcdef")
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 2
    attr.st_atime_ns = -(1 << 63) - 1  # one below what fits in signed 64 bits
    assert attr.st_atime_ns == -(1 << 63) - 1
    with pytest.raises(pyfuse3.FUSEError) as caught:
        fs.call(fs.ops.setattr, f, attr, Fields(update_size=True, update_atime=True), fh,
                fs.ctx)
    assert caught.value.errno == errno.EINVAL
    assert fs.getattr(f).st_size == 6
    fs.release(fh)


def test_new_inodes_take_the_callers_umask_and_ids(fs):
    ctx = Ctx(umask=0o027)
    fi, entry = fs.call(fs.ops.create, ROOT_INO, b"f", 0o666, os.O_RDWR, ctx)
    fs.release(fi.fh)
    assert stat.S_IMODE(entry.st_mode) == 0o640
    assert (entry.st_uid, entry.st_gid) == (ctx.uid, ctx.gid)
    d = fs.call(fs.ops.mkdir, ROOT_INO, b"d", 0o777, ctx)
    assert stat.S_IMODE(d.st_mode) == 0o750 and stat.S_ISDIR(d.st_mode)
    s = fs.call(fs.ops.symlink, ROOT_INO, b"s", b"f", ctx)
    assert stat.S_IMODE(s.st_mode) == 0o777 and stat.S_ISLNK(s.st_mode)
    assert s.st_size == 1


@pytest.mark.parametrize("seed", [1, 2])
def test_random_writes_truncates_and_reopens_against_a_bytearray(fs, seed):
    """fsx in miniature: the file's bytes and size always equal a bytearray's."""
    rng = random.Random(seed)
    fh, f = fs.create(b"f")
    handles = [fh]
    model = bytearray()

    def offset() -> int:
        if rng.random() < 0.3:
            return rng.randrange(4 * BS)
        edge = rng.randrange(4) * BS + rng.choice([0, BPC, 2 * BPC, BS - BPC])
        return max(0, edge + rng.randrange(-10, 10))

    for step in range(250):
        op = rng.choice(["write"] * 3 + ["read", "truncate", "reopen", "o_trunc", "fsync",
                                         "restart"])
        if op == "write":
            at = offset()
            data = os.urandom(rng.choice([1, 100, BPC - 1, BPC, BPC + 1, BS, BS + 1,
                                          rng.randrange(1, 3 * BS)]))
            assert fs.write(handles[-1], at, data) == len(data)
            model.extend(bytes(max(0, at - len(model))))
            model[at:at + len(data)] = data
        elif op == "read":
            at, size = offset(), rng.randrange(3 * BS)
            assert fs.read(rng.choice(handles), at, size) == bytes(model[at:at + size]), step
        elif op == "truncate":
            size = offset()
            fs.truncate(f, size, rng.choice(handles + [None]))
            del model[size:]
            model.extend(bytes(size - len(model)))
        elif op == "reopen":
            fs.release(handles.pop(0))
            handles.append(fs.open(f, rng.choice([os.O_RDWR, os.O_WRONLY])))
            if len(handles) < 3 and rng.random() < 0.5:
                handles.append(fs.open(f, os.O_RDWR))
        elif op == "o_trunc":
            handles.append(fs.open(f, os.O_RDWR | os.O_TRUNC))
            model = bytearray()
        elif op == "fsync":
            fs.call(fs.ops.fsync, handles[-1], False)
        else:
            for h in handles:
                fs.release(h)
            fs.stop()
            report = Fsck(fs.data).check()
            assert report.healthy, report.render()
            fs.start()
            handles = [fs.open(f, os.O_RDWR)]
        assert fs.getattr(f).st_size == len(model), step
    reader = fs.open(f, os.O_RDONLY)
    assert fs.read(reader, 0, len(model) + 1) == bytes(model)
    for h in handles + [reader]:
        fs.release(h)
    assert fs.ns.get_inode(f).size == len(model)
    assert all(rec.length <= BS for rec in fs.ns.get_blocks(f).values())


def test_a_crashed_daemon_leaves_nothing_the_next_start_does_not_repair(fs):
    """No shutdown (kill -9): the next mount.prepare recovers leases and purges orphans."""
    fh, f = fs.create(b"f")
    fs.write(fh, 0, b"a" * 1000)
    fs.write(fh, BS + 5, b"b" * 10)
    fh2, g = fs.create(b"g")
    fs.write(fh2, 0, b"orphan")
    fs.call(fs.ops.unlink, ROOT_INO, b"g", fs.ctx)
    orphan_blocks = fs.block_files(g)
    assert fs.ns.get_inode(f).size == 0  # the length lives in the daemon only
    assert set(fs.ns.leases()) == {f, g} and fs.ns.orphans() == [g]
    fs.stack.close()  # the process dies: lock released, nothing else done
    fs.start()
    assert fs.ns.leases() == {} and fs.ns.orphans() == []
    assert not orphan_blocks & fs.replica_files()
    assert fs.getattr(f).st_size == BS + 15
    fh = fs.open(f, os.O_RDONLY)
    assert fs.read(fh, 0, 2 * BS) == b"a" * 1000 + bytes(BS + 5 - 1000) + b"b" * 10
    fs.release(fh)


def test_readdir_resumes_after_dot(fs, readdir_buffer):
    d = fs.mkdir(b"d")
    fs.call(fs.ops.mknod, d, b"x", stat.S_IFREG | 0o644, 0, fs.ctx)
    first = readdir_buffer(fs, d, 0, capacity=1)
    assert [n for n, _, _ in first] == [b"."]
    rest = readdir_buffer(fs, d, first[0][2])
    assert [n for n, _, _ in rest] == [b"..", b"x"]


def _record_sync_replica(fs, monkeypatch) -> list[int]:
    """Block ids that fsync syncs by name (the replicas of blocks no longer open)."""
    synced = []
    for volume in fs.blockio.volumes:
        real = volume.sync_replica
        monkeypatch.setattr(volume, "sync_replica", lambda block_id, gs, real=real:
                            synced.append(block_id) or real(block_id, gs))
    return synced


def test_closed_files_unsynced_blocks_are_forgotten_once_a_syncfs_made_them_durable(
        fs, monkeypatch):
    """A file written and closed without fsync is remembered (a later open + fsync must
    sync what the closed handle wrote), about 300 bytes per file: ``cp -a`` of millions of
    files kept them all until each was unlinked. ``settle_unsynced`` syncs every volume's
    filesystem and then forgets the closed files it covered; an open file keeps its
    record, and a later fsync of a forgotten file has nothing left to sync."""
    inos = []
    for i in range(3):
        fh, ino = fs.create(f"f{i}".encode())
        fs.write(fh, 0, os.urandom(BS + 10))
        fs.release(fh)
        inos.append(ino)
    still_open = fs.open(inos[2], os.O_RDWR)
    assert set(fs.blockio.unsynced) == set(inos)
    assert fs.blockio.closed_unsynced_files() == 2
    syncs = []
    real_sync = fs.blockio.volumes.sync_filesystems
    monkeypatch.setattr(fs.blockio.volumes, "sync_filesystems",
                        lambda: syncs.append(1) or real_sync())
    assert fs.call(fs.blockio.settle_unsynced) == 2
    assert syncs == [1]
    assert set(fs.blockio.unsynced) == {inos[2]}
    assert fs.blockio.unsynced[inos[2]] == {0, 1}
    synced_by_name = _record_sync_replica(fs, monkeypatch)
    fh = fs.open(inos[0], os.O_RDONLY)
    fs.call(fs.ops.fsync, fh, False)
    fs.release(fh)
    assert synced_by_name == []
    fs.call(fs.ops.fsync, still_open, False)
    fs.release(still_open)
    assert fs.blockio.unsynced == {}
    assert fs.call(fs.blockio.settle_unsynced) == 0
    assert syncs == [1]  # nothing to settle: no syncfs


def test_a_failed_syncfs_stops_forgetting_for_the_rest_of_the_mount(fs, monkeypatch, caplog):
    """syncfs reports a write-back error once: had the next settle's syncfs succeeded and
    forgotten the blocks, a later fsync of their file would have succeeded although their
    data never reached the disk. So after one failure nothing is forgotten any more, the
    error is logged once, and fsync still syncs the closed file's blocks by name."""
    fh, ino = fs.create(b"f")
    fs.write(fh, 0, b"data")
    fs.release(fh)
    block_id = fs.ns.get_blocks(ino)[0].block_id
    syncs = []

    def failing_sync():
        syncs.append(1)
        raise FsError(errno.EIO, "cannot sync volume /v: Input/output error")

    monkeypatch.setattr(fs.blockio.volumes, "sync_filesystems", failing_sync)
    assert fs.call(fs.blockio.settle_unsynced) == 0
    assert fs.call(fs.blockio.settle_unsynced) == 0
    assert syncs == [1]
    assert fs.blockio.unsynced == {ino: {0}}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "stay remembered" in errors[0], errors
    caplog.clear()  # the one expected ERROR
    synced_by_name = _record_sync_replica(fs, monkeypatch)
    fh = fs.open(ino, os.O_RDONLY)
    fs.call(fs.ops.fsync, fh, False)
    fs.release(fh)
    assert synced_by_name == [block_id]


@pytest.mark.parametrize("errors, expected", [
    ((errno.ENOSPC, errno.ENOSPC), errno.ENOSPC),
    ((errno.ENOSPC, errno.EIO), errno.EIO),
])
def test_fsync_of_a_block_no_replica_could_sync_gives_enospc_only_when_all_were_full(
        replicated_fs, monkeypatch, caplog, errors, expected):
    """A block none of whose replicas synced fails the fsync: with ENOSPC when every
    replica's disk said it was full (the writer can free space and retry), else EIO. The
    block stays unsynced, so once the disks take it again the next fsync succeeds. The
    failure is injected where the kernel reports it, in the replica's fdatasync."""
    fs = replicated_fs
    fh, _ = fs.create(b"f")
    fs.write(fh, 0, b"x" * 5000)
    real_fsync = Replica.fsync
    failing = dict(zip(fs.blockio.volumes.by_id, errors))

    def fdatasync_fails(replica):
        code = failing[replica.volume.id]
        raise replica._os_error("fsync", OSError(code, os.strerror(code)))

    monkeypatch.setattr(Replica, "fsync", fdatasync_fails)
    assert fs.errno_of(fs.ops.fsync, fh, False) == expected
    assert fs.errno_of(fs.ops.fsync, fh, False) == expected  # still unsynced: tried again
    monkeypatch.setattr(Replica, "fsync", real_fsync)
    fs.call(fs.ops.fsync, fh, False)
    fs.release(fh)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 4 and all("fsync of inode" in m for m in logged), logged
    caplog.clear()  # the four expected ERRORs, one per replica and fsync


def _fsync_fails_on(monkeypatch, fs, ino: int, failing: set[tuple[int, str]]) -> None:
    """Replica.fsync fails for the replicas of the file's (block index, volume name)
    pairs in ``failing``."""
    real = Replica.fsync
    index_of = {rec.block_id: i for i, rec in fs.blockio.files[ino].blocks.items()}

    def fsync(replica):
        if (index_of.get(replica.block_id), replica.volume.path.name) in failing:
            raise FsError(errno.EIO, "injected fsync failure")
        real(replica)

    monkeypatch.setattr(Replica, "fsync", fsync)


def _b_over_a_with_d1_failing(fs, monkeypatch) -> tuple[int, int]:
    """A file with "A"s synced and "B"s written over them, whose next fsync fails on d1's
    replica: (handle, inode)."""
    fh, ino = fs.create(b"f")
    fs.write(fh, 0, b"A" * 5000)
    fs.call(fs.ops.fsync, fh, False)
    fs.write(fh, 0, b"B" * 5000)
    _fsync_fails_on(monkeypatch, fs, ino, {(0, "d1")})
    return fh, ino


def _set_gs_fails(replica, gs):
    raise FsError(errno.EIO, "injected: no new generation stamp")


def test_when_dropping_an_unsynced_replica_fails_every_block_stays_unsynced(
        replicated_fs, monkeypatch, caplog):
    """Block 0: d1 fails to sync and is to leave the block, but its survivor takes no new
    stamp; block 1: neither replica syncs. The fsync fails, both blocks stay unsynced for
    the next one, and the monitor is told of every failed replica (before: block 1 was
    forgotten, and the next fsync called it durable without syncing it). Found by
    review."""
    fs = replicated_fs
    fh, ino = fs.create(b"f")
    fs.write(fh, 0, b"x" * (BS + 5000))
    of = fs.blockio.files[ino]
    _fsync_fails_on(monkeypatch, fs, ino, {(0, "d1"), (1, "d1"), (1, "d2")})
    monkeypatch.setattr(Replica, "set_gs", _set_gs_fails)
    told = []
    monkeypatch.setattr(fs.blockio, "on_bad_replica",
                        lambda ino, index, volume_id, reason: told.append((index, volume_id)))
    assert fs.errno_of(fs.ops.fsync, fh, False) == errno.EIO
    assert of.unsynced == {0, 1}
    d1, d2 = (next(v.id for v in fs.blockio.volumes if v.path.name == name)
              for name in ("d1", "d2"))
    assert sorted(told) == [(0, d1), (1, d1), (1, d2)]  # the monitor hears of all three
    monkeypatch.undo()
    fs.call(fs.ops.fsync, fh, False)
    assert of.unsynced == set()
    fs.release(fh)
    caplog.clear()  # the injected failures' ERRORs


def test_a_replica_that_failed_to_sync_is_tried_again_after_its_drop_failed(
        replicated_fs, monkeypatch, caplog):
    """d1 fails to sync and d2 syncs but takes no new stamp: the fsync fails. The next
    fsync, with d1 still failing, must try d1 again and drop it, not succeed on d2 alone
    with d1 left in the block at the same stamp (before: d1 had been closed and
    forgotten). Found by review."""
    fs = replicated_fs
    fh, ino = _b_over_a_with_d1_failing(fs, monkeypatch)
    real_set_gs = Replica.set_gs
    monkeypatch.setattr(Replica, "set_gs", _set_gs_fails)
    assert fs.errno_of(fs.ops.fsync, fh, False) == errno.EIO
    monkeypatch.setattr(Replica, "set_gs", real_set_gs)
    d1 = next(v for v in fs.blockio.volumes if v.path.name == "d1")
    monkeypatch.setattr(d1, "sync_replica", lambda block_id, gs: (_ for _ in ()).throw(
        FsError(errno.EIO, "injected fsync failure")))  # d1 is closed now: synced by name
    fs.call(fs.ops.fsync, fh, False)
    assert d1.id not in fs.ns.get_blocks(ino)[0].volumes
    monkeypatch.undo()
    fs.release(fh)
    caplog.clear()


def test_a_new_stamp_the_namespace_could_not_record_is_taken_back(replicated_fs,
                                                                   monkeypatch):
    """A write session's first change re-stamps the replicas, then records the stamp. If
    that commit fails, the replicas go back to the stamp the namespace has: else the next
    open would take them for missing (stale) and drop them."""
    fs = replicated_fs
    fh, ino = fs.create(b"f")
    fs.write(fh, 0, b"A" * 5000)
    fs.release(fh)
    gs = fs.ns.get_blocks(ino)[0].gs

    def no_room(*args):
        raise FsError(errno.ENOSPC, "injected: the namespace's disk is full")

    monkeypatch.setattr(fs.ns, "set_block_gs", no_room)
    fh = fs.open(ino, os.O_RDWR)
    assert fs.errno_of(fs.ops.write, fh, 0, b"B" * 5000) == errno.ENOSPC
    fs.release(fh)
    monkeypatch.undo()
    assert {p.name for p in fs.data.rglob("blk_*.meta")} == {
        f"blk_{fs.ns.get_blocks(ino)[0].block_id}_{gs}.meta"}
    fh = fs.open(ino, os.O_RDWR)
    fs.write(fh, 0, b"C" * 5000)
    fs.release(fh)
    reader = fs.open(ino, os.O_RDONLY)
    assert fs.read(reader, 0, 5000) == b"C" * 5000
    fs.release(reader)
    assert len(fs.ns.get_blocks(ino)[0].volumes) == 2


def test_a_replica_whose_sync_error_was_reported_once_still_leaves_its_block(
        replicated_fs, monkeypatch, caplog):
    """Linux reports a write-back error to one fsync only. d1 fails to sync once, d2
    syncs but takes no new stamp, so d1's drop fails and the fsync fails. The retry syncs
    d1 by name without an error: d1, whose data never reached its disk, must still leave
    the block before that fsync returns success. Found by review."""
    fs = replicated_fs
    fh, ino = _b_over_a_with_d1_failing(fs, monkeypatch)
    monkeypatch.setattr(Replica, "set_gs", _set_gs_fails)
    assert fs.errno_of(fs.ops.fsync, fh, False) == errno.EIO
    monkeypatch.undo()  # the error is reported: a new fdatasync of d1 succeeds
    fs.call(fs.ops.fsync, fh, False)
    d1 = next(v.id for v in fs.blockio.volumes if v.path.name == "d1")
    assert d1 not in fs.ns.get_blocks(ino)[0].volumes
    fs.release(fh)
    caplog.clear()


def test_a_survivor_whose_new_stamp_failed_after_the_rename_is_kept(
        replicated_fs, monkeypatch, caplog):
    """d1 fails to sync, every time. d2 synced; its meta file is renamed to the new stamp,
    but the directory sync after the rename fails, so the drop fails. The meta file goes
    back to the stamp the namespace records, and the next fsync drops d1 and keeps d2
    (before: reopened at the old stamp, d2 was taken for missing and deleted, and the
    block carried on with d1 alone). Found by review."""
    fs = replicated_fs
    fh, ino = _b_over_a_with_d1_failing(fs, monkeypatch)
    d1, d2 = (next(v for v in fs.blockio.volumes if v.path.name == name)
              for name in ("d1", "d2"))
    monkeypatch.setattr(d1, "sync_replica", lambda block_id, gs: (_ for _ in ()).throw(
        FsError(errno.EIO, "injected fsync failure")))  # closed after the failure
    real_fsync_dir = type(d2)._fsync_dir
    failures = []

    def fsync_dir_fails_once(path):  # in Replica.set_gs, after the rename
        if not failures:
            failures.append(path)
            raise OSError(errno.EIO, "injected: directory sync after the rename failed")
        real_fsync_dir(d2, path)

    monkeypatch.setattr(d2, "_fsync_dir", fsync_dir_fails_once)
    assert fs.errno_of(fs.ops.fsync, fh, False) == errno.EIO and failures
    fs.call(fs.ops.fsync, fh, False)
    assert fs.ns.get_blocks(ino)[0].volumes == (d2.id,)
    monkeypatch.undo()
    fs.release(fh)
    reader = fs.open(ino, os.O_RDONLY)
    assert fs.read(reader, 0, 5000) == b"B" * 5000
    fs.release(reader)
    caplog.clear()


def test_a_copy_made_after_a_readers_fsync_restamped_the_block_is_not_kept_over_a_write(
        three_volume_fs, caplog, monkeypatch):
    """A read-only handle's fsync drops a replica that failed to sync and re-stamps the
    block, with no write session open. The monitor copies the block meanwhile (it waits
    only for writers), and a writer that opens during the copy must still take a stamp of
    its own, so that the copy, made from the data before the write, is stale (before: the
    copy was recorded at the same stamp, and a read served the old data). Found by
    review."""
    fs = three_volume_fs
    monitor = ReplicationMonitor(fs.ns, fs.blockio.volumes, fs.blockio, fs.ops.resolver)
    fh, ino = fs.create(b"f")
    fs.write(fh, 0, b"A" * 5000)
    fs.release(fh)  # unsynced, remembered: the reader's fsync syncs it by name
    reader = fs.open(ino, os.O_RDONLY)
    failing = fs.blockio.volumes.get(fs.blockio.files[ino].blocks[0].volumes[0])
    monkeypatch.setattr(failing, "sync_replica", lambda block_id, gs: (_ for _ in ()).throw(
        FsError(errno.EIO, "injected fsync failure")))
    fs.call(fs.ops.fsync, reader, False)
    monkeypatch.undo()
    assert failing.id not in fs.blockio.files[ino].blocks[0].volumes
    real_copy = replication.copy_replica
    writer = []

    def copy_then_a_write_lands(source, target, block_id, gs):
        copied = real_copy(source, target, block_id, gs)

        async def write():
            fi = await fs.ops.open(ino, os.O_WRONLY, fs.ctx)
            writer.append(fi.fh)
            await fs.ops.write(fi.fh, 0, b"B" * 5000)

        trio.from_thread.run(write)
        return copied

    monkeypatch.setattr(replication, "copy_replica", copy_then_a_write_lands)
    trio.run(monitor.round)
    monkeypatch.undo()
    fs.call(fs.ops.fsync, writer[0], False)
    fs.release(writer[0])
    fs.release(reader)
    rec = fs.ns.get_blocks(ino)[0]
    for volume_id in rec.volumes:
        replica = fs.blockio.volumes.get(volume_id).open_replica(rec.block_id, rec.gs,
                                                                 writable=False)
        try:
            assert bytes(replica.read(0, 1)) == b"B", f"volume {volume_id} serves old data"
        finally:
            replica.close()
    caplog.clear()  # the injected failure's ERROR


def test_a_survivor_that_takes_no_new_stamp_leaves_the_block_as_well(triple_fs, caplog,
                                                                      monkeypatch):
    """Replication 3: d1 fails to sync and leaves the block; of the survivors, d3's meta
    file takes no new stamp. d3 leaves as well and the block carries on with d2 alone
    at the new stamp (before: the fsync failed half-way, with d2 already re-stamped and
    the namespace still at the old stamp, so that d2 looked stale from then on)."""
    fs = triple_fs
    fh, ino = fs.create(b"f")
    fs.write(fh, 0, b"A" * 5000)
    fs.call(fs.ops.fsync, fh, False)
    fs.write(fh, 0, b"B" * 5000)
    gs = fs.ns.get_blocks(ino)[0].gs
    _fsync_fails_on(monkeypatch, fs, ino, {(0, "d1")})
    real_set_gs = Replica.set_gs
    monkeypatch.setattr(Replica, "set_gs", lambda replica, new_gs: (
        _set_gs_fails(replica, new_gs) if replica.volume.path.name == "d3"
        else real_set_gs(replica, new_gs)))
    fs.call(fs.ops.fsync, fh, False)
    monkeypatch.undo()
    rec = fs.ns.get_blocks(ino)[0]
    d2 = next(v.id for v in fs.blockio.volumes if v.path.name == "d2")
    assert rec.volumes == (d2,) and rec.gs > gs
    fs.release(fh)
    reader = fs.open(ino, os.O_RDONLY)
    assert fs.read(reader, 0, 5000) == b"B" * 5000
    fs.release(reader)
    caplog.clear()  # the injected failures' ERRORs


@pytest.mark.parametrize("fixture", ["fs", "replicated_fs"])
def test_a_write_restamping_a_block_while_fsync_syncs_it_by_name_fails_nothing(
        request, monkeypatch, fixture):
    """fsync syncs a closed file's blocks by their files' names in a worker thread; WRITE
    does not wait for it, and the first write to such a block gives it a new generation
    stamp, which renames its meta file. The sync by the old name then found no file: the
    fsync failed with EIO and the replica was reported bad (fsx found it under load, with
    msync and kernel writeback racing). Now it is synced again under its new stamp."""
    fs = request.getfixturevalue(fixture)
    fh, ino = fs.create(b"f")
    fs.write(fh, 0, b"a" * 3 * BS)
    fs.release(fh)
    reader = fs.open(ino, os.O_RDONLY)
    writer = fs.open(ino, os.O_WRONLY)
    stamps_before = {i: rec.gs for i, rec in fs.ns.get_blocks(ino).items()}
    raced = []
    for volume in fs.blockio.volumes:
        real = volume.sync_replica

        def sync_after_a_write(block_id, gs, real=real):
            if not raced:  # the kernel writes back a dirty page meanwhile
                raced.append(trio.from_thread.run(fs.ops.write, writer, BS + 10, b"new"))
            return real(block_id, gs)

        monkeypatch.setattr(volume, "sync_replica", sync_after_a_write)
    fs.call(fs.ops.fsync, reader, False)
    assert raced == [3]
    stamps_after = {i: rec.gs for i, rec in fs.ns.get_blocks(ino).items()}
    assert stamps_after[1] > stamps_before[1]  # the race did happen, on block 1
    fs.release(writer)
    fs.release(reader)
    fh = fs.open(ino, os.O_RDONLY)
    assert fs.read(fh, BS, 20) == b"a" * 10 + b"new" + b"a" * 7
    fs.release(fh)


def test_a_file_opened_while_the_syncfs_runs_keeps_its_unsynced_blocks(fs, monkeypatch):
    """The syncfs runs in a worker thread while requests go on. A closed file that is
    opened, written and closed again meanwhile has blocks the syncfs may have missed:
    its record must stay."""
    fh, ino = fs.create(b"f")
    fs.write(fh, 0, b"first")
    fs.release(fh)
    syncing, resume = threading.Event(), threading.Event()
    real_sync = fs.blockio.volumes.sync_filesystems

    def slow_sync():
        syncing.set()
        assert resume.wait(10)
        real_sync()

    monkeypatch.setattr(fs.blockio.volumes, "sync_filesystems", slow_sync)

    async def settle_while_rewriting():
        async with trio.open_nursery() as nursery:
            results = []

            async def settle():
                results.append(await fs.blockio.settle_unsynced())

            nursery.start_soon(settle)
            await trio.to_thread.run_sync(syncing.wait)
            handle = (await fs.ops.open(ino, os.O_RDWR, fs.ctx)).fh
            await fs.ops.write(handle, 0, b"again")
            await fs.ops.release(handle)
            resume.set()
        return results[0]

    assert trio.run(settle_while_rewriting) == 0
    assert fs.blockio.unsynced[ino] == {0}
    fh = fs.open(ino, os.O_RDONLY)
    assert fs.read(fh, 0, 10) == b"again"
    fs.release(fh)


def test_the_daemon_settles_unsynced_blocks_beyond_the_limit(fs, monkeypatch):
    """The daemon's settling task calls ``settle_unsynced`` once more closed files than
    UNSYNCED_FILES_MAX are remembered, and not before."""
    monkeypatch.setattr(serving, "TICK_SECONDS", 0.05)
    for i in range(3):
        fh, _ = fs.create(f"f{i}".encode())
        fs.write(fh, 0, b"x")
        fs.release(fh)

    async def settle_for_a_while():
        with trio.move_on_after(0.5):
            await serving.settle_unsynced(fs.blockio)

    monkeypatch.setattr(serving, "UNSYNCED_FILES_MAX", 3)
    trio.run(settle_for_a_while)
    assert len(fs.blockio.unsynced) == 3
    monkeypatch.setattr(serving, "UNSYNCED_FILES_MAX", 2)
    trio.run(settle_for_a_while)
    assert fs.blockio.unsynced == {}


def test_replication_walk_takes_only_what_was_noted_before_it(fs):
    """Notes that keep arriving while the monitor walks a big directory (setfattr or mv
    in a loop) wait for the next round, so the copies are not held off. Before: the walk
    started over for every new note, and never returned while they kept coming."""
    monitor = ReplicationMonitor(fs.ns, fs.blockio.volumes, fs.blockio, fs.ops.resolver)
    d = fs.mkdir(b"d")
    for i in range(600):
        fh, _ = fs.create(f"f{i}".encode(), parent=d)
        fs.release(fh)

    async def main() -> None:
        monitor.replication_may_change(d)

        async def keep_noting() -> None:
            while True:
                monitor.replication_may_change(d)
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_noting)
            with trio.fail_after(10):
                await monitor.walk_changed()
            nursery.cancel_scope.cancel()
        assert list(monitor.changed) == [d]     # for the next round

    trio.run(main)
