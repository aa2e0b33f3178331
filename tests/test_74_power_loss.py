"""Power loss: the namespace comes back as it was at its last sync, the volumes as they are.

A kill -9 (``test_70_crash.py``) loses nothing the kernel already has: LMDB's committed pages
are in the page cache. A power loss also loses the namespace's commits since its last sync
(fsync, syncfs, fsyncdir, the one-second tick), while what the daemon made durable itself
stays: renamed meta files (a new generation stamp), deleted replica files. Both must leave
a filesystem that the next mount makes whole on its own, with no acknowledged-then-synced
byte lost:

- a write session re-stamps a block (meta file renamed, durably) and its namespace records
  (the new GS, the lease) are lost: the replica is newer than the namespace, and is adopted;
- a truncate or an unlink drops whole blocks and the drop is lost: their files must still be
  there, so they are deleted only once the drop is on disk.

The power loss is simulated on the Operations layer (``tests/test_30_operations.py``): the
namespace file is copied after every sync, and the last copy is put back after the daemon's
objects are dropped without a shutdown. The fixture ends with fsck healthy and no ERROR
logged.
"""

from __future__ import annotations

import errno
import os

import pytest

from tests.test_30_operations import BS, FS, fs, replicated_fs  # noqa: F401 (fixtures)
from tierfs.backends.replica import Replica
from tierfs.fs.errors import FsError
from tierfs.fs.schema import ROOT_INO


def namespace_disk(fs: FS, monkeypatch) -> dict:
    """What the namespace's disk holds: the namespace file as of the last sync, taken from
    now on (every later sync of the daemon's replaces it)."""
    image = {}
    real_sync = fs.ns.sync

    def sync() -> None:
        real_sync()
        image["namespace"] = (fs.ns.path / "data.mdb").read_bytes()

    monkeypatch.setattr(fs.ns, "sync", sync)
    return image


@pytest.fixture
def disk(fs, monkeypatch) -> dict:
    return namespace_disk(fs, monkeypatch)


def power_loss(fs: FS, disk: dict) -> None:
    """Daemon and machine stop at once; the next mount finds the synced namespace."""
    fs.stack.close()  # no shutdown: nothing more is persisted, no lease closed
    fs.stack = None
    (fs.ns.path / "data.mdb").write_bytes(disk["namespace"])
    fs.start()


def write_file(fs: FS, name: bytes, payload: bytes) -> int:
    fh, ino = fs.create(name)
    assert fs.write(fh, 0, payload) == len(payload)
    fs.call(fs.ops.fsync, fh, False)
    fs.release(fh)
    fs.call(fs.blockio.sync_namespace)  # the tick: the closed lease is on disk too
    return ino


def read_file(fs: FS, ino: int, size: int) -> bytes:
    fh = fs.open(ino, os.O_RDONLY)
    try:
        return fs.read(fh, 0, size)
    finally:
        fs.release(fh)


def test_replica_restamped_by_a_write_session_whose_records_were_lost_is_adopted(fs, disk):
    payload = os.urandom(BS + 5000)
    ino = write_file(fs, b"f", payload)
    fh = fs.open(ino, os.O_WRONLY)
    fs.write(fh, 100, b"new bytes")  # new GS on the meta files, durably; not in the namespace
    power_loss(fs, disk)
    # before: the replica's GS was newer than the namespace's: "stale or missing", EIO
    expected = payload[:100] + b"new bytes" + payload[109:]
    assert read_file(fs, ino, 2 * BS) == expected
    assert fs.getattr(ino).st_size == len(payload)


def test_what_fdatasync_acknowledged_survives_a_power_loss(fs, disk):
    """An fdatasync that found the file's size and blocks already synced syncs only the
    replicas; one after an append, a new block or a new generation stamp syncs the
    namespace too (a new block's record lost would leave its replica an orphan). Either
    way the acknowledged bytes and size are there after the power loss."""
    payload = bytearray(os.urandom(BS + 5000))
    ino = write_file(fs, b"f", bytes(payload))
    fh = fs.open(ino, os.O_RDWR)
    for off, data in [(100, b"new GS"), (BS + 5000, os.urandom(BS)),  # into a new block
                      (7, b"in place"), (2 * BS + 20, b"in place, third block")]:
        fs.write(fh, off, data)
        fs.call(fs.ops.fsync, fh, True)
        payload[off:off + len(data)] = data
    power_loss(fs, disk)
    assert read_file(fs, ino, 3 * BS) == payload
    assert fs.getattr(ino).st_size == len(payload)


