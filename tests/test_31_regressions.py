"""Regression tests for bugs found by the Operations-layer tests: journal records that
could not be read back, a partial ENOSPC write leaving blocks past EOF, and an xattr name
list that could grow past what listxattr can return."""
import argparse, errno, os, stat
import pyfuse3, trio
from tierfs import mount
from tierfs.backends.storage_types import StorageType
from tierfs.fs import schema
from tierfs.fs.namespace import Namespace
from tierfs.fs.schema import BlockRecord, ROOT_INO
from tierfs.tools.fsck import Fsck
from tierfs.tools.mkfs import VolumeSpec, make_filesystem


class Ctx:
    uid, gid, pid, umask = os.getuid(), os.getgid(), os.getpid(), 0o022


def test_journal_record_of_persist_file_can_be_read_back(tmp_path):
    make_filesystem(tmp_path / "d")
    ns = Namespace.open(tmp_path / "d" / "namespace")
    f = ns.make_node(ROOT_INO, b"f", stat.S_IFREG | 0o644, 0, 0, 0, 1).ino
    rec = BlockRecord(ns.reserve("next_block_id"), ns.reserve("gs"), 10, (1,))
    ns.add_block(f, 0, rec)
    ns.persist_file(f, size=10, mtime_ns=1, ctime_ns=1, atime_ns=1, blocks={0: rec})
    with ns.env.begin() as txn:
        raw = txn.get(schema.u64(ns.last_txid()), db=ns.db["journal"])
    record = schema.parse_journal_record(raw)  # ValueError: int is not allowed for map key
    assert record[0] == schema.Op.UPDATE_BLOCKS


def test_write_that_runs_out_of_space_leaves_a_consistent_file(tmp_path):
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    mnt.mkdir()
    make_filesystem(data, [VolumeSpec(StorageType.DISK, data / "disk", 96 << 10)],
                    block_size=64 << 10, bytes_per_checksum=4096)
    stack, ops, blockio, ns = mount.prepare(argparse.Namespace(data=str(data),
                                                               mountpoint=str(mnt)))
    run = lambda fn, *a: trio.run(lambda: fn(*a))
    fi, entry = run(ops.create, ROOT_INO, b"f", 0o644, os.O_RDWR, Ctx())
    try:
        written = run(ops.write, fi.fh, 0, b"x" * (100 << 10))
    except pyfuse3.FUSEError as exc:
        assert exc.errno == errno.ENOSPC
        written = 0
    size = run(ops.getattr, entry.st_ino, Ctx()).st_size
    run(ops.release, fi.fh)
    mount.shutdown(ops, blockio, ns)
    stack.close()
    # either a short write (POSIX) with the size covering it, or nothing written at all
    assert size == written
    report = Fsck(data).check()
    assert report.healthy, report.render()  # BLOCK_PAST_EOF: size 0, blocks reach 65536


def test_setxattr_refuses_names_that_would_make_listxattr_fail(tmp_path):
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    mnt.mkdir()
    make_filesystem(data)
    stack, ops, blockio, ns = mount.prepare(argparse.Namespace(data=str(data),
                                                               mountpoint=str(mnt)))
    run = lambda fn, *a: trio.run(lambda: fn(*a))
    fi, entry = run(ops.create, ROOT_INO, b"f", 0o644, os.O_RDWR, Ctx())
    run(ops.release, fi.fh)
    try:
        for i in range(300):  # 300 names of 255 bytes: 76,800 bytes of names
            try:
                run(ops.setxattr, entry.st_ino, b"user.%05d" % i + b"x" * 245, b"", Ctx())
            except pyfuse3.FUSEError as exc:
                assert exc.errno in (errno.ENOSPC, errno.E2BIG)
                break
        names = run(ops.listxattr, entry.st_ino, Ctx())  # E2BIG for ever
        assert names
    finally:
        mount.shutdown(ops, blockio, ns)
        stack.close()



