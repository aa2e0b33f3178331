"""fsck's findings and their text: :class:`Problem`, :class:`Stats`, :class:`FsckReport` (one
check) and :class:`RepairReport` (one ``--repair``), rendered in HDFS's style (the output
and the exit code's rule are described in ``tierfs.tools.fsck``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.satisfier.summary import StoragePolicySummary


@dataclass
class Problem:
    """One thing wrong. ``action`` is ``(name, *args)`` for the repairer, None if fsck
    cannot repair it; ``key`` identifies it across two checks (mounted re-check, repair
    passes). ``health`` False: a replication or placement finding, which leaves the
    filesystem HEALTHY and is printed in HDFS's style; ``recovery``: work that a daemon which
    did not stop cleanly left for the next mount, which does it by itself: printed like any
    problem, but it leaves the filesystem HEALTHY; ``work``: bytes its fix copies."""

    kind: str
    where: str
    message: str
    key: tuple
    action: tuple | None = None
    outcome: str | None = None
    repaired: bool = False
    health: bool = True
    recovery: bool = False
    work: int = 0

    def line(self) -> str:
        text = (f"{self.kind}: {self.where}: {self.message}" if self.health
                else f"{self.where}: {self.message}")
        return f"{text} [{self.outcome}]" if self.outcome else text


@dataclass
class Stats:
    total_size: int = 0
    block_bytes: int = 0      # the blocks' own lengths: a sparse file's holes have none
    dirs: int = 0
    files: int = 0
    symlinks: int = 0
    blocks: int = 0
    minimally_replicated: int = 0
    over_replicated: int = 0
    under_replicated: int = 0
    misplaced: int = 0
    corrupt_blocks: int = 0
    recorded_replicas: int = 0
    missing_replicas: int = 0
    orphan_replicas: int = 0
    good_replicas: int = 0
    default_replication: int = 1
    volumes: int = 0


@dataclass
class FsckReport:
    """The outcome of one check: problems, notes, totals and (if asked) the listing."""

    data_dir: Path
    path: str
    mounted: bool
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    listing: list[tuple[str, list[str]]] = field(default_factory=list)
    placement: StoragePolicySummary | None = None
    storage_policies: bool = False
    started: float = field(default_factory=time.time)
    elapsed: float = 0.0

    @property
    def healthy(self) -> bool:
        """No problem but replication and placement findings and pending recovery (the exit
        code's rule)."""
        return not any(p.health and not p.recovery for p in self.problems)

    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def summary_lines(self) -> list[str]:
        """The HDFS-style summary and the final verdict line."""
        s = self.stats
        blocks = max(s.blocks, 1)
        avg_block = s.block_bytes // s.blocks if s.blocks else 0
        average = s.good_replicas / s.blocks if s.blocks else 0.0
        status = "HEALTHY" if self.healthy else "CORRUPT"
        return [
            f"Status: {status}",
            f" Total size:\t{s.total_size} B",
            f" Total dirs:\t{s.dirs}",
            f" Total files:\t{s.files}",
            f" Total symlinks:\t{s.symlinks}",
            f" Total blocks (validated):\t{s.blocks} (avg. block size {avg_block} B)",
            f" Minimally replicated blocks:\t{s.minimally_replicated} "
            f"({_percent(s.minimally_replicated, blocks)})",
            f" Over-replicated blocks:\t{s.over_replicated} "
            f"({_percent(s.over_replicated, blocks)})",
            f" Under-replicated blocks:\t{s.under_replicated} "
            f"({_percent(s.under_replicated, blocks)})",
            f" Mis-placed blocks:\t{s.misplaced} ({_percent(s.misplaced, blocks)})",
            f" Corrupt blocks:\t{s.corrupt_blocks}",
            f" Missing replicas:\t{s.missing_replicas} "
            f"({_percent(s.missing_replicas, max(s.recorded_replicas, 1))})",
            f" Orphan replicas:\t{s.orphan_replicas}",
            f" Default replication factor:\t{s.default_replication}",
            f" Average block replication:\t{average:.1f}",
            f" Number of volumes:\t{s.volumes}",
            "",
            *self.storage_policy_lines(),
            f"FSCK ended at {time.ctime(self.started + self.elapsed)} in "
            f"{int(self.elapsed * 1000)} milliseconds",
            "",
            f"The filesystem under path '{self.path}' is {status}",
        ]

    def storage_policy_lines(self) -> list[str]:
        """``--storagepolicies``: HDFS's two tables and a blank line, else nothing."""
        if not self.storage_policies or self.placement is None:
            return []
        return [*self.placement.lines(), ""]

    def header(self) -> str:
        return (f"FSCK started for path '{self.path}' of {self.data_dir} at "
                f"{time.ctime(self.started)}")

    def listing_lines(self) -> list[str]:
        return [line for _, lines in sorted(self.listing) for line in lines]

    def render(self) -> str:
        lines = [self.header(), *self.listing_lines()]
        lines += [p.line() for p in self.problems]
        lines += [f"NOTE: {n}" for n in self.notes]
        return "\n".join([*lines, "", *self.summary_lines()])


@dataclass
class RepairReport:
    """What ``--repair`` found (``before``), did (``problems``, with outcomes) and left
    (``after``: a fresh check of the repaired filesystem)."""

    before: FsckReport
    problems: list[Problem]
    after: FsckReport

    @property
    def exit_code(self) -> int:
        """The first check's: 1 only for problems that made the filesystem CORRUPT."""
        return 0 if self.before.healthy else 1

    def render(self) -> str:
        """The count line leaves out mis-placed blocks: fsck does not move blocks."""
        counted = [p for p in self.problems if p.health or p.action]
        left = [p for p in self.after.problems if p.health or p.action]
        fixed = sum(p.repaired for p in counted)
        lines = [self.before.header(), *self.after.listing_lines()]
        lines += [p.line() for p in self.problems]
        if counted:
            lines.append(f"Repaired {fixed} of {len(counted)} problems; {len(left)} left.")
        lines += [f"NOTE: {n}" for n in self.after.notes]
        return "\n".join([*lines, "", *self.after.summary_lines()])


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f} %"
