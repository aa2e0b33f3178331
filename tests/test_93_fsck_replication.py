"""``tierfs fsck``: replication and placement (under-, over-replicated and mis-placed blocks),
``--storagepolicies`` and the repairs that re-replicate and remove excess replicas.

One filesystem is made per module with ``tierfs mkfs`` (RAM_DISK r1, SSD s1 s2, DISK d1 d2
d3, no ARCHIVE, replication 2, 128 KiB blocks) and filled through a real ``mount.tierfs``:
HOT, ONE_SSD and LAZY_PERSIST files, and a HOT file whose directory was then set to COLD
(mis-placed for good: there is no ARCHIVE volume to move it to). Each test changes a private
copy while it is unmounted: replica files deleted, replicas dropped from or added to the
namespace through its own API, as a failed disk or an earlier copy would leave them. The
documented rules checked here (``tools/fsck/``): under-, over-replicated and mis-placed
blocks leave the filesystem HEALTHY (exit 0, as HDFS's fsck), ``--repair`` re-replicates
onto the volumes ``choose_volumes`` picks and removes excess replicas, and exits 1 only when
problems that made the filesystem CORRUPT were found.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tierfs.backends.copy import copy_replica
from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.namespace import Namespace
from tierfs.fs.placement import wanted_beyond_volumes
from tierfs.fs.recovery import delete_trash
from tierfs.fs.schema import ROOT_INO, Inherited
from tierfs.satisfier.policies import PolicySuite
from tierfs.satisfier.summary import StoragePolicySummary, classify, tables
from tierfs.tools import cli
from tierfs.tools.fsck import Fsck, Progress

from tests.conftest import Mount, run_tool

KiB = 1 << 10
BLOCK = 128 * KiB
KIND = re.compile(r"^([A-Z][A-Z_]+): ", re.MULTILINE)
FILE_LINE = re.compile(r"^(/\S*) (\d+) bytes, replication=(\d+), (\d+) block\(s\):  (.*)$")
BLOCK_LINE = re.compile(r"^(\d+)\. blk_(\d+)_(\d+) len=(\d+) Live_repl=(\d+)(.*)$")
LOCATION = re.compile(r" \[([^,\]]+),([0-9a-f-]{36}),([A-Z_]+)\](\([A-Z]+\))?")
VOLUMES = (("RAM_DISK", "r1"), ("SSD", "s1"), ("SSD", "s2"), ("DISK", "d1"), ("DISK", "d2"),
           ("DISK", "d3"))
CONTENT = {"/hot/f": os.urandom(2 * BLOCK + 1000), "/one/f": os.urandom(1000),
           "/lazy/f": os.urandom(5000), "/cold/f": os.urandom(3000)}
SUITE = PolicySuite()
T = StorageType


# --------------------------------------------------------------------------- the template


def _populate(mnt: Path) -> None:
    for name in ("hot", "one", "lazy", "cold"):
        (mnt / name).mkdir()
    os.setxattr(mnt / "one", "user.tierfs.storage_policy", b"ONE_SSD")
    os.setxattr(mnt / "lazy", "user.tierfs.storage_policy", b"LAZY_PERSIST")
    os.setxattr(mnt / "lazy", "user.tierfs.replication", b"1")
    os.setxattr(mnt / "cold", "user.tierfs.replication", b"1")
    for path, content in CONTENT.items():
        (mnt / path.lstrip("/")).write_bytes(content)
    # Written HOT, now COLD: mis-placed, and no ARCHIVE volume exists to move it to.
    os.setxattr(mnt / "cold", "user.tierfs.storage_policy", b"COLD")
    deadline = time.monotonic() + 30
    while os.getxattr(mnt / "lazy/f", "user.tierfs.placement") != b"RAM_DISK:1,DISK:1 x1":
        assert time.monotonic() < deadline, "the lazy writer did not persist /lazy/f"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("tiers")
    data = base / "data"
    run_tool("mkfs", str(data), "--block-size", "128K", "--replication", "2",
             *(f"--volume={t}:{data / n}" for t, n in VOLUMES))
    mount = Mount(data, base / "mnt").start()
    try:
        _populate(mount.mountpoint)
    finally:
        mount.stop()
    assert not mount.errors_logged(), mount.log_text()
    return data


@pytest.fixture
def data(template, tmp_path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "data", symlinks=True))


# --------------------------------------------------------------------------- helpers


def fsck(data: Path, *args: str, capsys) -> tuple[int, str]:
    """``tierfs fsck DATA ARGS`` through the CLI entry point, in this process."""
    capsys.readouterr()
    code = cli.main(["fsck", str(data), *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out


def kinds(out: str) -> set[str]:
    return set(KIND.findall(out)) - {"NOTE"}


def stat_line(out: str, label: str) -> str:
    return re.search(rf"^ {re.escape(label)}:\t(.*)$", out, re.M).group(1)


def table(out: str) -> list[str]:
    """The ``--storagepolicies`` tables: from their first line to the blank line before
    ``FSCK ended``."""
    lines = out.splitlines()
    start = lines.index("Blocks satisfying the specified storage policy:")
    end = next(i for i, line in enumerate(lines) if line.startswith("FSCK ended at"))
    assert lines[end - 1] == ""
    return lines[start:end - 1]


class Fs:
    """The namespace and volumes of an unmounted copy, through their own APIs."""

    def __init__(self, data: Path):
        self.data = data
        self.ns = Namespace.open(data / "namespace")
        self.volumes = VolumeSet.open(data, self.ns.config.fs_uuid, self.ns.config.volumes)
        self.by_name = {v.path.name: v for v in self.volumes}

    def close(self) -> None:
        self.ns.close()

    def ino(self, path: str) -> int:
        ino = ROOT_INO
        for part in path.strip("/").split("/"):
            ino = self.ns.lookup(ino, part.encode()).ino
        return ino

    def block(self, path: str, index: int = 0):
        return self.ns.get_blocks(self.ino(path))[index]

    def names(self, path: str, index: int = 0) -> list[str]:
        return [self.volumes.get(v).path.name for v in self.block(path, index).volumes]

    def drop(self, path: str, index: int, volume: str) -> None:
        """Forget a replica and delete its files, as a lost disk's replica ends up."""
        self.ns.drop_replicas(self.ino(path), index, (self.by_name[volume].id,))
        delete_trash(self.ns, self.volumes)

    def add(self, path: str, index: int, volume: str) -> None:
        """Copy a replica to another volume and record it: one replica too many."""
        rec = self.block(path, index)
        source = self.volumes.get(rec.volumes[0])
        copy_replica(source, self.by_name[volume], rec.block_id, rec.gs)
        assert self.ns.add_replica(self.ino(path), index, rec.block_id, rec.gs,
                                   self.by_name[volume].id)

    def read(self, path: str, index: int, volume: str) -> bytes:
        rec = self.block(path, index)
        with self.by_name[volume].open_replica(rec.block_id, rec.gs, writable=False) as r:
            return r.read(0, rec.length)


