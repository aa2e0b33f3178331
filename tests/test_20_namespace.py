"""Namespace unit tests on a real LMDB environment (DESIGN.md sections 3, 4 and 10).

Every test works on a filesystem made by ``make_filesystem`` (or a bare ``Namespace.create``)
in ``tmp_path`` and calls the ``Namespace`` methods the Operations layer calls. The journal
is read through the schema's own codecs: the contract is "one TxID and one journal record per
mutation, none for a mutation that fails".
"""

from __future__ import annotations

import errno
import random
import stat
import subprocess
import uuid
from contextlib import contextmanager
from typing import NamedTuple

import lmdb
import pytest

from tierfs.backends.storage_types import StorageType
from tierfs.fs import namespace as nsmod
from tierfs.fs import schema
from tierfs.fs.errors import FsError
from tierfs.fs.namespace import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    RENAME_WHITEOUT,
    FsConfig,
    Namespace,
)
from tierfs.fs.schema import ROOT_INO, BlockRecord, Inherited, Inode, Op
from tierfs.fs.space_reserve import SpaceReserve
from tierfs.tools.mkfs import NAMESPACE_DIR, VolumeSpec, make_filesystem
from tests.conftest import small_disk

DIR = stat.S_IFDIR | 0o755
REG = stat.S_IFREG | 0o644
LNK = stat.S_IFLNK | 0o777
NOW = 1_700_000_000_000_000_000


def never_busy(ino: int) -> bool:
    return False


def always_busy(ino: int) -> bool:
    return True


@contextmanager
def raises_errno(err: int):
    with pytest.raises(FsError) as info:
        yield info
    assert info.value.errno == err, (
        f"expected {errno.errorcode[err]}, got {errno.errorcode.get(info.value.errno)}: "
        f"{info.value}")


@pytest.fixture
def ns(tmp_path):
    make_filesystem(tmp_path / "d")
    namespace = Namespace.open(tmp_path / "d" / NAMESPACE_DIR)
    yield namespace
    namespace.close()


def mkdir(ns: Namespace, parent: int, name: bytes) -> int:
    return ns.make_node(parent, name, DIR, 0, 0, 0, NOW).ino


def mkfile(ns: Namespace, parent: int, name: bytes) -> int:
    return ns.make_node(parent, name, REG, 0, 0, 0, NOW).ino


def journal(ns: Namespace) -> dict[int, bytes]:
    """txid -> raw journal record."""
    with ns.env.begin() as txn:
        return {schema.read_u64(k): bytes(v)
                for k, v in txn.cursor(db=ns.db["journal"])}


class Row(NamedTuple):
    """A readdir row with names, for readable assertions."""

    cookie: int
    name: bytes
    ino: int
    inode: Inode


def listing(ns: Namespace, parent: int, after: int = 0, limit: int = 1 << 30) -> list[Row]:
    return [Row(cookie, name, ino, Inode(ino, *fields))
            for cookie, name, ino, fields in ns.readdir(parent, after, limit)]


def names(ns: Namespace, parent: int) -> dict[bytes, int]:
    return {e.name: e.ino for e in listing(ns, parent)}


def cookies(ns: Namespace, parent: int) -> dict[bytes, int]:
    return {e.name: e.cookie for e in listing(ns, parent)}


def nlink(ns: Namespace, ino: int) -> int:
    return ns.get_inode(ino).nlink


# --- TxIDs and the journal --------------------------------------------------------------------

def test_fresh_filesystem_has_root_and_mkfs_record(ns):
    root = ns.get_inode(ROOT_INO)
    assert stat.S_ISDIR(root.mode) and root.nlink == 2 and root.parent == ROOT_INO
    records = journal(ns)
    first = schema.parse_journal_record(records[1])
    assert first[0] == Op.MKFS and first[1] == ns.config.fs_uuid
    assert ns.last_txid() == max(records)
    assert names(ns, ROOT_INO) == {}
    assert ns.counts()["inodes"] == 1


def _setup_world(ns: Namespace) -> dict[str, int]:
    d = mkdir(ns, ROOT_INO, b"d")
    f = mkfile(ns, d, b"f")
    g = mkfile(ns, ROOT_INO, b"g")
    ns.set_xattr(f, b"user.x", b"1", NOW)
    block_id = ns.reserve("next_block_id")
    gs = ns.reserve("gs")
    ns.add_block(f, 0, BlockRecord(block_id, gs, 10, (1,)))
    return {"d": d, "f": f, "g": g, "block_id": block_id}


# (name, expected op code, call) -- each call is one successful mutation on the world above.
MUTATIONS = [
    ("mkdir", Op.MKNOD, lambda ns, w: ns.make_node(w["d"], b"sub", DIR, 0, 0, 0, NOW)),
    ("mknod", Op.MKNOD, lambda ns, w: ns.make_node(ROOT_INO, b"n", REG, 0, 0, 0, NOW)),
    ("symlink", Op.MKNOD, lambda ns, w: ns.make_node(ROOT_INO, b"s", LNK, 0, 0, 0, NOW,
                                                     target=b"/x")),
    ("link", Op.LINK, lambda ns, w: ns.link(w["f"], ROOT_INO, b"f2", NOW)),
    ("unlink", Op.UNLINK, lambda ns, w: ns.unlink(ROOT_INO, b"g", NOW, directory=False,
                                                  busy=never_busy)),
    ("unlink-busy", Op.UNLINK, lambda ns, w: ns.unlink(w["d"], b"f", NOW, directory=False,
                                                       busy=always_busy)),
    ("rename", Op.RENAME, lambda ns, w: ns.rename(ROOT_INO, b"g", w["d"], b"g", 0, NOW,
                                                  busy=never_busy)),
    ("rename-replace", Op.RENAME, lambda ns, w: ns.rename(ROOT_INO, b"g", w["d"], b"f", 0,
                                                          NOW, busy=never_busy)),
    ("exchange", Op.RENAME, lambda ns, w: ns.rename(ROOT_INO, b"g", w["d"], b"f",
                                                    RENAME_EXCHANGE, NOW, busy=never_busy)),
    ("setattr", Op.SETATTR, lambda ns, w: ns.setattr(w["f"], mode=0o600, ctime_ns=NOW)),
    ("setxattr", Op.SETXATTR, lambda ns, w: ns.set_xattr(w["g"], b"user.a", b"v", NOW)),
    ("removexattr", Op.REMOVEXATTR, lambda ns, w: ns.remove_xattr(w["f"], b"user.x", NOW)),
    ("purge", Op.PURGE, lambda ns, w: ns.purge(w["g"])),
    ("set_block_gs", Op.SET_GS, lambda ns, w: ns.set_block_gs(w["f"], 0, ns.reserve("gs"))),
    ("add_block", Op.ADD_BLOCK, lambda ns, w: ns.add_block(
        w["g"], 3, BlockRecord(ns.reserve("next_block_id"), ns.reserve("gs"), 1, (2,)))),
    ("persist_file", Op.UPDATE_BLOCKS, lambda ns, w: ns.persist_file(
        w["f"], size=10, mtime_ns=NOW, ctime_ns=NOW, atime_ns=NOW, blocks={})),
    ("truncate_blocks", Op.TRUNCATE, lambda ns, w: ns.truncate_blocks(w["f"], 0, 0, NOW)),
    ("take_lease", Op.LEASE, lambda ns, w: ns.take_lease(w["f"], b"s" * 16, NOW)),
    ("drop_lease", Op.LEASE, lambda ns, w: ns.drop_lease(w["f"])),
    ("trash_done", Op.TRASH_DONE, lambda ns, w: ns.trash_done([w["block_id"]])),
    ("set_state", Op.MOUNT, lambda ns, w: ns.set_state("mounted")),
    ("set_inherited", Op.SET_INHERITED, lambda ns, w: ns.set_inherited(
        w["d"], Inherited.REPLICATION, 2, NOW)),
    ("unset_inherited", Op.SET_INHERITED, lambda ns, w: ns.set_inherited(
        w["f"], Inherited.REPLICATION, None, NOW)),
    ("add_replica", Op.SET_REPLICAS, lambda ns, w: ns.add_replica(
        w["f"], 0, w["block_id"], ns.get_blocks(w["f"])[0].gs, 2)),
    ("drop_replicas", Op.SET_REPLICAS, lambda ns, w: ns.drop_replicas(w["f"], 0, (1,))),
]


