"""POSIX data semantics through a real mount: open flags, handles, holes, truncate, mmap.

Most tests run on a filesystem with small blocks (64 KiB, 4 KiB checksum chunks) so that
ordinary sizes cross block and chunk boundaries; the rest on the default layout. Open flags
whose meaning the kernel and the filesystem share (O_TRUNC with the atomic-open-truncate
protocol, O_APPEND, O_EXCL, access modes) run the same scenario on the host's ext4 and must
give the same results. Data read back is always compared byte for byte with what a model
says it must be; reads with O_DIRECT bypass the page cache and so see what the daemon holds.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import pread_all, require_tool, wait_for

BLOCK = 64 * 1024
CHUNK = 4096
PAGE = mmap.PAGESIZE
SMALL_BLOCKS = ("--block-size", "64K", "--bytes-per-checksum", "4K")
BLK_FILE = re.compile(r"blk_\d+")


# --- helpers ----------------------------------------------------------------------------------


def errno_of(fn, *args, **kwargs) -> int:
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return exc.errno
    return 0


def write_file(path, data: bytes = b"") -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read_file(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def direct_read(path, size: int, offset: int = 0) -> bytes:
    """Read through O_DIRECT into a page-aligned buffer: what the daemon holds."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        start = offset - offset % PAGE
        length = -(-(offset + size - start) // PAGE) * PAGE
        buf = mmap.mmap(-1, length)
        got = os.preadv(fd, [buf], start)
        data = bytes(buf[:got])
        buf.close()
    finally:
        os.close(fd)
    return data[offset - start:offset - start + size]


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def blk_files(root: Path) -> set[str]:
    """Names of replica data files (``blk_<id>``) under ``root``."""
    found = set()
    for _, _, files in os.walk(root):
        found.update(f for f in files if BLK_FILE.fullmatch(f))
    return found


@pytest.fixture
def mnt(mounted) -> Path:
    return mounted.mountpoint


@pytest.fixture
def small(make_mount):
    """A mounted filesystem with 64 KiB blocks and 4 KiB checksum chunks."""
    return make_mount(*SMALL_BLOCKS)


@pytest.fixture
def ref(tmp_path) -> Path:
    path = tmp_path / "ext4-reference"
    path.mkdir()
    return path


def both(mnt: Path, ref: Path, scenario):
    got, want = scenario(mnt), scenario(ref)
    assert got == want, f"tierfs differs from ext4:\n tierfs {got}\n ext4   {want}"
    return got


# --- open flags and access modes ---------------------------------------------------------------


def _open_flags_scenario(base: Path) -> dict:
    write_file(base / "f", b"0123456789")
    os.symlink("f", base / "link")
    os.symlink("nowhere", base / "dangling")
    os.mkdir(base / "dir")
    r = {
        "excl existing": errno_of(os.open, base / "f", os.O_CREAT | os.O_EXCL | os.O_WRONLY),
        "excl dangling symlink": errno_of(os.open, base / "dangling",
                                          os.O_CREAT | os.O_EXCL | os.O_WRONLY),
        "nofollow symlink": errno_of(os.open, base / "link", os.O_RDONLY | os.O_NOFOLLOW),
        "directory flag on file": errno_of(os.open, base / "f", os.O_RDONLY | os.O_DIRECTORY),
        "write a directory": errno_of(os.open, base / "dir", os.O_WRONLY),
        "missing without creat": errno_of(os.open, base / "nope", os.O_RDONLY),
    }
    fd = os.open(base / "new", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    r["excl new"] = os.stat(base / "new").st_size
    fd = os.open(base / "f", os.O_CREAT | os.O_WRONLY, 0o600)   # existing: no truncation
    os.close(fd)
    r["creat keeps data"] = read_file(base / "f")
    fd = os.open(base / "dangling", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"made through a link")
    os.close(fd)
    r["creat through dangling link"] = read_file(base / "nowhere")

    fd = os.open(base / "f", os.O_RDONLY)
    r["write on read-only"] = errno_of(os.write, fd, b"x")
    r["ftruncate on read-only"] = errno_of(os.ftruncate, fd, 0)
    r["shared writable map of read-only"] = errno_of(
        mmap.mmap, fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    r["read on read-only"] = os.read(fd, 4)
    os.close(fd)
    fd = os.open(base / "f", os.O_WRONLY)
    r["read on write-only"] = errno_of(os.read, fd, 1)
    r["pread on write-only"] = errno_of(os.pread, fd, 1, 0)
    r["write on write-only"] = os.write(fd, b"AB")
    os.close(fd)
    fd = os.open(base / "f", os.O_RDWR)
    os.lseek(fd, 4, os.SEEK_SET)
    os.write(fd, b"cd")
    os.lseek(fd, 0, os.SEEK_SET)
    r["read-write"] = os.read(fd, 100)
    os.close(fd)
    r["closed fd"] = errno_of(os.write, fd, b"x")
    return r


def test_open_flags_and_access_modes(mnt, ref):
    r = both(mnt, ref, _open_flags_scenario)
    assert r["excl existing"] == errno.EEXIST
    assert r["excl dangling symlink"] == errno.EEXIST
    assert r["nofollow symlink"] == errno.ELOOP
    assert r["directory flag on file"] == errno.ENOTDIR
    assert r["write a directory"] == errno.EISDIR
    assert r["missing without creat"] == errno.ENOENT
    assert r["excl new"] == 0
    assert r["creat keeps data"] == b"0123456789"
    assert r["creat through dangling link"] == b"made through a link"
    assert r["write on read-only"] == errno.EBADF
    assert r["ftruncate on read-only"] == errno.EINVAL
    assert r["shared writable map of read-only"] == errno.EACCES
    assert r["read on read-only"] == b"0123"
    assert r["read on write-only"] == r["pread on write-only"] == errno.EBADF
    assert r["write on write-only"] == 2
    assert r["read-write"] == b"AB23cd6789"


def test_o_trunc(mounted):
    mnt = mounted.mountpoint
    write_file(mnt / "f", pattern(1, 200_000))
    st = os.stat(mnt / "f")
    time.sleep(0.025)
    fd = os.open(mnt / "f", os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        os.write(fd, b"fresh")
    finally:
        os.close(fd)
    after = os.stat(mnt / "f")
    assert after.st_size == 5
    assert after.st_mtime_ns > st.st_mtime_ns and after.st_ctime_ns > st.st_ctime_ns
    assert read_file(mnt / "f") == b"fresh"
    assert direct_read(mnt / "f", 100) == b"fresh"
    # O_TRUNC while another handle has the old data cached: it sees the new size.
    write_file(mnt / "g", pattern(2, 50_000))
    reader = os.open(mnt / "g", os.O_RDONLY)
    try:
        assert len(pread_all(reader, 60_000, 0)) == 50_000
        fd = os.open(mnt / "g", os.O_RDWR | os.O_TRUNC)
        os.write(fd, b"short")
        os.close(fd)
        assert pread_all(reader, 60_000, 0) == b"short"
    finally:
        os.close(reader)
    mounted.stop()
    mounted.start()
    assert read_file(mnt / "f") == b"fresh"
    assert read_file(mnt / "g") == b"short"


def _append_scenario(base: Path) -> dict:
    path = base / "log"
    write_file(path, b"head:")
    a = os.open(path, os.O_WRONLY | os.O_APPEND)
    b = os.open(path, os.O_RDWR | os.O_APPEND)
    expected = bytearray(b"head:")
    try:
        rng = random.Random(7)
        for i in range(60):
            fd = a if i % 2 == 0 else b
            piece = bytes([65 + i % 26]) * rng.randint(1, 3000)
            assert os.write(fd, piece) == len(piece)
            expected += piece
        # pwrite on an O_APPEND descriptor appends on Linux, whatever the offset.
        os.pwrite(b, b"<pwrite>", 0)
        expected += b"<pwrite>"
        # Reads on the O_APPEND handle start where it last wrote... at the end.
        tail = os.read(b, 10)
        os.lseek(b, 0, os.SEEK_SET)
        head = os.read(b, 5)
    finally:
        os.close(a)
        os.close(b)
    data = read_file(path)
    return {"size": os.stat(path).st_size, "same": data == bytes(expected),
            "expected size": len(expected), "tail": tail, "head": head}


def test_o_append_from_two_handles_loses_nothing(mnt, ref):
    r = both(mnt, ref, _append_scenario)
    assert r["same"] and r["size"] == r["expected size"]
    # pwrite leaves the descriptor's offset where the last write() put it.
    assert r["tail"] == b"<pwrite>" and r["head"] == b"head:"


# --- O_DIRECT ----------------------------------------------------------------------------------


def test_o_direct_aligned_io_is_coherent_with_buffered_io(small):
    mnt = small.mountpoint
    path = mnt / "direct"
    size = 3 * BLOCK + 5 * PAGE
    first = pattern(3, size)
    write_file(path, first)

    cached = os.open(path, os.O_RDONLY)
    try:
        assert pread_all(cached, size, 0) == first          # now in the page cache
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 2 * BLOCK)
            second = pattern(4, 2 * BLOCK)
            buf[:] = second
            # An aligned write that straddles block 0 and block 2.
            assert os.pwritev(fd, [buf], BLOCK // 2) == 2 * BLOCK
            model = bytearray(first)
            model[BLOCK // 2:BLOCK // 2 + 2 * BLOCK] = second
            back = mmap.mmap(-1, size + PAGE)
            assert os.preadv(fd, [back], 0) == size          # short read at EOF
            assert back[:size] == model
            buf.close()
            back.close()
            # Extending with O_DIRECT.
            tail = mmap.mmap(-1, PAGE)
            tail[:] = b"T" * PAGE
            assert os.pwritev(fd, [tail], size) == PAGE
            model += b"T" * PAGE
            tail.close()
        finally:
            os.close(fd)
        # Buffered readers, old and new, see what O_DIRECT wrote.
        assert pread_all(cached, len(model) + 10, 0) == model
        assert read_file(path) == model
    finally:
        os.close(cached)
    # A buffered write is seen by an O_DIRECT reader.
    with open(path, "r+b") as f:
        f.seek(BLOCK - 3)
        f.write(b"buffered")
    model[BLOCK - 3:BLOCK + 5] = b"buffered"
    assert direct_read(path, len(model)) == model
    assert os.stat(path).st_size == len(model)


# --- unlinked but open -------------------------------------------------------------------------


def test_open_unlinked_file_lives_until_close_then_its_space_is_freed(make_mount, tmp_path):
    volume = tmp_path / "capped-disk"
    mount = make_mount(*SMALL_BLOCKS, "--volume", f"DISK:{volume}:64M")
    mnt = mount.mountpoint
    assert blk_files(volume) == set()
    free0 = os.statvfs(mnt).f_bfree
    data = pattern(5, 10 * BLOCK + 123)
    write_file(mnt / "doomed", data)
    write_file(mnt / "keeper", b"k" * 1000)
    ours = blk_files(volume)
    assert len(ours) == 12
    assert os.statvfs(mnt).f_bfree <= free0 - len(data) // 4096

    fd = os.open(mnt / "doomed", os.O_RDWR)
    try:
        os.unlink(mnt / "doomed")
        assert not (mnt / "doomed").exists()
        assert os.fstat(fd).st_nlink == 0
        assert pread_all(fd, len(data), 0) == data
        os.pwrite(fd, b"still writable", 2 * BLOCK - 4)
        os.pwrite(fd, b"and growing", len(data) + BLOCK)
        model = bytearray(data)
        model[2 * BLOCK - 4:2 * BLOCK + 10] = b"still writable"
        model += bytes(BLOCK) + b"and growing"
        assert os.fstat(fd).st_size == len(model)
        assert pread_all(fd, len(model) + 1, 0) == model
        os.fsync(fd)
        assert len(blk_files(volume)) == 13          # the unlinked file's blocks are kept
        # A new file of the same name is a different file.
        write_file(mnt / "doomed", b"new")
        assert pread_all(fd, 5, 0) == bytes(model[:5])
    finally:
        os.close(fd)
    assert wait_for(lambda: len(blk_files(volume)) == 2), blk_files(volume)
    assert wait_for(lambda: os.statvfs(mnt).f_bfree >= free0 - 2)
    assert read_file(mnt / "keeper") == b"k" * 1000
    assert read_file(mnt / "doomed") == b"new"


# --- holes, EOF, truncate ----------------------------------------------------------------------


def test_sparse_files_read_zeros_and_take_no_space(small):
    mnt = small.mountpoint
    path = mnt / "sparse"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.lseek(fd, 10 * 1024 * 1024, os.SEEK_SET)
        os.write(fd, b"end")
        st = os.fstat(fd)
        assert st.st_size == 10 * 1024 * 1024 + 3
        assert st.st_blocks * 512 <= BLOCK, st.st_blocks
        assert pread_all(fd, 5000, 5 * 1024 * 1024 + 17) == bytes(5000)
        assert pread_all(fd, 10, 10 * 1024 * 1024 - 7) == bytes(7) + b"end"
        # Writing in the middle of the hole fills just that part.
        os.pwrite(fd, b"middle", 3 * BLOCK + 100)
        assert pread_all(fd, 110, 3 * BLOCK) == bytes(100) + b"middle" + bytes(4)
        # Writing past EOF leaves a hole between.
        os.pwrite(fd, b"far", st.st_size + 1000)
        assert os.fstat(fd).st_size == st.st_size + 1003
        assert pread_all(fd, 1003, st.st_size) == bytes(1000) + b"far"
        # Reads at and after EOF return nothing.
        assert os.pread(fd, 10, st.st_size + 1003) == b""
        assert os.pread(fd, 10, st.st_size + 10**9) == b""
    finally:
        os.close(fd)
    assert os.stat(path).st_blocks * 512 <= 3 * BLOCK
    small.stop()
    small.start()
    with open(path, "rb") as f:
        f.seek(3 * BLOCK + 100)
        assert f.read(6) == b"middle"
        f.seek(-3, os.SEEK_END)
        assert f.read() == b"far"
    assert hashlib.sha256(read_file(path)).hexdigest() == hashlib.sha256(
        bytes(3 * BLOCK + 100) + b"middle"
        + bytes(10 * 1024 * 1024 - 3 * BLOCK - 106) + b"end" + bytes(1000) + b"far"
    ).hexdigest()


HOLD_OPEN_WITH_UNWRITTEN_PAGES = """
import os, sys
fds = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if not path.endswith("untouched"):
        os.write(fd, bytes(range(1, 256)) * 1000)
    fds.append(fd)
print("written", flush=True)
sys.stdin.readline()
"""


def test_a_file_another_process_is_writing_is_archived_whole_by_tar_sparse(mounted, tmp_path):
    """A process holds files open whose written pages are still only in the kernel's cache
    (writeback caching: this daemon has not seen them). Their st_blocks must not be 0, for
    GNU tar --sparse takes a non-empty file with 0 blocks for all holes and archives none of
    its bytes; it archived such a file as zeros, silently. The file opened had its
    attributes cached (0 blocks) before it was opened; an untouched one reports 0 blocks
    again once closed, as the written ones report what they take."""
    tar = require_tool("tar")
    mnt = mounted.mountpoint
    data = bytes(range(1, 256)) * 1000
    write_file(mnt / "opened")
    assert os.stat(mnt / "opened").st_blocks == 0
    names = ["created", "opened", "untouched"]
    writer = subprocess.Popen([sys.executable, "-c", HOLD_OPEN_WITH_UNWRITTEN_PAGES,
                               *(str(mnt / name) for name in names)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "written\n"
        for name in ("created", "opened"):
            st = os.stat(mnt / name)
            assert (st.st_size, st.st_blocks > 0) == (len(data), True), (name, st)
        archive, out = tmp_path / "a.tar", tmp_path / "out"
        out.mkdir()
        subprocess.run([tar, "-cSf", str(archive), "-C", str(mnt), *names], check=True)
        subprocess.run([tar, "-xSf", str(archive), "-C", str(out)], check=True)
        assert read_file(out / "created") == data
        assert read_file(out / "opened") == data
        assert read_file(out / "untouched") == b""
    finally:
        writer.communicate("\n", timeout=30)
    assert writer.returncode == 0
    for name in ("created", "opened"):
        assert os.stat(mnt / name).st_blocks * 512 >= len(data), name
    assert os.stat(mnt / "untouched").st_blocks == 0


def test_truncate_while_another_handle_reads(small):
    mnt = small.mountpoint
    path = mnt / "t"
    model = bytearray(pattern(6, 5 * BLOCK + 999))
    write_file(path, bytes(model))
    writer = os.open(path, os.O_RDWR)
    reader = os.open(path, os.O_RDONLY)
    try:
        def check():
            assert os.fstat(reader).st_size == len(model)
            assert pread_all(reader, len(model) + 100, 0) == model
            assert os.stat(path).st_size == len(model)

        check()
        steps = [("ftruncate", 2 * BLOCK + 100), ("ftruncate", 4 * BLOCK), ("write", 3 * BLOCK),
                 ("truncate", 3 * BLOCK + 5), ("ftruncate", 0), ("write", 70_000),
                 ("ftruncate", BLOCK), ("truncate", BLOCK - 1), ("ftruncate", 2 * BLOCK + 1),
                 ("write", BLOCK - 10), ("ftruncate", BLOCK + CHUNK // 2),
                 ("truncate", 6 * BLOCK)]
        for i, (op, arg) in enumerate(steps):
            if op == "write":
                piece = pattern(100 + i, 3000)
                os.pwrite(writer, piece, arg)
                end = arg + len(piece)
                if end > len(model):
                    model.extend(bytes(end - len(model)))
                model[arg:end] = piece
            else:
                (os.ftruncate if op == "ftruncate" else os.truncate)(
                    writer if op == "ftruncate" else path, arg)
                if arg < len(model):
                    del model[arg:]
                else:
                    model.extend(bytes(arg - len(model)))
            check()
        assert direct_read(path, len(model) + 10) == model
    finally:
        os.close(writer)
        os.close(reader)
    small.stop()
    small.start()
    assert read_file(path) == model


# --- mmap, fsync -------------------------------------------------------------------------------


def test_mmap_shared_writes_reach_the_file(small):
    mnt = small.mountpoint
    path = mnt / "mapped"
    size = BLOCK + 3 * PAGE + 100
    model = bytearray(pattern(7, size))
    write_file(path, bytes(model))
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        assert m[:] == model                      # mapped read of written data
        for offset, piece in ((10, b"X" * 10), (BLOCK - 5, b"straddles"),
                              (size - 7, b"endings")):
            m[offset:offset + len(piece)] = piece
            model[offset:offset + len(piece)] = piece
        m.flush()                                  # msync(MS_SYNC)
        assert direct_read(path, size) == model   # the daemon has it
        other = os.open(path, os.O_RDONLY)
        assert pread_all(other, size, 0) == model
        os.close(other)
        # write() through the descriptor shows in the mapping.
        os.pwrite(fd, b"via write", 2 * PAGE)
        model[2 * PAGE:2 * PAGE + 9] = b"via write"
        assert m[2 * PAGE:2 * PAGE + 9] == b"via write"
        # Mapped writes did not change the size (test_52_fsx checks the page tail past EOF).
        m.close()
        tail = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        assert len(tail) == size
        tail.close()
        assert os.fsync(fd) is None
        assert os.fdatasync(fd) is None
    finally:
        os.close(fd)
    # MAP_PRIVATE changes stay private.
    fd = os.open(path, os.O_RDWR)
    try:
        p = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        p[0:4] = b"PRIV"
        p.flush()
        p.close()
    finally:
        os.close(fd)
    assert read_file(path) == model
    # A mapping outliving its descriptor still writes back.
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    m[100:108] = b"no fd!!!"
    model[100:108] = b"no fd!!!"
    m.flush()
    m.close()
    assert os.stat(path).st_size == size
    small.stop()
    small.start()
    assert read_file(path) == model


def test_fsync_variants_return_zero_and_make_data_survive_a_kill(small):
    mnt = small.mountpoint
    os.mkdir(mnt / "d")
    data = pattern(8, 2 * BLOCK + 321)
    fd = os.open(mnt / "d" / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        assert os.fsync(fd) is None
        assert os.fdatasync(fd) is None
    finally:
        os.close(fd)
    ro = os.open(mnt / "d" / "f", os.O_RDONLY)
    try:
        assert os.fsync(ro) is None
    finally:
        os.close(ro)
    dfd = os.open(mnt / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert os.fsync(dfd) is None
    finally:
        os.close(dfd)
    small.kill()
    small.start()
    assert read_file(mnt / "d" / "f") == data


# --- block boundaries and big files ------------------------------------------------------------


def test_pread_pwrite_at_block_and_chunk_boundaries(small):
    mnt = small.mountpoint
    path = mnt / "edges"
    model = bytearray()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    ops = [(0, 1), (BLOCK - 1, 1), (BLOCK, 1), (BLOCK - 3, 7), (CHUNK - 1, 2),
           (2 * BLOCK - CHUNK, 2 * CHUNK), (3 * BLOCK, BLOCK), (BLOCK + 1, BLOCK - 2),
           (0, 3 * BLOCK + 1), (5 * BLOCK - 1, 2), (4 * BLOCK + 10, 1), (CHUNK * 3 + 5, 17)]
    try:
        for i, (offset, length) in enumerate(ops):
            piece = pattern(200 + i, length)
            assert os.pwrite(fd, piece, offset) == length
            if offset + length > len(model):
                model.extend(bytes(offset + length - len(model)))
            model[offset:offset + length] = piece
            for boundary in range(0, len(model) + BLOCK, BLOCK):
                for start in (boundary - 5, boundary - 1, boundary):
                    if start < 0:
                        continue
                    want = bytes(model[start:start + 11])
                    assert pread_all(fd, 11, start) == want, (i, start)
        assert os.fstat(fd).st_size == len(model)
    finally:
        os.close(fd)
    assert direct_read(path, len(model)) == model
    small.stop()
    small.start()
    assert read_file(path) == model


def test_large_file_across_many_blocks(small):
    mnt = small.mountpoint
    path = mnt / "large"
    data = pattern(9, 40 * BLOCK + 4321)
    with open(path, "wb") as f:
        view = memoryview(data)
        step = 7919
        for start in range(0, len(data), step):
            f.write(view[start:start + step])
    assert os.stat(path).st_size == len(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = bytearray()
        while piece := os.read(fd, 5003):
            got += piece
    finally:
        os.close(fd)
    assert got == data
    digest = hashlib.sha256(data).hexdigest()
    # Reads in odd sizes at odd offsets.
    rng = random.Random(10)
    with open(path, "rb") as f:
        for _ in range(50):
            start = rng.randrange(len(data))
            length = rng.randrange(1, 3 * BLOCK)
            f.seek(start)
            assert f.read(length) == data[start:start + length]
    # copy_file_range (what cp uses) copies it exactly.
    src = os.open(path, os.O_RDONLY)
    dst = os.open(mnt / "copy", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        copied = 0
        while n := os.copy_file_range(src, dst, 3 * BLOCK + 7):
            copied += n
    finally:
        os.close(src)
        os.close(dst)
    assert copied == len(data)
    small.stop()
    small.start()
    assert hashlib.sha256(read_file(path)).hexdigest() == digest
    assert hashlib.sha256(read_file(mnt / "copy")).hexdigest() == digest
    assert os.stat(path).st_blocks * 512 >= len(data)


def test_many_small_files_keep_their_data(mnt):
    files = {f"f{i}": pattern(300 + i, i * 37) for i in range(60)}
    for name, data in files.items():
        write_file(mnt / name, data)
    for name, data in files.items():
        assert read_file(mnt / name) == data
        st = os.stat(mnt / name)
        assert st.st_size == len(data)
        assert stat.S_ISREG(st.st_mode)
