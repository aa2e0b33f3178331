"""The namespace against a plain dict model of a tree (Hypothesis stateful testing).

A ``RuleBasedStateMachine`` drives a real ``Namespace`` on a fresh LMDB environment and a
model side by side: a dict of directories (name -> inode), the kind, permission bits and
symlink target of every inode, the orphan set and the TxID. Each rule predicts the errno
(or success) from the model and checks the namespace agrees; after every step the invariants
compare the whole tree (paths, inode numbers, types), every nlink, every readdir listing,
the parent chains, the orphans and the TxID.

The TxID contract checked here is the one ``Namespace._mutate`` implements: a successful
mutation takes exactly one TxID and one journal record; a failed one aborts its transaction,
so it takes none and leaves the namespace unchanged.
"""

from __future__ import annotations

import errno
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tierfs.fs import schema
from tierfs.fs.errors import FsError
from tierfs.fs.namespace import (RENAME_EXCHANGE, RENAME_NOREPLACE, RENAME_WHITEOUT, FsConfig,
                                 Namespace)
from tierfs.fs.schema import ROOT_INO, Inherited, Inode

NAMES = [b"a", b"b", b"c", b"d", b"e"]
NOW = 1_700_000_000_000_000_000
DIR, FILE, LINK, WHITEOUT = "dir", "file", "symlink", "whiteout"
MODE_TYPE = {DIR: stat.S_IFDIR, FILE: stat.S_IFREG, LINK: stat.S_IFLNK, WHITEOUT: stat.S_IFCHR}
FLAGS = [0, RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_NOREPLACE | RENAME_EXCHANGE,
         RENAME_WHITEOUT, RENAME_WHITEOUT | RENAME_NOREPLACE, RENAME_WHITEOUT | RENAME_EXCHANGE]

names_st = st.sampled_from(NAMES)
perm_st = st.integers(0, 0o7777)


