"""``tierfs fsck``: real filesystems, written through real mounts, damaged on purpose.

Two filesystems are made once per module with ``tierfs mkfs`` and filled through a real
``mount.tierfs``: a plain one (default layout, replication 1) and a replicated one (two DISK
volumes, replication 2). Each test damages a private copy of one of them (volume files
directly, or the namespace with the ``lmdb`` module), then checks that fsck reports exactly
that problem (exit 1), that ``--repair`` fixes it (exit 1: problems were found) and that a
second fsck exits 0. Most runs call the CLI entry point in-process (the same code as the
console script, without a Python start-up per run); the exit-code, output-format and
mounted cases run the installed ``tierfs`` in a subprocess and check that no traceback
reaches stderr.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path

import lmdb
import pytest

from tierfs.backends.volume_set import VolumeSet
from tierfs.fs import schema
from tierfs.fs.mountlock import MountLock
from tierfs.fs.namespace import Namespace
from tierfs.fs.schema import ROOT_INO, BlockRecord, Inode, u64
from tierfs.tools import cli
from tierfs.tools.fsck import Fsck, Progress

from tests.conftest import Mount, run_tool

KIND = re.compile(r"^([A-Z][A-Z_]+): ", re.MULTILINE)
BIG = os.urandom(2_500_000)      # three 1 MiB blocks, the last one partial
SUMMARY_LABELS = ("Status", "Total size", "Total dirs", "Total files", "Total symlinks",
                  "Total blocks (validated)", "Minimally replicated blocks",
                  "Over-replicated blocks", "Under-replicated blocks", "Mis-placed blocks",
                  "Corrupt blocks", "Missing replicas",
                  "Orphan replicas", "Default replication factor",
                  "Average block replication", "Number of volumes")


# --------------------------------------------------------------------------- templates


def _make_template(base: Path, mkfs_args: list[str], populate) -> Path:
    data = base / "data"
    run_tool("mkfs", str(data), "--block-size", "1M", *mkfs_args)
    mount = Mount(data, base / "mnt").start()
    try:
        populate(mount.mountpoint)
    finally:
        mount.stop()
    assert not mount.errors_logged(), mount.log_text()
    return data


def _populate_plain(mnt: Path) -> None:
    (mnt / "d" / "sub").mkdir(parents=True)
    (mnt / "d" / "f").write_bytes(b"hello\n")
    (mnt / "d" / "empty").touch()
    os.link(mnt / "d" / "f", mnt / "h")
    os.symlink("d/f", mnt / "s")
    (mnt / "big").write_bytes(BIG)
    (mnt / "x").write_bytes(b"x" * 10_000)


def _populate_replicated(mnt: Path) -> None:
    (mnt / "f").write_bytes(BIG)
    (mnt / "g").write_bytes(b"g" * 5000)


@pytest.fixture(scope="module")
def plain_template(tmp_path_factory) -> Path:
    return _make_template(tmp_path_factory.mktemp("plain"), [], _populate_plain)


@pytest.fixture(scope="module")
def replicated_template(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("replicated")
    volumes = [f"--volume={t}:{base / 'data' / n}" for t, n in
               (("DISK", "d1"), ("DISK", "d2"), ("SSD", "s1"))]
    return _make_template(base, ["--replication", "2", *volumes], _populate_replicated)


@pytest.fixture
def plain(plain_template, tmp_path) -> Path:
    return Path(shutil.copytree(plain_template, tmp_path / "data", symlinks=True))


@pytest.fixture
def replicated(replicated_template, tmp_path) -> Path:
    return Path(shutil.copytree(replicated_template, tmp_path / "data", symlinks=True))


# --------------------------------------------------------------------------- helpers


def fsck(data: Path, *args: str, capsys) -> tuple[int, str, str]:
    """``tierfs fsck DATA ARGS`` through the CLI entry point, in this process."""
    capsys.readouterr()
    code = cli.main(["fsck", str(data), *args])
    out, err = capsys.readouterr()
    return code, out, err


def fsck_process(data: Path, *args: str):
    """``tierfs fsck`` as a user runs it; never a traceback."""
    result = run_tool("fsck", str(data), *args, check=False)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def kinds(out: str) -> set[str]:
    return set(KIND.findall(out)) - {"NOTE"}


def assert_repairs(data: Path, expected: set[str], capsys) -> str:
    """fsck finds exactly ``expected`` (exit 1), --repair fixes all (exit 1, as
    documented: problems were found), a second fsck exits 0. Returns the repair output."""
    code, out, _ = fsck(data, capsys=capsys)
    assert (code, kinds(out)) == (1, expected), out
    assert "Status: CORRUPT" in out and out.rstrip().endswith("is CORRUPT")
    code, repaired, _ = fsck(data, "--repair", capsys=capsys)
    assert code == 1, repaired
    assert "not repaired" not in repaired, repaired
    assert repaired.rstrip().endswith("is HEALTHY"), repaired
    code, out, _ = fsck(data, capsys=capsys)
    assert code == 0, out
    assert kinds(out) == set() and out.rstrip().endswith("is HEALTHY")
    return repaired


def assert_recovers(data: Path, expected: set[str], capsys) -> str:
    """What a daemon that did not stop cleanly leaves: fsck lists exactly ``expected`` and
    says the next mount recovers it, but the filesystem is HEALTHY (exit 0); --repair does
    the recovery now (exit 0) and a second fsck finds nothing. Returns the repair output."""
    code, out, _ = fsck(data, capsys=capsys)
    assert (code, kinds(out)) == (0, expected), out
    found = len(KIND.findall(out)) - out.count("NOTE:")
    assert "NOTE: the daemon did not stop cleanly: the next mount completes its recovery" in out
    assert "Status: HEALTHY" in out and out.rstrip().endswith("is HEALTHY"), out
    code, repaired, _ = fsck(data, "--repair", capsys=capsys)
    assert code == 0, repaired
    assert f"Repaired {found} of {found} problems; 0 left." in repaired
    assert "not repaired" not in repaired and repaired.rstrip().endswith("is HEALTHY"), repaired
    code, out, _ = fsck(data, capsys=capsys)
    assert (code, kinds(out)) == (0, set()), out
    assert "did not stop cleanly" not in out
    return repaired


def inode_at(data: Path, path: str) -> Inode:
    ns = Namespace.open(data / "namespace", readonly=True)
    try:
        ino = ROOT_INO
        for part in [p for p in path.split("/") if p]:
            ino = ns.lookup(ino, part.encode()).ino
        return ns.get_inode(ino)
    finally:
        ns.close()


def blocks_at(data: Path, path: str) -> dict:
    ino = inode_at(data, path).ino
    ns = Namespace.open(data / "namespace", readonly=True)
    try:
        return ns.get_blocks(ino)
    finally:
        ns.close()


def replica_files(volume: Path, block_id: int) -> tuple[Path, Path]:
    """(data file, meta file) of a block on a volume directory."""
    data = next(volume.rglob(f"blk_{block_id}"))
    meta = next(volume.rglob(f"blk_{block_id}_*.meta"))
    return data, meta


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@contextmanager
def namespace_rows(data: Path):
    """A raw LMDB write transaction on the namespace: ``db(name)`` opens a database."""
    env = lmdb.open(str(data / "namespace"), max_dbs=len(schema.DATABASES) + 2,
                    map_size=1 << 30, subdir=True)
    try:
        with env.begin(write=True) as txn:
            yield (lambda name: env.open_db(name.encode(), txn=txn)), txn
    finally:
        env.close()


def rewrite_inode(data: Path, path: str, **fields) -> Inode:
    inode = inode_at(data, path)
    for name, value in fields.items():
        setattr(inode, name, value)
    with namespace_rows(data) as (db, txn):
        txn.put(u64(inode.ino), inode.pack(), db=db("inodes"))
    return inode


# --------------------------------------------------------------------------- healthy


def test_healthy_filesystem_summary(plain):
    result = fsck_process(plain)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    for label in SUMMARY_LABELS:
        assert any(line.strip().startswith(label + ":") for line in lines), label
    assert "Status: HEALTHY" in lines
    assert lines[-1] == "The filesystem under path '/' is HEALTHY"
    stats = dict(line.strip().split(":\t", 1) for line in lines if ":\t" in line)
    assert stats["Total dirs"] == "3"            # /, /d, /d/sub
    assert stats["Total files"] == "4"           # /d/f (also /h), /d/empty, /big, /x
    assert stats["Total symlinks"] == "1"
    assert stats["Total size"] == f"{6 + len(BIG) + 10_000} B"
    assert stats["Total blocks (validated)"].startswith("5 ")
    assert stats["Corrupt blocks"] == "0" and stats["Orphan replicas"] == "0"
    assert stats["Number of volumes"] == "3"
    assert kinds(result.stdout) == set()


def test_library_check_and_repair_of_healthy_filesystem(plain):
    report = Fsck(plain).check()
    assert report.healthy and not report.mounted
    assert (report.stats.files, report.stats.blocks, report.stats.corrupt_blocks) == (4, 5, 0)
    result = Fsck(plain).repair()
    assert result.exit_code == 0 and result.after.healthy and not result.problems


def test_files_blocks_locations_listing(replicated, replicated_template):
    volumes = {p.name: p for p in (replicated / "d1", replicated / "d2")}
    files = fsck_process(replicated, "--files").stdout
    assert re.search(r"^/f 2500000 bytes, replication=2, 3 block\(s\):  OK$", files, re.M)
    assert re.search(r"^/g 5000 bytes, replication=2, 1 block\(s\):  OK$", files, re.M)
    assert "blk_" not in files
    blocks = fsck_process(replicated, "--files", "--blocks").stdout
    block_lines = re.findall(r"^(\d+)\. blk_(\d+)_(\d+) len=(\d+) Live_repl=(\d+)$", blocks,
                             re.M)
    assert [(i, n, r) for i, _, _, n, r in block_lines] == [
        ("0", "1048576", "2"), ("1", "1048576", "2"), ("2", "402848", "2"), ("0", "5000", "2")]
    located = fsck_process(replicated, "--files", "--blocks", "--locations").stdout
    replica = re.compile(r"\[([^,\]]+),([0-9a-f-]{36}),([A-Z_]+)\]")
    for line in located.splitlines():
        if re.match(r"^\d+\. blk_", line):
            found = replica.findall(line)
            assert {Path(p).name for p, _, _ in found} == set(volumes), line
            assert {t for _, _, t in found} == {"DISK"}
            assert all(Path(p).is_absolute() for p, _, _ in found)


def test_path_limits_the_file_checks(plain, capsys):
    code, out, _ = fsck(plain, "/d", "--files", capsys=capsys)
    assert code == 0
    assert re.search(r"^/d/f 6 bytes", out, re.M) and "/big" not in out
    assert out.rstrip().endswith("The filesystem under path '/d' is HEALTHY")
    code, out, _ = fsck(plain, "/d/f", "--files", "--blocks", capsys=capsys)
    assert code == 0 and re.search(r"^0\. blk_\d+_\d+ len=6 Live_repl=1$", out, re.M)
    flip_byte(replica_files(plain / "disk", blocks_at(plain, "/big")[0].block_id)[0], 5)
    assert fsck(plain, "/d", capsys=capsys)[0] == 0      # damage outside the subtree
    assert fsck(plain, "/big", capsys=capsys)[0] == 1


# --------------------------------------------------------------------------- volumes


def test_flipped_byte_dropped_when_another_replica_is_good(replicated, capsys):
    rec = blocks_at(replicated, "/f")[1]
    data_file, meta_file = replica_files(replicated / "d1", rec.block_id)
    flip_byte(data_file, 3 * 4096 + 17)
    code, out, _ = fsck(replicated, capsys=capsys)
    assert re.search(rf"CORRUPT_REPLICA: /f: replica blk_{rec.block_id}_{rec.gs} on "
                     rf"{re.escape(str(replicated / 'd1'))}: checksum mismatch in "
                     r"chunk\(s\) 3$", out, re.M), out
    assert f"/f: Under replicated blk_{rec.block_id}_{rec.gs} (block 1). Target Replicas " \
           "is 2 but found 1 live persistent replica(s)." in out
    repaired = assert_repairs(replicated, {"CORRUPT_REPLICA"}, capsys)
    assert "[repaired: replica dropped, files deleted]" in repaired
    # d1 is the only other DISK volume: the block is copied back there from d2.
    assert f"[repaired: 1 replica(s) added on {replicated / 'd1'} (DISK)]" in repaired
    assert blocks_at(replicated, "/f")[1].volumes == (2, 1)
    assert data_file.read_bytes() == replica_files(replicated / "d2", rec.block_id)[0] \
        .read_bytes() == BIG[1 << 20:2 << 20]
    code, out, _ = fsck(replicated, capsys=capsys)
    assert "Under-replicated blocks:\t0 " in out


def test_flipped_byte_in_only_replica_is_a_lost_block(plain, capsys):
    rec = blocks_at(plain, "/x")[0]
    data_file, _ = replica_files(plain / "disk", rec.block_id)
    flip_byte(data_file, 9000)
    code, out, _ = fsck(plain, capsys=capsys)
    assert (code, kinds(out)) == (1, {"CORRUPT_REPLICA", "LOST_BLOCK"}), out
    assert "chunk(s) 2 (no other good replica: kept)" in out
    assert "Corrupt blocks:\t1" in out
    code, out, _ = fsck(plain, "--repair", capsys=capsys)
    assert code == 1 and out.rstrip().endswith("is CORRUPT")
    assert data_file.exists()                              # nothing salvageable destroyed
    assert blocks_at(plain, "/x")[0] == rec                # reads give EIO, record kept
    code, out, _ = fsck(plain, capsys=capsys)
    assert (code, kinds(out)) == (1, {"CORRUPT_REPLICA", "LOST_BLOCK"})


@pytest.mark.parametrize("which", ["data", "meta"])
def test_missing_replica_file(replicated, which, capsys):
    rec = blocks_at(replicated, "/g")[0]
    data_file, meta_file = replica_files(replicated / "d2", rec.block_id)
    (data_file if which == "data" else meta_file).unlink()
    code, out, _ = fsck(replicated, capsys=capsys)
    assert f"{which} file missing" in out and "Missing replicas:\t1 " in out
    assert f"Under replicated blk_{rec.block_id}_{rec.gs}" in out
    repaired = assert_repairs(replicated, {"MISSING_REPLICA"}, capsys)
    # Dropped, then copied back from d1: d2 is the only other DISK volume.
    assert f"1 replica(s) added on {replicated / 'd2'} (DISK)" in repaired
    assert blocks_at(replicated, "/g")[0].volumes == (1, 2)
    assert data_file.read_bytes() == b"g" * 5000 and meta_file.exists()


def test_stray_block_file_is_an_orphan_replica(plain, capsys):
    leaf = replica_files(plain / "disk", blocks_at(plain, "/x")[0].block_id)[0].parent
    stray = [leaf / "blk_1073742000", leaf / "blk_1073742000_1500.meta"]
    for path in stray:
        path.write_bytes(b"junk")
    code, out, _ = fsck(plain, capsys=capsys)
    assert "blk_1073742000: unknown block" in out and "Orphan replicas:\t1" in out
    assert_repairs(plain, {"ORPHAN_REPLICA"}, capsys)
    assert not any(p.exists() for p in stray)


def copy_replica_files(source: Path, target: Path, block_id: int) -> tuple[Path, Path]:
    """Copy a block's replica files from one volume directory to the same place on another,
    as a copy whose recording was lost leaves them; returns the copies (data, meta)."""
    copies = []
    for path in replica_files(source, block_id):
        copy = target / path.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, copy)
        copies.append(copy)
    return copies[0], copies[1]


def forget_replica(data: Path, path: str, volume_id: int) -> None:
    """Remove one volume from a block's record and the replicas index, leaving its files:
    what a copy whose recording a crash lost looks like."""
    ino = inode_at(data, path).ino
    with namespace_rows(data) as (db, txn):
        key = schema.block_key(ino, 0)
        rec = BlockRecord.unpack(txn.get(key, db=db("blocks")))
        rec.volumes = tuple(v for v in rec.volumes if v != volume_id)
        txn.put(key, rec.pack(), db=db("blocks"))
        txn.delete(schema.replica_key(volume_id, rec.block_id), db=db("replicas"))


def test_whole_replica_the_block_needs_is_recorded(replicated, capsys):
    """Before: called an orphan (CORRUPT) and deleted by --repair, as by the next mount,
    and then copied again."""
    rec = blocks_at(replicated, "/g")[0]
    assert rec.volumes == (1, 2)
    forget_replica(replicated, "/g", 2)
    code, out, _ = fsck(replicated, capsys=capsys)
    assert (code, kinds(out)) == (0, {"UNRECORDED_REPLICA"}), out
    assert (f"blk_{rec.block_id}_{rec.gs}: a whole replica the namespace does not record on "
            "this volume, which the block needs: the next mount records it") in out
    assert "Orphan replicas:\t0" in out and out.rstrip().endswith("is HEALTHY")
    code, repaired, _ = fsck(replicated, "--repair", capsys=capsys)
    assert code == 0 and "not repaired" not in repaired, repaired
    assert f"recorded as a replica on {replicated / 'd2'}" in repaired
    assert blocks_at(replicated, "/g")[0] == rec
    assert not list((replicated / "s1").rglob("blk_*"))      # no needless copy
    code, out, _ = fsck(replicated, capsys=capsys)
    assert (code, kinds(out)) == (0, set()), out


def test_surplus_copy_on_a_volume_the_block_is_not_recorded_on(replicated, capsys):
    """Both recorded replicas are good: a third, unrecorded copy (an excess replica whose
    deletion a power loss undid) is an orphan, as the mount would delete it."""
    rec = blocks_at(replicated, "/g")[0]
    copy_replica_files(replicated / "d1", replicated / "s1", rec.block_id)
    code, out, _ = fsck(replicated, capsys=capsys)
    assert f"blk_{rec.block_id}: not recorded on this volume" in out
    assert_repairs(replicated, {"ORPHAN_REPLICA"}, capsys)
    assert not list((replicated / "s1").rglob("blk_*"))
    assert blocks_at(replicated, "/g")[0] == rec


def test_damaged_copy_on_a_volume_the_block_is_not_recorded_on(replicated, capsys):
    rec = blocks_at(replicated, "/g")[0]
    forget_replica(replicated, "/g", 2)
    flip_byte(replica_files(replicated / "d2", rec.block_id)[0], 100)
    code, out, _ = fsck(replicated, capsys=capsys)
    assert f"blk_{rec.block_id}: not recorded on this volume" in out
    assert_repairs(replicated, {"ORPHAN_REPLICA"}, capsys)
    assert len(blocks_at(replicated, "/g")[0].volumes) == 2     # copied again from d1


def test_unrecorded_copy_replaces_a_corrupt_only_replica(plain, capsys):
    """The recorded replica is corrupt and the only good copy is one the namespace does not
    record: --repair records the copy, then drops the corrupt replica. Before: the copy
    was deleted as an orphan and the block lost."""
    rec = blocks_at(plain, "/x")[0]
    data_file, _ = replica_files(plain / "disk", rec.block_id)
    copy, _ = copy_replica_files(plain / "disk", plain / "archive", rec.block_id)
    flip_byte(data_file, 9000)
    code, out, _ = fsck(plain, capsys=capsys)
    assert code == 1
    assert kinds(out) == {"CORRUPT_REPLICA", "LOST_BLOCK", "UNRECORDED_REPLICA"}, out
    code, repaired, _ = fsck(plain, "--repair", capsys=capsys)
    assert code == 1 and "not repaired" not in repaired, repaired
    assert repaired.rstrip().endswith("is HEALTHY"), repaired
    (now,) = blocks_at(plain, "/x")[0].volumes
    assert now != rec.volumes[0] and not data_file.exists()
    assert copy.read_bytes() == b"x" * 10_000
    code, out, _ = fsck(plain, capsys=capsys)
    assert (code, kinds(out)) == (0, set()), out


def test_stale_meta_file_beside_a_good_replica(plain, capsys):
    rec = blocks_at(plain, "/x")[0]
    data_file, meta_file = replica_files(plain / "disk", rec.block_id)
    stale = meta_file.with_name(f"blk_{rec.block_id}_{rec.gs - 1}.meta")
    shutil.copy(meta_file, stale)
    code, out, _ = fsck(plain, capsys=capsys)
    assert f"generation stamp {rec.gs - 1}, the namespace has {rec.gs}" in out
    assert_repairs(plain, {"STALE_META"}, capsys)
    assert not stale.exists() and data_file.exists() and meta_file.exists()


def test_stale_replica_dropped_when_another_is_current(replicated, capsys):
    rec = blocks_at(replicated, "/g")[0]
    _, meta_file = replica_files(replicated / "d2", rec.block_id)
    meta_file.rename(meta_file.with_name(f"blk_{rec.block_id}_{rec.gs - 1}.meta"))
    code, out, _ = fsck(replicated, capsys=capsys)
    assert f"generation stamp {rec.gs - 1} is older than the namespace's {rec.gs}" in out
    assert_repairs(replicated, {"STALE_REPLICA"}, capsys)


def test_newer_replica_without_a_lease(replicated, capsys):
    rec = blocks_at(replicated, "/g")[0]
    _, meta_file = replica_files(replicated / "d2", rec.block_id)
    meta_file.rename(meta_file.with_name(f"blk_{rec.block_id}_{rec.gs + 1}.meta"))
    code, out, _ = fsck(replicated, capsys=capsys)
    assert f"generation stamp {rec.gs + 1} is newer than the namespace's {rec.gs}" in out
    assert_repairs(replicated, {"NEWER_REPLICA"}, capsys)


def test_replica_files_outside_their_layout_directory(replicated, capsys):
    rec = blocks_at(replicated, "/g")[0]
    elsewhere = replicated / "d1" / "current" / "finalized" / "subdir9" / "subdir9"
    elsewhere.mkdir(parents=True)
    for path in replica_files(replicated / "d1", rec.block_id):
        path.rename(elsewhere / path.name)
    code, out, _ = fsck(replicated, capsys=capsys)
    assert "is outside its layout directory" in out and "Orphan replicas:\t2" in out
    assert_repairs(replicated, {"ORPHAN_REPLICA", "MISSING_REPLICA"}, capsys)
    assert not list(elsewhere.iterdir())


def test_short_replica_has_wrong_length(replicated, capsys):
    rec = blocks_at(replicated, "/f")[0]
    data_file, _ = replica_files(replicated / "d2", rec.block_id)
    os.truncate(data_file, rec.length - 4096)
    code, out, _ = fsck(replicated, capsys=capsys)
    assert "but its checksums cover 256 chunks" in out
    assert_repairs(replicated, {"WRONG_LENGTH"}, capsys)


def test_long_replica_is_cut_to_the_recorded_length(plain, capsys):
    rec = blocks_at(plain, "/x")[0]
    ns = Namespace.open(plain / "namespace", readonly=True)
    try:
        volume = VolumeSet.open(plain, ns.config.fs_uuid, ns.config.volumes).get(2)
    finally:
        ns.close()
    with volume.open_replica(rec.block_id, rec.gs, writable=True) as replica:
        replica.write(rec.length, b"never acknowledged")
    code, out, _ = fsck(plain, capsys=capsys)
    assert f"data file is {rec.length + 18} bytes, the block is {rec.length}" in out
    repaired = assert_repairs(plain, {"WRONG_LENGTH"}, capsys)
    assert f"replica cut to {rec.length} bytes" in repaired
    assert volume.data_path(rec.block_id).stat().st_size == rec.length


def test_tmp_leftover(plain, capsys):
    (plain / "ssd" / "tmp" / "blk_99.copy").write_bytes(b"half a move")
    assert_repairs(plain, {"TMP_LEFTOVER"}, capsys)
    assert not list((plain / "ssd" / "tmp").iterdir())


def test_what_a_crash_leaves_on_the_volumes(plain, tmp_path, capsys):
    """After an unclean stop, a half-done move in tmp/ is recovery the next mount does.
    Replica files the namespace does not know stay a problem: a crash can leave them, but
    so can a namespace restored from an older copy, and the mount would delete them."""
    (plain / "ssd" / "tmp" / "blk_99.copy").write_bytes(b"half a move")
    with namespace_rows(plain) as (db, txn):
        txn.put(b"state", schema.pack_meta("mounted"), db=db("meta"))
    assert_recovers(plain, {"TMP_LEFTOVER", "UNCLEAN_STATE"}, capsys)
    assert not list((plain / "ssd" / "tmp").iterdir())
    leaf = replica_files(plain / "disk", blocks_at(plain, "/x")[0].block_id)[0].parent
    for path in [leaf / "blk_1073742000", leaf / "blk_1073742000_1500.meta"]:
        path.write_bytes(b"written before the crash, or a block the namespace lost")
    with namespace_rows(plain) as (db, txn):
        txn.put(b"state", schema.pack_meta("mounted"), db=db("meta"))
    code, out, _ = fsck(plain, capsys=capsys)
    assert (code, kinds(out)) == (1, {"ORPHAN_REPLICA", "UNCLEAN_STATE"}), out
    assert out.rstrip().endswith("is CORRUPT"), out


def test_pending_trash(plain, capsys):
    rec = blocks_at(plain, "/x")[0]
    leaf = replica_files(plain / "disk", rec.block_id)[0].parent
    files = [leaf / "blk_1073742001", leaf / f"blk_1073742001_{rec.gs}.meta"]
    for path in files:
        path.write_bytes(b"dropped")
    with namespace_rows(plain) as (db, txn):
        txn.put(u64(1073742001), schema.trash_value(rec.gs, (2,)), db=db("trash"))
    code, out, _ = fsck(plain, capsys=capsys)
    assert "Orphan replicas:\t0" in out       # trashed files are not orphans
    assert_recovers(plain, {"TRASH_PENDING"}, capsys)
    assert not any(p.exists() for p in files)


# --------------------------------------------------------------------------- namespace


def test_deleted_dentry_sends_the_file_to_lost_and_found(plain, tmp_path, capsys):
    ino = inode_at(plain, "/x").ino
    with namespace_rows(plain) as (db, txn):
        assert txn.delete(schema.dentry_key(ROOT_INO, b"x"), db=db("dentries"))
    code, out, _ = fsck(plain, capsys=capsys)
    assert f"NAMELESS_INODE: <inode {ino}>: inode with nlink 1 is named by no dentry" in out
    repaired = assert_repairs(plain, {"NAMELESS_INODE", "STRAY_COOKIE", "STRAY_BACKLINK"},
                              capsys)
    assert f"moved to /lost+found/#{ino}" in repaired
    mount = Mount(plain, tmp_path / "mnt").start()
    try:
        assert (mount.mountpoint / "lost+found" / f"#{ino}").read_bytes() == b"x" * 10_000
        assert not (mount.mountpoint / "x").exists()
    finally:
        mount.stop()
    assert fsck_process(plain).returncode == 0


def test_dangling_dentry(plain, capsys):
    ino = inode_at(plain, "/d/empty").ino
    with namespace_rows(plain) as (db, txn):
        txn.delete(u64(ino), db=db("inodes"))
    code, out, _ = fsck(plain, capsys=capsys)
    assert f"DANGLING_DENTRY: /d/empty: names inode {ino}, which does not exist" in out
    assert_repairs(plain, {"DANGLING_DENTRY"}, capsys)
    with pytest.raises(Exception):
        inode_at(plain, "/d/empty")


def test_wrong_nlink_of_file_and_directory(plain, capsys):
    rewrite_inode(plain, "/x", nlink=5)
    rewrite_inode(plain, "/d", nlink=7)
    code, out, _ = fsck(plain, capsys=capsys)
    assert "WRONG_NLINK: /x: nlink is 5, expected 1" in out
    assert "WRONG_NLINK: /d: nlink is 7, expected 3" in out
    assert_repairs(plain, {"WRONG_NLINK"}, capsys)
    assert (inode_at(plain, "/x").nlink, inode_at(plain, "/d").nlink) == (1, 3)
    assert inode_at(plain, "/h").nlink == 2


def test_wrong_parent(plain, capsys):
    rewrite_inode(plain, "/d/sub", parent=ROOT_INO)
    assert_repairs(plain, {"WRONG_PARENT"}, capsys)
    assert inode_at(plain, "/d/sub").parent == inode_at(plain, "/d").ino


def test_unlinked_inode_not_in_orphans_is_purged(plain, capsys):
    inode = inode_at(plain, "/x")
    rec = blocks_at(plain, "/x")[0]
    with namespace_rows(plain) as (db, txn):
        _, cookie = schema.parse_dentry_value(
            txn.get(schema.dentry_key(ROOT_INO, b"x"), db=db("dentries")))
        txn.delete(schema.dentry_key(ROOT_INO, b"x"), db=db("dentries"))
        txn.delete(schema.cookie_key(ROOT_INO, cookie), db=db("dircookies"))
        txn.delete(schema.backlink_key(inode.ino, ROOT_INO, b"x"), db=db("backlinks"))
        inode.nlink = 0
        txn.put(u64(inode.ino), inode.pack(), db=db("inodes"))
    assert_repairs(plain, {"UNLISTED_UNLINKED"}, capsys)
    assert not list((plain / "disk").rglob(f"blk_{rec.block_id}*"))


def test_orphan_row_of_a_linked_inode(plain, capsys):
    ino = inode_at(plain, "/x").ino
    with namespace_rows(plain) as (db, txn):
        txn.put(u64(ino), b"", db=db("orphans"))
    assert_repairs(plain, {"ORPHAN_LINKED"}, capsys)
    assert inode_at(plain, "/x").nlink == 1


def test_symlink_without_target_is_cleared(plain, capsys):
    ino = inode_at(plain, "/s").ino
    with namespace_rows(plain) as (db, txn):
        txn.delete(u64(ino), db=db("symlinks"))
    assert_repairs(plain, {"SYMLINK_NO_TARGET"}, capsys)
    with pytest.raises(Exception):
        inode_at(plain, "/s")


def test_directory_loop_is_broken_into_lost_and_found(plain, capsys):
    d, sub = inode_at(plain, "/d"), inode_at(plain, "/d/sub")
    with namespace_rows(plain) as (db, txn):
        _, cookie = schema.parse_dentry_value(
            txn.get(schema.dentry_key(ROOT_INO, b"d"), db=db("dentries")))
        txn.delete(schema.dentry_key(ROOT_INO, b"d"), db=db("dentries"))
        txn.delete(schema.cookie_key(ROOT_INO, cookie), db=db("dircookies"))
        txn.delete(schema.backlink_key(d.ino, ROOT_INO, b"d"), db=db("backlinks"))
        txn.put(schema.dentry_key(sub.ino, b"loop"), schema.dentry_value(d.ino, sub.next_cookie),
                db=db("dentries"))
        txn.put(schema.cookie_key(sub.ino, sub.next_cookie), schema.cookie_value(d.ino, b"loop"),
                db=db("dircookies"))
        txn.put(schema.backlink_key(d.ino, sub.ino, b"loop"), b"", db=db("backlinks"))
        sub.next_cookie += 1
        d.parent = sub.ino
        txn.put(u64(sub.ino), sub.pack(), db=db("inodes"))
        txn.put(u64(d.ino), d.pack(), db=db("inodes"))
    code, out, _ = fsck(plain, capsys=capsys)
    assert "DIRECTORY_LOOP" in out and "unreachable from the root" in out
    assert_repairs(plain, {"DIRECTORY_LOOP", "WRONG_NLINK"}, capsys)
    assert inode_at(plain, f"/lost+found/#{d.ino}/f").size == 6
    assert inode_at(plain, f"/lost+found/#{d.ino}/sub").ino == sub.ino


def test_replicas_index_row_missing(plain, capsys):
    rec = blocks_at(plain, "/big")[2]
    with namespace_rows(plain) as (db, txn):
        txn.delete(schema.replica_key(rec.volumes[0], rec.block_id), db=db("replicas"))
    assert_repairs(plain, {"REPLICA_INDEX"}, capsys)


def test_counters_behind(plain, capsys):
    with namespace_rows(plain) as (db, txn):
        txn.put(b"next_ino", u64(2), db=db("meta"))
        txn.put(b"gs", u64(1000), db=db("meta"))
    code, out, _ = fsck(plain, capsys=capsys)
    assert "next_ino is 2, must be at least" in out and "gs is 1000, must be at least" in out
    assert_repairs(plain, {"COUNTER_BEHIND"}, capsys)


# --------------------------------------------------------------------------- crash and mount


def test_lease_left_by_a_killed_daemon(plain, tmp_path, capsys):
    payload = os.urandom(300_000)
    mount = Mount(plain, tmp_path / "mnt").start()
    handles = [open(mount.mountpoint / name, "wb") for name in ("w", "gone")]
    for f in handles:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.unlink(mount.mountpoint / "gone")
    gone = os.fstat(handles[1].fileno()).st_ino
    mount.kill()
    for f in handles:
        try:
            f.close()
        except OSError:
            pass       # the daemon is gone; the kernel may report it
    code, out, _ = fsck(plain, capsys=capsys)
    assert "/w: lease left by a dead daemon" in out
    assert f"ORPHAN_PENDING: <inode {gone}>: unlinked inode left by a dead daemon" in out
    assert_recovers(plain, {"LEASE_PENDING", "ORPHAN_PENDING", "UNCLEAN_STATE"},
                    capsys)
    assert fsck_process(plain).returncode == 0
    mount = Mount(plain, tmp_path / "mnt").start()
    try:
        assert (mount.mountpoint / "w").read_bytes() == payload
    finally:
        mount.stop()


def killed_while_writing(data: Path, tmp_path: Path, name: str, payload: bytes) -> None:
    """Mount, write and fsync ``payload`` to a new file, kill -9 the daemon with the file
    still open: its lease is left for the next mount's lease recovery."""
    mount = Mount(data, tmp_path / "mnt").start()
    fd = os.open(mount.mountpoint / name, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, payload)
    os.fsync(fd)
    mount.kill()
    try:
        os.close(fd)
    except OSError:
        pass       # the daemon is gone; the kernel may report it