@pytest.fixture
def fs(data):
    fs = Fs(data)
    yield fs
    fs.close()


def names(data: Path, path: str, index: int = 0) -> list[str]:
    fs = Fs(data)
    try:
        return fs.names(path, index)
    finally:
        fs.close()


def types_of(names_: list[str]) -> list[str]:
    return [dict((n, t) for t, n in VOLUMES)[n] for n in names_]


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("policy, replication, replicas, under, over, misplaced, satisfied", [
    ("HOT", 2, [T.DISK, T.DISK], False, False, False, True),
    ("HOT", 2, [T.DISK], True, False, False, True),
    ("HOT", 2, [T.DISK] * 3, False, True, False, True),
    ("HOT", 2, [T.SSD, T.DISK, T.DISK], False, True, False, False),   # drop the SSD one
    ("HOT", 1, [T.ARCHIVE], False, False, True, False),
    ("COLD", 1, [T.DISK], False, False, True, False),
    ("COLD", 2, [T.DISK], True, False, True, False),
    ("COLD", 2, [T.DISK, T.DISK, T.ARCHIVE], False, True, True, False),
    ("WARM", 2, [T.DISK, T.ARCHIVE], False, False, False, True),
    ("WARM", 2, [T.DISK, T.DISK], False, False, True, False),
    ("WARM", 3, [T.DISK, T.ARCHIVE], True, False, False, True),
    ("ONE_SSD", 2, [T.DISK, T.DISK], False, False, True, False),
    ("LAZY_PERSIST", 1, [T.RAM_DISK], True, False, False, False),      # not yet persisted
    ("LAZY_PERSIST", 1, [T.RAM_DISK, T.DISK], False, False, False, True),
    ("LAZY_PERSIST", 1, [T.DISK], False, False, False, True),
    ("HOT", 2, [], False, False, False, False),                        # lost, not under
])
def test_placement_rule(policy, replication, replicas, under, over, misplaced, satisfied):
    verdict = classify(SUITE.get(policy), replication, replicas)
    assert (verdict.under_replicated, verdict.over_replicated, verdict.misplaced,
            verdict.satisfied) == (under, over, misplaced, satisfied)


