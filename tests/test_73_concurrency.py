"""Concurrency through a real mount: processes that read, write, truncate, append, create,
rename and unlink at the same time, and the tools run beside a busy mount.

Every actor is a separate Python process (``sys.executable -c``) so that the kernel, not the
test, decides the interleaving. Actors check what they see themselves and exit non-zero with
a message on the first wrong byte; the test then checks the final state exactly and, after
unmount, that the daemon logged no error and fsck reports nothing.

- Readers beside an appending writer (seed 002: single writer, many readers; new data is
  visible before close): every read returns a prefix of the final content, never other
  bytes, and a reader's prefix never shrinks. Buffered, held-open and O_DIRECT readers.
- A reader holding a handle while other processes truncate the file: reads after the
  truncate return the new content or EOF, never EIO; under a truncate/rewrite storm every
  byte read is the file's byte at that offset or zero.
- O_APPEND from two processes: every record lands whole, none is lost, each writer's records
  keep their order.
- Many processes creating, writing, renaming (also over one shared name) and unlinking in
  one directory: the directory ends with exactly the expected names and contents.
- A writer beside ``tierfs report`` and ``tierfs fsck`` (read-only): both succeed and fsck
  finds nothing wrong while files are written, grown, truncated, created and deleted.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, assert_fsck_clean, evict, run_tool

BLOCK = 64 * 1024
SMALL_BLOCKS = ("--block-size", "64K", "--bytes-per-checksum", "4096")
ACTOR_TIMEOUT = 90


# --- helpers ----------------------------------------------------------------------------------

# Shared by every actor: deterministic content, O_DIRECT reads, a done-file to stop loops.
PRELUDE = r"""
import errno, json, mmap, os, random, sys, time
def content(seed, size):
    return random.Random(seed).randbytes(size)
def read_all(fd, limit):
    out = bytearray()
    while len(out) < limit:
        piece = os.pread(fd, min(1 << 20, limit - len(out)), len(out))
        if not piece:
            break
        out += piece
    return bytes(out)
def direct_read_all(path, limit):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 1 << 20)
    out = bytearray()
    try:
        while len(out) < limit:
            n = os.preadv(fd, [buf], len(out))
            if n <= 0:
                break
            out += buf[:n]
            if n % 4096:
                break
    finally:
        buf.close()
        os.close(fd)
    return bytes(out[:limit])
def fail(msg):
    sys.stderr.write(msg + "\n")
    sys.exit(1)
"""


def spawn(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + code, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(procs: list[subprocess.Popen], timeout: float = ACTOR_TIMEOUT) -> list[str]:
    """Wait for every actor; each must exit 0. Returns their stdouts."""
    outs = []
    deadline = time.monotonic() + timeout
    failures = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"actor {proc.args[3:]} timed out: {err}")
            continue
        if proc.returncode != 0:
            failures.append(f"actor {proc.args[3:]} exited {proc.returncode}: {err}")
        outs.append(out)
    assert not failures, "\n".join(failures)
    return outs


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def direct_read(path: Path) -> bytes:
    size = os.stat(path).st_size
    span = max(4096, -(-size // 4096) * 4096)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, span)
        got = bytearray()
        while len(got) < span:
            n = os.preadv(fd, [buf], len(got))
            if n <= 0:
                break
            got += buf[:n]
        buf.close()
    finally:
        os.close(fd)
    return bytes(got)


@pytest.fixture
def replicated(tmp_path):
    """Three DISK volumes, replication 2, 64 KiB blocks: writes go through a pipeline of two
    replicas. At the end: clean unmount, no logged error, fsck clean."""
    data = tmp_path / "data"
    run_tool("mkfs", str(data), *SMALL_BLOCKS, "--replication", "2",
             *(f"--volume=DISK:{data / d}" for d in ("d1", "d2", "d3")))
    mount = Mount(data, tmp_path / "mnt").start()
    yield mount
    if mount.proc is not None:
        mount.stop()
    assert not mount.errors_logged(), "\n".join(mount.errors_logged())
    assert_fsck_clean(data)


# --- readers beside an appending writer ---------------------------------------------------------

APPENDER = r"""
path, seed, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = content(seed, total)
rng = random.Random(seed + 1)
fd = os.open(path, os.O_WRONLY | os.O_APPEND)
pos, writes = 0, 0
while pos < total:
    n = min(total - pos, rng.choice([1, 17, 511, 4096, 5000, 20000, 65536, 70000]))
    view = memoryview(data)[pos:pos + n]
    while view:
        view = view[os.write(fd, view):]
    pos += n
    writes += 1
    if writes % 7 == 0:
        os.fsync(fd)
    time.sleep(0.002)