def test_a_bad_chunk_under_a_dead_lease_is_not_called_healthy(plain, tmp_path, capsys):
    """Lease recovery re-checksums a chunk that fails its CRC, taking it for a write cut
    short; it may as well be damage to fsynced data, so fsck does not say HEALTHY."""
    killed_while_writing(plain, tmp_path, "w", os.urandom(300_000))
    data_file = replica_files(plain / "disk", blocks_at(plain, "/w")[0].block_id)[0]
    with open(data_file, "r+b") as f:
        f.seek(5000)
        f.write(b"XXXXXXXX")
    code, out, _ = fsck(plain, capsys=capsys)
    assert code == 1 and out.rstrip().endswith("is CORRUPT"), out
    assert ("LEASE_PENDING: /w: lease left by a dead daemon: needs lease recovery; a replica "
            "fails its checksum, which lease recovery cannot tell from damage") in out
    assert "checksum mismatch" in out


def test_old_copy_beside_a_replica_newer_than_the_namespace(plain, tmp_path, capsys):
    """An append whose transactions were lost (the namespace put back as it was before)
    left the recorded replica newer than the namespace, and an old copy of the block lies
    on another volume: the newest replica wins, through the mount as through --repair.
    Before: both recorded the old copy first; repair then dropped the newer replica (the
    appended bytes lost) and the mount left the copy's data file behind."""
    rec = blocks_at(plain, "/x")[0]
    saved = tmp_path / "saved"
    copy_replica_files(plain / "disk", saved, rec.block_id)
    shutil.copytree(plain / "namespace", tmp_path / "old-namespace")
    mount = Mount(plain, tmp_path / "mnt").start()
    with open(mount.mountpoint / "x", "ab") as f:
        f.write(b"y" * 100)
    mount.stop()
    shutil.rmtree(plain / "namespace")
    shutil.copytree(tmp_path / "old-namespace", plain / "namespace")
    copy_replica_files(saved, plain / "archive", rec.block_id)
    code, out, _ = fsck(plain, capsys=capsys)
    assert kinds(out) == {"NEWER_REPLICA", "LOST_BLOCK", "ORPHAN_REPLICA"}, out
    repaired = Path(shutil.copytree(plain, tmp_path / "repaired", symlinks=True))
    fsck(repaired, "--repair", capsys=capsys)
    for data in (plain, repaired):
        mount = Mount(data, tmp_path / "mnt").start()
        try:
            assert (mount.mountpoint / "x").read_bytes() == b"x" * 10_000 + b"y" * 100
        finally:
            mount.stop()
        assert not list((data / "archive").rglob(f"blk_{rec.block_id}*"))
        assert fsck_process(data).returncode == 0


