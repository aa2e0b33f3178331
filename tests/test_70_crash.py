"""Crash tests: the daemon is killed with SIGKILL at random moments, then remounted.

A writer process works on the mount and keeps, OUTSIDE the mount, a journal of what it is
about to do and of what was acknowledged (fsync returned, close returned, unlink returned).
After ``kill -9`` of the daemon and a remount, the filesystem must hold every acknowledged
byte and name, may hold any mixture of old and new bytes only where a write was in flight,
must read without EIO, and must have recovered by itself: the remount's log says recovery
ran, ``tierfs fsck`` is clean afterwards, and no replica file is left over in the volumes.

``TIERFS_CRASH_ROUNDS`` (default 50, the issue's "at least 50 kill points in the full run")
sets the number of kills of the main test (the others scale with it); ``TIERFS_CRASH_SEED`` replays a run (the seed is in every failure message).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, assert_fsck_clean, log_since, log_size, run_tool

ROUNDS = int(os.environ.get("TIERFS_CRASH_ROUNDS", "50"))
SEED = int(os.environ.get("TIERFS_CRASH_SEED", str(random.randrange(1 << 30))))
RECOVERY_LINE = "previous daemon did not stop cleanly; recovered:"
SMALL_BLOCKS = ("--block-size", "1M", "--bytes-per-checksum", "512")
CHUNK = 4096


# --- helpers --------------------------------------------------------------------------------


def block_files(data: Path) -> set[str]:
    """Names of replica data files (``blk_<id>``) in every volume under DATA."""
    return {p.name for p in data.rglob("blk_*") if re.fullmatch(r"blk_\d+", p.name)}


def meta_files(data: Path) -> set[str]:
    return {p.name for p in data.rglob("blk_*.meta")}


def read_all(path: Path) -> bytes:
    """The whole file, read in odd-sized pieces; EIO or any error fails the test."""
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while True:
            piece = f.read(100_003)
            if not piece:
                break
            out += piece
    assert len(out) == os.stat(path).st_size, path
    return bytes(out)


def start_helper(script: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen, timeout: float = 60) -> None:
    """The helper prints 'ready' once it has set up and starts its loop."""
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"helper did not start: {line}{out}\n{err}")


def finish_helper(proc: subprocess.Popen, what: str) -> None:
    """After the kill, a helper meets I/O errors and stops on its own with exit code 0."""
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what} hung after the daemon was killed:\n{err}")
    assert proc.returncode == 0, f"{what} failed (seed {SEED}):\n{out}\n{err}"


def crash_and_remount(mount: Mount, helper: subprocess.Popen | None = None,
                      what: str = "") -> str:
    """kill -9 (reaping ``helper``, the process that was working on the mount, before
    checking nothing landed beside it), remount; returns the remount's log, which must
    show that recovery ran."""
    mount.kill()
    if helper is not None:
        finish_helper(helper, what)
    assert os.listdir(mount.mountpoint) == [], "files written beside the dead mount"
    offset = log_size(mount)
    mount.start()
    text = log_since(mount, offset)
    assert RECOVERY_LINE in text, f"the remount ran no recovery:\n{text}"
    return text


def kill_under_helper(mount: Mount, helper: subprocess.Popen, what: str,
                      rng: random.Random, max_delay: float) -> None:
    """One crash round: let the ready helper work for a random moment, kill the daemon
    under it, remount with recovery, and fsck beside the new daemon."""
    wait_ready(helper)
    time.sleep(rng.uniform(0.05, max_delay))
    crash_and_remount(mount, helper, what)
    fsck_while_mounted(mount)


def stop_and_check(mount: Mount) -> None:
    """Clean unmount, no ERROR or traceback ever logged, fsck clean."""
    mount.stop()
    assert not mount.errors_logged(), "daemon logged errors:\n" + "\n".join(
        mount.errors_logged())
    assert_fsck_clean(mount.data)


def fsck_while_mounted(mount: Mount) -> None:
    """fsck beside the daemon right after recovery: nothing but notes."""
    result = run_tool("fsck", str(mount.data), check=False)
    assert result.returncode == 0, (f"fsck after recovery (seed {SEED}):\n{result.stdout}\n"
                                    f"{result.stderr}")


def payload(seed: int, step: int, n: int) -> bytes:
    return random.Random(f"{seed}:{step}").randbytes(n)


def check_allowed(name: str, got: bytes, base: bytes, writes: list[tuple[int, bytes]]) -> None:
    """``got`` is ``base`` (the acknowledged content) where no write was in flight; where
    one was, each byte is the old byte (zero past the end of ``base``) or one a write put
    there. Its size is at least ``len(base)`` and at most the end of the furthest write."""
    max_end = max([len(base)] + [off + len(d) for off, d in writes])
    assert len(base) <= len(got) <= max_end, (
        f"{name}: size {len(got)}, acknowledged {len(base)}, at most {max_end} (seed {SEED})")
    touched = bytearray(len(got))
    for off, data in writes:
        lo, hi = min(off, len(got)), min(off + len(data), len(got))
        touched[lo:hi] = b"\x01" * (hi - lo)
    padded = base + bytes(max(0, len(got) - len(base)))
    pos = 0
    while pos < len(got):
        end = min(pos + CHUNK, len(got))
        if got[pos:end] == padded[pos:end]:
            pos = end
            continue
        for p in range(pos, end):
            if got[p] == padded[p]:
                continue
            assert touched[p], (f"{name}: byte {p} is {got[p]}, acknowledged {padded[p]}, and "
                                f"no write was in flight there (seed {SEED})")
            assert any(off <= p < off + len(d) and d[p - off] == got[p] for off, d in writes), (
                f"{name}: byte {p} is {got[p]}: neither the old byte nor one a write in "
                f"flight put there (seed {SEED})")
        pos = end


def read_journal(state: Path) -> list[dict]:
    with open(state / "journal") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


# --- writes, appends, overwrites, fsync -----------------------------------------------------


ACK_JOURNAL = r"""
os.makedirs(state, exist_ok=True)
journal = open(os.path.join(state, "journal"), "a", buffering=1)
def log(**rec):
    journal.write(json.dumps(rec) + "\n")
    journal.flush()
