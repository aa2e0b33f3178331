"""Inherited-xattr resolution against the seed's "magician" model (seed 000, TLA+ ``Xattr``).

The TLA+ module keeps, next to the real (actual) xattrs, the value a magician would give
each node: a set on a node writes the value into its whole subtree at once, a rename either
overwrites the moved subtree with the destination's value (rename-affected) or leaves it
alone (non-rename-affected). Its invariant ``Consistent`` says the value computed from the
stored ops equals the magician's value for every node, in every reachable state. The state
machine below ports that: random create/rename/delete/set/unset on a small tree, the
magician's values kept explicitly per node, ``resolve`` checked against them after every
step, for both rename modes. DESIGN.md section 6 extends the TLA+ with unset (the subtree
follows the parent from then on), a set on the root, and creation taking the parent's value
in both modes.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierfs.fs.inherited import (
    DEFAULT,
    INHERIT,
    Op,
    RenameMode,
    Resolved,
    op_for_create,
    op_for_rename,
    op_for_set,
    op_for_unset,
    resolve,
)

ROOT = "/"
FOLLOW, KEEP = RenameMode.FOLLOW, RenameMode.KEEP
BLUE, GREEN, RED = 1, 2, 3


class Tree:
    """A stand-in for the namespace: a tree of named nodes with at most one op each.

    It does what the namespace does with ``tierfs.fs.inherited``: one TxID per operation,
    the chain of ops from a node up to the root for every call, and the returned op stored
    (None deletes it). ``materialize_create`` stores, at creation, the op DESIGN.md section 6
    describes literally (a non-explicit set of the parent's current value with the creation
    TxID as rename barrier) instead of nothing, to check that both give the same values.
    """

    def __init__(self, mode: RenameMode, materialize_create: bool = False):
        self.mode = mode
        self.materialize_create = materialize_create
        self.parent: dict[str, str | None] = {ROOT: None}
        self.is_dir: dict[str, bool] = {ROOT: True}
        self.ops: dict[str, Op] = {}
        self.txid = 0

    def _next_txid(self) -> int:
        self.txid += 1
        return self.txid

    def path(self, node: str) -> list[str]:
        """The node and its ancestors, up to the root."""
        out = [node]
        while self.parent[out[-1]] is not None:
            out.append(self.parent[out[-1]])  # type: ignore[arg-type]
        return out

    def chain(self, node: str) -> list[Op | None]:
        return [self.ops.get(x) for x in self.path(node)]

    def subtree(self, node: str) -> list[str]:
        return [x for x in self.parent if node in self.path(x)]

    def _store(self, node: str, op: Op | None) -> None:
        if op is None:
            self.ops.pop(node, None)
        else:
            assert Op.from_bytes(op.to_bytes()) == op
            self.ops[node] = op

    def create(self, parent: str, node: str, directory: bool = True) -> None:
        assert self.is_dir[parent] and node not in self.parent
        txid = self._next_txid()
        op = op_for_create(self.chain(parent), txid, self.mode)
        if self.materialize_create:
            op = Op(self.resolve(parent).value, (txid,), txid, False)
        self.parent[node] = parent
        self.is_dir[node] = directory
        self._store(node, op)

    def rename(self, node: str, new_parent: str) -> None:
        assert node != ROOT and self.is_dir[new_parent] and node not in self.path(new_parent)
        txid = self._next_txid()
        op = op_for_rename(self.chain(node), self.chain(new_parent), txid, self.mode)
        self.parent[node] = new_parent
        self._store(node, op)

    def delete(self, node: str) -> None:
        assert node != ROOT
        self._next_txid()
        for x in self.subtree(node):
            del self.parent[x], self.is_dir[x]
            self.ops.pop(x, None)

    def set(self, node: str, value: int) -> None:
        self._store(node, op_for_set(self.chain(node), value, self._next_txid(), self.mode))

    def unset(self, node: str) -> None:
        self._store(node, op_for_unset(self.chain(node), self._next_txid(), self.mode))

    def resolve(self, node: str) -> Resolved:
        return resolve(self.chain(node), self.mode)

    def value(self, node: str) -> int:
        return self.resolve(node).value


class MagicianMachine(RuleBasedStateMachine):
    """Random operations on a Tree, checked against the magician's values after every step.

    The model is the TLA+ ``exp*Xattr``: ``expected[n]`` is the value the magician gave n,
    ``explicit[n]`` whether the most recent operation that gave it was a user's set on n
    itself (what listxattr shows), ``source[n]`` the node ``user.tierfs.policy_source``
    names (None for the default): the node set, the source of the parent it follows after an
    unset or a rename-affected rename, or the moved node itself once a non-rename-affected
    rename froze the value there. Subclasses fix the rename mode.
    """

    MODE: RenameMode = FOLLOW
    MATERIALIZE_CREATE = False
    MAX_NODES = 8  # besides the root

    def __init__(self) -> None:
        super().__init__()
        self.tree = Tree(self.MODE, self.MATERIALIZE_CREATE)
        self.expected: dict[str, int] = {ROOT: DEFAULT}
        self.explicit: dict[str, bool] = {ROOT: False}
        self.source: dict[str, str | None] = {ROOT: None}
        self.names = 0

    # --- helpers ---------------------------------------------------------------------

    def _pick(self, data, nodes) -> str:
        return data.draw(st.sampled_from(sorted(nodes)))

    def _assign(self, node: str, value: int, source: str | None) -> None:
        """The magician: ``value`` goes to the whole subtree; nobody below keeps its own set."""
        for x in self.tree.subtree(node):
            self.expected[x] = value
            self.explicit[x] = False
            self.source[x] = source if value != DEFAULT else None

    # --- rules -----------------------------------------------------------------------

    @precondition(lambda self: len(self.tree.parent) <= self.MAX_NODES)
    @rule(data=st.data(), directory=st.booleans())
    def create(self, data, directory):
        parent = self._pick(data, [n for n, d in self.tree.is_dir.items() if d])
        self.names += 1
        node = f"{'d' if directory else 'f'}{self.names}"
        self.tree.create(parent, node, directory)
        self.expected[node] = self.expected[parent]
        self.explicit[node] = False
        self.source[node] = self.source[parent]

    @precondition(lambda self: len(self.tree.parent) > 1)
    @rule(data=st.data())
    def rename(self, data):
        node = self._pick(data, [n for n in self.tree.parent if n != ROOT])
        moved = set(self.tree.subtree(node))
        targets = [n for n, d in self.tree.is_dir.items() if d and n not in moved]
        new_parent = self._pick(data, targets)
        self.tree.rename(node, new_parent)
        if self.MODE is FOLLOW:
            self._assign(node, self.expected[new_parent], self.source[new_parent])
        else:
            for x in moved:
                if self.source[x] is not None and self.source[x] not in moved:
                    self.source[x] = node

    @precondition(lambda self: len(self.tree.parent) > 1)
    @rule(data=st.data())
    def delete(self, data):
        node = self._pick(data, [n for n in self.tree.parent if n != ROOT])
        for x in self.tree.subtree(node):
            del self.expected[x], self.explicit[x], self.source[x]
        self.tree.delete(node)

    @rule(data=st.data(), value=st.integers(BLUE, RED))
    def set(self, data, value):
        node = self._pick(data, self.tree.parent)
        self.tree.set(node, value)
        self._assign(node, value, node)
        self.explicit[node] = True

    @rule(data=st.data())
    def unset(self, data):
        node = self._pick(data, self.tree.parent)
        self.tree.unset(node)
        parent = self.tree.parent[node]
        if parent is None:
            self._assign(node, DEFAULT, None)
        else:
            self._assign(node, self.expected[parent], self.source[parent])

    # --- the TLA+ invariant ``Consistent``, plus what listxattr and policy_source need --

    @invariant()
    def consistent(self):
        for node in self.tree.parent:
            got = self.tree.resolve(node)
            assert got.value == self.expected[node], (node, got, self.tree.ops)
            assert got.own_explicit == self.explicit[node], (node, got, self.tree.ops)
            path = self.tree.path(node)
            if got.value == DEFAULT:
                assert (got.source, got.txid) == (None, 0)
            else:
                source_op = self.tree.ops[path[got.source]]
                assert source_op.value == got.value and source_op.order[0] == got.txid
            if not self.MATERIALIZE_CREATE:  # there a new node is its own source
                source = None if got.source is None else path[got.source]
                assert source == self.source[node], (node, got, self.tree.ops)
            assert got.value != INHERIT


def machine(mode: RenameMode, materialize_create: bool = False):
    name = f"Magician{mode.name.title()}{'Materialized' if materialize_create else ''}"
    return type(name, (MagicianMachine,), {"MODE": mode, "MATERIALIZE_CREATE": materialize_create})


SETTINGS = settings(max_examples=300, stateful_step_count=40, deadline=None)

TestMagicianFollow = SETTINGS(machine(FOLLOW)).TestCase
TestMagicianKeep = SETTINGS(machine(KEEP)).TestCase
TestMagicianKeepMaterializedCreate = SETTINGS(machine(KEEP, True)).TestCase
TestMagicianFollowMaterializedCreate = settings(SETTINGS, max_examples=100)(
    machine(FOLLOW, True)).TestCase


# --- hand-written regressions: the seed's examples ----------------------------------------

def build(mode: RenameMode, *dirs: str, materialize_create: bool = False) -> Tree:
    """A tree from paths like 'a', 'a/c', 'a/c/d'; a node is named by its last component."""
    tree = Tree(mode, materialize_create)
    for path in dirs:
        parts = path.split("/")
        tree.create(parts[-2] if len(parts) > 1 else ROOT, parts[-1])
    return tree


@pytest.mark.parametrize("mode", [FOLLOW, KEEP])
def test_child_set_then_parent_set(mode):
    """The seed's motivating example: [1] set /a/b HOT, [2] set /a ALL_SSD.

    HDFS leaves /a/b/c on HOT; the magician (and tierfs) gives ALL_SSD to all of /a.
    """
    hot, all_ssd = 7, 12
    tree = build(mode, "a", "a/b", "a/b/c")
    tree.set("b", hot)
    assert [tree.value(n) for n in "abc"] == [DEFAULT, hot, hot]
    tree.set("a", all_ssd)
    assert [tree.value(n) for n in "abc"] == [all_ssd] * 3
    assert tree.resolve("c").source == 2  # /a, seen from /a/b/c
    assert not tree.resolve("b").own_explicit and tree.resolve("a").own_explicit


@pytest.mark.parametrize("materialize", [False, True])
def test_rename_affected_illustration(materialize):
    """Seed 000, first figure: /a set blue at TxID 1, then d renamed under /a takes blue."""
    tree = build(FOLLOW, "a", "a/b", "a/c", "x", "x/d", "x/d/e", materialize_create=materialize)
    tree.set("e", GREEN)
    tree.set("a", BLUE)
    assert [tree.value(n) for n in ("a", "b", "c")] == [BLUE] * 3
    tree.rename("d", "c")
    assert tree.value("d") == tree.value("e") == BLUE
    res = tree.resolve("e")
    assert tree.path("e")[res.source] == "a"  # policy_source names /a, not the renamed d
    tree.set("c", RED)
    assert tree.value("e") == RED


@pytest.mark.parametrize("materialize", [False, True])
def test_non_rename_affected_graph_1(materialize):
    """Seed 000, Graph 1: who is influenced by the parent depends on rename vs set order.

    e is renamed under c *before* c's set, so c's set reaches it; d is renamed under c
    *after* c's set, so it keeps its own value; once e is set itself, c no longer decides.
    """
    tree = build(KEEP, "a", "a/c", "b", "b/d", "b/e", materialize_create=materialize)
    tree.set("b", BLUE)
    tree.rename("e", "c")
    assert tree.value("e") == BLUE and tree.value("c") == DEFAULT
    tree.set("c", GREEN)
    assert tree.value("e") == GREEN
    tree.rename("d", "c")
    assert tree.value("d") == BLUE and tree.value("e") == GREEN
    tree.set("e", RED)
    assert [tree.value(n) for n in ("c", "d", "e")] == [GREEN, BLUE, RED]
    assert tree.resolve("e").own_explicit and not tree.resolve("d").own_explicit
    tree.set("a", BLUE)  # a later set above reaches everyone below, whatever was renamed
    assert [tree.value(n) for n in ("c", "d", "e")] == [BLUE] * 3


@pytest.mark.parametrize("materialize", [False, True])
def test_non_rename_affected_graph_2(materialize):
    """Seed 000, Graph 2: a renamed d takes the value *and the TxID* that decided it.

    e set at 2, c set at 3, f set at 4: e follows c (blue), f keeps its own. When d is
    renamed away, its frozen order must lie between e's and f's, which only "directly after
    c's set" gives; then e stays blue and f stays green.
    """
    tree = build(KEEP, "c", "c/d", "c/d/e", "c/d/f", "x", materialize_create=materialize)
    tree.set("e", RED)
    t_e = tree.txid
    tree.set("c", BLUE)
    t_c = tree.txid
    tree.set("f", GREEN)
    t_f = tree.txid
    tree.set("x", RED)
    tree.rename("d", "x")
    assert [tree.value(n) for n in ("d", "e", "f")] == [BLUE, BLUE, GREEN]
    frozen = tree.ops["d"]
    assert frozen.value == BLUE and frozen.order == (t_c, -tree.txid) and not frozen.explicit
    assert (t_e,) < frozen.order < (t_f,)
    assert tree.resolve("e").txid == t_c  # policy_source: the TxID of the set on c
    tree.set("x", GREEN)
    assert [tree.value(n) for n in ("d", "e", "f")] == [GREEN] * 3


def test_graph_2_rename_affected():
    """The same operations with rename-affected xattrs: the moved subtree takes x's value."""
    tree = build(FOLLOW, "c", "c/d", "c/d/e", "c/d/f", "x")
    for node, value in (("e", RED), ("c", BLUE), ("f", GREEN), ("x", RED)):
        tree.set(node, value)
    tree.rename("d", "x")
    assert [tree.value(n) for n in ("d", "e", "f")] == [RED] * 3
    assert not tree.resolve("f").own_explicit


