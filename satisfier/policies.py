"""The HDFS block storage policy suite, as pure values and functions.

A policy says which storage types the replicas of a block should sit on. The suite, the
policy ids and names, their storage types and fallbacks, and the placement algorithm
(``chooseStorageTypes`` and ``chooseExcess``) are HDFS's, so that a user who knows
``hdfs storagepolicies`` meets the same answers here (reference, sections 1 and 2; source:
``BlockStoragePolicy.java`` and ``BlockStoragePolicySuite.createDefaultSuite``).

Nothing here touches the namespace or a volume: which policy applies to an inode is decided by
``tierfs.fs.inherited``; which volume of a type gets a replica is the volume set's business.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from tierfs.backends.storage_types import StorageType

_RAM_DISK = StorageType.RAM_DISK
_NVDIMM = StorageType.NVDIMM
_SSD = StorageType.SSD
_DISK = StorageType.DISK
_ARCHIVE = StorageType.ARCHIVE
_PROVIDED = StorageType.PROVIDED

#: Policy id 0 means "unspecified": the effective policy is the parent's, or the default.
UNSPECIFIED_ID = 0


@dataclass(frozen=True)
class BlockStoragePolicy:
    """One block storage policy: an immutable value with pure placement functions.

    ``storage_types`` lists the wanted type per replica for a new block, in order; the last
    one repeats for any further replicas. ``creation_fallbacks`` stand in for an unavailable
    type when a new block is written, ``replication_fallbacks`` when a replica is re-created
    or moved. ``copy_on_create_file`` (LAZY_PERSIST only) makes a new file record the policy
    itself instead of inheriting it.
    """

    id: int
    name: str
    storage_types: tuple[StorageType, ...]
    creation_fallbacks: tuple[StorageType, ...]
    replication_fallbacks: tuple[StorageType, ...]
    copy_on_create_file: bool = False

    def _wanted(self, replication: int) -> list[StorageType]:
        """HDFS ``chooseStorageTypes(n)``: the types for ``replication`` replicas.

        Transient types (RAM_DISK) are never asked for, because the NameNode has no reliable
        usage figures for them; LAZY_PERSIST therefore asks for DISK and the writer may try
        RAM_DISK first on its own. The last listed type repeats for the extra replicas unless
        it is transient.
        """
        out = [t for t in self.storage_types if not t.transient][:max(replication, 0)]
        last = self.storage_types[-1]
        if not last.transient:
            out.extend([last] * (replication - len(out)))
        return out

    def choose_storage_types(self, replication: int, chosen: Sequence[StorageType] = (),
                             unavailable: Collection[StorageType] = (),
                             is_new_block: bool = False) -> list[StorageType]:
        """The storage types still to place, given the replicas that already exist.

        This is HDFS's ``chooseStorageTypes`` in its three forms: ``(n)`` with the defaults,
        ``(n, chosen)``, and ``(n, chosen, unavailable, isNewBlock)``. With nothing
        unavailable the last form equals the second (an unmatched existing replica can never
        be in the remaining list), so one method serves all three.

        Each existing replica cancels one wanted slot of its type; those that match nothing
        are "excess". Going backwards through the remaining slots, every slot whose type is
        unavailable gets the *first* available fallback (creation fallbacks for a new block,
        replication fallbacks otherwise) or is dropped when there is none; then each excess
        replica cancels one slot of its type, since a wrong-type replica can stand in for a
        fallback. The caller sees a shortfall as fewer types than it needs (HDFS logs "Failed
        to place enough replicas"); nothing is logged here, this module is pure.
        """
        types = self._wanted(replication)
        excess: list[StorageType] = []
        _diff(types, chosen, excess)
        fallbacks = self.creation_fallbacks if is_new_block else self.replication_fallbacks
        fallback = next((f for f in fallbacks if f not in unavailable), None)
        for i in range(len(types) - 1, -1, -1):
            if types[i] in unavailable:
                if fallback is None:
                    del types[i]
                else:
                    types[i] = fallback
        _diff(types, excess, None)
        return types

    def choose_excess(self, replication: int, chosen: Sequence[StorageType]) -> list[StorageType]:
        """HDFS ``chooseExcess``: the types of existing replicas that the policy does not want.

        Used when a block has too many replicas, or replicas on the wrong tier once the
        wanted ones exist: these are the ones to delete.
        """
        excess: list[StorageType] = []
        _diff(self._wanted(replication), chosen, excess)
        return excess

    def __str__(self) -> str:
        """The text ``hdfs storagepolicies -listPolicies`` prints (Java's ``toString``)."""
        return (f"BlockStoragePolicy{{{self.name}:{self.id}, "
                f"storageTypes={_java_list(self.storage_types)}, "
                f"creationFallbacks={_java_list(self.creation_fallbacks)}, "
                f"replicationFallbacks={_java_list(self.replication_fallbacks)}}}")


def _diff(wanted: list[StorageType], chosen: Iterable[StorageType],
          excess: list[StorageType] | None) -> None:
    """Multiset difference in place: ``wanted -= chosen``; unmatched ``chosen`` go to ``excess``.

    Order matters and is HDFS's: each chosen type removes the first equal entry of
    ``wanted``, and ``excess`` keeps the order in which unmatched types came.
    """
    for t in chosen:
        if t in wanted:
            wanted.remove(t)
        elif excess is not None:
            excess.append(t)


def _java_list(types: Iterable[StorageType]) -> str:
    return "[" + ", ".join(t.name for t in types) + "]"


#: The built-in suite, in HDFS's table (reference section 1, which is authoritative).
BUILTIN_POLICIES: tuple[BlockStoragePolicy, ...] = (
    BlockStoragePolicy(1, "PROVIDED", (_PROVIDED, _DISK), (_PROVIDED, _DISK), (_PROVIDED, _DISK)),
    BlockStoragePolicy(2, "COLD", (_ARCHIVE,), (), ()),
    BlockStoragePolicy(5, "WARM", (_DISK, _ARCHIVE), (_DISK, _ARCHIVE), (_DISK, _ARCHIVE)),
    BlockStoragePolicy(7, "HOT", (_DISK,), (), (_ARCHIVE,)),
    BlockStoragePolicy(10, "ONE_SSD", (_SSD, _DISK), (_SSD, _DISK), (_SSD, _DISK)),
    BlockStoragePolicy(12, "ALL_SSD", (_SSD,), (_DISK,), (_DISK,)),
    BlockStoragePolicy(14, "ALL_NVDIMM", (_NVDIMM,), (_DISK,), (_DISK,)),
    BlockStoragePolicy(15, "LAZY_PERSIST", (_RAM_DISK, _DISK), (_DISK,), (_DISK,),
                       copy_on_create_file=True),
)


class PolicySuite:
    """The built-in policies, looked up by name or id, with a chosen default.

    The default (HOT unless mkfs chose another) is what id 0, "unspecified", means: HDFS's
    ``getPolicy(0)`` returns it, and an inode with no policy anywhere above it gets it.
    """

    def __init__(self, default_name: str = "HOT"):
        self._by_id = {p.id: p for p in BUILTIN_POLICIES}
        self._by_name = {p.name: p for p in BUILTIN_POLICIES}
        self.default: BlockStoragePolicy = self.get(default_name)

    def get(self, name_or_id: str | int) -> BlockStoragePolicy:
        """The policy with this name (any case) or id; id 0 gives the default policy.

        An unknown name or id raises ValueError with HDFS's message, which the xattr layer
        turns into EINVAL.
        """
        if isinstance(name_or_id, str):
            policy = self._by_name.get(name_or_id.upper())
            if policy is None:
                raise ValueError(f"Cannot find a block policy with the name {name_or_id}")
            return policy
        if isinstance(name_or_id, bool) or not isinstance(name_or_id, int):
            raise TypeError(f"a policy is named by a str or an int id, not {name_or_id!r}")
        if name_or_id == UNSPECIFIED_ID:
            return self.default
        policy = self._by_id.get(name_or_id)
        if policy is None:
            raise ValueError(f"Cannot find a block policy with the id {name_or_id}")
        return policy

    def all_policies(self) -> list[BlockStoragePolicy]:
        """Every policy in ascending id order, the order ``-listPolicies`` prints."""
        return [self._by_id[i] for i in sorted(self._by_id)]


def actual_policy(types: Sequence[StorageType], suite: PolicySuite) -> BlockStoragePolicy | None:
    """The policy a block's replica types amount to, as ``hdfs fsck -storagepolicies`` sees it.

    HDFS's rule (``StoragePolicySummary.getStoragePolicy``): sort the replica types and each
    policy's types in enum order; a policy matches when its sorted list is a prefix of the
    replicas' sorted list and every further replica has the policy's last sorted type. The
    first match in ascending id order wins; None when nothing matches (e.g. DISK:2,ARCHIVE:1).
    """
    have = sorted(types)
    for policy in suite.all_policies():
        want = sorted(policy.storage_types)
        if len(want) <= len(have) and have[:len(want)] == want \
                and all(t == want[-1] for t in have[len(want):]):
            return policy
    return None


def storage_type_summary(types: Iterable[StorageType]) -> str:
    """Replica types counted per type in enum order, e.g. ``DISK:1,ARCHIVE:2`` ("" for none)."""
    counts = Counter(types)
    return ",".join(f"{t.name}:{counts[t]}" for t in sorted(counts))