def save(name, content):  # STATE/name, replaced atomically: an acknowledged version
    tmp = os.path.join(state, name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(content)
    os.replace(tmp, os.path.join(state, name))
"""
"""What every helper below keeps OUTSIDE the mount (needs ``json``, ``os`` and ``state``):
a journal of what it is about to do and what was acknowledged, and ``save``."""


WRITER = r"""
import errno, json, os, random, sys
mnt, state, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
NFILES, CAP = 4, 3 << 20
SIZES = [1, 100, 511, 4095, 4097, 65536, 70001, 300000, 1 << 20]
rng = random.Random(seed)
""" + ACK_JOURNAL + r"""
def payload(step, n):
    return random.Random(f"{seed}:{step}").randbytes(n)
# Everything is opened relative to the mount's root directory, never by path: after the
# kill the lazily unmounted path would lead to the empty directory underneath.
root = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
models, fds = {}, {}
for name in sorted(os.listdir(root)):  # the baseline: what earlier rounds left (verified)
    with open(name, "rb", opener=lambda n, flags: os.open(n, flags, dir_fd=root)) as f:
        models[name] = bytearray(f.read())
    save(name + ".synced", bytes(models[name]))
    log(op="synced", file=name, size=len(models[name]))
print("ready", flush=True)
step = 0
try:
    while True:
        step += 1
        name = "f%d" % rng.randrange(NFILES)
        if name not in fds:
            fds[name] = os.open(name, os.O_RDWR | os.O_CREAT, 0o644, dir_fd=root)
            models.setdefault(name, bytearray())
        fd, model = fds[name], models[name]
        n = rng.choice(SIZES)
        r = rng.random()
        if len(model) + n <= CAP and (r < 0.45 or not model):
            off = len(model)                                   # append
        elif r < 0.9 or len(model) + n > CAP:
            off = rng.randrange(max(1, len(model) - n + 1))    # overwrite inside
        else:
            off = max(0, len(model) - n // 2)                  # overwrite across the end
        if off + n > CAP:
            n = max(1, CAP - off)
        data = payload(step, n)
        log(op="write", file=name, off=off, len=n, step=step)
        written = os.pwrite(fd, data, off)
        if written != n:
            # Only the kill may cut a write short (the kernel had copied part of it when the
            # connection died): then fsync fails with an OSError, which ends the loop.
            os.fsync(fd)
            raise AssertionError(f"short write ({written} of {n} bytes) on a live mount")
        if off > len(model):
            model += bytes(off - len(model))
        model[off:off + n] = data
        r = rng.random()
        if r < 0.25:
            (os.fdatasync if r < 0.12 else os.fsync)(fd)
            save(name + ".synced", bytes(model))
            log(op="synced", file=name, size=len(model))
        elif r < 0.30:                      # close: the daemon has the data and the size
            os.close(fds.pop(name))
            save(name + ".synced", bytes(model))
            log(op="synced", file=name, size=len(model))
except OSError as exc:
    log(op="error", errno=exc.errno)
"""


def verify_writer_state(mnt: Path, state: Path, seed: int) -> None:
    """Every file: acknowledged content exact, in-flight writes old-or-new, readable."""
    records = read_journal(state)
    acknowledged: dict[str, bytes] = {}
    in_flight: dict[str, list[tuple[int, bytes]]] = {}
    for rec in records:
        if rec["op"] == "synced":  # STATE/<file>.synced holds the last acknowledged version
            acknowledged[rec["file"]] = b""
            in_flight[rec["file"]] = []
        elif rec["op"] == "write":
            in_flight.setdefault(rec["file"], []).append(
                (rec["off"], payload(seed, rec["step"], rec["len"])))
    for name in acknowledged:
        acknowledged[name] = (state / (name + ".synced")).read_bytes()
        last = [r for r in records if r["op"] == "synced" and r["file"] == name][-1]
        assert len(acknowledged[name]) == last["size"]
    present = set(os.listdir(mnt))
    assert present <= set(in_flight) | set(acknowledged), (present, seed)
    for name in sorted(set(in_flight) | set(acknowledged)):
        if name not in acknowledged and name not in present:
            continue  # created, never acknowledged: it may be gone
        assert name in present, f"{name} was fsync'd but is gone (seed {SEED})"
        got = read_all(mnt / name)
        check_allowed(name, got, acknowledged.get(name, b""), in_flight.get(name, []))


@pytest.mark.parametrize("mkfs_args", [SMALL_BLOCKS, ()], ids=["1M-blocks", "64M-blocks"])
def test_kill_during_writes_and_fsyncs(make_mount, tmp_path, mkfs_args):
    """Appends, overwrites inside and across the end, fsync, fdatasync and close, killed at
    random moments, round after round on the same filesystem."""
    rounds = ROUNDS if mkfs_args else max(2, ROUNDS // 3)
    rng = random.Random(SEED)
    mount = make_mount(*mkfs_args)
    (mount.mountpoint / "f0").write_bytes(b"")  # one file exists from the start
    total_synced = 0
    for rnd in range(rounds):
        state = tmp_path / f"round{rnd}"
        writer = start_helper(WRITER, mount.mountpoint, state, SEED * 1000 + rnd)
        kill_under_helper(mount, writer, "writer", rng, 1.2)
        verify_writer_state(mount.mountpoint, state, SEED * 1000 + rnd)
        total_synced += sum(r["op"] == "synced" for r in read_journal(state))
        stop_and_check(mount)
        mount.start()
    assert total_synced > rounds, "the writer hardly ever got to fsync: the test tested little"


def test_fdatasync_of_overwrites_and_appends_survives_a_kill(make_mount):
    """An ``fdatasync`` of an overwrite inside a file whose size and blocks the namespace
    already holds syncs only the replicas (``fs/blockio.py``; most of the 60 here do): what
    it acknowledged must be there after kill -9 and lease recovery all the same, as must an
    append's new size. A kill keeps every namespace commit (they are in the page cache),
    so the conditions for skipping the namespace sync are guarded by the power-loss test
    (``tests/test_74_power_loss.py``)."""
    mount = make_mount(*SMALL_BLOCKS)
    path = mount.mountpoint / "db"
    rng = random.Random(SEED)
    model = bytearray(rng.randbytes(3 * 1024 * 1024 + 123))
    path.write_bytes(model)
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        for step in range(60):
            if step % 20 == 19:
                off, data = len(model), rng.randbytes(rng.choice([1, 5000, 70_000]))
            else:
                data = rng.randbytes(rng.choice([1, 512, 4096, 10_000]))
                off = rng.randrange(len(model) - len(data))
            assert os.pwrite(fd, data, off) == len(data)
            os.fdatasync(fd)
            model[off:off + len(data)] = data
        crash_and_remount(mount)
    finally:
        try:
            os.close(fd)
        except OSError as exc:  # the daemon is gone
            assert exc.errno in (errno.ENOTCONN, errno.EIO), exc
    assert read_all(path) == bytes(model), f"seed {SEED}"
    fsck_while_mounted(mount)
    stop_and_check(mount)


# --- truncate -------------------------------------------------------------------------------


TRUNCATOR = r"""
import json, os, random, sys
path, state, seed, bs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
""" + ACK_JOURNAL + r"""
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
with open(path, "rb") as f:
    model = bytearray(f.read())
if not model:
    model = bytearray(random.Random(seed).randbytes(5 * bs + bs // 2 + 7))
    os.pwrite(fd, model, 0)
os.fsync(fd)
save("done.bin", bytes(model))
log(op="done", k=0)
print("ready", flush=True)
k = 0
try:
    while True:
        k += 1
        if rng.random() < 0.75:
            size = rng.choice([0, 1, bs - 1, bs, bs + 1, 3 * bs, rng.randrange(6 * bs),
                               rng.randrange(6 * bs), max(0, len(model) - 1),
                               len(model) + 5000])
            log(op="truncate", k=k, size=size)
            os.ftruncate(fd, size)
            del model[size:]
            model += bytes(size - len(model))
        else:
            off = rng.randrange(len(model) + 3 * bs // 2)
            n = rng.choice([1, 513, 4096, bs // 2, bs + 3])
            data = random.Random(f"{seed}:{k}").randbytes(n)
            log(op="write", k=k, off=off, len=n)
            os.pwrite(fd, data, off)
            model += bytes(max(0, off + n - len(model)))
            model[off:off + n] = data
        os.fsync(fd)
        save("done.bin", bytes(model))
        log(op="done", k=k)
except OSError as exc:
    log(op="error", errno=exc.errno)
"""


def test_kill_during_truncates(make_mount, tmp_path):
    """ftruncate (down inside a block, on a block boundary, across blocks, to zero, up) and
    writes, each followed by fsync: after a crash the file is exactly the last acknowledged
    version or, for a truncate in flight, exactly the truncated one; a write in flight may
    be partly there."""
    bs = 1 << 20
    rng = random.Random(SEED + 1)
    mount = make_mount(*SMALL_BLOCKS)
    path = mount.mountpoint / "t"
    for rnd in range(max(3, ROUNDS // 5)):
        state = tmp_path / f"round{rnd}"
        seed = SEED * 1000 + rnd
        helper = start_helper(TRUNCATOR, path, state, seed, bs)
        kill_under_helper(mount, helper, "truncator", rng, 0.8)
        records = read_journal(state)
        done = [r for r in records if r["op"] == "done"]
        last = done[-1]["k"]
        base = (state / "done.bin").read_bytes()
        pending = [r for r in records if r["op"] in ("truncate", "write") and r["k"] > last]
        got = read_all(path)
        if not pending or got == base:
            assert got == base, f"not the acknowledged version {last} (seed {SEED})"
        elif pending[0]["op"] == "truncate":
            size = pending[0]["size"]
            truncated = base[:size] + bytes(max(0, size - len(base)))
            assert got == truncated, (
                f"after a crash in truncate to {size} the file is neither the version before "
                f"({len(base)} bytes) nor after: {len(got)} bytes (seed {SEED})")
        else:
            w = pending[0]
            check_allowed("t", got, base, [(w["off"], payload(seed, w["k"], w["len"]))])
        assert sum(r["op"] == "done" for r in records) >= 1
        stop_and_check(mount)
        mount.start()


# --- many creates, unlinks and renames ------------------------------------------------------


CREATOR = r"""
import json, os, random, sys
root, state, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
""" + ACK_JOURNAL + r"""
top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # never by path (see WRITER)
for d in range(5):
    if "d%d" % d not in os.listdir(top):
        os.mkdir("d%d" % d, dir_fd=top)
existing = []
for d in range(5):
    dfd = os.open("d%d" % d, os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
    existing += sorted("d%d/%s" % (d, n) for n in os.listdir(dfd))
    os.close(dfd)
print("ready", flush=True)
i = 0
try:
    while True:
        i += 1
        r = rng.random()
        if r < 0.55 or len(existing) < 5:
            name = "d%d/c%d_%d" % (rng.randrange(5), seed, i)
            n = rng.choice([0, 3000, 4096, 70000])
            data = random.Random(f"{seed}:{i}").randbytes(n)
            log(op="create", name=name, len=n, i=i)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=top)
            os.write(fd, data)
            if rng.random() < 0.3:
                os.fsync(fd)
            os.close(fd)
            log(op="created", name=name)
            existing.append(name)
        elif r < 0.8:
            name = existing.pop(rng.randrange(len(existing)))
            log(op="unlink", name=name)
            os.unlink(name, dir_fd=top)
            log(op="unlinked", name=name)
        else:
            src = existing.pop(rng.randrange(len(existing)))
            if rng.random() < 0.3 and existing:   # over an existing file
                dst = existing.pop(rng.randrange(len(existing)))
            else:
                dst = "d%d/r%d_%d" % (rng.randrange(5), seed, i)
            log(op="rename", src=src, dst=dst)
            os.rename(src, dst, src_dir_fd=top, dst_dir_fd=top)
            log(op="renamed", src=src, dst=dst)
            existing.append(dst)
except OSError as exc:
    log(op="error", errno=exc.errno)
"""


def _expected_names(records: list[dict], known: dict[str, bytes], seed: int):
    """Replay the journal: (names that must exist with their content, the one operation in
    flight at the crash or None)."""
    names = dict(known)
    pending = None
    for rec in records:
        op = rec["op"]
        if op == "create":
            pending = rec
        elif op == "created":
            names[rec["name"]] = payload(seed, pending["i"], pending["len"])
            pending = None
        elif op in ("unlink", "rename"):
            pending = rec
        elif op == "unlinked":
            del names[rec["name"]]
            pending = None
        elif op == "renamed":
            names[rec["dst"]] = names.pop(rec["src"])
            pending = None
    return names, pending


def _tree(root: Path) -> dict[str, bytes]:
    found = {}
    for d in sorted(root.iterdir()):
        assert d.is_dir() and re.fullmatch(r"d\d", d.name), d
        for f in d.iterdir():
            found[f"{d.name}/{f.name}"] = read_all(f)
    return found


def test_kill_during_creates_unlinks_and_renames(make_mount, tmp_path):
    """Every create that returned (file closed) is there with its bytes, every unlink and
    rename that returned is done, the one in flight is all or nothing, and no replica file
    of a deleted or never-recorded block survives the recovery."""
    rng = random.Random(SEED + 2)
    mount = make_mount()
    root = mount.mountpoint / "ns"
    root.mkdir()
    known: dict[str, bytes] = {}
    for rnd in range(max(3, ROUNDS // 5)):
        state = tmp_path / f"round{rnd}"
        seed = SEED * 1000 + rnd
        helper = start_helper(CREATOR, root, state, seed)
        kill_under_helper(mount, helper, "creator", rng, 1.0)
        names, pending = _expected_names(read_journal(state), known, seed)
        found = _tree(root)
        extra = set(found) - set(names)
        missing = set(names) - set(found)
        if pending is None:
            assert not extra and not missing, (extra, missing, SEED)
        elif pending["op"] == "create":
            assert not missing and extra <= {pending["name"]}, (extra, missing, SEED)
            if extra:  # the create in flight: any prefix of its bytes, or zeros
                check_allowed(pending["name"], found[pending["name"]], b"",
                              [(0, payload(seed, pending["i"], pending["len"]))])
                names[pending["name"]] = found[pending["name"]]
        elif pending["op"] == "unlink":
            assert not extra and missing <= {pending["name"]}, (extra, missing, SEED)
            names = {k: v for k, v in names.items() if k in found}
        else:  # rename in flight: before or after, never both names nor neither
            src, dst = pending["src"], pending["dst"]
            before = {k: v for k, v in names.items()}
            after = {k: v for k, v in names.items() if k != src}
            after[dst] = names[src]
            assert found.keys() in (before.keys(), after.keys()), (extra, missing, SEED)
            names = before if found.keys() == before.keys() else after
        for name, content in names.items():
            assert found[name] == content, f"{name}: wrong content (seed {SEED})"
        known = names
        stop_and_check(mount)
        # one block per non-empty file (all are far below the block size), nothing else
        nonempty = sum(1 for c in known.values() if any(c))  # (a hole has no block)
        assert len(block_files(mount.data)) == nonempty, (
            f"{len(block_files(mount.data))} replica files for {nonempty} non-empty files")
        assert len(meta_files(mount.data)) == nonempty
        mount.start()


# --- close after the daemon died ----------------------------------------------------------


def test_a_close_after_the_daemon_died_fails(make_mount):
    """close() never reports success for data the daemon did not get. With writeback
    caching, write() only fills the kernel's page cache; once the daemon is gone the
    kernel drops those pages at close(). Were FLUSH answered ENOSYS, the kernel would
    stop sending it after the first close and this close() would return 0, for a file
    that reads back empty after the remount (seen once in the create test above)."""
    mount = make_mount()
    top = os.open(mount.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        warm = os.open("warm", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=top)
        os.write(warm, b"w")
        os.close(warm)  # the first close: an unanswered FLUSH would end FLUSH here
        fd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=top)
        assert os.write(fd, b"x" * 3000) == 3000
        mount.kill()
        with pytest.raises(OSError) as closing:
            os.close(fd)
        assert closing.value.errno == errno.ENOTCONN
    finally:
        os.close(top)
    mount.start()
    assert (mount.mountpoint / "warm").read_bytes() == b"w"
    # created, its data never acknowledged: empty, unless the kernel happened to write
    # the pages back before the kill
    assert (mount.mountpoint / "f").read_bytes() in (b"", b"x" * 3000)
    stop_and_check(mount)


# --- open but unlinked ----------------------------------------------------------------------


HOLDER = r"""
import os, random, sys
mnt, size = sys.argv[1], int(sys.argv[2])
path = os.path.join(mnt, "victim")
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, random.Random(1).randbytes(size))
os.fsync(fd)
os.unlink(path)
os.write(fd, b"written after the unlink")
os.fsync(fd)
assert os.pread(fd, 10, 0) == random.Random(1).randbytes(size)[:10]
print("ready", flush=True)
sys.stdin.read()          # hold the file open until the test is done with us
"""


@pytest.mark.parametrize("mkfs_args", [SMALL_BLOCKS, ()], ids=["1M-blocks", "64M-blocks"])
def test_kill_with_an_open_unlinked_file(make_mount, mkfs_args):
    """The blocks of a file unlinked while open are purged by the next mount's recovery: no
    replica or meta file of it is left in any volume."""
    mount = make_mount(*mkfs_args)
    mnt, data = mount.mountpoint, mount.data
    (mnt / "keeper").write_bytes(random.Random(2).randbytes(2_500_000))
    keeper_blocks = block_files(data)
    keeper_metas = meta_files(data)
    assert keeper_blocks
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(mnt), str(3_300_000)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(holder)
        assert "victim" not in os.listdir(mnt)
        victim_blocks = block_files(data) - keeper_blocks
        assert victim_blocks, "the open, unlinked file holds no replica files"
        assert len(victim_blocks) == (4 if mkfs_args else 1)
        text = crash_and_remount(mount)
    finally:
        holder.kill()
        holder.communicate()
    assert "orphans purged: 1" in text, text
    assert block_files(data) == keeper_blocks, "replica files of the purged orphan remain"
    assert meta_files(data) == keeper_metas
    fsck_while_mounted(mount)
    assert os.listdir(mnt) == ["keeper"]
    assert read_all(mnt / "keeper") == random.Random(2).randbytes(2_500_000)
    stop_and_check(mount)
    assert block_files(data) == keeper_blocks


def test_kill_with_several_open_unlinked_files_and_a_pending_write(make_mount):
    """Several open-unlinked files, one of them still being written: all purged, nothing
    leaks, and the surviving file's acknowledged bytes are intact."""
    mount = make_mount(*SMALL_BLOCKS)
    mnt, data = mount.mountpoint, mount.data
    survivor = random.Random(3).randbytes(1_500_000)
    with open(mnt / "survivor", "wb") as f:
        f.write(survivor)
        os.fsync(f.fileno())
    keep = block_files(data)
    fds = []
    for i in range(5):
        fd = os.open(mnt / f"v{i}", os.O_RDWR | os.O_CREAT, 0o644)
        os.write(fd, random.Random(i).randbytes(700_000 * (i + 1)))
        if i % 2:
            os.fsync(fd)
        os.unlink(mnt / f"v{i}")
        fds.append(fd)
    os.write(fds[-1], b"unsynced tail")   # in flight at the kill
    text = crash_and_remount(mount)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass  # the old connection is gone
    assert "orphans purged: 5" in text, text
    assert sorted(os.listdir(mnt)) == ["survivor"]
    assert read_all(mnt / "survivor") == survivor
    fsck_while_mounted(mount)
    stop_and_check(mount)
    assert block_files(data) == keep


@pytest.mark.parametrize("kill_at", ["tierfs.fs.namespace:Namespace.truncate_blocks",
                                     "tierfs.backends.replica:Replica.truncate"])
def test_kill_inside_a_truncate_gives_exactly_the_truncated_file(tmp_path, kill_at):
    """Regression (independent review): the truncate target is in the lease before any
    replica is cut, so a kill between cutting and recording completes the truncate."""
    import textwrap
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    run_tool("mkfs", str(data), "--block-size", "1M")
    mnt.mkdir()
    arm = tmp_path / "arm"
    launcher = tmp_path / "crashmount.py"
    launcher.write_text(textwrap.dedent(f'''
        import importlib, os, signal, sys
        mod, attr = {kill_at!r}.split(":")
        owner = importlib.import_module(mod)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        def killing(*a, **k):
            if os.path.exists({str(arm)!r}):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*a, **k)
        setattr(owner, name, killing)
        from tierfs.mount import main
        sys.exit(main(sys.argv[1:]))
    '''))
    daemon = subprocess.Popen([sys.executable, str(launcher), str(data), str(mnt), "-f"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.ismount(mnt):
        assert time.monotonic() < deadline and daemon.poll() is None
        time.sleep(0.05)
    original = os.urandom(3 << 20)
    fd = os.open(mnt / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, original)
    os.fsync(fd)
    os.close(fd)
    arm.touch()
    subprocess.run(["truncate", "-s", str(3 << 19), str(mnt / "f")], capture_output=True)
    daemon.wait(timeout=30)
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    arm.unlink()
    mount = Mount(data, mnt).start()
    try:
        assert (mnt / "f").read_bytes() == original[:3 << 19]
        assert "truncate completed" in mount.log_text()
    finally:
        mount.stop()
    assert_fsck_clean(data)
