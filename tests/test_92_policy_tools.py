"""``tierfs policy list|get|set|unset`` and ``tierfs report``: outputs and exit codes.

The policy commands answer like ``hdfs storagepolicies`` (reference, section 3.1): 0 done,
1 usage, 2 failed. ``tierfs report`` reads a data directory or a mount beside the running
daemon. No command may ever show a traceback.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import stat
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from tests.conftest import TIERFS, require_tool, run_tool
from tierfs.satisfier.policies import PolicySuite

KiB = 1 << 10
BLOCK = 128 * KiB
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
          "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
"""Another user, running this checkout's ``tierfs``. The checkout may sit where other users
cannot read (a clone in /root, mode 0700 on a fresh Debian), so that user may read and
search any file (CAP_DAC_READ_SEARCH): what it is refused below is writing, which that
capability does not allow."""
TIERS = (("SSD", "ssd0", "4M"), ("DISK", "disk0", None), ("DISK", "disk1", None),
         ("ARCHIVE", "arc0", None), ("ARCHIVE", "arc1", None))
HOT_LINE = ("BlockStoragePolicy{HOT:7, storageTypes=[DISK], creationFallbacks=[], "
            "replicationFallbacks=[ARCHIVE]}")
COLD_LINE = ("BlockStoragePolicy{COLD:2, storageTypes=[ARCHIVE], creationFallbacks=[], "
             "replicationFallbacks=[]}")


def tool(*args: str, cwd: Path | None = None, user: list[str] | None = None):
    """``tierfs ARGS`` (optionally as another user); never a traceback, on any stream."""
    if user:
        result = subprocess.run([*user, TIERFS, *args], cwd=cwd, capture_output=True,
                                text=True, timeout=120)
    else:
        result = run_tool(*args, check=False, cwd=cwd, timeout=120)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    return result


def failed(result, code: int, message: str) -> None:
    """Exit ``code`` with exactly one line on stderr containing ``message``."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


# --- tierfs policy ----------------------------------------------------------------------------


def test_policy_list_prints_the_suite_like_hdfs():
    r = tool("policy", "list")
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == "Block Storage Policies:"
    assert lines[1:] == [f"\t{p}" for p in PolicySuite().all_policies()]
    ids = [int(re.match(r"\tBlockStoragePolicy\{\w+:(\d+),", line).group(1))
           for line in lines[1:]]
    assert ids == sorted(ids) == [1, 2, 5, 7, 10, 12, 14, 15]
    assert f"\t{HOT_LINE}" in lines and f"\t{COLD_LINE}" in lines


def test_policy_get_set_unset_on_a_mount(mounted):
    mnt = mounted.mountpoint
    (mnt / "a/b").mkdir(parents=True)
    (mnt / "a/b/f").write_bytes(b"x")

    r = tool("policy", "get", "a/b/f", cwd=mnt)       # nothing set anywhere: unspecified
    assert (r.returncode, r.stdout, r.stderr) == (
        0, "The storage policy of a/b/f is unspecified\n", "")

    r = tool("policy", "set", "a", "cold", cwd=mnt)
    assert (r.returncode, r.stdout, r.stderr) == (0, "Set storage policy cold on a\n", "")
    assert os.getxattr(mnt / "a", "user.tierfs.storage_policy") == b"COLD"
    for path in ("a", "a/b", "a/b/f", str(mnt / "a/b/f")):   # the effective policy
        r = tool("policy", "get", path, cwd=mnt)
        assert (r.returncode, r.stdout) == (0, f"The storage policy of {path}:\n{COLD_LINE}\n")

    r = tool("policy", "set", str(mnt / "a/b/f"), "HOT")
    assert r.returncode == 0 and r.stdout == f"Set storage policy HOT on {mnt / 'a/b/f'}\n"
    assert tool("policy", "get", "a/b/f", cwd=mnt).stdout == \
        f"The storage policy of a/b/f:\n{HOT_LINE}\n"

    r = tool("policy", "unset", "a", cwd=mnt)
    assert (r.returncode, r.stdout, r.stderr) == (0, "Unset storage policy from a\n", "")
    assert tool("policy", "get", "a/b", cwd=mnt).stdout == \
        "The storage policy of a/b is unspecified\n"
    # The unset applies to the subtree: the file's own older setting is gone too.
    assert tool("policy", "get", "a/b/f", cwd=mnt).stdout == \
        "The storage policy of a/b/f is unspecified\n"
    r = tool("policy", "unset", "a/b", cwd=mnt)       # nothing of its own: still fine
    assert r.returncode == 0

    # Set on the root: "unspecified" means nothing set on the path or any ancestor.
    tool("policy", "set", str(mnt), "WARM")
    assert tool("policy", "get", "a/b/f", cwd=mnt).stdout.startswith(
        "The storage policy of a/b/f:\nBlockStoragePolicy{WARM:5,")