def test_tables_in_hdfs_format():
    summary = StoragePolicySummary(SUITE)
    for _ in range(3):
        summary.add([T.DISK, T.DISK], SUITE.get("HOT"), 2)
    summary.add([T.DISK], SUITE.get("LAZY_PERSIST"), 1)     # DISK:1 satisfies both: one row
    summary.add([T.DISK], SUITE.get("HOT"), 1)
    summary.add([T.DISK, T.ARCHIVE], SUITE.get("COLD"), 2)
    summary.add([T.RAM_DISK], SUITE.get("LAZY_PERSIST"), 1)
    summary.add([], SUITE.get("HOT"), 1)
    assert summary.lines() == [
        "Blocks satisfying the specified storage policy:",
        "Storage Policy                  # of blocks       % of blocks",
        "DISK:2(HOT)                        3              37.5000%",
        "DISK:1(HOT)                        2              25.0000%",
        "",
        "Blocks NOT satisfying the specified storage policy:",
        "Storage Policy                  Specified Storage Policy      # of blocks"
        "       % of blocks",
        "(no replicas)                       HOT                           1"
        "              12.5000%",
        "RAM_DISK:1                          LAZY_PERSIST                  1"
        "              12.5000%",
        "DISK:1,ARCHIVE:1(WARM)              COLD                          1"
        "              12.5000%",
    ]
    assert tables([], []) == [
        "Blocks satisfying the specified storage policy:",
        "Storage Policy                  # of blocks       % of blocks", "",
        "All blocks satisfy specified storage policy."]


# --------------------------------------------------------------------------- healthy


def test_misplaced_block_is_healthy_and_listed(data, capsys):
    code, out = fsck(data, capsys=capsys)
    assert code == 0 and kinds(out) == set(), out
    assert "Status: HEALTHY" in out and out.rstrip().endswith("is HEALTHY")
    rec = _block(data, "/cold/f")
    assert (f"/cold/f: Mis-placed blk_{rec.block_id}_{rec.gs} (block 0). Replicas on DISK:1, "
            "policy COLD wants ARCHIVE:1: these volumes cannot hold that (only 0 ARCHIVE "
            "volumes).") in out
    assert stat_line(out, "Mis-placed blocks") == "1 (16.7 %)"
    assert stat_line(out, "Over-replicated blocks") == "0 (0.0 %)"
    assert stat_line(out, "Under-replicated blocks") == "0 (0.0 %)"
    assert "Blocks satisfying" not in out                      # only with --storagepolicies
    # fsck --repair does not move blocks: nothing changes, exit 0.
    code, repaired = fsck(data, "--repair", capsys=capsys)
    assert code == 0 and "not repaired" not in repaired, repaired
    assert names(data, "/cold/f") == ["d1"]
    assert stat_line(repaired, "Mis-placed blocks") == "1 (16.7 %)"


