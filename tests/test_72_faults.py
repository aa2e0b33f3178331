"""Fault injection on replicated filesystems: damaged, missing, stale and unwritable replicas.

Every test makes a filesystem with three DISK volumes (64 KiB blocks, 4 KiB chunks), mostly
with replication 2 so that a spare volume exists, writes files through a real mount, then
damages replica files on the volumes directly, as a failing disk or an operator would.

What must hold (DESIGN.md section 4, seed 002):

- a read that meets a corrupt, missing or stale replica fails over to another one and returns
  the right bytes; the daemon's log names the bad replica; the replication monitor drops it
  (never the last one) and copies a good replica, so the block is back to full replication
  within seconds, as the volumes, ``user.tierfs.placement`` and ``tierfs fsck`` show;
- with no good replica left a read gives EIO, never wrong data, and nothing is deleted;
- a replica that cannot be written during a write is dropped from the pipeline: the write
  goes on, the block continues on the other replicas under a new generation stamp (the meta
  file names show it) and the failed replica is stale from then on;
- a volume that disappears does not stop reads;
- a stale replica (an older stamp than the namespace's) is never served;
- a write that cuts into a corrupt chunk drops that replica instead of blessing it;
- after kill -9 mid-write, lease recovery keeps everything fsynced and leaves the replicas
  identical under a new stamp, also when one replica's last write is torn.

Reads go through O_DIRECT, which bypasses the page cache, so they reach the daemon.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, run_tool, wait_for

BLOCK = 64 * 1024
CHUNK = 4096
PAGE = mmap.PAGESIZE
SMALL_BLOCKS = ("--block-size", "64K", "--bytes-per-checksum", "4096")
REPAIR_TIMEOUT = 15.0
PLACEMENT = "user.tierfs.placement"

BLOCK_LINE = re.compile(r"^(\d+)\. blk_(\d+)_(\d+) len=(\d+) Live_repl=(\d+)(.*)$")
LOCATION = re.compile(r"\[([^,\]]+),([^,\]]+),([A-Z_]+)\](\([A-Z]+\))?")
META_NAME = re.compile(r"^blk_(\d+)_(\d+)\.meta$")
PROBLEM = re.compile(r"^([A-Z][A-Z_]+): ", re.MULTILINE)


# --- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def make_fs(tmp_path):
    """make_fs(replication): mkfs with three DISK volumes d1, d2, d3 and small blocks, then
    mount. Tests unmount and check themselves; a failed test's daemon is killed here."""
    mounts: list[Mount] = []

    def factory(replication: int) -> Mount:
        data = tmp_path / "data"
        run_tool("mkfs", str(data), *SMALL_BLOCKS, "--replication", str(replication),
                 *(f"--volume=DISK:{data / d}" for d in ("d1", "d2", "d3")))
        mount = Mount(data, tmp_path / "mnt").start()
        mounts.append(mount)
        return mount

    yield factory
    for mount in mounts:
        if mount.proc is not None:
            mount.kill()


def leaf_dir(volume: Path, block_id: int) -> Path:
    return (volume / "current" / "finalized" / f"subdir{(block_id >> 16) & 0x1F}"
            / f"subdir{(block_id >> 8) & 0x1F}")


def data_file(volume: Path, block_id: int) -> Path:
    return leaf_dir(volume, block_id) / f"blk_{block_id}"


def meta_gss(volume: Path, block_id: int) -> list[int]:
    leaf = leaf_dir(volume, block_id)
    if not leaf.is_dir():
        return []
    return sorted(int(m.group(2)) for m in map(META_NAME.match, os.listdir(leaf))
                  if m and int(m.group(1)) == block_id)


def meta_file(volume: Path, block_id: int, gs: int) -> Path:
    return leaf_dir(volume, block_id) / f"blk_{block_id}_{gs}.meta"


def blocks_of(data: Path, path: str) -> list[dict]:
    """The namespace's block map of one file (``tierfs fsck PATH --files --blocks
    --locations``, read-only, also beside a mount): index, id, gs, len, live, volumes, marks."""
    result = run_tool("fsck", str(data), path, "--files", "--blocks", "--locations",
                      check=False)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    blocks = []
    for line in result.stdout.splitlines():
        m = BLOCK_LINE.match(line)
        if m:
            locations = LOCATION.findall(m.group(6))
            blocks.append({"index": int(m.group(1)), "id": int(m.group(2)),
                           "gs": int(m.group(3)), "len": int(m.group(4)),
                           "live": int(m.group(5)),
                           "volumes": [Path(v) for v, _, _, _ in locations],
                           "marks": [mark for _, _, _, mark in locations]})
    return blocks


def fsck(data: Path, *args: str) -> tuple[int, str]:
    result = run_tool("fsck", str(data), *args, check=False)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stdout


def problem_kinds(output: str) -> list[str]:
    return sorted(PROBLEM.findall(output))