def test_keep_reinsertions_after_the_same_op_stay_ordered():
    """Two subtrees frozen after the same op keep the TLA+ ``Reinsert`` order between them.

    d1 and then d2 are frozen directly after c's set; the later one sorts closer to it, as
    ``Reinsert`` puts it directly after c's event, before d1's. Moving d2 under d1 then
    keeps everybody's value, and a later set on d1 reaches the whole of d1.
    """
    tree = build(KEEP, "c", "c/d1", "c/d2", "c/d2/g", "x", "y")
    tree.set("c", BLUE)
    tree.set("g", GREEN)
    tree.rename("d1", "x")
    tree.rename("d2", "y")
    assert tree.ops["d2"].order < tree.ops["d1"].order
    tree.rename("d2", "d1")
    assert [tree.value(n) for n in ("d1", "d2", "g")] == [BLUE, BLUE, GREEN]
    tree.set("d1", RED)
    assert [tree.value(n) for n in ("d1", "d2", "g")] == [RED, RED, RED]


@pytest.mark.parametrize("mode", [FOLLOW, KEEP])
def test_unset_follows_the_parent_from_now_on(mode):
    tree = build(mode, "a", "a/b", "a/b/c")
    tree.set("a", BLUE)
    tree.set("c", GREEN)
    tree.set("b", RED)
    tree.set("c", GREEN)
    tree.unset("b")  # the whole of b takes a's value, c's own set included
    assert [tree.value(n) for n in "abc"] == [BLUE] * 3
    assert tree.path("c")[tree.resolve("c").source] == "a"
    tree.set("a", RED)
    assert [tree.value(n) for n in "abc"] == [RED] * 3
    tree.unset("a")
    tree.unset(ROOT)
    assert [tree.value(n) for n in "abc"] == [DEFAULT] * 3
    tree.set(ROOT, GREEN)  # a set on the mount root applies to everything
    assert [tree.value(n) for n in "abc"] == [GREEN] * 3