def test_storagepolicies_tables(data, capsys):
    code, out = fsck(data, "--storagepolicies", capsys=capsys)
    assert code == 0, out
    assert table(out) == [
        "Blocks satisfying the specified storage policy:",
        "Storage Policy                  # of blocks       % of blocks",
        "%-25s %10d  %20s" % ("DISK:2(HOT)", 3, "50.0000%"),
        "%-25s %10d  %20s" % ("RAM_DISK:1,DISK:1(LAZY_PERSIST)", 1, "16.6667%"),
        "%-25s %10d  %20s" % ("SSD:1,DISK:1(ONE_SSD)", 1, "16.6667%"),
        "",
        "Blocks NOT satisfying the specified storage policy:",
        "Storage Policy                  Specified Storage Policy      # of blocks"
        "       % of blocks",
        "%-35s %-20s %10d  %20s" % ("DISK:1(HOT)", "COLD", 1, "16.6667%"),
    ]
    lines = out.splitlines()
    assert lines[-1] == "The filesystem under path '/' is HEALTHY"
    assert lines.index("Blocks satisfying the specified storage policy:") > \
        lines.index(f" Number of volumes:\t{len(VOLUMES)}")
    # tierfs report prints the same tables: one shared computation.
    report = run_tool("report", str(data)).stdout.splitlines()
    start = report.index("Blocks satisfying the specified storage policy:")
    assert report[start:start + len(table(out))] == table(out)
    # A PATH limits the tables to its subtree.
    code, out = fsck(data, "/hot", "--storagepolicies", capsys=capsys)
    assert code == 0 and table(out)[2:] == [
        "%-25s %10d  %20s" % ("DISK:2(HOT)", 3, "100.0000%"), "",
        "All blocks satisfy specified storage policy."]


def test_listing_lines_are_unchanged(data):
    result = run_tool("fsck", str(data), "--files", "--blocks", "--locations")
    out = result.stdout
    files = {m.group(1): m.groups()[1:] for m in map(FILE_LINE.match, out.splitlines()) if m}
    assert files == {"/hot/f": (str(2 * BLOCK + 1000), "2", "3", "OK"),
                     "/one/f": ("1000", "2", "1", "OK"), "/lazy/f": ("5000", "1", "1", "OK"),
                     "/cold/f": ("3000", "1", "1", "OK")}              # mis-placed is OK
    located = []
    for line in out.splitlines():
        m = BLOCK_LINE.match(line)
        if m:
            found = LOCATION.findall(m.group(6))
            assert LOCATION.sub("", m.group(6)) == "", line
            assert all(Path(p).parent == data and not mark for p, _, _, mark in found), line
            located.append((int(m.group(5)), [t for _, _, t, _ in found]))
    assert located == [(1, ["DISK"]), (2, ["DISK", "DISK"]), (2, ["DISK", "DISK"]),
                       (2, ["DISK", "DISK"]), (2, ["RAM_DISK", "DISK"]), (2, ["SSD", "DISK"])]
    with_tables = run_tool("fsck", str(data), "--files", "--blocks", "--locations",
                           "--storagepolicies").stdout
    assert _listing(with_tables) == _listing(out) and len(_listing(out)) == 15


def _listing(out: str) -> list[str]:
    return [line for line in out.splitlines()
            if FILE_LINE.match(line) or BLOCK_LINE.match(line) or line.endswith(" <dir>")]


@pytest.mark.parametrize("policy, replication, volumes, why", [
    ("HOT", 1, [T.SSD, T.DISK, T.ARCHIVE], None),
    ("HOT", 2, [T.SSD, T.DISK, T.ARCHIVE], "only 1 DISK volume"),
    ("HOT", 2, [T.DISK, T.DISK], None),
    ("WARM", 3, [T.DISK, T.ARCHIVE, T.ARCHIVE], None),
    ("WARM", 3, [T.DISK, T.ARCHIVE, T.SSD], "only 1 ARCHIVE volume"),
    ("ONE_SSD", 3, [T.ARCHIVE], "only 0 SSD volumes, 0 DISK volumes"),
    ("COLD", 1, [T.DISK, T.DISK], "only 0 ARCHIVE volumes"),
    ("LAZY_PERSIST", 1, [T.RAM_DISK, T.DISK], None),   # it wants DISK; RAM_DISK is a bonus
])
def test_a_policy_the_volumes_cannot_hold_is_named(policy, replication, volumes, why):
    """Mis-placed blocks that no move could fix say why instead of waiting for the
    satisfier: the policy's own types need more volumes of a type than there are."""
    got = wanted_beyond_volumes(SUITE.get(policy), replication, volumes)
    assert got == (why and f"these volumes cannot hold that ({why})")


