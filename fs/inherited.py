"""Inherited xattrs (storage policy, replication) resolved from TxID-ordered operations.

The semantics are seed 000's "magician": an inode's value is decided by the most recent
operation applied to it or to an ancestor, where an operation on a directory applies to its
whole subtree *at that moment*. Setting a value is O(1): the namespace stores one :class:`Op`
for the inode (at most one per inode and attribute) and never visits the descendants.
Resolving is O(depth): the namespace hands :func:`resolve` the ops of the inode and of its
ancestors up to the root, and the answer follows from their ordering keys alone.

Operations and how each is stored (``txid`` is the operation's TxID):

set (``op_for_set``)
    ``Op(value, (txid,), rename, explicit=True)``: later than everything in the subtree, so
    it wins over any older op below it and loses to any newer op above it.
unset (``op_for_unset``)
    ``Op(INHERIT, (txid,), ...)``: from now on the node and its subtree follow the parent. An
    INHERIT op that decides makes the value the parent's *current* value, which is what the
    magician gives: the subtree took the parent's value at ``txid``, and every later change
    of the parent's value came from an op above, which also applies to the subtree.
create (``op_for_create``)
    Nothing is stored, in both modes. An inode without an op resolves exactly like its
    parent, and in the magician model a new inode keeps its parent's value until an op on
    the inode itself (set, unset, rename): every other event that changes the parent's value
    is an op on the parent or above, which applies to the new inode too. So "a set of the
    parent's value at creation" (DESIGN.md section 6) and "no op" give the same value at
    every later moment; storing nothing saves a write per create and lets
    ``user.tierfs.policy_source`` name the directory the value really comes from.
rename, ``RenameMode.FOLLOW`` (rename-affected, the default)
    ``Op(INHERIT, (txid,), txid)``: the seed's proof treats a rename as a set of the
    destination's value at the rename TxID; an INHERIT op has that value and keeps the
    destination as the reported source. The value of a node is then decided by the op with
    the greatest order among the node and its ancestors.
rename, ``RenameMode.KEEP`` (``mkfs --policy-on-rename keep``)
    The TLA+ module ``Xattr`` of seed 000, ported: see "KEEP mode" below.

KEEP mode. Each op also records ``rename``, the TxID of the node's latest rename: an
ancestor's op older than a rename on the path cannot have been applied to the moved subtree
(it happened while the subtree was elsewhere). The TLA+ ``GetNonRenXattrModID`` walks from
the node up, comparing each ancestor's setxattr position with the node's own setxattr and
with the latest rename seen on the path so far; an ancestor's op applies when it is newer
than both. At a rename the TLA+ model freezes the moved node: it stores the value that
currently decides it and moves the node's setxattr event to directly after the deciding
event in the global order (``Reinsert``; its Assert checks "directly after"). That position
is exactly right for every descendant: one whose value came from at or above the moved node
(the same deciding event, by monotonicity of the walk) still finds the frozen op newer than
everything on its own path below, and one whose value came from below still finds it older,
because nothing lies between the deciding event and the frozen op.

Ordering keys. The TLA+ keeps one global sequence of events; tierfs keeps integer TxIDs and
compares ``order`` tuples lexicographically. A new event (set, unset) gets ``(txid,)``,
later than every existing key since TxIDs only grow. "Directly after the key X" at TxID
``t`` is ``X + (-t,)``: it sorts after X (a longer tuple with X as prefix), before every key
that was already after X (those differ from X at an earlier position with a larger element,
or are ``X + (-t',)...`` with ``t' < t``, i.e. earlier reinsertions after X, which the TLA+
``Reinsert`` also leaves after the newer one), and before every later ``(txid,)``. So
nothing, present or future, can fall between X and the new key. "Directly after nothing"
(no op decides, the value is the filesystem default) is ``(-t,)``: the empty tuple is the
origin, older than every real key. Rename events are ``(rename,)``, appended at their TxID.
Keys grow by one element per reinsertion *after a reinserted op*, i.e. with nested renames of
subtrees that are themselves frozen; a node whose own op decides keeps its key unchanged.

Unset in KEEP mode is an INHERIT op as in FOLLOW mode; a later rename of such a node
freezes the concrete value, like any other rename.

Resolution in one pass. With ``key(op) = max(order, (rename,))`` in KEEP mode (``order``
alone in FOLLOW mode, where renames are ops of their own), an ancestor's op at index ``i``
reaches the inode at index ``j`` when its order is greater than ``key`` of every op on
``chain[j:i]``; the deciding op is the root-most op that reaches. (For FOLLOW this is the
op with the greatest order; for KEEP it is the TLA+ walk, whose running maximum
``max(setXattrID, renameID)`` is exactly the greatest key seen so far.) :func:`_decide`
keeps the reaching ops on a stack while it walks from the root down, so every level costs
amortised O(1), and it remembers each level's value, which an INHERIT op needs: when an
INHERIT op at index ``u`` decides, the value is that of ``chain[u + 1]``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

#: The value of an op that makes its node (and subtree) follow the parent from now on.
INHERIT = -1
#: The concrete value "nothing set anywhere": the filesystem default applies.
DEFAULT = 0

_FORMAT_VERSION = 1


class RenameMode(enum.Enum):
    """What a rename does to the moved subtree's values (chosen at mkfs, fixed after)."""

    #: Rename-affected (the default): the moved subtree takes the destination's value.
    FOLLOW = "follow"
    #: Non-rename-affected (``--policy-on-rename keep``): the moved subtree keeps its values.
    KEEP = "keep"


