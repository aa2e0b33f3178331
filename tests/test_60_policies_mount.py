"""Storage policies and replication on real mounts: the ``user.tierfs.*`` xattrs through
setfattr/getfattr and os.*xattr, inheritance, renames in both modes, and where new blocks
land (replica files in the volumes), with fallbacks and ENOSPC.

DESIGN.md sections 5-6; the reference's section 2 for ``chooseStorageTypes`` and fallbacks.
Every mount ends with a clean unmount and ``tierfs fsck`` reporting nothing (conftest).
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import require_tool

POLICY = "user.tierfs.storage_policy"
REPLICATION = "user.tierfs.replication"
SOURCE = "user.tierfs.policy_source"
PLACEMENT = "user.tierfs.placement"
SATISFIED = "user.tierfs.satisfied"
READ_ONLY = (SOURCE, PLACEMENT, SATISFIED)
NOBODY = "setpriv --reuid=65534 --regid=65534 --clear-groups"

KiB = 1 << 10
BLOCK = 128 * KiB
# Eight volumes: two SSD, three DISK, three ARCHIVE (distinct-volume checks need three of
# the types a replication-3 policy asks for).
TIERS = (("SSD", "ssd0"), ("SSD", "ssd1"), ("DISK", "disk0"), ("DISK", "disk1"),
         ("DISK", "disk2"), ("ARCHIVE", "arc0"), ("ARCHIVE", "arc1"), ("ARCHIVE", "arc2"))


# --- helpers --------------------------------------------------------------------------------


def sh(cmd: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True,
                            timeout=120)
    if check and result.returncode != 0:
        pytest.fail(f"command failed ({result.returncode}): {cmd}\n{result.stdout}\n"
                    f"{result.stderr}")
    return result


def get(path: Path, name: str = POLICY) -> str:
    return os.getxattr(path, name).decode()


def source_of(path: Path, label: str = "storage_policy") -> str:
    """The deciding directory (or "default") of one value in ``policy_source``."""
    text = get(path, SOURCE)
    match = re.search(rf"{label}: ([^;]+?)(?: txid \d+)?(?:;|$)", text)
    assert match, text
    return match.group(1)


def listed(path: Path) -> list[str]:
    return sorted(n for n in os.listxattr(path) if n.startswith("user.tierfs."))


def dump(cwd: Path, path: str) -> str:
    """``getfattr -d`` of one path: only the listed names."""
    return sh(f"getfattr -d --absolute-names {path}", cwd).stdout


def expect_errno(err: int, fn, *args) -> None:
    with pytest.raises(OSError) as info:
        fn(*args)
    assert info.value.errno == err, f"{fn.__name__}{args}: {info.value}"


def volume_args(root: Path, capacities: dict[str, str] | None = None,
                tiers=TIERS) -> list[str]:
    args = []
    for storage_type, name in tiers:
        cap = (capacities or {}).get(name)
        args += ["--volume", f"{storage_type}:{root / name}" + (f":{cap}" if cap else "")]
    return args


def replicas(root: Path, tiers=TIERS) -> dict[int, list[str]]:
    """Block id -> volume names holding a ``blk_<id>`` data file (finalized layout)."""
    found: dict[int, list[str]] = defaultdict(list)
    for _, name in tiers:
        for path in (root / name / "current" / "finalized").rglob("blk_*"):
            match = re.fullmatch(r"blk_(\d+)", path.name)
            if match:
                assert re.fullmatch(r"subdir\d+", path.parent.name), path
                found[int(match.group(1))].append(name)
    return dict(found)


def new_blocks(root: Path, before: dict[int, list[str]], tiers=TIERS) -> dict[int, list[str]]:
    after = replicas(root, tiers)
    return {b: sorted(v) for b, v in after.items() if b not in before}


def kind(volume: str) -> str:
    return {"ssd": "SSD", "dis": "DISK", "arc": "ARCHIVE"}[volume[:3]]


def types_of(volumes: list[str]) -> list[str]:
    return sorted(kind(v) for v in volumes)


def write(path: Path, nbytes: int) -> bytes:
    """Write and fsync (so placement errors surface here, not at some later writeback)."""
    data = os.urandom(nbytes)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


# --- the xattr interface ----------------------------------------------------------------------


def test_set_and_get_on_directories_and_files_inherit_down_the_tree(mounted):
    mnt = mounted.mountpoint
    (mnt / "a/b/c").mkdir(parents=True)
    (mnt / "a/b/c/f").write_bytes(b"x")
    for rel in ("", "a", "a/b", "a/b/c", "a/b/c/f"):
        assert get(mnt / rel) == "HOT"          # the mkfs default, nothing set anywhere
        assert get(mnt / rel, REPLICATION) == "1"
        assert source_of(mnt / rel) == "default"
        assert listed(mnt / rel) == []

    sh("setfattr -n user.tierfs.storage_policy -v cold a/b", mnt)   # any case
    assert sh("getfattr --only-values -n user.tierfs.storage_policy a/b/c/f", mnt).stdout \
        == "COLD"
    for rel in ("a/b", "a/b/c", "a/b/c/f"):
        assert get(mnt / rel) == "COLD"
        assert source_of(mnt / rel) == "/a/b"
    assert get(mnt / "a") == "HOT"
    (mnt / "a/b/c/new").write_bytes(b"y")     # created later: takes its directory's value
    (mnt / "a/b/c/newdir").mkdir()
    assert get(mnt / "a/b/c/new") == get(mnt / "a/b/c/newdir") == "COLD"

    sh("setfattr -n user.tierfs.storage_policy -v WARM a/b/c/f", mnt)   # a file of its own
    assert get(mnt / "a/b/c/f") == "WARM"
    assert source_of(mnt / "a/b/c/f") == "/a/b/c/f"
    assert get(mnt / "a/b/c/new") == "COLD"

    sh("setfattr -n user.tierfs.replication -v 2 a", mnt)
    sh("setfattr -n user.tierfs.replication -v 3 a/b/c/new", mnt)
    assert [get(mnt / r, REPLICATION) for r in ("a", "a/b", "a/b/c/f", "a/b/c/new")] \
        == ["2", "2", "2", "3"]
    assert source_of(mnt / "a/b/c/f", "replication") == "/a"
    assert get(mnt / "a/b", POLICY) == "COLD"   # the two values are independent

    # getfattr -d lists the names exactly where the inode's own explicit setting decides.
    assert listed(mnt / "a") == [REPLICATION]
    assert listed(mnt / "a/b") == [POLICY]
    assert listed(mnt / "a/b/c") == []
    assert listed(mnt / "a/b/c/new") == [REPLICATION]
    assert 'user.tierfs.storage_policy="COLD"' in dump(mnt, "a/b")
    assert "user.tierfs" not in dump(mnt, "a/b/c")


def test_policy_source_names_a_directory_whose_name_is_not_utf8(mounted):
    """Names are bytes; policy_source, which names the deciding directory, answered EIO
    (and logged a bug) for one that is not valid UTF-8."""
    mnt = mounted.mountpoint
    odd = os.fsencode(mnt) + b"/caf\xe9"
    os.mkdir(odd)
    os.setxattr(odd, POLICY, b"COLD")
    with open(odd + b"/f", "wb"):
        pass
    assert os.getxattr(odd + b"/f", SOURCE).startswith(b"storage_policy: /caf\xe9 txid ")
    assert get(odd + b"/f") == "COLD"


def test_a_later_set_on_an_ancestor_overrides_an_earlier_set_below(mounted):
    """The seed's example: HOT on /a/b, then ALL_SSD on /a: /a/b/c is ALL_SSD (HDFS would
    keep HOT)."""
    mnt = mounted.mountpoint
    (mnt / "a/b").mkdir(parents=True)
    (mnt / "a/b/c").write_bytes(b"")
    sh("setfattr -n user.tierfs.storage_policy -v HOT a/b", mnt)
    sh("setfattr -n user.tierfs.storage_policy -v ALL_SSD a", mnt)
    for rel in ("a", "a/b", "a/b/c"):
        assert get(mnt / rel) == "ALL_SSD"
        assert source_of(mnt / rel) == "/a"
    assert listed(mnt / "a/b") == []            # its own setting no longer decides
    assert listed(mnt / "a") == [POLICY]
    sh("setfattr -n user.tierfs.storage_policy -v ONE_SSD a/b", mnt)   # and again below
    assert [get(mnt / r) for r in ("a", "a/b", "a/b/c")] == ["ALL_SSD", "ONE_SSD", "ONE_SSD"]


def test_unset_makes_the_subtree_follow_the_parent(mounted):
    mnt = mounted.mountpoint
    (mnt / "a/b/c").mkdir(parents=True)
    (mnt / "a/b/c/f").write_bytes(b"")
    sh("setfattr -n user.tierfs.storage_policy -v WARM a", mnt)
    sh("setfattr -n user.tierfs.storage_policy -v COLD a/b", mnt)
    sh("setfattr -n user.tierfs.storage_policy -v HOT a/b/c", mnt)
    sh("setfattr -n user.tierfs.replication -v 2 a/b/c/f", mnt)
    sh("setfattr -x user.tierfs.storage_policy a/b", mnt)
    sh("setfattr -x user.tierfs.replication a/b", mnt)    # nothing of its own: still fine
    for rel in ("a/b", "a/b/c", "a/b/c/f"):
        assert get(mnt / rel) == "WARM"          # the unset applies to the whole subtree
        assert source_of(mnt / rel) == "/a"
        assert get(mnt / rel, REPLICATION) == "1"
        assert listed(mnt / rel) == []
    sh("setfattr -n user.tierfs.storage_policy -v ALL_SSD a", mnt)
    assert get(mnt / "a/b/c/f") == "ALL_SSD"      # and from now on follows the parent
    sh("setfattr -x user.tierfs.storage_policy a", mnt)
    assert get(mnt / "a/b/c/f") == "HOT"
    assert source_of(mnt / "a/b/c/f") == "default"
    assert listed(mnt / "a") == []


@pytest.mark.parametrize("mode", ["follow", "keep"])
def test_mv_of_a_subtree_into_a_directory_with_another_policy(make_mount, mode):
    mount = make_mount("--policy-on-rename", mode)
    mnt = mount.mountpoint
    (mnt / "src/sub/g").mkdir(parents=True)
    (mnt / "dst").mkdir()
    (mnt / "src/sub/f").write_bytes(b"data")
    (mnt / "src/file").write_bytes(b"data")
    sh("setfattr -n user.tierfs.storage_policy -v WARM src && "
       "setfattr -n user.tierfs.replication -v 2 src && "
       "setfattr -n user.tierfs.storage_policy -v ONE_SSD src/sub/g && "
       "setfattr -n user.tierfs.storage_policy -v COLD dst && "
       "setfattr -n user.tierfs.replication -v 1 dst", mnt)
    sh("mv src/sub dst/ && mv src/file dst/", mnt)
    moved = ("dst/sub", "dst/sub/f", "dst/sub/g", "dst/file")
    if mode == "follow":
        # The moved subtree takes the destination's values, own settings included.
        assert [get(mnt / r) for r in moved] == ["COLD"] * 4
        assert [get(mnt / r, REPLICATION) for r in moved] == ["1"] * 4
        assert source_of(mnt / "dst/sub/g") == "/dst"
        assert listed(mnt / "dst/sub/g") == []
    else:
        assert [get(mnt / r) for r in moved] == ["WARM", "WARM", "ONE_SSD", "WARM"]
        assert [get(mnt / r, REPLICATION) for r in moved] == ["2"] * 4
        assert listed(mnt / "dst/sub/g") == [POLICY]     # still its own explicit setting
        assert listed(mnt / "dst/sub") == []
    assert get(mnt / "dst") == "COLD" and get(mnt / "src") == "WARM"

    # In both modes a later set on the destination applies to everything below it.
    sh("setfattr -n user.tierfs.storage_policy -v HOT dst", mnt)
    assert [get(mnt / r) for r in moved] == ["HOT"] * 4

    # rm -r leaves nothing behind: the same names, made again, simply inherit.
    sh("rm -r dst/sub dst/file", mnt)
    (mnt / "dst/sub/g").mkdir(parents=True)
    assert get(mnt / "dst/sub/g") == "HOT" and listed(mnt / "dst/sub/g") == []
    assert get(mnt / "dst/sub/g", REPLICATION) == "1"


def test_read_only_names_and_invalid_values(mounted):
    mnt = mounted.mountpoint
    (mnt / "d").mkdir()
    (mnt / "d/f").write_bytes(b"x")
    for name in READ_ONLY:
        for rel in ("d", "d/f"):
            assert get(mnt / rel, name)                    # readable ...
            expect_errno(errno.EPERM, os.setxattr, mnt / rel, name, b"x")
            expect_errno(errno.EPERM, os.removexattr, mnt / rel, name)
        r = sh(f"setfattr -n {name} -v x d", mnt, check=False)
        assert r.returncode != 0 and "Operation not permitted" in r.stderr
    sh("setfattr -n user.tierfs.storage_policy -v COLD d", mnt)
    names = sh("getfattr -d -m - --absolute-names d", mnt).stdout
    assert POLICY in names and not any(n in names for n in READ_ONLY)   # ... never listed

    for value in (b"bogus", b"", b"HOTT"):
        expect_errno(errno.EINVAL, os.setxattr, mnt / "d", POLICY, value)
    r = sh("setfattr -n user.tierfs.storage_policy -v nosuch d", mnt, check=False)
    assert r.returncode != 0 and "Invalid argument" in r.stderr
    volumes = 3   # the default layout: ssd, disk, archive
    for value in (b"0", str(volumes + 1).encode(), b"-1", b"two", b"1.5"):
        expect_errno(errno.EINVAL, os.setxattr, mnt / "d/f", REPLICATION, value)
    os.setxattr(mnt / "d/f", REPLICATION, str(volumes).encode())
    assert get(mnt / "d/f", REPLICATION) == str(volumes)
    assert get(mnt / "d") == "COLD"                        # nothing changed by the refusals

    # LAZY_PERSIST cannot be set on an existing file (HDFS: copyOnCreateFile), on a
    # directory it can.
    expect_errno(errno.EINVAL, os.setxattr, mnt / "d/f", POLICY, b"LAZY_PERSIST")
    r = sh("setfattr -n user.tierfs.storage_policy -v lazy_persist d/f", mnt, check=False)
    assert r.returncode != 0 and "Invalid argument" in r.stderr
    assert get(mnt / "d/f") == "COLD"
    os.setxattr(mnt / "d", POLICY, b"LAZY_PERSIST")
    assert get(mnt / "d") == get(mnt / "d/f") == "LAZY_PERSIST"
    # A file created under it records it and keeps it (HDFS: "Existing policy LAZY_PERSIST
    # cannot be changed after file creation").
    (mnt / "d/new").write_bytes(b"x")
    assert get(mnt / "d/new") == "LAZY_PERSIST" and source_of(mnt / "d/new") == "/d/new"
    expect_errno(errno.EINVAL, os.setxattr, mnt / "d/new", POLICY, b"HOT")
    expect_errno(errno.EINVAL, os.removexattr, mnt / "d/new", POLICY)
    assert get(mnt / "d/new") == "LAZY_PERSIST"


def test_permissions_of_other_users(mounted):
    require_tool("setpriv")
    mnt = mounted.mountpoint
    (mnt / "d").mkdir()
    (mnt / "d/f").write_bytes(b"x")
    (mnt / "mine").mkdir()
    os.chmod(mnt, 0o755)
    os.chmod(mnt / "d/f", 0o644)
    os.chown(mnt / "mine", 65534, 65534)
    for rel in ("d", "d/f"):
        for cmd in (f"setfattr -n {POLICY} -v COLD {rel}", f"setfattr -x {POLICY} {rel}",
                    f"setfattr -n {REPLICATION} -v 2 {rel}"):
            r = sh(f"{NOBODY} {cmd}", mnt, check=False)
            assert r.returncode != 0, cmd
            assert "Permission denied" in r.stderr or "Operation not permitted" in r.stderr
        # Reading needs no write access.
        assert sh(f"{NOBODY} getfattr --only-values -n {POLICY} {rel}", mnt).stdout == "HOT"
    assert get(mnt / "d") == "HOT" and listed(mnt / "d") == []
    sh(f"{NOBODY} setfattr -n {POLICY} -v WARM mine", mnt)   # the owner may
    assert get(mnt / "mine") == "WARM"
    r = sh(f"{NOBODY} setfattr -n {PLACEMENT} -v x mine", mnt, check=False)
    assert r.returncode != 0 and "Operation not permitted" in r.stderr


# --- placement of new blocks ------------------------------------------------------------------


def test_new_blocks_land_on_the_policy_s_storage_types(make_mount, tmp_path):
    vols = tmp_path / "vols"
    mount = make_mount("--block-size", "128K", *volume_args(vols))
    mnt = mount.mountpoint
    expected = {   # dir: (policy, replication, replica types per block)
        "all_ssd": ("ALL_SSD", 2, ["SSD", "SSD"]),
        "all_ssd3": ("ALL_SSD", 3, ["DISK", "SSD", "SSD"]),  # 2 SSD volumes: fallback DISK
        "one_ssd": ("ONE_SSD", 3, ["DISK", "DISK", "SSD"]),
        "warm": ("WARM", 3, ["ARCHIVE", "ARCHIVE", "DISK"]),
        "cold": ("COLD", 1, ["ARCHIVE"]),
        "cold3": ("COLD", 3, ["ARCHIVE", "ARCHIVE", "ARCHIVE"]),
        "hot": ("HOT", 2, ["DISK", "DISK"]),
    }
    placement = {"all_ssd": "SSD:2 x3", "all_ssd3": "SSD:2,DISK:1 x3",
                 "one_ssd": "SSD:1,DISK:2 x3", "warm": "DISK:1,ARCHIVE:2 x3",
                 "cold": "ARCHIVE:1 x3", "cold3": "ARCHIVE:3 x3", "hot": "DISK:2 x3"}
    for name, (policy, replication, types) in expected.items():
        d = mnt / name
        d.mkdir()
        sh(f"setfattr -n {POLICY} -v {policy} {name} && "
           f"setfattr -n {REPLICATION} -v {replication} {name}", mnt)
        before = replicas(vols)
        data = write(d / "f", 3 * BLOCK - 1000)   # three blocks, the last one partial
        blocks = new_blocks(vols, before)
        assert len(blocks) == 3, (name, blocks)
        for block_id, on in blocks.items():
            assert len(set(on)) == len(on) == replication, (name, on)   # distinct volumes
            assert types_of(on) == types, (name, on)
            for volume in on:
                blk = next((vols / volume).rglob(f"blk_{block_id}"))
                assert blk.stat().st_size in (BLOCK, BLOCK - 1000)
                assert list(blk.parent.glob(f"blk_{block_id}_*.meta"))
        f = d / "f"
        assert get(f) == policy and get(f, REPLICATION) == str(replication)
        assert source_of(f) == f"/{name}" and source_of(f, "replication") == f"/{name}"
        assert get(f, PLACEMENT) == placement[name]
        if name == "all_ssd3":      # the fallback replica is not where ALL_SSD wants it
            assert get(f, SATISFIED) == (
                "no: 3 of 3 blocks not placed as ALL_SSD wants (SSD:3; e.g. SSD:2,DISK:1): "
                "these volumes cannot hold that (only 2 SSD volumes)")
        else:
            assert get(f, SATISFIED) == "yes"
        assert f.read_bytes() == data

    # A policy change moves nothing by itself: the file is now misplaced, and says so.
    sh(f"setfattr -n {POLICY} -v COLD warm", mnt)
    satisfied = get(mnt / "warm/f", SATISFIED)
    assert satisfied == ("no: 3 of 3 blocks not placed as COLD wants (ARCHIVE:3; "
                         "e.g. DISK:1,ARCHIVE:2)")      # movable: three ARCHIVE volumes
    assert get(mnt / "warm/f", PLACEMENT) == "DISK:1,ARCHIVE:2 x3"
    pending = get(mnt / "warm", SATISFIED)     # a directory: the satisfier's view
    assert pending == "yes" or pending.startswith("pending:") and "/warm" in pending


def test_a_full_volume_makes_new_blocks_use_the_creation_fallback(make_mount, tmp_path):
    """ALL_SSD with every SSD volume full: new blocks go to DISK, its creation fallback."""
    vols = tmp_path / "vols"
    tiers = (("SSD", "ssd0"), ("DISK", "disk0"), ("DISK", "disk1"), ("ARCHIVE", "arc0"))
    mount = make_mount("--block-size", "128K", *volume_args(vols, {"ssd0": "1M"}, tiers))
    mnt = mount.mountpoint
    (mnt / "fast").mkdir()
    sh(f"setfattr -n {POLICY} -v ALL_SSD fast", mnt)
    write(mnt / "fast/fill", 7 * BLOCK)           # 7 blocks + meta files: less than 1M
    assert get(mnt / "fast/fill", PLACEMENT) == "SSD:1 x7"
    assert get(mnt / "fast/fill", SATISFIED) == "yes"

    before = replicas(vols, tiers)
    data = write(mnt / "fast/more", 2 * BLOCK)
    blocks = new_blocks(vols, before, tiers)
    assert len(blocks) == 2 and all(types_of(on) == ["DISK"] for on in blocks.values())
    assert (mnt / "fast/more").read_bytes() == data
    assert get(mnt / "fast/more", PLACEMENT) == "DISK:1 x2"
    assert get(mnt / "fast/more", SATISFIED) == \
        "no: 2 of 2 blocks not placed as ALL_SSD wants (SSD:1; e.g. DISK:1)"
    assert get(mnt / "fast/more") == "ALL_SSD"     # the policy itself is unchanged


def test_enospc_when_nothing_the_policy_allows_has_room(make_mount, tmp_path):
    """COLD has no fallback: with the only ARCHIVE volume full a write fails with ENOSPC
    and leaves no replica file and no block behind."""
    vols = tmp_path / "vols"
    tiers = (("SSD", "ssd0"), ("DISK", "disk0"), ("ARCHIVE", "arc0"))
    mount = make_mount("--block-size", "128K", *volume_args(vols, {"arc0": "1M"}, tiers))
    mnt = mount.mountpoint
    (mnt / "cold").mkdir()
    sh(f"setfattr -n {POLICY} -v COLD cold", mnt)
    write(mnt / "cold/fill", 7 * BLOCK)
    assert get(mnt / "cold/fill", PLACEMENT) == "ARCHIVE:1 x7"

    before = replicas(vols, tiers)
    r = sh("dd if=/dev/zero of=cold/more bs=128K count=2 conv=fsync status=none", mnt,
           check=False)
    assert r.returncode != 0 and "No space left on device" in r.stderr
    assert replicas(vols, tiers) == before      # nothing half-written, on any volume
    assert get(mnt / "cold/more", PLACEMENT) == "no blocks"
    assert get(mnt / "cold/fill", PLACEMENT) == "ARCHIVE:1 x7"
    assert "no volume allowed by policy COLD has room" in mount.log_text()
    # HOT still has room on DISK: the same filesystem goes on working.
    (mnt / "hot").mkdir()
    write(mnt / "hot/f", BLOCK)
    assert get(mnt / "hot/f", PLACEMENT) == "DISK:1 x1"