def test_policy_failures_exit_2_with_one_line(mounted, tmp_path):
    mnt = mounted.mountpoint
    (mnt / "d").mkdir()
    (mnt / "d/f").write_bytes(b"x")
    os.mkfifo(mnt / "d/fifo")
    failed(tool("policy", "get", "missing", cwd=mnt), 2,
           "File/Directory does not exist: missing")
    failed(tool("policy", "set", "d/missing", "HOT", cwd=mnt), 2,
           "File/Directory does not exist: d/missing")
    failed(tool("policy", "unset", "missing", cwd=mnt), 2,
           "File/Directory does not exist: missing")
    plain = tmp_path / "plain"
    plain.mkdir()
    for args in (["get", str(plain)], ["set", str(plain), "HOT"], ["unset", str(plain)]):
        failed(tool("policy", *args), 2, f"{plain} is not on a tierfs mount")
    failed(tool("policy", "set", "d", "NOSUCH", cwd=mnt), 2,
           "Cannot find a block policy with the name NOSUCH")
    failed(tool("policy", "set", "d/f", "lazy_persist", cwd=mnt), 2,
           "Policy LAZY_PERSIST cannot be set after file creation.")
    (mnt / "lazy").mkdir()
    assert tool("policy", "set", "lazy", "LAZY_PERSIST", cwd=mnt).returncode == 0
    (mnt / "lazy/f").write_bytes(b"x")
    for args in (["set", "lazy/f", "HOT"], ["unset", "lazy/f"]):
        failed(tool("policy", *args, cwd=mnt), 2,
               "Existing policy LAZY_PERSIST cannot be changed after file creation.")
    failed(tool("policy", "set", "d/fifo", "HOT", cwd=mnt), 2,
           "only regular files and directories have a storage policy")
    assert tool("policy", "get", "d", cwd=mnt).stdout.endswith("is unspecified\n")

    require_tool("setpriv")
    os.chmod(mnt, 0o755)
    for args in (["set", "d", "COLD"], ["set", "d/f", "COLD"], ["unset", "d"]):
        failed(tool("policy", *args, cwd=mnt, user=NOBODY), 2, "Permission denied")
    r = tool("policy", "get", "d/f", cwd=mnt, user=NOBODY)   # reading needs no write access
    assert r.returncode == 0 and "is unspecified" in r.stdout


@pytest.mark.parametrize("args", [
    ["policy"], ["policy", "frob"], ["policy", "get"], ["policy", "set", "x"],
    ["policy", "unset"], ["policy", "get", "a", "b"], ["policy", "list", "extra"],
    ["policy", "set", "--bogus", "x", "HOT"],
])
def test_policy_usage_errors_exit_1(args):
    r = tool(*args)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("tierfs policy")


def test_policy_unknown_option_before_the_action_exits_1():
    """HDFS's code for every usage error of ``storagepolicies`` (reference §3.1), wherever
    the unknown option stands."""
    for args in (["policy", "--bogus", "list"], ["policy", "list", "--bogus"]):
        r = tool(*args)
        assert r.returncode == 1 and r.stdout == "", (args, r.returncode, r.stderr)
    assert tool("policy", "--bogus", "list").stderr == \
        "tierfs policy: unrecognized arguments: --bogus\n"


