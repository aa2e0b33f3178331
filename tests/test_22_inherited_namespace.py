"""Seed 000's "magician" model against the real namespace, for both inherited xattrs.

``test_12_inherited`` checks the pure resolver against the TLA+ model on a dict store. This
machine drives the real LMDB ``Namespace`` (create, mkdir, rename, delete, set and unset of
the storage policy and of the replication factor, in both rename modes) and compares every
inode's value as the ``Resolver`` computes it with the magician's expectation after every
step. It covers what the pure test cannot: the ops the namespace stores at each mutation
(including the rename fast path for files), the parent pointers it walks, purges.

The magician: a set on a node gives the value to its whole subtree at that moment; an unset
gives the subtree the parent's current value and makes it follow from then on; a new inode
takes its parent's value; a rename gives the moved subtree the destination's value
(rename-affected, the default) or leaves it unchanged (``--policy-on-rename keep``).
"""

from __future__ import annotations

import stat
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tierfs.fs.errors import FsError
from tierfs.fs.inherited import DEFAULT, RenameMode
from tierfs.fs.namespace import Namespace
from tierfs.fs.resolver import Resolver
from tierfs.fs.schema import ROOT_INO, Inherited
from tierfs.tools.mkfs import make_filesystem

ATTRS = (Inherited.POLICY, Inherited.REPLICATION)
VALUES = st.integers(min_value=1, max_value=3)
FILE, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