def test_a_misplaced_block_a_move_can_fix_is_the_satisfier_s_work(data, capsys):
    """/one/f is ONE_SSD with two replicas (SSD and DISK); as ALL_SSD it wants SSD:2, which
    the two SSD volumes can hold."""
    fs = Fs(data)
    try:
        fs.ns.set_inherited(fs.ino("/one"), Inherited.POLICY, SUITE.get("ALL_SSD").id,
                            time.time_ns())
    finally:
        fs.close()
    code, out = fsck(data, capsys=capsys)
    assert code == 0 and kinds(out) == set(), out
    rec = _block(data, "/one/f")
    assert (f"/one/f: Mis-placed blk_{rec.block_id}_{rec.gs} (block 0). Replicas on "
            "SSD:1,DISK:1, policy ALL_SSD wants SSD:2: moving it is the satisfier's work."
            ) in out
    assert stat_line(out, "Mis-placed blocks") == "2 (33.3 %)"     # and /cold/f


def test_policy_change_through_a_mount_leaves_blocks_misplaced(make_mount, tmp_path, capsys):
    """The issue's scenario on its own filesystem: HOT data, COLD set on its directory
    through the mount, unmounted. No ARCHIVE volume: nothing could move the blocks. The
    fixture's final fsck must exit 0 too."""
    data = tmp_path / "cold"
    mount = make_mount("--block-size", "128K", f"--volume=SSD:{data / 's1'}",
                       f"--volume=DISK:{data / 'd1'}", f"--volume=DISK:{data / 'd2'}",
                       name="cold")
    mnt = mount.mountpoint
    (mnt / "archive-me").mkdir()
    (mnt / "archive-me" / "a").write_bytes(os.urandom(BLOCK + 10))
    (mnt / "archive-me" / "b").write_bytes(b"b" * 100)
    (mnt / "stays").write_bytes(b"hot data")
    os.setxattr(mnt / "archive-me", "user.tierfs.storage_policy", b"COLD")
    mount.stop()
    code, out = fsck(mount.data, "--storagepolicies", capsys=capsys)
    assert code == 0 and kinds(out) == set(), out
    assert stat_line(out, "Mis-placed blocks") == "3 (75.0 %)"
    assert out.count(": Mis-placed blk_") == 3
    assert "Status: HEALTHY" in out
    rows = table(out)
    assert "%-25s %10d  %20s" % ("DISK:1(HOT)", 1, "25.0000%") in rows
    assert rows[rows.index("Blocks NOT satisfying the specified storage policy:") + 2:] == [
        "%-35s %-20s %10d  %20s" % ("DISK:1(HOT)", "COLD", 3, "75.0000%")]


# --------------------------------------------------------------------------- under-replicated


def _block(data: Path, path: str, index: int = 0):
    fs = Fs(data)
    try:
        return fs.block(path, index)
    finally:
        fs.close()


def test_lost_replica_files_are_replaced_on_a_fresh_volume(data, fs, capsys):
    rec = fs.block("/hot/f", 0)
    assert fs.names("/hot/f", 0) == ["d1", "d2"]
    fs.by_name["d1"].delete_replica(rec.block_id, rec.gs)
    fs.close()
    code, out = fsck(data, capsys=capsys)
    assert (code, kinds(out)) == (1, {"MISSING_REPLICA"}), out
    assert (f"/hot/f: Under replicated blk_{rec.block_id}_{rec.gs} (block 0). Target Replicas "
            "is 2 but found 1 live persistent replica(s).") in out
    assert stat_line(out, "Under-replicated blocks") == "1 (16.7 %)"
    code, repaired = fsck(data, "--repair", capsys=capsys)
    assert code == 1, repaired                      # a MISSING_REPLICA was found
    assert "not repaired" not in repaired and repaired.rstrip().endswith("is HEALTHY")
    # HOT wants DISK; d1 lost the replica, d2 holds the other: the copy goes to d3.
    assert f"[repaired: 1 replica(s) added on {data / 'd3'} (DISK)]" in repaired, repaired
    assert names(data, "/hot/f", 0) == ["d2", "d3"]
    code, out = fsck(data, capsys=capsys)
    assert code == 0 and kinds(out) == set(), out
    assert stat_line(out, "Under-replicated blocks") == "0 (0.0 %)"
    again = Fs(data)
    try:
        assert again.read("/hot/f", 0, "d3") == CONTENT["/hot/f"][:BLOCK]
    finally:
        again.close()