def test_replica_whose_index_row_is_lost_is_kept_by_the_mount(plain, tmp_path, capsys):
    """The block record lists the volume but the replicas index lost its row: the files
    are the block's replica all the same. Before: the mount deleted them as unrecorded."""
    rec = blocks_at(plain, "/x")[0]
    (disk_id,) = rec.volumes
    with namespace_rows(plain) as (db, txn):
        txn.delete(schema.replica_key(disk_id, rec.block_id), db=db("replicas"))
    code, out, _ = fsck(plain, capsys=capsys)
    assert (code, kinds(out)) == (1, {"REPLICA_INDEX"}), out
    mount = Mount(plain, tmp_path / "mnt").start()
    try:
        assert (mount.mountpoint / "x").read_bytes() == b"x" * 10_000
    finally:
        mount.stop()
    assert "replicas index has no row for it: its files are kept" in mount.log_text()
    assert_repairs(plain, {"REPLICA_INDEX"}, capsys)


def test_copy_of_a_linked_file_listed_as_orphan_is_recorded(plain, tmp_path, capsys):
    """A file still named but listed in the orphan table is not purged by the mount, so
    the unrecorded copy that its corrupt block needs is recorded, by --repair as by the
    mount. Before: fsck called the copy an orphan and --repair deleted it."""
    rec = blocks_at(plain, "/x")[0]
    data_file, _ = replica_files(plain / "disk", rec.block_id)
    copy, _ = copy_replica_files(plain / "disk", plain / "archive", rec.block_id)
    flip_byte(data_file, 9000)
    ino = inode_at(plain, "/x").ino
    with namespace_rows(plain) as (db, txn):
        txn.put(u64(ino), b"", db=db("orphans"))
    code, out, _ = fsck(plain, capsys=capsys)
    assert "UNRECORDED_REPLICA" in kinds(out) and "ORPHAN_LINKED" in kinds(out), out
    code, repaired, _ = fsck(plain, "--repair", capsys=capsys)
    assert "not repaired" not in repaired and repaired.rstrip().endswith("is HEALTHY"), repaired
    assert copy.read_bytes() == b"x" * 10_000


