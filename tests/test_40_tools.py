"""Ordinary shell tools on a real mount, checked byte for byte against a plain directory.

Every test does the same operations in ``tmp_path/'ref'`` (the backing ext4/tmpfs of the test
machine) and on the tierfs mount, then compares: file bytes with ``cmp``, stat fields (type,
mode, owner, size, link count, mtime and, where the tool preserves it, atime, hard-link
groups), symlink targets, extended attributes (``getfattr -d`` dumps and ``os.getxattr``)
and ``find -printf`` listings. Where a property has no plain-directory twin (sparse
allocation, persistence across a remount, replica files in the volumes), it is asserted on
its own.
"""

from __future__ import annotations

import os
import random
import re
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import lock_is_free, require_tool, run_tool
from tierfs.fs.errors import FsError
from tierfs.tools import mkfs

MiB = 1 << 20
NOBODY = "setpriv --reuid=65534 --regid=65534 --clear-groups"
BLOCK = 64 * MiB  # mkfs default block size (tools/mkfs.py)


# --- helpers --------------------------------------------------------------------------------


def sh(cmd: str, cwd: Path | None = None, check: bool = True,
       timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a bash script (errexit, pipefail); with check, a failure fails the test."""
    result = subprocess.run(["bash", "-c", "set -e -o pipefail\n" + cmd], cwd=cwd,
                            capture_output=True, timeout=timeout)
    result.stdout = result.stdout.decode(errors="surrogateescape")
    result.stderr = result.stderr.decode(errors="surrogateescape")
    if check and result.returncode != 0:
        pytest.fail(f"command failed ({result.returncode}): {cmd}\n"
                    f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
    return result


def snapshot(root: Path, *, atime: bool = True, mtime: bool = True,
             dir_mtime: bool = True, dir_atime: bool = True) -> dict[str, dict]:
    """Everything ``stat``/``readlink``/``getxattr`` say about a tree, keyed by relative path.

    Each directory is stat'ed before it is listed and nothing is read, so atimes are the ones
    the tool under test left. Hard links are recorded as groups of paths sharing an inode.
    """
    out: dict[str, dict] = {}
    inodes: dict[int, list[str]] = {}

    def visit(path: Path, rel: str) -> None:
        st = os.lstat(path)
        kind = stat.S_IFMT(st.st_mode)
        entry: dict = {"mode": oct(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
                       "nlink": st.st_nlink}
        if kind != stat.S_IFDIR:
            entry["size"] = st.st_size
        if mtime and (kind != stat.S_IFDIR or dir_mtime):
            entry["mtime"] = st.st_mtime_ns
        if atime and (kind == stat.S_IFREG or kind == stat.S_IFDIR and dir_atime):
            entry["atime"] = st.st_atime_ns
        if kind in (stat.S_IFCHR, stat.S_IFBLK):
            entry["rdev"] = st.st_rdev
        if kind == stat.S_IFLNK:
            entry["target"] = os.readlink(path)
        entry["xattrs"] = {n: os.getxattr(path, n, follow_symlinks=False)
                           for n in sorted(os.listxattr(path, follow_symlinks=False))}
        if kind == stat.S_IFREG and st.st_nlink > 1:
            inodes.setdefault(st.st_ino, []).append(rel)
        out[rel] = entry
        if kind == stat.S_IFDIR:
            for name in sorted(os.listdir(path)):
                visit(path / name, f"{rel}/{name}" if rel else name)

    visit(root, "")
    groups = sorted(sorted(g) for g in inodes.values())
    out["<hard link groups>"] = {"groups": groups}
    return out


def assert_same(expected: dict, actual: dict, what: str = "tree") -> None:
    """Equal snapshots, reporting only the entries that differ."""
    if expected == actual:
        return
    lines = []
    for key in sorted(expected.keys() | actual.keys()):
        if expected.get(key) != actual.get(key):
            lines.append(f"  {key!r}:\n    expected {expected.get(key)}\n    actual   "
                         f"{actual.get(key)}")
    pytest.fail(f"{what} differs in {len(lines)} entries:\n" + "\n".join(lines[:40]))


def regular_files(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, name), root)
                  for d, _, names in os.walk(root) for name in names
                  if stat.S_ISREG(os.lstat(os.path.join(d, name)).st_mode))


def assert_same_bytes(ref: Path, mnt: Path) -> None:
    """``cmp`` every regular file of ``ref`` with its twin under ``mnt``."""
    files = regular_files(ref)
    assert files == regular_files(mnt)
    for rel in files:
        sh(f"cmp -- {q(ref / rel)} {q(mnt / rel)}")


def q(path) -> str:
    """Shell-quote a path."""
    return "'" + str(path).replace("'", "'\\''") + "'"


def find_listing(root: Path) -> str:
    """``find -printf`` listing (directories without their size, which is fs-specific)."""
    files = sh("find . ! -type d -printf '%P|%y|%m|%s|%n|%U|%G|%T@|%l\\n' | LC_ALL=C sort",
               cwd=root).stdout
    dirs = sh("find . -type d -printf '%P|%y|%m|%n|%U|%G|%T@\\n' | LC_ALL=C sort",
              cwd=root).stdout
    return files + dirs


def getfattr_dump(root: Path) -> dict[str, list[str]]:
    """``getfattr -R -h -d -m -`` parsed into {path: sorted 'name=value' lines}."""
    out = sh("getfattr -R -h -d -m - .", cwd=root).stdout
    dump: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("# file: "):
            current = line[len("# file: "):]
            dump[current] = []
        elif line.strip():
            dump[current].append(line)
    return {k: sorted(v) for k, v in dump.items()}


def count_block_files(data: Path) -> int:
    """Replica data files (``blk_<id>``, not meta files) in every volume under DATA."""
    return sum(1 for p in data.rglob("blk_*") if re.fullmatch(r"blk_\d+", p.name))


def remount(mount) -> None:
    """Clean unmount and a new daemon: later reads come from the volumes, not a cache."""
    mount.stop()
    mount.start()


def write_file(path: Path, data: bytes, mode: int | None = None) -> None:
    path.write_bytes(data)
    if mode is not None:
        os.chmod(path, mode)


NS = 10**9


def build_tree(root: Path, seed: int = 1) -> None:
    """A deterministic tree exercising everything ``cp -a``, tar and rsync carry.

    Regular files of sizes around the 4 KiB checksum chunk and beyond 1 MiB, empty files,
    nested and oddly named directories, modes with setuid/setgid/sticky bits, foreign owners,
    relative, absolute, dangling and long symlinks, a three-name hard link, a FIFO, a
    character device, user and trusted xattrs (binary and empty values) on files and
    directories, and distinct nanosecond atimes and mtimes everywhere.
    """
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for d in ("a", "a/b", "a/b/c", "a/b/c/d", "dir with spaces", "ünïcödé", "private",
              "sticky", "empty_dir", "x" * 200):
        (root / d).mkdir()
    sizes = {"empty": 0, "one": 1, "chunk-1": 4095, "chunk": 4096, "chunk+1": 4097,
             "a/medium": 100_000, "a/b/big": MiB + 3, "a/b/c/d/deep": 12345,
             "dir with spaces/file with spaces": 777, "ünïcödé/ƒïłé": 5000,
             "private/secret": 64, "sticky/shared": 10, "y" * 255: 3}
    for rel, size in sizes.items():
        write_file(root / rel, rng.randbytes(size))
    (root / "notes.txt").write_text("plain text\nwith two lines\n")
    modes = {"one": 0o600, "chunk": 0o755, "chunk-1": 0o444, "chunk+1": 0o4755,
             "a/medium": 0o2750, "private": 0o700, "sticky": 0o1777, "a/b": 0o750}
    for rel, mode in modes.items():
        os.chmod(root / rel, mode)
    os.chown(root / "private/secret", 1234, 5678)
    os.chown(root / "private", 4321, 8765)
    os.chown(root / "sticky/shared", 65534, 65534)
    # hard links: three names of one inode, across directories
    os.link(root / "a/medium", root / "a/b/hard")
    os.link(root / "a/medium", root / "hard2")
    # symlinks
    os.symlink("../chunk", root / "a/link_to_file")
    os.symlink("/nonexistent/target", root / "dangling")
    os.symlink("c", root / "a/b/link_to_dir")
    os.symlink("/".join(["z" * 200] * 5), root / "long_link")
    os.symlink("ünïcödé/ƒïłé", root / "unicode_link")
    os.mkfifo(root / "fifo", 0o640)
    os.mknod(root / "chardev", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    # xattrs
    os.setxattr(root / "notes.txt", "user.comment", b"hello world")
    os.setxattr(root / "notes.txt", "user.mime_type", b"text/plain")
    os.setxattr(root / "chunk", "user.binary", bytes(range(256)))
    os.setxattr(root / "one", "user.empty", b"")
    os.setxattr(root / "a", "user.dirattr", b"on a directory")
    os.setxattr(root / "a/medium", "user.shared_by_links", b"3 names")
    os.setxattr(root / "chunk+1", "trusted.rootonly", b"trusted value")
    # times, deepest first so that setting them does not disturb later ones
    paths = sorted((p for p in root.rglob("*")), key=lambda p: -len(p.parts))
    for i, path in enumerate(paths + [root]):
        mtime = (1_000_000_000 + rng.randrange(10**8)) * NS + rng.randrange(NS)
        atime = mtime + rng.randrange(10**6) * NS + rng.randrange(NS)
        os.utime(path, ns=(atime, mtime), follow_symlinks=False)


# --- cp -a ----------------------------------------------------------------------------------


def test_cp_a_preserves_everything(mounted, tmp_path):
    """``cp -a`` onto tierfs gives what ``cp -a`` gives in a plain directory: bytes, types,
    modes, owners, times (atime included), hard links, symlinks, xattrs; and back again."""
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    build_tree(ref / "src1")
    build_tree(ref / "src2")   # twin source: each copy reads a source with untouched atimes
    sh(f"cp -a {q(ref / 'src1')} {q(ref / 'copy')}")
    sh(f"cp -a {q(ref / 'src2')} {q(mnt / 'copy')}")

    expected = snapshot(ref / "copy")
    actual = snapshot(mnt / "copy")
    assert_same(expected, actual, "cp -a copy")
    assert expected["<hard link groups>"]["groups"] == [["a/b/hard", "a/medium", "hard2"]]
    assert expected["a/medium"]["nlink"] == 3
    assert find_listing(ref / "copy") == find_listing(mnt / "copy")
    assert getfattr_dump(ref / "copy") == getfattr_dump(mnt / "copy")
    assert "user.comment=\"hello world\"" in getfattr_dump(mnt / "copy")["notes.txt"]

    # and back: a copy from the mount into a plain directory equals the first copy, but for
    # the directories' atimes: the snapshots above listed them, which moves them (relatime,
    # as ext4 does to ref/copy's), and cp -a carries the moved ones back
    listed = snapshot(mnt / "copy")
    sh(f"cp -a {q(mnt / 'copy')} {q(ref / 'back')}")
    back = snapshot(ref / "back")  # lists back's directories: ext4 moves their atimes now
    dirs = {rel for rel, e in back.items() if "mode" in e and stat.S_ISDIR(int(e["mode"], 8))}
    assert dirs and all(back[rel]["atime"] == listed[rel]["atime"] for rel in dirs)
    for rel in dirs:
        del back[rel]["atime"]
    assert_same(snapshot(ref / "copy", dir_atime=False), back, "cp -a back from the mount")
    assert_same_bytes(ref / "copy", mnt / "copy")
    assert_same_bytes(ref / "copy", ref / "back")

    # all of it survives a remount
    remount(mounted)
    assert_same(snapshot(ref / "copy", atime=False), snapshot(mnt / "copy", atime=False),
                "cp -a copy after remount")
    assert_same_bytes(ref / "copy", mnt / "copy")


def test_cp_of_a_file_onto_itself_and_over_existing_files(mounted, tmp_path):
    """``cp`` over an existing (longer, shorter) file truncates it first; ``cp -f`` over a
    read-only file replaces it; ``cp --reflink=auto`` and ``--sparse=always`` just work."""
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    ref.mkdir()
    rng = random.Random(2)
    long_data, short_data = rng.randbytes(300_000), rng.randbytes(5000)
    for base in (ref, mnt):
        write_file(base / "long", long_data)
        write_file(base / "short", short_data)
    script = ("cp long target && cp short target && cp long target2 && chmod 0444 target2 "
              "&& cp -f short target2 && cp --reflink=auto long target3 "
              "&& cp --sparse=always long target4")
    for base in (ref, mnt):
        sh(script, cwd=base)
        r = sh("cp long long", cwd=base, check=False)
        assert r.returncode == 1 and "are the same file" in r.stderr, r.stderr
    assert (mnt / "target").read_bytes() == short_data
    assert_same(snapshot(ref, atime=False, mtime=False), snapshot(mnt, atime=False,
                                                                  mtime=False))
    assert_same_bytes(ref, mnt)


# --- mv -------------------------------------------------------------------------------------


MV_SCRIPT = """
mv notes.txt notes.renamed
mv one a/b/c/
mv 'dir with spaces' a/moved_dir
mv a/b/c/d top_d
mv chunk chunk-1
mv a/b/hard hard_moved
mkdir target_empty && mv ünïcödé target_empty
mkdir e1 && mkdir e2 && mv e1 e2
mv a/b renamed_b
"""


def test_mv_within_and_across_directories(mounted, tmp_path):
    """Renames of files and directories, across directories, over existing files and empty
    directories, keep inode numbers, links, xattrs and bytes; the refused ones fail the same
    way as in a plain directory."""
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    build_tree(ref / "src")
    sh(f"cp -a {q(ref / 'src')} {q(ref / 't')} && cp -a {q(ref / 'src')} {q(mnt / 't')}")
    inode_before = {rel: os.lstat(mnt / "t" / rel).st_ino
                    for rel in ("notes.txt", "one", "dir with spaces", "a/b/c/d", "chunk",
                                "a/b/hard", "ünïcödé", "a/b")}
    replaced_ino = os.lstat(mnt / "t" / "chunk-1").st_ino
    for base in (ref, mnt):
        sh(MV_SCRIPT, cwd=base / "t")
    moved = {"notes.txt": "notes.renamed", "one": "renamed_b/c/one",
             "dir with spaces": "a/moved_dir", "a/b/c/d": "top_d", "chunk": "chunk-1",
             "a/b/hard": "hard_moved", "ünïcödé": "target_empty/ünïcödé",
             "a/b": "renamed_b"}
    for old, new in moved.items():
        assert os.lstat(mnt / "t" / new).st_ino == inode_before[old], (old, new)
    names = {os.lstat(p).st_ino for p in (mnt / "t").rglob("*")}
    assert replaced_ino not in names
    assert_same(snapshot(ref / "t", atime=False, dir_mtime=False),
                snapshot(mnt / "t", atime=False, dir_mtime=False), "tree after mv")
    assert_same_bytes(ref / "t", mnt / "t")

    refused = [
        "mv renamed_b renamed_b/c/",           # into its own subdirectory
        "mkdir -p full/x && mkdir -p dst/full/y && mv full dst/",  # over a non-empty dir
        "mv chunk-1 renamed_b/c/missing_dir/f",  # missing target directory
        "mv -T hard2 top_d",                   # a file over a directory
        "mv -T top_d hard2",                   # a directory over a file
    ]
    for cmd in refused:
        results = [sh(cmd, cwd=base / "t", check=False) for base in (ref, mnt)]
        assert results[0].returncode == results[1].returncode, (cmd, results)
        assert results[0].stderr == results[1].stderr, (cmd, results)
        assert results[1].returncode != 0, cmd
    assert_same(snapshot(ref / "t", atime=False, dir_mtime=False),
                snapshot(mnt / "t", atime=False, dir_mtime=False), "tree after refused mv")


def test_mv_of_an_open_file_and_across_filesystems(mounted, tmp_path):
    """An open file stays readable and writable through its descriptor after ``mv``; ``mv``
    from the mount to a plain directory (a copy + unlink) and back keeps bytes and xattrs."""
    mnt = mounted.mountpoint
    data = random.Random(3).randbytes(200_000)
    write_file(mnt / "open_file", data)
    with open(mnt / "open_file", "r+b") as f:
        sh(f"mv {q(mnt / 'open_file')} {q(mnt / 'moved')}")
        assert f.read() == data
        f.seek(0)
        f.write(b"HEAD")
    assert (mnt / "moved").read_bytes() == b"HEAD" + data[4:]
    assert not (mnt / "open_file").exists()

    os.setxattr(mnt / "moved", "user.kept", b"yes")
    os.utime(mnt / "moved", ns=(1_500_000_000 * NS + 5, 1_400_000_000 * NS + 7))
    sh(f"mv {q(mnt / 'moved')} {q(tmp_path / 'outside')}")
    assert not (mnt / "moved").exists()
    assert (tmp_path / "outside").read_bytes() == b"HEAD" + data[4:]
    sh(f"mv {q(tmp_path / 'outside')} {q(mnt / 'back')}")
    st = os.stat(mnt / "back")
    assert st.st_mtime_ns == 1_400_000_000 * NS + 7
    assert os.getxattr(mnt / "back", "user.kept") == b"yes"
    assert (mnt / "back").read_bytes() == b"HEAD" + data[4:]


# --- dd -------------------------------------------------------------------------------------


def test_dd_block_sizes_seek_sparse_and_notrunc(mounted, tmp_path):
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    ref.mkdir()
    src = tmp_path / "src.bin"
    write_file(src, random.Random(4).randbytes(5 * MiB + 123))
    patch = tmp_path / "patch.bin"
    write_file(patch, random.Random(5).randbytes(3 * 4096 + 17))
    script = f"""
    dd if={q(src)} of=bs1m bs=1M status=none
    dd if={q(src)} of=bs4k bs=4k status=none
    dd if={q(src)} of=bs1000 bs=1000 conv=fsync status=none
    dd if={q(src)} of=direct bs=4096 oflag=direct status=none
    dd if={q(patch)} of=bs4k bs=4k seek=100 count=3 conv=notrunc status=none
    dd if={q(patch)} of=bs1m bs=1000 seek=2097 conv=notrunc status=none
    dd if={q(patch)} of=bs1000 bs=1 seek=4090 count=20 conv=notrunc status=none
    dd if={q(patch)} of=bs1000 bs=4k oflag=append conv=notrunc status=none
    dd if={q(patch)} of=sparse bs=1M seek=200 status=none
    dd if={q(patch)} of=sparse2 bs=4k seek=1 count=1 status=none
    dd if={q(patch)} of=sparse3 bs=1 seek={BLOCK - 5} status=none
    dd if={q(src)} of=truncating bs=1M status=none
    dd if={q(patch)} of=truncating bs=4k seek=3 status=none
    dd if=/dev/zero of=zeros bs=64k count=20 status=none
    dd if=bs1m of=partial bs=4k skip=5 count=10 status=none
    """
    for base in (ref, mnt):
        sh(textwrap.dedent(script), cwd=base)
    assert_same(snapshot(ref, atime=False, mtime=False), snapshot(mnt, atime=False,
                                                                  mtime=False), "dd results")
    assert os.stat(mnt / "sparse").st_size == 200 * MiB + len(patch.read_bytes())
    assert os.stat(mnt / "truncating").st_size == 3 * 4096 + len(patch.read_bytes())
    # holes are allocated nowhere, whole blocks or inside one (st_blocks, as du shows)
    for name in ("sparse", "sparse2", "sparse3"):
        st = os.stat(mnt / name)
        assert st.st_blocks * 512 < st.st_size, (name, st.st_blocks, st.st_size)
        assert st.st_blocks * 512 <= 2 * len(patch.read_bytes()) + 8192, (name, st.st_blocks)
    for name in ("bs1000", "sparse3", "bs4k"):
        for flags in ("bs=1M", "bs=3001 iflag=direct", "bs=65537 skip=3"):
            want = sh(f"dd if={name} {flags.replace(' iflag=direct', '')} status=none "
                      "| md5sum", cwd=ref).stdout
            got = sh(f"dd if={name} {flags} status=none | md5sum", cwd=mnt).stdout
            assert want == got, (name, flags)
    assert_same_bytes(ref, mnt)
    remount(mounted)
    assert_same_bytes(ref, mnt)


# --- truncate -------------------------------------------------------------------------------


def test_truncate_up_and_down(mounted, tmp_path):
    """``truncate -s`` to sizes inside a chunk, on chunk and block boundaries, up (a hole
    reading zeros) and down; data cut off never reappears when the file grows again."""
    mnt = mounted.mountpoint
    data_dir = mounted.data
    ref = tmp_path / "ref"
    ref.mkdir()
    data = random.Random(6).randbytes(BLOCK + 2 * MiB + 999)
    for base in (ref, mnt):
        write_file(base / "f", data)
        write_file(base / "small", data[:10_000])
    steps = [f"-s {BLOCK + MiB}", f"-s {BLOCK}", "-s 10000", f"-s {BLOCK + 5000}", "-s 4096",
             "-s 8000", "-s +100", "-s -2000", "-s 0", "-s 1", "-s 7M"]
    for step in steps:
        for base in (ref, mnt):
            sh(f"truncate {step} f && truncate {step} small", cwd=base)
        for name in ("f", "small"):
            assert os.stat(mnt / name).st_size == os.stat(ref / name).st_size, (step, name)
            sh(f"cmp {q(ref / name)} {q(mnt / name)}")
    # writing past a cut-off tail: the gap reads as zeros, not the old bytes
    for base in (ref, mnt):
        sh("truncate -s 3000 small && printf tail | dd of=small bs=1 seek=9000 conv=notrunc "
           "status=none && truncate -s 20000 small", cwd=base)
    sh(f"cmp {q(ref / 'small')} {q(mnt / 'small')}")
    assert (mnt / "small").read_bytes()[3000:9000] == bytes(6000)
    st = os.stat(mnt / "f")
    assert st.st_size == 7 * MiB and st.st_blocks * 512 <= 4096, "a grown file is a hole"
    remount(mounted)
    for name in ("f", "small"):
        sh(f"cmp {q(ref / name)} {q(mnt / name)}")
    sh("truncate -s 0 f small", cwd=mnt)
    mounted.stop()
    assert count_block_files(data_dir) == 0, "blocks of truncated files left in the volumes"
    mounted.start()


def test_truncate_errors_match_a_plain_directory(mounted, tmp_path):
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    ref.mkdir()
    for base in (ref, mnt):
        (base / "dir").mkdir()
        (base / "ro").write_bytes(b"x" * 100)
        os.chmod(base / "ro", 0o444)
    for cmd in ("truncate -s 10 dir", "truncate -s -5x ro", "truncate -c -s 10 missing"):
        results = [sh(cmd, cwd=base, check=False) for base in (ref, mnt)]
        assert (results[0].returncode, results[0].stderr) == (
            results[1].returncode, results[1].stderr), cmd
    assert not (mnt / "missing").exists()
    # as nobody, a read-only file cannot be truncated
    # (relative paths from a cwd inside the mount: nobody cannot traverse pytest's tmp dirs)
    r = sh(f"{NOBODY} truncate -s 0 ro", cwd=mnt, check=False)
    assert r.returncode == 1 and "Permission denied" in r.stderr, r.stderr
    assert (mnt / "ro").read_bytes() == b"x" * 100


# --- tar ------------------------------------------------------------------------------------


TAR_C = "tar --xattrs --xattrs-include='*' --numeric-owner -cf"
TAR_X = "tar --xattrs --xattrs-include='*' --numeric-owner -xpf"


def test_tar_onto_and_from_the_mount(mounted, tmp_path):
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    build_tree(ref / "src")
    archive = tmp_path / "tree.tar"
    sh(f"{TAR_C} {q(archive)} -C {q(ref)} src")
    (ref / "x").mkdir()
    (mnt / "x").mkdir()
    for base in (ref, mnt):
        sh(f"{TAR_X} {q(archive)} -C x", cwd=base)
    expected = snapshot(ref / "x" / "src", atime=False)
    assert_same(expected, snapshot(mnt / "x" / "src", atime=False), "tar x onto the mount")
    assert_same_bytes(ref / "x", mnt / "x")
    assert getfattr_dump(ref / "x") == getfattr_dump(mnt / "x")
    r = sh(f"tar --xattrs --numeric-owner -df {q(archive)} -C x", cwd=mnt, check=False)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr

    # tar c reads the tree from the mount; extracted elsewhere it is the same tree
    archive2 = tmp_path / "from_mount.tar"
    sh(f"{TAR_C} {q(archive2)} -C {q(mnt / 'x')} src")
    (ref / "y").mkdir()
    sh(f"{TAR_X} {q(archive2)} -C {q(ref / 'y')}")
    assert_same(expected, snapshot(ref / "y" / "src", atime=False), "tar c from the mount")
    assert_same_bytes(ref / "x", ref / "y")
    # the same archive piped straight onto the mount again
    sh(f"tar -C {q(mnt / 'x')} --xattrs --numeric-owner -cf - src | "
       f"tar -C {q(mnt)} --xattrs --xattrs-include='*' --numeric-owner -xpf -")
    assert_same(snapshot(ref / "x" / "src", atime=False), snapshot(mnt / "src", atime=False),
                "tar c | tar x within the mount")


# --- ln, readlink ---------------------------------------------------------------------------


def test_ln_symlink_and_readlink(mounted, tmp_path):
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    ref.mkdir()
    long_target = "/".join(["d" * 200] * 20)  # 4019 bytes, below PATH_MAX
    script = f"""
    mkdir -p dir/sub
    printf 'content\\n' > file
    ln file hard
    ln file dir/sub/hard2
    echo appended >> dir/sub/hard2
    ln -s file soft
    ln -s ../../file dir/sub/up
    ln -s dir dirlink
    ln -s /absolute/nowhere dangling
    ln -s {long_target} long
    ln -s soft chain
    ln -sf hard soft
    ln -sfn dir/sub dirlink
    ln -s '' empty_target 2>/dev/null || true
    stat -c '%n %h %s' file hard dir/sub/hard2
    readlink soft dir/sub/up dirlink dangling chain
    readlink -f chain dir/sub/up
    cat chain dir/sub/up dirlink/hard2
    ls dirlink/
    rm file
    stat -c '%n %h' hard
    """
    outputs = []
    for base in (ref, mnt):
        out = sh(textwrap.dedent(script), cwd=base).stdout
        outputs.append(out.replace(str(base), "BASE"))
    assert outputs[0] == outputs[1]
    assert "hard 3 17" in outputs[1] and "hard 2" in outputs[1].splitlines()[-1]
    assert os.readlink(mnt / "long") == long_target
    st = os.stat(mnt / "hard")
    assert st.st_ino == os.stat(mnt / "dir/sub/hard2").st_ino and st.st_nlink == 2
    assert_same(snapshot(ref, atime=False, mtime=False), snapshot(mnt, atime=False,
                                                                  mtime=False))
    for cmd in ("ln hard dir/sub/hard2", "ln dir dirhard", "ln -s x soft", "ln missing z",
                "readlink hard", "ln hard dir/nonexistent/x"):
        results = [sh(cmd, cwd=base, check=False) for base in (ref, mnt)]
        assert (results[0].returncode, results[0].stderr) == (
            results[1].returncode, results[1].stderr), cmd
        assert results[1].returncode != 0, cmd


# --- find -----------------------------------------------------------------------------------


def test_find_predicates(mounted, tmp_path):
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    build_tree(ref / "src")
    sh(f"cp -a {q(ref / 'src')} {q(mnt / 'src')}")
    stamp = ref / "src" / "a" / "b" / "c" / "d" / "deep"
    queries = {
        "-type f": None, "-type d": None, "-type l": None, "-type p": ["./fifo"],
        "-type c": ["./chardev"],
        "-name '*.txt'": ["./notes.txt"], "-iname 'CHUNK*'": None,
        "-size +1M": None, "-size -2k -type f": None, "-size 0 -type f": None,
        "-empty": None,
        f"-newer {q(stamp)}": None, f"! -newer {q(stamp)} -type f": None,
        "-links 3 -type f": ["./a/b/hard", "./a/medium", "./hard2"], "-links 3": None,
        "-perm -4000": ["./chunk+1"], "-perm -1000": ["./sticky"],
        "-user 1234": ["./private/secret"], "-uid 65534": ["./sticky/shared"],
        "-maxdepth 1 -type d": None, "-mindepth 4": None, "-path '*b/c*'": None,
        "-xtype l": None, "-lname '*nonexistent*'": ["./dangling"],
        "-regex '.*/a/.*deep'": ["./a/b/c/d/deep"], "-mmin -1": [],
    }
    for query, expected in queries.items():
        want = sh(f"find . {query} | LC_ALL=C sort", cwd=ref / "src").stdout.splitlines()
        got = sh(f"find . {query} | LC_ALL=C sort", cwd=mnt / "src").stdout.splitlines()
        assert got == want, query
        if expected is not None:
            assert got == expected, query
        else:
            assert got, f"query {query} matches nothing: not a useful check"
    # -newer on files touched now: the mount's clock-based times work with find
    sh("touch stamp", cwd=mnt)
    time.sleep(0.05)
    sh("touch src/notes.txt src/a/new_file", cwd=mnt)
    got = sh("find src -newer stamp -type f | LC_ALL=C sort", cwd=mnt).stdout.split()
    assert got == ["src/a/new_file", "src/notes.txt"]
    got = sh("find src -mmin -1 -type f | LC_ALL=C sort", cwd=mnt).stdout.split()
    assert got == ["src/a/new_file", "src/notes.txt"]
    # -delete and -exec
    sh("find src -name 'chunk*' -delete && find src -type f -name '*.txt' -exec cp {} "
       "{}.copy ';'", cwd=mnt)
    assert not list((mnt / "src").glob("chunk*"))
    assert (mnt / "src/notes.txt.copy").read_bytes() == (ref / "src/notes.txt").read_bytes()


# --- rsync ----------------------------------------------------------------------------------


RSYNC = "rsync -aHAX --numeric-ids"


def test_rsync_to_the_mount_and_back(mounted, tmp_path):
    require_tool("rsync")
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    build_tree(ref / "src")
    sh(f"{RSYNC} {q(ref / 'src')}/ {q(mnt / 'rs')}/")
    expected = snapshot(ref / "src", atime=False)
    assert_same(expected, snapshot(mnt / "rs", atime=False), "rsync onto the mount")
    assert_same_bytes(ref / "src", mnt / "rs")
    again = sh(f"{RSYNC} --itemize-changes {q(ref / 'src')}/ {q(mnt / 'rs')}/")
    assert again.stdout == "", "a second rsync transferred:\n" + again.stdout
    # a change in the middle of one file, a new file, a deletion: exactly those move
    with open(ref / "src" / "a/b/big", "r+b") as f:
        f.seek(500_000)
        f.write(b"CHANGED")
    os.utime(ref / "src" / "a/b/big", ns=(2_000_000_000 * NS, 2_000_000_000 * NS))
    (ref / "src" / "fresh").write_bytes(b"fresh file\n")
    os.unlink(ref / "src" / "one")
    # an old directory mtime: the rename of rsync's temp file on the mount must be undone
    # (rsync compares directory times to the second)
    os.utime(ref / "src", ns=(1_900_000_000 * NS, 1_900_000_000 * NS + 3))
    changes = sh(f"{RSYNC} --delete --itemize-changes {q(ref / 'src')}/ {q(mnt / 'rs')}/")
    items = sorted(line.split()[-1] for line in changes.stdout.splitlines())
    assert items == ["./", "a/b/big", "fresh", "one"], changes.stdout
    assert_same(snapshot(ref / "src", atime=False), snapshot(mnt / "rs", atime=False),
                "rsync --delete onto the mount")
    assert_same_bytes(ref / "src", mnt / "rs")
    # --inplace rewrites inside the existing file on the mount
    with open(ref / "src" / "chunk+1", "r+b") as f:
        f.seek(4000)
        f.write(b"INPLACE")
    sh(f"{RSYNC} --inplace --no-whole-file {q(ref / 'src')}/ {q(mnt / 'rs')}/")
    sh(f"cmp {q(ref / 'src' / 'chunk+1')} {q(mnt / 'rs' / 'chunk+1')}")
    # and back from the mount into a plain directory
    sh(f"{RSYNC} {q(mnt / 'rs')}/ {q(ref / 'back')}/")
    assert_same(snapshot(ref / "src", atime=False), snapshot(ref / "back", atime=False),
                "rsync back from the mount")
    assert_same_bytes(ref / "src", ref / "back")
    again = sh(f"{RSYNC} --itemize-changes {q(mnt / 'rs')}/ {q(ref / 'back')}/")
    assert again.stdout == "", "a second rsync back transferred:\n" + again.stdout
    # checksums agree too (reads every byte through the mount)
    again = sh(f"{RSYNC} --checksum --itemize-changes {q(ref / 'src')}/ {q(mnt / 'rs')}/")
    assert again.stdout == ""


# --- setfattr / getfattr --------------------------------------------------------------------


def test_setfattr_getfattr(mounted, tmp_path):
    require_tool("setfattr")
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    ref.mkdir()
    big = "0s" + __import__("base64").b64encode(random.Random(7).randbytes(3000)).decode()
    script = f"""
    touch f && mkdir d && ln -s f l
    setfattr -n user.text -v 'some text' f
    setfattr -n user.hex -v 0x00ff10 f
    setfattr -n user.b64 -v 0sAAECAw== f
    setfattr -n user.empty f
    setfattr -n user.big -v {big} f
    setfattr -n user.text -v replaced f
    setfattr -n user.dir -v dirvalue d
    setfattr -n trusted.t -v root d
    setfattr -n user.gone -v x f
    setfattr -x user.gone f
    getfattr -d f d
    getfattr -d -m - -e hex d
    getfattr -n user.hex -e hex f
    getfattr -n user.b64 -e base64 f
    getfattr -n user.text --only-values f; echo
    getfattr --only-values -n user.empty f | wc -c
    getfattr -n user.big --only-values f | md5sum
    getfattr -h -d l
    getfattr -d l
    """
    outputs = []
    for base in (ref, mnt):
        out = sh(textwrap.dedent(script), cwd=base)
        outputs.append(out.stdout)
        assert out.stderr == ""
    assert outputs[0] == outputs[1]
    assert 'user.text="replaced"' in outputs[1] and "user.gone" not in outputs[1]
    assert os.getxattr(mnt / "f", "user.hex") == b"\x00\xff\x10"
    failing = ["getfattr -n user.missing f", "setfattr -x user.missing f",
               "getfattr -n user.missing d", "setfattr -h -n user.x -v 1 l",
               "setfattr -n user.x -v 1 missing", "getfattr -n nonamespace f",
               "setfattr -n nonamespace -v 1 f", "getfattr -n system.nonexistent f",
               "getfattr -n user.gone f"]
    for cmd in failing:
        results = [sh(cmd, cwd=base, check=False) for base in (ref, mnt)]
        assert (results[0].returncode, results[0].stderr) == (
            results[1].returncode, results[1].stderr), cmd
        assert results[1].returncode == 1, cmd
    r = sh("getfattr -n user.missing f", cwd=mnt, check=False)
    assert r.returncode == 1 and "f: user.missing: No such attribute" in r.stderr
    r = sh("setfattr -x user.missing f", cwd=mnt, check=False)
    assert r.returncode == 1 and "No such attribute" in r.stderr
    # a value at the Linux limit and one beyond it
    os.setxattr(mnt / "d", "user.max", b"v" * 65536)
    assert os.getxattr(mnt / "d", "user.max") == b"v" * 65536
    with pytest.raises(OSError) as exc:
        os.setxattr(mnt / "d", "user.toolong", b"v" * 65537)
    assert exc.value.errno == __import__("errno").E2BIG
    # xattrs survive a remount; dumps of the whole tree match getfattr -R on a plain dir
    os.removexattr(mnt / "d", "user.max")
    remount(mounted)
    assert getfattr_dump(ref) == getfattr_dump(mnt)
    # a non-owner may read but not write user xattrs of a file it cannot write
    r = sh(f"{NOBODY} getfattr -n user.text --only-values f", cwd=mnt)
    assert r.stdout == "replaced"
    r = sh(f"{NOBODY} setfattr -n user.text -v hacked f", cwd=mnt, check=False)
    assert r.returncode == 1 and "Permission denied" in r.stderr
    assert os.getxattr(mnt / "f", "user.text") == b"replaced"


# --- large files ----------------------------------------------------------------------------


def test_large_file_crossing_blocks(mounted, tmp_path):
    """300 MiB of random bytes cross four 64 MiB block boundaries: cp, cmp, overwrites that
    straddle a boundary, an append, after a remount (reads from the volumes)."""
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    ref.mkdir()
    size = 300 * MiB + 12345
    sh(f"head -c {size} /dev/urandom > {q(ref / 'big')}")
    sh(f"cp {q(ref / 'big')} {q(mnt / 'big')}")
    sh(f"cmp {q(ref / 'big')} {q(mnt / 'big')}")
    patch = tmp_path / "patch"
    write_file(patch, random.Random(8).randbytes(3 * MiB + 5))
    for base in (ref, mnt):
        sh(f"dd if={q(patch)} of=big bs=1M seek=63 conv=notrunc status=none && "
           f"dd if={q(patch)} of=big bs=1 seek={2 * BLOCK - 7} count=100 conv=notrunc "
           f"status=none && head -c 1000000 {q(patch)} >> big", cwd=base)
    st = os.stat(mnt / "big")
    assert st.st_size == size + 1_000_000
    assert st.st_blocks * 512 >= st.st_size
    remount(mounted)
    sh(f"cmp {q(ref / 'big')} {q(mnt / 'big')}")
    want = sh(f"dd if={q(ref / 'big')} bs=1M skip=127 count=3 status=none | md5sum").stdout
    got = sh(f"dd if={q(mnt / 'big')} bs=1M skip=127 count=3 iflag=direct status=none | "
             "md5sum").stdout
    assert want == got
    sh(f"rm {q(mnt / 'big')}")
    assert not (mnt / "big").exists()


# --- odd sizes and random overwrites --------------------------------------------------------


ODD_IO = r"""
import os, random, sys
path, out, seed, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
model = bytearray()
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
# sequential writes with sizes that are never a multiple of 512
while len(model) < size:
    n = rng.choice([1, 511, 1000, 4095, 4097, 6000, 65537, 100003])
    piece = rng.randbytes(n)
    assert os.write(fd, piece) == n
    model += piece
# random overwrites, some extending the file, some leaving a hole
for i in range(300):
    off = rng.randrange(len(model) + 5000)
    n = rng.choice([1, 3, 777, 4096, 5000, 12289])
    piece = rng.randbytes(n)
    assert os.pwrite(fd, piece, off) == n
    if off > len(model):
        model += bytes(off - len(model))
    model[off:off + n] = piece
    if i % 50 == 0:
        os.fsync(fd)
os.close(fd)
for flags in (0, os.O_DIRECT):
    fd = os.open(path, os.O_RDONLY | flags)
    assert os.fstat(fd).st_size == len(model)
    for _ in range(200):
        off = rng.randrange(len(model))
        n = rng.choice([1, 100, 3001, 4097, 70001])
        got = os.pread(fd, n, off)
        assert got == bytes(model[off:off + n]), (flags, off, n)
    pos, chunk = 0, 3001
    while True:
        got = os.pread(fd, chunk, pos)
        if not got:
            break
        assert got == bytes(model[pos:pos + len(got)]), (flags, pos)
        pos += len(got)
    assert pos == len(model)
    os.close(fd)
with open(out, "wb") as f:
    f.write(model)
"""


@pytest.mark.parametrize("mkfs_args", [(), ("--block-size", "64K", "--bytes-per-checksum",
                                            "512")], ids=["default", "64K-blocks"])
def test_odd_write_and_read_sizes(make_mount, tmp_path, mkfs_args):
    """Writes and reads whose sizes and offsets are not multiples of the checksum chunk
    (nor of the block size), through the page cache and with O_DIRECT, against a model."""
    mount = make_mount(*mkfs_args)
    out = tmp_path / "odd"
    path = mount.mountpoint / "odd"
    r = subprocess.run([sys.executable, "-c", ODD_IO, str(path), str(out), "9",
                        str(3 * MiB + 17)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    sh(f"cmp {q(out)} {q(path)}")
    remount(mount)
    sh(f"cmp {q(out)} {q(path)}")
    for flags in ("bs=4097", "bs=3001 iflag=direct", "bs=1M skip=1"):
        want = sh(f"dd if={q(out)} {flags.replace(' iflag=direct', '')} status=none "
                  "| md5sum").stdout
        got = sh(f"dd if={q(path)} {flags} status=none | md5sum").stdout
        assert want == got, flags
    assert not mount.errors_logged(), mount.errors_logged()


# --- concurrency ----------------------------------------------------------------------------


WRITER = r"""
import os, random, sys
path, seed, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
data = rng.randbytes(total)
sizes = [4097, 1000, 65537, 12345, 131072, 333]
with open(path, "wb", buffering=0) as f:
    pos = 0
    while pos < total:
        n = min(rng.choice(sizes), total - pos)
        assert f.write(data[pos:pos + n]) == n
        pos += n
        if rng.random() < 0.05:
            os.fsync(f.fileno())
"""

APPENDER = r"""
import os, random, sys
path, count = sys.argv[1], int(sys.argv[2])
def record(i):
    return b"%08d:" % i + random.Random(i).randbytes(1 + i * 7919 % 9000) + b"\n"
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
for i in range(count):
    rec = record(i)
    assert os.write(fd, rec) == len(rec)
    if i % 97 == 0:
        os.fsync(fd)
os.close(fd)
"""

READER = r"""
import os, random, sys
path, done_flag = sys.argv[1], sys.argv[2]
def record(i):
    return b"%08d:" % i + random.Random(i).randbytes(1 + i * 7919 % 9000) + b"\n"
def check(data):
    pos = i = 0
    while pos < len(data):
        rec = record(i)
        piece = data[pos:pos + len(rec)]
        if piece != rec:
            assert len(piece) < len(rec) and rec.startswith(piece), (
                f"record {i} at {pos} is wrong ({len(data)} bytes read)")
        pos += len(rec)
        i += 1
    return i
reads = nonempty = 0
while not os.path.exists(done_flag):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        continue
    check(data)
    reads += 1
    nonempty += bool(data)
with open(path, "rb") as f:
    records = check(f.read())
print(reads, nonempty, records)
"""


def test_concurrent_writers_appender_and_readers(mounted, tmp_path):
    """Four processes write their own files while one appends records to a shared file and
    three read it over and over: every read sees a prefix of the record stream (no zeros, no
    stale or foreign bytes), and every file ends exactly as written."""
    mnt = mounted.mountpoint
    done = tmp_path / "done"
    total = 6 * MiB + 1
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(mnt / f"w{i}"), str(i),
                                 str(total)], stderr=subprocess.PIPE, text=True)
               for i in range(4)]
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(mnt / "shared"), str(done)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(3)]
    appender = subprocess.Popen([sys.executable, "-c", APPENDER, str(mnt / "shared"), "1500"],
                                stderr=subprocess.PIPE, text=True)
    try:
        assert appender.wait(timeout=240) == 0, appender.stderr.read()
        for w in writers:
            assert w.wait(timeout=240) == 0, w.stderr.read()
    finally:
        done.touch()
    stats = []
    for r in readers:
        out, err = r.communicate(timeout=120)
        assert r.returncode == 0, err
        stats.append([int(x) for x in out.split()])
    for reads, nonempty, records in stats:
        assert records == 1500
        assert nonempty >= 1 and reads >= nonempty
    for i in range(4):
        expected = random.Random(i).randbytes(total)
        assert (mnt / f"w{i}").read_bytes() == expected, f"w{i}"
    remount(mounted)
    for i in range(4):
        assert (mnt / f"w{i}").read_bytes() == random.Random(i).randbytes(total), f"w{i}"
    r = subprocess.run([sys.executable, "-c", READER, str(mnt / "shared"), str(done)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split()[2] == "1500", r.stderr


def test_parallel_tools_on_disjoint_trees(mounted, tmp_path):
    """cp, tar and rsync run at the same time into different directories of one mount."""
    mnt = mounted.mountpoint
    ref = tmp_path / "ref"
    build_tree(ref / "src")
    archive = tmp_path / "t.tar"
    sh(f"{TAR_C} {q(archive)} -C {q(ref)} src")
    (mnt / "tar").mkdir()
    cmds = [f"cp -a {q(ref / 'src')} {q(mnt / 'cp')}",
            f"{TAR_X} {q(archive)} -C {q(mnt / 'tar')}",
            f"{RSYNC} {q(ref / 'src')}/ {q(mnt / 'rsync')}/",
            f"cp -a {q(ref / 'src')} {q(mnt / 'cp2')}"]
    procs = [subprocess.Popen(["bash", "-c", c], stderr=subprocess.PIPE, text=True)
             for c in cmds]
    for p, c in zip(procs, cmds):
        assert p.wait(timeout=120) == 0, (c, p.stderr.read())
    expected = snapshot(ref / "src", atime=False)
    for sub in ("cp", "tar/src", "rsync", "cp2"):
        assert_same(expected, snapshot(mnt / sub, atime=False), sub)
        assert_same_bytes(ref / "src", mnt / sub)


# --- tierfs's own commands: user mistakes are one line and a documented exit code --------------


def tierfs(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``tierfs ARGS``; never a traceback, on any stream."""
    result = run_tool(*args, check=False, cwd=cwd, timeout=120)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def refused(result: subprocess.CompletedProcess, code: int, line: str) -> None:
    """Exit ``code``, nothing on stdout, and exactly ``line`` on stderr."""
    assert (result.returncode, result.stdout, result.stderr) == (code, "", line + "\n")


def test_tierfs_without_a_command_names_them_and_debug_goes_either_side(tmp_path):
    """``tierfs`` alone says which commands there are; ``--debug`` is taken before the
    subcommand and after it alike (it was refused after it)."""
    refused(tierfs(), 2, "tierfs: a COMMAND is required: one of mkfs, umount, fsck, policy, "
                         "report (tierfs --help, tierfs COMMAND --help)")
    data = tmp_path / "data"
    assert tierfs("mkfs", str(data), "--debug").returncode == 0
    for args in (["--debug", "fsck", str(data)], ["fsck", "--debug", str(data)]):
        r = tierfs(*args)
        assert r.returncode == 0 and "HEALTHY" in r.stdout, (args, r)
    for args in (["policy", "--debug", "list"], ["policy", "list", "--debug"]):
        r = tierfs(*args)
        assert r.returncode == 0 and r.stdout.startswith("Block Storage Policies:"), (args, r)


def test_mkfs_refuses_a_data_directory_holding_anything_else(tmp_path):
    """mkfs never mixes a filesystem into someone's files: same words as mount.tierfs."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "precious").write_text("keep me")
    refused(tierfs("mkfs", str(data)), 1,
            f"tierfs mkfs: {data} is neither empty nor a tierfs filesystem")
    (data / "ssd").mkdir()   # a default volume directory does not make it acceptable
    refused(tierfs("mkfs", str(data), "--volume", f"SSD:{data}/ssd"), 1,
            f"tierfs mkfs: {data} is neither empty nor a tierfs filesystem")
    assert sorted(os.listdir(data)) == ["precious", "ssd"]

    (tmp_path / "here").mkdir()
    refused(tierfs("mkfs", "", cwd=tmp_path / "here"), 2,
            "tierfs mkfs: argument DATA: must not be empty")
    assert os.listdir(tmp_path / "here") == []

    # Allowed: the empty volume directories to be, and the log mount.tierfs writes first.
    os.unlink(data / "precious")
    (data / "disk").mkdir()
    (data / "tierfs.log").write_text("")
    r = tierfs("mkfs", str(data), "--volume", f"SSD:{data}/ssd", "--volume",
               f"DISK:{data}/disk")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    # A non-empty volume directory inside DATA is still the volume's refusal.
    other = tmp_path / "other"
    (other / "ssd").mkdir(parents=True)
    (other / "ssd" / "x").write_text("")
    refused(tierfs("mkfs", str(other)), 1,
            f"tierfs mkfs: volume directory {other}/ssd is not empty")


def test_mkfs_refuses_a_zero_block_size_and_a_volume_smaller_than_a_block(tmp_path):
    data = tmp_path / "data"
    refused(tierfs("mkfs", str(data), "--block-size", "0"), 2,
            "tierfs mkfs: --block-size must be positive")
    refused(tierfs("mkfs", str(data), "--volume", f"DISK:{tmp_path}/v:1K"), 2,
            f"tierfs mkfs: volume {tmp_path}/v: capacity 1024 is smaller than one block "
            f"(--block-size 67108864)")
    assert not data.exists() and not (tmp_path / "v").exists()
    r = tierfs("mkfs", str(data), "--block-size", "64K", "--volume", f"DISK:{tmp_path}/v:64K")
    assert r.returncode == 0, r.stderr


def test_a_failed_mkfs_removes_the_parent_directories_it_made(tmp_path):
    """mkfs makes missing parents of DATA and of each volume, as ``mkdir -p`` would; when
    it fails it removes them too, not only the last directory of each path. It left
    DATA's and the volumes' parents behind, so a typo'd path cluttered the disk."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    data = tmp_path / "a" / "b" / "data"
    r = tierfs("mkfs", str(data), "--volume", f"SSD:{tmp_path}/p/q/ssd",
               "--volume", f"DISK:{taken}")
    assert r.returncode == 1 and r.stderr == f"tierfs mkfs: volume directory {taken} is not empty\n"
    assert sorted(os.listdir(tmp_path)) == ["taken"]
    assert os.listdir(taken) == ["x"]
    # A parent that was there before stays, and so does one made meanwhile by someone else.
    (tmp_path / "a").mkdir()
    r = tierfs("mkfs", str(data), "--volume", f"DISK:{taken}")
    assert r.returncode == 1
    assert sorted(os.listdir(tmp_path)) == ["a", "taken"] and os.listdir(tmp_path / "a") == []
    assert mkfs._make_dirs(tmp_path / "a") == []
    # The same paths work once the refused volume is out of the way.
    r = tierfs("mkfs", str(data), "--volume", f"SSD:{tmp_path}/p/q/ssd")
    assert r.returncode == 0, r.stderr
    assert run_tool("fsck", str(data)).returncode == 0


def test_mkfs_on_a_disk_that_fills_leaves_nothing_half_made(tmp_path):
    """Whatever step runs out of room (a volume's layout, its identity file, the namespace's
    pages, LMDB's lock file), mkfs says so in one line and leaves no part of a filesystem,
    so that it can simply be run again. It crashed with SIGBUS (LMDB's mapped lock
    file on a full tmpfs) or with a traceback, and a namespace cut short made every later
    mkfs answer "already holds a tierfs filesystem"."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        outcomes = set()
        for free_pages in range(24, -1, -1):  # mkfs needed 20 pages (kernel 6.18)
            filler = disk / "filler"
            filler.write_bytes(b"")
            while os.statvfs(disk).f_bavail > free_pages:
                with open(filler, "ab") as f:
                    f.write(b"\0" * 4096)
            data = disk / "data"
            r = tierfs("mkfs", str(data))
            assert "Traceback" not in r.stderr and r.returncode in (0, 1), (free_pages, r)
            if r.returncode == 1:
                assert len(r.stderr.splitlines()) == 1, r.stderr
                assert "No space left on device" in r.stderr or "no space left" in r.stderr
                assert not data.exists(), list(data.rglob("*"))
            else:
                assert run_tool("fsck", str(data)).returncode == 0
            outcomes.add(r.returncode)
            subprocess.run(["rm", "-rf", str(data), str(filler)], check=True)
        assert outcomes == {0, 1}
        # What a crash during an earlier mkfs leaves does not stop the next.
        (data / "namespace.partial").mkdir(parents=True)
        (data / "namespace.partial" / "data.mdb").write_bytes(b"cut short")
        assert tierfs("mkfs", str(data)).returncode == 0
        assert sorted(p.name for p in data.iterdir()) == ["archive", "disk", "namespace", "ssd"]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


KILL_MKFS = """
import os, signal, sys
from tierfs.tools import mkfs
from tierfs.backends import volume

def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

where = sys.argv[2]
if where == "second volume's layout":
    real_mkdir, made = os.mkdir, []
    def mkdir(path, *args, **kwargs):
        made.append(path)
        if str(path).endswith("/disk/tmp"):
            kill()
        return real_mkdir(path, *args, **kwargs)
    volume.os.mkdir = mkdir
elif where == "third volume's identity":
    real = volume.write_durably
    volume.write_durably = lambda path, data: kill() if "archive" in str(path) else real(path, data)
elif where == "namespace rename":
    real_rename = os.rename
    mkfs.os.rename = lambda a, b: kill() if str(b).endswith("/namespace") else real_rename(a, b)
mkfs.make_filesystem(sys.argv[1])
"""


@pytest.mark.parametrize("where", ["second volume's layout", "third volume's identity",
                                   "namespace rename"])
def test_mkfs_killed_half_way_can_be_run_again(tmp_path, where):
    """A mkfs killed (or a machine that lost power) half-way left volumes that every later
    mkfs or mount.tierfs of the DATA refused as "not empty". The volumes it had formatted,
    still without a block, are known by its mark in DATA and formatted again."""
    data = tmp_path / "data"
    r = subprocess.run([sys.executable, "-c", KILL_MKFS, str(data), where])
    assert r.returncode == -9
    assert not (data / "namespace").exists() and (data / "mkfs.partial").exists()
    r = tierfs("mkfs", str(data))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in data.iterdir()) == ["archive", "disk", "namespace", "ssd"]
    assert run_tool("fsck", str(data)).returncode == 0


def test_mkfs_does_not_take_over_a_volume_of_another_filesystem(tmp_path):
    """The mark of an interrupted mkfs lets the next one format again only the volumes that
    mkfs itself made: a volume of another filesystem, even one without a block yet, is
    still refused, and kept."""
    other = tmp_path / "other"
    run_tool("mkfs", str(other), "--volume", f"DISK:{tmp_path}/shared")
    data = tmp_path / "data"
    r = subprocess.run([sys.executable, "-c", KILL_MKFS, str(data), "namespace rename"])
    assert r.returncode == -9
    r = tierfs("mkfs", str(data), "--volume", f"DISK:{tmp_path}/shared")
    assert r.returncode == 1 and "is not empty" in r.stderr, r
    assert run_tool("fsck", str(other)).returncode == 0


def test_a_mkfs_that_loses_a_race_leaves_the_winner_alone(tmp_path, monkeypatch):
    """Two mkfs (or mount.tierfs) runs of one empty DATA: the one that finds its volume
    directories filled by the other between its check and its format fails, and its undo
    must not delete the other's volumes."""
    data = tmp_path / "data"
    real_validate = mkfs._validate

    def validate_then_lose_the_race(*args, **kwargs):
        real_validate(*args, **kwargs)
        monkeypatch.setattr(mkfs, "_validate", real_validate)
        mkfs.make_filesystem(data)          # the other run finishes first

    monkeypatch.setattr(mkfs, "_validate", validate_then_lose_the_race)
    with pytest.raises(FsError, match="is not empty"):
        mkfs.make_filesystem(data)
    assert run_tool("fsck", str(data)).returncode == 0


def test_tools_on_a_full_namespace_disk_without_a_lock_file(tmp_path):
    """LMDB makes its lock file sparse and writes it through a mapping even for read-only
    opens: on a full disk, fsck and report died of SIGBUS. Now they fail in one line."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    try:
        data = disk / "data"
        run_tool("mkfs", str(data), "--volume", f"DISK:{tmp_path}/v")
        (data / "namespace" / "lock.mdb").unlink()
        with open(disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 4096)
        for tool in ("fsck", "report"):
            r = tierfs(tool, str(data))
            assert r.returncode == 2, (tool, r)
            assert r.stderr == (f"tierfs {tool}: cannot open the namespace of {data}: cannot "
                                f"open namespace {data}/namespace: No space left on device\n")
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_umount_through_a_symlink_and_timeout_usage(mounted, tmp_path):
    mnt = mounted.mountpoint
    for timeout in ("0", "-5", "nan"):
        refused(tierfs("umount", str(mnt), "--timeout", timeout), 2,
                f"tierfs umount: argument --timeout: must be a positive number of seconds, "
                f"not '{timeout}'")
    assert os.path.ismount(mnt)
    link = tmp_path / "link"
    link.symlink_to(mnt)
    r = tierfs("umount", str(link))
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert not os.path.ismount(mnt) and lock_is_free(mounted.data)


def test_unknown_arguments_are_named_by_the_parser_they_reach(data_dir):
    refused(tierfs("--bogus"), 2, "tierfs: unrecognized arguments: --bogus")
    refused(tierfs("--bogus", "fsck", str(data_dir)), 2,
            "tierfs: unrecognized arguments: --bogus")
    refused(tierfs("fsck", str(data_dir), "/p", "extra"), 2,
            "tierfs fsck: unrecognized arguments: extra")
    refused(tierfs("fsck", str(data_dir), "--files", "/p", "extra"), 2,
            "tierfs fsck: unrecognized arguments: extra")
    refused(tierfs("mkfs", str(data_dir), "--bogus"), 2,
            "tierfs mkfs: unrecognized arguments: --bogus")
    refused(tierfs("fsck", str(data_dir), "--files", "/nosuch"), 2,
            f"tierfs fsck: path '/nosuch' does not exist in {data_dir}")   # PATH after options
    assert tierfs("fsck", str(data_dir), "--files", "/").returncode == 0


def test_report_of_a_path_inside_a_mount_is_refused(mounted):
    mnt = mounted.mountpoint
    (mnt / "sub").mkdir()
    refused(tierfs("report", str(mnt / "sub")), 2,
            f"tierfs report: {mnt}/sub is inside the tierfs mounted on {mnt}, not its mount "
            f"point; give the mount point or DATA")
    refused(tierfs("report", str(mounted.data / "ssd")), 2,
            f"tierfs report: {mounted.data}/ssd is neither a tierfs data directory nor a "
            f"tierfs mount point; give the mount point or DATA")
    for target in (mnt, mounted.data):
        r = tierfs("report", str(target))
        assert r.returncode == 0 and r.stdout.startswith(
            f"tierfs report of {mounted.data}:"), r.stderr


def test_a_tool_that_cannot_run_exits_with_its_documented_code(tmp_path):
    """fsck --repair on a read-only DATA cannot take the mount lock: that is "cannot run"
    (2), not "problems found" (1), which it answered before."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    try:
        run_tool("mkfs", str(disk / "data"))
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        r = run_tool("fsck", "--repair", str(disk / "data"), check=False)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and "Read-only file system" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_ctrl_c_while_a_tool_starts_is_a_quiet_interrupt():
    """SIGINT before ``main`` runs (the modules are still loading) or while it builds its
    parser ends the tool with 130, without a traceback."""
    early = subprocess.run(
        [sys.executable, "-c", "import os, signal, time, tierfs.tools.cli\n"
                               "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)"],
        capture_output=True, text=True, timeout=30)
    assert early.returncode == 130 and early.stderr == "", early.stderr
    in_parser = subprocess.run(
        [sys.executable, "-c", "import sys, tierfs.tools.cli as cli\n"
                               "def interrupted():\n    raise KeyboardInterrupt\n"
                               "cli.build_parser = interrupted\nsys.exit(cli.main(['report', '/']))"],
        capture_output=True, text=True, timeout=30)
    assert in_parser.returncode == 130, in_parser.stderr
    assert in_parser.stderr == "tierfs: interrupted\n"