def test_under_replication_alone_is_healthy_and_repaired_on_the_right_type(data, fs, capsys):
    assert types_of(fs.names("/one/f")) == ["SSD", "DISK"]
    ssd = fs.names("/one/f")[0]
    fs.drop("/one/f", 0, ssd)
    rec = fs.block("/one/f")
    fs.close()
    code, out = fsck(data, "--files", "--blocks", "--storagepolicies", capsys=capsys)
    assert code == 0 and kinds(out) == set() and "Status: HEALTHY" in out, out
    assert (f"/one/f: Under replicated blk_{rec.block_id}_{rec.gs} (block 0). Target "
            "Replicas is 2 but found 1 live persistent replica(s).") in out
    assert re.search(r"^/one/f 1000 bytes, replication=2, 1 block\(s\):  OK$", out, re.M)
    assert re.search(rf"^0\. blk_{rec.block_id}_{rec.gs} len=1000 Live_repl=1$", out, re.M)
    assert stat_line(out, "Under-replicated blocks") == "1 (16.7 %)"
    assert stat_line(out, "Mis-placed blocks") == "1 (16.7 %)"       # only /cold/f
    # DISK:1 is ONE_SSD's first wanted type missing its SSD: under-replicated, not moved.
    assert "%-25s %10d  %20s" % ("DISK:1(HOT)", 1, "16.6667%") in table(out)

    code, repaired = fsck(data, "--repair", capsys=capsys)
    assert code == 0, repaired              # nothing that made it CORRUPT was found
    added = re.search(r"\[repaired: 1 replica\(s\) added on (\S+) \((\w+)\)\]", repaired)
    assert added and added.group(2) == "SSD", repaired
    assert types_of(names(data, "/one/f")) == ["DISK", "SSD"]
    code, out = fsck(data, capsys=capsys)
    assert code == 0 and stat_line(out, "Under-replicated blocks") == "0 (0.0 %)"


def test_block_only_on_ram_disk_is_under_replicated(data, fs, capsys):
    assert fs.names("/lazy/f") == ["r1", "d1"]
    fs.drop("/lazy/f", 0, "d1")
    rec = fs.block("/lazy/f")
    fs.close()
    code, out = fsck(data, "--storagepolicies", capsys=capsys)
    assert code == 0 and kinds(out) == set(), out
    assert (f"/lazy/f: Under replicated blk_{rec.block_id}_{rec.gs} (block 0). Target Replicas "
            "is 1 but found 0 live persistent replica(s) and 1 on RAM_DISK.") in out
    assert "%-35s %-20s %10d  %20s" % ("RAM_DISK:1", "LAZY_PERSIST", 1, "16.6667%") \
        in table(out)
    code, repaired = fsck(data, "--repair", capsys=capsys)
    assert code == 0 and "not repaired" not in repaired, repaired
    assert types_of(names(data, "/lazy/f")) == ["RAM_DISK", "DISK"]
    code, out = fsck(data, capsys=capsys)
    assert code == 0 and stat_line(out, "Under-replicated blocks") == "0 (0.0 %)", out


class _InterruptCopies(Progress):
    """Ctrl-C right after the first re-replicated block."""

    def __init__(self):
        super().__init__(io.StringIO(), tty=False)
        self.name = ""

    def phase(self, name: str, total: int, unit: str = "B") -> None:
        self.name = name

    def advance(self, n: int) -> None:
        if self.name == "re-replicating":
            raise KeyboardInterrupt


