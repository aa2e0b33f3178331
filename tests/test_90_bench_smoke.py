"""Smoke test of the benchmark harness (bench/run.py) on a plain directory.

The benchmark itself runs outside the test suite (DESIGN.md section 12); this only keeps the
harness working: a quick ``--target-only`` run must finish and report a figure for every
workload, in the table and in the JSON. It needs no tierfs, and takes a second or two.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(REPO, "bench", "run.py")

#: Figures a plain directory cannot give: it has no storage-policy xattr, and dropping the
#: page cache needs root.
NOT_ON_PLAIN_DIRS = {"setfattr_empty", "setfattr_subtree", "setfattr_ratio"}
NEEDS_ROOT = {"seq_read_cold"}
FIGURES = [
    "seq_write", "seq_read_cold", "seq_read_warm", "rand_read_4k", "rand_write_4k",
    "append_small", "create", "stat_warm", "readdir", "rename", "unlink", "mkdir",
    "small_files_write", "small_files_read",
]


def quick_run(tmp_path, *options: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """A successful ``--quick --target-only`` run on a new directory: the finished process,
    the directory and the JSON it wrote."""
    out = tmp_path / "bench.json"
    target = tmp_path / "target"
    target.mkdir()
    done = subprocess.run(
        [sys.executable, RUN, "--target-only", str(target), "--quick", "--json", str(out),
         *options],
        capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, target, out


@pytest.mark.timeout(60)
def test_quick_run_on_a_plain_directory_reports_every_workload(tmp_path):
    done, target, out = quick_run(tmp_path)

    # each workload's line says how much CPU the hypervisor took meanwhile (/proc/stat)
    assert re.search(r"^dir\s+seq_write\s+.*\(.*, \d+% CPU stolen\)$", done.stdout, re.MULTILINE), \
        done.stdout
    table = done.stdout.split("\n\n")[-1]
    optional = NOT_ON_PLAIN_DIRS | (NEEDS_ROOT if os.geteuid() != 0 else set())
    for name in FIGURES + sorted(NOT_ON_PLAIN_DIRS):
        row = re.search(rf"^{name}\s+\S+\s+(\S+)", table, re.MULTILINE)
        assert row, f"no row for {name} in:\n{table}"
        if name not in optional:
            assert re.fullmatch(r"[\d,.]+", row.group(1)), f"{name}: {row.group(0)}"
            assert float(row.group(1).replace(",", "")) > 0

    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    for name in FIGURES:
        if name not in optional:
            assert figures[name]["values"]["dir"]["value"] > 0
    assert "skipped" in figures["setfattr_subtree"]["values"]["dir"]
    assert os.listdir(target) == [], "the harness left files behind"


def test_unknown_workload_is_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, RUN, "--target-only", str(tmp_path), "--only", "seq_write,nope"],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "nope" in done.stderr


@pytest.mark.timeout(60)
def test_rounds_report_the_median_round_and_keep_every_round(tmp_path):
    done, target, out = quick_run(tmp_path, "--rounds", "3", "--only", "create,mkdir")
    assert len(re.findall(r"^dir\s+create\s", done.stdout, re.MULTILINE)) == 3, done.stdout
    assert "each figure is the median of 3 rounds" in done.stdout
    run = json.loads(out.read_text())
    assert run["rounds"] == 3
    for figure in run["figures"]:
        cell = figure["values"]["dir"]
        assert len(cell["rounds"]) == 3
        assert cell["value"] == sorted(cell["rounds"])[1]
    assert os.listdir(target) == [], "the harness left files behind"


def test_rounds_must_be_positive(tmp_path):
    done = subprocess.run([sys.executable, RUN, "--target-only", str(tmp_path), "--rounds", "0"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--rounds must be at least 1" in done.stderr


def test_a_failed_round_is_not_outvoted(monkeypatch):
    """The median of the rounds that worked must not hide a round that failed."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "bench"))
    from report import Missing, Results
    from workloads import Figure

    results = Results(["backing", "tierfs"])
    results.add("backing", "create", Figure("create", 100.0, 1.0, 100))
    results.add("tierfs", "create", Figure("create", 10.0, 1.0, 10))
    results.add("backing", "create", Figure("create", 200.0, 1.0, 200))
    results.add("tierfs", "create", Missing("ENOSPC", error=True, workload="create"))
    results.add("backing", "create", Figure("create", 300.0, 1.0, 300))
    results.add("tierfs", "create", Figure("create", 30.0, 1.0, 30))
    assert results.cells["create"]["backing"].value == 200.0
    assert isinstance(results.cells["create"]["tierfs"], Missing)
    assert results.verdict("create") == "FAIL"


@pytest.mark.timeout(120)
def test_a_floor_run_measures_the_floor_filesystem_beside_tierfs(tmp_path):
    """``--floor``: every workload also runs on bench/floorfs.py, really mounted, and the
    table and the JSON give its ratio to the backing directory beside tierfs's; both mounts
    are gone afterwards, and so is the work directory the run made."""
    out = tmp_path / "bench.json"
    workdir = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, RUN, "--workdir", str(workdir), "--quick", "--floor",
         "--only", "seq_write,create,unlink,small_files", "--json", str(out)],
        capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr

    table = done.stdout.split("\n\n")[-1]
    assert re.search(r"^workload\s+unit\s+backing\s+floor\s+tierfs\s+floor ratio\s+ratio\s",
                     table, re.MULTILINE), table
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    for name in ("seq_write", "create", "unlink", "small_files_write", "small_files_read"):
        values = figures[name]["values"]
        assert values["floor"]["value"] > 0 and values["tierfs"]["value"] > 0, values
        assert figures[name]["floor_ratio"] == pytest.approx(
            values["floor"]["value"] / values["backing"]["value"])
        assert figures[name]["ratio"] == pytest.approx(
            values["tierfs"]["value"] / values["backing"]["value"])
    assert not any(os.path.ismount(workdir / part) for part in ("mnt", "floor"))
    assert not workdir.exists(), "the harness left its work directory behind"


def test_floor_and_target_only_exclude_each_other(tmp_path):
    done = subprocess.run([sys.executable, RUN, "--target-only", str(tmp_path), "--floor"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--floor and --target-only exclude each other" in done.stderr


def test_a_middle_directory_gets_a_ratio_but_no_verdict(monkeypatch):
    """With a floor between the backing directory and tierfs, the targets judge tierfs
    alone: a floor that misses one does not make tierfs fail, nor one that meets it pass."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "bench"))
    from report import Results, render_table
    from workloads import Figure

    results = Results(["backing", "floor", "tierfs"])
    results.add("backing", "create", Figure("create", 1000.0, 1.0, 1000))
    results.add("floor", "create", Figure("create", 50.0, 1.0, 50))
    results.add("tierfs", "create", Figure("create", 100.0, 1.0, 100))
    assert results.ratio("create") == pytest.approx(0.1)
    assert results.ratio("create", "floor") == pytest.approx(0.05)
    assert results.verdict("create") == "PASS"  # 0.1 >= 0.075, though the floor is below
    header, _, row = render_table(results).splitlines()[:3]
    assert header.split() == ["workload", "unit", "backing", "floor", "tierfs", "floor",
                              "ratio", "ratio", "target", "result"]
    assert row.split() == ["create", "ops/s", "1,000", "50.0", "100", "0.050", "0.100",
                           ">=", "0.075x", "PASS"]
