#!/usr/bin/env python3
"""Benchmark tierfs against the directory it stores its data in.

    python bench/run.py [--workdir DIR] [--floor] [--quick] [--rounds N] [--only NAME,...]
                        [--json OUT]
    python bench/run.py --target-only DIR [--quick] [--rounds N] [--only NAME,...] [--json OUT]

Makes a fresh tierfs with ``tierfs mkfs``, mounts it with ``mount.tierfs -f``, and runs every
workload twice in the same run: on ``backing/``, a plain directory on the same filesystem as
the tierfs volumes, and on the mount. The table then gives tierfs's figures as ratios of what
the same disk does without it, measured minutes apart on the same machine (DESIGN.md section
12), next to the targets. With ``--floor`` they also run, in the same rounds, on
``floorfs.py``: the least a pyfuse3 filesystem does, served as tierfs is, whose ratios show
what the stack and the machine allow before tierfs does any work of its own. With
``--target-only DIR`` the workloads run on DIR alone and no tierfs is involved: to develop
the harness, or to measure a tierfs mounted by hand.

Exit status: 0 when the run completes (with ``--strict``, 1 if a target is missed), 2 when it
cannot start or the daemon dies, 130 when interrupted (Ctrl-C or SIGTERM); the mount is
always taken down first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime, timezone

from mountctl import FloorMount, RssSampler, SetupError, TierfsMount, fs_type
from progress import Progress
from report import Missing, Results, format_number, render_table, to_json
from workloads import (WORKLOADS, BenchError, Figure, Sizes, SkipWorkload, Workload,
                       Workspace)

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}
DEFAULT_ROUNDS = 3
"""On a shared VM one measurement of a workload can land on a slow minute for one directory
and a fast one for the other (the backing directory alone has written at 400 to 1,270 MB/s
within an hour); the median of three paired rounds is what the README's table reports."""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark tierfs against its backing filesystem.",
        epilog="workloads: " + ", ".join(w.name for w in WORKLOADS))
    parser.add_argument("--workdir", help="a new or empty directory for backing/, data/ and "
                        "mnt/ (default: a fresh directory under /var/tmp)")
    parser.add_argument("--target-only", metavar="DIR",
                        help="run the workloads on DIR only, without tierfs")
    parser.add_argument("--quick", action="store_true", help="about 50x less work (smoke run)")
    parser.add_argument("--rounds", type=int, metavar="N",
                        help="run every workload N times on each directory, alternating, and "
                        "report the median (default 3, with --quick 1)")
    parser.add_argument("--only", metavar="NAME,...", help="run only these workloads")
    parser.add_argument("--json", metavar="OUT", help="also write every figure to OUT")
    parser.add_argument("--block-size", type=int, help="passed to tierfs mkfs")
    parser.add_argument("--bytes-per-checksum", type=int, help="passed to tierfs mkfs")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (and the daemon log) afterwards")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument("--floor", action="store_true",
                        help="also run every workload on bench/floorfs.py, the least a "
                        "pyfuse3 filesystem does, served as tierfs is: what the stack "
                        "allows on this machine before tierfs does any work")
    parser.add_argument("--mount-timeout", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument("--stall-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="kill the daemon when a workload makes no progress this long")
    args = parser.parse_args(argv)
    if args.target_only and args.workdir:
        parser.error("--workdir and --target-only exclude each other")
    if args.target_only and args.floor:
        parser.error("--floor and --target-only exclude each other")
    if args.rounds is None:
        args.rounds = 1 if args.quick else DEFAULT_ROUNDS
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        args.workloads = choose_workloads(args.only)
    except ValueError as e:
        parser.error(str(e))
    return args


def choose_workloads(only: str | None) -> list[Workload]:
    """The workloads named in ``only`` (all when None), always in the standard order."""
    if not only:
        return list(WORKLOADS)
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    unknown = wanted - {w.name for w in WORKLOADS}
    if unknown:
        raise ValueError(f"unknown workload(s): {', '.join(sorted(unknown))}")
    return [w for w in WORKLOADS if w.name in wanted]


# -- running workloads ----------------------------------------------------------------------


def run_workloads(workloads: list[Workload], sides: list[tuple[Workspace, TierfsMount | None]],
                  progress: Progress, results: Results, rounds: int = 1) -> None:
    """Runs each workload on every side in turn, ``rounds`` times, so each pair is measured
    close together and a slow minute falls on both sides of a round.

    A side with a mount is checked before each workload, so a dead daemon stops the run
    with its last words instead of turning every later workload into ENOTCONN.
    """
    for workload in workloads:
        for round_no in range(1, rounds + 1):
            for workspace, mount in sides:
                on_stall = None
                if mount is not None:
                    mount.check()
                    on_stall = mount.kill
                name = workload.name if rounds == 1 else f"{workload.name} {round_no}/{rounds}"
                before = cpu_ticks()
                with progress.task(f"{workspace.label} {name}", on_stall):
                    outcome = run_one(workload, workspace)
                record(results, workload, workspace.label, outcome, stolen_share(before))


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, total) CPU ticks of the machine so far, from /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return fields[7], sum(fields)


def stolen_share(before: tuple[int, int] | None) -> float | None:
    """Share of the CPU time since ``before`` that the hypervisor gave to other guests.

    On a shared VM this is what makes two runs of the same code differ most: a workload that
    ran while a third of the CPU was stolen says little about tierfs."""
    after = cpu_ticks()
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def run_one(workload: Workload, workspace: Workspace) -> list[Figure] | Missing:
    """The workload's figures, or why there are none.

    An OSError is the filesystem's answer, not the harness's failure: it is reported in the
    table and the run goes on.
    """
    try:
        return workload.run(workspace)
    except SkipWorkload as e:
        return Missing(str(e), workload=workload.name)
    except (OSError, BenchError) as e:
        return Missing(str(e), error=True, workload=workload.name)


def record(results: Results, workload: Workload, label: str,
           outcome: list[Figure] | Missing, stolen: float | None = None) -> None:
    """Adds the outcome to the results and prints it at once, one line per figure."""
    steal = "" if stolen is None else f", {stolen:.0%} CPU stolen"
    if isinstance(outcome, Missing):
        for name in workload.figures:
            results.add(label, name, outcome)
        print(f"{label:<8} {workload.name:<18} {outcome}", flush=True)
        return
    for figure in outcome:
        results.add(label, figure.name, figure)
        print(f"{label:<8} {figure.name:<18} {format_number(figure.value):>12} "
              f"{figure.unit:<9} ({format_seconds(figure.seconds)}{steal})", flush=True)


# -- the two modes --------------------------------------------------------------------------


def bench_tierfs(args: argparse.Namespace, sizes: Sizes, progress: Progress,
                 results: Results, meta: dict) -> None:
    """Makes and mounts a tierfs in a work directory, benchmarks it against backing/, and
    always unmounts and cleans up afterwards."""
    workdir, created = make_workdir(args.workdir)
    parts = ("backing", "data", "mnt", "floor-data", "floor")
    backing, data, mnt, floor_data, floor_mnt = (os.path.join(workdir, name) for name in parts)
    meta.update(workdir=workdir, fs_type=fs_type(workdir))
    mount = TierfsMount(data, mnt, os.path.join(workdir, "daemon.log"),
                        mkfs_options(args), args.mount_timeout)
    floor = FloorMount(floor_data, floor_mnt, os.path.join(workdir, "floorfs.log"),
                       args.mount_timeout) if args.floor else None
    sampler = None
    try:
        check_space(workdir, (3 if floor else 2) * sizes.file_bytes)
        os.mkdir(backing)
        print(f"making and mounting tierfs in {workdir}", file=sys.stderr, flush=True)
        mount.start()
        meta.update(mkfs_settings(mount.mkfs_output))
        sampler = RssSampler(mount.pid)
        sampler.start()
        meta["statvfs"] = {"backing": statvfs_json(backing), "tierfs": statvfs_json(mnt)}
        sides = [(Workspace("backing", backing, sizes, progress, (backing,)), None),
                 (Workspace("tierfs", mnt, sizes, progress, (mnt, data)), mount)]
        if floor:
            floor.start()
            sides.insert(1, (Workspace("floor", floor_mnt, sizes, progress,
                                       (floor_mnt, floor_data)), floor))
        run_workloads(args.workloads, sides, progress, results, args.rounds)
    finally:
        with interrupts_deferred():
            if sampler is not None:
                record_memory(results, meta, sampler)
            mount.unmount()
            meta["daemon_exit_status"] = mount.exit_status
            unmounted = mount.unmounted
            if floor:
                floor.unmount()
                unmounted = unmounted and floor.unmounted
            clean_up(workdir, created, [os.path.join(workdir, name) for name in parts],
                     args.keep, unmounted)


def bench_directory(args: argparse.Namespace, sizes: Sizes, progress: Progress,
                    results: Results, meta: dict) -> None:
    """Benchmarks one directory, in a scratch directory made inside it and removed after."""
    if not os.path.isdir(args.target_only):
        raise SetupError(f"{args.target_only} is not a directory")
    check_space(args.target_only, sizes.file_bytes)
    root = tempfile.mkdtemp(prefix="tierfs-bench-", dir=args.target_only)
    meta.update(workdir=root, fs_type=fs_type(root), statvfs={"dir": statvfs_json(root)})
    try:
        workspace = Workspace("dir", root, sizes, progress, (root,))
        run_workloads(args.workloads, [(workspace, None)], progress, results, args.rounds)
    finally:
        with interrupts_deferred():
            clean_up(root, True, [], args.keep, True)


def record_memory(results: Results, meta: dict, sampler: RssSampler) -> None:
    """Stops the daemon's memory sampling and adds its peak to the results."""
    memory = sampler.stop()
    meta["daemon_memory_kb"] = asdict(memory)
    if memory.peak_kb:
        seconds = memory.samples * sampler.interval
        results.add("tierfs", "peak_rss", Figure("peak_rss", memory.peak_kb * 1024 / 1e6,
                                                 seconds, memory.samples))


def format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def mkfs_settings(output: str) -> dict:
    """The block size and bytes per checksum that ``tierfs mkfs`` says it chose, for the JSON
    (the defaults are tierfs's, so the run records what it actually measured)."""
    settings = {}
    phrases = {"block_size": "block size", "bytes_per_checksum": "bytes per checksum"}
    for key, phrase in phrases.items():
        found = re.search(rf"\b{phrase} (\d+)", output)
        if found:
            settings[key] = int(found.group(1))
    return settings


def mkfs_options(args: argparse.Namespace) -> list[str]:
    options = []
    if args.block_size:
        options += ["--block-size", str(args.block_size)]
    if args.bytes_per_checksum:
        options += ["--bytes-per-checksum", str(args.bytes_per_checksum)]
    return options


# -- the work directory ---------------------------------------------------------------------


def make_workdir(path: str | None) -> tuple[str, bool]:
    """The work directory, and whether this run created it (and so may remove it).

    The default is on a disk: on tmpfs the backing figures would be memory speeds and the
    ratios meaningless.
    """
    if path is None:
        return tempfile.mkdtemp(prefix="tierfs-bench-", dir=default_base()), True
    created = not os.path.exists(path)
    if created:
        os.makedirs(path)
    elif os.listdir(path):
        raise SetupError(f"--workdir {path} is not empty")
    if fs_type(path) in MEMORY_FILESYSTEMS:
        print(f"warning: {path} is in memory ({fs_type(path)}); the ratios will mean little",
              file=sys.stderr)
    return path, created


def default_base() -> str:
    """The first of /var/tmp, /tmp and the home directory that is on a disk."""
    for base in ("/var/tmp", "/tmp", os.path.expanduser("~")):
        if os.path.isdir(base) and os.access(base, os.W_OK) \
                and fs_type(base) not in MEMORY_FILESYSTEMS:
            return base
    raise SetupError("no disk-backed place for the work directory; give --workdir")


def check_space(path: str, needed: int) -> None:
    """Refuses to start a run that would fill the disk halfway through."""
    free = shutil.disk_usage(path).free
    if free < needed + 512 * 2**20:
        raise SetupError(f"{path} has {free / 1e9:.1f} GB free; this run needs about "
                         f"{(needed + 512 * 2**20) / 1e9:.1f} GB (try --quick)")


def clean_up(workdir: str, created: bool, parts: list[str], keep: bool,
             unmounted: bool) -> None:
    """Removes what the run made, never anything that was there before it.

    A directory still mounted is left alone: removing through a broken mount could hang.
    """
    if keep:
        print(f"kept {workdir}", file=sys.stderr)
    elif not unmounted:
        print(f"left {workdir} in place: the mount is still there", file=sys.stderr)
    elif created:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        for part in parts:
            shutil.rmtree(part, ignore_errors=True)


# -- signals, metadata, main ----------------------------------------------------------------


def raise_interrupt(_signum, _frame) -> None:
    """Makes SIGTERM end the run like Ctrl-C, through the same unmount and cleanup."""
    raise KeyboardInterrupt


@contextmanager
def interrupts_deferred():
    """Keeps a second Ctrl-C from cutting the unmount and cleanup short."""
    def say_wait(_signum, _frame):
        print("still cleaning up; please wait", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, say_wait) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def statvfs_json(path: str) -> dict:
    """The block sizes the filesystem at ``path`` reports."""
    st = os.statvfs(path)
    return {"f_bsize": st.f_bsize, "f_frsize": st.f_frsize}


def describe_run(args: argparse.Namespace, sizes: Sizes) -> dict:
    """What the JSON records about the machine and the run besides the figures."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "tierfs_commit": git_commit(),
        "mode": "target-only" if args.target_only else "tierfs",
        "quick": args.quick,
        "rounds": args.rounds,
        "workloads": [w.name for w in args.workloads],
        "sizes": asdict(sizes),
        "block_size": args.block_size,
        "bytes_per_checksum": args.bytes_per_checksum,
    }


def git_commit() -> str | None:
    """The checkout's commit, marked "+dirty" when it has local changes."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_interrupt)
    sizes = Sizes().quick() if args.quick else Sizes()
    results = Results(["dir"] if args.target_only
                      else ["backing", "floor", "tierfs"] if args.floor
                      else ["backing", "tierfs"])
    meta = describe_run(args, sizes)
    progress = Progress(stall_timeout=args.stall_timeout)
    status = 0
    try:
        if args.target_only:
            bench_directory(args, sizes, progress, results, meta)
        else:
            bench_tierfs(args, sizes, progress, results, meta)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the partial report come out
        print("interrupted", file=sys.stderr)
        meta["interrupted"] = True
        status = 130
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        meta["error"] = str(e)
        status = 2
    finally:
        progress.close()
    if results.names():
        print()
        print(render_table(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(to_json(results, meta), out, indent=2)
            out.write("\n")
    if status == 0 and args.strict and "FAIL" in results.verdicts().values():
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