@pytest.mark.parametrize("datasync", [False, True], ids=["fsync", "fdatasync"])
def test_a_replica_that_failed_to_sync_is_not_served_after_a_power_loss(
        replicated_fs, monkeypatch, caplog, datasync):
    """An fsync succeeds while a block has a replica that synced. The one that did not may
    come back from a power loss with an older version, consistent with its checksums and
    at the same stamp: it must leave the block before the fsync returns (the survivor gets
    a new stamp), or it is taken for intact and, on the lower volume, read first (before:
    the acknowledged "B"s read back as "A"s). Found by review."""
    fs = replicated_fs
    disk = namespace_disk(fs, monkeypatch)
    old = os.urandom(BS // 2)
    ino = write_file(fs, b"f", old)
    fh = fs.open(ino, os.O_RDWR)
    fs.write(fh, 0, b"A" * 4096)  # a new write session: a new stamp on both replicas
    fs.call(fs.ops.fsync, fh, False)
    d1 = fs.data / "d1"
    d1_synced = {p: p.read_bytes() for p in d1.rglob("blk_*")}  # the "A" version
    assert d1_synced
    fs.write(fh, 0, b"B" * 4096)  # what the next fsync acknowledges
    real_fsync = Replica.fsync

    def d1_fails(replica):
        if replica.volume.path.name == "d1":
            raise FsError(errno.EIO, "injected: d1 lost the write-back")
        real_fsync(replica)

    monkeypatch.setattr(Replica, "fsync", d1_fails)
    fs.call(fs.ops.fsync, fh, datasync)  # d2 synced: success
    monkeypatch.setattr(Replica, "fsync", real_fsync)
    fs.stack.close()  # the power loss: d1 holds what it last synced, nothing later
    fs.stack = None
    (fs.ns.path / "data.mdb").write_bytes(disk["namespace"])
    for path in d1.rglob("blk_*"):
        path.unlink()
    for path, content in d1_synced.items():
        path.write_bytes(content)
    fs.start()
    assert read_file(fs, ino, BS)[:4096] == b"B" * 4096
    caplog.clear()  # the injected failure's ERRORs


@pytest.mark.parametrize("drop", ["truncate to a block boundary", "truncate to 0", "unlink"])
def test_blocks_dropped_by_a_change_a_power_loss_undid_are_still_there(fs, disk, drop):
    payload = os.urandom(2 * BS + 777)
    ino = write_file(fs, b"f", payload)
    if drop == "unlink":
        fs.call(fs.ops.unlink, ROOT_INO, b"f", fs.ctx)
        fs.forget(ino)  # purged: its blocks dropped
        assert fs.errno_of(fs.ops.getattr, ino, fs.ctx) == errno.ENOENT
    else:
        fs.truncate(ino, BS if drop == "truncate to a block boundary" else 0)
    power_loss(fs, disk)
    # before: the files were deleted right after the (lost) commit: EIO on every block
    assert fs.call(fs.ops.lookup, ROOT_INO, b"f", fs.ctx).st_ino == ino
    assert read_file(fs, ino, 3 * BS) == payload


def test_truncate_that_cuts_a_block_in_place_is_completed_after_a_power_loss(fs, disk):
    """The cut replica cannot be put back: the truncate's target is synced before the cut,
    so recovery finishes it (before: the old size, with zeros where the cut data was)."""
    payload = os.urandom(2 * BS + 777)
    ino = write_file(fs, b"f", payload)
    fs.truncate(ino, 10)
    power_loss(fs, disk)
    assert fs.getattr(ino).st_size == 10
    assert read_file(fs, ino, 3 * BS) == payload[:10]


def test_space_of_dropped_blocks_is_there_for_the_next_write_at_once(tmp_path):
    """Deleting dropped blocks only after the sync must not make a full volume refuse a
    write that the deletion makes room for: ``rm big; cp other big`` on a nearly full
    volume, or an O_TRUNC rewrite. The write syncs at once and frees them."""
    from tierfs.backends.storage_types import StorageType
    from tierfs.tools.mkfs import VolumeSpec, make_filesystem
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    mnt.mkdir()
    make_filesystem(data, [VolumeSpec(StorageType.DISK, data / "disk", 5 * BS)],
                    block_size=BS, bytes_per_checksum=4096)
    fs = FS(data, mnt)
    try:
        big = os.urandom(4 * BS)
        ino = write_file(fs, b"big", big)
        fs.call(fs.ops.unlink, ROOT_INO, b"big", fs.ctx)
        fs.forget(ino)
        ino = write_file(fs, b"again", big)  # before the tick: the old blocks still there
        fh = fs.open(ino, os.O_WRONLY | os.O_TRUNC)
        assert fs.write(fh, 0, big) == len(big)
        fs.release(fh)
        assert read_file(fs, ino, 5 * BS) == big
    finally:
        fs.stop()
