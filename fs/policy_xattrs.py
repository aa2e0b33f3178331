"""The ``user.tierfs.*`` xattr interface (DESIGN.md section 6): computed, never stored.

=============================  ==========  =================================================
name                           access      meaning
=============================  ==========  =================================================
user.tierfs.storage_policy     read/write  effective policy name; write sets it on the inode
                               /remove     and its subtree; remove: follow the parent again
user.tierfs.replication        read/write  effective replication, 1..number of volumes
                               /remove
user.tierfs.policy_source      read-only   where each value comes from (path or "default")
                                           and the TxID of the deciding operation
user.tierfs.placement          read-only   storage types of the replicas, per distinct
                                           combination: "DISK:1 x3; ARCHIVE:1 x1"
user.tierfs.satisfied          read-only   "yes", or what is pending and why
=============================  ==========  =================================================

The two writable names are listed by listxattr only where the inode's own explicit setting
decides its value, so ``cp -a`` and ``rsync -X`` carry explicit settings and nothing else.
Read-only names are not listed, and writing or removing them gives EPERM.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import Counter

from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.errors import FsError
from tierfs.fs.inherited import DEFAULT
from tierfs.fs.namespace import Namespace
from tierfs.fs.placement import beyond_reach, wanted_beyond_volumes
from tierfs.fs.resolver import ATTR_POLICY, ATTR_REPLICATION, Resolver
from tierfs.fs.times import now_ns
from tierfs.satisfier.policies import storage_type_summary
from tierfs.satisfier.summary import classify

PREFIX = b"user.tierfs."
POLICY = b"user.tierfs.storage_policy"
REPLICATION = b"user.tierfs.replication"
SOURCE = b"user.tierfs.policy_source"
PLACEMENT = b"user.tierfs.placement"
SATISFIED = b"user.tierfs.satisfied"
WRITABLE = {POLICY: ATTR_POLICY, REPLICATION: ATTR_REPLICATION}
READ_ONLY = (SOURCE, PLACEMENT, SATISFIED)


def is_policy_xattr(name: bytes) -> bool:
    return name in WRITABLE or name in READ_ONLY


class PolicyXattrs:
    """Answers the ``user.tierfs.*`` names from the namespace and the block map."""

    def __init__(self, ns: Namespace, resolver: Resolver, volumes: VolumeSet, blocks_of):
        self.ns = ns
        self.resolver = resolver
        self.volumes = volumes
        self.blocks_of = blocks_of  # ino -> {index: BlockRecord}, open files' view first

    # --- read ------------------------------------------------------------------------------

    def get(self, ino: int, name: bytes) -> bytes:
        if name == POLICY:
            return self.resolver.policy(ino).name.encode()
        if name == REPLICATION:
            return str(self.resolver.replication(ino)).encode()
        if name == SOURCE:
            return os.fsencode(self._source(ino))  # directory names need not be UTF-8
        if name == PLACEMENT:
            return self._placement(ino).encode()
        if name == SATISFIED:
            return self._satisfied(ino).encode()
        raise FsError(errno.ENODATA, "no such attribute")

    def listed(self, ino: int) -> list[bytes]:
        """The writable names whose value this inode's own explicit setting decides."""
        return [name for name, attr in WRITABLE.items()
                if self.resolver.resolve(ino, attr)[0].own_explicit]

    def _source(self, ino: int) -> str:
        parts = []
        for label, attr in (("storage_policy", ATTR_POLICY), ("replication", ATTR_REPLICATION)):
            resolved, inos = self.resolver.resolve(ino, attr)
            if resolved.source is None:
                parts.append(f"{label}: default")
            else:
                where = self.ns.path_of(inos[resolved.source])
                parts.append(f"{label}: {where} txid {resolved.txid}")
        return "; ".join(parts)

    def _replica_types(self, ino: int) -> list[tuple]:
        return [tuple(sorted(self.volumes.get(v).storage_type for v in rec.volumes))
                for _, rec in sorted(self.blocks_of(ino).items())]

    def _placement(self, ino: int) -> str:
        counts = Counter(self._replica_types(ino))
        if not counts:
            return "no blocks"
        return "; ".join(f"{storage_type_summary(types) or 'no replicas'} x{n}"
                         for types, n in sorted(counts.items()))

    def _satisfied(self, ino: int) -> str:
        """Files: compare every block's replicas with what the policy wants. Directories:
        whether a policy change of the subtree still waits for the satisfier."""
        inode = self.ns.get_inode(ino)
        if stat.S_ISDIR(inode.mode):
            chain = set(self.ns.parent_chain(ino))
            pending = [(txid, i) for txid, i, _ in self.ns.satisfier_entries() if i in chain]
            if pending:
                txid, root = pending[0]
                return (f"pending: placement change at txid {txid} on "
                        f"{self.ns.path_of(root)} waits for the satisfier")
            return "yes"
        policy, replication = self.resolver.placement(ino)
        blocks = self._replica_types(ino)
        verdicts = [classify(policy, replication, types) for types in blocks]
        lazy = sum(1 for types, v in zip(blocks, verdicts) if types and not v.persistent)
        wrong = [types for types, v in zip(blocks, verdicts) if v.persistent and not v.satisfied]
        under = sum(1 for v in verdicts if v.persistent and v.under_replicated)
        over = sum(1 for v in verdicts if v.over_replicated)
        if not (lazy or wrong or under or over):
            return "yes"
        n = len(blocks)
        reasons = []
        if wrong:
            want = storage_type_summary(policy.choose_storage_types(replication))
            never = wanted_beyond_volumes(policy, replication,
                                          (v.storage_type for v in self.volumes))
            reasons.append(f"{len(wrong)} of {n} blocks not placed as {policy.name} wants "
                           f"({want}; e.g. {storage_type_summary(wrong[0])})"
                           + (f": {never}" if never else ""))
        if lazy:
            reasons.append(f"{lazy} of {n} blocks only on RAM_DISK, awaiting the lazy writer")
        if under:
            why = beyond_reach(policy, replication, self.volumes) or "awaiting re-replication"
            reasons.append(f"{under} of {n} blocks have fewer than {replication} replicas, "
                           f"{why}")
        if over:
            reasons.append(f"{over} of {n} blocks have more than {replication} replicas")
        return "no: " + "; ".join(reasons)

    # --- write -----------------------------------------------------------------------------

    def set(self, ino: int, name: bytes, raw: bytes) -> None:
        if name in READ_ONLY:
            raise FsError(errno.EPERM, f"{name.decode()} is read-only")
        text = raw.decode(errors="replace").strip().rstrip("\x00").strip()
        if name == POLICY:
            value = self._policy_value(ino, text)
        else:
            value = self._replication_value(text)
        self.ns.set_inherited(ino, WRITABLE[name], value, now_ns())

    def remove(self, ino: int, name: bytes) -> None:
        if name in READ_ONLY:
            raise FsError(errno.EPERM, f"{name.decode()} is read-only")
        if name == POLICY:
            self._check_not_lazy_persist_file(ino)
        self.ns.set_inherited(ino, WRITABLE[name], None, now_ns())

    def _policy_value(self, ino: int, text: str) -> int:
        try:
            policy = self.resolver.suite.get(text)
        except ValueError:
            raise FsError(errno.EINVAL, f"Cannot find a block policy with the name {text}") \
                from None
        inode = self.ns.get_inode(ino)
        if not stat.S_ISDIR(inode.mode):
            if policy.copy_on_create_file:
                raise FsError(errno.EINVAL, f"Policy {policy.name} cannot be set after file "
                                            f"creation.")
            self._check_not_lazy_persist_file(ino)
        return policy.id

    def _check_not_lazy_persist_file(self, ino: int) -> None:
        inode = self.ns.get_inode(ino)
        if stat.S_ISDIR(inode.mode):
            return
        resolved, _ = self.resolver.resolve(ino, ATTR_POLICY)
        if resolved.source == 0 and resolved.value != DEFAULT and \
                self.resolver.suite.get(resolved.value).copy_on_create_file:
            raise FsError(errno.EINVAL, "Existing policy LAZY_PERSIST cannot be changed after "
                                        "file creation.")

    def _replication_value(self, text: str) -> int:
        limit = len(self.volumes)
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= limit:
            raise FsError(errno.EINVAL, f"replication must be an integer from 1 to {limit}")
        return int(text)