@pytest.mark.parametrize("name,op,call", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_every_mutation_takes_one_txid_and_one_journal_record(ns, name, op, call):
    world = _setup_world(ns)
    # Reservations are batched: make sure the call below does not need a new batch, so
    # that exactly one transaction is expected.
    before = ns.last_txid()
    records_before = journal(ns)
    assert max(records_before) == before
    call(ns, world)
    after = ns.last_txid()
    records = journal(ns)
    assert after == before + 1
    assert set(records) - set(records_before) == {after}
    assert {k: records[k] for k in records_before} == records_before
    record = schema.parse_journal_record(records[after])
    assert record[0] == op


def test_journal_records_carry_the_arguments(ns):
    d = mkdir(ns, ROOT_INO, b"dir")
    ns.rename(ROOT_INO, b"dir", ROOT_INO, b"dir2", RENAME_NOREPLACE, NOW, busy=never_busy)
    records = journal(ns)
    mknod = schema.parse_journal_record(records[ns.last_txid() - 1])
    assert mknod[:4] == [Op.MKNOD, ROOT_INO, b"dir", d]
    assert mknod[4] == DIR
    rename = schema.parse_journal_record(records[ns.last_txid()])
    assert rename == [Op.RENAME, ROOT_INO, b"dir", ROOT_INO, b"dir2", RENAME_NOREPLACE]


def test_txids_are_consecutive_and_survive_reopen(tmp_path):
    make_filesystem(tmp_path / "d")
    ns = Namespace.open(tmp_path / "d" / NAMESPACE_DIR)
    start = ns.last_txid()
    for i in range(20):
        mkfile(ns, ROOT_INO, b"f%d" % i)
    assert ns.last_txid() == start + 20
    assert sorted(journal(ns)) == list(range(1, start + 21))
    ns.close()
    ns = Namespace.open(tmp_path / "d" / NAMESPACE_DIR)
    assert ns.last_txid() == start + 20
    mkfile(ns, ROOT_INO, b"after")
    assert ns.last_txid() == start + 21
    ns.close()


FAILURES = [
    ("EEXIST", errno.EEXIST, lambda ns, w: ns.make_node(w["d"], b"f", REG, 0, 0, 0, NOW)),
    ("ENOENT-parent", errno.ENOENT, lambda ns, w: ns.make_node(999, b"x", REG, 0, 0, 0, NOW)),
    ("ENOTDIR", errno.ENOTDIR, lambda ns, w: ns.make_node(w["f"], b"x", REG, 0, 0, 0, NOW)),
    ("ENOENT-unlink", errno.ENOENT, lambda ns, w: ns.unlink(ROOT_INO, b"nope", NOW,
                                                            directory=False, busy=never_busy)),
    ("ENOTEMPTY", errno.ENOTEMPTY, lambda ns, w: ns.unlink(ROOT_INO, b"d", NOW,
                                                           directory=True, busy=never_busy)),
    ("EPERM-link", errno.EPERM, lambda ns, w: ns.link(w["d"], ROOT_INO, b"l", NOW)),
    ("EINVAL-rename", errno.EINVAL, lambda ns, w: ns.rename(ROOT_INO, b"d", w["d"], b"x", 0,
                                                            NOW, busy=never_busy)),
    ("ENODATA", errno.ENODATA, lambda ns, w: ns.remove_xattr(w["g"], b"user.no", NOW)),
    ("ENOENT-setattr", errno.ENOENT, lambda ns, w: ns.setattr(999, mode=0, ctime_ns=NOW)),
    ("EIO-add-existing-block", errno.EIO, lambda ns, w: ns.add_block(
        w["f"], 0, BlockRecord(ns.reserve("next_block_id"), 1, 1, (1,)))),
    ("ENAMETOOLONG", errno.ENAMETOOLONG, lambda ns, w: ns.make_node(
        ROOT_INO, b"n" * 256, REG, 0, 0, 0, NOW)),
]


@pytest.mark.parametrize("name,err,call", FAILURES, ids=[f[0] for f in FAILURES])
def test_failed_mutation_changes_nothing_and_takes_no_txid(ns, name, err, call):
    world = _setup_world(ns)
    ns.reserve("next_block_id")  # the batch exists: a failing call needs no reservation
    before_txid = ns.last_txid()
    before_journal = journal(ns)
    before_inodes = ns.counts()["inodes"]
    before_tree = {ino: names(ns, ino) for ino in (ROOT_INO, world["d"])}
    with raises_errno(err):
        call(ns, world)
    assert ns.last_txid() == before_txid
    assert journal(ns) == before_journal
    assert ns.counts()["inodes"] == before_inodes
    assert {ino: names(ns, ino) for ino in (ROOT_INO, world["d"])} == before_tree
    # The failed call reserved no inode number: the next one follows the last one made.
    assert mkfile(ns, ROOT_INO, b"probe") == world["g"] + 1


# --- inode numbers and block ids are never reused ---------------------------------------------

def test_inode_numbers_never_reused_after_unlink_and_purge(tmp_path):
    make_filesystem(tmp_path / "d")
    path = tmp_path / "d" / NAMESPACE_DIR
    ns = Namespace.open(path)
    seen = set()
    last = ROOT_INO
    for round_ in range(3):
        for i in range(5):
            ino = mkfile(ns, ROOT_INO, b"f%d" % i)
            assert ino > last and ino not in seen
            seen.add(ino)
            last = ino
        d = mkdir(ns, ROOT_INO, b"dir")
        assert d > last
        last = d
        ns.unlink(ROOT_INO, b"dir", NOW, directory=True, busy=never_busy)
        for i in range(5):
            busy = always_busy if i % 2 else never_busy
            ino = ns.unlink(ROOT_INO, b"f%d" % i, NOW, directory=False, busy=busy)
            ns.purge(ino)
            with raises_errno(errno.ENOENT):
                ns.get_inode(ino)
        if round_ == 1:
            ns.close()
            ns = Namespace.open(path)
    ns.close()


def test_block_ids_and_generation_stamps_never_reused(tmp_path):
    make_filesystem(tmp_path / "d")
    path = tmp_path / "d" / NAMESPACE_DIR
    ns = Namespace.open(path)
    ids: list[int] = []
    stamps: list[int] = []
    f = mkfile(ns, ROOT_INO, b"f")
    for i in range(nsmod.ID_BATCH + 10):  # crosses a reservation batch
        ids.append(ns.reserve("next_block_id"))
        stamps.append(ns.reserve("gs"))
    assert ids == sorted(set(ids)) and stamps == sorted(set(stamps))
    ns.add_block(f, 0, BlockRecord(ids[-1], stamps[-1], 5, (1,)))
    ns.unlink(ROOT_INO, b"f", NOW, directory=False, busy=never_busy)
    assert [t[0] for t in ns.trash()] == [ids[-1]]
    ns.close()
    ns = Namespace.open(path)  # a new process: its batches start past the durable counters
    assert ns.reserve("next_block_id") > ids[-1]
    assert ns.reserve("gs") > stamps[-1]
    ns.close()


def test_reserve_takes_one_txid_per_batch(ns):
    before = ns.last_txid()
    for _ in range(nsmod.ID_BATCH):
        ns.reserve("next_block_id")
    assert ns.last_txid() == before + 1
    ns.reserve("next_block_id")
    assert ns.last_txid() == before + 2


# --- errors with the right errno --------------------------------------------------------------

def test_eexist(ns):
    d = mkdir(ns, ROOT_INO, b"d")
    f = mkfile(ns, d, b"f")
    with raises_errno(errno.EEXIST):
        mkfile(ns, d, b"f")
    with raises_errno(errno.EEXIST):
        mkdir(ns, ROOT_INO, b"d")
    with raises_errno(errno.EEXIST):
        ns.link(f, d, b"f", NOW)
    g = mkfile(ns, d, b"g")
    with raises_errno(errno.EEXIST):
        ns.rename(d, b"g", d, b"f", RENAME_NOREPLACE, NOW, busy=never_busy)
    assert names(ns, d) == {b"f": f, b"g": g}


def test_enoent(ns):
    d = mkdir(ns, ROOT_INO, b"d")
    with raises_errno(errno.ENOENT):
        ns.lookup(ROOT_INO, b"missing")
    with raises_errno(errno.ENOENT):
        ns.get_inode(12345)
    with raises_errno(errno.ENOENT):
        ns.unlink(d, b"missing", NOW, directory=False, busy=never_busy)
    with raises_errno(errno.ENOENT):
        ns.unlink(d, b"missing", NOW, directory=True, busy=never_busy)
    with raises_errno(errno.ENOENT):
        ns.rename(d, b"missing", ROOT_INO, b"x", 0, NOW, busy=never_busy)
    mkfile(ns, d, b"a")
    with raises_errno(errno.ENOENT):
        ns.rename(d, b"a", ROOT_INO, b"nothing", RENAME_EXCHANGE, NOW, busy=never_busy)
    with raises_errno(errno.ENOENT):
        ns.make_node(777, b"x", REG, 0, 0, 0, NOW)
    with raises_errno(errno.ENOENT):
        ns.link(777, ROOT_INO, b"x", NOW)


def test_enotdir(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    mkdir(ns, ROOT_INO, b"d")
    with raises_errno(errno.ENOTDIR):
        mkfile(ns, f, b"x")
    with raises_errno(errno.ENOTDIR):
        ns.unlink(ROOT_INO, b"f", NOW, directory=True, busy=never_busy)
    with raises_errno(errno.ENOTDIR):
        ns.rename(ROOT_INO, b"d", ROOT_INO, b"f", 0, NOW, busy=never_busy)
    with raises_errno(errno.ENOTDIR):
        ns.rename(f, b"x", ROOT_INO, b"y", 0, NOW, busy=never_busy)
    with raises_errno(errno.ENOTDIR):
        ns.link(f, f, b"x", NOW)
    assert stat.S_ISREG(ns.lookup(ROOT_INO, b"f").mode)


def test_eisdir(ns):
    mkdir(ns, ROOT_INO, b"d")
    mkfile(ns, ROOT_INO, b"f")
    with raises_errno(errno.EISDIR):
        ns.unlink(ROOT_INO, b"d", NOW, directory=False, busy=never_busy)
    with raises_errno(errno.EISDIR):
        ns.rename(ROOT_INO, b"f", ROOT_INO, b"d", 0, NOW, busy=never_busy)
    assert stat.S_ISDIR(ns.lookup(ROOT_INO, b"d").mode)


def test_enotempty(ns):
    d = mkdir(ns, ROOT_INO, b"d")
    mkfile(ns, d, b"f")
    e = mkdir(ns, ROOT_INO, b"e")
    with raises_errno(errno.ENOTEMPTY):
        ns.unlink(ROOT_INO, b"d", NOW, directory=True, busy=never_busy)
    with raises_errno(errno.ENOTEMPTY):
        ns.rename(ROOT_INO, b"e", ROOT_INO, b"d", 0, NOW, busy=never_busy)
    assert names(ns, ROOT_INO) == {b"d": d, b"e": e}
    # an empty directory can be replaced
    ns.unlink(d, b"f", NOW, directory=False, busy=never_busy)
    assert ns.rename(ROOT_INO, b"e", ROOT_INO, b"d", 0, NOW, busy=never_busy) == d
    assert names(ns, ROOT_INO) == {b"d": e}
    with raises_errno(errno.ENOENT):
        ns.get_inode(d)


def test_einval_rename_into_own_subtree(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    b = mkdir(ns, a, b"b")
    c = mkdir(ns, b, b"c")
    for target in (a, b, c):
        with raises_errno(errno.EINVAL):
            ns.rename(ROOT_INO, b"a", target, b"moved", 0, NOW, busy=never_busy)
    with raises_errno(errno.EINVAL):
        ns.rename(a, b"b", c, b"moved", 0, NOW, busy=never_busy)
    # replacing a directory inside itself
    with raises_errno(errno.EINVAL):
        ns.rename(a, b"b", b, b"c", 0, NOW, busy=never_busy)
    # exchanging a directory with something in its own subtree, in either direction
    with raises_errno(errno.EINVAL):
        ns.rename(ROOT_INO, b"a", b, b"c", RENAME_EXCHANGE, NOW, busy=never_busy)
    with raises_errno(errno.EINVAL):
        ns.rename(b, b"c", ROOT_INO, b"a", RENAME_EXCHANGE, NOW, busy=never_busy)
    assert ns.parent_chain(c) == [c, b, a, ROOT_INO]


def test_rename_whiteout_leaves_a_whiteout_in_the_same_transaction(ns):
    """overlayfs's whiteout: a character device 0:0, mode 0, at the old name, owned as
    asked; one TxID, whose journal record names the new inode and its owner."""
    f = mkfile(ns, ROOT_INO, b"a")
    d = mkdir(ns, ROOT_INO, b"d")
    before = ns.last_txid()
    assert ns.rename(ROOT_INO, b"a", d, b"b", RENAME_WHITEOUT, NOW + 5, busy=never_busy,
                     whiteout_owner=(1000, 100)) is None
    assert ns.last_txid() == before + 1
    whiteout = ns.lookup(ROOT_INO, b"a")
    assert whiteout.ino > d and ns.lookup(d, b"b").ino == f
    assert (whiteout.mode, whiteout.rdev, whiteout.uid, whiteout.gid, whiteout.nlink) == (
        stat.S_IFCHR, 0, 1000, 100, 1)
    assert whiteout.mtime_ns == whiteout.ctime_ns == NOW + 5
    assert ns.parent_chain(whiteout.ino) == [whiteout.ino, ROOT_INO]
    record = schema.parse_journal_record(journal(ns)[ns.last_txid()])
    assert record == [Op.RENAME, ROOT_INO, b"a", d, b"b", RENAME_WHITEOUT, whiteout.ino,
                      1000, 100]
    # onto an existing name with RENAME_NOREPLACE: EEXIST, and no whiteout either
    with raises_errno(errno.EEXIST):
        ns.rename(d, b"b", ROOT_INO, b"a", RENAME_WHITEOUT | RENAME_NOREPLACE, NOW,
                  busy=never_busy, whiteout_owner=(0, 0))
    assert ns.lookup(d, b"b").ino == f and ns.last_txid() == before + 1


def test_einval_rename_flags(ns):
    mkfile(ns, ROOT_INO, b"a")
    mkfile(ns, ROOT_INO, b"b")
    before = ns.last_txid()
    with raises_errno(errno.EINVAL):
        ns.rename(ROOT_INO, b"a", ROOT_INO, b"b", RENAME_NOREPLACE | RENAME_EXCHANGE, NOW,
                  busy=never_busy)
    with raises_errno(errno.EINVAL):
        ns.rename(ROOT_INO, b"a", ROOT_INO, b"c", 8, NOW, busy=never_busy)  # unknown flag
    with raises_errno(errno.EINVAL):  # needs an owner for the whiteout
        ns.rename(ROOT_INO, b"a", ROOT_INO, b"c", RENAME_WHITEOUT, NOW, busy=never_busy)
    with raises_errno(errno.EINVAL):
        ns.rename(ROOT_INO, b"a", ROOT_INO, b"b", RENAME_WHITEOUT | RENAME_EXCHANGE, NOW,
                  busy=never_busy, whiteout_owner=(0, 0))
    assert ns.last_txid() == before
    assert set(names(ns, ROOT_INO)) == {b"a", b"b"}


@pytest.mark.parametrize("bad", [b"", b".", b"..", b"a/b"])
def test_einval_bad_names(ns, bad):
    f = mkfile(ns, ROOT_INO, b"f")
    with raises_errno(errno.EINVAL):
        ns.make_node(ROOT_INO, bad, REG, 0, 0, 0, NOW)
    with raises_errno(errno.EINVAL):
        ns.link(f, ROOT_INO, bad, NOW)
    with raises_errno(errno.EINVAL):
        ns.rename(ROOT_INO, b"f", ROOT_INO, bad, 0, NOW, busy=never_busy)
    assert names(ns, ROOT_INO) == {b"f": f}


def test_enametoolong(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    long_name = b"x" * 256
    with raises_errno(errno.ENAMETOOLONG):
        ns.make_node(ROOT_INO, long_name, REG, 0, 0, 0, NOW)
    with raises_errno(errno.ENAMETOOLONG):
        ns.make_node(ROOT_INO, long_name, DIR, 0, 0, 0, NOW)
    with raises_errno(errno.ENAMETOOLONG):
        ns.link(f, ROOT_INO, long_name, NOW)
    with raises_errno(errno.ENAMETOOLONG):
        ns.rename(ROOT_INO, b"f", ROOT_INO, long_name, 0, NOW, busy=never_busy)
    with raises_errno(errno.ENAMETOOLONG):
        ns.lookup(ROOT_INO, long_name)
    # 255 bytes (multi-byte UTF-8 included) is the limit and works everywhere
    ok = ("é" * 127).encode() + b"x"
    assert len(ok) == 255
    g = mkfile(ns, ROOT_INO, ok)
    assert ns.lookup(ROOT_INO, ok).ino == g
    ns.rename(ROOT_INO, ok, ROOT_INO, b"y" * 255, 0, NOW, busy=never_busy)
    assert ns.lookup(ROOT_INO, b"y" * 255).ino == g


def test_eperm_hard_link_to_directory(ns):
    d = mkdir(ns, ROOT_INO, b"d")
    with raises_errno(errno.EPERM):
        ns.link(d, ROOT_INO, b"d2", NOW)
    with raises_errno(errno.EPERM):
        ns.link(ROOT_INO, d, b"root", NOW)
    assert nlink(ns, d) == 2 and nlink(ns, ROOT_INO) == 3
    assert names(ns, ROOT_INO) == {b"d": d}


def test_link_to_removed_file_is_enoent(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    ns.unlink(ROOT_INO, b"f", NOW, directory=False, busy=always_busy)
    with raises_errno(errno.ENOENT):
        ns.link(f, ROOT_INO, b"back", NOW)
    assert names(ns, ROOT_INO) == {}


def test_no_entry_in_a_removed_directory(ns):
    d = mkdir(ns, ROOT_INO, b"d")
    ns.unlink(ROOT_INO, b"d", NOW, directory=True, busy=always_busy)
    assert ns.orphans() == [d]
    assert nlink(ns, d) == 0
    assert nlink(ns, ROOT_INO) == 2
    with raises_errno(errno.ENOENT):
        mkfile(ns, d, b"x")
    f = mkfile(ns, ROOT_INO, b"f")
    with raises_errno(errno.ENOENT):
        ns.rename(ROOT_INO, b"f", d, b"f", 0, NOW, busy=never_busy)
    with raises_errno(errno.ENOENT):
        ns.link(f, d, b"f", NOW)
    ns.purge(d)
    assert ns.orphans() == []
    with raises_errno(errno.ENOENT):
        ns.get_inode(d)


# --- nlink ------------------------------------------------------------------------------------

def test_directory_nlink_mkdir_rmdir(ns):
    assert nlink(ns, ROOT_INO) == 2
    a = mkdir(ns, ROOT_INO, b"a")
    assert nlink(ns, ROOT_INO) == 3 and nlink(ns, a) == 2
    for i in range(4):
        mkdir(ns, a, b"s%d" % i)
    mkfile(ns, a, b"file")  # files do not count
    ns.make_node(a, b"sym", LNK, 0, 0, 0, NOW, target=b"t")
    assert nlink(ns, a) == 6 and nlink(ns, ROOT_INO) == 3
    ns.unlink(a, b"s0", NOW, directory=True, busy=never_busy)
    assert nlink(ns, a) == 5
    ns.unlink(a, b"file", NOW, directory=False, busy=never_busy)
    assert nlink(ns, a) == 5


def test_directory_nlink_rename_between_dirs(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    b = mkdir(ns, ROOT_INO, b"b")
    s = mkdir(ns, a, b"s")
    mkdir(ns, s, b"deep")
    ns.rename(a, b"s", b, b"s", 0, NOW, busy=never_busy)
    assert (nlink(ns, a), nlink(ns, b), nlink(ns, s), nlink(ns, ROOT_INO)) == (2, 3, 3, 4)
    assert ns.get_inode(s).parent == b
    # rename within one directory changes no count
    ns.rename(b, b"s", b, b"t", 0, NOW, busy=never_busy)
    assert (nlink(ns, a), nlink(ns, b), nlink(ns, s)) == (2, 3, 3)
    # replacing an empty directory in another directory
    e = mkdir(ns, a, b"e")
    assert nlink(ns, a) == 3
    assert ns.rename(b, b"t", a, b"e", 0, NOW, busy=never_busy) == e
    assert (nlink(ns, a), nlink(ns, b), nlink(ns, s)) == (3, 2, 3)
    assert nlink(ns, ROOT_INO) == 4
    # a directory moved to the root and back
    ns.rename(a, b"e", ROOT_INO, b"top", 0, NOW, busy=never_busy)
    assert (nlink(ns, a), nlink(ns, ROOT_INO)) == (2, 5)
    ns.rename(ROOT_INO, b"top", a, b"back", 0, NOW, busy=never_busy)
    assert (nlink(ns, a), nlink(ns, ROOT_INO)) == (3, 4)


def test_directory_nlink_exchange_dir_and_file(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    b = mkdir(ns, ROOT_INO, b"b")
    d = mkdir(ns, a, b"d")
    f = mkfile(ns, b, b"f")
    ns.rename(a, b"d", b, b"f", RENAME_EXCHANGE, NOW, busy=never_busy)
    assert names(ns, a) == {b"d": f} and names(ns, b) == {b"f": d}
    assert (nlink(ns, a), nlink(ns, b), nlink(ns, d), nlink(ns, f)) == (2, 3, 2, 1)
    assert ns.get_inode(d).parent == b and ns.get_inode(f).parent == a
    assert ns.parent_chain(d) == [d, b, ROOT_INO]
    # and back, in the other argument order
    ns.rename(a, b"d", b, b"f", RENAME_EXCHANGE, NOW, busy=never_busy)
    assert (nlink(ns, a), nlink(ns, b)) == (3, 2)
    # two directories: no count changes
    e = mkdir(ns, b, b"e")
    ns.rename(a, b"d", b, b"e", RENAME_EXCHANGE, NOW, busy=never_busy)
    assert (nlink(ns, a), nlink(ns, b)) == (3, 3)
    assert ns.parent_chain(e) == [e, a, ROOT_INO]
    # exchange within one directory
    mkfile(ns, a, b"g")
    ns.rename(a, b"d", a, b"g", RENAME_EXCHANGE, NOW, busy=never_busy)
    assert nlink(ns, a) == 3


def test_file_nlink_counts_hard_links(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    f = mkfile(ns, ROOT_INO, b"f")
    ns.link(f, a, b"l1", NOW)
    ns.link(f, a, b"l2", NOW)
    assert nlink(ns, f) == 3
    ns.unlink(ROOT_INO, b"f", NOW, directory=False, busy=never_busy)
    assert nlink(ns, f) == 2
    assert ns.get_inode(f).parent == a  # its parent moved to a remaining link
    assert ns.parent_chain(f) == [f, a, ROOT_INO]
    ns.unlink(a, b"l1", NOW, directory=False, busy=never_busy)
    assert nlink(ns, f) == 1 and ns.orphans() == []
    ns.unlink(a, b"l2", NOW, directory=False, busy=never_busy)
    with raises_errno(errno.ENOENT):
        ns.get_inode(f)


# --- rename -----------------------------------------------------------------------------------

def test_rename_replacing_a_file(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    src = mkfile(ns, ROOT_INO, b"src")
    dst = mkfile(ns, a, b"dst")
    ns.set_xattr(dst, b"user.k", b"v", NOW)
    assert ns.rename(ROOT_INO, b"src", a, b"dst", 0, NOW, busy=never_busy) == dst
    assert names(ns, a) == {b"dst": src} and names(ns, ROOT_INO) == {b"a": a}
    assert ns.get_inode(src).parent == a
    with raises_errno(errno.ENOENT):
        ns.get_inode(dst)
    assert ns.list_xattrs(dst) == []
    assert ns.orphans() == []


def test_rename_replacing_an_open_file_makes_an_orphan(ns):
    src = mkfile(ns, ROOT_INO, b"src")
    dst = mkfile(ns, ROOT_INO, b"dst")
    assert ns.rename(ROOT_INO, b"src", ROOT_INO, b"dst", 0, NOW, busy=always_busy) == dst
    assert ns.orphans() == [dst]
    assert ns.get_inode(dst).nlink == 0
    assert names(ns, ROOT_INO) == {b"dst": src}


def test_rename_replacing_one_link_of_a_hard_linked_file(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    dst = mkfile(ns, a, b"dst")
    ns.link(dst, ROOT_INO, b"other", NOW)
    src = mkfile(ns, ROOT_INO, b"src")
    assert ns.rename(ROOT_INO, b"src", a, b"dst", 0, NOW, busy=never_busy) == dst
    assert nlink(ns, dst) == 1
    assert ns.get_inode(dst).parent == ROOT_INO
    assert names(ns, ROOT_INO) == {b"a": a, b"other": dst}
    assert names(ns, a) == {b"dst": src}


def test_rename_onto_another_link_of_the_same_file_is_a_noop(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    f = mkfile(ns, ROOT_INO, b"f")
    ns.link(f, a, b"g", NOW)
    before = cookies(ns, ROOT_INO), cookies(ns, a)
    assert ns.rename(ROOT_INO, b"f", a, b"g", 0, NOW, busy=never_busy) is None
    assert names(ns, ROOT_INO) == {b"a": a, b"f": f}
    assert names(ns, a) == {b"g": f}
    assert (cookies(ns, ROOT_INO), cookies(ns, a)) == before
    assert nlink(ns, f) == 2 and ns.orphans() == []
    # the same name onto itself
    assert ns.rename(ROOT_INO, b"f", ROOT_INO, b"f", 0, NOW, busy=never_busy) is None
    assert names(ns, ROOT_INO) == {b"a": a, b"f": f}
    assert ns.rename(ROOT_INO, b"a", ROOT_INO, b"a", 0, NOW, busy=never_busy) is None
    assert nlink(ns, ROOT_INO) == 3 and names(ns, a) == {b"g": f}


def test_rename_gives_a_new_cookie_and_exchange_keeps_cookies(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    x = mkfile(ns, ROOT_INO, b"x")
    y = mkdir(ns, a, b"y")
    mkfile(ns, ROOT_INO, b"z")
    root_before, a_before = cookies(ns, ROOT_INO), cookies(ns, a)
    ns.rename(ROOT_INO, b"x", a, b"y", RENAME_EXCHANGE, NOW, busy=never_busy)
    assert cookies(ns, ROOT_INO) == root_before and cookies(ns, a) == a_before
    assert names(ns, ROOT_INO)[b"x"] == y and names(ns, a)[b"y"] == x
    ns.rename(ROOT_INO, b"z", ROOT_INO, b"z2", 0, NOW, busy=never_busy)
    after = cookies(ns, ROOT_INO)
    assert b"z" not in after and after[b"z2"] > max(root_before.values())


def test_exchange_of_two_files_in_different_directories(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    b = mkdir(ns, ROOT_INO, b"b")
    f = mkfile(ns, a, b"f")
    g = mkfile(ns, b, b"g")
    assert ns.rename(a, b"f", b, b"g", RENAME_EXCHANGE, NOW, busy=never_busy) is None
    assert names(ns, a) == {b"f": g} and names(ns, b) == {b"g": f}
    assert ns.lookup(a, b"f").ino == g
    assert ns.parent_chain(f) == [f, b, ROOT_INO] and ns.parent_chain(g) == [g, a, ROOT_INO]
    # the moved inodes can be unlinked under their new names (backlinks follow)
    ns.unlink(b, b"g", NOW, directory=False, busy=never_busy)
    with raises_errno(errno.ENOENT):
        ns.get_inode(f)
    assert nlink(ns, g) == 1


def test_rename_updates_times(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    f = mkfile(ns, ROOT_INO, b"f")
    later = NOW + 5
    ns.rename(ROOT_INO, b"f", a, b"f", 0, later, busy=never_busy)
    for ino in (ROOT_INO, a):
        inode = ns.get_inode(ino)
        assert inode.mtime_ns == inode.ctime_ns == later
    assert ns.get_inode(f).ctime_ns == later and ns.get_inode(f).mtime_ns == NOW


def test_times_of_names_and_inodes(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    f = mkfile(ns, a, b"f")
    t = NOW + 10
    ns.link(f, ROOT_INO, b"l", t)  # the file's ctime, the new parent's mtime and ctime
    assert ns.get_inode(f).ctime_ns == t and ns.get_inode(f).mtime_ns == NOW
    assert ns.get_inode(ROOT_INO).mtime_ns == ns.get_inode(ROOT_INO).ctime_ns == t
    assert ns.get_inode(a).mtime_ns == NOW
    t += 10
    ns.unlink(a, b"f", t, directory=False, busy=never_busy)
    assert ns.get_inode(f).ctime_ns == t and ns.get_inode(f).mtime_ns == NOW
    assert ns.get_inode(a).mtime_ns == ns.get_inode(a).ctime_ns == t
    t += 10
    mkdir(ns, a, b"sub")  # make_node stamps the parent with its own now_ns (NOW)
    assert ns.get_inode(a).mtime_ns == NOW
    t += 10
    ns.set_xattr(f, b"user.x", b"1", t)
    assert ns.get_inode(f).ctime_ns == t and ns.get_inode(f).mtime_ns == NOW


# --- readdir ----------------------------------------------------------------------------------

def test_readdir_order_limit_and_resume(ns):
    d = mkdir(ns, ROOT_INO, b"d")
    created = [mkfile(ns, d, b"e%03d" % i) for i in range(50)]
    everything = listing(ns, d, 0, 1000)
    assert [e.ino for e in everything] == created
    assert [e.cookie for e in everything] == sorted({e.cookie for e in everything})
    assert min(e.cookie for e in everything) >= schema.FIRST_COOKIE
    # each row carries its inode's stored attributes, as get_inode reads them
    assert [e.inode for e in everything] == [ns.get_inode(i) for i in created]
    first = listing(ns, d, 0, 7)
    assert len(first) == 7
    rest = listing(ns, d, first[-1].cookie, 1000)
    assert first + rest == everything
    assert ns.readdir(d, everything[-1].cookie, 10) == []
    assert ns.readdir(d, 0, 0) == []
    # another directory's entries never leak into this one
    mkfile(ns, ROOT_INO, b"zz")
    assert [e.name for e in listing(ns, d, 0, 1000)] == [b"e%03d" % i for i in range(50)]


def test_readdir_stable_offsets_under_concurrent_changes(ns):
    rng = random.Random(20)
    d = mkdir(ns, ROOT_INO, b"d")
    initial = {b"init%04d" % i for i in range(400)}
    for name in sorted(initial, key=lambda _: rng.random()):
        mkfile(ns, d, name)
    removed: set[bytes] = set()
    added: set[bytes] = set()
    seen: list[bytes] = []
    seen_cookies: list[int] = []
    after = 0
    counter = 0
    while True:
        batch = listing(ns, d, after, rng.randint(1, 13))
        if not batch:
            break
        for entry in batch:
            seen.append(entry.name)
            seen_cookies.append(entry.cookie)
        after = batch[-1].cookie
        # between batches: remove some entries (listed or not), add new ones, rename some
        current = sorted(names(ns, d))
        for name in rng.sample(current, k=min(len(current), rng.randint(0, 3))):
            ns.unlink(d, name, NOW, directory=False, busy=never_busy)
            removed.add(name)
        for _ in range(rng.randint(0, 3)):
            counter += 1
            name = b"new%04d" % counter
            mkfile(ns, d, name)
            added.add(name)
        current = sorted(names(ns, d))
        if current and rng.random() < 0.3:
            old = rng.choice(current)
            counter += 1
            new = b"ren%04d" % counter
            ns.rename(d, old, d, new, 0, NOW, busy=never_busy)
            removed.add(old)
            added.add(new)
    assert seen_cookies == sorted(set(seen_cookies)), "cookies repeat or go backwards"
    stayed = initial - removed
    assert len(stayed) > 100
    for name in stayed:
        assert seen.count(name) == 1, name
    assert set(seen) <= initial | added


def test_readdir_of_a_directory_with_many_entries_in_batches(ns):
    d = mkdir(ns, ROOT_INO, b"d")
    expected = {b"f%05d" % i for i in range(1500)}
    for name in expected:
        mkfile(ns, d, name)
    got: list[bytes] = []
    after = 0
    while batch := listing(ns, d, after, 256):
        got += [e.name for e in batch]
        after = batch[-1].cookie
    assert len(got) == len(expected) and set(got) == expected


# --- orphans and purge ------------------------------------------------------------------------

def test_busy_unlink_makes_an_orphan_and_purge_trashes_its_blocks(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    recs = {}
    for index in (0, 2):
        rec = BlockRecord(ns.reserve("next_block_id"), ns.reserve("gs"), 100, (1, 2))
        ns.add_block(f, index, rec)
        recs[index] = rec
    ns.set_xattr(f, b"user.k", b"v", NOW)
    assert ns.unlink(ROOT_INO, b"f", NOW, directory=False, busy=always_busy) == f
    assert ns.orphans() == [f]
    assert ns.trash() == [] and ns.last_trash == []
    inode = ns.get_inode(f)
    assert inode.nlink == 0
    assert ns.get_blocks(f) == recs  # still readable through an open handle
    with raises_errno(errno.ENOENT):
        ns.lookup(ROOT_INO, b"f")
    assert ns.counts()["inodes"] == 2
    ns.purge(f)
    assert ns.orphans() == []
    with raises_errno(errno.ENOENT):
        ns.get_inode(f)
    assert ns.get_blocks(f) == {}
    assert ns.list_xattrs(f) == []
    assert sorted(ns.trash()) == sorted((r.block_id, r.gs, r.volumes) for r in recs.values())
    assert sorted(ns.last_trash) == sorted(ns.trash())
    assert ns.counts()["inodes"] == 1
    ns.trash_done([r.block_id for r in recs.values()])
    assert ns.trash() == []


def test_unlink_not_busy_purges_at_once(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    rec = BlockRecord(ns.reserve("next_block_id"), ns.reserve("gs"), 1, (3,))
    ns.add_block(f, 0, rec)
    ns.take_lease(f, b"h" * 16, NOW)
    ns.unlink(ROOT_INO, b"f", NOW, directory=False, busy=never_busy)
    assert ns.orphans() == [] and ns.leases() == {}
    assert ns.trash() == [(rec.block_id, rec.gs, (3,))]
    assert ns.last_trash == [(rec.block_id, rec.gs, (3,))]
    with raises_errno(errno.ENOENT):
        ns.get_inode(f)


def test_busy_is_asked_about_the_unlinked_inode_only_when_its_last_link_goes(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    ns.link(f, ROOT_INO, b"g", NOW)
    asked = []

    def busy(ino):
        asked.append(ino)
        return False

    ns.unlink(ROOT_INO, b"f", NOW, directory=False, busy=busy)
    assert asked == []
    ns.unlink(ROOT_INO, b"g", NOW, directory=False, busy=busy)
    assert asked == [f]


def test_purge_of_a_linked_inode_does_nothing(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    ns.purge(f)
    assert ns.lookup(ROOT_INO, b"f").ino == f
    ns.purge(99999)  # unknown: nothing to do, no error


def test_truncate_blocks_trashes_the_dropped_blocks(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    recs = [BlockRecord(ns.reserve("next_block_id"), ns.reserve("gs"), 10, (1,))
            for _ in range(3)]
    for i, rec in enumerate(recs):
        ns.add_block(f, i, rec)
    trash = ns.truncate_blocks(f, 1, 5, NOW + 1)
    assert sorted(trash) == sorted((r.block_id, r.gs, r.volumes) for r in recs[1:])
    assert ns.get_blocks(f) == {0: recs[0]}
    inode = ns.get_inode(f)
    assert inode.size == 5 and inode.mtime_ns == NOW + 1


# --- map growth -------------------------------------------------------------------------------

def test_map_grows_from_a_tiny_map(tmp_path, monkeypatch):
    monkeypatch.setattr(nsmod, "INITIAL_MAP_SIZE", 64 << 10)
    config = FsConfig(fs_uuid=str(uuid.uuid4()), block_size=1 << 20, bytes_per_checksum=4096,
                      replication=1, default_policy="HOT", rename_mode="follow")
    ns = Namespace.create(tmp_path / "ns", config, uid=0, gid=0, now_ns=NOW)
    start_map = ns.env.info()["map_size"]
    assert start_map <= 128 << 10
    start_txid = ns.last_txid()
    d = mkdir(ns, ROOT_INO, b"d")
    count = 4000
    inos = {}
    for i in range(count):
        name = b"entry-%05d-" % i + b"p" * 150
        inos[name] = mkfile(ns, d, name)
        ns.set_xattr(inos[name], b"user.pad", b"v" * 64, NOW)
    assert ns.env.info()["map_size"] > start_map
    assert ns.last_txid() == start_txid + 1 + 2 * count
    assert ns.counts()["inodes"] == count + 2
    assert names(ns, d) == inos
    assert ns.get_xattr(inos[b"entry-03999-" + b"p" * 150], b"user.pad") == b"v" * 64
    ns.close()
    # and it reopens with everything (the map is sized from the file)
    ns = Namespace.open(tmp_path / "ns")
    assert len(names(ns, d)) == count
    ns.close()


def test_map_grows_when_opened_with_a_tiny_map(tmp_path, monkeypatch):
    make_filesystem(tmp_path / "d")
    monkeypatch.setattr(nsmod, "INITIAL_MAP_SIZE", 32 << 10)
    ns = Namespace.open(tmp_path / "d" / NAMESPACE_DIR)
    start_map = ns.env.info()["map_size"]
    for i in range(3000):
        ns.make_node(ROOT_INO, b"dir-%05d" % i + b"q" * 100, DIR, 0, 0, 0, NOW)
    assert ns.env.info()["map_size"] > start_map
    assert nlink(ns, ROOT_INO) == 3002
    assert len(names(ns, ROOT_INO)) == 3000
    ns.close()


# --- counts, txid, parent_chain, symlinks, setattr --------------------------------------------

def test_counts_and_txid(ns):
    base = ns.counts()
    txid = ns.last_txid()
    assert base["inodes"] == 1 and base["used"] <= base["map_size"]
    d = mkdir(ns, ROOT_INO, b"d")
    for i in range(10):
        mkfile(ns, d, b"%d" % i)
    assert ns.counts()["inodes"] == 12
    assert ns.last_txid() == txid + 11
    ns.unlink(d, b"0", NOW, directory=False, busy=always_busy)
    assert ns.counts()["inodes"] == 12  # an orphan still counts
    ns.unlink(d, b"1", NOW, directory=False, busy=never_busy)
    assert ns.counts()["inodes"] == 11
    assert ns.last_txid() == txid + 13


def test_parent_chain(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    b = mkdir(ns, a, b"b")
    c = mkdir(ns, b, b"c")
    f = mkfile(ns, c, b"f")
    assert ns.parent_chain(ROOT_INO) == [ROOT_INO]
    assert ns.parent_chain(f) == [f, c, b, a, ROOT_INO]
    ns.rename(a, b"b", ROOT_INO, b"b", 0, NOW, busy=never_busy)
    assert ns.parent_chain(f) == [f, c, b, ROOT_INO]
    ns.rename(b, b"c", a, b"c", 0, NOW, busy=never_busy)
    assert ns.parent_chain(f) == [f, c, a, ROOT_INO]
    ns.link(f, b, b"f2", NOW)
    ns.unlink(c, b"f", NOW, directory=False, busy=never_busy)
    assert ns.parent_chain(f) == [f, b, ROOT_INO]
    with raises_errno(errno.ENOENT):
        ns.parent_chain(424242)


@pytest.mark.parametrize("target", [b"/abs/path", b"rel", b"\xff\xfe not utf-8", b"t" * 4095,
                                    b"../../x"])
def test_symlink_target_round_trip(tmp_path, target):
    make_filesystem(tmp_path / "d")
    ns = Namespace.open(tmp_path / "d" / NAMESPACE_DIR)
    s = ns.make_node(ROOT_INO, b"s", LNK, 0, 0, 0, NOW, target=target)
    assert s.size == len(target) and stat.S_ISLNK(s.mode)
    assert ns.readlink(s.ino) == target
    ns.close()
    ns = Namespace.open(tmp_path / "d" / NAMESPACE_DIR)
    assert ns.readlink(s.ino) == target
    assert ns.lookup(ROOT_INO, b"s").size == len(target)
    ns.close()


def test_readlink_of_a_non_symlink_is_einval(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    with raises_errno(errno.EINVAL):
        ns.readlink(f)
    with raises_errno(errno.EINVAL):
        ns.readlink(ROOT_INO)


def test_symlink_target_goes_with_purge(ns):
    s = ns.make_node(ROOT_INO, b"s", LNK, 0, 0, 0, NOW, target=b"x").ino
    ns.unlink(ROOT_INO, b"s", NOW, directory=False, busy=never_busy)
    with raises_errno(errno.EINVAL):
        ns.readlink(s)


def test_setattr(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    inode = ns.setattr(f, mode=0o4711, uid=12, gid=34, atime_ns=5, mtime_ns=6,
                       ctime_ns=NOW + 9)
    assert stat.S_IFMT(inode.mode) == stat.S_IFREG and stat.S_IMODE(inode.mode) == 0o4711
    assert (inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns, inode.ctime_ns) == (
        12, 34, 5, 6, NOW + 9)
    assert ns.get_inode(f) == inode
    # only the permission bits move; the file type never changes
    inode = ns.setattr(f, mode=stat.S_IFDIR | 0o700, ctime_ns=NOW + 10)
    assert stat.S_ISREG(inode.mode) and stat.S_IMODE(inode.mode) == 0o700
    assert (inode.uid, inode.mtime_ns) == (12, 6)


def test_make_node_attributes_and_parent_times(ns):
    later = NOW + 100
    inode = ns.make_node(ROOT_INO, b"fifo", stat.S_IFIFO | 0o600, 7, 8, 0, later)
    assert (inode.uid, inode.gid, inode.nlink, inode.size, inode.parent) == (
        7, 8, 1, 0, ROOT_INO)
    assert inode.atime_ns == inode.mtime_ns == inode.ctime_ns == later
    assert ns.get_inode(inode.ino) == inode
    root = ns.get_inode(ROOT_INO)
    assert root.mtime_ns == root.ctime_ns == later
    dev = ns.make_node(ROOT_INO, b"dev", stat.S_IFCHR | 0o600, 0, 0, 0x0103, later)
    assert ns.get_inode(dev.ino).rdev == 0x0103


def test_lookup_dot_and_dotdot(ns):
    a = mkdir(ns, ROOT_INO, b"a")
    b = mkdir(ns, a, b"b")
    assert ns.lookup(b, b".").ino == b
    assert ns.lookup(b, b"..").ino == a
    assert ns.lookup(ROOT_INO, b"..").ino == ROOT_INO


# --- xattrs -----------------------------------------------------------------------------------

def test_xattrs_set_get_list_remove(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    g = mkfile(ns, ROOT_INO, b"g")
    assert ns.list_xattrs(f) == [] and ns.xattr_bytes(f) == 0
    ns.set_xattr(f, b"user.b", b"2", NOW)
    ns.set_xattr(f, b"user.a", b"", NOW)
    ns.set_xattr(f, b"trusted.c", b"\x00\xff" * 100, NOW)
    ns.set_xattr(g, b"user.a", b"other", NOW)
    assert ns.get_xattr(f, b"user.a") == b""
    assert ns.get_xattr(f, b"user.b") == b"2"
    assert ns.get_xattr(f, b"trusted.c") == b"\x00\xff" * 100
    assert sorted(ns.list_xattrs(f)) == [b"trusted.c", b"user.a", b"user.b"]
    assert ns.xattr_bytes(f) == len(b"user.b") + 1 + len(b"user.a") + len(b"trusted.c") + 200
    ns.set_xattr(f, b"user.b", b"replaced", NOW + 1)
    assert ns.get_xattr(f, b"user.b") == b"replaced"
    assert ns.get_inode(f).ctime_ns == NOW + 1
    ns.remove_xattr(f, b"user.b", NOW + 2)
    assert ns.get_inode(f).ctime_ns == NOW + 2
    with raises_errno(errno.ENODATA):
        ns.get_xattr(f, b"user.b")
    with raises_errno(errno.ENODATA):
        ns.remove_xattr(f, b"user.b", NOW)
    assert sorted(ns.list_xattrs(f)) == [b"trusted.c", b"user.a"]
    assert ns.list_xattrs(g) == [b"user.a"] and ns.get_xattr(g, b"user.a") == b"other"


def test_xattr_errors(ns):
    f = mkfile(ns, ROOT_INO, b"f")
    with raises_errno(errno.ENODATA):
        ns.get_xattr(f, b"user.none")
    with raises_errno(errno.ENOENT):
        ns.set_xattr(31337, b"user.a", b"1", NOW)
    with raises_errno(errno.ENOENT):
        ns.remove_xattr(31337, b"user.a", NOW)
    # an xattr on a neighbour inode (prefix of the key space) is not visible
    g = mkfile(ns, ROOT_INO, b"g")
    ns.set_xattr(g, b"user.a", b"1", NOW)
    with raises_errno(errno.ENODATA):
        ns.get_xattr(f, b"user.a")


# --- persistence across reopen ----------------------------------------------------------------

def test_everything_survives_reopen(tmp_path):
    make_filesystem(tmp_path / "d")
    path = tmp_path / "d" / NAMESPACE_DIR
    ns = Namespace.open(path)
    a = mkdir(ns, ROOT_INO, b"a")
    f = mkfile(ns, a, b"f")
    ns.link(f, ROOT_INO, b"l", NOW)
    ns.set_xattr(f, b"user.k", b"v", NOW)
    rec = BlockRecord(ns.reserve("next_block_id"), ns.reserve("gs"), 42, (1, 3))
    ns.add_block(f, 7, rec)
    ns.unlink(ROOT_INO, b"l", NOW, directory=False, busy=never_busy)
    ns.persist_file(f, size=7 * 4096 + 42, mtime_ns=1, ctime_ns=2, atime_ns=3, blocks={})
    txid = ns.last_txid()
    ns.close()
    ns = Namespace.open(path, readonly=True)
    assert ns.last_txid() == txid
    assert names(ns, ROOT_INO) == {b"a": a}
    assert names(ns, a) == {b"f": f}
    inode = ns.get_inode(f)
    assert (inode.nlink, inode.size, inode.mtime_ns, inode.ctime_ns, inode.atime_ns) == (
        1, 7 * 4096 + 42, 1, 2, 3)
    assert ns.get_blocks(f) == {7: rec}
    assert ns.get_xattr(f, b"user.k") == b"v"
    ns.close()


def test_on_a_full_disk_only_removals_use_the_reserve(tmp_path):
    """Creates fill the namespace's disk until ENOSPC without touching the removal reserve
    (fs/space_reserve.py), and so do renames that leave a whiteout (they make a node) and
    failures that are not for want of room. Attribute changes may use half of it, however
    long they go on; removals of everything made still commit, taking from the rest. It is
    made whole again only once the disk has room for all of it."""
    with small_disk(tmp_path, "4m") as disk:
        make_filesystem(disk / "d", volumes=[VolumeSpec(StorageType.DISK, tmp_path / "v")])
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (1 << 20))
        namespace = Namespace.open(disk / "d" / NAMESPACE_DIR)
        reserve = namespace.space_reserve = SpaceReserve(namespace.path, size=1 << 20)

        def until_enospc(step) -> int:
            done = 0
            with pytest.raises(FsError) as caught:
                while True:
                    step(done)
                    done += 1
            assert caught.value.errno == errno.ENOSPC, caught.value
            return done

        def make(i: int) -> None:
            ino = mkfile(namespace, ROOT_INO, b"f%d" % i)
            namespace.set_xattr(ino, b"user.pad", b"x" * 2000, NOW)

        def corrupt(w) -> None:
            raise lmdb.CorruptedError("injected")

        try:
            assert reserve.refill() and reserve.held() == 1 << 20
            made = until_enospc(make)
            assert made > 100 and reserve.held() == 1 << 20
            until_enospc(lambda i: namespace.rename(
                ROOT_INO, b"f%d" % i, ROOT_INO, b"w%d" % i, RENAME_WHITEOUT, NOW,
                busy=never_busy, whiteout_owner=(0, 0)))
            assert reserve.held() == 1 << 20
            with pytest.raises(FsError):
                namespace.run(Op.RECOVER, (), corrupt)
            assert reserve.held() == 1 << 20
            until_enospc(lambda i: namespace.setattr(ROOT_INO, mode=stat.S_IFDIR | i % 0o777,
                                                     ctime_ns=NOW))
            assert reserve.held() == 1 << 19
            while rows := namespace.readdir(ROOT_INO, 0, 100):
                for row in rows:
                    namespace.unlink(ROOT_INO, row[1], NOW, directory=False, busy=never_busy)
            assert reserve.held() < 1 << 19
            assert not reserve.refill()   # the disk is still full: nothing taken back
            filler.unlink()
            assert reserve.refill() and reserve.held() == 1 << 20
        finally:
            namespace.close()


def test_a_full_namespace_disk_gives_enospc_not_eio(tmp_path):
    """LMDB reports a commit cut short by a full disk as EIO; the mount must answer ENOSPC
    (and log no I/O error), and what was committed stays readable."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    try:
        make_filesystem(disk / "d", volumes=[VolumeSpec(StorageType.DISK, tmp_path / "v")])
        namespace = Namespace.open(disk / "d" / NAMESPACE_DIR)
        try:
            made = 0
            with pytest.raises(FsError) as caught:
                for made in range(1_000_000):
                    ino = mkfile(namespace, ROOT_INO, b"f%d" % made)
                    namespace.set_xattr(ino, b"user.pad", b"x" * 2000, NOW)
            assert caught.value.errno == errno.ENOSPC, caught.value
            assert made > 100
            assert namespace.lookup(ROOT_INO, b"f1").ino
        finally:
            namespace.close()
    finally:
        subprocess.run(["umount", str(disk)], check=True)