# --- tierfs report ----------------------------------------------------------------------------


def _mkfs_volumes(root: Path) -> list[str]:
    args = []
    for storage_type, name, cap in TIERS:
        args += ["--volume", f"{storage_type}:{root / name}" + (f":{cap}" if cap else "")]
    return args


def _replica_counts(root: Path) -> dict[str, int]:
    return {name: sum(1 for p in (root / name).rglob("blk_*") if re.fullmatch(r"blk_\d+", p.name))
            for _, name, _ in TIERS}


def _fill(mnt: Path) -> dict[str, int]:
    """Files under several policies; returns the bytes written per effective policy."""
    layout = {"hot": ("HOT", 1, 2 * BLOCK), "warm": ("WARM", 2, 3 * BLOCK + 5),
              "cold": ("COLD", 1, BLOCK), "fast": ("ALL_SSD", 1, BLOCK // 2)}
    for name, (policy, replication, size) in layout.items():
        (mnt / name).mkdir()
        os.setxattr(mnt / name, "user.tierfs.storage_policy", policy.encode())
        os.setxattr(mnt / name, "user.tierfs.replication", str(replication).encode())
        with open(mnt / name / "f", "wb") as f:
            f.write(os.urandom(size))
            os.fsync(f.fileno())
    (mnt / "hot/empty").write_bytes(b"")
    os.symlink("hot/f", mnt / "link")
    # A policy change without a satisfier: warm/f's 4 blocks are now misplaced.
    os.setxattr(mnt / "warm", "user.tierfs.storage_policy", b"COLD")
    return {"HOT": 2 * BLOCK, "COLD": 4 * BLOCK + 5, "ALL_SSD": BLOCK // 2}


def _check_json(report: dict, data: Path, vols: Path, written: dict[str, int]) -> None:
    assert report["data"] == str(data)
    assert report["default_policy"] == "HOT" and report["block_size"] == BLOCK
    counts = _replica_counts(vols)
    assert [(v["id"], v["storage_type"], v["path"], v["replicas"]) for v in report["volumes"]] \
        == [(i + 1, t, str(vols / n), counts[n]) for i, (t, n, _) in enumerate(TIERS)]
    ssd = report["volumes"][0]
    assert ssd["capacity_limit"] == ssd["capacity"] == 4 << 20
    assert ssd["free"] == ssd["capacity"] - ssd["used"] and ssd["used"] > BLOCK // 2
    for v in report["volumes"]:
        assert v["error"] is None and v["used"] >= 0 and v["free"] > 0
    per_type = report["storage_types"]
    assert list(per_type) == ["SSD", "DISK", "ARCHIVE"]
    for name, row in per_type.items():
        members = [v for v in report["volumes"] if v["storage_type"] == name]
        assert row["volumes"] == len(members)
        assert row["replicas"] == sum(v["replicas"] for v in members)
        assert row["used"] == sum(v["used"] for v in members)
    assert per_type["SSD"]["capacity"] == 4 << 20
    assert report["total"]["replicas"] == sum(counts.values()) == 2 + 4 * 2 + 1 + 1
    assert report["total"]["volumes"] == 5

    assert {k: v["bytes"] for k, v in report["policies"].items()} == written
    assert {k: v["files"] for k, v in report["policies"].items()} == \
        {"HOT": 2, "COLD": 2, "ALL_SSD": 1}
    assert {k: (v["blocks"], v["misplaced_blocks"]) for k, v in report["policies"].items()} \
        == {"HOT": (2, 0), "COLD": (5, 4), "ALL_SSD": (1, 0)}
    assert (report["files"], report["directories"], report["other_inodes"]) == (5, 5, 1)
    assert (report["blocks"], report["blocks_satisfying"], report["blocks_not_satisfying"]) \
        == (8, 4, 4)
    assert [(r["storage_types"], r["blocks"], r["percent"]) for r in report["satisfying"]] \
        == [("DISK:1(HOT)", 2, 25.0), ("SSD:1(ALL_SSD)", 1, 12.5),
            ("ARCHIVE:1(COLD)", 1, 12.5)]
    assert [(r["storage_types"], r["combination"], r["actual_policy"], r["specified_policy"],
             r["blocks"], r["percent"]) for r in report["not_satisfying"]] \
        == [("DISK:1,ARCHIVE:1(WARM)", "DISK:1,ARCHIVE:1", "WARM", "COLD", 4, 50.0)]
    assert report["pending_satisfier"] >= 0


def test_report_of_a_mount_and_of_its_data_directory(make_mount, tmp_path):
    vols = tmp_path / "vols"
    mount = make_mount("--block-size", "128K", *_mkfs_volumes(vols))
    written = _fill(mount.mountpoint)

    by_mount = json.loads(tool("report", str(mount.mountpoint), "--json").stdout)
    _check_json(by_mount, mount.data, vols, written)
    assert by_mount["mounted"] == {"pid": mount.pid, "mount_point": str(mount.mountpoint)}
    by_data = json.loads(tool("report", str(mount.data), "--json").stdout)
    _check_json(by_data, mount.data, vols, written)
    for key in ("policies", "blocks", "satisfying", "not_satisfying", "files", "fs_uuid",
                "mounted"):          # the disk's free space may change meanwhile
        assert by_data[key] == by_mount[key], key
    assert [(v["used"], v["replicas"]) for v in by_data["volumes"]] == \
        [(v["used"], v["replicas"]) for v in by_mount["volumes"]]

    r = tool("report", str(mount.mountpoint))
    assert r.returncode == 0 and r.stderr == ""      # no progress noise off a terminal
    text = r.stdout
    assert f"tierfs report of {mount.data}" in text and "mounted on" in text
    for type_name in ("SSD", "DISK", "ARCHIVE", "Total"):
        assert re.search(rf"^{type_name}\s+\d+\s", text, re.M), type_name
    assert str(vols / "ssd0") in text
    assert re.search(r"^COLD\s+2\s+" + str(4 * BLOCK + 5) + r"\s", text, re.M)
    assert "Blocks: 8, placed as their policy wants: 4, not: 4" in text
    # hdfs fsck -storagepolicies' tables and format strings.
    assert ("Blocks satisfying the specified storage policy:\n"
            "Storage Policy                  # of blocks       % of blocks\n"
            + "%-25s %10d  %20s\n" % ("DISK:1(HOT)", 2, "25.0000%")) in text
    assert ("Blocks NOT satisfying the specified storage policy:\n"
            "Storage Policy                  Specified Storage Policy      # of blocks"
            "       % of blocks\n"
            + "%-35s %-20s %10d  %20s" % ("DISK:1,ARCHIVE:1(WARM)", "COLD", 4, "50.0000%")) \
        in text

    mount.stop()                                       # and with nothing mounted
    offline = json.loads(tool("report", str(mount.data), "--json").stdout)
    assert offline["mounted"] is None
    _check_json(offline, mount.data, vols, written)


def test_report_when_every_block_is_placed_as_wanted(mounted):
    (mounted.mountpoint / "f").write_bytes(b"x" * 1000)
    text = tool("report", str(mounted.mountpoint)).stdout
    assert "All blocks satisfy specified storage policy." in text
    assert "%-25s %10d  %20s" % ("DISK:1(HOT)", 1, "100.0000%") in text
    report = json.loads(tool("report", str(mounted.data), "--json").stdout)
    assert report["policies"] == {"HOT": {"files": 1, "bytes": 1000, "blocks": 1,
                                          "misplaced_blocks": 0}}
    assert report["not_satisfying"] == []


def test_report_cannot_run_exit_2(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "file").write_bytes(b"")
    failed(tool("report", str(tmp_path / "missing")), 2, "does not exist")
    failed(tool("report", str(plain)), 2,
           "is neither a tierfs data directory nor a tierfs mount")
    failed(tool("report", str(plain / "file")), 2,
           "is neither a tierfs data directory nor a tierfs mount")
    failed(tool("report", "/proc"), 2, "is neither a tierfs data directory nor a tierfs "
                                       "mount")
    broken = tmp_path / "broken"
    (broken / "namespace").mkdir(parents=True)
    (broken / "namespace" / "data.mdb").write_bytes(b"not lmdb" * 1000)
    r = tool("report", str(broken))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    for args in (["report"], ["report", "--bogus", str(plain)]):
        r = tool(*args)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1


def _big_namespace(data: Path, files: int) -> None:
    """A namespace with many (empty) files, made directly: fast, and no mount needed."""
    from tierfs.fs.namespace import Namespace
    from tierfs.fs.schema import Inherited

    run_tool("mkfs", str(data))
    ns = Namespace.open(data / "namespace")
    try:
        now = time.time_ns()
        d = ns.make_node(1, b"d", stat.S_IFDIR | 0o755, 0, 0, 0, now)
        ns.set_inherited(d.ino, Inherited.POLICY, PolicySuite().get("COLD").id, now)
        for i in range(files):
            ns.make_node(d.ino, b"f%d" % i, stat.S_IFREG | 0o644, 0, 0, 0, now)
        ns.sync()
    finally:
        ns.close()


def test_report_shows_progress_on_a_terminal_and_stops_on_ctrl_c(tmp_path):
    data = tmp_path / "data"
    _big_namespace(data, 20000)
    pid, fd = pty.fork()
    if pid == 0:   # the child: stdout and stderr are the terminal
        os.execv(TIERFS, [TIERFS, "report", str(data)])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # 100x24
    output = b""
    deadline = time.monotonic() + 60
    interrupted = False
    status = None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            output += chunk
        if not interrupted and re.search(rb"inodes:\s+\d+%", output):
            os.kill(pid, signal.SIGINT)        # what Ctrl-C sends
            interrupted = True
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status = code
            break
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"report did not finish:\n{output.decode(errors='replace')}")
    if status is None:    # the terminal closed first
        _, status = os.waitpid(pid, 0)
    os.close(fd)
    text = output.decode(errors="replace")
    assert interrupted, text
    assert b"Traceback" not in output, text
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        pytest.skip("the report finished before Ctrl-C arrived")
    assert code == 130, text
    assert "tierfs report: interrupted" in text
    assert "Blocks satisfying" not in text     # stopped, no half report


def test_report_counts_many_files(tmp_path):
    data = tmp_path / "data"
    _big_namespace(data, 3000)
    report = json.loads(tool("report", str(data), "--json").stdout)
    assert report["files"] == 3000 and report["directories"] == 2
    assert report["policies"] == {"COLD": {"files": 3000, "bytes": 0, "blocks": 0,
                                           "misplaced_blocks": 0}}
    assert report["blocks"] == 0 and report["satisfying"] == [] == report["not_satisfying"]
    text = tool("report", str(data)).stdout
    assert "All blocks satisfy specified storage policy." in text

    # A volume that cannot be opened is reported as such; the rest of the report stands.
    (data / "archive").rename(data / "archive.away")
    r = tool("report", str(data), "--json")
    assert r.returncode == 0
    report = json.loads(r.stdout)
    archive = report["volumes"][2]
    assert archive["storage_type"] == "ARCHIVE" and "is missing" in archive["error"]
    assert archive["capacity"] is archive["used"] is archive["free"] is None
    assert report["storage_types"]["ARCHIVE"] == {"volumes": 1, "capacity": None,
                                                  "used": None, "free": None,
                                                  "replicas": 0, "unavailable": 1}
    assert report["total"]["unavailable"] == 1 and report["files"] == 3000
    text = tool("report", str(data)).stdout
    assert "UNAVAILABLE: volume" in text and "(1 unavailable)" in text