os.fsync(fd)
os.close(fd)
print(writes)
"""

READER = r"""
path, seed, total, mode, done = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
want = content(seed, total)
held = os.open(path, os.O_RDONLY) if mode == "held" else None
last, partial, reads = 0, set(), 0
while True:
    finished = os.path.exists(done)
    if mode == "held":
        got = read_all(held, total + 1)
    elif mode == "direct":
        got = direct_read_all(path, total + 1)
    else:
        fd = os.open(path, os.O_RDONLY)
        got = read_all(fd, total + 1)
        os.close(fd)
    reads += 1
    if got != want[:len(got)]:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), total)
        fail(f"{mode}: read {len(got)} bytes, first wrong byte at {first}")
    if len(got) < last:
        fail(f"{mode}: prefix shrank from {last} to {len(got)}")
    last = len(got)
    if 0 < len(got) < total:
        partial.add(len(got))
    if finished:
        break
if last != total:
    fail(f"{mode}: final read {last} bytes, want {total}")
print(json.dumps({"reads": reads, "partial": len(partial)}))
"""


def test_readers_see_a_growing_prefix_while_a_writer_appends(replicated, tmp_path):
    path = replicated.mountpoint / "growing"
    path.touch()
    total = 2_000_000
    done = tmp_path / "writer-done"
    readers = [spawn(READER, path, 7, total, mode, done)
               for mode in ("open-each-time", "held", "direct", "held")]
    time.sleep(0.3)
    writer = spawn(APPENDER, path, 7, total)
    (writes,) = collect([writer])
    done.touch()
    results = [json.loads(out) for out in collect(readers)]
    assert int(writes) > 50
    # The readers really ran beside the writer: each saw several different prefixes.
    assert all(r["partial"] >= 3 for r in results), results
    want = content(7, total)
    assert path.read_bytes() == want
    assert direct_read(path) == want


# --- a reader holding a handle while the file is truncated -----------------------------------


TRUNCATE = r"""
path, size = sys.argv[1], int(sys.argv[2])
os.truncate(path, size)
"""


def test_reader_sees_truncates_made_by_another_process(replicated):
    path = replicated.mountpoint / "t"
    data = content(11, 5 * BLOCK + 333)
    path.write_bytes(data)
    reader = os.open(path, os.O_RDONLY)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 8 * BLOCK)

    def direct_all() -> bytes:
        n = os.preadv(direct, [buf], 0)
        return bytes(buf[:n])

    try:
        assert os.pread(reader, 10 * BLOCK, 0) == data
        assert direct_all() == data
        model = bytearray(data)
        steps = [("truncate", 2 * BLOCK + 100), ("truncate", 0), ("write", 3 * BLOCK + 5),
                 ("truncate", BLOCK - 1), ("truncate", 4 * BLOCK), ("write", 100),
                 ("truncate", 2 * BLOCK)]
        for i, (op, arg) in enumerate(steps):
            if op == "truncate":
                collect([spawn(TRUNCATE, path, arg)])
                del model[arg:]
                model.extend(bytes(max(0, arg - len(model))))
            else:
                piece = content(100 + i, arg)
                with open(path, "r+b") as f:
                    f.write(piece)
                model[:arg] = piece
            assert os.fstat(reader).st_size == len(model)
            assert os.pread(reader, 10 * BLOCK, 0) == model, f"step {i}: {op} {arg}"
            assert os.pread(reader, 100, len(model)) == b""
            assert direct_all() == model, f"step {i}: {op} {arg} (O_DIRECT)"
    finally:
        buf.close()
        os.close(reader)
        os.close(direct)
    # close() returns before the daemon has answered the RELEASE; an unmount at that very
    # moment aborts it, and pyfuse3 logs an ERROR (seen here before open files' time updates
    # stayed in memory). Let the RELEASE be answered before the fixture unmounts.
    time.sleep(0.2)


TRUNCATOR = r"""
path, seed, size, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = content(seed, size)
rng = random.Random(seed + 2)
fd = os.open(path, os.O_RDWR)
for i in range(rounds):
    cut = rng.randrange(0, size)
    if rng.random() < 0.5:
        os.ftruncate(fd, cut)
    else:
        os.truncate(path, cut)
    if rng.random() < 0.3:
        os.fsync(fd)
    os.pwrite(fd, data[cut:], cut)