@dataclass(frozen=True)
class Op:
    """The one stored operation of an inode for one inherited attribute.

    ``value`` is INHERIT, DEFAULT or a concrete value (> 0: a policy id or a replication
    factor). ``order`` places the op among all others (compared as a tuple, see the module
    docstring). ``rename`` is the TxID of the node's latest rename (0 if none), the KEEP mode
    barrier. ``explicit`` is True only for a user's own set: listxattr shows the name only
    where the inode's own explicit op decides, so ``cp -a`` carries explicit settings only.
    """

    value: int
    order: tuple[int, ...]
    rename: int = 0
    explicit: bool = False

    def __post_init__(self) -> None:
        # A malformed op would silently resolve to a wrong policy; refuse it at once.
        if not isinstance(self.value, int) or self.value < INHERIT:
            raise ValueError(f"bad inherited value {self.value!r}")
        if not isinstance(self.order, tuple) or not self.order \
                or not all(isinstance(x, int) for x in self.order):
            raise ValueError(f"an op's order must be a non-empty tuple of ints, not {self.order!r}")
        if not isinstance(self.rename, int) or self.rename < 0:
            raise ValueError(f"bad rename TxID {self.rename!r}")
        if self.explicit and self.value <= DEFAULT:
            raise ValueError("only a concrete value can be explicitly set")

    @property
    def last_txid(self) -> int:
        """The newest TxID this op mentions: its own set's, or the rename that froze it."""
        return max(self.order[0], self.rename)

    def to_bytes(self) -> bytes:
        """Compact form for an LMDB value: a header byte, then varints.

        Header: format version << 1 | explicit. Then zigzag(value), rename,
        len(order), zigzag(order[i])...: about a dozen bytes for TxIDs in the millions.
        """
        out = bytearray([(_FORMAT_VERSION << 1) | int(self.explicit)])
        _put_varint(out, _zigzag(self.value))
        _put_varint(out, self.rename)
        _put_varint(out, len(self.order))
        for x in self.order:
            _put_varint(out, _zigzag(x))
        return bytes(out)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Op:
        """Parse :meth:`to_bytes`; ValueError for anything else (a corrupt record)."""
        raw = bytes(raw)
        if not raw or raw[0] >> 1 != _FORMAT_VERSION:
            raise ValueError(f"not an inherited-xattr op: {raw!r}")
        pos = 1
        value, pos = _get_varint(raw, pos)
        rename, pos = _get_varint(raw, pos)
        length, pos = _get_varint(raw, pos)
        order = []
        for _ in range(length):
            x, pos = _get_varint(raw, pos)
            order.append(_unzigzag(x))
        if pos != len(raw):
            raise ValueError(f"trailing bytes in an inherited-xattr op: {raw!r}")
        return cls(_unzigzag(value), tuple(order), rename, bool(raw[0] & 1))


@dataclass(frozen=True)
class Resolved:
    """The effective value of an inode and where it comes from.

    ``value`` is never INHERIT; DEFAULT means the filesystem default applies, and then
    ``source`` is None and ``txid`` 0. Otherwise ``source`` is the index in the chain of
    the node whose op decided (0 = the inode itself) and ``txid`` that op's ``order[0]``
    (for a value frozen by a KEEP mode rename, the TxID of the op it was frozen from).
    ``own_explicit`` is True when the inode's own explicit set decides (listxattr).
    """

    value: int
    source: int | None
    txid: int
    own_explicit: bool = False


_NOTHING = Resolved(DEFAULT, None, 0, False)


def resolve(chain: Sequence[Op | None], mode: RenameMode) -> Resolved:
    """The effective value of ``chain[0]``; ``chain`` holds the ops from it up to the root.

    ``chain[i]`` is None for a node without an op; ``chain[-1]`` is the root's. O(depth).
    """
    _, res = _decide(chain, mode)
    if res.source == 0 and chain[0] is not None and chain[0].explicit:
        return Resolved(res.value, res.source, res.txid, True)
    return res


