"""An fsx-style random exerciser: one file on the mount against a bytearray model.

Like fsx (xfstests ltp/fsx.c), it writes at random offsets and lengths (also past EOF,
leaving holes), reads and compares, truncates up and down, reads and writes through shared
mappings (a mapped write first extends the file with ftruncate, a mapped read also checks
that the tail of the last page beyond EOF is zero), fsyncs, closes and reopens, and writes
runs of zeros over data. Two extra checks fsx does not have: reads through O_DIRECT (which
bypass the page cache and so, after an fsync, see what the daemon holds) and reads through a second handle
that stays open the whole run. Every read must equal the model exactly.

The filesystem has 64 KiB blocks and 4 KiB checksum chunks, so operations of up to a block
and a half cross block and chunk boundaries all the time. ``test_fsx_fixed_seed`` runs a few
thousand operations from a fixed seed (a failure prints the seed, the step and the last
operations); ``test_fsx_hypothesis`` lets Hypothesis choose and shrink shorter sequences.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
from collections import deque
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.conftest import pread_all

BLOCK = 64 * 1024
CHUNK = 4096
PAGE = mmap.PAGESIZE
SMALL_BLOCKS = ("--block-size", "64K", "--bytes-per-checksum", "4K")
MAX_FILE = 12 * BLOCK + 1000
MAX_OP = BLOCK + BLOCK // 2

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


class FsxFile:
    """The file under test, its model, and the operations on both."""

    def __init__(self, path: Path):
        self.path = path
        self.model = bytearray()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.reader = os.open(path, os.O_RDONLY)
        self.history: deque[str] = deque(maxlen=12)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.reader)

    def _note(self, text: str) -> None:
        self.history.append(text)

    def _fail(self, what: str, offset: int, got: bytes, want: bytes) -> None:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     min(len(got), len(want)))
        raise AssertionError(
            f"{what} at {offset}: got {len(got)} bytes, want {len(want)}; first difference "
            f"at file offset {offset + first} (got {got[first:first + 8].hex()}, want "
            f"{want[first:first + 8].hex()}); size {len(self.model)}; last operations:\n  "
            + "\n  ".join(self.history))

    def _extend_model(self, end: int) -> None:
        if end > len(self.model):
            self.model.extend(bytes(end - len(self.model)))

    # --- operations --------------------------------------------------------------------------

    def write(self, offset: int, data: bytes) -> None:
        self._note(f"write {offset} +{len(data)}")
        view = memoryview(data)
        pos = offset
        while view:
            n = os.pwrite(self.fd, view, pos)
            assert n > 0
            view = view[n:]
            pos += n
        self._extend_model(offset + len(data))
        self.model[offset:offset + len(data)] = data

    def read(self, offset: int, length: int, fd: int | None = None, what: str = "read") -> None:
        self._note(f"{what} {offset} +{length}")
        fd = self.fd if fd is None else fd
        got = pread_all(fd, length, offset)
        want = bytes(self.model[offset:offset + length])
        if got != want:
            self._fail(what, offset, bytes(got), want)

    def read_other_handle(self, offset: int, length: int) -> None:
        self.read(offset, length, self.reader, "read (second handle)")

    def read_direct(self, offset: int, length: int) -> None:
        """fsync, then an O_DIRECT read of the page-aligned range around the given one.

        The fsync first pushes every page the kernel's writeback cache still holds: an
        O_DIRECT read flushes only its own range, and the daemon cannot see a file length
        set by pages still dirty beyond it (a known problem, kept out of this model).
        """
        self._note(f"fsync + direct read {offset} +{length}")
        os.fsync(self.fd)
        start = offset - offset % PAGE
        span = -(-(offset + length - start) // PAGE) * PAGE
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, span)
            n = os.preadv(fd, [buf], start)
            got = bytes(buf[:n])
            buf.close()
        finally:
            os.close(fd)
        want = bytes(self.model[start:start + span])
        if got != want:
            self._fail("direct read", start, got, want)

    def truncate(self, size: int) -> None:
        self._note(f"truncate {len(self.model)} -> {size}")
        os.ftruncate(self.fd, size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self._extend_model(size)

    def map_write(self, offset: int, data: bytes) -> None:
        """fsx domapwrite: extend with ftruncate if needed, map, copy, msync, unmap."""
        self._note(f"mapwrite {offset} +{len(data)}")
        end = offset + len(data)
        if end > len(self.model):
            os.ftruncate(self.fd, end)
            self._extend_model(end)
        start = offset - offset % PAGE
        m = mmap.mmap(self.fd, end - start, mmap.MAP_SHARED,
                      mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        try:
            m[offset - start:end - start] = data
            m.flush()
        finally:
            m.close()
        self.model[offset:end] = data

    def map_read(self, offset: int, length: int) -> None:
        """fsx domapread, with check_eofpage: bytes of the last page past EOF are zero."""
        size = len(self.model)
        if size == 0:
            return
        offset = min(offset, size - 1)
        length = min(length, size - offset)
        self._note(f"mapread {offset} +{length}")
        start = offset - offset % PAGE
        span = -(-(size - start) // PAGE) * PAGE     # up to the end of the last page
        addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, self.fd, start)
        if addr in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        try:
            got = ctypes.string_at(addr + offset - start, length)
            tail = ctypes.string_at(addr + size - start, start + span - size)
        finally:
            libc.munmap(addr, span)
        want = bytes(self.model[offset:offset + length])
        if got != want:
            self._fail("mapread", offset, got, want)
        if tail != bytes(len(tail)):
            self._fail("mapread beyond EOF", size, tail, bytes(len(tail)))

    def zero(self, offset: int, length: int) -> None:
        self._note("zero-fill:")
        self.write(offset, bytes(length))

    def fsync(self, data_only: bool) -> None:
        self._note("fdatasync" if data_only else "fsync")
        (os.fdatasync if data_only else os.fsync)(self.fd)

    def reopen(self) -> None:
        self._note("close/open")
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR)

    def check_size(self) -> None:
        for what, size in (("fstat", os.fstat(self.fd).st_size),
                           ("fstat (second handle)", os.fstat(self.reader).st_size),
                           ("stat", os.stat(self.path).st_size)):
            if size != len(self.model):
                raise AssertionError(f"{what} size {size}, model {len(self.model)}; last "
                                     f"operations:\n  " + "\n  ".join(self.history))

    def check_all(self) -> None:
        self.check_size()
        self.read(0, len(self.model) + 1, what="full read")
        self.read_direct(0, len(self.model) + 1)


def _random_op(f: FsxFile, rng: random.Random) -> None:
    size = len(f.model)
    kind = rng.choices(
        ["write", "read", "read2", "direct", "truncate", "mapwrite", "mapread", "zero",
         "fsync", "reopen"],
        weights=[24, 18, 6, 4, 8, 8, 8, 5, 2, 2])[0]
    # Offsets cluster at block and chunk boundaries half the time, as fsx -B would not.
    if rng.random() < 0.5:
        unit = rng.choice((BLOCK, CHUNK))
        offset = max(0, rng.randrange(0, MAX_FILE // unit + 1) * unit + rng.randint(-3, 3))
    else:
        offset = rng.randrange(0, MAX_FILE)
    offset = min(offset, MAX_FILE - 1)
    length = rng.randint(1, min(MAX_OP, MAX_FILE - offset))
    if kind == "write":
        f.write(offset, rng.randbytes(length))
    elif kind == "read":
        f.read(offset if size == 0 else rng.randrange(0, size + 10), length)
    elif kind == "read2":
        f.read_other_handle(rng.randrange(0, size + 10), length)
    elif kind == "direct":
        f.read_direct(rng.randrange(0, size + 10), length)
    elif kind == "truncate":
        f.truncate(rng.randrange(0, MAX_FILE))
    elif kind == "mapwrite":
        f.map_write(offset, rng.randbytes(length))
    elif kind == "mapread":
        f.map_read(rng.randrange(0, max(size, 1)), length)
    elif kind == "zero":
        if size:
            start = rng.randrange(0, size)
            f.zero(start, rng.randint(1, min(MAX_OP, size - start)))
    elif kind == "fsync":
        f.fsync(data_only=rng.random() < 0.5)
    else:
        f.reopen()


SEED = 20240521
STEPS = 2500


@pytest.mark.timeout(300)
def test_fsx_fixed_seed(make_mount):
    mount = make_mount(*SMALL_BLOCKS)
    path = mount.mountpoint / "fsx.file"
    rng = random.Random(SEED)
    f = FsxFile(path)
    try:
        for step in range(STEPS):
            try:
                _random_op(f, rng)
                if step % 100 == 99:
                    f.check_all()
            except AssertionError as exc:
                raise AssertionError(f"seed {SEED}, step {step}: {exc}") from None
        f.check_all()
        model = bytes(f.model)
    finally:
        f.close()
    mount.stop()
    mount.start()
    with open(path, "rb") as fh:
        assert fh.read() == model, "the file changed across a remount"


# --- Hypothesis ---------------------------------------------------------------------------------

_MOUNT: dict[str, Path] = {}
HYP_MAX_FILE = 4 * BLOCK + 100
offsets = st.one_of(
    st.integers(0, HYP_MAX_FILE),
    st.builds(lambda b, d: max(0, b * BLOCK + d), st.integers(0, 4), st.integers(-3, 3)),
    st.builds(lambda c, d: max(0, c * CHUNK + d), st.integers(0, 64), st.integers(-2, 2)),
)
lengths = st.integers(1, BLOCK + CHUNK)


class FsxMachine(RuleBasedStateMachine):
    """The same operations chosen by Hypothesis, which shrinks a failing sequence."""

    counter = 0

    def __init__(self):
        super().__init__()
        FsxMachine.counter += 1
        self.f = FsxFile(_MOUNT["dir"] / f"hyp{FsxMachine.counter}")

    def teardown(self):
        self.f.close()
        os.unlink(self.f.path)

    @rule(offset=offsets, length=lengths, seed=st.integers(0, 2**32))
    def write(self, offset, length, seed):
        self.f.write(offset, random.Random(seed).randbytes(length))

    @rule(offset=offsets, length=lengths)
    def read(self, offset, length):
        self.f.read(offset, length)

    @rule(offset=offsets, length=lengths)
    def read_other_handle(self, offset, length):
        self.f.read_other_handle(offset, length)

    @rule(offset=offsets, length=lengths)
    def read_direct(self, offset, length):
        self.f.read_direct(offset, length)

    @rule(size=offsets)
    def truncate(self, size):
        self.f.truncate(size)

    @rule(offset=offsets, length=lengths, seed=st.integers(0, 2**32))
    def map_write(self, offset, length, seed):
        self.f.map_write(offset, random.Random(seed).randbytes(length))

    @precondition(lambda self: len(self.f.model) > 0)
    @rule(offset=offsets, length=lengths)
    def map_read(self, offset, length):
        self.f.map_read(offset, length)

    @precondition(lambda self: len(self.f.model) > 0)
    @rule(offset=offsets, length=lengths)
    def zero(self, offset, length):
        offset = min(offset, len(self.f.model) - 1)
        self.f.zero(offset, min(length, len(self.f.model) - offset))

    @rule(data_only=st.booleans())
    def fsync(self, data_only):
        self.f.fsync(data_only)

    @rule()
    def reopen(self):
        self.f.reopen()

    @invariant()
    def sizes_agree(self):
        self.f.check_size()


@pytest.mark.timeout(300)
def test_fsx_hypothesis(make_mount):
    mount = make_mount(*SMALL_BLOCKS)
    _MOUNT["dir"] = mount.mountpoint
    try:
        FsxMachine.TestCase.settings = settings(
            max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
            database=None, suppress_health_check=list(HealthCheck))
        FsxMachine.TestCase().runTest()
    finally:
        _MOUNT.clear()
    assert os.listdir(mount.mountpoint) == []