def test_keep_rename_freezes_an_unset_node():
    tree = build(KEEP, "a", "a/b", "a/b/c", "x")
    tree.set("a", BLUE)
    tree.set("c", GREEN)
    tree.unset("b")
    tree.rename("b", "x")
    assert tree.ops["b"].value == BLUE  # concrete: b no longer follows anyone
    assert [tree.value(n) for n in ("b", "c")] == [BLUE, BLUE]
    tree.set("x", RED)
    assert [tree.value(n) for n in ("b", "c")] == [RED, RED]


def test_keep_rename_of_default_node_stays_default():
    tree = build(KEEP, "a", "a/b", "x")
    tree.set("x", BLUE)
    tree.rename("b", "x")
    assert tree.value("b") == DEFAULT
    assert tree.resolve("b") == Resolved(DEFAULT, None, 0, False)
    assert tree.ops["b"].order == (-tree.txid,)


def test_keep_rename_keeps_an_own_explicit_set():
    tree = build(KEEP, "a", "a/b", "x")
    tree.set("b", GREEN)
    before = tree.ops["b"]
    tree.rename("b", "x")
    after = tree.ops["b"]
    assert (after.value, after.order, after.explicit) == (GREEN, before.order, True)
    assert after.rename == tree.txid
    assert tree.resolve("b").own_explicit