def test_copy_of_a_block_under_a_dead_lease_is_not_recorded(plain, tmp_path, capsys):
    """Lease recovery runs first and may re-stamp or cut the file's blocks, and tierfs never
    copies a block of a file open for writing: such a copy is an orphan, for fsck as for
    the mount."""
    payload = os.urandom(300_000)
    killed_while_writing(plain, tmp_path, "w", payload)
    rec = blocks_at(plain, "/w")[0]
    copy, _ = copy_replica_files(plain / "disk", plain / "archive", rec.block_id)
    code, out, _ = fsck(plain, capsys=capsys)
    assert code == 1, out
    assert kinds(out) == {"LEASE_PENDING", "UNCLEAN_STATE", "ORPHAN_REPLICA"}, out
    mount = Mount(plain, tmp_path / "mnt").start()
    try:
        assert not copy.exists()
        assert (mount.mountpoint / "w").read_bytes() == payload
    finally:
        mount.stop()
    assert fsck_process(plain).returncode == 0


def test_lost_block_whose_replica_is_on_an_unrecorded_volume(plain, tmp_path, capsys):
    """A block record listing no volume, its whole replica on a volume: the mount finds the
    block by its id among the block records, and records the replica."""
    rec = blocks_at(plain, "/x")[0]
    (disk_id,) = rec.volumes
    data_file, meta_file = replica_files(plain / "disk", rec.block_id)
    copy_replica_files(plain / "disk", plain / "archive", rec.block_id)
    data_file.unlink()
    meta_file.unlink()
    forget_replica(plain, "/x", disk_id)
    code, out, _ = fsck(plain, capsys=capsys)
    assert (code, kinds(out)) == (1, {"LOST_BLOCK", "UNRECORDED_REPLICA"}), out
    mount = Mount(plain, tmp_path / "mnt").start()
    try:
        assert (mount.mountpoint / "x").read_bytes() == b"x" * 10_000
    finally:
        mount.stop()
    (now,) = blocks_at(plain, "/x")[0].volumes
    assert now != disk_id
    assert fsck_process(plain).returncode == 0


