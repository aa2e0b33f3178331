"""File data against a bytearray model, through a real mount, down to the replica files.

A Hypothesis state machine drives one file per example through three handles that stay open
(a read-write handle, an O_APPEND handle and a read-only handle): appends, overwrites at any
offset (across block and checksum-chunk boundaries, and past EOF, leaving holes), truncates up
and down by path and by ftruncate, fsync, close and reopen, reads through the page cache and
through O_DIRECT (which reaches the daemon). Every read must equal the model exactly.

When an example ends, the file is checked where the data really lives. ``tierfs fsck PATH
--files --blocks --locations`` (read-only, beside the mount) gives the namespace's block map;
then, for every block: it lies inside the file, it has exactly ``replication`` replicas on
distinct volumes, all healthy; each replica is one data file and one meta file named with the
block's generation stamp; the replicas are identical byte for byte (data and meta) and equal
the model's bytes of that block; every non-zero byte of the model is stored in some block.

The filesystems have 64 KiB blocks and 4 KiB chunks, so blocks are crossed all the time: one
with the default layout and replication 1, one with three DISK volumes and replication 3
(every block on every volume). Each is mounted once for its machine run; after the run it is
unmounted, the daemon must have logged no error, fsck must report nothing, and the volumes
must agree with one another (same blocks, same stamps, same bytes) with generation stamps
unique across blocks (they come from one global counter).

``test_generation_stamps_follow_write_sessions`` pins down the stamp rules themselves (seed
002): a new block gets a new stamp; the first change of an existing block in a write session
takes a new one, on every replica, and later changes in that session keep it; a truncate that
cuts into a block re-stamps it and drops the blocks beyond; growing a file makes no block.
"""

from __future__ import annotations

import mmap
import os
import random
import re
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, rule,
                                 run_state_machine_as_test)

from tests.conftest import Mount, pread_all, run_tool

BLOCK = 64 * 1024
CHUNK = 4096
PAGE = mmap.PAGESIZE
SMALL_BLOCKS = ("--block-size", "64K", "--bytes-per-checksum", "4096")
MAX_OFFSET = 6 * BLOCK
MAX_WRITE = BLOCK + BLOCK // 2

BLOCK_LINE = re.compile(r"^(\d+)\. blk_(\d+)_(\d+) len=(\d+) Live_repl=(\d+)(.*)$")
LOCATION = re.compile(r"\[([^,\]]+),([^,\]]+),([A-Z_]+)\](\([A-Z]+\))?")
FILE_LINE = re.compile(r"^(/\S*) (\d+) bytes, replication=(\d+), (\d+) block\(s\)")
META_NAME = re.compile(r"^blk_(\d+)_(\d+)\.meta$")


# --- helpers ----------------------------------------------------------------------------------


def three_disk_args(data: Path, replication: int) -> list[str]:
    return [*(f"--volume=DISK:{data / n}" for n in ("d1", "d2", "d3")),
            "--replication", str(replication)]


def volumes_of(data: Path) -> list[Path]:
    """The volume directories of a filesystem (each has an identity file)."""
    return sorted(p.parent for p in data.glob("*/VERSION"))


def leaf_dir(volume: Path, block_id: int) -> Path:
    return (volume / "current" / "finalized" / f"subdir{(block_id >> 16) & 0x1F}"
            / f"subdir{(block_id >> 8) & 0x1F}")


def replica_files(volume: Path, block_id: int) -> tuple[Path | None, list[tuple[int, Path]]]:
    """(data file or None, [(gs, meta file)]) of one block on one volume."""
    leaf = leaf_dir(volume, block_id)
    data = leaf / f"blk_{block_id}"
    metas = []
    if leaf.is_dir():
        for name in os.listdir(leaf):
            m = META_NAME.match(name)
            if m and int(m.group(1)) == block_id:
                metas.append((int(m.group(2)), leaf / name))
    return (data if data.exists() else None), sorted(metas)