os.close(fd)
"""

STORM_READER = r"""
path, seed, size, done, direct = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
direct = direct == "1"
want = content(seed, size)
rng = random.Random(seed + 3)
fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
buf = mmap.mmap(-1, 2 * 65536)
reads = 0
while not os.path.exists(done):
    off = rng.randrange(0, size) & ~4095
    try:
        n = os.preadv(fd, [buf], off)
    except OSError as e:
        fail(f"read at {off}: {e}")
    got = buf[:n]
    for i, b in enumerate(got):
        if b != want[off + i] and b != 0:
            fail(f"byte {off + i}: {b} is neither the file's byte {want[off + i]} nor zero")
    reads += 1
os.close(fd)
print(reads)
"""


def test_reads_during_a_truncate_storm_never_fail_or_invent_bytes(replicated, tmp_path):
    path = replicated.mountpoint / "storm"
    size = 6 * BLOCK + 777
    path.write_bytes(content(21, size))
    done = tmp_path / "storm-done"
    readers = [spawn(STORM_READER, path, 21, size, done, direct) for direct in (0, 1, 0)]
    truncators = [spawn(TRUNCATOR, path, 21, size, 60)]
    collect(truncators)
    done.touch()
    reads = [int(out) for out in collect(readers)]
    assert all(n > 10 for n in reads), reads
    assert path.read_bytes() == content(21, size)
    assert direct_read(path) == content(21, size)


# --- O_APPEND from two processes ---------------------------------------------------------------

RECORD_WRITER = r"""
path, who, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(who)
fd = os.open(path, os.O_WRONLY | os.O_APPEND)
for k in range(count):
    body = bytes([65 + k % 26]) * rng.choice([10, 900, 4096, 7000, 70000])
    record = f"<{who}:{k}:{len(body)}>".encode() + body + b"\n"
    assert os.write(fd, record) == len(record)
    if k % 25 == 0:
        os.fsync(fd)