def _read_held_in_a_worker_thread(tmp_path, monkeypatch, before_read, after_read):
    """Write one 64 KiB block, then read it through a worker thread that is held twice (the
    slow disk is injected): ``before_read(ops, blockio, of, fh)`` runs before the thread
    reads the replica, ``after_read`` after it has read and before it returns. Returns the
    block as written, the read's result and the replicas reported bad; ends with fsck."""
    import threading
    from tierfs.fs import blockio as blockio_module
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    mnt.mkdir()
    make_filesystem(data, [VolumeSpec(StorageType.DISK, data / "disk")],
                    block_size=64 << 10, bytes_per_checksum=4096)
    stack, ops, blockio, ns = mount.prepare(argparse.Namespace(data=str(data),
                                                               mountpoint=str(mnt)))
    written = os.urandom(64 << 10)
    may_read, has_read, may_return = threading.Event(), threading.Event(), threading.Event()
    real_execute_read = blockio_module._execute_read

    def slow_disk(plan, ino, bad, short, nowait=False):
        if nowait:
            return None  # not in the page cache: the read goes to a worker thread
        may_read.wait()
        try:
            return real_execute_read(plan, ino, bad, short)
        finally:
            has_read.set()
            may_return.wait()

    bad_reports = []
    blockio.on_bad_replica = lambda *report: bad_reports.append(report)

    async def scenario():
        fi, _ = await ops.create(ROOT_INO, b"f", 0o644, os.O_RDWR, Ctx())
        await ops.write(fi.fh, 0, written)
        of = ops.handles[fi.fh].of
        monkeypatch.setattr(blockio_module, "_execute_read", slow_disk)
        result = {}
        async with trio.open_nursery() as nursery:
            async def read():
                result["data"] = await ops.read(fi.fh, 0, 64 << 10)
            nursery.start_soon(read)
            try:
                await trio.sleep(0.05)
                await before_read(ops, blockio, of, fi.fh)
                may_read.set()
                await trio.to_thread.run_sync(has_read.wait)
                await after_read(ops, blockio, of, fi.fh)
                monkeypatch.setattr(blockio_module, "_execute_read", real_execute_read)
            finally:  # a failure here must not leave the thread (and the test) waiting
                may_read.set()
                may_return.set()
        await ops.release(fi.fh)
        return result["data"]

    try:
        got = trio.run(scenario)
    finally:
        mount.shutdown(ops, blockio, ns)
        stack.close()
    report = Fsck(data).check()
    assert report.healthy, report.render()
    return written, got, bad_reports


async def _nothing(ops, blockio, of, fh):
    pass


def test_read_racing_a_truncate_and_regrow_plans_again_instead_of_failing(tmp_path,
                                                                          monkeypatch):
    """A read that a worker thread serves from a replica the file was cut short under, and
    that returns only after the file grew back, must plan again: before, it compared the
    (regrown) block length with its plan, took the short replica for damage, answered EIO
    (FUSEError) and reported a healthy replica as bad."""
    regrown = os.urandom(64 << 10)

    async def cut(ops, blockio, of, fh):
        await blockio.truncate(of, 100)  # the replica is cut to 100 bytes in place

    async def regrow(ops, blockio, of, fh):
        await ops.write(fh, 0, regrown)

    _, got, bad = _read_held_in_a_worker_thread(tmp_path, monkeypatch, cut, regrow)
    assert got == regrown
    assert bad == []


def test_replica_dropped_by_a_truncate_stays_open_for_the_thread_reading_it(tmp_path,
                                                                             monkeypatch):
    """A truncate to 0 drops the block and closes its replicas at once (no descriptor
    leak), but not one a worker thread is still reading: the read must not meet a closed
    descriptor (EIO) or, worse, its number reused by another file."""

    async def drop(ops, blockio, of, fh):
        await blockio.truncate(of, 0)
        assert of.retired, "a retired replica that a thread still reads must stay open"

    written, got, bad = _read_held_in_a_worker_thread(tmp_path, monkeypatch, drop, _nothing)
    assert got == written  # the read began before the truncate: the old bytes, whole
    assert bad == []