def all_replicas(volume: Path) -> dict[int, tuple[bytes, list[str]]]:
    """Every block on a volume: block id -> (data bytes, sorted meta file names)."""
    out: dict[int, tuple[bytes, list[str]]] = {}
    for data in (volume / "current" / "finalized").glob("subdir*/subdir*/blk_*"):
        if data.name.endswith(".meta"):
            continue
        block_id = int(data.name[4:])
        _, metas = replica_files(volume, block_id)
        out[block_id] = (data.read_bytes(), [m.name for _, m in metas])
    metas_alone = {int(META_NAME.match(p.name).group(1))
                   for p in (volume / "current" / "finalized").glob("subdir*/subdir*/*.meta")}
    assert metas_alone <= out.keys(), f"meta files without data on {volume}: " \
                                      f"{sorted(metas_alone - out.keys())}"
    return out


def fsck_blocks(data: Path, path: str) -> tuple[dict, list[dict]]:
    """The namespace's view of one file from ``tierfs fsck PATH --files --blocks
    --locations`` (which must exit 0): the file line and one dict per block."""
    result = run_tool("fsck", str(data), path, "--files", "--blocks", "--locations",
                      check=False)
    assert result.returncode == 0, f"fsck {path}:\n{result.stdout}\n{result.stderr}"
    file_info, blocks = None, []
    for line in result.stdout.splitlines():
        m = FILE_LINE.match(line)
        if m and m.group(1) == path:
            file_info = {"size": int(m.group(2)), "replication": int(m.group(3)),
                         "blocks": int(m.group(4))}
            continue
        m = BLOCK_LINE.match(line)
        if m:
            blocks.append({
                "index": int(m.group(1)), "id": int(m.group(2)), "gs": int(m.group(3)),
                "len": int(m.group(4)), "live": int(m.group(5)),
                "locations": [(Path(v), t, mark) for v, _, t, mark in LOCATION.findall(m.group(6))],
            })
    assert file_info is not None, f"fsck did not list {path}:\n{result.stdout}"
    assert file_info["blocks"] == len(blocks), result.stdout
    return file_info, blocks


def check_file_blocks(data: Path, mnt: Path, path: Path, model: bytes, replication: int,
                      types: set[str]) -> list[dict]:
    """The block map and the replica files of one closed file against its model."""
    rel = "/" + str(path.relative_to(mnt))
    info, blocks = fsck_blocks(data, rel)
    assert info["size"] == len(model), (info, len(model))
    assert info["replication"] == replication
    covered = bytearray(len(model))
    indexes = [b["index"] for b in blocks]
    assert indexes == sorted(set(indexes)), f"block indexes {indexes}"
    for b in blocks:
        start = b["index"] * BLOCK
        where = f"{rel} block {b['index']} (blk_{b['id']}_{b['gs']})"
        assert 0 < b["len"] <= BLOCK, f"{where}: length {b['len']}"
        assert start + b["len"] <= len(model), f"{where}: stored beyond EOF {len(model)}"
        assert b["live"] == replication, f"{where}: Live_repl {b['live']}"
        vols = [v for v, _, _ in b["locations"]]
        assert len(vols) == replication == len(set(vols)), f"{where}: on {vols}"
        assert all(mark == "" for _, _, mark in b["locations"]), f"{where}: {b['locations']}"
        assert {t for _, t, _ in b["locations"]} <= types, f"{where}: {b['locations']}"
        want = model[start:start + b["len"]]
        first = None
        for vol in vols:
            data_file, metas = replica_files(vol, b["id"])
            assert data_file is not None, f"{where}: no data file on {vol}"
            assert [gs for gs, _ in metas] == [b["gs"]], f"{where}: meta files {metas} on {vol}"
            content = (data_file.read_bytes(), metas[0][1].read_bytes())
            assert content[0] == want, f"{where}: replica on {vol} differs from the model"
            if first is None:
                first = content
            assert content == first, f"{where}: replicas differ ({vol})"
        covered[start:start + b["len"]] = bytes([1]) * b["len"]
    unstored = [i for i, byte in enumerate(model) if byte and not covered[i]]
    assert not unstored, f"{rel}: non-zero bytes at {unstored[:5]}... are in no block"
    return blocks