def op_for_set(chain: Sequence[Op | None], value: int, txid: int, mode: RenameMode) -> Op:
    """The op a user's set of ``value`` on ``chain[0]`` stores: it and its subtree take it.

    The node's rename barrier is kept (it no longer changes any answer, since the new order
    is later than the rename, but it stays the record of the node's latest rename).
    """
    if value <= DEFAULT:
        raise ValueError(f"a set needs a concrete value (> 0), not {value}")
    _check_txid(txid, chain)
    return Op(value, (txid,), _rename_of(chain), explicit=True)


def op_for_unset(chain: Sequence[Op | None], txid: int, mode: RenameMode) -> Op:
    """The op an unset on ``chain[0]`` stores: from now on its subtree follows the parent.

    An op is stored even if the node had none: it must override the older ops of the
    descendants, which the magician replaces with the parent's value too.
    """
    _check_txid(txid, chain)
    return Op(INHERIT, (txid,), _rename_of(chain))


def op_for_create(parent_chain: Sequence[Op | None], txid: int, mode: RenameMode) -> Op | None:
    """What to store for a new inode under ``parent_chain[0]``: always nothing (None).

    A node without an op takes its parent's value now and follows it until an op on the
    node itself, which is what "creation is a set of the parent's value" means in both modes
    (module docstring, "create").
    """
    _check_txid(txid, parent_chain)
    return None


def op_for_rename(old_chain: Sequence[Op | None], new_parent_chain: Sequence[Op | None],
                  txid: int, mode: RenameMode) -> Op | None:
    """The moved inode's new op (``old_chain`` is its chain before the move).

    The ops of the descendants never change. FOLLOW: an INHERIT op at the rename TxID, so
    the whole moved subtree takes the destination's value. KEEP: the value that decides the
    node now, concrete (an INHERIT op that decides is frozen to the value it gives), at an
    order directly after the deciding op, so the whole moved subtree keeps its values; the
    node's own deciding op keeps its order and explicitness. Both modes always return an Op;
    ``new_parent_chain`` only takes part in the TxID check.
    """
    _check_txid(txid, old_chain)
    _check_txid(txid, new_parent_chain)
    if mode is RenameMode.FOLLOW:
        return Op(INHERIT, (txid,), txid)
    winner, res = _decide(old_chain, mode)
    if winner is None:
        order: tuple[int, ...] = (-txid,)
    elif winner == 0:
        order = old_chain[0].order  # type: ignore[union-attr]
    else:
        order = old_chain[winner].order + (-txid,)  # type: ignore[union-attr]
    own = old_chain[0]
    explicit = winner == 0 and own is not None and own.explicit
    return Op(res.value, order, txid, explicit)


def _decide(chain: Sequence[Op | None], mode: RenameMode) -> tuple[int | None, Resolved]:
    """(index of the op that decides ``chain[0]`` or None, the resolved value).

    The returned index is the deciding op before any INHERIT is followed: the one a KEEP
    rename must place the frozen op directly after. See "Resolution in one pass" in the
    module docstring for why the stack holds exactly the ops that reach the current level.
    """
    keep = mode is RenameMode.KEEP
    reaching: list[int] = []  # chain indices, root-most first; orders decrease along the list
    value_at: list[Resolved] = [_NOTHING] * (len(chain) + 1)  # value_at[len] = above the root
    for i in range(len(chain) - 1, -1, -1):
        op = chain[i]
        if op is not None:
            key = max(op.order, (op.rename,)) if keep and op.rename else op.order
            while reaching and chain[reaching[-1]].order <= key:  # type: ignore[union-attr]
                reaching.pop()
            reaching.append(i)
        if not reaching:
            value_at[i] = _NOTHING
            continue
        winner = chain[reaching[0]]
        assert winner is not None
        if winner.value == INHERIT:
            value_at[i] = value_at[reaching[0] + 1]
        elif winner.value == DEFAULT:
            value_at[i] = _NOTHING
        else:
            value_at[i] = Resolved(winner.value, reaching[0], winner.order[0])
    return (reaching[0] if reaching else None), value_at[0]


def _rename_of(chain: Sequence[Op | None]) -> int:
    own = chain[0] if chain else None
    return own.rename if own is not None else 0


def _check_txid(txid: int, chain: Sequence[Op | None]) -> None:
    """TxIDs must grow: an op not newer than what it overrides would be silently ignored."""
    if not isinstance(txid, int) or txid <= 0:
        raise ValueError(f"bad TxID {txid!r}")
    newest = max((op.last_txid for op in chain if op is not None), default=0)
    if txid <= newest:
        raise ValueError(f"TxID {txid} is not newer than TxID {newest} already in the chain")


def _zigzag(n: int) -> int:
    return 2 * n if n >= 0 else -2 * n - 1


def _unzigzag(n: int) -> int:
    return n >> 1 if not n & 1 else -((n + 1) >> 1)


def _put_varint(out: bytearray, n: int) -> None:
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _get_varint(raw: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(raw) or shift > 70:
            raise ValueError(f"truncated varint in an inherited-xattr op: {raw!r}")
        byte = raw[pos]
        pos += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return n, pos