def test_average_block_size_counts_blocks_not_holes(mounted):
    """One block (64 MiB blocks): the second, from 64 MiB to the byte at 100 MiB; the first
    is a hole and has none. Before: the files' sizes over the number of blocks, 104,857,601 B
    for this file, more than a block holds."""
    with open(mounted.mountpoint / "sparse", "wb") as f:
        f.seek(100 << 20)
        f.write(b"!")
    result = fsck_process(mounted.data)
    assert "Total size:\t104857601 B" in result.stdout, result.stdout
    assert ("Total blocks (validated):\t1 (avg. block size 37748737 B)"
            in result.stdout), result.stdout


def test_check_beside_a_mount_and_repair_refused(mounted):
    mnt = mounted.mountpoint
    (mnt / "done").write_bytes(b"closed file")
    with open(mnt / "open", "wb") as writer:
        writer.write(b"still being written")
        writer.flush()
        result = fsck_process(mounted.data)
        assert result.returncode == 0, result.stdout
        assert "NOTE: /open: open for writing (lease held)" in result.stdout
        refused = fsck_process(mounted.data, "--repair")
        assert refused.returncode == 2
        assert refused.stdout == ""
        assert len(refused.stderr.splitlines()) == 1
        assert "is mounted" in refused.stderr and "unmount it before" in refused.stderr
    assert (mnt / "open").read_bytes() == b"still being written"


