"""Effective inherited values of an inode: storage policy and replication factor.

Reads the chain of TxID-ordered ops from the inode up to the root (one read transaction,
O(depth)) and resolves it with ``tierfs.fs.inherited``. The filesystem defaults (mkfs
``--default-policy`` and ``--replication``) apply where nothing is set.
"""

from __future__ import annotations

from tierfs.fs.inherited import DEFAULT, Op, RenameMode, Resolved, resolve
from tierfs.fs.namespace import Namespace
from tierfs.fs.placement import Placement
from tierfs.fs.schema import Inherited
from tierfs.satisfier.policies import BlockStoragePolicy, PolicySuite

ATTR_POLICY = Inherited.POLICY
ATTR_REPLICATION = Inherited.REPLICATION


class Resolver:
    def __init__(self, ns: Namespace):
        self.ns = ns
        self.suite = PolicySuite(ns.config.default_policy)
        self.mode = RenameMode(ns.config.rename_mode)

    def chain(self, ino: int, attr: int) -> tuple[list[int], list[Op | None]]:
        inos, raw = self.ns.inherited_chain(ino, attr)
        return inos, _ops(raw)

    def resolve(self, ino: int, attr: int) -> tuple[Resolved, list[int]]:
        """The effective value; a file's copy-on-create stamp (LAZY_PERSIST) always wins, as
        a policy in an HDFS file header does."""
        inos, ops = self.chain(ino, attr)
        return self._resolved(ino, attr, ops), inos

    def _resolved(self, ino: int, attr: int, ops: list[Op | None]) -> Resolved:
        if attr == ATTR_POLICY:
            stamp = self.ns.policy_stamp(ino)
            if stamp is not None:
                return Resolved(stamp.value, 0, stamp.order[0], False)
        return resolve(ops, self.mode)

    def policy(self, ino: int) -> BlockStoragePolicy:
        return self._policy(self.resolve(ino, ATTR_POLICY)[0].value)

    def replication(self, ino: int) -> int:
        return self._replication(self.resolve(ino, ATTR_REPLICATION)[0].value)

    def resolve_many(self, ino: int, attrs: tuple[int, ...]) -> list[Resolved]:
        """``resolve``'s values for several attributes, from one walk up the tree."""
        _, raw = self.ns.inherited_chains(ino, attrs)
        return [self._resolved(ino, attr, _ops(chain)) for attr, chain in zip(attrs, raw)]

    def placement(self, ino: int) -> Placement:
        """Policy and replication, from one walk up the tree."""
        policy, replication = self.resolve_many(ino, (ATTR_POLICY, ATTR_REPLICATION))
        return self._policy(policy.value), self._replication(replication.value)

    def _policy(self, value: int) -> BlockStoragePolicy:
        return self.suite.default if value == DEFAULT else self.suite.get(value)

    def _replication(self, value: int) -> int:
        return self.ns.config.replication if value == DEFAULT else value


def _ops(raw: list[bytes | None]) -> list[Op | None]:
    return [None if r is None else Op.from_bytes(r) for r in raw]