def test_interrupted_re_replication_leaves_a_consistent_filesystem(data, fs, capsys):
    for index in range(3):
        fs.drop("/hot/f", index, "d2")
    fs.close()
    with pytest.raises(KeyboardInterrupt):
        Fsck(data, progress=_InterruptCopies()).repair()
    assert not any((data / n / "tmp").exists() and list((data / n / "tmp").iterdir())
                   for _, n in VOLUMES)
    report = Fsck(data).check()
    assert report.healthy and report.stats.under_replicated == 2, report.render()
    code, out = fsck(data, "--repair", capsys=capsys)
    assert code == 0 and out.count("replica(s) added on") == 2, out
    for index in range(3):
        assert types_of(names(data, "/hot/f", index)) == ["DISK", "DISK"]
    assert fsck(data, capsys=capsys)[0] == 0


# --------------------------------------------------------------------------- over-replicated


def test_excess_replicas_are_removed_unwanted_type_first(data, fs, capsys):
    fs.add("/hot/f", 0, "s2")          # HOT wants DISK: the SSD replica is the excess
    fs.add("/hot/f", 1, "d3")          # three DISK replicas: any one may go
    recs = [fs.block("/hot/f", i) for i in (0, 1)]
    fs.close()
    code, out = fsck(data, "--storagepolicies", capsys=capsys)
    assert code == 0 and kinds(out) == set(), out
    for index, rec in enumerate(recs):
        assert (f"/hot/f: Over replicated blk_{rec.block_id}_{rec.gs} (block {index}). Target "
                "Replicas is 2 but found 3 live persistent replica(s).") in out
    assert stat_line(out, "Over-replicated blocks") == "2 (33.3 %)"
    assert stat_line(out, "Mis-placed blocks") == "1 (16.7 %)"
    rows = table(out)
    assert "%-25s %10d  %20s" % ("DISK:3(HOT)", 1, "16.6667%") in rows
    assert "%-35s %-20s %10d  %20s" % ("SSD:1,DISK:2(ONE_SSD)", "HOT", 1, "16.6667%") in rows

    code, repaired = fsck(data, "--repair", capsys=capsys)
    assert code == 0 and "not repaired" not in repaired, repaired
    assert f"[repaired: 1 excess replica(s) dropped from {data / 's2'} (SSD)]" in repaired
    assert names(data, "/hot/f", 0) == ["d1", "d2"]
    assert types_of(names(data, "/hot/f", 1)) == ["DISK", "DISK"]
    assert not list((data / "s2").rglob(f"blk_{recs[0].block_id}*"))
    leftover = [n for n in ("d1", "d2", "d3")
                if list((data / n).rglob(f"blk_{recs[1].block_id}*"))]
    assert sorted(leftover) == sorted(names(data, "/hot/f", 1))
    code, out = fsck(data, capsys=capsys)
    assert code == 0 and stat_line(out, "Over-replicated blocks") == "0 (0.0 %)", out
    fs = Fs(data)
    try:
        assert fs.ns.trash() == []
        for name in fs.names("/hot/f", 1):
            assert fs.read("/hot/f", 1, name) == CONTENT["/hot/f"][BLOCK:2 * BLOCK]
    finally:
        fs.close()


def test_excess_of_a_block_with_a_bad_replica_never_goes_below_replication(data, fs, capsys):
    """Three replicas of two wanted, one of them corrupt: the corrupt one is dropped, and no
    good one: the block ends with exactly its two good replicas."""
    fs.add("/hot/f", 2, "d3")
    rec = fs.block("/hot/f", 2)
    fs.close()
    data_file = next((data / "d1").rglob(f"blk_{rec.block_id}"))
    with open(data_file, "r+b") as f:
        f.write(b"\xff")
    code, out = fsck(data, capsys=capsys)
    assert (code, kinds(out)) == (1, {"CORRUPT_REPLICA"}), out
    assert "Over replicated" not in out                # two good persistent replicas
    code, repaired = fsck(data, "--repair", capsys=capsys)
    assert code == 1 and "not repaired" not in repaired, repaired
    assert names(data, "/hot/f", 2) == ["d2", "d3"]
    assert fsck(data, capsys=capsys)[0] == 0