class NamespaceModel(RuleBasedStateMachine):
    rename_mode = "follow"

    def __init__(self):
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="tierfs-model-"))
        config = FsConfig(fs_uuid=str(uuid.uuid4()), block_size=1 << 20,
                          bytes_per_checksum=4096, replication=1, default_policy="HOT",
                          rename_mode=self.rename_mode)
        self.ns = Namespace.create(self.tmp / "ns", config, uid=0, gid=0, now_ns=NOW,
                                   root_mode=0o755)
        # the model
        self.children: dict[int, dict[bytes, int]] = {ROOT_INO: {}}
        self.kind: dict[int, str] = {ROOT_INO: DIR}
        self.perm: dict[int, int] = {ROOT_INO: 0o755}
        self.target: dict[int, bytes] = {}
        self.dir_parent: dict[int, int] = {ROOT_INO: ROOT_INO}
        self.orphans: set[int] = set()
        # readdir cookies seen so far per (directory, name), and the largest ever seen per
        # directory: a name keeps its cookie until it is removed or renamed (an exchange
        # keeps both), a new name gets a cookie above every earlier one
        self.cookie: dict[tuple[int, bytes], int] = {}
        self.max_cookie: dict[int, int] = {}
        self.purged: set[int] = set()
        self.txid = self.ns.last_txid()
        self.max_ino = ROOT_INO
        self.now = NOW

    def teardown(self):
        self.ns.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # --- model helpers ------------------------------------------------------------------------

    def _tick(self) -> int:
        self.now += 1
        return self.now

    def _dirs(self) -> list[int]:
        return sorted(self.children)

    def _in_subtree(self, top: int, ino: int) -> bool:
        """Is directory ``ino`` equal to ``top`` or below it?"""
        while True:
            if ino == top:
                return True
            if ino == ROOT_INO:
                return False
            ino = self.dir_parent[ino]

    def _dentries_of(self, ino: int) -> list[tuple[int, bytes]]:
        return [(d, n) for d, entries in self.children.items()
                for n, c in entries.items() if c == ino]

    def _nlink(self, ino: int) -> int:
        if ino in self.orphans:
            return 0
        if self.kind[ino] == DIR:
            return 2 + sum(self.kind[c] == DIR for c in self.children[ino].values())
        return len(self._dentries_of(ino))

    def _forget_inode(self, ino: int) -> None:
        for table in (self.kind, self.perm, self.target):
            table.pop(ino, None)
        self.children.pop(ino, None)
        self.dir_parent.pop(ino, None)
        self.orphans.discard(ino)
        self.purged.add(ino)

    def _drop_dentry(self, parent: int, name: bytes) -> None:
        del self.children[parent][name]
        self.cookie.pop((parent, name), None)

    def _lost_last_link(self, ino: int, busy: bool) -> None:
        if self.kind[ino] == DIR:
            self.children.pop(ino)
            self.dir_parent.pop(ino)
        if busy:
            self.orphans.add(ino)
        else:
            self._forget_inode(ino)

    def _expect(self, err: int | None, call):
        """Run a mutation; check the errno the model predicts and the TxID it takes."""
        before = self.ns.last_txid()
        assert before == self.txid
        if err is None:
            result = call()
            self.txid += 1
            assert self.ns.last_txid() == self.txid
            return result
        try:
            call()
        except FsError as exc:
            assert exc.errno == err, (
                f"expected {errno.errorcode[err]}, got {errno.errorcode.get(exc.errno)}: {exc}")
        else:
            raise AssertionError(f"expected {errno.errorcode[err]}, the call succeeded")
        assert self.ns.last_txid() == before, "a failed mutation took a TxID"
        return None

    def _new_node(self, parent: int, name: bytes, kind: str, perm: int,
                  target: bytes | None = None) -> None:
        err = errno.EEXIST if name in self.children[parent] else None
        mode = MODE_TYPE[kind] | perm
        inode = self._expect(err, lambda: self.ns.make_node(parent, name, mode, 0, 0, 0,
                                                            self._tick(), target))
        if inode is None:
            return
        assert inode.ino > self.max_ino, "inode number reused or not increasing"
        self.max_ino = inode.ino
        self.children[parent][name] = inode.ino
        self.kind[inode.ino] = kind
        self.perm[inode.ino] = perm
        if kind == DIR:
            self.children[inode.ino] = {}
            self.dir_parent[inode.ino] = parent
        if target is not None:
            self.target[inode.ino] = target

    # --- rules --------------------------------------------------------------------------------

    @initialize(shape=st.lists(st.tuples(st.sampled_from([DIR, FILE, LINK]), names_st,
                                         st.integers(0, 20)), max_size=8))
    def start_tree(self, shape):
        """A few nodes to start from, so that most steps act on an existing tree."""
        for kind, name, where in shape:
            dirs = self._dirs()
            self._new_node(dirs[where % len(dirs)], name, kind, 0o755,
                           b"target" if kind == LINK else None)


    @rule(data=st.data(), name=names_st, perm=perm_st)
    def mkdir(self, data, name, perm):
        parent = data.draw(st.sampled_from(self._dirs()), label="parent")
        self._new_node(parent, name, DIR, perm)

    @rule(data=st.data(), name=names_st, perm=perm_st)
    def create_file(self, data, name, perm):
        parent = data.draw(st.sampled_from(self._dirs()), label="parent")
        self._new_node(parent, name, FILE, perm)

    @rule(data=st.data(), name=names_st, link_target=st.binary(min_size=1, max_size=40))
    def symlink(self, data, name, link_target):
        parent = data.draw(st.sampled_from(self._dirs()), label="parent")
        self._new_node(parent, name, LINK, 0o777, link_target)

    def _entries(self, kind: str | None = None) -> list[tuple[int, bytes]]:
        return sorted((d, n) for d, es in self.children.items() for n, c in es.items()
                      if kind is None or self.kind[c] == kind)

    def _link(self, ino: int, parent: int, name: bytes) -> None:
        if self.kind[ino] == DIR:
            err = errno.EPERM
        elif ino in self.orphans:
            err = errno.ENOENT
        elif name in self.children[parent]:
            err = errno.EEXIST
        else:
            err = None
        inode = self._expect(err, lambda: self.ns.link(ino, parent, name, self._tick()))
        if inode is not None:
            assert inode.ino == ino
            self.children[parent][name] = ino
            assert inode.nlink == self._nlink(ino)

    @rule(data=st.data(), name=names_st)
    def hard_link(self, data, name):
        """Mostly files and symlinks (orphans included); now and then a directory (EPERM)."""
        others = sorted(i for i, k in self.kind.items() if k != DIR)
        some_dir = data.draw(st.sampled_from(self._dirs()), label="a directory")
        ino = data.draw(st.sampled_from(others + [some_dir]), label="inode")
        parent = data.draw(st.sampled_from(self._dirs()), label="parent")
        self._link(ino, parent, name)

    def _unlink(self, parent: int, name: bytes, busy: bool) -> None:
        child = self.children[parent].get(name)
        if child is None:
            err = errno.ENOENT
        elif self.kind[child] == DIR:
            err = errno.EISDIR
        else:
            err = None
        got = self._expect(err, lambda: self.ns.unlink(parent, name, self._tick(),
                                                        directory=False,
                                                        busy=lambda ino: busy))
        if err is None:
            assert got == child
            self._drop_dentry(parent, name)
            if not self._dentries_of(child):
                self._lost_last_link(child, busy)

    @rule(data=st.data(), name=names_st, busy=st.booleans())
    def unlink(self, data, name, busy):
        parent = data.draw(st.sampled_from(self._dirs()), label="parent")
        self._unlink(parent, name, busy)

    @precondition(lambda self: any(self.children.values()))
    @rule(data=st.data(), busy=st.booleans())
    def unlink_entry(self, data, busy):
        parent, name = data.draw(st.sampled_from(self._entries()), label="entry")
        self._unlink(parent, name, busy)

    def _rmdir(self, parent: int, name: bytes, busy: bool) -> None:
        child = self.children[parent].get(name)
        if child is None:
            err = errno.ENOENT
        elif self.kind[child] != DIR:
            err = errno.ENOTDIR
        elif self.children[child]:
            err = errno.ENOTEMPTY
        else:
            err = None
        got = self._expect(err, lambda: self.ns.unlink(parent, name, self._tick(),
                                                        directory=True,
                                                        busy=lambda ino: busy))
        if err is None:
            assert got == child
            self._drop_dentry(parent, name)
            self._lost_last_link(child, busy)

    @rule(data=st.data(), name=names_st, busy=st.booleans())
    def rmdir(self, data, name, busy):
        parent = data.draw(st.sampled_from(self._dirs()), label="parent")
        self._rmdir(parent, name, busy)

    @precondition(lambda self: len(self.children) > 1)
    @rule(data=st.data(), busy=st.booleans())
    def rmdir_entry(self, data, busy):
        parent, name = data.draw(st.sampled_from(self._entries(DIR)), label="entry")
        self._rmdir(parent, name, busy)

    def _predict_rename(self, old_parent, old_name, new_parent, new_name, flags):
        noreplace = bool(flags & RENAME_NOREPLACE)
        exchange = bool(flags & RENAME_EXCHANGE)
        if exchange and (noreplace or flags & RENAME_WHITEOUT):
            return errno.EINVAL
        src = self.children[old_parent].get(old_name)
        if src is None:
            return errno.ENOENT
        dst = self.children[new_parent].get(new_name)
        if self.kind[src] == DIR and self._in_subtree(src, new_parent):
            return errno.EINVAL
        if exchange:
            if dst is None:
                return errno.ENOENT
            if self.kind[dst] == DIR and self._in_subtree(dst, old_parent):
                return errno.EINVAL
            return None
        if dst is not None and noreplace:
            return errno.EEXIST
        if dst is None or dst == src:
            return None
        if self.kind[src] == DIR:
            if self.kind[dst] != DIR:
                return errno.ENOTDIR
            if self.children[dst]:
                return errno.ENOTEMPTY
        elif self.kind[dst] == DIR:
            return errno.EISDIR
        return None

    def _rename(self, old_parent, old_name, new_parent, new_name, flags, busy):
        err = self._predict_rename(old_parent, old_name, new_parent, new_name, flags)
        got = self._expect(err, lambda: self.ns.rename(old_parent, old_name, new_parent,
                                                        new_name, flags, self._tick(),
                                                        busy=lambda ino: busy,
                                                        whiteout_owner=(0, 0)))
        if err is not None:
            return err
        src = self.children[old_parent][old_name]
        dst = self.children[new_parent].get(new_name)
        if flags & RENAME_EXCHANGE:
            assert got is None
            self.children[old_parent][old_name] = dst
            self.children[new_parent][new_name] = src
            if self.kind[src] == DIR:
                self.dir_parent[src] = new_parent
            if self.kind[dst] == DIR:
                self.dir_parent[dst] = old_parent
            return None
        if dst == src:
            assert got is None
            return None
        assert got == dst
        self._drop_dentry(old_parent, old_name)
        self.cookie.pop((new_parent, new_name), None)
        self.children[new_parent][new_name] = src
        if self.kind[src] == DIR:
            self.dir_parent[src] = new_parent
        if flags & RENAME_WHITEOUT:  # a new node at the old name, in the same transaction
            whiteout = self.ns.lookup(old_parent, old_name)
            assert whiteout.ino > self.max_ino, "inode number reused or not increasing"
            assert (whiteout.rdev, whiteout.uid, whiteout.gid) == (0, 0, 0)
            self.max_ino = whiteout.ino
            self.children[old_parent][old_name] = whiteout.ino
            self.kind[whiteout.ino] = WHITEOUT
            self.perm[whiteout.ino] = 0
        if dst is not None and not self._dentries_of(dst):
            self._lost_last_link(dst, busy)
        return None

    @rule(data=st.data(), old_name=names_st, new_name=names_st,
          flags=st.sampled_from(FLAGS), busy=st.booleans())
    def rename(self, data, old_name, new_name, flags, busy):
        old_parent = data.draw(st.sampled_from(self._dirs()), label="old_parent")
        new_parent = data.draw(st.sampled_from(self._dirs()), label="new_parent")
        self._rename(old_parent, old_name, new_parent, new_name, flags, busy)

    @precondition(lambda self: any(self.children.values()))
    @rule(data=st.data(), flags=st.sampled_from(FLAGS), new_name=names_st,
          busy=st.booleans())
    def rename_entry(self, data, flags, new_name, busy):
        """An existing entry to anywhere, so that moves happen often."""
        old_parent, old_name = data.draw(st.sampled_from(self._entries()), label="source")
        new_parent = data.draw(st.sampled_from(self._dirs()), label="new_parent")
        self._rename(old_parent, old_name, new_parent, new_name, flags, busy)

    @precondition(lambda self: any(self.children.values()))
    @rule(data=st.data(), flags=st.sampled_from(FLAGS), busy=st.booleans())
    def rename_onto_entry(self, data, flags, busy):
        """An existing entry onto another existing one: replace, exchange, no-op, errors."""
        entries = self._entries()
        old_parent, old_name = data.draw(st.sampled_from(entries), label="source")
        new_parent, new_name = data.draw(st.sampled_from(entries), label="target")
        self._rename(old_parent, old_name, new_parent, new_name, flags, busy)

    @precondition(lambda self: len(self.children) > 1)
    @rule(data=st.data(), new_name=names_st, flags=st.sampled_from([0, RENAME_NOREPLACE,
                                                                   RENAME_EXCHANGE]))
    def rename_into_own_subtree(self, data, new_name, flags):
        moved = data.draw(st.sampled_from([d for d in self._dirs() if d != ROOT_INO]),
                          label="moved")
        below = [d for d in self._dirs() if self._in_subtree(moved, d)]
        target = data.draw(st.sampled_from(below), label="target")
        old_parent = self.dir_parent[moved]
        old_name = next(n for n, c in self.children[old_parent].items() if c == moved)
        if flags & RENAME_EXCHANGE and new_name not in self.children[target]:
            flags = 0  # an exchange with nothing would be ENOENT before EINVAL matters
        err = self._rename(old_parent, old_name, target, new_name, flags, False)
        assert err == errno.EINVAL

    @rule(data=st.data(), perm=perm_st)
    def setattr_mode(self, data, perm):
        live = sorted(set(self.kind) - self.orphans)
        ino = data.draw(st.sampled_from(live + [self.max_ino + 1]), label="inode")
        err = None if ino in self.kind else errno.ENOENT
        inode = self._expect(err, lambda: self.ns.setattr(ino, mode=perm,
                                                          ctime_ns=self._tick()))
        if err is None:
            self.perm[ino] = perm
            assert inode.mode == MODE_TYPE[self.kind[ino]] | perm

    @rule(data=st.data(), value=st.one_of(st.none(), st.integers(1, 3)))
    def set_inherited(self, data, value):
        """Inherited-xattr ops change which code path a rename takes; the tree stays."""
        live = sorted(set(self.kind) - self.orphans)
        ino = data.draw(st.sampled_from(live + [self.max_ino + 1]), label="inode")
        err = None if ino in self.kind else errno.ENOENT
        self._expect(err, lambda: self.ns.set_inherited(ino, Inherited.REPLICATION, value,
                                                        self._tick()))

    @precondition(lambda self: self.orphans)
    @rule(data=st.data())
    def purge_orphan(self, data):
        ino = data.draw(st.sampled_from(sorted(self.orphans)), label="orphan")
        self._expect(None, lambda: self.ns.purge(ino))
        self._forget_inode(ino)

    # --- invariants ---------------------------------------------------------------------------

    def _listing(self, ino: int) -> list[tuple[int, bytes, Inode]]:
        """(cookie, name, inode) per entry, the inode as readdir's row carries it."""
        return [(cookie, name, Inode(child, *fields))
                for cookie, name, child, fields in self.ns.readdir(ino, 0, 1 << 20)]

    @invariant()
    def tree_matches(self):
        def walk_ns(ino, prefix, out):
            for _, name, inode in self._listing(ino):
                path = prefix + b"/" + name
                out[path] = (inode.ino, stat.S_IFMT(inode.mode))
                if stat.S_ISDIR(inode.mode):
                    walk_ns(inode.ino, path, out)
            return out

        def walk_model(ino, prefix, out):
            for name, child in self.children[ino].items():
                path = prefix + b"/" + name
                out[path] = (child, MODE_TYPE[self.kind[child]])
                if self.kind[child] == DIR:
                    walk_model(child, path, out)
            return out

        assert walk_ns(ROOT_INO, b"", {}) == walk_model(ROOT_INO, b"", {})

    @invariant()
    def readdir_matches_every_directory(self):
        for d, entries in self.children.items():
            listing = self._listing(d)
            assert sorted(name for _, name, _ in listing) == sorted(entries)
            cookies = [cookie for cookie, _, _ in listing]
            assert cookies == sorted(set(cookies))
            for cookie, name, _ in listing:
                known = self.cookie.get((d, name))
                if known is None:
                    assert cookie > self.max_cookie.get(d, 0), (
                        f"new entry {name!r} in {d} reuses an old cookie")
                    self.cookie[d, name] = cookie
                    self.max_cookie[d] = cookie
                else:
                    assert cookie == known, f"{name!r} in {d} changed cookie"
            for _, name, inode in listing:
                assert inode.ino == entries[name]
                assert inode == self.ns.get_inode(inode.ino), "readdir's attributes are stale"
            # lookup agrees with readdir, also for names that are not there
            for name in NAMES:
                if name in entries:
                    assert self.ns.lookup(d, name).ino == entries[name]
                else:
                    try:
                        self.ns.lookup(d, name)
                    except FsError as exc:
                        assert exc.errno == errno.ENOENT
                    else:
                        raise AssertionError(f"lookup found removed {name!r} in {d}")

    @invariant()
    def inodes_match(self):
        for ino, kind in self.kind.items():
            inode = self.ns.get_inode(ino)
            assert inode.nlink == self._nlink(ino), (ino, kind)
            assert inode.mode == MODE_TYPE[kind] | self.perm[ino]
            if kind == LINK:
                assert self.ns.readlink(ino) == self.target[ino]
        for ino in self.purged:
            try:
                self.ns.get_inode(ino)
            except FsError as exc:
                assert exc.errno == errno.ENOENT
            else:
                raise AssertionError(f"purged inode {ino} still exists")
        assert sorted(self.ns.orphans()) == sorted(self.orphans)
        assert self.ns.counts()["inodes"] == len(self.kind)

    @invariant()
    def parent_chains_consistent(self):
        for ino, kind in self.kind.items():
            if ino in self.orphans:
                continue
            chain = self.ns.parent_chain(ino)
            assert chain[0] == ino and chain[-1] == ROOT_INO
            if kind == DIR:
                expected = [ino]
                while expected[-1] != ROOT_INO:
                    expected.append(self.dir_parent[expected[-1]])
                assert chain == expected
            else:
                holders = {d for d, _ in self._dentries_of(ino)}
                assert chain[1] in holders, (ino, chain, holders)
                assert chain[1:] == self.ns.parent_chain(chain[1])

    @invariant()
    def txid_and_journal(self):
        assert self.ns.last_txid() == self.txid
        with self.ns.env.begin() as txn:
            keys = [schema.read_u64(k) for k in
                    txn.cursor(db=self.ns.db["journal"]).iternext(values=False)]
        assert keys == list(range(1, self.txid + 1))


class KeepModeNamespaceModel(NamespaceModel):
    """The same in the non-rename-affected mode, where renames take the other code path."""

    rename_mode = "keep"


SETTINGS = settings(max_examples=125, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
NamespaceModel.TestCase.settings = SETTINGS
KeepModeNamespaceModel.TestCase.settings = SETTINGS
TestNamespaceModel = NamespaceModel.TestCase
TestKeepModeNamespaceModel = KeepModeNamespaceModel.TestCase
