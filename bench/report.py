"""The targets tierfs is held to, and the table and JSON that report a run against them.

Most targets are ratios against the backing directory measured in the same run, because the
absolute speed of a machine says little about the filesystem; a few are absolute, where a
user notices the rate itself (appends, metadata operations, small files) or where the backing
directory is not comparable (memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads import UNITS, Figure


@dataclass(frozen=True)
class Goal:
    """A target: ``kind`` is "ratio" (tierfs/backing at least ``threshold``), "min" (the
    tierfs figure at least ``threshold``) or "max" (the tierfs figure below ``threshold``)."""

    kind: str
    threshold: float

    def describe(self) -> str:
        if self.kind == "ratio":
            return f">= {self.threshold:g}x"
        if self.kind == "min":
            return f">= {self.threshold:,.0f}"
        return f"< {self.threshold:,.0f}"

    def met(self, value: float, ratio: float | None) -> bool | None:
        """Whether the goal is met; None when it needs a ratio and there is none."""
        if self.kind == "ratio":
            return None if ratio is None else ratio >= self.threshold
        if self.kind == "min":
            return value >= self.threshold
        return value < self.threshold


GOALS = {
    "seq_write": Goal("ratio", 0.5),
    "seq_read_cold": Goal("ratio", 0.8),
    "seq_read_warm": Goal("ratio", 0.35),
    "rand_read_4k": Goal("ratio", 0.1),
    "rand_write_4k": Goal("ratio", 0.06),
    "append_small": Goal("min", 10_000),
    "create": Goal("ratio", 0.075),
    "stat_warm": Goal("ratio", 0.15),
    "readdir": Goal("min", 100_000),
    "rename": Goal("min", 1_500),
    "unlink": Goal("min", 1_500),
    "mkdir": Goal("min", 1_500),
    "small_files_write": Goal("min", 700),
    "small_files_read": Goal("min", 2_000),
    "peak_rss": Goal("max", 150),
}


@dataclass(frozen=True)
class Missing:
    """No figure for a workload on a directory: it was skipped there, or it failed."""

    reason: str
    error: bool = False
    workload: str = ""

    def __str__(self) -> str:
        return f"{'ERROR' if self.error else 'skipped'}: {self.reason}"


Cell = Figure | Missing


class Results:
    """Everything measured in one run: figure name -> directory label -> cell.

    ``labels`` are the directories in column order. With two or more, the first is the
    reference (the backing directory) and the last the subject (the tierfs mount), which the
    targets judge; any between (``--floor``) get a ratio column of their own, unjudged. With
    one (``--target-only``) there is no reference and only absolute targets are judged.
    """

    def __init__(self, labels: list[str]):
        self.labels = labels
        self.cells: dict[str, dict[str, Cell]] = {}
        self.rounds: dict[str, dict[str, list[Figure]]] = {}

    @property
    def reference(self) -> str | None:
        return self.labels[0] if len(self.labels) >= 2 else None

    @property
    def subject(self) -> str:
        return self.labels[-1]

    def add(self, label: str, name: str, cell: Cell) -> None:
        """One round's outcome. Over several rounds a directory's cell is the round with the
        median value (the lower of the two middle ones for an even count, so that every
        figure shown was measured), and a round that failed or was skipped decides the cell
        for good: a failure is not outvoted by the rounds that worked."""
        row = self.cells.setdefault(name, {})
        if isinstance(row.get(label), Missing):
            return
        if isinstance(cell, Missing):
            row[label] = cell
            return
        samples = self.rounds.setdefault(name, {}).setdefault(label, [])
        samples.append(cell)
        row[label] = sorted(samples, key=lambda f: f.value)[(len(samples) - 1) // 2]

    def round_count(self) -> int:
        """The most rounds any figure was measured in."""
        return max((len(s) for row in self.rounds.values() for s in row.values()), default=0)

    def names(self) -> list[str]:
        """The figures measured so far, in report order."""
        return [name for name in UNITS if name in self.cells]

    @property
    def compared(self) -> list[str]:
        """The labels measured against the reference, each with a ratio: the subject last."""
        return self.labels[1:] if self.reference else []

    def ratio(self, name: str, label: str | None = None) -> float | None:
        """label/reference (label: the subject by default), when both were measured."""
        row = self.cells[name]
        subject, reference = row.get(label or self.subject), row.get(self.reference)
        if not (isinstance(subject, Figure) and isinstance(reference, Figure)):
            return None
        return subject.value / reference.value if reference.value else None

    def verdict(self, name: str) -> str:
        """PASS or FAIL against the goal; "-" with no goal, "skip" or "n/a" when unjudged."""
        goal = GOALS.get(name)
        cell = self.cells[name].get(self.subject)
        if isinstance(cell, Missing):
            return ("FAIL" if goal else "ERROR") if cell.error else "skip"
        if goal is None or cell is None:
            return "-"
        met = goal.met(cell.value, self.ratio(name))
        return "n/a" if met is None else "PASS" if met else "FAIL"

    def verdicts(self) -> dict[str, str]:
        return {name: self.verdict(name) for name in self.names()}


def format_number(value: float) -> str:
    """Three or so significant digits, with thousands separators for big rates."""
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def render_table(results: Results) -> str:
    """The results as an aligned text table, followed by why anything is missing."""
    header = ["workload", "unit", *results.labels]
    header += [f"{label} ratio" for label in results.compared[:-1]]
    if results.reference:
        header.append("ratio")
    header += ["target", "result"]
    rows = [header] + [_table_row(results, name) for name in results.names()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    left = {0, 1, len(header) - 1}
    lines = ["  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines += _notes(results)
    if results.round_count() > 1:
        lines.append(f"each figure is the median of {results.round_count()} rounds "
                     "(every round ran on each directory in turn)")
    counts = list(results.verdicts().values())
    lines.append(f"PASS {counts.count('PASS')}, FAIL {counts.count('FAIL')}")
    return "\n".join(lines)


def _table_row(results: Results, name: str) -> list[str]:
    row = [name, UNITS[name]]
    for label in results.labels:
        cell = results.cells[name].get(label)
        if cell is None:
            row.append("")
        elif isinstance(cell, Missing):
            row.append("ERROR" if cell.error else "skip")
        else:
            row.append(format_number(cell.value))
    for label in results.compared:
        ratio = results.ratio(name, label)
        row.append("" if ratio is None else format_number(ratio))
    goal = GOALS.get(name)
    row += [goal.describe() if goal else "", results.verdict(name)]
    return row


def _notes(results: Results) -> list[str]:
    """One line per skipped or failed workload on a directory, saying why."""
    notes = []
    for name in results.names():
        for label, cell in results.cells[name].items():
            note = f"  {label} {cell.workload or name}: {cell}" if isinstance(cell, Missing) else ""
            if note and note not in notes:
                notes.append(note)
    return notes


def to_json(results: Results, meta: dict) -> dict:
    """The run as plain data: ``meta`` (machine, sizes, options) plus every figure."""
    figures = []
    for name in results.names():
        goal = GOALS.get(name)
        figures.append({
            "name": name,
            "unit": UNITS[name],
            "values": {label: _cell_json(cell, results.rounds.get(name, {}).get(label))
                       for label, cell in results.cells[name].items()},
            "ratio": results.ratio(name),
            **{f"{label}_ratio": results.ratio(name, label)
               for label in results.compared[:-1]},
            "target": None if goal is None else {"kind": goal.kind, "threshold": goal.threshold},
            "result": results.verdict(name),
        })
    return {**meta, "figures": figures}


def _cell_json(cell: Cell, rounds: list[Figure] | None) -> dict:
    if isinstance(cell, Missing):
        return {"error" if cell.error else "skipped": cell.reason}
    out = {"value": cell.value, "seconds": cell.seconds, "count": cell.count}
    if rounds and len(rounds) > 1:
        out["rounds"] = [f.value for f in rounds]
    return out