# --------------------------------------------------------------------------- cannot run


def test_not_a_tierfs_filesystem(tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "nowhere"):
        result = fsck_process(target)
        assert result.returncode == 2 and result.stdout == ""
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert str(target) in result.stderr


def test_missing_or_foreign_volume(plain, tmp_path):
    shutil.rmtree(plain / "archive")
    result = fsck_process(plain)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "archive" in result.stderr and "missing" in result.stderr
    run_tool("mkfs", str(tmp_path / "other"))
    shutil.copytree(tmp_path / "other" / "archive", plain / "archive")
    result = fsck_process(plain)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "belongs to another tierfs filesystem" in result.stderr


def test_path_that_does_not_exist(plain):
    result = fsck_process(plain, "/no/such")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "'/no/such' does not exist" in result.stderr


# --------------------------------------------------------------------------- progress


def test_status_lines_without_a_terminal():
    stream = io.StringIO()
    progress = Progress(stream, tty=False, interval=0)
    progress.phase("verifying replicas", 200)
    progress.advance(50)
    progress.close()
    assert stream.getvalue() == "tierfs fsck: verifying replicas: 50 of 200 (25%)\n"


class _Interrupt(Progress):
    """Ctrl-C in the middle of reading replicas."""

    def __init__(self):
        super().__init__(io.StringIO(), tty=False)

    def advance(self, n: int) -> None:
        raise KeyboardInterrupt