def machine_for(mode: RenameMode):
    class Machine(RuleBasedStateMachine):
        """The namespace (system) and the magician (model) side by side."""

        @initialize()
        def start(self):
            path = self.workdir / f"fs{time.perf_counter_ns()}"
            make_filesystem(path, rename_mode=mode.value)
            self.ns = Namespace.open(path / "namespace")
            self.resolver = Resolver(self.ns)
            self.parent = {ROOT_INO: None}
            self.names = {ROOT_INO: b""}
            self.is_dir = {ROOT_INO: True}
            self.expected = {(ROOT_INO, a): DEFAULT for a in ATTRS}
            self.serial = 0

        def teardown(self):
            if hasattr(self, "ns"):
                self.ns.close()

        # --- model helpers ---------------------------------------------------------------

        def subtree(self, node):
            out = [node]
            for n in list(self.parent):
                p = self.parent[n]
                while p is not None:
                    if p == node:
                        out.append(n)
                        break
                    p = self.parent[p]
            return out

        def nodes(self):
            return sorted(self.parent)

        def dirs(self):
            return [n for n in self.nodes() if self.is_dir[n]]

        def children(self, node):
            return [n for n, p in self.parent.items() if p == node]

        def fresh_name(self):
            self.serial += 1
            return b"n%d" % self.serial

        # --- rules ----------------------------------------------------------------------

        @rule(data=st.data(), directory=st.booleans())
        def create(self, data, directory):
            parent = data.draw(st.sampled_from(self.dirs()))
            name = self.fresh_name()
            inode = self.ns.make_node(parent, name, DIR if directory else FILE, 0, 0, 0,
                                      time.time_ns())
            self.parent[inode.ino] = parent
            self.names[inode.ino] = name
            self.is_dir[inode.ino] = directory
            for a in ATTRS:
                self.expected[(inode.ino, a)] = self.expected[(parent, a)]

        @rule(data=st.data(), attr=st.sampled_from(ATTRS), value=VALUES)
        def set_value(self, data, attr, value):
            node = data.draw(st.sampled_from(self.nodes()))
            self.ns.set_inherited(node, attr, value, time.time_ns())
            for n in self.subtree(node):
                self.expected[(n, attr)] = value

        @rule(data=st.data(), attr=st.sampled_from(ATTRS))
        def unset(self, data, attr):
            node = data.draw(st.sampled_from(self.nodes()))
            self.ns.set_inherited(node, attr, None, time.time_ns())
            above = self.expected[(self.parent[node], attr)] if node != ROOT_INO else DEFAULT
            for n in self.subtree(node):
                self.expected[(n, attr)] = above

        @precondition(lambda self: len(self.parent) > 1)
        @rule(data=st.data(), same_name=st.booleans())
        def rename(self, data, same_name):
            node = data.draw(st.sampled_from([n for n in self.nodes() if n != ROOT_INO]))
            inside = set(self.subtree(node))
            target = data.draw(st.sampled_from([d for d in self.dirs() if d not in inside]))
            new_name = self.names[node] if same_name and target == self.parent[node] \
                else self.fresh_name()
            if new_name == self.names[node] and target == self.parent[node]:
                return  # rename onto itself: nothing happens
            self.ns.rename(self.parent[node], self.names[node], target, new_name, 0,
                           time.time_ns(), busy=lambda ino: False)
            self.parent[node] = target
            self.names[node] = new_name
            if mode is RenameMode.FOLLOW:
                for a in ATTRS:
                    for n in inside:
                        self.expected[(n, a)] = self.expected[(target, a)]

        @precondition(lambda self: len(self.parent) > 1)
        @rule(data=st.data())
        def delete(self, data):
            node = data.draw(st.sampled_from([n for n in self.nodes() if n != ROOT_INO]))
            for n in sorted(self.subtree(node), key=self.depth, reverse=True):
                self.ns.unlink(self.parent[n], self.names[n], time.time_ns(),
                               directory=self.is_dir[n], busy=lambda ino: False)
                del self.parent[n], self.names[n], self.is_dir[n]
                for a in ATTRS:
                    del self.expected[(n, a)]

        def depth(self, node):
            d = 0
            while self.parent[node] is not None:
                node, d = self.parent[node], d + 1
            return d

        # --- the invariant ----------------------------------------------------------------

        @invariant()
        def every_value_is_the_magicians(self):
            if not hasattr(self, "ns"):
                return
            for node in self.nodes():
                for a in ATTRS:
                    got = self.resolver.resolve(node, a)[0].value
                    assert got == self.expected[(node, a)], (
                        f"inode {node} attr {a}: namespace says {got}, magician says "
                        f"{self.expected[(node, a)]}")

        @invariant()
        def one_walk_for_both_attributes_gives_the_magicians_values(self):
            """``resolve_many``, placement's single walk up the tree."""
            if not hasattr(self, "ns"):
                return
            for node in self.nodes():
                got = [r.value for r in self.resolver.resolve_many(node, ATTRS)]
                assert got == [self.expected[(node, a)] for a in ATTRS], f"inode {node}"

        @invariant()
        def deleted_inodes_are_gone(self):
            if not hasattr(self, "ns"):
                return
            assert self.ns.counts()["inodes"] == len(self.parent)

    Machine.__name__ = f"Magician{mode.name.title()}"
    return Machine


@pytest.mark.parametrize("mode", list(RenameMode), ids=lambda m: m.value)
def test_namespace_matches_the_magician(mode, tmp_path):
    machine = machine_for(mode)
    machine.workdir = tmp_path
    runner = machine.TestCase
    runner.settings = settings(max_examples=60, stateful_step_count=35, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.filter_too_much])
    runner().runTest()


def test_purged_inode_leaves_no_ops(tmp_path):
    """Ops of a deleted inode are removed with it (a later inode never inherits them)."""
    make_filesystem(tmp_path / "d")
    ns = Namespace.open(tmp_path / "d" / "namespace")
    ino = ns.make_node(ROOT_INO, b"f", FILE, 0, 0, 0, 1).ino
    ns.set_inherited(ino, Inherited.POLICY, 2, 1)
    ns.unlink(ROOT_INO, b"f", 1, directory=False, busy=lambda i: False)
    with ns.env.begin() as txn:
        assert txn.stat(ns.db["inherited"])["entries"] == 0
    with pytest.raises(FsError):
        ns.get_inode(ino)