def write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def direct_read(path: Path, offset: int = 0, size: int | None = None) -> bytes:
    """O_DIRECT read (page-aligned): bypasses the page cache, so the daemon serves it."""
    if size is None:
        size = os.stat(path).st_size - offset
    start = offset - offset % PAGE
    span = max(PAGE, -(-(offset + size - start) // PAGE) * PAGE)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, span)
        try:
            got = bytearray()
            while len(got) < span:
                n = os.preadv(fd, [buf], start + len(got))
                if n <= 0:
                    break
                got += buf[:n]
        finally:
            buf.close()
    finally:
        os.close(fd)
    return bytes(got[offset - start:offset - start + size])


def direct_read_errno(path: Path, offset: int, size: int) -> int:
    try:
        direct_read(path, offset, size)
    except OSError as exc:
        return exc.errno
    return 0


def flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)
        assert len(old) == 1, f"{path} has no byte {offset}"
        os.pwrite(fd, bytes([old[0] ^ 0x5A]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def placement(path: Path) -> str:
    return os.getxattr(path, PLACEMENT).decode()


def replicas_ok(data: Path, rel: str, content: bytes, replication: int) -> str | None:
    """None if every block of the file has ``replication`` good replicas, each a data file
    equal to the file's bytes and one meta file of the block's stamp; else what is wrong."""
    blocks = blocks_of(data, rel)
    if not blocks:
        return "no blocks listed"
    for b in blocks:
        where = f"block {b['index']} (blk_{b['id']}_{b['gs']})"
        if b["live"] != replication or len(b["volumes"]) != replication or any(b["marks"]):
            return f"{where}: live {b['live']}, on {b['volumes']} {b['marks']}"
        want = content[b["index"] * BLOCK:b["index"] * BLOCK + b["len"]]
        for vol in b["volumes"]:
            if meta_gss(vol, b["id"]) != [b["gs"]]:
                return f"{where}: meta files on {vol}: {meta_gss(vol, b['id'])}"
            if data_file(vol, b["id"]).read_bytes() != want:
                return f"{where}: replica on {vol} differs from the file"
    return None


def wait_for_full_replication(mount: Mount, rel: str, content: bytes, replication: int,
                              nblocks: int) -> list[dict]:
    """Poll (the monitor works in ~0.5 s rounds) until every block is fully replicated."""
    path = mount.mountpoint / rel.lstrip("/")
    wanted = f"DISK:{replication} x{nblocks}"
    deadline = time.monotonic() + REPAIR_TIMEOUT
    while True:
        problem = replicas_ok(mount.data, rel, content, replication)
        if problem is None and placement(path) == wanted:
            return blocks_of(mount.data, rel)
        if time.monotonic() > deadline:
            pytest.fail(f"{rel} not back to {replication} replicas within {REPAIR_TIMEOUT} s: "
                        f"{problem}; placement {placement(path)!r}\n{mount.log_text()}")
        time.sleep(0.3)


def error_lines(mount: Mount) -> list[str]:
    lines = mount.errors_logged()
    assert not any("Traceback" in line for line in lines), mount.log_text()
    return lines


def finish(mount: Mount) -> None:
    """Unmount; fsck must report nothing."""
    mount.stop()
    code, out = fsck(mount.data)
    assert code == 0, out


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


# --- one bad replica: reads fail over, the monitor repairs --------------------------------------


def _flip_data(vol: Path, bid: int, gs: int) -> None:
    flip_byte(data_file(vol, bid), 5000)          # in chunk 1


def _flip_meta(vol: Path, bid: int, gs: int) -> None:
    flip_byte(meta_file(vol, bid, gs), meta_file(vol, bid, gs).stat().st_size - 2)


def _delete_data(vol: Path, bid: int, gs: int) -> None:
    data_file(vol, bid).unlink()


def _delete_meta(vol: Path, bid: int, gs: int) -> None:
    meta_file(vol, bid, gs).unlink()


DAMAGE = {"flipped data byte": (_flip_data, "checksum error"),
          "flipped checksum byte": (_flip_meta, "checksum error"),
          "data file deleted": (_delete_data, "is missing"),
          "meta file deleted": (_delete_meta, "is missing")}


CASES = [(damage, 2) for damage in DAMAGE] + [("flipped data byte", 3),
                                                ("data file deleted", 3)]


@pytest.mark.parametrize(("damage", "replication"), CASES)
def test_bad_replica_is_read_around_and_replaced(make_fs, tmp_path, damage, replication):
    mount = make_fs(replication)
    content = pattern(1, 3 * BLOCK + 7000)
    path = mount.mountpoint / "f"
    write_file(path, content)
    blocks = wait_for_full_replication(mount, "/f", content, replication, 4)
    victim = blocks[1]
    # Reads prefer the fastest type, then the lowest volume id: damage that replica.
    bad_vol = min(victim["volumes"], key=lambda v: v.name)
    DAMAGE[damage][0](bad_vol, victim["id"], victim["gs"])

    assert direct_read(path) == content
    start = BLOCK + CHUNK
    assert direct_read(path, start, 2 * CHUNK) == content[start:start + 2 * CHUNK]
    after = wait_for_full_replication(mount, "/f", content, replication, 4)
    assert [(b["id"], b["gs"]) for b in after] == [(b["id"], b["gs"]) for b in blocks]
    assert [b["volumes"] for i, b in enumerate(after) if i != 1] == \
        [b["volumes"] for i, b in enumerate(blocks) if i != 1]
    assert direct_read(path) == content

    errors = error_lines(mount)
    assert errors, "the bad replica was not reported"
    for line in errors:
        assert f"block {victim['id']}" in line and str(bad_vol) in line, line
        assert DAMAGE[damage][1] in line, line
    finish(mount)


def test_a_read_only_mount_reads_around_a_bad_replica_and_leaves_it(make_fs, tmp_path):
    """On ``-o ro`` reads still fail over to a good replica, but nothing on the volumes
    changes: the monitor, which would drop the bad replica and copy a new one, does not
    run (before: the replica was replaced on a mount nobody was to write to)."""
    mount = make_fs(2)
    content = pattern(3, 2 * BLOCK)
    write_file(mount.mountpoint / "f", content)
    blocks = wait_for_full_replication(mount, "/f", content, 2, 2)
    mount.stop()
    victim = blocks[0]
    bad_vol = min(victim["volumes"], key=lambda v: v.name)
    _flip_data(bad_vol, victim["id"], victim["gs"])
    damaged = data_file(bad_vol, victim["id"]).read_bytes()

    ro = Mount(mount.data, mount.mountpoint, "allow_other,ro").start()
    try:
        assert direct_read(ro.mountpoint / "f") == content
        time.sleep(2.0)  # four rounds of a monitor, were one running
        assert direct_read(ro.mountpoint / "f") == content
    finally:
        ro.stop()
    assert data_file(bad_vol, victim["id"]).read_bytes() == damaged
    def replicas(listing):
        return [(b["id"], b["gs"], b["volumes"]) for b in listing]
    assert replicas(blocks_of(mount.data, "/f")) == replicas(blocks)
    assert "read-only mount: bad or missing replicas are not repaired" in ro.log_text()
    code, out = fsck(mount.data)
    assert code == 1 and problem_kinds(out) == ["CORRUPT_REPLICA"], out


def test_all_replicas_bad_gives_eio_and_keeps_them(make_fs, tmp_path):
    mount = make_fs(2)
    content = pattern(2, 3 * BLOCK)
    path = mount.mountpoint / "f"
    write_file(path, content)
    blocks = wait_for_full_replication(mount, "/f", content, 2, 3)
    victim = blocks[1]
    for vol in victim["volumes"]:
        flip_byte(data_file(vol, victim["id"]), 2 * CHUNK + 17)      # chunk 2 of block 1
    bad_chunk = BLOCK + 2 * CHUNK

    assert direct_read_errno(path, bad_chunk, CHUNK) == errno.EIO
    assert direct_read_errno(path, 0, 3 * BLOCK) == errno.EIO
    # Chunks that verify are still served, in the damaged block too; never wrong bytes.
    assert direct_read(path, 0, bad_chunk) == content[:bad_chunk]
    assert direct_read(path, bad_chunk + CHUNK, 2 * BLOCK - 3 * CHUNK) == \
        content[bad_chunk + CHUNK:]
    # The monitor must not delete the last replicas: once it has judged the block (a busy
    # machine may take it a while), give it several more rounds.
    assert wait_for(lambda: any("no good replica" in line for line in error_lines(mount)),
                    timeout=30), mount.log_text()
    time.sleep(2.0)
    for vol in victim["volumes"]:
        assert data_file(vol, victim["id"]).exists()
        assert meta_gss(vol, victim["id"]) == [victim["gs"]]
    assert direct_read_errno(path, bad_chunk, CHUNK) == errno.EIO
    assert placement(path) == "DISK:2 x3"
    assert any("no good replica" in line for line in error_lines(mount)), mount.log_text()
    for line in error_lines(mount):
        assert f"block {victim['id']}" in line, line
    mount.stop()

    code, out = fsck(mount.data)
    assert code == 1
    assert problem_kinds(out) == ["CORRUPT_REPLICA", "CORRUPT_REPLICA", "LOST_BLOCK"], out
    assert out.count("checksum mismatch in chunk(s) 2 (no other good replica: kept)") == 2, out
    code, out = fsck(mount.data, "--repair")
    assert code == 1 and "Repaired 0 of 3 problems; 3 left." in out, out
    for vol in victim["volumes"]:
        assert data_file(vol, victim["id"]).exists(), "repair destroyed the last replicas"
    mount.start()
    assert direct_read_errno(path, bad_chunk, CHUNK) == errno.EIO
    assert direct_read(path, 0, bad_chunk) == content[:bad_chunk]
    mount.stop()


# --- fsync: a replica that cannot be synced -----------------------------------------------------


def fsync_errno(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        return exc.errno
    finally:
        os.close(fd)
    return 0


def test_fsync_goes_on_without_a_replica_that_cannot_be_synced(make_fs):
    """A replica whose file was deleted behind the daemon's back cannot be synced. While
    its block has another replica that synced, the fsync succeeds (as an HDFS pipeline goes
    on without a failed DataNode) and the monitor replaces it; it failed with EIO, and a
    second fsync then called the blocks after it durable without syncing them. Both ways a
    replica is synced are covered: by name (the file was closed since it was written) and
    through the descriptors of a file still open."""
    mount = make_fs(2)
    closed, held = mount.mountpoint / "closed", mount.mountpoint / "held"
    closed_content = pattern(7, 3 * BLOCK + 100)
    fd = os.open(closed, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, closed_content)
    os.close(fd)
    assert wait_for(lambda: len(blocks_of(mount.data, "/closed")) == 4)
    first = blocks_of(mount.data, "/closed")[0]
    data_file(first["volumes"][0], first["id"]).unlink()
    assert fsync_errno(closed) == 0

    held_content = pattern(8, 3000)
    fd = os.open(held, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, held_content[:1000])
        os.fsync(fd)
        os.write(fd, held_content[1000:])  # in the page cache: written back by the fsync
        (block,) = blocks_of(mount.data, "/held")
        meta_file(block["volumes"][1], block["id"], block["gs"]).unlink()
        os.fsync(fd)
    finally:
        os.close(fd)
    wait_for_full_replication(mount, "/closed", closed_content, 2, 4)
    wait_for_full_replication(mount, "/held", held_content, 2, 1)
    failures = [line for line in error_lines(mount) if "fsync of inode" in line]
    assert len(failures) == 2, mount.log_text()
    finish(mount)


def test_fsync_fails_while_no_replica_of_a_block_can_be_synced(make_fs):
    """Every replica's files deleted behind the daemon's back: the fsync fails with EIO,
    and so does the next one (the block stays unsynced), never calling lost data durable.
    Nothing else is lost: the other blocks are intact after a remount."""
    mount = make_fs(2)
    path = mount.mountpoint / "f"
    content = pattern(9, 2 * BLOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, content)
        os.fsync(fd)
        os.pwrite(fd, b"late", BLOCK + 10)
        victim = blocks_of(mount.data, "/f")[1]
        for vol in victim["volumes"]:
            data_file(vol, victim["id"]).unlink()
        with pytest.raises(OSError) as first:
            os.fsync(fd)
        assert first.value.errno == errno.EIO
        with pytest.raises(OSError) as second:
            os.fsync(fd)
        assert second.value.errno == errno.EIO
    finally:
        os.close(fd)
    mount.stop()
    code, out = fsck(mount.data)
    assert code == 1 and problem_kinds(out) == ["LOST_BLOCK", "MISSING_REPLICA",
                                                "MISSING_REPLICA"], out
    mount.start()
    assert direct_read(mount.mountpoint / "f", 0, BLOCK) == content[:BLOCK]
    mount.stop()


# --- a replica that cannot be written during a write --------------------------------------------


def chattr(flag: str, path: Path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True, capture_output=True)


def test_unwritable_replica_is_dropped_from_the_write_pipeline(make_fs, tmp_path):
    """``chattr +i`` on one replica's data file makes the daemon's pwrite fail with EPERM
    (root ignores mode bits, so chmod would not). The writer must not notice: the block
    goes on on the other replica under a new stamp, and the old one is stale."""
    mount = make_fs(2)
    path = mount.mountpoint / "long"
    content = bytearray()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    immutable: Path | None = None
    try:
        piece = pattern(3, 20_000)
        os.write(fd, piece)
        content += piece
        os.fsync(fd)
        (first,) = blocks_of(mount.data, "/long")
        assert len(first["volumes"]) == 2
        failed_vol, good_vol = sorted(first["volumes"])
        immutable = data_file(failed_vol, first["id"])
        chattr("+i", immutable)
        for i in range(12):                           # into block 0, then on to block 3
            piece = pattern(10 + i, 15_000)
            assert os.write(fd, piece) == len(piece)
            content += piece
            assert os.fsync(fd) is None
        blocks = blocks_of(mount.data, "/long")
        assert [b["index"] for b in blocks] == [0, 1, 2, 3]
        b0 = blocks[0]
        assert b0["id"] == first["id"] and b0["gs"] > first["gs"]
        assert b0["volumes"] == [good_vol]
        assert meta_gss(good_vol, b0["id"]) == [b0["gs"]]
        assert meta_gss(failed_vol, b0["id"]) == [first["gs"]], "the failed replica is stale"
        assert data_file(good_vol, b0["id"]).read_bytes() == content[:BLOCK]
        assert direct_read(path) == content
        for b in blocks[1:]:
            assert len(b["volumes"]) == 2, b
    finally:
        os.close(fd)
        if immutable is not None:
            chattr("-i", immutable)
    assert direct_read(path) == content
    errors = error_lines(mount)
    assert errors and all(f"block {first['id']}" in line for line in errors), errors
    assert any("Operation not permitted" in line and str(failed_vol) in line
               for line in errors), errors
    mount.stop()
    # The failed replica's files could not be deleted while immutable; the next mount
    # deletes them and the monitor brings block 0 back to two replicas.
    mount.start()
    wait_for_full_replication(mount, "/long", bytes(content), 2, 4)
    assert meta_gss(failed_vol, first["id"]) in ([], [b0["gs"]])
    finish(mount)


# --- a volume that disappears -------------------------------------------------------------------


def test_volume_moved_away_reads_fail_over(make_fs, tmp_path):
    mount = make_fs(2)
    content = pattern(4, 3 * BLOCK + 100)
    path = mount.mountpoint / "f"
    write_file(path, content)
    blocks = wait_for_full_replication(mount, "/f", content, 2, 4)
    gone = min(blocks[0]["volumes"], key=lambda v: v.name)
    on_gone = [b for b in blocks if gone in b["volumes"]]
    away = gone.with_name(gone.name + ".away")
    gone.rename(away)
    try:
        for _ in range(2):
            assert direct_read(path) == content
        # The monitor drops the replicas it cannot read from the block map and copies each
        # to the spare DISK volume (fsck cannot run while a volume is missing: watch the
        # spare volume's files; the placement xattr still shows two DISK replicas each).
        all_volumes = set(gone.parent.glob("d[0-9]"))  # the DISK volumes still present
        spares = {b["id"]: next(iter(all_volumes - set(b["volumes"]))) for b in on_gone}
        deadline = time.monotonic() + REPAIR_TIMEOUT
        while not all(data_file(spare, bid).exists() and meta_gss(spare, bid)
                      for bid, spare in spares.items()):
            assert time.monotonic() < deadline, mount.log_text()
            time.sleep(0.3)
        assert placement(path) == f"DISK:2 x{len(blocks)}"
        assert direct_read(path) == content
    finally:
        away.rename(gone)
    errors = error_lines(mount)
    assert errors and all(str(gone) in line for line in errors), errors
    assert {int(m) for line in errors for m in re.findall(r"block (\d+)", line)} == \
        {b["id"] for b in on_gone}
    mount.stop()

    # The volume came back before the unmount: the dropped replicas' files, kept in the
    # trash while their volume was away, were deleted at the unmount; nothing is left.
    code, out = fsck(mount.data)
    assert code == 0, out
    for b in on_gone:
        assert not data_file(gone, b["id"]).exists() and meta_gss(gone, b["id"]) == []
    mount.start()
    wait_for_full_replication(mount, "/f", content, 2, 4)
    finish(mount)


# --- stale replicas ------------------------------------------------------------------------------


def _stale_setup(make_fs, tmp_path: Path):
    """A file whose block 0 is appended to after a copy of one replica was saved."""
    mount = make_fs(2)
    path = mount.mountpoint / "f"
    old = pattern(5, 10_000)
    write_file(path, old)
    (b,) = wait_for_full_replication(mount, "/f", old, 2, 1)
    vol = min(b["volumes"], key=lambda v: v.name)      # the replica reads prefer
    saved = tmp_path / "saved"
    saved.mkdir()
    shutil.copy2(data_file(vol, b["id"]), saved / "data")
    shutil.copy2(meta_file(vol, b["id"], b["gs"]), saved / "meta")
    new = old + pattern(6, 5000)
    with open(path, "ab") as f:
        f.write(new[len(old):])
        f.flush()
        os.fsync(f.fileno())
    (b2,) = wait_for_full_replication(mount, "/f", new, 2, 1)
    assert b2["id"] == b["id"] and b2["gs"] > b["gs"]
    assert b2["volumes"] == b["volumes"]

    def put_back() -> None:
        """Replace the replica on ``vol`` by the saved, older one."""
        for gs in meta_gss(vol, b["id"]):
            meta_file(vol, b["id"], gs).unlink()
        data_file(vol, b["id"]).unlink()
        shutil.copy2(saved / "data", data_file(vol, b["id"]))
        shutil.copy2(saved / "meta", meta_file(vol, b["id"], b["gs"]))

    return mount, path, new, b2, vol, put_back


def test_stale_replica_is_never_served_and_replaced(make_fs, tmp_path):
    mount, path, new, b, vol, put_back = _stale_setup(make_fs, tmp_path)
    put_back()
    assert direct_read(path) == new
    wait_for_full_replication(mount, "/f", new, 2, 1)
    assert direct_read(path) == new
    errors = error_lines(mount)
    assert errors and all(f"block {b['id']}" in line and str(vol) in line
                          for line in errors), errors
    finish(mount)


def test_stale_replica_put_back_while_unmounted_is_never_served(make_fs, tmp_path):
    mount, path, new, b, vol, put_back = _stale_setup(make_fs, tmp_path)
    mount.stop()
    put_back()
    mount.start()
    assert direct_read(path) == new
    wait_for_full_replication(mount, "/f", new, 2, 1)
    assert meta_gss(vol, b["id"]) in ([], [b["gs"]])
    finish(mount)


def test_stale_replica_removed_by_fsck_repair(make_fs, tmp_path):
    mount, path, new, b, vol, put_back = _stale_setup(make_fs, tmp_path)
    mount.stop()
    put_back()
    code, out = fsck(mount.data)
    assert code == 1 and problem_kinds(out) == ["STALE_REPLICA"], out
    assert f"older than the namespace's {b['gs']}" in out, out
    code, out = fsck(mount.data, "--repair")
    assert code == 1 and "0 left" in out, out
    assert not data_file(vol, b["id"]).exists() and meta_gss(vol, b["id"]) == []
    code, out = fsck(mount.data)
    assert code == 0, out
    mount.start()
    assert direct_read(path) == new
    wait_for_full_replication(mount, "/f", new, 2, 1)
    assert not any(" ERROR" in line for line in mount.log_text().splitlines()), mount.log_text()
    finish(mount)


# --- a replication raised on a live mount ---------------------------------------------------------


def test_replication_raised_by_setfattr_or_rename_is_met_at_once(make_fs):
    """Raising the replication of a file, of a directory above files, or moving a file
    under such a directory (or removing the first name of a hard-linked file whose other
    name is there), makes the monitor copy the blocks now, as HDFS's setrep does. Before:
    nothing happened until the next mount's scan."""
    mount = make_fs(1)
    mnt = mount.mountpoint
    (mnt / "d").mkdir()
    contents = {rel: pattern(i, 2 * BLOCK + 100) for i, rel in enumerate(("/f", "/d/g", "/h"))}
    for rel, content in contents.items():
        write_file(mnt / rel.lstrip("/"), content)
        wait_for_full_replication(mount, rel, content, 1, 3)
    os.setxattr(mnt / "f", "user.tierfs.replication", b"2")
    wait_for_full_replication(mount, "/f", contents["/f"], 2, 3)
    os.setxattr(mnt / "d", "user.tierfs.replication", b"3")
    wait_for_full_replication(mount, "/d/g", contents["/d/g"], 3, 3)
    os.rename(mnt / "h", mnt / "d" / "h")
    wait_for_full_replication(mount, "/d/h", contents["/h"], 3, 3)
    # A hard link's first name decides; when it goes, the file takes the next one's value.
    for i, how in enumerate(("unlink", "replace")):
        first, second = mnt / f"first{i}", mnt / "d" / f"second{i}"
        content = pattern(10 + i, BLOCK + 1)
        write_file(first, content)
        os.link(first, second)
        wait_for_full_replication(mount, f"/d/second{i}", content, 1, 2)
        if how == "unlink":
            first.unlink()
        else:
            write_file(mnt / "other", b"other")
            os.rename(mnt / "other", first)
        wait_for_full_replication(mount, f"/d/second{i}", content, 3, 2)
    os.removexattr(mnt / "f", "user.tierfs.replication")   # lowered: the surplus stays
    assert os.getxattr(mnt / "f", "user.tierfs.replication") == b"1"
    assert os.getxattr(mnt / "f", "user.tierfs.satisfied").startswith(b"no: 3 of 3 blocks have more")
    finish(mount)


# --- replica files the namespace does not record on their volume -------------------------------


def test_mount_records_an_unrecorded_replica_the_block_needs_and_removes_a_surplus_one(make_fs):
    """A whole copy of a block on a volume the block is not recorded on (a copy whose
    recording a crash lost) is verified and recorded by the mount's volume scan when the
    block needs it: here it saves block 0, whose recorded replica is corrupt. Block 1's
    recorded replica is good, so its copy is surplus and removed. Before: both copies were
    deleted as orphans, and reads of block 0 gave EIO."""
    mount = make_fs(1)
    path = mount.mountpoint / "f"
    content = pattern(11, 3 * BLOCK)
    write_file(path, content)
    b0, b1, _ = wait_for_full_replication(mount, "/f", content, 1, 3)
    mount.stop()
    disks = [mount.data / d for d in ("d1", "d2", "d3")]
    spare0 = next(v for v in disks if v not in b0["volumes"])
    spare1 = next(v for v in disks if v not in b1["volumes"])
    for block, spare in ((b0, spare0), (b1, spare1)):
        leaf_dir(spare, block["id"]).mkdir(parents=True, exist_ok=True)
        shutil.copy2(data_file(block["volumes"][0], block["id"]), data_file(spare, block["id"]))
        shutil.copy2(meta_file(block["volumes"][0], block["id"], block["gs"]),
                     meta_file(spare, block["id"], block["gs"]))
    flip_byte(data_file(b0["volumes"][0], b0["id"]), 5000)   # the recorded replica of b0
    mount.start()
    log = mount.log_text()
    assert (f"replica of block {b0['id']} on volume" in log
            and "which needs it, and is now recorded" in log), log
    assert (f"unrecorded files of block {b1['id']} on volume" in log
            and "surplus: the block has 1 good replica(s) for replication 1" in log), log
    assert not data_file(spare1, b1["id"]).exists() and meta_gss(spare1, b1["id"]) == []
    assert direct_read(path) == content
    # The read failed over from the corrupt replica, which the monitor then drops.
    wait_for_full_replication(mount, "/f", content, 1, 3)
    assert blocks_of(mount.data, "/f")[0]["volumes"] == [spare0]
    finish(mount)


# --- a write that meets a corrupt replica -------------------------------------------------------


def test_write_into_a_corrupt_chunk_drops_that_replica(make_fs, tmp_path):
    """A write that cuts into the middle of a chunk checks the chunk's old bytes first, so a
    corrupt replica is never blessed with a fresh checksum: that replica leaves the write
    pipeline (new stamp on the others) and is replaced once the file is closed."""
    mount = make_fs(2)
    path = mount.mountpoint / "f"
    content = bytearray(pattern(7, 2 * BLOCK + 500))
    write_file(path, bytes(content))
    before = wait_for_full_replication(mount, "/f", bytes(content), 2, 3)
    b0 = before[0]
    bad_vol, good_vol = sorted(b0["volumes"])
    flip_byte(data_file(bad_vol, b0["id"]), CHUNK + 10)         # chunk 1 of block 0
    # O_DIRECT: the write reaches the daemon as it is, not as a page the kernel rewrote.
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        piece = pattern(8, 100)
        assert os.pwrite(fd, piece, CHUNK + 100) == 100      # cuts into chunk 1
        content[CHUNK + 100:CHUNK + 200] = piece
        (b0_now, *_) = blocks_of(mount.data, "/f")
        assert b0_now["id"] == b0["id"] and b0_now["gs"] > b0["gs"]
        assert b0_now["volumes"] == [good_vol]
        assert meta_gss(good_vol, b0["id"]) == [b0_now["gs"]]
        assert data_file(good_vol, b0["id"]).read_bytes() == content[:BLOCK]
    finally:
        os.close(fd)
    assert direct_read(path) == content
    after = wait_for_full_replication(mount, "/f", bytes(content), 2, 3)
    assert after[0]["gs"] == b0_now["gs"] and after[1:] == before[1:]
    errors = error_lines(mount)
    assert errors and all(f"block {b0['id']}" in line and str(bad_vol) in line
                          for line in errors), errors
    assert any("checksum error" in line for line in errors), errors
    finish(mount)


# --- kill -9 in the middle of a replicated write --------------------------------------------------


def test_kill_during_a_replicated_write_recovers_the_lease(make_fs, tmp_path):
    """kill -9 while a file is open for writing on two replicas, and one replica's last data
    write got to its data file but not to its checksums (the crash table of
    ``backends/replica.py``). The next mount recovers the lease: nothing fsynced is lost,
    the unsynced tail is kept only where it is whole, both replicas end with the same bytes
    and a new generation stamp, and fsck is clean."""
    mount = make_fs(2)
    path = mount.mountpoint / "f"
    written = pattern(9, 130_000)
    synced = 100_000                                  # mid-chunk, in block 1
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert os.write(fd, written[:synced]) == synced
        os.fsync(fd)
        before = blocks_of(mount.data, "/f")
        assert os.write(fd, written[synced:]) == len(written) - synced
        mount.kill()
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    last = max(before, key=lambda b: b["index"])
    assert last["index"] == 1
    torn = min(last["volumes"], key=lambda v: v.name)
    with open(data_file(torn, last["id"]), "ab") as f:
        f.write(b"\xee" * 777)                        # data without its checksums
    mount.start()
    assert any("recovered lease" in line for line in mount.log_text().splitlines())
    size = os.stat(path).st_size
    assert synced <= size <= len(written)
    got = direct_read(path)
    assert got[:synced] == written[:synced]
    assert all(a == b or a == 0 for a, b in zip(got[synced:], written[synced:size])), \
        "bytes after the fsynced length are neither what was written nor zero"
    blocks = wait_for_full_replication(mount, "/f", got, 2, 2)
    assert blocks[0]["gs"] == before[0]["gs"] and blocks[1]["gs"] > last["gs"]
    assert blocks[1]["len"] == size - BLOCK
    assert not error_lines(mount), mount.log_text()
    finish(mount)


# --- regressions: bugs these fault tests found (B1-B8 of the issue-4 fault campaign) ---------

def wait_placement(path: Path, wanted: str, mount) -> None:
    deadline = time.monotonic() + REPAIR_TIMEOUT
    while placement(path) != wanted:
        if time.monotonic() > deadline:
            pytest.fail(f"placement {placement(path)!r}, want {wanted!r}\n{mount.log_text()}")
        time.sleep(0.3)


def test_B1_block_dropped_from_pipeline_is_rereplicated_while_mounted(make_fs):
    mount = make_fs(2)
    path = mount.mountpoint / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    content = pattern(1, 20_000)
    os.write(fd, content)
    os.fsync(fd)
    (b,) = blocks_of(mount.data, "/f")
    failed = min(b["volumes"])
    victim = data_file(failed, b["id"])
    chattr("+i", victim)
    try:
        more = pattern(2, 20_000)
        os.write(fd, more)
        os.fsync(fd)
        content += more
    finally:
        chattr("-i", victim)
        os.close(fd)
    # The volume is writable again and d3 was always empty: within seconds, two replicas.
    wait_for_full_replication(mount, "/f", content, 2, 1)
    finish(mount)


def test_B2_gs_bump_drops_a_replica_whose_meta_cannot_be_renamed(make_fs):
    mount = make_fs(2)
    path = mount.mountpoint / "f"
    content = pattern(3, 10_000)
    write_file(path, content)
    (b,) = wait_for_full_replication(mount, "/f", content, 2, 1)
    failed = min(b["volumes"])
    chattr("+i", leaf_dir(failed, b["id"]))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_DIRECT)
        try:
            piece = pattern(4, 4096)
            assert os.write(fd, piece) == 4096          # EIO today
            content += piece
        finally:
            os.close(fd)
        (b2,) = blocks_of(mount.data, "/f")
        assert b2["gs"] > b["gs"] and failed not in b2["volumes"]
    finally:
        chattr("-i", leaf_dir(failed, b["id"]))
    assert direct_read(path) == content


def test_B3_replicas_on_a_vanished_volume_are_recopied_to_the_spare(make_fs):
    mount = make_fs(2)
    path = mount.mountpoint / "f"
    content = pattern(5, 2 * BLOCK)
    write_file(path, content)
    blocks = wait_for_full_replication(mount, "/f", content, 2, 2)
    gone = min(blocks[0]["volumes"])
    away = gone.with_name(gone.name + ".away")
    gone.rename(away)
    try:
        assert direct_read(path) == content
        spare = mount.data / "d3"
        deadline = time.monotonic() + REPAIR_TIMEOUT
        while not all(data_file(spare, b["id"]).exists() for b in blocks):
            if time.monotonic() > deadline:                # nothing reaches d3 today
                pytest.fail(f"placement {placement(path)!r}\n{mount.log_text()}")
            time.sleep(0.3)
        wait_placement(path, "DISK:2 x2", mount)
    finally:
        away.rename(gone)


def test_B4_new_blocks_avoid_a_vanished_volume(make_fs):
    mount = make_fs(2)
    gone = mount.data / "d1"
    away = mount.data / "d1.away"
    gone.rename(away)
    try:
        path = mount.mountpoint / "new"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"x" * 5000)
            os.fsync(fd)                                  # EIO today
        finally:
            os.close(fd)
        assert placement(path) == "DISK:2 x1"
    finally:
        away.rename(gone)


def test_B5_stale_replica_found_at_mount_is_dropped_and_replaced(make_fs, tmp_path):
    mount, path, new, b, vol, put_back = _stale_setup(make_fs, tmp_path)
    mount.stop()
    put_back()
    mount.start()
    # No read: the mount itself must notice (its volume scan removes the stale meta file).
    wait_for_full_replication(mount, "/f", new, 2, 1)
    finish(mount)


def test_B6_short_replica_data_file_is_never_served_as_zeros(make_fs):
    mount = make_fs(2)
    path = mount.mountpoint / "f"
    content = pattern(6, BLOCK + 100)
    write_file(path, content)
    (b0, _) = wait_for_full_replication(mount, "/f", content, 2, 2)
    os.truncate(data_file(min(b0["volumes"]), b0["id"]), 2 * CHUNK)
    assert direct_read(path, 4 * CHUNK, 4 * CHUNK) == content[4 * CHUNK:8 * CHUNK]
    logged = error_lines(mount)
    assert logged and all(f"block {b0['id']} (index 0)" in line for line in logged), logged


def _kill_with_synced_file(mount):
    path = mount.mountpoint / "f"
    written = pattern(9, 100_000)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, written)
    os.fsync(fd)
    blocks = blocks_of(mount.data, "/f")
    mount.kill()
    try:
        os.close(fd)
    except OSError:
        pass
    return path, written, blocks[-1]


def test_B7_lease_recovery_keeps_fsynced_data_when_a_replica_is_short(make_fs):
    mount = make_fs(2)
    path, written, last = _kill_with_synced_file(mount)
    os.truncate(data_file(min(last["volumes"]), last["id"]), 20_000)
    mount.start()
    assert direct_read(path) == written                # zeros after the cut today
    mount.stop()
    code, out = fsck(mount.data)
    assert code == 0, out


def test_B8_lease_recovery_never_blesses_a_corrupt_fsynced_chunk(make_fs):
    mount = make_fs(2)
    path, written, last = _kill_with_synced_file(mount)
    f = data_file(min(last["volumes"]), last["id"])
    raw = bytearray(f.read_bytes())
    raw[9000] ^= 0xFF
    f.write_bytes(bytes(raw))
    mount.start()
    assert direct_read(path) == written                # the flipped byte is served today