def test_interrupted_repair_releases_everything(plain, capsys):
    flip_byte(replica_files(plain / "disk", blocks_at(plain, "/big")[0].block_id)[0], 1)
    with pytest.raises(KeyboardInterrupt):
        Fsck(plain, progress=_Interrupt()).repair()
    assert MountLock(plain).holder() is None
    assert fsck(plain, capsys=capsys)[0] == 1
    assert stat.S_ISDIR(inode_at(plain, "/d").mode)


# --------------------------------------------------------------------------- more rows


def _unname(txn, db, parent: int, name: bytes) -> int:
    """Delete a dentry with its dircookies and backlinks rows; returns the child."""
    child, cookie = schema.parse_dentry_value(
        txn.get(schema.dentry_key(parent, name), db=db("dentries")))
    txn.delete(schema.dentry_key(parent, name), db=db("dentries"))
    txn.delete(schema.cookie_key(parent, cookie), db=db("dircookies"))
    txn.delete(schema.backlink_key(child, parent, name), db=db("backlinks"))
    return child


def _put_inode(txn, db, inode: Inode) -> None:
    txn.put(u64(inode.ino), inode.pack(), db=db("inodes"))


def damage_orphan_left_by_dead_daemon(nodes, txn, db):
    inode = nodes["/x"]
    _unname(txn, db, ROOT_INO, b"x")
    inode.nlink = 0
    _put_inode(txn, db, inode)
    txn.put(u64(inode.ino), b"", db=db("orphans"))