def check_volumes_agree(data: Path, replication: int) -> None:
    """After unmount: one meta file per replica, stamps unique per block; with replication
    equal to the number of volumes, every volume holds the same blocks, byte for byte."""
    volumes = volumes_of(data)
    per_volume = {v: all_replicas(v) for v in volumes}
    stamps: dict[int, int] = {}
    for vol, replicas in per_volume.items():
        for block_id, (_, metas) in replicas.items():
            assert len(metas) == 1, f"blk_{block_id} on {vol}: meta files {metas}"
            gs = int(META_NAME.match(metas[0]).group(2))
            assert stamps.setdefault(block_id, gs) == gs, f"blk_{block_id}: stamps differ"
    gss = list(stamps.values())
    assert len(gss) == len(set(gss)), "two blocks share a generation stamp"
    counts = {}
    for replicas in per_volume.values():
        for block_id in replicas:
            counts[block_id] = counts.get(block_id, 0) + 1
    assert set(counts.values()) <= {replication}, counts
    if replication == len(volumes):
        first = per_volume[volumes[0]]
        for vol in volumes[1:]:
            assert per_volume[vol] == first, f"{vol} differs from {volumes[0]}"


def write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        assert n > 0
        view = view[n:]
        if offset is not None:
            offset += n


def direct_read(path: Path, offset: int, size: int) -> bytes:
    """O_DIRECT read of the page-aligned range around [offset, offset+size): the daemon's data."""
    start = offset - offset % PAGE
    span = max(PAGE, -(-(offset + size - start) // PAGE) * PAGE)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, span)
        got = bytearray()
        pos = start
        while len(got) < span:
            n = os.preadv(fd, [buf], pos)
            if n <= 0:
                break
            got += buf[:n]
            pos += n
            if n < span:
                break
        buf.close()
    finally:
        os.close(fd)
    return bytes(got[offset - start:offset - start + size])


# --- the filesystems (one mount each, for the whole module) ----------------------------------


class FsUnderTest:
    def __init__(self, base: Path, replication: int, mkfs_args: list[str], types: set[str]):
        self.data = base / "data"
        self.replication = replication
        self.types = types
        run_tool("mkfs", str(self.data), *SMALL_BLOCKS, *mkfs_args)
        self.mount = Mount(self.data, base / "mnt").start()
        self.mnt = self.mount.mountpoint
        self.counter = 0

    def finish(self) -> None:
        self.mount.stop()
        assert not self.mount.errors_logged(), self.mount.log_text()
        result = run_tool("fsck", str(self.data), check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        check_volumes_agree(self.data, self.replication)


@pytest.fixture(scope="module")
def fs_r1(tmp_path_factory):
    fs = FsUnderTest(tmp_path_factory.mktemp("r1"), 1, [], {"DISK"})
    yield fs
    fs.finish()


@pytest.fixture(scope="module")
def fs_r3(tmp_path_factory):
    base = tmp_path_factory.mktemp("r3")
    fs = FsUnderTest(base, 3, three_disk_args(base / "data", 3), {"DISK"})
    yield fs
    fs.finish()


# --- the machine --------------------------------------------------------------------------------

offsets = st.one_of(
    st.integers(0, MAX_OFFSET),
    st.builds(lambda b, d: max(0, b * BLOCK + d), st.integers(0, 6), st.integers(-3, 3)),
    st.builds(lambda c, d: max(0, c * CHUNK + d), st.integers(0, 96), st.integers(-2, 2)),
)
lengths = st.one_of(st.integers(1, MAX_WRITE), st.integers(1, 300),
                    st.sampled_from([BLOCK, CHUNK, BLOCK - 1, BLOCK + 1]))
seeds = st.integers(0, 2**32 - 1)


class DataModel(RuleBasedStateMachine):
    """One file, three open handles, and the bytearray it must equal."""

    def __init__(self, fs: FsUnderTest):
        super().__init__()
        self.fs = fs
        fs.counter += 1
        self.path = fs.mnt / f"model{fs.counter}"
        self.model = bytearray()
        self.history: list[str] = []
        self.rw = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._open_others()

    def _open_others(self) -> None:
        self.app = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.ro = os.open(self.path, os.O_RDONLY)

    def _close_all(self) -> None:
        for fd in (self.rw, self.app, self.ro):
            os.close(fd)

    def _note(self, text: str) -> None:
        self.history.append(text)

    def _compare(self, what: str, offset: int, got: bytes, want: bytes) -> None:
        if got == want:
            return
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     min(len(got), len(want)))
        raise AssertionError(
            f"{what} at {offset}: got {len(got)} bytes, want {len(want)}; first difference at "
            f"{offset + first}; size {len(self.model)}; operations:\n  "
            + "\n  ".join(self.history[-15:]))

    def _resize_model(self, size: int) -> None:
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model.extend(bytes(size - len(self.model)))

    # --- rules --------------------------------------------------------------------------------

    @rule(length=lengths, seed=seeds)
    def append(self, length, seed):
        data = random.Random(seed).randbytes(length)
        self._note(f"append +{length} (at {len(self.model)})")
        write_all(self.app, data)
        self.model += data

    @rule(offset=offsets, length=lengths, seed=seeds)
    def overwrite(self, offset, length, seed):
        data = random.Random(seed).randbytes(length)
        self._note(f"pwrite {offset} +{length}")
        write_all(self.rw, data, offset)
        if offset + length > len(self.model):
            self._resize_model(offset + length)
        self.model[offset:offset + length] = data

    @rule(size=offsets)
    def truncate_path(self, size):
        self._note(f"truncate(path) {len(self.model)} -> {size}")
        os.truncate(self.path, size)
        self._resize_model(size)

    @rule(size=offsets)
    def ftruncate(self, size):
        self._note(f"ftruncate {len(self.model)} -> {size}")
        os.ftruncate(self.rw, size)
        self._resize_model(size)

    @rule(append_handle=st.booleans())
    def fsync(self, append_handle):
        self._note(f"fsync ({'append' if append_handle else 'rw'} handle)")
        assert os.fsync(self.app if append_handle else self.rw) is None

    @rule()
    def close_and_reopen(self):
        self._note("close all, reopen")
        self._close_all()
        self.rw = os.open(self.path, os.O_RDWR)
        self._open_others()

    @rule(offset=offsets, length=lengths, read_only_handle=st.booleans())
    def read(self, offset, length, read_only_handle):
        self._note(f"read {offset} +{length}")
        got = pread_all(self.ro if read_only_handle else self.rw, length, offset)
        self._compare("read", offset, got, bytes(self.model[offset:offset + length]))

    @rule(offset=offsets, length=lengths)
    def direct_read(self, offset, length):
        # fsync first: the kernel's writeback cache may hold pages the daemon has not seen,
        # and an O_DIRECT read flushes only the range it reads.
        self._note(f"fsync + O_DIRECT read {offset} +{length}")
        os.fsync(self.rw)
        got = direct_read(self.path, offset, length)
        self._compare("O_DIRECT read", offset, got, bytes(self.model[offset:offset + length]))

    @invariant()
    def sizes_agree(self):
        sizes = {"fstat rw": os.fstat(self.rw).st_size, "fstat ro": os.fstat(self.ro).st_size,
                 "fstat append": os.fstat(self.app).st_size,
                 "stat": os.stat(self.path).st_size}
        wrong = {k: v for k, v in sizes.items() if v != len(self.model)}
        assert not wrong, f"sizes {wrong}, model {len(self.model)}; operations:\n  " + \
            "\n  ".join(self.history[-15:])

    def teardown(self):
        self._close_all()
        model = bytes(self.model)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._compare("final read", 0, pread_all(fd, len(model) + 1, 0), model)
        finally:
            os.close(fd)
        self._compare("final O_DIRECT read", 0, direct_read(self.path, 0, len(model) + 1), model)
        check_file_blocks(self.fs.data, self.fs.mnt, self.path, model, self.fs.replication,
                          self.fs.types)


MACHINE_SETTINGS = settings(max_examples=18, stateful_step_count=30, deadline=None,
                            derandomize=True, database=None,
                            suppress_health_check=list(HealthCheck))


@pytest.mark.timeout(300)
def test_data_model_replication_1(fs_r1):
    run_state_machine_as_test(lambda: DataModel(fs_r1), settings=MACHINE_SETTINGS)


@pytest.mark.timeout(300)
def test_data_model_replication_3(fs_r3):
    run_state_machine_as_test(lambda: DataModel(fs_r3), settings=MACHINE_SETTINGS)


# --- generation stamps, step by step -----------------------------------------------------------


def stamps(fs: FsUnderTest, path: Path, model: bytes) -> dict[int, tuple[int, int]]:
    """index -> (block id, gs), after checking the blocks and replicas against the model."""
    blocks = check_file_blocks(fs.data, fs.mnt, path, model, fs.replication, fs.types)
    return {b["index"]: (b["id"], b["gs"]) for b in blocks}


def test_generation_stamps_follow_write_sessions(fs_r3):
    fs = fs_r3
    path = fs.mnt / "stamps"
    rng = random.Random(71)
    model = bytearray(rng.randbytes(2 * BLOCK + BLOCK // 2))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    write_all(fd, bytes(model))
    os.fsync(fd)
    os.close(fd)
    s0 = stamps(fs, path, model)
    assert sorted(s0) == [0, 1, 2]
    gs0 = [s0[i][1] for i in range(3)]
    assert gs0 == sorted(set(gs0)), f"new blocks, new increasing stamps: {gs0}"

    # Appending: the partial last block takes a new stamp at the first change; a second
    # change in the same session keeps it. Full blocks are untouched.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    piece = rng.randbytes(100)
    write_all(fd, piece)
    model += piece
    os.fsync(fd)
    s1 = stamps(fs, path, model)
    assert s1[0] == s0[0] and s1[1] == s0[1]
    assert s1[2][0] == s0[2][0] and s1[2][1] > max(gs0)
    piece = rng.randbytes(300)
    write_all(fd, piece)
    model += piece
    os.fsync(fd)
    assert stamps(fs, path, model) == s1, "a second change in one session keeps the stamp"
    os.close(fd)

    # A new session that overwrites block 0 re-stamps block 0 only.
    fd = os.open(path, os.O_RDWR)
    piece = rng.randbytes(10)
    write_all(fd, piece, 10)
    model[10:20] = piece
    os.fsync(fd)
    s2 = stamps(fs, path, model)
    assert s2[0][0] == s0[0][0] and s2[0][1] > s1[2][1]
    assert s2[1] == s0[1] and s2[2] == s1[2]

    # Truncate into block 1: block 2 is dropped (its files leave every volume), block 1 is
    # cut under a new stamp, block 0 keeps its stamp.
    os.truncate(path, BLOCK + 1000)
    del model[BLOCK + 1000:]
    s3 = stamps(fs, path, model)
    assert sorted(s3) == [0, 1]
    assert s3[0] == s2[0]
    assert s3[1][0] == s0[1][0] and s3[1][1] > s2[0][1]
    # The dropped block's files go once the drop is synced: the next tick, about a second.
    deadline = time.monotonic() + 5
    for vol in volumes_of(fs.data):
        while replica_files(vol, s0[2][0]) != (None, []) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replica_files(vol, s0[2][0]) == (None, []), f"dropped block left on {vol}"

    # Growing makes a hole, not a block; stamps stay.
    os.ftruncate(fd, 3 * BLOCK)
    model.extend(bytes(3 * BLOCK - len(model)))
    os.fsync(fd)
    os.close(fd)
    assert stamps(fs, path, model) == s3
    assert direct_read(path, 0, len(model) + 1) == model