os.close(fd)
"""


def parse_records(data: bytes) -> list[tuple[str, int]]:
    records, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 1] == b"<", f"no record starts at {pos}"
        end = data.index(b">", pos)
        who, k, n = data[pos + 1:end].decode().split(":")
        body = data[end + 1:end + 1 + int(n)]
        assert body == bytes([65 + int(k) % 26]) * int(n), f"record {who}:{k} is torn"
        assert data[end + 1 + int(n):end + 2 + int(n)] == b"\n", f"record {who}:{k} is torn"
        records.append((who, int(k)))
        pos = end + 2 + int(n)
    return records


def test_o_append_from_two_processes(replicated):
    path = replicated.mountpoint / "log"
    path.touch()
    count = 120
    collect([spawn(RECORD_WRITER, path, who, count) for who in ("a", "b")])
    data = path.read_bytes()
    records = parse_records(data)
    for who in ("a", "b"):
        assert [k for w, k in records if w == who] == list(range(count))
    assert len(records) == 2 * count
    assert os.stat(path).st_size == len(data)
    assert direct_read(path) == data
    replicated.stop()
    replicated.start()
    assert path.read_bytes() == data


# --- many processes in one directory ------------------------------------------------------------

NAMESPACE_WORKER = r"""
d, who, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for k in range(rounds):
    tmp = os.path.join(d, f".tmp{who}_{k}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, f"{who}:{k}\n".encode() * (k % 5 + 1))
    os.close(fd)
    os.rename(tmp, os.path.join(d, f"f{who}_{k}"))
    if k >= 2:
        os.unlink(os.path.join(d, f"f{who}_{k - 2}"))
    if k % 3 == 0:
        mine = os.path.join(d, f"s{who}")
        with open(mine, "wb") as f:
            f.write(f"shared {who}:{k}\n".encode())
        os.rename(mine, os.path.join(d, "shared"))      # replaces whoever was there
    if k % 4 == 0:
        os.mkdir(os.path.join(d, f"dir{who}_{k}"))
        if k >= 4:
            os.rmdir(os.path.join(d, f"dir{who}_{k - 4}"))
    # POSIX: a listing returns every name that is neither added nor removed meanwhile
    # exactly once; names replaced or re-created meanwhile ("shared", "s<who>") may be
    # missing or repeated, and names of other workers' files may come and go.
    names = os.listdir(d)
    mine = [f"f{who}_{k}", f"dir{who}_{k - k % 4}"] + ([f"f{who}_{k - 1}"] if k else [])
    for name in mine:
        if names.count(name) != 1:
            fail(f"round {k}: {name} listed {names.count(name)} times: {sorted(names)}")
    repeated = {n for n in names if names.count(n) > 1} - {"shared"} - {f"s{w}" for w in range(64)}
    if repeated:
        fail(f"round {k}: listed more than once: {sorted(repeated)}")
"""


def test_many_processes_create_rename_unlink_in_one_directory(mounted):
    d = mounted.mountpoint / "busy"
    d.mkdir()
    workers, rounds = 6, 60
    collect([spawn(NAMESPACE_WORKER, d, who, rounds) for who in range(workers)])
    expected = {"shared"}
    for who in range(workers):
        expected |= {f"f{who}_{rounds - 2}", f"f{who}_{rounds - 1}"}
        expected.add(f"dir{who}_{max(k for k in range(rounds) if k % 4 == 0)}")
    names = os.listdir(d)
    assert len(names) == len(set(names))
    assert set(names) == expected
    for who in range(workers):
        for k in (rounds - 2, rounds - 1):
            assert (d / f"f{who}_{k}").read_bytes() == f"{who}:{k}\n".encode() * (k % 5 + 1)
    last_shared = max(k for k in range(rounds) if k % 3 == 0)
    assert (d / "shared").read_bytes() in {f"shared {who}:{last_shared}\n".encode()
                                           for who in range(workers)}
    assert os.stat(d).st_nlink == 2 + workers
    mounted.stop()
    mounted.start()
    assert set(os.listdir(d)) == expected


# --- a writer beside the tools --------------------------------------------------------------------

BUSY_WRITER = r"""
d, done, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
k = 0
while not os.path.exists(done):
    name = os.path.join(d, f"w{k % 8}")
    with open(name, "ab") as f:
        f.write(rng.randbytes(rng.choice([100, 5000, 70000, 150000])))
        if rng.random() < 0.5:
            f.flush()
            os.fsync(f.fileno())
    if rng.random() < 0.2:
        os.truncate(name, rng.randrange(0, 100000))
    if rng.random() < 0.1:
        os.unlink(name)
    k += 1
# Leave a known final state: w0..w7 with known content.
for i in range(8):
    with open(os.path.join(d, f"w{i}"), "wb") as f:
        f.write(content(seed + i, 100000 + i))
print(k)
"""


def test_writer_beside_report_and_fsck(replicated, tmp_path):
    mnt, data = replicated.mountpoint, replicated.data
    d = mnt / "w"
    d.mkdir()
    done = tmp_path / "busy-done"
    writer = spawn(BUSY_WRITER, d, done, 31)
    try:
        for i in range(4):
            report = run_tool("report", str(mnt if i % 2 else data), "--json", check=False)
            assert report.returncode == 0, report.stderr
            info = json.loads(report.stdout)
            assert info["default_replication"] == 2 and info["block_size"] == BLOCK
            assert info["total"]["volumes"] == 3
            check = run_tool("fsck", str(data), check=False)
            assert check.returncode == 0, check.stdout + check.stderr
            assert "is HEALTHY" in check.stdout
            assert "Traceback" not in check.stderr + report.stderr
        repair = run_tool("fsck", str(data), "--repair", check=False)
        assert repair.returncode == 2 and "Traceback" not in repair.stderr, repair.stderr
    finally:
        done.touch()
    (rounds,) = collect([writer])
    assert int(rounds) > 4
    for i in range(8):
        assert (d / f"w{i}").read_bytes() == content(31 + i, 100000 + i)
    # Quiet now: the report counts exactly what is there.
    time.sleep(1.5)     # lengths and leases of the last closes reach the namespace
    info = json.loads(run_tool("report", str(mnt), "--json").stdout)
    assert info["mounted"]
    blocks = sum(-(-(100000 + i) // BLOCK) for i in range(8))
    assert info["total"]["replicas"] == 2 * blocks, info["total"]
    check = run_tool("fsck", str(data), "/w", "--files", check=False)
    assert check.returncode == 0, check.stdout
    for i in range(8):
        assert f"/w/w{i} {100000 + i} bytes, replication=2" in check.stdout


# --- descriptors of a file held open through truncates ---------------------------------------

def test_a_file_held_open_through_truncates_does_not_pile_up_descriptors(replicated):
    """Each truncate drops blocks and each rewrite makes new ones; the dropped replicas'
    files must be closed at once, not when the file is last closed. Before, a file kept
    open (a log rotated with ftruncate, fsx) leaked two descriptors per dropped replica
    until the daemon hit its descriptor limit and every new block failed with EIO."""
    path = replicated.mountpoint / "rotated"
    fds = lambda: len(os.listdir(f"/proc/{replicated.pid}/fd"))
    chunk = content(31, 3 * BLOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, chunk)
        os.fsync(fd)
        before = fds()
        for _ in range(100):  # 100 x 3 blocks x 2 replicas dropped: 1,200 descriptors before
            os.ftruncate(fd, 0)
            os.pwrite(fd, chunk, 0)
            os.fsync(fd)
            assert os.pread(fd, 10, BLOCK) == chunk[BLOCK:BLOCK + 10]
        after = fds()
    finally:
        os.close(fd)
    assert after - before < 20, f"daemon descriptors grew from {before} to {after}"
    assert path.read_bytes() == chunk
    time.sleep(0.2)  # let the RELEASE be answered before the fixture unmounts


def test_a_file_of_many_blocks_keeps_a_bounded_number_open(replicated):
    """Each block's replicas hold two descriptors each while the file keeps them open. A
    handle that writes and reads many blocks used to keep all of them open until its last
    close: with small blocks that exhausted the daemon's descriptors, and writes failed
    with EIO. Now at most OPEN_BLOCKS_PER_FILE blocks per file stay open, and an fsync
    still syncs the blocks whose replicas were closed meanwhile."""
    from tierfs.fs.blockio import OPEN_BLOCKS_PER_FILE
    path = replicated.mountpoint / "many"
    fds = lambda: len(os.listdir(f"/proc/{replicated.pid}/fd"))
    data = content(41, 256 * BLOCK + 100)  # 257 blocks x 2 replicas x 2 files: 1,028 before
    bound = fds() + OPEN_BLOCKS_PER_FILE * 2 * 2 + 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for offset in range(0, len(data), 1 << 20):
            os.pwrite(fd, data[offset:offset + (1 << 20)], offset)
        os.fsync(fd)
        after_write = fds()
        evict(path)
        got = bytearray()
        while len(got) < len(data):
            got += os.pread(fd, 1 << 20, len(got))
        after_read = fds()
    finally:
        os.close(fd)
    assert after_write <= bound and after_read <= bound, (after_write, after_read, bound)
    assert got == data
    time.sleep(0.2)  # let the RELEASE be answered before the fixture unmounts


def _daemon_soft_descriptor_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no descriptor limit in /proc/{pid}/limits")


def test_many_open_files_of_many_blocks_under_the_usual_descriptor_limit(tmp_path):
    """30 files of 64 blocks each, all open at once and read and rewritten in turn, by a
    daemon started with the usual limit of 1,024 descriptors (soft and hard). Each file
    may keep 64 blocks open, two descriptors each: 3,840 together. Before, reads answered
    EIO and the replication monitor logged the replicas as lost; now the daemon closes
    the least recently used blocks of all files and every byte comes back right."""
    data = tmp_path / "data"
    run_tool("mkfs", str(data), *SMALL_BLOCKS)
    mount = Mount(data, tmp_path / "mnt", descriptor_limit=(1024, 1024)).start()
    size = 64 * BLOCK
    paths = [mount.mountpoint / f"f{i}" for i in range(30)]
    expected = {path: bytearray(content(100 + i, size)) for i, path in enumerate(paths)}
    try:
        assert _daemon_soft_descriptor_limit(mount.pid) == 1024
        for path, payload in expected.items():
            path.write_bytes(payload)
            evict(path)
        fds = [os.open(path, os.O_RDWR) for path in paths]
        try:
            for offset in range(0, size, 1 << 20):  # every file in turn, all kept open
                for fd, path in zip(fds, paths):
                    assert os.pread(fd, 1 << 20, offset) == expected[path][offset:offset + (1 << 20)]
            for offset in range(BLOCK // 2, size, 4 * BLOCK):
                for i, (fd, path) in enumerate(zip(fds, paths)):
                    piece = content(200 + i + offset, 2 * BLOCK)
                    os.pwrite(fd, piece, offset)
                    expected[path][offset:offset + len(piece)] = piece
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)
        for path in paths:
            evict(path)
            assert path.read_bytes() == expected[path], path.name
        time.sleep(0.2)  # let the RELEASEs be answered before the unmount
    finally:
        mount.stop()
    assert not mount.errors_logged(), "\n".join(mount.errors_logged())
    assert_fsck_clean(data)


def test_the_daemon_raises_its_soft_descriptor_limit_to_the_hard_one(tmp_path):
    """A login's soft limit (1,024) is far below the hard one the daemon may take."""
    data = tmp_path / "data"
    run_tool("mkfs", str(data))
    mount = Mount(data, tmp_path / "mnt", descriptor_limit=(512, 4096)).start()
    try:
        assert _daemon_soft_descriptor_limit(mount.pid) == 4096
    finally:
        mount.stop()