def damage_orphan_with_nlink(nodes, txn, db):
    damage_orphan_left_by_dead_daemon(nodes, txn, db)
    _put_inode(txn, db, rewrite_fields(nodes["/x"], nlink=1))


def damage_missing_cookie_row(nodes, txn, db):
    _, cookie = schema.parse_dentry_value(
        txn.get(schema.dentry_key(ROOT_INO, b"x"), db=db("dentries")))
    txn.delete(schema.cookie_key(ROOT_INO, cookie), db=db("dircookies"))


def damage_cookie_row_names_another_inode(nodes, txn, db):
    _, cookie = schema.parse_dentry_value(
        txn.get(schema.dentry_key(ROOT_INO, b"x"), db=db("dentries")))
    txn.put(schema.cookie_key(ROOT_INO, cookie), schema.cookie_value(nodes["/big"].ino, b"x"),
            db=db("dircookies"))


def damage_missing_backlink(nodes, txn, db):
    txn.delete(schema.backlink_key(nodes["/x"].ino, ROOT_INO, b"x"),
               db=db("backlinks"))


def damage_next_cookie(nodes, txn, db):
    root = nodes["/"]
    root.next_cookie = 4
    _put_inode(txn, db, root)


def damage_directory_hard_link(nodes, txn, db):
    sub, root = nodes["/d/sub"], nodes["/"]
    txn.put(schema.dentry_key(ROOT_INO, b"sub2"), schema.dentry_value(sub.ino, root.next_cookie),
            db=db("dentries"))
    txn.put(schema.cookie_key(ROOT_INO, root.next_cookie), schema.cookie_value(sub.ino, b"sub2"),
            db=db("dircookies"))
    txn.put(schema.backlink_key(sub.ino, ROOT_INO, b"sub2"), b"", db=db("backlinks"))
    root.next_cookie += 1
    root.nlink += 1
    _put_inode(txn, db, root)


def damage_block_past_end_of_file(nodes, txn, db):
    _put_inode(txn, db, rewrite_fields(nodes["/big"], size=1000))


def damage_block_of_a_missing_inode(nodes, txn, db):
    ino = nodes["/x"].ino
    _unname(txn, db, ROOT_INO, b"x")
    txn.delete(u64(ino), db=db("inodes"))


def damage_rows_of_a_missing_inode(nodes, txn, db):
    txn.put(schema.xattr_key(999_999, b"user.lost"), b"value", db=db("xattrs"))
    txn.put(u64(999_998), b"", db=db("orphans"))


def damage_symlink_size(nodes, txn, db):
    _put_inode(txn, db, rewrite_fields(nodes["/s"], size=99))


def damage_txid_counter(nodes, txn, db):
    txn.put(b"txid", u64(3), db=db("meta"))


def damage_unknown_volume_in_record(nodes, txn, db):
    ino = nodes["/x"].ino
    key = schema.block_key(ino, 0)
    rec = schema.BlockRecord.unpack(txn.get(key, db=db("blocks")))
    rec.volumes = (*rec.volumes, 7)
    txn.put(key, rec.pack(), db=db("blocks"))
    txn.put(schema.replica_key(7, rec.block_id), key, db=db("replicas"))


def damage_root_missing(nodes, txn, db):
    txn.delete(u64(ROOT_INO), db=db("inodes"))


def rewrite_fields(inode: Inode, **fields) -> Inode:
    for name, value in fields.items():
        setattr(inode, name, value)
    return inode


def test_orphan_left_by_a_dead_daemon_is_pending_recovery(plain, capsys):
    nodes = {p: inode_at(plain, p) for p in ("/", "/x")}
    with namespace_rows(plain) as (db, txn):
        damage_orphan_left_by_dead_daemon(nodes, txn, db)
    assert_recovers(plain, {"ORPHAN_PENDING"}, capsys)


def test_pending_recovery_does_not_hide_damage(plain, capsys):
    nodes = {p: inode_at(plain, p) for p in ("/", "/x", "/big")}
    with namespace_rows(plain) as (db, txn):
        damage_orphan_left_by_dead_daemon(nodes, txn, db)
        damage_block_past_end_of_file(nodes, txn, db)
    code, out, _ = fsck(plain, capsys=capsys)
    assert (code, kinds(out)) == (1, {"ORPHAN_PENDING", "BLOCK_PAST_EOF"}), out
    assert out.rstrip().endswith("is CORRUPT"), out
    code, out, _ = fsck(plain, "--repair", capsys=capsys)
    assert code == 1 and out.rstrip().endswith("is HEALTHY"), out


@pytest.mark.parametrize("damage, expected", [
    (damage_orphan_with_nlink, {"ORPHAN_NLINK"}),
    (damage_missing_cookie_row, {"MISSING_COOKIE"}),
    (damage_cookie_row_names_another_inode, {"MISSING_COOKIE"}),
    (damage_missing_backlink, {"MISSING_BACKLINK"}),
    (damage_next_cookie, {"BAD_NEXT_COOKIE"}),
    (damage_directory_hard_link, {"DIR_HARDLINK"}),
    (damage_block_past_end_of_file, {"BLOCK_PAST_EOF"}),
    (damage_block_of_a_missing_inode, {"BLOCK_OF_NON_FILE"}),
    (damage_rows_of_a_missing_inode, {"STRAY_ROWS"}),
    (damage_symlink_size, {"WRONG_SIZE"}),
    (damage_txid_counter, {"COUNTER_BEHIND"}),
    (damage_unknown_volume_in_record, {"MISSING_REPLICA"}),
    (damage_root_missing, {"ROOT_MISSING"}),
], ids=lambda v: v.__name__.removeprefix("damage_") if callable(v) else None)
def test_namespace_damage_is_found_and_repaired(plain, damage, expected, capsys):
    nodes = {p: inode_at(plain, p) for p in ("/", "/x", "/d/sub", "/big", "/s")}
    with namespace_rows(plain) as (db, txn):
        damage(nodes, txn, db)
    assert_repairs(plain, expected, capsys)
    report = Fsck(plain).check()
    assert report.healthy and report.stats.corrupt_blocks == 0
