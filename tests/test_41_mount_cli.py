"""``mount.tierfs``, ``tierfs umount`` and ``tierfs mkfs`` as a person uses them.

Mounting creates the default layout where there is none, refuses what it must refuse (a
second daemon, foreign, missing or swapped volumes, a mount point or data directory that is
not what it should be) with one line on stderr and exit code 1, and every way of stopping
the daemon (``tierfs umount``, ``fusermount3 -u``, SIGTERM, SIGINT) unmounts, exits 0 and
leaves the filesystem clean: the next mount runs no recovery. No tool ever prints a
traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (MOUNT_TIERFS, TIERFS, Mount, assert_fsck_clean, assert_remount_is_clean,
                            fill_disk, is_mounted, lock_is_free, log_since, log_size, wait_for,
                            run_tool, small_disk)

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


# --- helpers --------------------------------------------------------------------------------


def run(cmd: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def mount_cmd(data, mnt, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run([MOUNT_TIERFS, str(data), str(mnt), *extra], timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *fragments: str,
                          prefix: str | None = None) -> str:
    """Exit code ``code``, nothing on stdout, exactly one line on stderr containing every
    fragment, and no traceback."""
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert result.stdout == "", result.stdout
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    if prefix is not None:
        assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def lock_holder_pid(data: Path) -> int:
    return int((data / "namespace" / "mount.lock").read_text().split()[0])


def process_gone(pid: int) -> bool:
    """The process has exited (it may linger as a zombie of whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[:2] == ["State:", "Z"] for line in f)
    except FileNotFoundError:
        return True


def mkfs(data: Path, *args: str) -> None:
    run_tool("mkfs", str(data), *args)


# --- creating the default layout ------------------------------------------------------------


@pytest.mark.parametrize("state", ["missing", "empty", "only-a-log"])
def test_mount_creates_the_default_layout(tmp_path, state):
    data = tmp_path / "data"
    if state == "empty":
        data.mkdir()
    if state == "only-a-log":
        data.mkdir()
        (data / "tierfs.log").write_text("an earlier failed mount left its log\n")
    mnt = tmp_path / "mnt"
    mount = Mount(data, mnt).start()
    try:
        (mnt / "hello").write_bytes(b"hello\n")
        assert os.listdir(mnt) == ["hello"]
    finally:
        mount.stop()
    expected = {"ssd": "SSD", "disk": "DISK", "archive": "ARCHIVE"}
    assert {p.name for p in data.iterdir()} >= set(expected) | {"namespace"}
    fs_uuids = set()
    for name, storage_type in expected.items():
        identity = json.loads((data / name / "VERSION").read_text())
        assert identity["storage_type"] == storage_type
        fs_uuids.add(identity["fs_uuid"])
        assert (data / name / "current" / "finalized").is_dir()
    assert len(fs_uuids) == 1
    assert (data / "namespace" / "data.mdb").is_file()
    assert "created filesystem" in mount.log_text()
    assert not mount.errors_logged(), mount.errors_logged()
    assert_fsck_clean(data)
    assert_remount_is_clean(data, mnt, {"hello": b"hello\n"})


