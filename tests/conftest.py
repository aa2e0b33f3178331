"""Shared fixtures: real filesystems made with the installed tools, real mounts.

Layers (test file numbers): 1x pure units and backends, 2x namespace, 3x Operations driven
directly, 4x-6x real mounts, 7x crash and fault tests, 9x tools and benchmarks. Real-mount
tests run the installed console scripts (``tierfs``, ``mount.tierfs``) in subprocesses and
end with ``tierfs fsck`` reporting nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
TIERFS = str(BIN / "tierfs")
MOUNT_TIERFS = str(BIN / "mount.tierfs")


def run_tool(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run ``tierfs ARGS``; with check, a non-zero exit fails the test with its output."""
    result = subprocess.run([TIERFS, *args], capture_output=True, text=True,
                            errors="surrogateescape", **kwargs)  # paths are bytes
    if check and result.returncode != 0:
        pytest.fail(f"tierfs {' '.join(args)} exited {result.returncode}:\n"
                    f"{result.stdout}\n{result.stderr}")
    return result


def is_mounted(mountpoint: Path) -> bool:
    return os.path.ismount(mountpoint)


class Mount:
    """A tierfs mounted in the foreground by a ``mount.tierfs -f`` child process."""

    def __init__(self, data: Path, mountpoint: Path, options: str = "allow_other", *,
                 descriptor_limit: tuple[int, int] | None = None):
        """``descriptor_limit``: (soft, hard) RLIMIT_NOFILE the daemon starts with."""
        self.data = data
        self.mountpoint = mountpoint
        self.options = options
        self.descriptor_limit = descriptor_limit
        self.proc: subprocess.Popen | None = None
        self.log = data.parent / f"{data.name}.mount.log"

    def start(self, timeout: float = 30.0) -> "Mount":
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        cmd = [MOUNT_TIERFS, str(self.data), str(self.mountpoint), "-f"]
        if self.options:
            cmd += ["-o", self.options]
        logf = open(self.log, "ab")
        limit = self.descriptor_limit
        self.proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT,
            preexec_fn=None if limit is None else
            (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit)))
        logf.close()
        deadline = time.monotonic() + timeout
        while not is_mounted(self.mountpoint):
            if self.proc.poll() is not None:
                pytest.fail(f"mount.tierfs exited {self.proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"mount did not appear within {timeout} s:\n{self.log_text()}")
            time.sleep(0.02)
        return self

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 60.0) -> None:
        """Unmount cleanly and check the daemon exits with 0."""
        if self.proc is None:
            return
        subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"daemon did not exit after unmount:\n{self.log_text()}")
        self.proc = None
        assert rc == 0, f"daemon exited {rc}:\n{self.log_text()}"

    def kill(self) -> None:
        """kill -9 the daemon and clear the dead mount, as an admin would."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        deadline = time.monotonic() + 10
        while is_mounted(self.mountpoint) and time.monotonic() < deadline:
            time.sleep(0.05)

    def errors_logged(self) -> list[str]:
        """ERROR lines and tracebacks the daemon logged: a bug unless a test expects them."""
        return [line for line in self.log_text().splitlines()
                if " ERROR" in line or "Traceback" in line]


def pread_all(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset``, or fewer only at end of file (pread may return less)."""
    out = bytearray()
    while len(out) < size:
        piece = os.pread(fd, size - len(out), offset + len(out))
        if not piece:
            break
        out += piece
    return bytes(out)


def evict(path) -> None:
    """Write a file out and drop its pages from the page cache, as if it were cold (only
    clean pages can be dropped, hence the fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def assert_fsck_clean(data: Path) -> None:
    result = run_tool("fsck", str(data), check=False)
    assert result.returncode == 0, f"fsck found problems:\n{result.stdout}\n{result.stderr}"


RECOVERY_MARKERS = ("did not stop cleanly", "recovered")
"""What a daemon logs when its mount had to recover from a crash."""


def lock_is_free(data: Path) -> bool:
    """True when no daemon holds DATA's mount lock (what ``tierfs umount`` waits for)."""
    path = data / "namespace" / "mount.lock"
    if not path.exists():
        return True
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def log_size(mount: Mount) -> int:
    return mount.log.stat().st_size if mount.log.exists() else 0


def log_since(mount: Mount, offset: int) -> str:
    with open(mount.log, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def assert_remount_is_clean(data: Path, mnt: Path, expect: dict[str, bytes] | None = None
                            ) -> None:
    """A new daemon logs no recovery and no error, finds ``expect``, and unmounts; fsck is
    clean."""
    mount = Mount(data, mnt)
    offset = log_size(mount)
    mount.start()
    try:
        for name, content in (expect or {}).items():
            assert (mnt / name).read_bytes() == content, name
    finally:
        mount.stop()
    text = log_since(mount, offset)
    for marker in RECOVERY_MARKERS:
        assert marker not in text, f"remount ran recovery:\n{text}"
    assert " ERROR" not in text and "Traceback" not in text, text
    assert_fsck_clean(data)


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A fresh filesystem with the default layout, made by ``tierfs mkfs``."""
    data = tmp_path / "data"
    run_tool("mkfs", str(data))
    return data


@pytest.fixture
def mounted(tmp_path, data_dir):
    """A mounted default filesystem; at the end: clean unmount, no logged errors, fsck clean."""
    mount = Mount(data_dir, tmp_path / "mnt").start()
    yield mount
    if mount.proc is not None:
        mount.stop()
    assert not mount.errors_logged(), "daemon logged errors:\n" + "\n".join(
        mount.errors_logged())
    assert_fsck_clean(data_dir)


@pytest.fixture
def make_mount(tmp_path):
    """Factory for mounts of custom filesystems: make_mount(*mkfs_args) -> started Mount."""
    mounts: list[Mount] = []

    def factory(*mkfs_args: str, name: str = "data", options: str = "allow_other") -> Mount:
        data = tmp_path / name
        run_tool("mkfs", str(data), *mkfs_args)
        mount = Mount(data, tmp_path / f"{name}-mnt", options).start()
        mounts.append(mount)
        return mount

    yield factory
    for mount in mounts:
        if mount.proc is not None:
            mount.stop()
        assert_fsck_clean(mount.data)


def require_tool(name: str) -> str:
    """Path of a system tool the suite installs (.ci/run); missing means a broken setup."""
    path = shutil.which(name)
    assert path, f"{name} is not installed: run the README's test command, which installs it"
    return path


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) at ``tmp_path/disk``: a real disk that
    fills, unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                   check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def fill_disk(disk: Path, room: int = 0, name: str = "filler") -> Path:
    """Fill ``disk`` from outside tierfs, as another program would, to its last page, then
    give ``room`` bytes back; returns the file that fills it."""
    filler = disk / name
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    if room:
        os.truncate(filler, filler.stat().st_size - room)
    return filler