def test_op_bytes_round_trip_and_rejects_garbage():
    for op in (Op(7, (1,)), Op(INHERIT, (2**40,), 2**40), Op(DEFAULT, (-9,), 9),
               Op(12, (3, -8, -11), 11, False), Op(1, (5,), 4, True)):
        assert Op.from_bytes(op.to_bytes()) == op
    for raw in (b"", b"\x00", Op(7, (1,)).to_bytes() + b"\x00", Op(7, (1, 2)).to_bytes()[:-1]):
        with pytest.raises(ValueError):
            Op.from_bytes(raw)


def test_bad_ops_and_txids_are_refused():
    with pytest.raises(ValueError):
        Op(INHERIT, (1,), 0, True)  # only a concrete value is explicit
    with pytest.raises(ValueError):
        Op(7, ())
    with pytest.raises(ValueError):
        op_for_set([None], DEFAULT, 1, KEEP)
    with pytest.raises(ValueError):
        op_for_set([Op(7, (5,))], 3, 5, KEEP)  # TxIDs must grow
    with pytest.raises(ValueError):
        op_for_rename([None, None], [Op(7, (9,), 9)], 8, FOLLOW)


def test_a_deep_chain_of_nested_unsets():
    """Each unset decides in turn (newest lowest): the value comes from the very top."""
    depth = 2000
    chain: list[Op | None] = [Op(INHERIT, (depth - i + 1,)) for i in range(depth)]
    chain.append(Op(BLUE, (1,)))
    assert resolve(chain, FOLLOW) == Resolved(BLUE, depth, 1, False)
    assert resolve(chain, KEEP).value == BLUE