def test_mount_of_a_relative_data_dir_in_the_background(tmp_path):
    """Relative DATA and MNT work in background mode (the daemon changes directory to /);
    missing parents of DATA are created."""
    (tmp_path / "mnt").mkdir()
    r = run([MOUNT_TIERFS, "x/y/data", "mnt"], cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    try:
        assert is_mounted(tmp_path / "mnt")
        (tmp_path / "mnt" / "f").write_text("relative\n")
    finally:
        r = run([TIERFS, "umount", "mnt"], cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert not is_mounted(tmp_path / "mnt")
    data = tmp_path / "x" / "y" / "data"
    assert (data / "ssd" / "VERSION").exists()
    assert "created filesystem" in (data / "tierfs.log").read_text()
    assert_remount_is_clean(data, tmp_path / "mnt", {"f": b"relative\n"})


# --- background mode and tierfs umount ------------------------------------------------------


def test_background_mount_and_tierfs_umount(data_dir, tmp_path):
    """Without -f the command returns 0 once the mount is there; ``tierfs umount`` returns 0
    only after the daemon has finished: lock free, process gone, log complete."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = mount_cmd(data_dir, mnt)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert is_mounted(mnt), "mount.tierfs returned before the mount was there"
    pid = lock_holder_pid(data_dir)
    assert not process_gone(pid)
    assert not lock_is_free(data_dir)
    options = next(line.split()[3] for line in open("/proc/mounts")
                   if line.split()[1] == str(mnt))
    assert "allow_other" not in options.split(",")
    payload = os.urandom(300_000)
    (mnt / "file").write_bytes(payload)
    # the daemon logs to DATA/tierfs.log
    log = data_dir / "tierfs.log"
    assert "mounted" in log.read_text()

    r = run([TIERFS, "umount", str(mnt)])
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    # checked at once: no waiting here, tierfs umount must have waited
    assert lock_is_free(data_dir), "tierfs umount returned while the daemon held the lock"
    assert not is_mounted(mnt)
    assert "unmounted" in log.read_text()
    deadline = time.monotonic() + 5  # the lock is released just before the process exits
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_gone(pid)
    assert "Traceback" not in log.read_text() and " ERROR" not in log.read_text()
    assert_fsck_clean(data_dir)
    assert_remount_is_clean(data_dir, mnt, {"file": payload})


def test_fsck_takes_a_mount_point_and_umount_takes_data(data_dir, tmp_path):
    """Either name of a mounted filesystem works where the other is asked for: ``tierfs
    fsck MNT`` checks its DATA (it said "not a tierfs filesystem"), and ``tierfs umount
    DATA`` unmounts it (it said "not mounted"), as ``umount`` takes a device."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert mount_cmd(data_dir, mnt).returncode == 0
    (mnt / "sub").mkdir()
    (mnt / "sub" / "f").write_bytes(b"x" * 5000)
    for args, path in (([str(mnt)], "/"), ([str(mnt), "/sub"], "/sub")):
        r = run([TIERFS, "fsck", *args])
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        assert r.stdout.startswith(f"FSCK started for path '{path}' of {data_dir} at ")
        assert r.stdout.endswith(f"The filesystem under path '{path}' is HEALTHY\n")
    assert " Total files:\t1\n" in r.stdout
    r = run([TIERFS, "fsck", str(mnt), "--repair"])
    assert_one_line_error(r, 2, f"{data_dir} is mounted", "unmount it before fsck --repair")
    r = run([TIERFS, "umount", str(data_dir)])
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert not is_mounted(mnt) and lock_is_free(data_dir)
    r = run([TIERFS, "umount", str(data_dir)])
    assert_one_line_error(r, 1, f"{data_dir} is not mounted")


def test_background_mount_options_and_log_file(data_dir, tmp_path):
    """``-o allow_other`` reaches the kernel in background mode; ``--log`` chooses the log."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "logs" / "daemon.log"
    r = mount_cmd(data_dir, mnt, "-o", "allow_other", "--log", str(log))
    assert (r.returncode, r.stderr) == (0, "")
    try:
        options = next(line.split()[3] for line in open("/proc/mounts")
                       if line.split()[1] == str(mnt))
        assert "allow_other" in options.split(",")
        assert "mounted" in log.read_text()
        assert not (data_dir / "tierfs.log").exists()
    finally:
        assert run([TIERFS, "umount", str(mnt)]).returncode == 0
    assert "unmounted" in log.read_text()


def test_tierfs_umount_of_a_busy_mount_fails_and_leaves_it_mounted(mounted):
    mnt = mounted.mountpoint
    (mnt / "dir").mkdir()
    busy = subprocess.Popen(["sleep", "60"], cwd=mnt / "dir")
    try:
        r = run([TIERFS, "umount", str(mnt)])
        line = assert_one_line_error(r, 1, "cannot unmount", str(mnt),
                                     prefix="tierfs umount: ")
        assert "busy" in line.lower()
        assert is_mounted(mnt)
        assert mounted.proc.poll() is None
        (mnt / "still_works").write_text("yes")
    finally:
        busy.kill()
        busy.wait()
    r = run([TIERFS, "umount", str(mnt)])
    assert (r.returncode, r.stderr) == (0, "")
    assert mounted.proc.wait(timeout=30) == 0
    mounted.proc = None
    assert lock_is_free(mounted.data)


@pytest.mark.parametrize("what", ["plain-dir", "missing", "proc", "file", "usage"])
def test_tierfs_umount_refuses_what_is_not_a_tierfs_mount(tmp_path, what):
    target = {"plain-dir": tmp_path, "missing": tmp_path / "nope", "proc": Path("/proc"),
              "file": tmp_path / "f", "usage": None}[what]
    if what == "file":
        target.write_text("x")
    if what == "usage":
        r = run([TIERFS, "umount"])
        assert_one_line_error(r, 2, "MNT", prefix="tierfs umount: ")
        return
    r = run([TIERFS, "umount", str(target)])
    fragment = "is not a tierfs mount (proc)" if what == "proc" else "is not mounted"
    assert_one_line_error(r, 1, str(target), fragment, prefix="tierfs umount: ")
    assert os.path.ismount("/proc")


# --- signals and fusermount -----------------------------------------------------------------


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "fusermount3"])
def test_stopping_the_foreground_daemon(make_mount, how):
    """SIGTERM, SIGINT and ``fusermount3 -u`` unmount; the daemon exits 0, releases the lock,
    and the filesystem is clean (the next mount recovers nothing)."""
    mount = make_mount()
    mnt, data = mount.mountpoint, mount.data
    payload = os.urandom(1_000_003)
    (mnt / "d").mkdir()
    (mnt / "d" / "f").write_bytes(payload)
    os.setxattr(mnt / "d", "user.note", b"kept")
    if how == "fusermount3":
        r = run(["fusermount3", "-u", str(mnt)])
        assert r.returncode == 0, r.stderr
    else:
        mount.proc.send_signal(getattr(signal, how))
    rc = mount.proc.wait(timeout=30)
    mount.proc = None
    assert rc == 0, mount.log_text()
    assert not is_mounted(mnt)
    assert lock_is_free(data)
    text = mount.log_text()
    assert "unmounted" in text
    if how != "fusermount3":
        assert f"signal {getattr(signal, how).value}: unmounting" in text
    assert not mount.errors_logged(), mount.errors_logged()
    assert_fsck_clean(data)
    assert_remount_is_clean(data, mnt, {"d/f": payload})


def test_sigterm_to_a_background_daemon(data_dir, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert mount_cmd(data_dir, mnt).returncode == 0
    (mnt / "f").write_bytes(b"data before SIGTERM\n")
    pid = lock_holder_pid(data_dir)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not (process_gone(pid) and lock_is_free(data_dir)):
        assert time.monotonic() < deadline, "daemon did not stop after SIGTERM"
        time.sleep(0.02)
    assert not is_mounted(mnt)
    assert "unmounted" in (data_dir / "tierfs.log").read_text()
    assert_fsck_clean(data_dir)
    assert_remount_is_clean(data_dir, mnt, {"f": b"data before SIGTERM\n"})


# --- refusals -------------------------------------------------------------------------------


def test_second_mount_of_the_same_data_is_refused(mounted, tmp_path):
    data = mounted.data
    other = tmp_path / "mnt2"
    other.mkdir()
    (mounted.mountpoint / "f").write_text("first\n")
    link = tmp_path / "data-link"
    link.symlink_to(data)
    for args in ([], ["-f"]):
        for spelling in (data, link):
            r = mount_cmd(spelling, other, *args)
            assert_one_line_error(r, 1, "already mounted", f"pid {mounted.pid}",
                                  str(mounted.mountpoint), prefix="mount.tierfs: ")
            assert not is_mounted(other)
    # the first mount is undisturbed
    assert mounted.proc.poll() is None
    assert (mounted.mountpoint / "f").read_text() == "first\n"
    (mounted.mountpoint / "g").write_text("second\n")
    assert lock_holder_pid(data) == mounted.pid


def _break_volume(tmp_path: Path, data: Path, other: Path, case: str):
    """Damage DATA's volume set as ``case`` says; returns (fragments of the message, fix)."""
    aside = tmp_path / "aside"

    def swap(a: str, b: str):
        os.rename(data / a, aside)
        os.rename(data / b, data / a)
        os.rename(aside, data / b)

    def put_back():
        if (data / "disk").exists() or (data / "disk").is_symlink():
            os.rename(data / "disk", tmp_path / "rejected")
        os.rename(aside, data / "disk")

    if case == "removed":
        os.rename(data / "disk", aside)
        return ["/disk (DISK) is missing"], put_back
    if case == "foreign":  # the DISK volume of another tierfs filesystem
        os.rename(data / "disk", aside)
        os.rename(other / "disk", data / "disk")
        return ["/disk", "belongs to another tierfs filesystem"], put_back
    if case == "empty-dir":
        os.rename(data / "disk", aside)
        (data / "disk").mkdir()
        return ["/disk", "not a tierfs volume"], put_back
    if case == "plain-file":
        os.rename(data / "disk", aside)
        (data / "disk").write_text("not a directory")
        return ["/disk"], put_back
    if case == "symlink-elsewhere":
        os.rename(data / "disk", aside)
        (data / "disk").symlink_to(other / "archive")
        return ["/disk", "belongs to another tierfs filesystem"], put_back
    if case == "swapped-within-fs":  # ssd and disk exchanged: the first one opened is named
        swap("ssd", "disk")
        return ["/ssd is volume"], lambda: swap("ssd", "disk")
    version = data / "disk" / "VERSION"
    saved = version.read_bytes()
    if case == "wrong-type":
        identity = json.loads(saved)
        identity["storage_type"] = "SSD"
        version.write_text(json.dumps(identity))
        return ["/disk is a SSD volume, expected DISK"], lambda: version.write_bytes(saved)
    assert case == "garbled-identity"
    version.write_text("{not json")
    return ["/disk has a malformed VERSION file"], lambda: version.write_bytes(saved)


VOLUME_CASES = [(case, False) for case in (
    "removed", "foreign", "empty-dir", "plain-file", "symlink-elsewhere", "swapped-within-fs",
    "wrong-type", "garbled-identity")] + [("removed", True), ("foreign", True)]


@pytest.mark.parametrize("case,background", VOLUME_CASES,
                         ids=[f"{c}-{'bg' if b else 'fg'}" for c, b in VOLUME_CASES])
def test_a_missing_or_swapped_volume_is_refused(tmp_path, case, background):
    """The volume directories are checked against the namespace before anything is served;
    the refusal is one line naming the volume, exit 1, and changes nothing: after putting the
    right directory back, the filesystem mounts clean with its data."""
    data, other = tmp_path / "data", tmp_path / "other"
    mkfs(data)
    mkfs(other)
    mnt = tmp_path / "mnt"
    mount = Mount(data, mnt).start()
    payload = os.urandom(200_000)
    (mnt / "f").write_bytes(payload)
    mount.stop()
    fragments, fix = _break_volume(tmp_path, data, other, case)
    before = sorted(os.listdir(data))
    r = mount_cmd(data, mnt, *([] if background else ["-f"]))
    assert_one_line_error(r, 1, str(data), *fragments, prefix="mount.tierfs: ")
    assert not is_mounted(mnt)
    assert lock_is_free(data)
    assert sorted(os.listdir(data)) == sorted(set(before) | ({"tierfs.log"} if background
                                                             else set()))
    fix()
    assert_remount_is_clean(data, mnt, {"f": payload})


def test_mount_point_problems_are_one_line_errors(tmp_path):
    data = tmp_path / "data"
    (tmp_path / "afile").write_text("x")
    for mnt, args in ((tmp_path / "missing", []), (tmp_path / "missing", ["-f"]),
                      (tmp_path / "afile", ["-f"]), (tmp_path / "afile", [])):
        r = mount_cmd(data, mnt, *args)
        assert_one_line_error(r, 1, str(mnt), "does not exist or is not a directory",
                              prefix="mount.tierfs: ")
        # nothing made but, in background mode, the log file the error is not written to
        assert not data.exists() or os.listdir(data) == ["tierfs.log"], os.listdir(data)
    assert not (data / "namespace").exists()


@pytest.mark.parametrize("background", [False, True], ids=["fg", "bg"])
def test_a_non_tierfs_data_directory_is_refused(tmp_path, background):
    data = tmp_path / "data"
    (data / "photos").mkdir(parents=True)
    (data / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 not really")
    (data / "notes").write_text("mine\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    before = sorted(str(p.relative_to(data)) for p in data.rglob("*"))
    r = mount_cmd(data, mnt, *([] if background else ["-f"]))
    assert_one_line_error(r, 1, str(data), "neither empty nor a tierfs filesystem",
                          prefix="mount.tierfs: ")
    assert not is_mounted(mnt)
    after = sorted(str(p.relative_to(data)) for p in data.rglob("*"))
    if background:  # the background daemon opens DATA/tierfs.log before it looks (reported)
        after = [p for p in after if p != "tierfs.log"]
    assert after == before
    # a file where DATA should be
    r = mount_cmd(tmp_path / "data" / "notes", mnt, *([] if background else ["-f"]))
    assert_one_line_error(r, 1, "notes", prefix="mount.tierfs: ")


def test_an_unknown_fuse_option_fails_and_leaves_the_filesystem_clean(data_dir, tmp_path):
    """libfuse explains the failure on stderr only; that explanation is the one line
    (before: "fuse_session_new() failed", and with -f libfuse's own line as well)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for mode in (["-f"], []):
        r = mount_cmd(data_dir, mnt, *mode, "-o", "no_such_option")
        assert_one_line_error(r, 1, "FUSE mount", "unknown option", "no_such_option",
                              prefix="mount.tierfs: ")
        assert not is_mounted(mnt)
    assert lock_is_free(data_dir)
    assert_remount_is_clean(data_dir, mnt)


@pytest.mark.parametrize("option", ["fsname=/elsewhere", "subtype=other"])
def test_options_the_daemon_sets_itself_are_refused(data_dir, tmp_path, option):
    """The tools find a mount's DATA by its fsname (before: -o fsname=X broke tierfs
    report and made tierfs umount return before the daemon had finished)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = mount_cmd(data_dir, mnt, "-o", f"allow_other,{option}")
    assert_one_line_error(r, 1, option.partition("=")[0], "set by mount.tierfs",
                          prefix="mount.tierfs: ")
    assert not is_mounted(mnt)


def test_a_mount_point_overlapping_data_or_a_volume_is_refused(tmp_path):
    """The daemon reaches DATA and its volumes by path: mounted on (or over) one of them, it
    waited on itself at the first write, unkillably (before: exit 0, then a hang)."""
    data, outside = tmp_path / "fs" / "data", tmp_path / "vol"
    mkfs(data, "--volume", f"SSD:{data / 'ssd'}", "--volume", f"DISK:{outside}")
    (outside / "current" / "sub").mkdir(parents=True, exist_ok=True)
    cases = [(data, "the data directory"), (data / "ssd", "the data directory"),
             (tmp_path / "fs", "the data directory"), (outside, "volume"),
             (outside / "current" / "sub", "volume")]
    for mnt, what in cases:
        for mode in (["-f"], []):
            r = mount_cmd(data, mnt, *mode, timeout=30)
            assert_one_line_error(r, 1, str(mnt), "overlaps", what, prefix="mount.tierfs: ")
            assert not is_mounted(mnt)
    (outside / "current" / "sub").rmdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # DATA given through a symlink inside the mount point resolves elsewhere, but the
    # daemon opens it by the path given: through its own mount (before: a hang).
    os.symlink(data, mnt / "link")
    for mode in (["-f"], []):
        r = mount_cmd(mnt / "link", mnt, *mode, timeout=30)
        assert_one_line_error(r, 1, str(mnt), "overlaps", "the data directory",
                              prefix="mount.tierfs: ")
        assert not is_mounted(mnt)
    os.unlink(mnt / "link")
    assert_remount_is_clean(data, mnt)


@pytest.mark.parametrize("refusal", ["mount point is DATA", "fsname", "volume not empty"])
def test_a_refused_background_mount_of_a_new_data_directory_writes_nothing(tmp_path, refusal):
    """The background daemon opens its log in DATA before prepare() runs; a refusal that
    only prepare() made left DATA/tierfs.log behind (in a mount point, for one)."""
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    data.mkdir()
    mnt.mkdir()
    if refusal == "volume not empty":  # the default layout's ssd/ holds someone's file
        (data / "ssd").mkdir()
        (data / "ssd" / "someone's").write_text("x")
    before = sorted(p.name for p in data.rglob("*"))
    if refusal == "mount point is DATA":
        r = mount_cmd(data, data)
    elif refusal == "fsname":
        r = mount_cmd(data, mnt, "-o", "fsname=x")
    else:
        r = mount_cmd(data, mnt)
    assert_one_line_error(r, 1, prefix="mount.tierfs: ")
    assert sorted(p.name for p in data.rglob("*")) == before


def test_a_data_directory_at_the_root_of_a_fresh_disk_is_taken(tmp_path):
    """mkfs.ext4 puts lost+found at the root of every filesystem; DATA and volumes are
    often such roots. Both mount.tierfs (default layout, which may also find its volume
    directories made, empty) and tierfs mkfs take them, and leave lost+found alone."""
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    (data / "lost+found").mkdir(parents=True)
    (data / "ssd").mkdir()
    mnt.mkdir()
    r = mount_cmd(data, mnt)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    (mnt / "f").write_bytes(b"kept")
    assert run([TIERFS, "umount", str(mnt)]).returncode == 0
    assert (data / "lost+found").is_dir()
    assert_remount_is_clean(data, mnt, {"f": b"kept"})

    other, volume = tmp_path / "other", tmp_path / "volume"
    (other / "lost+found").mkdir(parents=True)
    (volume / "lost+found").mkdir(parents=True)
    r = run([TIERFS, "mkfs", str(other), "--volume", f"DISK:{volume}"])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (volume / "lost+found").is_dir() and (volume / "VERSION").is_file()


@pytest.mark.parametrize("foreground", [False, True])
def test_a_mount_started_with_stderr_closed_works(tmp_path, foreground):
    """``mount.tierfs DATA MNT 2>&-``: Python then has no sys.stderr, and the daemon's
    first open() would take descriptor 2 (libfuse's messages written into the namespace).
    It failed with "daemon died"; now fd 2 is /dev/null, or the log in the background."""
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    mnt.mkdir()
    cmd = [MOUNT_TIERFS, str(data), str(mnt)] + (["-f"] if foreground else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(2))
    try:
        if foreground:
            deadline = time.monotonic() + 30
            while not is_mounted(mnt):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
            pid = proc.pid
        else:
            assert proc.wait(timeout=60) == 0
            pid = lock_holder_pid(data)
        expected = os.devnull if foreground else str(data / "tierfs.log")
        assert os.readlink(f"/proc/{pid}/fd/2") == expected
        (mnt / "f").write_bytes(b"x" * 100_000)
        assert (mnt / "f").read_bytes() == b"x" * 100_000
    finally:
        r = run([TIERFS, "umount", str(mnt)])
    assert r.returncode == 0, r.stderr
    if foreground:
        assert proc.wait(timeout=30) == 0
    assert_remount_is_clean(data, mnt, {"f": b"x" * 100_000})


def test_debug_lines_stay_out_of_the_one_line_error(data_dir, tmp_path):
    """With --debug, pyfuse3's own log lines during the FUSE setup were captured along
    with libfuse's explanation and made part of the error line."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = mount_cmd(data_dir, mnt, "-f", "--debug", "-o", "no_such_option")
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("mount.tierfs: ")]
    assert errors == ["mount.tierfs: FUSE mount of %s failed: fuse: unknown option(s): "
                      "`-o no_such_option'" % mnt], r.stderr
    assert "Initializing pyfuse3" in r.stderr  # the debug lines went to stderr as usual


def test_mounting_over_a_tierfs_mount_is_refused(mounted, tmp_path):
    """A second filesystem stacked on the first would hide it, and tierfs umount would only
    ever reach the top one."""
    other = tmp_path / "other"
    mkfs(other)
    (mounted.mountpoint / "f").write_text("first\n")
    for mode in (["-f"], []):
        r = mount_cmd(other, mounted.mountpoint, *mode)
        assert_one_line_error(r, 1, "already the mount point of tierfs", str(mounted.data),
                              prefix="mount.tierfs: ")
    assert (mounted.mountpoint / "f").read_text() == "first\n"
    assert lock_is_free(other)


def test_mounting_over_the_data_directory_of_another_tierfs_is_refused(make_mount, tmp_path):
    """A mount on or around another mounted tierfs's DATA hid its namespace and volumes
    from its daemon, which reaches them by path (its disk volume went "UNAVAILABLE")."""
    first = make_mount()
    (first.mountpoint / "f").write_bytes(b"kept\n")
    other = tmp_path / "other"
    for target in (first.data / "disk", first.data):
        r = mount_cmd(other, target)
        assert_one_line_error(r, 1, f"mount point {target} overlaps the data directory "
                                    f"{first.data} of the tierfs mounted on "
                                    f"{first.mountpoint}: mount it elsewhere",
                              prefix="mount.tierfs: ")
    assert not other.exists()
    with open(first.mountpoint / "g", "wb") as f:  # a new block, placed by path
        f.write(b"still reachable\n")
        os.fsync(f.fileno())
    assert (first.mountpoint / "f").read_bytes() == b"kept\n"


def test_a_dead_mount_on_the_mount_point_is_refused_saying_how_to_clear_it(data_dir,
                                                                          tmp_path):
    """A killed daemon leaves a dead mount (ENOTCONN) on its mount point. Mounting there
    said only "Transport endpoint is not connected"; now it names the dead mount and the
    command that clears it, and never takes a mount away itself (only its daemon knows
    for sure that it is gone). ``tierfs umount`` of the dead mount does not wait for a
    daemon of the same DATA that serves it elsewhere meanwhile (it waited 120 s)."""
    mnt, elsewhere = tmp_path / "mnt", tmp_path / "elsewhere"
    first = Mount(data_dir, mnt).start()
    with open(mnt / "f", "wb") as f:
        f.write(b"kept\n")
        os.fsync(f.fileno())
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    with pytest.raises(OSError) as dead:
        os.stat(mnt / "f")
    assert dead.value.errno == errno.ENOTCONN
    for data in (data_dir, tmp_path / "other"):
        assert_one_line_error(mount_cmd(data, mnt), 1,
                              f"{mnt} is already the mount point of tierfs {data_dir} (its "
                              f"daemon is gone): unmount it first (tierfs umount {mnt})",
                              prefix="mount.tierfs: ")
    assert not (tmp_path / "other").exists()

    elsewhere.mkdir()
    assert mount_cmd(data_dir, elsewhere).returncode == 0
    try:
        assert (elsewhere / "f").read_bytes() == b"kept\n"
        started = time.monotonic()
        r = run([TIERFS, "umount", str(mnt)])
        assert (r.returncode, r.stderr) == (0, ""), r.stderr
        assert time.monotonic() - started < 10
        assert not is_mounted(mnt) and is_mounted(elsewhere)
        assert (elsewhere / "f").read_bytes() == b"kept\n"
    finally:
        assert run_tool("umount", str(elsewhere)).returncode == 0
    assert_fsck_clean(data_dir)


def test_mount_usage_errors(tmp_path):
    for args in ([], [str(tmp_path)], ["a", "b", "c"], ["--bogus", "a", "b"]):
        r = run([MOUNT_TIERFS, *args])
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert "usage: mount.tierfs" in r.stderr


# --- allow_other ----------------------------------------------------------------------------


def test_allow_other_lets_other_users_in(mounted):
    """With ``-o allow_other`` (the fixture's mount) another user lists and reads the mount;
    permissions are still enforced (default_permissions)."""
    mnt = mounted.mountpoint
    (mnt / "public").write_text("for everyone\n")
    (mnt / "private").write_text("root only\n")
    os.chmod(mnt / "private", 0o600)
    options = next(line.split()[3] for line in open("/proc/mounts")
                   if line.split()[1] == str(mnt))
    assert {"allow_other", "default_permissions"} <= set(options.split(","))
    # relative paths from a cwd inside the mount: nobody may not traverse pytest's tmp dirs
    r = run([*NOBODY, "ls", "-a", "."], cwd=mnt)
    assert (r.returncode, r.stdout.split()) == (0, [".", "..", "private", "public"]), r.stderr
    r = run([*NOBODY, "cat", "public"], cwd=mnt)
    assert (r.returncode, r.stdout) == (0, "for everyone\n")
    r = run([*NOBODY, "cat", "private"], cwd=mnt)
    assert r.returncode == 1 and "Permission denied" in r.stderr
    r = run([*NOBODY, "touch", "new"], cwd=mnt)
    assert r.returncode == 1 and "Permission denied" in r.stderr
    os.chmod(mnt, 0o1777)
    r = run([*NOBODY, "sh", "-c", "echo mine > new && stat -c '%u %g' new"], cwd=mnt)
    assert (r.returncode, r.stdout) == (0, "65534 65534\n"), r.stderr


def test_without_allow_other_other_users_are_kept_out(make_mount):
    mount = make_mount(options="")
    mnt = mount.mountpoint
    (mnt / "public").write_text("x")
    options = next(line.split()[3] for line in open("/proc/mounts")
                   if line.split()[1] == str(mnt))
    assert "allow_other" not in options.split(",")
    r = run([*NOBODY, "ls", "."], cwd=mnt)
    assert r.returncode == 2 and "Permission denied" in r.stderr, (r.returncode, r.stderr)
    r = run([*NOBODY, "cat", "public"], cwd=mnt)
    assert r.returncode == 1 and "Permission denied" in r.stderr
    assert run(["ls", "."], cwd=mnt).stdout.split() == ["public"]


# --- tierfs mkfs ----------------------------------------------------------------------------


def test_mkfs_success_output(tmp_path):
    data = tmp_path / "data"
    r = run([TIERFS, "mkfs", str(data), "--volume", f"SSD:{tmp_path}/fast:1G",
             "--volume", f"DISK:{tmp_path}/slow", "--replication", "2", "--block-size", "1M",
             "--default-policy", "one_ssd"])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("tierfs filesystem ") and lines[0].endswith(
        f"created in {data}")
    assert len(lines) == 4, r.stdout
    assert "SSD" in lines[1] and f"{tmp_path}/fast" in lines[1] and "capacity" in lines[1]
    assert "DISK" in lines[2] and f"{tmp_path}/slow" in lines[2]
    assert "block size 1048576" in lines[3] and "replication 2" in lines[3]
    assert "default policy ONE_SSD" in lines[3]
    mount = Mount(data, tmp_path / "mnt").start()
    try:
        (tmp_path / "mnt" / "f").write_bytes(b"x" * 3_000_000)
    finally:
        mount.stop()
    # ONE_SSD, replication 2 over an SSD and a DISK volume: every block has a data file on each
    fast = {p.name for p in (tmp_path / "fast").rglob("blk_*") if "meta" not in p.name}
    slow = {p.name for p in (tmp_path / "slow").rglob("blk_*") if "meta" not in p.name}
    assert len(fast) == 3 and fast == slow
    assert_fsck_clean(data)


def test_mkfs_warns_of_a_default_policy_no_volume_can_take(tmp_path, make_mount):
    """HOT wants DISK and has no creation fallback: on SSD volumes alone every write under
    the default policy fails with ENOSPC. mkfs says so (and still makes the filesystem:
    directories may get policies these volumes satisfy); a policy whose fallback is
    present draws no warning."""
    r = run([TIERFS, "mkfs", str(tmp_path / "fallback"), "--volume",
             f"DISK:{tmp_path}/fallback-disk", "--default-policy", "ALL_SSD"])
    assert r.returncode == 0 and r.stderr == "", r.stderr

    r = run([TIERFS, "mkfs", str(tmp_path / "warned"), "--volume", f"SSD:{tmp_path}/warned-ssd"])
    assert r.returncode == 0 and r.stderr == (
        "warning: default policy HOT can place no block on these volumes (it wants DISK; "
        "creation fallbacks: none): writes will fail with ENOSPC wherever no other policy "
        "is set\n"), r.stderr

    # What it warns of, on a mount of the same layout.
    mnt = make_mount("--volume", f"SSD:{tmp_path}/ssd-only", "--block-size", "1M").mountpoint
    with pytest.raises(OSError) as caught:
        (mnt / "f").write_bytes(b"x" * 10)
    assert caught.value.errno == errno.ENOSPC
    (mnt / "fast").mkdir()
    os.setxattr(mnt / "fast", "user.tierfs.storage_policy", b"ALL_SSD")
    (mnt / "fast" / "f").write_bytes(b"y" * 10)
    assert (mnt / "fast" / "f").read_bytes() == b"y" * 10


def test_a_replication_the_volumes_cannot_hold_is_warned_of_and_explained(tmp_path,
                                                                         make_mount):
    """Replication 3 on the default layout: HOT keeps one replica on DISK and one on
    ARCHIVE, and there is no third volume it may use. mkfs warned of nothing, the file's
    ``satisfied`` said "awaiting re-replication" forever and the log "no volume allowed by
    HOT has room" with every disk nearly empty. Now all three say what cannot be met."""
    r = run([TIERFS, "mkfs", str(tmp_path / "three"), "--replication", "3"])
    assert r.returncode == 0 and r.stderr == (
        "warning: default policy HOT can keep at most 2 of 3 replicas on these volumes (one "
        "per volume): blocks will stay under-replicated wherever no other policy is set\n")
    r = run([TIERFS, "mkfs", str(tmp_path / "disks"), "--replication", "3"]
            + [f"--volume=DISK:{tmp_path}/disks-{i}" for i in range(3)])
    assert r.returncode == 0 and r.stderr == "", r.stderr

    mount = make_mount("--replication", "3", "--block-size", "1M")
    (mount.mountpoint / "f").write_bytes(b"x" * 10)
    why = "HOT can keep at most 2 replicas on these volumes (one per volume)"

    def satisfied() -> str:
        return os.getxattr(mount.mountpoint / "f", "user.tierfs.satisfied").decode()

    assert wait_for(lambda: why in satisfied()), satisfied()
    assert satisfied().endswith(f"1 of 1 blocks have fewer than 3 replicas, {why}")
    assert wait_for(lambda: f"only 2 of 3 replicas placeable: {why}" in mount.log_text()), \
        mount.log_text()
    assert os.getxattr(mount.mountpoint / "f", "user.tierfs.placement") == b"DISK:1,ARCHIVE:1 x1"


MKFS_ERRORS = [
    # (extra args, exit code, fragments)
    (["--volume", "FOO:{tmp}/v"], 2, ["unknown storage type 'FOO'"]),
    (["--volume", "SSD"], 2, ["invalid volume 'SSD'"]),
    (["--volume", "SSD:"], 2, ["invalid volume"]),
    (["--volume", "SSD:{tmp}/v:1:2"], 2, ["invalid volume"]),
    (["--volume", "SSD:{tmp}/v:10Q"], 2, ["invalid size '10Q'"]),
    (["--volume", "SSD:{tmp}/v:0"], 2, ["capacity must be positive"]),
    (["--volume", "SSD:{tmp}/v", "--volume", "DISK:{tmp}/v"], 2, ["share a directory"]),
    (["--block-size", "12X"], 2, ["invalid size '12X'"]),
    (["--block-size", "-1"], 2, ["invalid size"]),
    (["--block-size", "2G"], 2, ["--block-size"]),
    (["--block-size", "1000"], 2, ["--block-size"]),
    (["--bytes-per-checksum", "100"], 2, ["--bytes-per-checksum"]),
    (["--bytes-per-checksum", "lots"], 2, ["invalid size 'lots'"]),
    (["--replication", "4"], 2, ["--replication", "(3)"]),
    (["--replication", "0"], 2, ["--replication"]),
    (["--replication", "2", "--volume", "SSD:{tmp}/v"], 2, ["--replication", "(1)"]),
    (["--replication", "two"], 2, ["--replication"]),
    (["--default-policy", "NOPE"], 2, ["NOPE"]),
    (["--policy-on-rename", "sometimes"], 2, ["--policy-on-rename"]),
    (["--no-such-flag"], 2, ["--no-such-flag"]),
]


@pytest.mark.parametrize("args,code,fragments", MKFS_ERRORS,
                         ids=[" ".join(a) for a, _, _ in MKFS_ERRORS])
def test_mkfs_errors(tmp_path, args, code, fragments):
    data = tmp_path / "data"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = run([TIERFS, "mkfs", str(data), *args])
    assert_one_line_error(r, code, *fragments, prefix="tierfs")
    assert not data.exists(), "a refused mkfs created the data directory"
    assert not (tmp_path / "v").exists(), "a refused mkfs created a volume"


def test_mkfs_refuses_an_existing_filesystem_and_leaves_it_intact(mounted, tmp_path):
    data = mounted.data
    (mounted.mountpoint / "f").write_text("precious\n")
    before = json.loads((data / "ssd" / "VERSION").read_text())
    for extra in ([], ["--replication", "2"]):
        r = run([TIERFS, "mkfs", str(data), *extra])
        assert_one_line_error(r, 1, str(data), "already holds a tierfs filesystem",
                              prefix="tierfs mkfs: ")
    assert json.loads((data / "ssd" / "VERSION").read_text()) == before
    assert (mounted.mountpoint / "f").read_text() == "precious\n"
    mounted.stop()
    r = run([TIERFS, "mkfs", str(data)])
    assert_one_line_error(r, 1, "already holds a tierfs filesystem")
    assert_remount_is_clean(data, mounted.mountpoint, {"f": b"precious\n"})


def test_mkfs_refuses_a_non_empty_volume_directory(tmp_path):
    """Nothing is formatted when any volume is refused, so the same command works once the
    problem is fixed."""
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "someone_elses").write_text("keep me")
    cmd = [TIERFS, "mkfs", str(tmp_path / "data"), "--volume", f"SSD:{tmp_path}/first",
           "--volume", f"DISK:{tmp_path}/v"]
    r = run(cmd)
    assert_one_line_error(r, 1, f"{tmp_path}/v", "not empty", prefix="tierfs mkfs: ")
    assert os.listdir(tmp_path / "v") == ["someone_elses"]
    assert not (tmp_path / "first" / "VERSION").exists(), "a refused mkfs formatted a volume"
    os.rename(tmp_path / "v" / "someone_elses", tmp_path / "moved_away")
    r = run(cmd)
    assert r.returncode == 0, r.stderr
    assert_fsck_clean(tmp_path / "data")
    r = run([TIERFS, "mkfs", str(tmp_path / "data2"), "--volume",
             f"DISK:{tmp_path}/moved_away"])
    assert_one_line_error(r, 1, "not a directory", prefix="tierfs mkfs: ")


def test_no_traceback_from_tools_on_odd_input(tmp_path):
    """A grab bag of user mistakes: every one is a short message, never a traceback."""
    cmds = [[TIERFS], [TIERFS, "nosuchcommand"], [TIERFS, "mkfs"], [TIERFS, "fsck"],
            [TIERFS, "fsck", str(tmp_path / "nothing")],
            [TIERFS, "mkfs", "/proc/tierfs-cannot-be-here"],
            [MOUNT_TIERFS, str(tmp_path / "d"), str(tmp_path / "m"), "-o", ""]]
    for cmd in cmds:
        r = run(cmd)
        assert r.returncode != 0, cmd
        assert "Traceback" not in r.stderr, (cmd, r.stderr)
        assert 1 <= len(r.stderr.splitlines()) <= 3, (cmd, r.stderr)


def test_a_tool_whose_output_pipe_closes_stops_quietly(tmp_path):
    """``tierfs report DATA | head -1``: the tool used to end with "Broken pipe" on
    stderr and exit 1, as if it had failed. fsck keeps its verdict as exit code."""
    data = tmp_path / "data"
    mkfs(data)
    for cmd, code in (["report", 141], ["fsck", 0]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        proc = subprocess.run([TIERFS, cmd, str(data)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
        os.close(write_end)
        assert (proc.returncode, proc.stderr) == (code, ""), cmd


@pytest.mark.parametrize("name", ["données", "not-utf8-\udcff", "a,b", "back\\slash 50%",
                                  "form\x0cfeed line\u2028separator"])
def test_data_and_mount_point_names_beyond_ascii(tmp_path, name):
    """pyfuse3 passes mount options as ASCII and libfuse splits them at commas: a DATA
    named "données" made the daemon die at the mount ("daemon died", a traceback in its
    log). The fsname now percent-encodes what libfuse cannot take, and the tools decode
    it: report and umount find DATA from the mount point."""
    data = tmp_path / name
    mnt = tmp_path / f"mnt-{name}"
    mnt.mkdir()
    r = mount_cmd(data, mnt)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    try:
        (mnt / "f").write_bytes(b"kept")
        report = subprocess.run([TIERFS, "report", str(mnt)], capture_output=True,
                                timeout=60)
        assert report.returncode == 0, report.stderr
        assert report.stdout.startswith(b"tierfs report of " + os.fsencode(data) + b":")
    finally:
        r = run([TIERFS, "umount", str(mnt)])
    assert r.returncode == 0, r.stderr
    assert_remount_is_clean(data, mnt, {"f": b"kept"})


def test_mount_errors_naming_a_path_that_is_not_utf8_reach_the_user(tmp_path):
    """In the background the daemon sends its one line through a pipe; encoding it
    strictly failed for such a path, and the user only read "daemon died"."""
    data = tmp_path / "data"
    missing = tmp_path / "not-utf8-\udcff"
    r = subprocess.run([MOUNT_TIERFS, str(data), str(missing)], capture_output=True,
                       timeout=60)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(b"mount.tierfs: mount point ") and \
        b"not-utf8-" in r.stderr and b"does not exist" in r.stderr, r.stderr


def test_the_mount_lock_names_a_mount_point_holding_a_newline(tmp_path):
    """The lock file holds the daemon's pid and mount point, one per line; a mount point
    with a newline in its name was cut there in "already mounted (pid N on MNT)"."""
    from tierfs.fs.mountlock import MountLock
    data = tmp_path / "data"
    mkfs(data)
    lock = MountLock(data)
    lock.acquire(tmp_path / "a\nb")
    try:
        assert MountLock(data).holder() == (os.getpid(), str(tmp_path / "a\nb"))
    finally:
        lock.release()
    assert MountLock(data).holder() is None


def test_a_data_path_too_long_to_name_a_mount_is_refused_with_a_reason(tmp_path):
    """The kernel takes a mount's source name (here the percent-encoded DATA path) up to
    4,095 bytes; beyond that the mount failed with a bare "Invalid argument"."""
    data = tmp_path.joinpath(*["ж" * 120] * 6)  # 1,440 bytes, 4,320 once encoded
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for mode in (["-f"], []):
        r = mount_cmd(data, mnt, *mode)
        assert_one_line_error(r, 1, "too long to name a mount", prefix="mount.tierfs: ")
    assert not data.exists()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_signal_while_the_mount_is_in_use_for_reading(make_mount, how):
    """A process with its cwd in the mount and a file open for reading does not stop the
    signal from unmounting; the daemon exits 0 and leaves a clean filesystem."""
    mount = make_mount()
    mnt, data = mount.mountpoint, mount.data
    (mnt / "sub").mkdir()
    (mnt / "sub" / "f").write_bytes(b"read me\n" * 1000)
    reader = subprocess.Popen(
        ["python3", "-c", "import sys, time; f = open('f', 'rb'); f.read(10); "
         "print('ready', flush=True); time.sleep(60)"],
        cwd=mnt / "sub", stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready"
        mount.proc.send_signal(getattr(signal, how))
        rc = mount.proc.wait(timeout=30)
        mount.proc = None
    finally:
        reader.kill()
        reader.wait()
    assert rc == 0, mount.log_text()
    assert not is_mounted(mnt)
    assert lock_is_free(data)
    assert not mount.errors_logged(), mount.errors_logged()
    assert_fsck_clean(data)
    assert_remount_is_clean(data, mnt, {"sub/f": b"read me\n" * 1000})


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_signal_while_a_file_is_being_written_waits_for_the_writer(make_mount, how):
    """A file open for writing holds the unmount back until it is closed, and the daemon
    serves it meanwhile: every byte the writer wrote is there after the remount. Before,
    the daemon unmounted at once; the writer's later write() calls succeeded into the page
    cache and were lost (dd of 1 GiB exited 0 with 381 MiB stored)."""
    mount = make_mount()
    mnt, data = mount.mountpoint, mount.data
    writer = subprocess.Popen(
        ["python3", "-c", "import os, sys, time\n"
         "fd = os.open('f', os.O_WRONLY | os.O_CREAT, 0o644)\n"
         "os.write(fd, b'a' * 65536); print('ready', flush=True)\n"
         "sys.stdin.readline()\n"
         "for i in range(64): os.write(fd, bytes([98 + i % 20]) * 65536)\n"
         "os.close(fd)"],
        cwd=mnt, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        mount.proc.send_signal(getattr(signal, how))
        deadline = time.monotonic() + 10
        while "open for writing" not in mount.log_text():
            assert time.monotonic() < deadline, mount.log_text()
            time.sleep(0.05)
        assert mount.proc.poll() is None and is_mounted(mnt)  # still serving the writer
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.wait(timeout=30) == 0
    finally:
        writer.kill()
        writer.wait()
    rc = mount.proc.wait(timeout=30)
    mount.proc = None
    assert rc == 0, mount.log_text()
    assert not is_mounted(mnt)
    expected = b"a" * 65536 + b"".join(bytes([98 + i % 20]) * 65536 for i in range(64))
    assert_fsck_clean(data)
    assert_remount_is_clean(data, mnt, {"f": expected})


def test_reply_to_a_dropped_request_is_not_logged_as_an_error():
    """The kernel forgets a request when its caller is interrupted or the connection ends at
    unmount with an asynchronous RELEASE in flight; pyfuse3 then logs the failed reply as an
    error. The daemon demotes exactly that (ENOENT) to INFO, as libfuse does, and leaves every
    other failed reply an error."""
    import logging

    from tierfs.mount import DroppedReplyFilter

    def filtered(msg: str, *args) -> logging.LogRecord:
        record = logging.LogRecord("pyfuse3", logging.ERROR, __file__, 1, msg, args, None)
        assert DroppedReplyFilter().filter(record)
        return record

    dropped = filtered("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
    assert dropped.levelname == "INFO" and dropped.levelno == logging.INFO
    assert "fuse_release()" in dropped.getMessage()
    assert "dropped the request" in dropped.getMessage()
    other = filtered("fuse_write(): fuse_reply_* failed with %s", os.strerror(errno.EINVAL))
    assert other.levelname == "ERROR"


def test_a_full_volume_fails_the_write_itself_not_only_the_close(tmp_path, make_mount):
    """With little room left, write-only opens are served uncached: write() gets ENOSPC,
    the size is what was stored, and nothing turns into zeros. Through the page cache,
    ``echo x > f`` exited 0 with the data lost, stat showed the size the kernel assumed,
    and a later append made the lost bytes a hole of zeros for good."""
    mount = make_mount("--volume", f"DISK:{tmp_path}/small:8M", "--block-size", "1M")
    mnt = mount.mountpoint
    src = tmp_path / "src"
    src.write_bytes(os.urandom(16 << 20))
    r = run(["dd", f"if={src}", f"of={mnt}/big", "bs=1M"])
    assert r.returncode == 1 and "No space left on device" in r.stderr, r.stderr
    stored = (mnt / "big").stat().st_size
    assert 0 < stored < (8 << 20) and stored % (1 << 20) == 0
    assert (mnt / "big").read_bytes() == src.read_bytes()[:stored]

    # A loop that keeps trying gets ENOSPC every time, but the log says so once a minute.
    fd = os.open(mnt / "big", os.O_WRONLY | os.O_APPEND)
    try:
        for _ in range(50):
            with pytest.raises(OSError) as caught:
                os.write(fd, b"x" * 4096)
            assert caught.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    full = [line for line in mount.log_text().splitlines()
            if "WARNING" in line and "write: no volume allowed" in line]
    assert len(full) == 1, full

    r = run(["bash", "-c", f"echo hello > {mnt}/log"])
    assert r.returncode != 0 and "No space left on device" in r.stderr, r.stderr
    assert (mnt / "log").stat().st_size == 0
    (mnt / "big").unlink()
    r = run(["bash", "-c", f"echo world >> {mnt}/log"])
    assert r.returncode == 0, r.stderr
    assert (mnt / "log").read_bytes() == b"world\n"

    # Read-write opens keep the page cache, so shared mappings still work.
    with open(mnt / "mapped", "w+b") as f:
        f.truncate(4096)
        with mmap.mmap(f.fileno(), 4096) as m:
            m[:5] = b"shared"[:5]
    assert (mnt / "mapped").read_bytes()[:5] == b"share"


def test_an_o_direct_write_the_volume_can_take_only_in_part_is_short(tmp_path, make_mount):
    """A write that fills the last block and needs a new one on a full volume writes what
    fits and returns that count (POSIX); the next write gets ENOSPC. Through the kernel's
    own O_DIRECT path (tried instead of ``direct_io``) the same write failed with EIO after
    changing the data."""
    mount = make_mount("--volume", f"DISK:{tmp_path}/small:8M", "--block-size", "1M")
    path = mount.mountpoint / "f"
    page = mmap.PAGESIZE
    r = run(["dd", "if=/dev/zero", f"of={path}", "bs=1M"])
    assert r.returncode == 1 and "No space left on device" in r.stderr, r.stderr
    stored = path.stat().st_size
    assert stored and stored % (1 << 20) == 0
    buf = mmap.mmap(-1, 2 * page)
    buf[:] = b"X" * (2 * page)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        assert os.pwritev(fd, [buf], stored - page) == page
        with pytest.raises(OSError) as caught:
            os.pwritev(fd, [buf], stored)
        assert caught.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
        buf.close()
    assert path.stat().st_size == stored
    with open(path, "rb") as f:
        f.seek(stored - 2 * page)
        assert f.read() == bytes(page) + b"X" * page


def _wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_removals_work_and_free_space_when_something_else_filled_the_disk(tmp_path):
    """Another program fills the disk that holds DATA to its last byte. Adding data fails
    with ENOSPC, but rm, rm -r, truncate, mv over a file and removexattr still work and
    give the space back, as on ext4. Every LMDB commit needs fresh pages, so all of them
    used to fail with ENOSPC too: the mount could not be cleared at all. The namespace
    keeps a removal reserve for them, made again once the disk has room. A mount on such
    a disk starts (it failed writing its lock file) and says when its reserve is short."""
    with small_disk(tmp_path, "96m") as disk:
        data = disk / "data"
        run_tool("mkfs", str(data), "--block-size", "1M")
        mount = Mount(data, tmp_path / "mnt")
        mount.log = tmp_path / "mount.log"   # not on the disk that fills
        mount.start()
        reserve = data / "namespace" / "removal.reserve"
        mnt = mount.mountpoint
        payload = os.urandom(8 << 20)
        try:
            assert reserve.stat().st_size == 8 << 20
            for name in ("big0", "big1", "big2"):
                (mnt / name).write_bytes(payload)
            (mnt / "d").mkdir()
            for i in range(200):
                (mnt / "d" / f"f{i}").write_bytes(b"%d" % i)
            (mnt / "keep").write_bytes(b"kept")
            os.setxattr(mnt / "keep", "user.note", b"x" * 2000)
            filler = fill_disk(disk)
            assert os.statvfs(disk).f_bavail == 0

            r = run(["dd", "if=/dev/zero", f"of={mnt}/big1", "bs=1M", "count=1",
                     "oflag=append", "conv=notrunc"])
            assert r.returncode == 1 and "No space left on device" in r.stderr, r.stderr
            assert (mnt / "big1").stat().st_size == 8 << 20
            (mnt / "big0").unlink()
            r = run(["rm", "-r", str(mnt / "d")])
            assert r.returncode == 0, r.stderr
            os.truncate(mnt / "big1", 4096)
            os.rename(mnt / "keep", mnt / "big2")
            os.removexattr(mnt / "big2", "user.note")

            _wait_for(lambda: os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
                      >= 16 << 20, "the removed files' blocks were not freed")
            _wait_for(lambda: reserve.stat().st_size == 8 << 20,
                      "the removal reserve was not made again")
            (mnt / "after").write_bytes(payload)
            assert sorted(os.listdir(mnt)) == ["after", "big1", "big2"]
            assert os.listxattr(mnt / "big2") == []
        finally:
            mount.stop()
        assert "gave 64 KiB of the removal reserve" in mount.log_text()
        assert "removal reserve whole again (8 MiB)" in mount.log_text()
        assert mount.errors_logged() == []

        # What a mount finds when removals used part of the reserve and the disk is full
        # again: it starts (the lock file and the mount state reuse their space or take
        # from the reserve), says the reserve is short, removals work, and the reserve is
        # made whole once there is room.
        os.truncate(reserve, 4 << 20)
        more = fill_disk(disk, name="more")
        assert os.statvfs(disk).f_bavail == 0
        offset = log_size(mount)
        mount.start()
        try:
            assert "the removal reserve is made once there is room" in log_since(mount, offset)
            (mnt / "big2").unlink()
            more.unlink()
            _wait_for(lambda: reserve.stat().st_size == 8 << 20,
                      "the removal reserve was not made whole once there was room")
        finally:
            mount.stop()
        filler.unlink()
        assert_remount_is_clean(data, mnt, {"big1": payload[:4096], "after": payload})


def _snapshot(tree: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``tree``: (size, mtime_ns, content)."""
    return {str(p.relative_to(tree)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(tree.rglob("*")) if p.is_file()}


def test_a_read_only_data_directory_mounts_with_ro_and_is_left_as_it_was(tmp_path):
    """DATA on read-only media (here a read-only bind mount) is served as it is with -o ro:
    no lock holder, state, recovery or sync is written. Without -o ro, or after an unclean
    stop (whose recovery must write), the mount is refused in one line."""
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    payload = os.urandom(300_000)
    mount = Mount(data, mnt).start()   # mount.tierfs makes the default layout
    (mnt / "dir").mkdir()
    (mnt / "dir" / "f").write_bytes(payload)
    os.setxattr(mnt / "dir", "user.tierfs.policy", b"COLD")
    mount.stop()
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    subprocess.run(["mount", "--bind", str(data), str(frozen)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(frozen)], check=True)
        before = _snapshot(data)
        assert_one_line_error(mount_cmd(frozen, mnt, "-f"), 1,
                              f"{frozen} is read-only here: mount it with -o ro")
        assert_one_line_error(mount_cmd(frozen, mnt, "-o", "ro"), 1,
                              f"cannot open log {frozen}/tierfs.log: Read-only file system "
                              "(give --log FILE, or run with -f)")
        ro = Mount(frozen, mnt, "ro,allow_other").start()
        try:
            assert (mnt / "dir" / "f").read_bytes() == payload
            assert os.getxattr(mnt / "dir", "user.tierfs.policy") == b"COLD"
            with pytest.raises(OSError) as caught:
                (mnt / "new").write_bytes(b"x")
            assert caught.value.errno == errno.EROFS
            other = tmp_path / "other"
            other.mkdir()
            assert_one_line_error(mount_cmd(frozen, other, "-f", "-o", "ro"), 1,
                                  f"{frozen} is already mounted")
            r = run([TIERFS, "report", str(frozen)])
            assert r.returncode == 0 and "mounted (read-only DATA" in r.stdout, r
            r = run([TIERFS, "fsck", str(frozen)])
            assert r.returncode == 0 and r.stdout.rstrip().endswith("is HEALTHY"), r.stdout
        finally:
            ro.stop()
        assert "ERROR" not in ro.log_text(), ro.log_text()
        assert _snapshot(data) == before
        # an unclean stop leaves recovery that needs to write
        rw = Mount(data, mnt).start()
        fd = os.open(mnt / "dir" / "open", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"x")
        os.fsync(fd)
        rw.kill()
        with contextlib.suppress(OSError):  # the daemon is gone
            os.close(fd)
        assert_one_line_error(mount_cmd(frozen, mnt, "-f", "-o", "ro"), 1,
                              f"{frozen} was not unmounted cleanly and is read-only here: its "
                              "recovery needs to write, so mount it once where it is writable")
    finally:
        subprocess.run(["umount", str(frozen)], check=True)
    Mount(data, mnt).start().stop()    # writable again: the recovery runs
    assert_fsck_clean(data)


# --- the README's ./run script ------------------------------------------------------------------

RUN_SCRIPT = Path(__file__).resolve().parent.parent / "run"


@pytest.mark.parametrize("args, mount_point", [
    ("/d /m", "/m"),
    ("-o ro /d /m", "/m"),           # made a directory named "ro" in the current one
    ("-fo ro /d /m", "/m"),
    ("/d -f /m -o allow_other", "/m"),
    ("--lo /tmp/l --debug /d /m", "/m"),   # --log, abbreviated as argparse allows
    ("/d -o", None),                 # no MNT: mount.tierfs's usage, exit code 2
])
def test_run_mount_finds_the_mount_point_as_mount_tierfs_reads_it(args, mount_point):
    """``./run mount`` makes MNT before it mounts: MNT as mount.tierfs's own parser reads
    the command line, not the second argument."""
    venv = os.path.dirname(os.path.dirname(TIERFS))
    r = run(["bash", "-c", f'source "$1"; mount_point_arg {args}', "bash", str(RUN_SCRIPT)],
            env={**os.environ, "TIERFS_VENV": venv})
    if mount_point is None:
        assert (r.returncode, r.stdout) == (2, "")
        assert r.stderr.startswith("usage: mount.tierfs"), r.stderr
    else:
        assert (r.returncode, r.stdout, r.stderr) == (0, mount_point + "\n", "")


def test_run_shell_runs_a_command_with_the_virtualenv_active():
    """``./run shell -c COMMAND`` ran an interactive shell and ignored the command; without
    a terminal the virtualenv was not active either (bash reads no rc file then)."""
    venv = os.path.dirname(os.path.dirname(TIERFS))
    r = run([str(RUN_SCRIPT), "shell", "-c", 'echo "$VIRTUAL_ENV"; command -v tierfs'],
            env={**os.environ, "TIERFS_VENV": venv}, stdin=subprocess.DEVNULL, timeout=300)
    assert (r.returncode, r.stdout) == (0, f"{venv}\n{TIERFS}\n"), r.stderr
