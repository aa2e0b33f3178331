"""``tierfs report DATA|MNT [--json]``: where the space is, and whether data sits where its
storage policy wants it.

The target is a data directory, or the mount point of a tierfs (its source in
/proc/self/mountinfo, fstype ``fuse.tierfs``, is the data directory). The namespace is opened
read-only beside a running mount (LMDB allows readers in other processes) and read in short
transactions, one per batch, so a long report neither blocks the daemon nor pins old pages;
the volumes are opened (identity checked) and their used bytes counted from the files.

What it prints (``--json``: the same as one JSON object, sizes in bytes):

- per storage type and per volume: capacity, used, free (as ``hdfs dfsadmin -report`` has
  them per DataNode; volumes that share a disk count its free space once in the totals),
  and the number of replicas (from the ``replicas`` database);
- per effective storage policy (each file's, resolved like ``user.tierfs.storage_policy``):
  files, the sum of their sizes, their blocks and how many of those are mis-placed (on a
  type the policy does not want while a wanted one is missing: a move fixes them);
- the blocks satisfying their policy and those that do not, in the two tables of
  ``hdfs fsck -storagepolicies``: each combination of the recorded replicas' storage types as
  ``DISK:1,ARCHIVE:2(WARM)`` (the policy the combination amounts to in parentheses, when one
  does), with counts and percentages. The rule (mis-placed, satisfying) and the tables are
  ``tierfs.satisfier.summary``'s, shared with ``tierfs fsck --storagepolicies``;
- the number of subtrees still waiting for the satisfier.

Files removed while the report runs are skipped; files created meanwhile may or may not be
counted: a report of a busy filesystem is a moving picture, not a snapshot.

Progress goes to stderr: a tqdm bar on a terminal, else a status line every few seconds.
Ctrl-C stops between two batches (exit 130, through ``tierfs``'s main).

Exit codes: 0 reported; 2 usage or cannot run (no such path, neither a tierfs data directory
nor a tierfs mount point, e.g. a directory inside a mount; namespace unreadable), one line on
stderr.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import lmdb

from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet, resolve_volume_path
from tierfs.fs import schema
from tierfs.fs.errors import FsError
from tierfs.fs.mountlock import MountLock
from tierfs.fs.namespace import Namespace
from tierfs.fs.resolver import Resolver
from tierfs.fs.schema import BlockRecord, Inode, u64
from tierfs.satisfier.summary import Combination, StoragePolicySummary, tables
from tierfs.tools.mkfs import NAMESPACE_DIR, is_filesystem
from tierfs.tools.mountinfo import (FSTYPE, MountEntry, mount_of_device, stat_target,
                                    tierfs_mounted_on)
from tierfs.tools import progress as _progress
from tierfs.tools.progress import Silent

CANNOT_RUN = 2
BATCH = 1000              # inodes (or replica rows x 10) per read transaction


class ReportError(Exception):
    """The report cannot run: one line on stderr, exit code 2."""



class Progress(_progress.Progress):
    """Status lines of this tool start with its name."""

    label = "tierfs report"

# =========================================================================== the numbers


@dataclass
class VolumeRow:
    id: int
    storage_type: str
    path: str
    capacity_limit: int | None      # set at mkfs, or None (the disk's size)
    capacity: int | None = None     # None when the volume could not be opened
    used: int | None = None
    free: int | None = None
    replicas: int = 0
    error: str | None = None


@dataclass
class SpaceRow:
    volumes: int = 0
    capacity: int | None = None     # None when none of the volumes could be opened
    used: int | None = None
    free: int | None = None
    replicas: int = 0
    unavailable: int = 0            # volumes that could not be opened


@dataclass
class PolicyRow:
    files: int = 0
    bytes: int = 0
    blocks: int = 0
    misplaced_blocks: int = 0


@dataclass
class Report:
    data: str
    fs_uuid: str
    mounted: dict | None            # {"pid": ..., "mount_point": ...} or None
    default_policy: str
    default_replication: int
    block_size: int
    rename_mode: str
    storage_types: dict[str, SpaceRow] = field(default_factory=dict)
    total: SpaceRow = field(default_factory=SpaceRow)
    volumes: list[VolumeRow] = field(default_factory=list)
    policies: dict[str, PolicyRow] = field(default_factory=dict)
    files: int = 0
    directories: int = 0
    other_inodes: int = 0
    blocks: int = 0
    blocks_satisfying: int = 0
    blocks_not_satisfying: int = 0
    satisfying: list[Combination] = field(default_factory=list)
    not_satisfying: list[Combination] = field(default_factory=list)
    pending_satisfier: int = 0

    def to_json(self) -> dict:
        return asdict(self)


# =========================================================================== progress


# =========================================================================== the target


def find_data_dir(target: str) -> tuple[Path, str | None]:
    """(data directory, mount point or None) of a data directory or a tierfs mount point.
    A directory inside a mount is refused rather than taken for its whole filesystem: the
    report would look like one of that directory."""
    entry = tierfs_mounted_on(target)
    if entry is not None:
        return _mounted_data(target, entry), entry.mount_point
    st = stat_target(target, ReportError, f"{target} does not exist")
    if stat.S_ISDIR(st.st_mode) and is_filesystem(Path(target)):
        return Path(os.path.abspath(target)), None
    raise ReportError(_not_a_target(target, st))


def _mounted_data(target: str, entry: MountEntry) -> Path:
    data = Path(entry.data_dir)
    if not is_filesystem(data):
        raise ReportError(f"{target} is a tierfs mount, but its data directory {data} "
                          f"holds no tierfs filesystem (not visible from here?)")
    return data


def _not_a_target(target: str, st: os.stat_result) -> str:
    """Why ``target`` is refused, naming the mount it lies inside when that is a tierfs."""
    inside = mount_of_device(st.st_dev)
    if inside is not None and inside.fstype == FSTYPE:
        return (f"{target} is inside the tierfs mounted on {inside.mount_point}, not its "
                f"mount point; give the mount point or DATA")
    return (f"{target} is neither a tierfs data directory nor a tierfs mount point; give "
            f"the mount point or DATA")


# =========================================================================== collection


class Collector:
    """Reads one filesystem and fills a :class:`Report`. The library behind the CLI."""

    def __init__(self, data_dir: Path, progress: Progress | None = None):
        self.data_dir = Path(data_dir)
        self.progress = progress or Silent()

    def collect(self) -> Report:
        try:
            ns = Namespace.open(self.data_dir / NAMESPACE_DIR, readonly=True)
        except FsError as exc:
            raise ReportError(f"cannot open the namespace of {self.data_dir}: {exc}") \
                from None
        except lmdb.Error as exc:
            raise ReportError(f"namespace of {self.data_dir} is unreadable: {exc}") from None
        try:
            return self._collect(ns)
        except lmdb.Error as exc:
            raise ReportError(f"namespace of {self.data_dir} is unreadable: {exc}") from None
        finally:
            self.progress.close()
            ns.close()

    def _collect(self, ns: Namespace) -> Report:
        config = ns.config
        holder = MountLock(self.data_dir).holder()
        report = Report(
            data=str(self.data_dir), fs_uuid=config.fs_uuid,
            mounted=None if holder is None else {"pid": holder[0], "mount_point": holder[1]},
            default_policy=config.default_policy, default_replication=config.replication,
            block_size=config.block_size, rename_mode=config.rename_mode)
        types = {c.id: StorageType.parse(c.storage_type) for c in config.volumes}
        replicas = self._count_replicas(ns)
        opened = self._volumes(report, config, replicas)
        self._space(report, opened)
        self._files(ns, report, types)
        with self._txn(ns) as txn:
            report.pending_satisfier = txn.stat(ns.db["satisfier"])["entries"]
        return report

    # --- volumes and space ------------------------------------------------------------------

    def _volumes(self, report: Report, config, replicas: Counter) -> list[Volume]:
        """Open each volume (its identity checked, its files counted); one that cannot be
        opened is reported as unavailable, with the reason, instead of failing the report."""
        opened = []
        self.progress.phase("volumes", len(config.volumes), "volume")
        for c in config.volumes:
            path = resolve_volume_path(self.data_dir, c.path)
            row = VolumeRow(c.id, c.storage_type, str(path), c.capacity,
                            replicas=replicas.get(c.id, 0))
            try:
                volume = Volume.open(path, fs_uuid=config.fs_uuid, volume_uuid=c.uuid,
                                     volume_id=c.id,
                                     storage_type=StorageType.parse(c.storage_type),
                                     capacity=c.capacity)
                row.capacity = volume.total_bytes()
                row.used = volume.used_bytes()
                row.free = volume.free_bytes()
                opened.append(volume)
            except FsError as exc:
                row.error = str(exc)
            report.volumes.append(row)
            self.progress.advance(1)
        return opened

    def _space(self, report: Report, opened: list[Volume]) -> None:
        """Per type and in total; a disk shared by several volumes counts its free space
        once (``VolumeSet.space``)."""
        by_type: dict[str, list[Volume]] = defaultdict(list)
        for volume in opened:
            by_type[volume.storage_type.name].append(volume)
        for row in sorted(report.volumes, key=lambda r: (StorageType.parse(r.storage_type),
                                                          r.id)):
            space = report.storage_types.setdefault(row.storage_type, SpaceRow())
            space.volumes += 1
            space.replicas += row.replicas
            space.unavailable += row.error is not None
        for name, volumes in by_type.items():
            space = report.storage_types[name]
            space.capacity, space.free = VolumeSet(volumes).space()
            space.used = sum(v.used_bytes() for v in volumes)
        report.total = SpaceRow(volumes=len(report.volumes),
                                replicas=sum(r.replicas for r in report.volumes),
                                unavailable=sum(r.error is not None for r in report.volumes))
        if opened:
            report.total.capacity, report.total.free = VolumeSet(opened).space()
            report.total.used = sum(v.used_bytes() for v in opened)

    def _count_replicas(self, ns: Namespace) -> Counter:
        counts: Counter = Counter()
        db = ns.db["replicas"]
        with self._txn(ns) as txn:
            total = txn.stat(db)["entries"]
        self.progress.phase("replicas", total, "replica")
        after = None
        while True:
            rows = 0
            with self._txn(ns) as txn, txn.cursor(db=db) as cur:
                found = cur.set_range(after) if after is not None else cur.first()
                if found and after is not None and cur.key() == after:
                    found = cur.next()
                while found and rows < BATCH * 10:
                    key = bytes(cur.key())
                    counts[schema.split_replica_key(key)[0]] += 1
                    after = key
                    rows += 1
                    found = cur.next()
            self.progress.advance(rows)
            if not found:
                return counts

    # --- files, policies and blocks -----------------------------------------------------------

    def _files(self, ns: Namespace, report: Report, types: dict[int, StorageType]) -> None:
        resolver = Resolver(ns)
        summary = StoragePolicySummary(resolver.suite)
        policies: dict[str, PolicyRow] = {}
        with self._txn(ns) as txn:
            total = txn.stat(ns.db["inodes"])["entries"]
        self.progress.phase("inodes", total, "inode")
        for batch in self._inode_batches(ns):
            for inode, blocks in batch:
                if stat.S_ISDIR(inode.mode):
                    report.directories += 1
                    continue
                if not stat.S_ISREG(inode.mode):
                    report.other_inodes += 1
                    continue
                try:
                    policy, replication = self._placement(ns, resolver, inode.ino)
                except FsError:
                    continue  # removed while we read
                report.files += 1
                row = policies.setdefault(policy.name, PolicyRow())
                row.files += 1
                row.bytes += inode.size
                for rec in blocks:
                    have = [types[v] for v in rec.volumes if v in types]
                    placement = summary.add(have, policy, replication)
                    row.blocks += 1
                    row.misplaced_blocks += placement.misplaced
            self.progress.advance(len(batch))
        report.policies = {p.name: policies[p.name] for p in resolver.suite.all_policies()
                           if p.name in policies}
        report.blocks = summary.total
        report.satisfying, report.not_satisfying = summary.rows()
        report.blocks_satisfying = sum(r.blocks for r in report.satisfying)
        report.blocks_not_satisfying = sum(r.blocks for r in report.not_satisfying)

    def _placement(self, ns: Namespace, resolver: Resolver, ino: int):
        try:
            return resolver.placement(ino)
        except lmdb.MapResizedError:
            ns.env.set_mapsize(0)   # the daemon grew the map: adopt its size
            return resolver.placement(ino)

    def _inode_batches(self, ns: Namespace) -> Iterator[list[tuple[Inode, list[BlockRecord]]]]:
        """Inodes in key order with their block records, ``BATCH`` per read transaction.
        Inodes without a name (open but unlinked) are left out."""
        after = 0
        while True:
            batch = []
            with self._txn(ns) as txn, txn.cursor(db=ns.db["inodes"]) as cur, \
                    txn.cursor(db=ns.db["blocks"]) as blocks:
                found = cur.set_range(u64(after + 1))
                while found and len(batch) < BATCH:
                    ino = schema.read_u64(cur.key())
                    inode = Inode.unpack(ino, cur.value())
                    after = ino
                    if inode.nlink > 0:
                        batch.append((inode, self._blocks(blocks, ino)
                                      if stat.S_ISREG(inode.mode) else []))
                    found = cur.next()
            if batch:
                yield batch
            if not found:
                return

    @staticmethod
    def _blocks(cur, ino: int) -> list[BlockRecord]:
        prefix = u64(ino)
        out = []
        if cur.set_range(prefix):
            for key, value in cur:
                if key[:8] != prefix:
                    break
                out.append(BlockRecord.unpack(value))
        return out

    @contextmanager
    def _txn(self, ns: Namespace):
        """A short read transaction; adopts a map the daemon grew meanwhile."""
        try:
            txn = ns.env.begin()
        except lmdb.MapResizedError:
            ns.env.set_mapsize(0)
            txn = ns.env.begin()
        with txn:
            yield txn


# =========================================================================== rendering


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"  # not reached


def _percent(used: int | None, capacity: int | None) -> str:
    if not capacity or used is None:
        return "-"
    return f"{100.0 * used / capacity:.1f}%"


def render(report: Report) -> str:
    out: list[str] = []
    where = "not mounted"
    if report.mounted and report.mounted["pid"]:
        where = (f"mounted on {report.mounted['mount_point']} "
                 f"(daemon pid {report.mounted['pid']})")
    elif report.mounted:  # DATA is read-only: the daemon could not write where it runs
        where = "mounted (read-only DATA: mount point not recorded)"
    out.append(f"tierfs report of {report.data}: filesystem {report.fs_uuid}, {where}")
    out.append(f"Default policy {report.default_policy}, default replication "
               f"{report.default_replication}, block size {human(report.block_size)}, "
               f"policy on rename: {report.rename_mode}")
    out.append("")
    head = (f"{'':<10} {'Volumes':>7} {'Capacity':>12} {'Used':>12} {'Free':>12} "
            f"{'Used%':>7} {'Replicas':>10}")
    out.append("Storage types:")
    out.append(f"{'Type':<10}" + head[10:])
    rows = list(report.storage_types.items()) + [("Total", report.total)]
    for name, row in rows:
        out.append(f"{name:<10} {row.volumes:>7} {human(row.capacity):>12} "
                   f"{human(row.used):>12} {human(row.free):>12} "
                   f"{_percent(row.used, row.capacity):>7} {row.replicas:>10}"
                   + (f"  ({row.unavailable} unavailable)" if row.unavailable else ""))
    out.append("")
    out.append("Volumes:")
    out.append(f"{'ID':>4} {'Type':<9} {'Capacity':>12} {'Used':>12} {'Free':>12} "
               f"{'Used%':>7} {'Replicas':>10}  Path")
    for v in report.volumes:
        limit = "" if v.capacity_limit is None else " (limit)"
        line = (f"{v.id:>4} {v.storage_type:<9} {human(v.capacity):>12} {human(v.used):>12} "
                f"{human(v.free):>12} {_percent(v.used, v.capacity):>7} {v.replicas:>10}  "
                f"{v.path}{limit}")
        if v.error:
            line += f"  UNAVAILABLE: {v.error}"
        out.append(line)
    out.append("")
    out.append(f"Files: {report.files}, directories: {report.directories}, "
               f"symlinks and special files: {report.other_inodes}")
    out.append("Bytes per effective storage policy:")
    out.append(f"{'Policy':<14} {'Files':>9} {'Bytes':>16} {'Size':>12} {'Blocks':>9} "
               f"{'Misplaced':>10}")
    for name, row in report.policies.items():
        out.append(f"{name:<14} {row.files:>9} {row.bytes:>16} {human(row.bytes):>12} "
                   f"{row.blocks:>9} {row.misplaced_blocks:>10}")
    if not report.policies:
        out.append("(no files)")
    out.append("")
    out.append(f"Blocks: {report.blocks}, placed as their policy wants: "
               f"{report.blocks_satisfying}, not: {report.blocks_not_satisfying}")
    out.append("")
    out.extend(tables(report.satisfying, report.not_satisfying))
    out.append("")
    if report.pending_satisfier:
        out.append(f"Subtrees waiting for the satisfier: {report.pending_satisfier}")
    else:
        out.append("No subtree is waiting for the satisfier.")
    return "\n".join(out)


# =========================================================================== the CLI


def run(args) -> int:
    """``tierfs report``: print the report; exit codes in the module docstring."""
    progress = Progress()
    try:
        data, _ = find_data_dir(args.target)
        report = Collector(data, progress).collect()
    except ReportError as exc:
        progress.close()
        print(f"tierfs report: {exc}", file=sys.stderr)
        return CANNOT_RUN
    finally:
        progress.close()
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(render(report), flush=True)
    return 0
