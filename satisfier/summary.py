"""Whether a block sits where its storage policy wants it, and the tables of
``hdfs fsck -storagepolicies``: the one rule that ``tierfs fsck`` and ``tierfs report`` share.

Pure values and functions, like ``policies.py``: the callers give each block's replica storage
types (fsck: its good replicas; report: its recorded ones) with the file's effective policy
and replication.

The rule (:func:`classify`), on the block's *persistent* replicas (RAM_DISK is transient and
counts for nothing, as in HDFS's replication monitor and Mover):

under-replicated
    fewer persistent replicas than the replication, while some replica exists (a block
    without any is lost, not under-replicated; one only on RAM_DISK is under-replicated,
    as an HDFS lazy-persist block before the lazy writer ran).
over-replicated
    more persistent replicas than the replication.
mis-placed
    the persistent types differ from ``policy.choose_storage_types(replication)`` as a
    multiset beyond what the count explains: some replica is on a type the policy does not
    want (``choose_excess`` is not empty) while a wanted slot is still empty
    (``choose_storage_types(replication, types)`` is not empty), so only a move fixes it.
    With exactly ``replication`` replicas this is plain multiset inequality. A block missing
    a replica, or carrying one too many, of a wanted type is under- or over-replicated, not
    mis-placed; COLD with replication 2 on DISK:1 is both under-replicated and mis-placed.
satisfying
    some persistent replica, and each one of a type the policy wants for that many replicas:
    ``choose_excess(max(replication, count), types)`` is empty. So a mis-placed block does
    not satisfy its policy, nor does one whose extra replica sits on a type the policy does
    not want (HOT with replication 2 on SSD:1,DISK:2: removing the excess SSD replica fixes
    it), while an under- or over-replicated block on wanted types does (HOT on DISK:1 or
    DISK:3). This is HDFS's verdict, that the combination's actual policy is the specified
    one (``StoragePolicySummary.policyMatches``), but where HDFS's prefix match is stricter
    than the policy itself: HDFS calls a LAZY_PERSIST block persisted on DISK:1 "HOT", so not
    satisfying, and a WARM block with only DISK:1 of its two replicas too; tierfs calls both
    satisfying, since DISK is what those policies ask for first.

The tables (:class:`StoragePolicySummary`) count blocks per (replica type combination,
specified policy), most frequent first, and print them with HDFS's format strings (reference
section 3.4; ``StoragePolicySummary.toString``): ``%-25s %10d  %20s`` for the satisfying rows,
``%-35s %-20s %10d  %20s`` for the others, percentages with four decimals, the actual policy
in parentheses when the combination amounts to one (:func:`actual_policy`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tierfs.backends.storage_types import StorageType
from tierfs.satisfier.policies import (
    BlockStoragePolicy,
    PolicySuite,
    actual_policy,
    storage_type_summary,
)

NO_REPLICAS = "(no replicas)"


@dataclass(frozen=True)
class BlockPlacement:
    """How one block's replicas compare with its policy and replication (module docstring)."""

    replication: int
    persistent: int
    under_replicated: bool
    over_replicated: bool
    misplaced: bool
    satisfied: bool


def classify(policy: BlockStoragePolicy, replication: int,
             types: Sequence[StorageType]) -> BlockPlacement:
    """The placement verdict for a block whose replicas are on ``types``."""
    persistent = [t for t in types if not t.transient]
    count = len(persistent)
    misplaced = bool(policy.choose_excess(replication, persistent)) \
        and bool(policy.choose_storage_types(replication, persistent))
    satisfied = count > 0 and not policy.choose_excess(max(replication, count), persistent)
    return BlockPlacement(replication, count,
                          under_replicated=bool(types) and count < replication,
                          over_replicated=count > replication, misplaced=misplaced,
                          satisfied=satisfied)


@dataclass
class Combination:
    """One row of the tables: a replica type combination and, for blocks not satisfying
    their policy, the specified policy. ``tierfs report --json`` prints these fields."""

    storage_types: str              # "DISK:1,ARCHIVE:2(WARM)"
    combination: str                # "DISK:1,ARCHIVE:2"
    actual_policy: str | None       # "WARM", or None when the combination matches none
    specified_policy: str | None    # only for blocks not satisfying their policy
    blocks: int
    percent: float


class StoragePolicySummary:
    """Blocks counted per (replica types, specified policy), as HDFS's
    ``StoragePolicySummary``; :meth:`add` one block at a time, then read the rows."""

    def __init__(self, suite: PolicySuite):
        self.suite = suite
        self._counts: Counter = Counter()

    def add(self, types: Sequence[StorageType], policy: BlockStoragePolicy,
            replication: int) -> BlockPlacement:
        """Count one block; returns its :func:`classify` verdict."""
        placement = classify(policy, replication, types)
        specified = None if placement.satisfied else policy.name
        self._counts[(tuple(sorted(types)), specified)] += 1
        return placement

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def rows(self) -> tuple[list[Combination], list[Combination]]:
        """(satisfying, not satisfying), each most frequent first; ties in storage type
        order (fastest first). Several specified policies can be satisfied by the same
        combination (DISK:1 is HOT's and LAZY_PERSIST's): it is one row, as in HDFS."""
        total = self.total
        satisfying: dict[str, Combination] = {}
        not_satisfying: list[Combination] = []
        ordered = sorted(self._counts.items(),
                         key=lambda kv: (-kv[1], kv[0][0], kv[0][1] or ""))
        for (types, specified), count in ordered:
            actual = actual_policy(types, self.suite)
            summary = storage_type_summary(types) or NO_REPLICAS
            row = Combination(
                storage_types=summary + (f"({actual.name})" if actual else ""),
                combination=summary, actual_policy=actual.name if actual else None,
                specified_policy=specified, blocks=count, percent=_percent(count, total))
            if specified is not None:
                not_satisfying.append(row)
            elif row.storage_types in satisfying:
                satisfying[row.storage_types].blocks += count
            else:
                satisfying[row.storage_types] = row
        for row in satisfying.values():
            row.percent = _percent(row.blocks, total)
        return sorted(satisfying.values(), key=lambda r: -r.blocks), not_satisfying

    def lines(self) -> list[str]:
        return tables(*self.rows())


def tables(satisfying: Sequence[Combination], not_satisfying: Sequence[Combination]) -> list[str]:
    """The two tables of ``hdfs fsck -storagepolicies``, with its format strings; when every
    block complies, the second is HDFS's one line instead."""
    out = ["Blocks satisfying the specified storage policy:",
           "Storage Policy                  # of blocks       % of blocks"]
    for row in satisfying:
        out.append("%-25s %10d  %20s" % (row.storage_types, row.blocks, f"{row.percent:.4f}%"))
    out.append("")
    if not not_satisfying:
        out.append("All blocks satisfy specified storage policy.")
        return out
    out.append("Blocks NOT satisfying the specified storage policy:")
    out.append("Storage Policy                  Specified Storage Policy      # of blocks"
               "       % of blocks")
    for row in not_satisfying:
        out.append("%-35s %-20s %10d  %20s" % (row.storage_types, row.specified_policy,
                                               row.blocks, f"{row.percent:.4f}%"))
    return out


def _percent(count: int, total: int) -> float:
    return round(100.0 * count / total, 4) if total else 0.0
