"""``tierfs fsck DATA [PATH] [--repair] [--files [--blocks [--locations]]] [--storagepolicies]``.

Checks a filesystem's namespace against itself and against its volumes, as HDFS's ``hdfs
fsck`` checks the NameNode's view against the DataNodes' block reports and as e2fsck checks
an ext4 image. :class:`Fsck` is the library (``check()`` and ``repair()``), used by the CLI
and by the tests; :func:`run_fsck` is the ``tierfs fsck`` subcommand.

What is checked
    Volumes against the namespace: recorded replicas without files (missing), replicas whose
    chunks fail their CRC32C (every chunk is read; the bad ones are named), whose meta file
    has too few checksums or an unreadable header (corrupt), whose meta file carries an older
    generation stamp than the namespace (stale) or a newer one (a note when the file is under
    a lease, which lease recovery adopts; unusable otherwise), whose data length differs from
    the recorded block length (wrong length, for blocks not under a lease); leftover meta
    files of older stamps; replica files of blocks the namespace does not know, or does not
    know on that volume, and files outside their layout directory (orphan replicas); anything
    left in a volume's ``tmp/``.
    The namespace against itself (``fs/schema.py`` invariants): dentries naming missing
    inodes (dangling) or living in non-directories; dentry, dircookie and backlink rows that
    do not match one another; ``next_cookie`` below a used cookie; nlink (directories: 2 +
    subdirectories; others: number of dentries; orphans: 0); the ``parent`` field;
    directories with several names; inodes not reachable from the root (nameless ones with
    nlink > 0 go to ``/lost+found``, nlink-0 ones not listed as orphans are purged, directory
    loops are broken); orphans with nlink > 0 or with names; symlink records; block records
    of missing or non-regular inodes and blocks past the end of their file; rows of other
    databases keyed by missing inodes; the replicas index against the block records; and the
    meta counters (``next_ino``, ``next_block_id``, ``gs``, ``txid``) against what they count.
    When no daemon runs: leases and orphans left by a dead daemon, pending trash, and a state
    still ``mounted``: everything the next mount's recovery would do.
    Replication and placement of every block not under a lease, from its good replicas and
    its file's effective policy and replication (the rule is ``tierfs.satisfier.summary``'s,
    shared with ``tierfs report``): under-replicated (fewer good persistent replicas than the
    replication while one good replica exists; RAM_DISK is transient and counts for nothing,
    so a block only on RAM_DISK is under-replicated, as an HDFS lazy-persist block), over-
    replicated (more), mis-placed (a replica on a type the policy does not want while a
    wanted one is missing, so that only a move fixes it).

Mounted filesystems
    The namespace is opened read-only (LMDB allows readers beside the daemon) and its state is
    read in one snapshot, then released before the long data pass. Leases, orphans, trash
    and ``tmp/`` files are then in use: they are reported as notes. Blocks under a lease are
    not verified (their writer changes them). Anything found in the volumes is checked a
    second time, and only what both passes found is reported, so a block created or moved
    during the check is not mistaken for damage; replica files younger than a minute are
    not called orphans (a new block's files exist before the namespace records them).

PATH
    Resolved in the namespace from the root (``/``, ``/a/b``). It limits the file checks
    (blocks, replicas, data verification, the listing and the totals) to that subtree. The
    whole-namespace checks (structure, counters, orphan replica files, ``tmp/``, leases,
    orphans, trash) run only for ``/``.

Repair (``--repair``; refused while mounted: exit 2)
    Takes the mount lock for its whole run, so no daemon can start meanwhile. Each fix is one
    namespace write transaction (``ns.run`` with journal op ``Op.REPAIR``) that first checks
    that the problem is still there; purges and lease recovery reuse the namespace's and
    ``fs/recovery.py``'s own code and are journaled under their own op codes. Replica files
    are deleted after the transaction that stops referring to them commits. A missing,
    corrupt, stale or wrong-length replica is dropped only when its block keeps another good
    replica; a block without any is reported as lost and left alone (reads give EIO), so
    nothing that might still be salvaged is destroyed. An under-replicated block gets copies
    of a good replica (``backends/copy.py``: verified, installed durably) on the volumes that
    ``fs/placement.py``'s ``choose_volumes`` picks for it, the daemon's rule for
    re-replication (the policy's types, replication fallbacks, most free space, distinct
    volumes), each recorded (``Namespace.add_replica``) only if the block's stamp is
    unchanged; volumes that held a bad or unrecorded replica of the block are used only when
    no other volume qualifies (HDFS does not pick nodes with a corrupt replica as targets
    either). An over-replicated block loses its surplus, never going below its replication:
    replicas of the types ``policy.choose_excess`` names, so those on a type the policy does
    not want go first, of one type the one on the fullest volume; the record changes in one
    transaction with a trash row, the files are deleted right after. Mis-placed blocks are
    not moved: moving is the satisfier's and the mover's work, as in HDFS. Ctrl-C during a
    copy leaves at most a copy in the target's ``tmp/`` (removed on the way out) or an
    unrecorded replica file, which the next fsck reports and removes. Fixes can uncover
    further problems (a removed dentry leaves its file nameless), so check and repair
    alternate until nothing repairable is left or no progress is made. The listing and
    summary then describe the repaired filesystem.

Output
    HDFS-like: a header, the ``--files`` listing, one line per problem (``KIND: where: what``,
    with ``[repaired: ...]`` or ``[not repaired: ...]`` after a repair), notes, then the
    summary (``Status``, ``Total size``, ...) and last ``The filesystem under path 'P' is
    HEALTHY`` (or ``CORRUPT``). Replication and placement findings are lines in HDFS's own
    style, ``P: Under replicated blk_<id>_<gs> (block i). Target Replicas is 2 but found 1
    live persistent replica(s).`` (also ``Over replicated`` and ``Mis-placed``), so that a
    line ``KIND: ...`` (other than ``NOTE``) always means a problem; they are counted in the
    summary (``Over-replicated blocks``, ``Under-replicated blocks``, ``Mis-placed blocks``)
    and do not change a file's ``OK`` in the listing. ``--storagepolicies`` adds the two
    tables of ``hdfs fsck -storagepolicies`` (blocks satisfying their policy and not, per
    combination of their good replicas' types, in scope) after the summary's counts and
    before ``FSCK ended``, where HDFS prints them. ``--files`` lists each file once (by one of
    its names) with its size and block count, ``--blocks`` adds ``blk_<id>_<gs> len=<n>``
    per block, ``--locations`` adds ``[<volume path>,<volume uuid>,<STORAGE_TYPE>]`` per
    replica (each implies the ones before). Progress goes to stderr: a tqdm bar on a
    terminal, else a status line every few seconds (also while ``--repair`` copies).

Exit codes
    0 healthy (notes are not problems; neither are under-, over-replicated or mis-placed
    blocks: HDFS's fsck calls a filesystem with them HEALTHY, since the replication monitor
    and the satisfier restore them while data stays readable); 1 problems found, including
    with ``--repair`` when every one was repaired (like e2fsck's "errors corrected"; the last
    line then says HEALTHY, and a second fsck exits 0 unless blocks were lost), but not when
    ``--repair`` only re-replicated or removed excess replicas; 2 usage or cannot run (DATA
    is not a tierfs filesystem, the namespace is unreadable, a volume is missing or foreign,
    PATH does not exist, ``--repair`` on a mounted filesystem), one line on stderr; 130
    interrupted (Ctrl-C stops cleanly between two steps).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import lmdb
import msgpack

from tierfs.backends.copy import copy_error, copy_replica
from tierfs.backends.meta import CRC_SIZE, HEADER_SIZE, num_chunks
from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs import schema
from tierfs.fs.errors import ChecksumError, FsError, UsageError
from tierfs.fs.mountlock import MountLock
from tierfs.fs.namespace import Namespace
from tierfs.fs.placement import choose_volumes
from tierfs.fs.recovery import RecoveryReport, delete_trash, recover_lease
from tierfs.fs.resolver import Resolver
from tierfs.fs.schema import BlockRecord, Inode, Op, ROOT_INO, u64
from tierfs.satisfier.policies import BlockStoragePolicy, storage_type_summary
from tierfs.satisfier.summary import StoragePolicySummary
from tierfs.tools.mkfs import NAMESPACE_DIR, is_filesystem
from tierfs.tools import progress as _progress
from tierfs.tools.progress import Silent

VERIFY_SPAN = 4 << 20
"""Bytes verified per read: big enough to be fast, small enough for RAM."""

MAX_REPAIR_PASSES = 5

ORPHAN_GRACE = 60.0
"""Beside a daemon, replica files younger than this (ctime) are not called orphans: a new
block's files exist, and are fsynced, before the namespace records them, and on a loaded
machine that can outlast both passes of the check."""

SCAN_ATTEMPTS = 5
"""Beside a daemon a file can vanish between listing a directory and its stat: rescan."""
LOST_FOUND = b"lost+found"

# Listing levels (--files, --blocks, --locations).
LIST_FILES, LIST_BLOCKS, LIST_LOCATIONS = 1, 2, 3



class Progress(_progress.Progress):
    """Status lines of this tool start with its name."""

    label = "tierfs fsck"

# =========================================================================== progress


# =========================================================================== report


@dataclass
class Problem:
    """One thing wrong. ``action`` is ``(name, *args)`` for the repairer, None if fsck
    cannot repair it; ``key`` identifies it across two checks (mounted re-check, repair
    passes). ``health`` False: a replication or placement finding, which leaves the
    filesystem HEALTHY and is printed in HDFS's style; ``work``: bytes its fix copies."""

    kind: str
    where: str
    message: str
    key: tuple
    action: tuple | None = None
    outcome: str | None = None
    repaired: bool = False
    health: bool = True
    work: int = 0

    def line(self) -> str:
        text = (f"{self.kind}: {self.where}: {self.message}" if self.health
                else f"{self.where}: {self.message}")
        return f"{text} [{self.outcome}]" if self.outcome else text


@dataclass
class Stats:
    total_size: int = 0
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
        """No problem but replication and placement findings (the exit code's rule)."""
        return not any(p.health for p in self.problems)

    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def summary_lines(self) -> list[str]:
        """The HDFS-style summary and the final verdict line."""
        s = self.stats
        blocks = max(s.blocks, 1)
        avg_block = s.total_size // s.blocks if s.blocks else 0
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


# =========================================================================== snapshot


@dataclass
class Snapshot:
    """Everything fsck reads from the namespace, taken in one read transaction.

    One transaction gives a consistent view even beside a running daemon; copying it out
    releases the transaction before the long data pass (a long LMDB read transaction would
    stop page reuse and grow the file).
    """

    block_size: int
    counters: dict[str, int]
    state: str
    inodes: dict[int, Inode]
    dentries: dict[tuple[int, bytes], tuple[int, int]]
    cookies: dict[tuple[int, int], tuple[int, bytes]]
    backlinks: set[tuple[int, int, bytes]]
    symlinks: dict[int, bytes]
    blocks: dict[tuple[int, int], BlockRecord]
    replicas: dict[tuple[int, int], tuple[int, int]]
    leases: dict[int, tuple[bytes, int]]
    orphans: set[int]
    trash: dict[int, tuple[int, tuple[int, ...]]]
    keyed: dict[str, set[int]]
    last_journal: int
    links: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    children: dict[int, list[tuple[bytes, int]]] = field(default_factory=dict)
    blocks_of: dict[int, list[tuple[int, BlockRecord]]] = field(default_factory=dict)

    @classmethod
    def load(cls, ns: Namespace) -> "Snapshot":
        """Read the namespace; beside a daemon that grew the map meanwhile, adopt the new
        size (LMDB's documented answer to MDB_MAP_RESIZED) and read again."""
        try:
            return cls._load(ns)
        except lmdb.MapResizedError:
            ns.env.set_mapsize(0)
            return cls._load(ns)

    @classmethod
    def _load(cls, ns: Namespace) -> "Snapshot":
        with ns.env.begin() as txn:
            def rows(name: str) -> list[tuple[bytes, bytes]]:
                with txn.cursor(db=ns.db[name]) as cur:
                    return [(bytes(k), bytes(v)) for k, v in cur]

            def decode(name: str, fn: Callable[[list], object]):
                try:
                    return fn(rows(name))
                except (struct.error, ValueError, msgpack.UnpackException) as exc:
                    raise FsError(errno.EIO, f"namespace database '{name}' holds a "
                                             f"malformed row ({exc})") from None

            with txn.cursor(db=ns.db["journal"]) as cur:
                last_journal = schema.read_u64(cur.key()) if cur.last() else 0
            meta = dict(rows("meta"))
            snap = cls(
                block_size=ns.config.block_size,
                counters={k: schema.read_u64(meta[k.encode()]) if k.encode() in meta else 0
                          for k in schema.COUNTERS},
                state=schema.unpack_meta(meta[b"state"]) if b"state" in meta else "clean",
                inodes=decode("inodes", lambda r: {
                    schema.read_u64(k): Inode.unpack(schema.read_u64(k), v) for k, v in r}),
                dentries=decode("dentries", lambda r: {
                    schema.split_dentry_key(k): schema.parse_dentry_value(v) for k, v in r}),
                cookies=decode("dircookies", lambda r: {
                    schema.split_cookie_key(k): schema.parse_cookie_value(v) for k, v in r}),
                backlinks=decode("backlinks", lambda r: {
                    schema.split_backlink_key(k) for k, _ in r}),
                symlinks=decode("symlinks", lambda r: {schema.read_u64(k): v for k, v in r}),
                blocks=decode("blocks", lambda r: {
                    schema.split_block_key(k): BlockRecord.unpack(v) for k, v in r}),
                replicas=decode("replicas", lambda r: {
                    schema.split_replica_key(k): schema.split_block_key(v) for k, v in r}),
                leases=decode("leases", lambda r: {
                    schema.read_u64(k): schema.parse_lease_value(v) for k, v in r}),
                orphans=decode("orphans", lambda r: {schema.read_u64(k) for k, _ in r}),
                trash=decode("trash", lambda r: {
                    schema.read_u64(k): schema.parse_trash_value(v) for k, v in r}),
                keyed={name: decode(name, lambda r: {schema.read_u64(k[:8]) for k, _ in r})
                       for name in ("xattrs", "inherited")},
                last_journal=last_journal,
            )
        snap._derive()
        return snap

    def _derive(self) -> None:
        """Indexes the checks need: valid names of each inode, children, blocks per file.

        A name is valid in an existing directory, and in the root even when the root inode
        is missing: the root is recreated, so its entries are not reported one by one.
        """
        root_missing = ROOT_INO not in self.inodes
        for (parent, name), (child, _) in self.dentries.items():
            in_dir = self.is_dir(parent) or (parent == ROOT_INO and root_missing)
            if not in_dir or child not in self.inodes:
                continue
            self.links.setdefault(child, []).append((parent, name))
            self.children.setdefault(parent, []).append((name, child))
        for (ino, index), rec in sorted(self.blocks.items()):
            self.blocks_of.setdefault(ino, []).append((index, rec))

    def is_dir(self, ino: int) -> bool:
        inode = self.inodes.get(ino)
        return inode is not None and stat.S_ISDIR(inode.mode)

    def primary_link(self, ino: int) -> tuple[int, bytes] | None:
        """The name used for paths: the one in the inode's ``parent`` directory if any."""
        links = self.links.get(ino)
        if not links:
            return None
        parent = self.inodes[ino].parent
        return next((link for link in links if link[0] == parent), links[0])

    def path_of(self, ino: int) -> str:
        """``/a/b`` for an inode reachable through names, ``<inode N>`` otherwise."""
        parts: list[bytes] = []
        seen = set()
        cur = ino
        while cur != ROOT_INO:
            link = None if cur in seen else self.primary_link(cur)
            if link is None:
                return f"<inode {ino}>"
            seen.add(cur)
            parts.append(link[1])
            cur = link[0]
        return "/" + "/".join(_show(p) for p in reversed(parts))

    def entry_path(self, parent: int, name: bytes) -> str:
        base = self.path_of(parent) if parent in self.inodes else f"<inode {parent}>"
        return f"{base.rstrip('/')}/{_show(name)}"

    def resolve(self, path: str) -> int | None:
        """Inode of a path walked from the root through valid dentries, or None."""
        ino = ROOT_INO
        for part in path.strip("/").split("/") if path.strip("/") else []:
            if not self.is_dir(ino):
                return None
            found = self.dentries.get((ino, os.fsencode(part)))
            if found is None or found[0] not in self.inodes:
                return None
            ino = found[0]
        return ino if ino in self.inodes else None

    def subtree(self, top: int) -> list[int]:
        """``top`` and every inode below it (each once, loop-safe)."""
        seen = {top}
        order = [top]
        for ino in order:
            for _, child in self.children.get(ino, ()):
                if child not in seen:
                    seen.add(child)
                    order.append(child)
        return order


def _show(name: bytes) -> str:
    """A name for display: undecodable bytes shown escaped, never an encoding error."""
    return name.decode("utf-8", "backslashreplace")


def _ranges(numbers: list[int]) -> str:
    """``0, 3-5, 9`` for [0, 3, 4, 5, 9]."""
    out: list[str] = []
    for n in sorted(numbers):
        if out and n == end + 1:
            end = n
            out[-1] = f"{start}-{end}"
            continue
        start = end = n
        out.append(str(n))
    return ", ".join(out)


# =========================================================================== volumes


@dataclass
class Found:
    """The files of one block on one volume, at their layout paths."""

    data_path: Path | None = None
    data_len: int = 0
    metas: dict[int, Path] = field(default_factory=dict)

    def paths(self) -> list[str]:
        paths = [str(p) for p in self.metas.values()]
        return [str(self.data_path), *paths] if self.data_path else paths


def scan_volume(volume: Volume) -> tuple[dict[int, Found], list[Path]]:
    """Replica files by block id, and files that are not where the layout puts them."""
    for attempt in range(SCAN_ATTEMPTS):
        try:
            return _scan_volume_once(volume)
        except FileNotFoundError:
            if attempt == SCAN_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _scan_volume_once(volume: Volume) -> tuple[dict[int, Found], list[Path]]:
    found: dict[int, Found] = {}
    misplaced: list[Path] = []
    for info in volume.iter_replicas():
        entry = found.setdefault(info.block_id, Found())
        if info.data_path is not None:
            if info.data_path == volume.data_path(info.block_id):
                entry.data_path, entry.data_len = info.data_path, info.length
            elif info.data_path not in misplaced:
                misplaced.append(info.data_path)
        if info.meta_path is not None:
            if info.meta_path == volume.meta_path(info.block_id, info.gs):
                entry.metas[info.gs] = info.meta_path
            else:
                misplaced.append(info.meta_path)
    return {bid: f for bid, f in found.items() if f.data_path or f.metas}, misplaced


@dataclass
class Verdict:
    """What reading a whole replica found."""

    length: int = 0
    bad_chunks: list[int] = field(default_factory=list)
    crc_count: int = 0
    chunks: int = 0
    error: str | None = None      # cannot open or read: the replica is unusable

    def corruption(self) -> str | None:
        """Why the replica's data cannot be trusted, or None."""
        if self.error:
            return self.error
        reasons = []
        mismatched = [c for c in self.bad_chunks if c < self.crc_count]
        if mismatched:
            reasons.append(f"checksum mismatch in chunk(s) {_ranges(mismatched)}")
        if self.crc_count < self.chunks:
            reasons.append(f"meta file has checksums for {self.crc_count} of "
                           f"{self.chunks} chunks")
        return "; ".join(reasons) or None


def verify_replica(volume: Volume, block_id: int, gs: int,
                   advance: Callable[[int], None]) -> Verdict:
    """Read every chunk of a replica through ``Replica.read`` (which checks CRC32C)."""
    try:
        replica = volume.open_replica(block_id, gs, writable=False)
    except FsError as exc:
        return Verdict(error=f"cannot open: {exc}")
    with replica:
        bpc = replica.bytes_per_checksum
        verdict = Verdict(length=replica.length, chunks=num_chunks(replica.length, bpc))
        try:
            meta_len = os.stat(volume.meta_path(block_id, gs)).st_size
        except OSError as exc:
            return Verdict(error=f"cannot stat meta file: {exc.strerror}")
        verdict.crc_count = max(0, (meta_len - HEADER_SIZE) // CRC_SIZE)
        span = max(1, VERIFY_SPAN // bpc) * bpc
        for pos in range(0, verdict.length, span):
            count = min(span, verdict.length - pos)
            try:
                replica.read(pos, count)
            except ChecksumError:
                verdict.bad_chunks += _bad_chunks(replica, pos, count, bpc)
            except FsError as exc:
                verdict.error = f"read error: {exc}"
                return verdict
            advance(count)
    return verdict


def _bad_chunks(replica, pos: int, count: int, bpc: int) -> list[int]:
    """The chunks of a span that fail, one read per chunk (only after a span failed)."""
    bad = []
    for offset in range(pos, pos + count, bpc):
        try:
            replica.read(offset, min(bpc, pos + count - offset))
        except ChecksumError:
            bad.append(offset // bpc)
    return bad


@dataclass
class ReplicaState:
    """One recorded replica of a block, judged."""

    volume_id: int
    status: str          # ok, long, unverified, missing, corrupt, stale, newer, short
    reason: str = ""
    unopenable: bool = False

    @property
    def good(self) -> bool:
        """Servable now: reads through this replica return the recorded bytes."""
        return self.status in ("ok", "long", "unverified")


_REPLICA_KINDS = {"missing": "MISSING_REPLICA", "corrupt": "CORRUPT_REPLICA",
                  "stale": "STALE_REPLICA", "newer": "NEWER_REPLICA",
                  "short": "WRONG_LENGTH", "long": "WRONG_LENGTH"}


# =========================================================================== the checker


class _Checker:
    """One check: the snapshot's structure, then the files in scope and the volumes."""

    def __init__(self, fsck: "Fsck", ns: Namespace, volumes: VolumeSet, mounted: bool):
        self.fsck = fsck
        self.ns = ns
        self.volumes = volumes
        self.mounted = mounted
        self.progress = fsck.progress
        self.snap = Snapshot.load(ns)
        self.report = FsckReport(fsck.data_dir, fsck.path, mounted,
                                 storage_policies=fsck.storage_policies)
        self.report.stats.default_replication = ns.config.replication
        self.report.stats.volumes = len(volumes)
        self.whole = fsck.path == "/"
        self.resolver = Resolver(ns)
        self.report.placement = StoragePolicySummary(self.resolver.suite)
        self.found: dict[tuple[int, int], Found] = {}
        self.holders: dict[int, set[int]] = {}     # block id -> volumes with its files
        self.misplaced: dict[int, list[Path]] = {}

    def problem(self, kind: str, where: str, message: str, key: tuple,
                action: tuple | None = None, **extra) -> None:
        self.report.problems.append(Problem(kind, where, message, (kind, *key), action,
                                            **extra))

    def note(self, text: str) -> None:
        self.report.notes.append(text)

    def run(self) -> FsckReport:
        start = time.monotonic()
        top = self.snap.resolve(self.fsck.path)
        if top is None and not self.whole:
            raise UsageError(f"path '{self.fsck.path}' does not exist in "
                             f"{self.fsck.data_dir}")
        holder = self.fsck.holder() if self.mounted else None
        if holder:
            self.note(f"mounted (daemon pid {holder[0]} on {holder[1]}): checked beside it; "
                      "blocks open for writing are not verified")
        if self.whole:
            self.check_structure()
        self.scan_volumes()
        scope = self.snap.subtree(top) if not self.whole else self._all_inodes()
        self.check_files(scope)
        if self.whole:
            self.check_volume_leftovers()
        self.report.elapsed = time.monotonic() - start
        return self.report

    def _all_inodes(self) -> list[int]:
        """Reachable inodes in tree order, then the rest (orphans, detached)."""
        order = [i for i in self.snap.subtree(ROOT_INO) if i in self.snap.inodes]
        reached = set(order)
        return order + sorted(set(self.snap.inodes) - reached)

    # ----------------------------------------------------------------- structure

    def check_structure(self) -> None:
        self.check_root()
        self.check_dentries()
        self.check_cookie_rows()
        self.check_backlink_rows()
        self.check_inodes()
        self.check_loops()
        self.check_keyed_rows()
        self.check_block_records()
        self.check_replica_index()
        self.check_counters()
        self.check_pending()

    def check_root(self) -> None:
        root = self.snap.inodes.get(ROOT_INO)
        if root is None:
            self.problem("ROOT_MISSING", "/", "the root inode is missing", (),
                         ("make_root",))
        elif not stat.S_ISDIR(root.mode):
            self.problem("ROOT_NOT_DIR", "/", f"the root inode has mode {root.mode:o}", ())

    def check_dentries(self) -> None:
        snap = self.snap
        stale_next = set()
        for (parent, name), (child, cookie) in snap.dentries.items():
            where = snap.entry_path(parent, name)
            pinode = snap.inodes.get(parent)
            if pinode is None or not stat.S_ISDIR(pinode.mode):
                what = "a missing inode" if pinode is None else "a non-directory"
                if parent != ROOT_INO:   # a missing root is recreated, keeping its entries
                    self.problem("DENTRY_IN_NON_DIR", where,
                                 f"entry for inode {child} lives in {what} ({parent})",
                                 (parent, name), ("remove_dentry", parent, name, "non_dir"))
                continue
            if child not in snap.inodes:
                self.problem("DANGLING_DENTRY", where, f"names inode {child}, which does "
                             "not exist", (parent, name), ("remove_dentry", parent, name, "dangling"))
                continue
            if snap.cookies.get((parent, cookie)) != (child, name):
                self.problem("MISSING_COOKIE", where, f"readdir cookie {cookie} has no "
                             f"dircookies row naming inode {child}", (parent, name),
                             ("fix_cookie", parent, name))
            if (child, parent, name) not in snap.backlinks:
                self.problem("MISSING_BACKLINK", where, f"inode {child} has no backlink "
                             "for this name", (parent, name),
                             ("add_backlink", child, parent, name))
            if cookie >= pinode.next_cookie:
                stale_next.add(parent)
        for parent in sorted(stale_next):
            self.problem("BAD_NEXT_COOKIE", snap.path_of(parent),
                         f"next_cookie {snap.inodes[parent].next_cookie} is not above every "
                         "cookie in use", (parent,), ("fix_next_cookie", parent))

    def check_cookie_rows(self) -> None:
        for (parent, cookie), (_, name) in self.snap.cookies.items():
            entry = self.snap.dentries.get((parent, name))
            if entry is None or entry[1] != cookie:
                self.problem("STRAY_COOKIE", self.snap.entry_path(parent, name),
                             f"dircookies row {cookie} has no matching dentry",
                             (parent, cookie), ("delete_cookie", parent, cookie))

    def check_backlink_rows(self) -> None:
        for child, parent, name in self.snap.backlinks:
            entry = self.snap.dentries.get((parent, name))
            if entry is None or entry[0] != child:
                self.problem("STRAY_BACKLINK", self.snap.entry_path(parent, name),
                             f"backlink of inode {child} has no matching dentry",
                             (child, parent, name), ("delete_backlink", child, parent, name))

    def check_inodes(self) -> None:
        snap = self.snap
        subdirs = {p: sum(snap.is_dir(c) for _, c in kids)
                   for p, kids in snap.children.items()}
        for ino, inode in snap.inodes.items():
            links = snap.links.get(ino, [])
            if ino == ROOT_INO:
                self._check_root_links(inode, links, subdirs.get(ino, 0))
            elif not links:
                self._check_nameless(ino, inode)
            else:
                self._check_named(ino, inode, links, subdirs.get(ino, 0))
            self._check_symlink(ino, inode)

    def _check_root_links(self, root: Inode, links, subdirs: int) -> None:
        for parent, name in links:
            self.problem("DIR_HARDLINK", self.snap.entry_path(parent, name),
                         "names the root directory", (parent, name),
                         ("remove_dentry", parent, name, "dir_link"))
        if root.parent != ROOT_INO:
            self.problem("WRONG_PARENT", "/", f"parent is {root.parent}, not itself",
                         (ROOT_INO,), ("fix_parent", ROOT_INO))
        if stat.S_ISDIR(root.mode) and root.nlink != 2 + subdirs:
            self.problem("WRONG_NLINK", "/", f"nlink is {root.nlink}, expected "
                         f"{2 + subdirs}", (ROOT_INO,), ("fix_nlink", ROOT_INO))

    def _check_nameless(self, ino: int, inode: Inode) -> None:
        """An inode no dentry names: an orphan, a leftover to purge, or lost."""
        where = f"<inode {ino}>"
        if ino in self.snap.orphans:
            if inode.nlink != 0:
                self.problem("ORPHAN_NLINK", where, f"listed as orphan but nlink is "
                             f"{inode.nlink} > 0", (ino,), ("fix_nlink", ino))
        elif inode.nlink == 0:
            self.problem("UNLISTED_UNLINKED", where, "nlink 0 and no name, but not listed "
                         "in orphans", (ino,), ("purge", ino))
        else:
            kind = "directory" if stat.S_ISDIR(inode.mode) else "inode"
            self.problem("NAMELESS_INODE", where, f"{kind} with nlink {inode.nlink} is "
                         "named by no dentry", (ino,), ("relink", ino))

    def _check_named(self, ino: int, inode: Inode, links, subdirs: int) -> None:
        snap = self.snap
        where = snap.path_of(ino)
        is_dir = stat.S_ISDIR(inode.mode)
        if ino in snap.orphans:
            self.problem("ORPHAN_LINKED", where, f"listed in orphans but named by "
                         f"{len(links)} dentries", (ino,), ("remove_orphan_row", ino))
        if is_dir and len(links) > 1:
            keep = snap.primary_link(ino)
            for parent, name in links:
                if (parent, name) != keep:
                    self.problem("DIR_HARDLINK", snap.entry_path(parent, name),
                                 f"second name of directory {where}", (parent, name),
                                 ("remove_dentry", parent, name, "dir_link"))
        expected = 2 + subdirs if is_dir else len(links)
        if inode.nlink != expected:
            self.problem("WRONG_NLINK", where, f"nlink is {inode.nlink}, expected "
                         f"{expected}", (ino,), ("fix_nlink", ino))
        if inode.parent not in {parent for parent, _ in links}:
            self.problem("WRONG_PARENT", where, f"parent field is {inode.parent}, which "
                         "holds no dentry of it", (ino,), ("fix_parent", ino))

    def _check_symlink(self, ino: int, inode: Inode) -> None:
        target = self.snap.symlinks.get(ino)
        where = self.snap.path_of(ino)
        if stat.S_ISLNK(inode.mode):
            if target is None:
                self.problem("SYMLINK_NO_TARGET", where, "symlink without a target record",
                             (ino,), ("clear_symlink", ino))
            elif inode.size != len(target):
                self.problem("WRONG_SIZE", where, f"symlink size {inode.size}, target is "
                             f"{len(target)} bytes", (ino,), ("fix_symlink_size", ino))
        elif target is not None:
            self.problem("STRAY_SYMLINK", where, "symlink target record on a "
                         "non-symlink", (ino,), ("delete_rows", "symlinks", ino))

    def check_loops(self) -> None:
        """Directories named only from inside their own subtree: a loop the root cannot
        reach. (Subtrees below a nameless directory are covered by that directory.)"""
        snap = self.snap
        reached = set(snap.subtree(ROOT_INO))
        done: set[int] = set()
        for ino in sorted(snap.inodes):
            if ino in reached or ino in done or not snap.is_dir(ino) or not snap.links.get(ino):
                continue
            chain: dict[int, int] = {}
            cur = ino
            while cur not in done and cur not in chain and snap.links.get(cur):
                chain[cur] = len(chain)
                cur = snap.primary_link(cur)[0]
            if cur in chain:
                cycle = list(chain)[chain[cur]:]
                victim = min(cycle)
                self.problem("DIRECTORY_LOOP", f"<inode {victim}>",
                             f"directories {', '.join(map(str, cycle))} name each other and "
                             "are unreachable from the root", (victim,), ("relink", victim))
            done.update(chain)

    def check_keyed_rows(self) -> None:
        snap = self.snap
        for name, inos in [*snap.keyed.items(), ("symlinks", set(snap.symlinks)),
                           ("orphans", snap.orphans)]:
            for ino in sorted(inos - snap.inodes.keys()):
                self.problem("STRAY_ROWS", f"<inode {ino}>", f"'{name}' rows of a missing "
                             "inode", (name, ino), ("delete_rows", name, ino))

    def check_block_records(self) -> None:
        snap = self.snap
        past_eof = set()
        for (ino, index), rec in snap.blocks.items():
            inode = snap.inodes.get(ino)
            if inode is None or not stat.S_ISREG(inode.mode):
                what = "missing inode" if inode is None else "non-regular inode"
                self.problem("BLOCK_OF_NON_FILE", f"<inode {ino}>",
                             f"block {index} (blk_{rec.block_id}) belongs to a {what}",
                             (ino, index), ("drop_block", ino, index))
            elif (ino not in snap.leases
                  and index * snap.block_size + rec.length > inode.size):
                past_eof.add(ino)
        for ino in sorted(past_eof):
            end = max(i * snap.block_size + r.length for i, r in snap.blocks_of[ino])
            self.problem("BLOCK_PAST_EOF", snap.path_of(ino), f"size is "
                         f"{snap.inodes[ino].size} but its blocks reach {end}", (ino,),
                         ("fix_size", ino))

    def check_replica_index(self) -> None:
        snap = self.snap
        expected: dict[tuple[int, int], tuple[int, int]] = {}
        for (ino, index), rec in snap.blocks.items():
            for vid in rec.volumes:
                expected.setdefault((vid, rec.block_id), (ino, index))
        for (vid, bid), target in expected.items():
            if snap.replicas.get((vid, bid)) != target:
                self.problem("REPLICA_INDEX", self.snap.path_of(target[0]),
                             f"replicas index lacks blk_{bid} on volume {vid}", (vid, bid),
                             ("index_set", vid, bid, *target))
        for vid, bid in sorted(snap.replicas.keys() - expected.keys()):
            self.problem("REPLICA_INDEX", f"volume {vid}", f"replicas index row for "
                         f"blk_{bid} matches no block record", (vid, bid),
                         ("index_delete", vid, bid))

    def check_counters(self) -> None:
        snap = self.snap
        ids = [r.block_id for r in snap.blocks.values()] + list(snap.trash)
        stamps = [r.gs for r in snap.blocks.values()] + [g for g, _ in snap.trash.values()]
        need = {"next_ino": max(snap.inodes, default=ROOT_INO) + 1,
                "next_block_id": max(ids, default=0) + 1,
                "gs": max(stamps, default=0), "txid": snap.last_journal}
        for name, minimum in need.items():
            if snap.counters[name] < minimum:
                self.problem("COUNTER_BEHIND", "meta", f"{name} is {snap.counters[name]}, "
                             f"must be at least {minimum}", (name,),
                             ("raise_counter", name, minimum))

    def check_pending(self) -> None:
        """Leases, orphans and trash: in use beside a daemon, recovery work without one."""
        snap = self.snap
        for ino in sorted(snap.leases):
            if self.mounted:
                self.note(f"{snap.path_of(ino)}: open for writing (lease held)")
            else:
                self.problem("LEASE_PENDING", snap.path_of(ino), "lease left by a dead "
                             "daemon: needs lease recovery", (ino,), ("recover_lease", ino))
        for ino in sorted(snap.orphans & snap.inodes.keys()):
            if snap.links.get(ino) or snap.inodes[ino].nlink:
                continue
            if self.mounted:
                self.note(f"<inode {ino}>: unlinked but still open (orphan in use)")
            else:
                self.problem("ORPHAN_PENDING", f"<inode {ino}>", "unlinked inode left by a "
                             "dead daemon: to purge", (ino,), ("purge", ino))
        if snap.trash:
            if self.mounted:
                self.note(f"{len(snap.trash)} dropped blocks waiting for file deletion")
            else:
                self.problem("TRASH_PENDING", "trash", f"{len(snap.trash)} dropped blocks "
                             "still have replica files to delete", (), ("delete_trash",))
        if not self.mounted and snap.state != "clean":
            self.problem("UNCLEAN_STATE", "meta", f"state is '{snap.state}' but no daemon "
                         "runs (not unmounted cleanly)", (), ("set_clean",))

    # ----------------------------------------------------------------- volumes and files

    def scan_volumes(self) -> None:
        self.progress.phase("scanning volumes", len(self.volumes), unit="vol")
        for volume in self.volumes:
            found, misplaced = scan_volume(volume)
            for bid, entry in found.items():
                self.found[(volume.id, bid)] = entry
                self.holders.setdefault(bid, set()).add(volume.id)
            self.misplaced[volume.id] = misplaced
            self.progress.advance(1)

    def check_files(self, scope: list[int]) -> None:
        snap = self.snap
        total = sum(r.length * len(r.volumes) for ino in scope
                    for _, r in snap.blocks_of.get(ino, ()))
        self.progress.phase("verifying replicas", total)
        for ino in scope:
            inode = snap.inodes[ino]
            if stat.S_ISDIR(inode.mode):
                self.report.stats.dirs += 1
                self._list(ino, f"{snap.path_of(ino)} <dir>")
            elif stat.S_ISLNK(inode.mode):
                self.report.stats.symlinks += 1
                target = _show(snap.symlinks.get(ino, b"?"))
                self._list(ino, f"{snap.path_of(ino)} <symlink> -> {target}")
            else:
                self.check_file(ino, inode)

    def _list(self, ino: int, line: str, blocks: list[str] = ()) -> None:
        level = self.fsck.listing
        if level >= LIST_FILES:
            self.report.listing.append((self.snap.path_of(ino),
                                        [line, *(blocks if level >= LIST_BLOCKS else ())]))

    def check_file(self, ino: int, inode: Inode) -> None:
        stats = self.report.stats
        stats.files += 1
        stats.total_size += inode.size
        blocks = self.snap.blocks_of.get(ino, []) if stat.S_ISREG(inode.mode) else []
        policy, target = self._placement(ino)
        before = len(self.report.problems)
        lines = [self.check_block(ino, index, rec, policy, target) for index, rec in blocks]
        kinds = sorted({p.kind for p in self.report.problems[before:] if p.health})
        status = " ".join(kinds) if kinds else "OK"
        self._list(ino, f"{self.snap.path_of(ino)} {inode.size} bytes, replication="
                        f"{target}, {len(blocks)} block(s):  {status}", lines)

    def _placement(self, ino: int) -> tuple[BlockStoragePolicy, int]:
        """The file's effective policy and replication; the defaults where the chain is
        broken (a parent loop is reported by the structure checks)."""
        try:
            return self.resolver.placement(ino)
        except FsError:
            return self.resolver.suite.default, self.ns.config.replication

    def check_block(self, ino: int, index: int, rec: BlockRecord, policy: BlockStoragePolicy,
                    target: int) -> str:
        """Judge every replica of one block; returns its listing line."""
        leased = ino in self.snap.leases
        path = self.snap.path_of(ino)
        states = [self.judge_replica(rec, vid, leased) for vid in rec.volumes]
        good = [s.volume_id for s in states if s.good]
        for state in states:
            self._report_replica(path, ino, index, rec, state, good, leased)
        self._check_extra_metas(path, rec, leased)
        self._count_block(rec, states, good)
        if not good and not leased:
            why = "no replica recorded" if not rec.volumes else "no good replica"
            self.problem("LOST_BLOCK", path, f"blk_{rec.block_id}_{rec.gs} (block {index}) "
                         f"has {why}: reads of it give EIO", (rec.block_id,))
        self._check_placement(path, ino, index, rec, states, policy, target, leased)
        return self._block_line(index, rec, states)

    def _count_block(self, rec: BlockRecord, states: list[ReplicaState],
                     good: list[int]) -> None:
        stats = self.report.stats
        stats.blocks += 1
        stats.recorded_replicas += len(rec.volumes)
        stats.missing_replicas += sum(s.status == "missing" for s in states)
        stats.good_replicas += len(good)
        stats.minimally_replicated += bool(good)
        stats.corrupt_blocks += not good

    def _check_placement(self, path: str, ino: int, index: int, rec: BlockRecord,
                         states: list[ReplicaState], policy: BlockStoragePolicy, target: int,
                         leased: bool) -> None:
        """Replication and placement of the good replicas (``satisfier/summary.py``'s rule):
        counted for the summary and the ``--storagepolicies`` tables, and, for blocks not
        under a lease (their writer is placing them), findings with their fixes."""
        good = [s.volume_id for s in states if s.good and s.volume_id in self.volumes.by_id]
        types = [self.volumes.by_id[v].storage_type for v in good]
        verdict = self.report.placement.add(types, policy, target)
        if leased:
            return
        stats = self.report.stats
        block = f"blk_{rec.block_id}_{rec.gs} (block {index})"
        found = (f"Target Replicas is {target} but found {verdict.persistent} live "
                 f"persistent replica(s)")
        transient = len(types) - verdict.persistent
        if transient:
            found += f" and {transient} on RAM_DISK"
        key = (ino, index, rec.block_id, rec.gs)
        if verdict.under_replicated:
            stats.under_replicated += 1
            # Volumes holding bad or unrecorded files of the block: targets of last resort.
            avoid = tuple(sorted(({s.volume_id for s in states if not s.good}
                                  | self.holders.get(rec.block_id, set())) - set(good)))
            self.problem("UNDER_REPLICATED", path, f"Under replicated {block}. {found}.", key,
                         ("replicate", ino, index, rec.block_id, rec.gs, tuple(good), avoid),
                         health=False, work=rec.length * (target - verdict.persistent))
        if verdict.over_replicated:
            stats.over_replicated += 1
            self.problem("OVER_REPLICATED", path, f"Over replicated {block}. {found}.", key,
                         ("drop_excess", ino, index, rec.block_id, rec.gs, tuple(good)),
                         health=False)
        if verdict.misplaced:
            stats.misplaced += 1
            wanted = storage_type_summary(policy.choose_storage_types(target))
            have = storage_type_summary(t for t in types if not t.transient)
            self.problem("MISPLACED", path, f"Mis-placed {block}. Replicas on {have}, policy "
                         f"{policy.name} wants {wanted}: moving it is the satisfier's work.",
                         key, health=False)

    def _block_line(self, index: int, rec: BlockRecord, states: list[ReplicaState]) -> str:
        line = (f"{index}. blk_{rec.block_id}_{rec.gs} len={rec.length} "
                f"Live_repl={sum(s.good for s in states)}")
        if self.fsck.listing >= LIST_LOCATIONS:
            for state in states:
                volume = self.volumes.by_id.get(state.volume_id)
                where = (f"[{volume.path},{volume.uuid},{volume.storage_type.name}]"
                         if volume else f"[unknown volume {state.volume_id}]")
                mark = "" if state.good else f"({state.status.upper()})"
                line += f" {where}{mark}"
        return line

    def judge_replica(self, rec: BlockRecord, vid: int, leased: bool) -> ReplicaState:
        """The state of the replica of ``rec`` recorded on volume ``vid``."""
        volume = self.volumes.by_id.get(vid)
        if volume is None:
            return ReplicaState(vid, "missing", f"recorded on volume id {vid}, which this "
                                "filesystem does not have")
        found = self.found.get((vid, rec.block_id))
        if found is None:
            return ReplicaState(vid, "missing", "no replica files")
        if found.data_path is None:
            return ReplicaState(vid, "missing", "data file missing", unopenable=True)
        if not found.metas:
            return ReplicaState(vid, "missing", "meta file missing")
        if rec.gs not in found.metas:
            newest = max(found.metas)
            if newest < rec.gs:
                return ReplicaState(vid, "stale", f"generation stamp {newest} is older than "
                                    f"the namespace's {rec.gs}")
            return ReplicaState(vid, "newer", f"generation stamp {newest} is newer than the "
                                f"namespace's {rec.gs}")
        if leased and self.mounted:
            return ReplicaState(vid, "unverified", "open for writing: not verified")
        return self._judge_data(volume, rec, found)

    def _judge_data(self, volume: Volume, rec: BlockRecord, found: Found) -> ReplicaState:
        verdict = self.fsck.verify(volume, rec.block_id, rec.gs, found, self.progress.advance)
        vid = volume.id
        corruption = verdict.corruption()
        if corruption:
            return ReplicaState(vid, "corrupt", corruption,
                                unopenable=verdict.error is not None)
        if verdict.crc_count > verdict.chunks:
            return ReplicaState(vid, "short", f"data file is {verdict.length} bytes but its "
                                f"checksums cover {verdict.crc_count} chunks")
        if verdict.length < rec.length:
            return ReplicaState(vid, "short", f"data file is {verdict.length} bytes, the "
                                f"block is {rec.length}")
        if verdict.length > rec.length:
            return ReplicaState(vid, "long", f"data file is {verdict.length} bytes, the "
                                f"block is {rec.length}")
        return ReplicaState(vid, "ok")

    def _report_replica(self, path: str, ino: int, index: int, rec: BlockRecord,
                        state: ReplicaState, good: list[int], leased: bool) -> None:
        """A problem (or, for a leased block, a note) for a replica that is not ok."""
        if state.status in ("ok", "unverified"):
            return
        volume = self.volumes.by_id.get(state.volume_id)
        where_vol = volume.path if volume else f"volume id {state.volume_id}"
        text = f"replica blk_{rec.block_id}_{rec.gs} on {where_vol}: {state.reason}"
        kind = _REPLICA_KINDS[state.status]
        key = (state.volume_id, rec.block_id, rec.gs)
        drop = ("drop_replica", ino, index, rec.block_id, rec.gs, state.volume_id)
        if leased:
            if state.unopenable:
                self.problem(kind, path, text + " (lease recovery cannot open it)", key,
                             (*drop, ()))
            else:
                self.note(f"{path}: {text} (under a lease: lease recovery settles it)")
            return
        if state.status == "long":
            self.problem(kind, path, text, key, ("truncate_replica", ino, index, rec.block_id,
                                                 rec.gs, state.volume_id, rec.length))
            return
        others = tuple(v for v in good if v != state.volume_id)
        if others:
            self.problem(kind, path, text, key, (*drop, others))
        else:
            self.problem(kind, path, text + " (no other good replica: kept)", key)

    def _check_extra_metas(self, path: str, rec: BlockRecord, leased: bool) -> None:
        """Meta files of other stamps beside a replica of the current one."""
        for vid in rec.volumes:
            found = self.found.get((vid, rec.block_id))
            if found is None or rec.gs not in found.metas:
                continue
            for gs, meta_path in found.metas.items():
                if gs == rec.gs:
                    continue
                if gs > rec.gs and leased:
                    self.note(f"{path}: {meta_path} is newer than the namespace (under a "
                              "lease: lease recovery adopts it)")
                    continue
                self.problem("STALE_META", path, f"{meta_path}: generation stamp {gs}, the "
                             f"namespace has {rec.gs}", (vid, rec.block_id, gs),
                             ("unlink_meta", vid, rec.block_id, gs))

    def check_volume_leftovers(self) -> None:
        """Replica files nobody refers to, misplaced files and ``tmp/`` leftovers."""
        snap = self.snap
        expected = {(vid, r.block_id) for r in snap.blocks.values() for vid in r.volumes}
        known = {r.block_id for r in snap.blocks.values()}
        for (vid, bid), found in sorted(self.found.items()):
            if (vid, bid) in expected:
                continue
            if bid in snap.trash:
                continue   # reported with TRASH_PENDING (or in use beside a daemon)
            why = "not recorded on this volume" if bid in known else "unknown block"
            self._orphan(self.volumes.by_id[vid], bid, found.paths(), f"blk_{bid}: {why}")
        for vid, paths in self.misplaced.items():
            for path in paths:
                self._orphan(self.volumes.by_id[vid], None, [str(path)],
                             f"{path.name} is outside its layout directory")
        for volume in self.volumes:
            self._check_tmp(volume)

    def _orphan(self, volume: Volume, bid: int | None, paths: list[str], text: str) -> None:
        if self.mounted and _newest_ctime(paths) > time.time() - ORPHAN_GRACE:
            self.note(f"{volume.path}: {text}: recent files, maybe a block being created")
            return
        self.report.stats.orphan_replicas += 1
        self.problem("ORPHAN_REPLICA", str(volume.path), f"{text} ({', '.join(paths)})",
                     (volume.id, bid, *paths), ("delete_paths", volume.id, bid, paths))

    def _check_tmp(self, volume: Volume) -> None:
        try:
            names = sorted(os.listdir(volume.tmp_dir))
        except FileNotFoundError:
            return
        for name in names:
            if self.mounted:
                self.note(f"{volume.tmp_dir}/{name}: in tmp/ (a move in progress?)")
            else:
                self.problem("TMP_LEFTOVER", str(volume.tmp_dir), f"{name} left by an "
                             "interrupted move", (volume.id, name),
                             ("clear_tmp", volume.id, name))


# =========================================================================== repairs


class _Unchanged(Exception):
    """A fix found its problem gone (fixed by an earlier fix): nothing was written."""


class _Rows:
    """In-transaction access for repairs, through the schema codecs."""

    def __init__(self, ns: Namespace, txn: lmdb.Transaction):
        self.ns = ns
        self.txn = txn
        self.db = ns.db

    def inode(self, ino: int) -> Inode | None:
        raw = self.txn.get(u64(ino), db=self.db["inodes"])
        return None if raw is None else Inode.unpack(ino, raw)

    def put_inode(self, inode: Inode) -> None:
        self.txn.put(u64(inode.ino), inode.pack(), db=self.db["inodes"])

    def dentry(self, parent: int, name: bytes) -> tuple[int, int] | None:
        raw = self.txn.get(schema.dentry_key(parent, name), db=self.db["dentries"])
        return None if raw is None else schema.parse_dentry_value(raw)

    def prefixed(self, dbname: str, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        with self.txn.cursor(db=self.db[dbname]) as cur:
            if not cur.set_range(prefix):
                return
            for key, value in cur:
                if key[:len(prefix)] != prefix:
                    return
                yield bytes(key), bytes(value)

    def delete_prefix(self, dbname: str, prefix: bytes) -> None:
        for key in [k for k, _ in self.prefixed(dbname, prefix)]:
            self.txn.delete(key, db=self.db[dbname])

    def links(self, ino: int) -> list[tuple[int, bytes]]:
        """Names of ``ino``: backlinks whose dentry exists, names it, in a directory."""
        out = []
        for key, _ in self.prefixed("backlinks", u64(ino)):
            _, parent, name = schema.split_backlink_key(key)
            entry = self.dentry(parent, name)
            pinode = self.inode(parent)
            if entry and entry[0] == ino and pinode and stat.S_ISDIR(pinode.mode):
                out.append((parent, name))
        return out

    def reaches_root(self, ino: int) -> bool:
        """Whether names lead from ``ino`` up to the root (no loop, no nameless ancestor)."""
        seen = set()
        while ino != ROOT_INO:
            links = self.links(ino)
            if not links or ino in seen:
                return False
            seen.add(ino)
            ino = links[0][0]
        return self.inode(ROOT_INO) is not None

    def children(self, ino: int) -> list[tuple[bytes, int, int]]:
        out = []
        for key, value in self.prefixed("dentries", u64(ino)):
            child, cookie = schema.parse_dentry_value(value)
            out.append((schema.split_dentry_key(key)[1], child, cookie))
        return out

    def is_orphan(self, ino: int) -> bool:
        return self.txn.get(u64(ino), db=self.db["orphans"]) is not None

    def expected_nlink(self, inode: Inode) -> int:
        """nlink by the schema's rules, from the rows as they are now."""
        if inode.ino != ROOT_INO and self.is_orphan(inode.ino) and not self.links(inode.ino):
            return 0
        if stat.S_ISDIR(inode.mode):
            kids = [self.inode(child) for _, child, _ in self.children(inode.ino)]
            return 2 + sum(1 for k in kids if k is not None and stat.S_ISDIR(k.mode))
        return len(self.links(inode.ino))

    def recount(self, ino: int) -> None:
        """Set a directory's nlink from its rows (parents after a name came or went)."""
        inode = self.inode(ino)
        if inode is not None and stat.S_ISDIR(inode.mode):
            inode.nlink = self.expected_nlink(inode)
            self.put_inode(inode)

    def remove_dentry(self, parent: int, name: bytes) -> int:
        child, cookie = self.dentry(parent, name)
        self.txn.delete(schema.dentry_key(parent, name), db=self.db["dentries"])
        cookie_key = schema.cookie_key(parent, cookie)
        if self.cookie_row(parent, cookie)[1:] == (name,):
            self.txn.delete(cookie_key, db=self.db["dircookies"])
        self.txn.delete(schema.backlink_key(child, parent, name), db=self.db["backlinks"])
        return child

    def cookie_row(self, parent: int, cookie: int) -> tuple[int, bytes] | tuple[()]:
        """(child, name) of a dircookies row, or () when there is none."""
        raw = self.txn.get(schema.cookie_key(parent, cookie), db=self.db["dircookies"])
        return () if raw is None else schema.parse_cookie_value(raw)

    def free_cookie(self, parent: Inode) -> int:
        """The directory's next cookie, skipping any a damaged ``next_cookie`` left in use."""
        cookie = parent.next_cookie
        while self.txn.get(schema.cookie_key(parent.ino, cookie),
                           db=self.db["dircookies"]) is not None:
            cookie += 1
        return cookie

    def add_dentry(self, parent: Inode, name: bytes, child: int) -> None:
        cookie = self.free_cookie(parent)
        parent.next_cookie = cookie + 1
        self.txn.put(schema.dentry_key(parent.ino, name), schema.dentry_value(child, cookie),
                     db=self.db["dentries"])
        self.txn.put(schema.cookie_key(parent.ino, cookie), schema.cookie_value(child, name),
                     db=self.db["dircookies"])
        self.txn.put(schema.backlink_key(child, parent.ino, name), b"",
                     db=self.db["backlinks"])
        self.put_inode(parent)

    def block(self, ino: int, index: int) -> BlockRecord | None:
        raw = self.txn.get(schema.block_key(ino, index), db=self.db["blocks"])
        return None if raw is None else BlockRecord.unpack(raw)

    def put_block(self, ino: int, index: int, rec: BlockRecord) -> None:
        self.txn.put(schema.block_key(ino, index), rec.pack(), db=self.db["blocks"])


# The order fixes run in within one pass: what the next mount's recovery would do first,
# then rows that make names consistent, then names, counts and blocks, then volume files,
# and the clean state last.
_ORDER = ("make_root", "delete_trash", "drop_replica_leased", "recover_lease", "delete_cookie",
          "delete_backlink", "remove_dentry", "add_backlink", "fix_next_cookie", "fix_cookie",
          "remove_orphan_row", "relink", "purge", "clear_symlink", "fix_nlink", "fix_parent",
          "fix_symlink_size", "delete_rows", "drop_block", "fix_size", "index_set",
          "index_delete", "drop_replica", "truncate_replica", "unlink_meta", "delete_paths",
          "clear_tmp", "drop_excess", "replicate", "raise_counter", "set_clean")


def _priority(problem: Problem) -> int:
    name = problem.action[0]
    if name == "drop_replica" and problem.action[-1] == ():
        name = "drop_replica_leased"
    return _ORDER.index(name)


class _Repairer:
    """Applies the actions of one check's problems; each fix re-checks its condition."""

    def __init__(self, ns: Namespace, volumes: VolumeSet, progress: Progress | None = None):
        self.ns = ns
        self.volumes = volumes
        self.progress = progress or Silent()

    def apply(self, problems: list[Problem]) -> None:
        work = sum(p.work for p in problems)
        if work:
            self.progress.phase("re-replicating", work)
        try:
            for problem in sorted(problems, key=_priority):
                name, *args = problem.action
                try:
                    problem.outcome = "repaired: " + getattr(self, f"fix_{name}")(*args)
                    problem.repaired = True
                except _Unchanged as exc:
                    problem.outcome = f"repaired by an earlier fix: {exc}"
                    problem.repaired = True
                except FsError as exc:
                    problem.outcome = f"not repaired: {exc}"
        finally:
            self.progress.close()
        delete_trash(self.ns, self.volumes)

    def _txn(self, action: tuple, body: Callable[[_Rows], str]) -> str:
        return self.ns.run(Op.REPAIR, action, lambda w: body(_Rows(self.ns, w.txn)))

    # --- recovery work -------------------------------------------------------------------

    def fix_delete_trash(self) -> str:
        return f"deleted the files of {delete_trash(self.ns, self.volumes)} dropped blocks"

    def fix_recover_lease(self, ino: int) -> str:
        recover_lease(self.ns, self.volumes, ino, RecoveryReport())
        return "lease recovered"

    def fix_purge(self, ino: int) -> str:
        self.ns.purge(ino)
        with self.ns.env.begin() as txn:
            if txn.get(u64(ino), db=self.ns.db["inodes"]) is not None:
                raise FsError(errno.EBUSY, f"inode {ino} still has links")
        return "purged"

    def fix_set_clean(self) -> str:
        def body(rows: _Rows) -> str:
            rows.txn.put(b"state", schema.pack_meta("clean"), db=rows.db["meta"])
            return "state set to clean"
        return self._txn(("set_clean",), body)

    def fix_make_root(self) -> str:
        def body(rows: _Rows) -> str:
            if rows.inode(ROOT_INO) is not None:
                raise _Unchanged("the root exists")
            now = time.time_ns()
            root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), 2, 0, 0,
                         now, now, now, ROOT_INO)
            root.next_cookie = 1 + max((c for _, _, c in rows.children(ROOT_INO)),
                                       default=schema.FIRST_COOKIE - 1)
            rows.put_inode(root)
            rows.recount(ROOT_INO)
            return "root directory recreated"
        return self._txn(("make_root",), body)

    # --- names ---------------------------------------------------------------------------

    def fix_remove_dentry(self, parent: int, name: bytes, reason: str) -> str:
        """Remove a bad name, if ``reason`` still holds: its directory is missing or not a
        directory (``non_dir``), its inode is missing (``dangling``), or it is an extra
        name of a directory (``dir_link``). A child that loses its last name goes to
        lost+found in the next pass (its nlink is left alone, so it is never purged)."""
        def body(rows: _Rows) -> str:
            entry = rows.dentry(parent, name)
            if entry is None:
                raise _Unchanged("the entry is gone")
            pinode, child = rows.inode(parent), rows.inode(entry[0])
            still = {
                "non_dir": pinode is None or not stat.S_ISDIR(pinode.mode),
                "dangling": child is None,
                "dir_link": child is not None and stat.S_ISDIR(child.mode)
                and (child.ino == ROOT_INO or len(rows.links(child.ino)) > 1),
            }[reason]
            if not still:
                raise _Unchanged("the entry is no longer wrong")
            rows.remove_dentry(parent, name)
            rows.recount(parent)
            return "entry removed"
        return self._txn(("remove_dentry", parent, name, reason), body)

    def fix_delete_cookie(self, parent: int, cookie: int) -> str:
        def body(rows: _Rows) -> str:
            row = rows.cookie_row(parent, cookie)
            entry = rows.dentry(parent, row[1]) if row else None
            if not row or (entry and entry[1] == cookie):
                raise _Unchanged("no longer stray")
            rows.txn.delete(schema.cookie_key(parent, cookie), db=rows.db["dircookies"])
            return "row deleted"
        return self._txn(("delete_cookie", parent, cookie), body)

    def fix_delete_backlink(self, child: int, parent: int, name: bytes) -> str:
        def body(rows: _Rows) -> str:
            entry = rows.dentry(parent, name)
            if entry and entry[0] == child:
                raise _Unchanged("no longer stray")
            rows.txn.delete(schema.backlink_key(child, parent, name), db=rows.db["backlinks"])
            return "row deleted"
        return self._txn(("delete_backlink", child, parent, name), body)

    def fix_add_backlink(self, child: int, parent: int, name: bytes) -> str:
        def body(rows: _Rows) -> str:
            entry = rows.dentry(parent, name)
            if not entry or entry[0] != child:
                raise _Unchanged("the entry changed")
            rows.txn.put(schema.backlink_key(child, parent, name), b"",
                         db=rows.db["backlinks"])
            return "backlink added"
        return self._txn(("add_backlink", child, parent, name), body)

    def fix_fix_cookie(self, parent: int, name: bytes) -> str:
        """Give the entry its dircookies row, with a fresh cookie if another name holds its
        own; a row with the right name but the wrong inode is corrected in place."""
        def body(rows: _Rows) -> str:
            entry = rows.dentry(parent, name)
            if entry is None:
                raise _Unchanged("the entry is gone")
            child, cookie = entry
            held = rows.cookie_row(parent, cookie)
            if held == (child, name):
                raise _Unchanged("the row exists")
            pinode = rows.inode(parent)
            if (held and held[1] != name) or cookie < schema.FIRST_COOKIE:
                cookie = rows.free_cookie(pinode)
                rows.txn.put(schema.dentry_key(parent, name),
                             schema.dentry_value(child, cookie), db=rows.db["dentries"])
            pinode.next_cookie = max(pinode.next_cookie, cookie + 1)
            rows.put_inode(pinode)
            rows.txn.put(schema.cookie_key(parent, cookie), schema.cookie_value(child, name),
                         db=rows.db["dircookies"])
            return f"cookie {cookie} recorded"
        return self._txn(("fix_cookie", parent, name), body)

    def fix_fix_next_cookie(self, parent: int) -> str:
        def body(rows: _Rows) -> str:
            pinode = rows.inode(parent)
            used = [c for _, _, c in rows.children(parent)]
            used += [schema.split_cookie_key(k)[1]
                     for k, _ in rows.prefixed("dircookies", u64(parent))]
            if pinode is None or pinode.next_cookie > max(used, default=0):
                raise _Unchanged("next_cookie is fine")
            pinode.next_cookie = max(used) + 1
            rows.put_inode(pinode)
            return f"next_cookie set to {pinode.next_cookie}"
        return self._txn(("fix_next_cookie", parent), body)

    def fix_remove_orphan_row(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            if not rows.links(ino):
                raise _Unchanged("the inode has no name")
            rows.txn.delete(u64(ino), db=rows.db["orphans"])
            return "removed from orphans"
        return self._txn(("remove_orphan_row", ino), body)

    def fix_relink(self, ino: int) -> str:
        """Give a nameless inode (or one directory of a loop) the name ``#<ino>`` in
        ``/lost+found``, as e2fsck does, so its data survives."""
        lost_found = self._lost_found()

        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if inode is None:
                raise _Unchanged("the inode is gone")
            old = rows.links(ino)
            if old and (not stat.S_ISDIR(inode.mode) or rows.reaches_root(ino)):
                raise _Unchanged("the inode has a name")
            for parent, old_name in old:
                rows.remove_dentry(parent, old_name)
            name = f"#{ino}".encode()
            while rows.dentry(lost_found, name) is not None:
                name += b"+"
            rows.add_dentry(rows.inode(lost_found), name, ino)
            inode = rows.inode(ino)
            inode.parent = lost_found
            inode.nlink = rows.expected_nlink(inode)
            rows.put_inode(inode)
            for parent in {lost_found, *(p for p, _ in old)}:
                rows.recount(parent)
            return f"moved to /{LOST_FOUND.decode()}/{_show(name)}"
        return self._txn(("relink", ino), body)

    def _lost_found(self) -> int:
        with self.ns.env.begin() as txn:
            raw = txn.get(schema.dentry_key(ROOT_INO, LOST_FOUND), db=self.ns.db["dentries"])
        if raw is None:
            inode = self.ns.make_node(ROOT_INO, LOST_FOUND, stat.S_IFDIR | 0o700, os.getuid(),
                                      os.getgid(), 0, time.time_ns())
            return inode.ino
        ino = schema.parse_dentry_value(raw)[0]
        if not stat.S_ISDIR(self.ns.get_inode(ino).mode):
            raise FsError(errno.ENOTDIR, "/lost+found is not a directory")
        return ino

    # --- inode fields ----------------------------------------------------------------------

    def fix_fix_nlink(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if inode is None:
                raise _Unchanged("the inode is gone")
            expected = rows.expected_nlink(inode)
            if expected == 0 and not rows.is_orphan(ino):
                raise _Unchanged("no name left: lost+found takes it")
            if inode.nlink == expected:
                raise _Unchanged("nlink is right")
            inode.nlink = expected
            rows.put_inode(inode)
            return f"nlink set to {expected}"
        return self._txn(("fix_nlink", ino), body)

    def fix_fix_parent(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if inode is None:
                raise _Unchanged("the inode is gone")
            parents = [p for p, _ in rows.links(ino)] if ino != ROOT_INO else [ROOT_INO]
            if not parents or inode.parent in parents:
                raise _Unchanged("parent is right")
            old, inode.parent = inode.parent, parents[0]
            rows.put_inode(inode)
            return f"parent {old} -> {inode.parent}"
        return self._txn(("fix_parent", ino), body)

    def fix_fix_symlink_size(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            target = rows.txn.get(u64(ino), db=rows.db["symlinks"])
            if inode is None or target is None or inode.size == len(target):
                raise _Unchanged("size is right")
            inode.size = len(target)
            rows.put_inode(inode)
            return f"size set to {inode.size}"
        return self._txn(("fix_symlink_size", ino), body)

    def fix_clear_symlink(self, ino: int) -> str:
        """A symlink without a target cannot be repaired; like e2fsck, clear it."""
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if inode is None or rows.txn.get(u64(ino), db=rows.db["symlinks"]) is not None:
                raise _Unchanged("no longer a symlink without target")
            for parent, name in rows.links(ino):
                rows.remove_dentry(parent, name)
            inode.nlink = 0
            rows.put_inode(inode)
            rows.txn.put(u64(ino), b"", db=rows.db["orphans"])
            return "unlinked"
        result = self._txn(("clear_symlink", ino), body)
        self.ns.purge(ino)
        return result + " and purged"

    def fix_fix_size(self, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            bs = self.ns.config.block_size
            ends = [schema.split_block_key(k)[1] * bs + BlockRecord.unpack(v).length
                    for k, v in rows.prefixed("blocks", u64(ino))]
            if inode is None or inode.size >= max(ends, default=0):
                raise _Unchanged("size covers the blocks")
            old, inode.size = inode.size, max(ends)
            rows.put_inode(inode)
            return f"size {old} -> {inode.size}"
        return self._txn(("fix_size", ino), body)

    def fix_delete_rows(self, dbname: str, ino: int) -> str:
        def body(rows: _Rows) -> str:
            inode = rows.inode(ino)
            if dbname == "symlinks" and inode is not None and stat.S_ISLNK(inode.mode):
                raise _Unchanged("the inode is a symlink")
            if dbname in ("xattrs", "inherited") and inode is not None:
                raise _Unchanged("the inode exists")
            if dbname == "orphans" and inode is not None:
                raise _Unchanged("the inode exists")
            if dbname in ("xattrs", "inherited"):
                rows.delete_prefix(dbname, u64(ino))
            else:
                rows.txn.delete(u64(ino), db=rows.db[dbname])
            return f"'{dbname}' rows deleted"
        return self._txn(("delete_rows", dbname, ino), body)

    # --- block records and the replicas index -------------------------------------------------

    def fix_drop_block(self, ino: int, index: int) -> str:
        """Drop a block of a missing or non-regular inode; its files go through the trash."""
        def body(rows: _Rows) -> str:
            rec = rows.block(ino, index)
            inode = rows.inode(ino)
            if rec is None or (inode is not None and stat.S_ISREG(inode.mode)):
                raise _Unchanged("the block is gone or its file exists")
            rows.txn.delete(schema.block_key(ino, index), db=rows.db["blocks"])
            for vid in rec.volumes:
                rows.txn.delete(schema.replica_key(vid, rec.block_id), db=rows.db["replicas"])
            rows.txn.put(u64(rec.block_id), schema.trash_value(rec.gs, rec.volumes),
                         db=rows.db["trash"])
            return "block dropped, files trashed"
        return self._txn(("drop_block", ino, index), body)

    def fix_index_set(self, vid: int, bid: int, ino: int, index: int) -> str:
        def body(rows: _Rows) -> str:
            rec = rows.block(ino, index)
            if rec is None or rec.block_id != bid or vid not in rec.volumes:
                raise _Unchanged("the block record changed")
            rows.txn.put(schema.replica_key(vid, bid), schema.block_key(ino, index),
                         db=rows.db["replicas"])
            return "index row written"
        return self._txn(("index_set", vid, bid, ino, index), body)

    def fix_index_delete(self, vid: int, bid: int) -> str:
        def body(rows: _Rows) -> str:
            raw = rows.txn.get(schema.replica_key(vid, bid), db=rows.db["replicas"])
            if raw is None:
                raise _Unchanged("the row is gone")
            rec = rows.block(*schema.split_block_key(raw))
            if rec is not None and rec.block_id == bid and vid in rec.volumes:
                raise _Unchanged("the row matches a block record")
            rows.txn.delete(schema.replica_key(vid, bid), db=rows.db["replicas"])
            return "index row deleted"
        return self._txn(("index_delete", vid, bid), body)

    def fix_raise_counter(self, name: str, minimum: int) -> str:
        """Counters only grow. ``txid`` numbers the repair's own journal record, so it is
        raised in a plain transaction first and the raise is journaled right after."""
        if name == "txid":
            with self.ns.env.begin(write=True) as txn:
                current = schema.read_u64(txn.get(b"txid", db=self.ns.db["meta"]))
                if current < minimum:
                    txn.put(b"txid", u64(minimum), db=self.ns.db["meta"])
            self._txn(("raise_counter", name, current, minimum), lambda rows: "")
            return f"txid {current} -> {minimum}"

        def body(rows: _Rows) -> str:
            current = schema.read_u64(rows.txn.get(name.encode(), db=rows.db["meta"]) or u64(0))
            if current >= minimum:
                raise _Unchanged(f"{name} is {current}")
            rows.txn.put(name.encode(), u64(minimum), db=rows.db["meta"])
            return f"{name} {current} -> {minimum}"
        return self._txn(("raise_counter", name, minimum), body)

    # --- replica files ------------------------------------------------------------------------

    def fix_drop_replica(self, ino: int, index: int, bid: int, gs: int, vid: int,
                         good: tuple[int, ...]) -> str:
        """Stop recording a bad replica, then delete its files. ``good`` names replicas known
        good when checked; one must still be recorded (an empty ``good`` is for leased
        blocks, whose lease recovery would drop an unopenable replica anyway)."""
        def body(rows: _Rows) -> str:
            rec = rows.block(ino, index)
            if rec is None or rec.block_id != bid or vid not in rec.volumes:
                raise _Unchanged("the replica is no longer recorded")
            if good and (rec.gs != gs or not set(good) & set(rec.volumes)):
                raise FsError(errno.EIO, "no other good replica is left")
            rec.volumes = tuple(v for v in rec.volumes if v != vid)
            rows.put_block(ino, index, rec)
            rows.txn.delete(schema.replica_key(vid, bid), db=rows.db["replicas"])
            return "replica dropped"
        result = self._txn(("drop_replica", ino, index, bid, gs, vid), body)
        volume = self.volumes.by_id.get(vid)
        if volume is not None:
            volume.delete_replica(bid, None)
            return result + ", files deleted"
        return result

    def fix_truncate_replica(self, ino: int, index: int, bid: int, gs: int, vid: int,
                             length: int) -> str:
        """Cut a replica longer than its block: the bytes past the recorded length were
        never acknowledged (reads stop at the recorded length)."""
        rec = self.ns.get_blocks(ino).get(index)
        if rec is None or rec.block_id != bid or rec.gs != gs or rec.length != length:
            raise _Unchanged("the block record changed")
        with self.volumes.get(vid).open_replica(bid, gs, writable=True) as replica:
            replica.truncate(length)
            replica.fsync()
        self._txn(("truncate_replica", ino, index, bid, gs, vid, length), lambda rows: "")
        return f"replica cut to {length} bytes"

    def fix_unlink_meta(self, vid: int, bid: int, gs: int) -> str:
        volume = self.volumes.get(vid)
        with self.ns.env.begin() as txn:
            owner = txn.get(schema.replica_key(vid, bid), db=self.ns.db["replicas"])
            raw = None if owner is None else txn.get(owner, db=self.ns.db["blocks"])
        if raw is not None and BlockRecord.unpack(raw).gs == gs:
            raise _Unchanged("the meta file is current")
        self._txn(("unlink_meta", vid, bid, gs), lambda rows: "")
        _unlink(volume.meta_path(bid, gs))
        return "meta file deleted"

    def fix_delete_paths(self, vid: int, bid: int | None, paths: list[str]) -> str:
        """Delete orphan replica files, unless the block is now recorded on the volume
        (files at their layout paths would then be its replica)."""
        volume = self.volumes.get(vid)
        if bid is not None:
            with self.ns.env.begin() as txn:
                if txn.get(schema.replica_key(vid, bid), db=self.ns.db["replicas"]):
                    raise _Unchanged("the block is recorded on this volume")
        self._txn(("delete_paths", vid, bid, [str(p) for p in paths]), lambda rows: "")
        for path in paths:
            _unlink(Path(path))
        return f"{len(paths)} file(s) deleted from {volume.path}"

    def fix_clear_tmp(self, vid: int, name: str) -> str:
        path = self.volumes.get(vid).tmp_dir / name
        self._txn(("clear_tmp", vid, name), lambda rows: "")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            _unlink(path)
        return "deleted"

    # --- replication -----------------------------------------------------------------------

    def fix_replicate(self, ino: int, index: int, bid: int, gs: int, good: tuple[int, ...],
                      avoid: tuple[int, ...]) -> str:
        """Copy a good replica to the volumes ``choose_volumes`` picks, as the daemon's
        replication monitor does; ``avoid`` (volumes that held bad or unrecorded files of
        the block) only when nothing else qualifies. Each copy is recorded with
        ``add_replica``, which refuses it if the block changed meanwhile."""
        rec = self.ns.get_blocks(ino).get(index)
        if rec is None or rec.block_id != bid or rec.gs != gs:
            raise _Unchanged("the block changed")
        policy, replication = Resolver(self.ns).placement(ino)
        good = [v for v in good if v in rec.volumes and v in self.volumes.by_id]
        if not good:
            raise FsError(errno.EIO, "no good replica is left to copy")
        existing = [self.volumes.get(v) for v in good]
        have = sum(not v.storage_type.transient for v in existing)
        if have >= replication:
            raise _Unchanged(f"{have} persistent replicas")
        targets = self._targets(policy, replication, rec, existing, set(avoid))
        added: list[Volume] = []
        try:
            for target in targets:
                self._copy(ino, index, rec, existing, target)
                added.append(target)
                self.progress.advance(rec.length)
        except FsError as exc:
            done = f"{_added(added)}; then " if added else ""
            raise FsError(exc.errno, f"{done}{copy_error(exc)}") from None
        if have + len(added) < replication:
            done = f"{_added(added)}; " if added else ""
            raise FsError(errno.ENOSPC, f"{done}only {have + len(added)} of {replication} "
                                        f"replicas placeable: no other volume allowed by "
                                        f"{policy.name} has room")
        return _added(added)

    def _targets(self, policy: BlockStoragePolicy, replication: int, rec: BlockRecord,
                 existing: list[Volume], avoid: set[int]) -> list[Volume]:
        """``choose_volumes`` on the volumes the block is not on; those in ``avoid`` join
        only if the others cannot take every replica still needed."""
        have = sum(not v.storage_type.transient for v in existing)
        kept = {v.id for v in existing}
        free = [v for v in self.volumes if v.id not in rec.volumes or v.id in kept]
        preferred = choose_volumes(policy, replication,
                                   VolumeSet(v for v in free if v.id not in avoid),
                                   rec.length, existing)
        if have + len(preferred) >= replication or not avoid & {v.id for v in free}:
            return preferred
        anywhere = choose_volumes(policy, replication, VolumeSet(free), rec.length, existing)
        return anywhere if len(anywhere) > len(preferred) else preferred

    def _copy(self, ino: int, index: int, rec: BlockRecord, sources: list[Volume],
              target: Volume) -> None:
        """One verified copy from the first source that reads, then its record."""
        error: FsError | None = None
        for source in self.volumes.sorted_for_read(v.id for v in sources):
            try:
                copy_replica(source, target, rec.block_id, rec.gs)
                break
            except FsError as exc:
                error = exc
        else:
            raise error or FsError(errno.EIO, "no replica to copy")
        if not self.ns.add_replica(ino, index, rec.block_id, rec.gs, target.id):
            target.delete_replica(rec.block_id, rec.gs)
            raise FsError(errno.EAGAIN, "the block changed during the copy")

    def fix_drop_excess(self, ino: int, index: int, bid: int, gs: int,
                        good: tuple[int, ...]) -> str:
        """Drop the surplus replicas of an over-replicated block, never going below its
        replication: of the types ``policy.choose_excess`` names, the replica on the
        fullest volume first. Files go through the trash (deleted after the commit)."""
        policy, replication = Resolver(self.ns).placement(ino)

        def body(rows: _Rows) -> str:
            rec = rows.block(ino, index)
            if rec is None or rec.block_id != bid or rec.gs != gs:
                raise _Unchanged("the block changed")
            persistent = [self.volumes.by_id[v] for v in good if v in rec.volumes
                          and v in self.volumes.by_id
                          and not self.volumes.by_id[v].storage_type.transient]
            surplus = len(persistent) - replication
            if surplus <= 0:
                raise _Unchanged(f"{len(persistent)} persistent replicas")
            victims: list[Volume] = []
            for storage_type in policy.choose_excess(
                    replication, [v.storage_type for v in persistent])[:surplus]:
                candidates = [v for v in persistent
                              if v.storage_type == storage_type and v not in victims]
                victims.append(min(candidates, key=lambda v: (v.free_bytes(), -v.id)))
            dropped = tuple(v.id for v in victims)
            rec.volumes = tuple(v for v in rec.volumes if v not in dropped)
            rows.put_block(ino, index, rec)
            for vid in dropped:
                rows.txn.delete(schema.replica_key(vid, bid), db=rows.db["replicas"])
            raw = rows.txn.get(u64(bid), db=rows.db["trash"])
            earlier = schema.parse_trash_value(raw)[1] if raw is not None else ()
            rows.txn.put(u64(bid), schema.trash_value(gs, tuple(sorted({*earlier, *dropped}))),
                         db=rows.db["trash"])
            where = ", ".join(f"{v.path} ({v.storage_type.name})" for v in victims)
            return f"{len(victims)} excess replica(s) dropped from {where}"
        return self._txn(("drop_excess", ino, index, bid, gs, good), body)


def _added(volumes: list[Volume]) -> str:
    where = ", ".join(f"{v.path} ({v.storage_type.name})" for v in volumes)
    return f"{len(volumes)} replica(s) added on {where}"


def _newest_ctime(paths: list[str]) -> float:
    """Newest ctime among files (a vanished one counts as new: it was just deleted)."""
    newest = 0.0
    for path in paths:
        try:
            newest = max(newest, os.stat(path).st_ctime)
        except FileNotFoundError:
            return time.time()
    return newest


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise FsError(exc.errno or errno.EIO, f"cannot delete {path}: {exc.strerror}") from None


# =========================================================================== the library


class Fsck:
    """fsck of one filesystem: ``check()`` (read-only, safe beside a mount) and ``repair()``.

    ``path`` limits the file checks to a subtree; ``listing`` is 0 (none), LIST_FILES,
    LIST_BLOCKS or LIST_LOCATIONS; ``storage_policies`` adds the tables of ``hdfs fsck
    -storagepolicies`` to the rendered report (the counts are always in
    ``FsckReport.placement``). Raises UsageError (exit code 2) when the filesystem cannot
    be checked at all.
    """

    def __init__(self, data_dir, path: str = "/", *, listing: int = 0,
                 storage_policies: bool = False, progress: Progress | None = None):
        self.data_dir = Path(os.path.abspath(data_dir))
        self.path = _normalise(path)
        self.listing = listing
        self.storage_policies = storage_policies
        self.progress = progress or Silent()
        self._verified: dict[tuple, Verdict] = {}
        if not self.data_dir.is_dir():
            raise UsageError(f"{self.data_dir} does not exist or is not a directory")
        if not is_filesystem(self.data_dir):
            raise UsageError(f"{self.data_dir} is not a tierfs filesystem "
                             f"(no {NAMESPACE_DIR}/data.mdb)")

    def holder(self) -> tuple[int, str] | None:
        """(pid, mount point) of a running daemon, or None."""
        return MountLock(self.data_dir).holder()

    def check(self) -> FsckReport:
        """Check without changing anything. Beside a running daemon, what the volumes show
        is checked twice and only what both passes found is reported (see the module
        docstring)."""
        mounted = self.holder() is not None
        with self._opened(readonly=True) as (ns, volumes):
            report = self._check(ns, volumes, mounted)
            if mounted and report.problems:
                again = self._check(ns, volumes, mounted)
                keys = {p.key for p in again.problems}
                report.problems = [p for p in report.problems if p.key in keys]
            return report

    def repair(self) -> RepairReport:
        """Check, fix, check again until clean or stuck; refused while mounted."""
        lock = MountLock(self.data_dir)
        try:
            lock.acquire(Path("(tierfs fsck --repair)"))
        except FsError:
            holder = self.holder()
            where = f" (pid {holder[0]} on {holder[1]})" if holder else ""
            raise UsageError(f"{self.data_dir} is mounted{where}: unmount it before "
                             "fsck --repair") from None
        try:
            with self._opened(readonly=False) as (ns, volumes):
                return self._repair(ns, volumes)
        finally:
            lock.release()

    def _repair(self, ns: Namespace, volumes: VolumeSet) -> RepairReport:
        """Alternate checks and fixes. A problem is attempted once per distinct message
        (a fix may uncover the same kind of problem on the same inode with new numbers);
        the log lists every problem found, with the outcome of its fix."""
        start = time.monotonic()
        before = self._check(ns, volumes, mounted=False)
        log = {(p.key, p.message): p for p in before.problems}
        report = before
        for _ in range(MAX_REPAIR_PASSES):
            todo = [p for p in report.problems if p.action
                    and log.get((p.key, p.message), p).outcome is None]
            if not todo:
                break
            # Without a root every name looks wrong: recreate it alone, then look again.
            todo = [p for p in todo if p.kind == "ROOT_MISSING"] or todo
            _Repairer(ns, volumes, self.progress).apply(todo)
            log.update({(p.key, p.message): p for p in todo})
            report = self._check(ns, volumes, mounted=False)
        for problem in report.problems:
            log.setdefault((problem.key, problem.message), problem)
        ns.sync()
        report.started, report.elapsed = before.started, time.monotonic() - start
        return RepairReport(before, list(log.values()), report)

    def _check(self, ns: Namespace, volumes: VolumeSet, mounted: bool) -> FsckReport:
        try:
            return _Checker(self, ns, volumes, mounted).run()
        finally:
            self.progress.close()

    def verify(self, volume: Volume, block_id: int, gs: int, found: Found,
               advance: Callable[[int], None]) -> Verdict:
        """Verify a replica, or trust an earlier good verdict on unchanged files (repair
        passes and the mounted re-check read each good replica once)."""
        try:
            key = (volume.id, block_id, gs, *_file_id(found.data_path),
                   *_file_id(found.metas[gs]))
        except OSError:
            key = None
        if key is not None and key in self._verified:
            advance(found.data_len)
            return self._verified[key]
        verdict = verify_replica(volume, block_id, gs, advance)
        if key is not None and verdict.corruption() is None:
            self._verified[key] = verdict
        return verdict

    @contextmanager
    def _opened(self, *, readonly: bool) -> Iterator[tuple[Namespace, VolumeSet]]:
        """The namespace and the volumes, or UsageError (exit 2) when they cannot be used."""
        try:
            ns = Namespace.open(self.data_dir / NAMESPACE_DIR, readonly=readonly)
        except (FsError, lmdb.Error) as exc:
            raise UsageError(f"cannot open the namespace of {self.data_dir}: {exc}") from None
        try:
            yield ns, self._open_volumes(ns)
        except lmdb.Error as exc:
            raise UsageError(f"namespace of {self.data_dir} is unreadable: {exc}") from None
        finally:
            ns.close()


    def _open_volumes(self, ns: Namespace) -> VolumeSet:
        """Open every volume (identity checked); rescans when a daemon deletes a file while
        the volume counts its bytes."""
        for attempt in range(SCAN_ATTEMPTS):
            try:
                return VolumeSet.open(self.data_dir, ns.config.fs_uuid, ns.config.volumes)
            except (FsError, ValueError) as exc:
                raise UsageError(f"cannot check {self.data_dir}: {exc}") from None
            except FileNotFoundError:
                if attempt == SCAN_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")


def _file_id(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _normalise(path: str) -> str:
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise UsageError(f"PATH '{path}' must not contain '..'")
    return "/" + "/".join(parts)


# =========================================================================== the CLI


def run_fsck(args) -> int:
    """``tierfs fsck``: print the report; exit codes in the module docstring."""
    listing = (LIST_LOCATIONS if args.locations else LIST_BLOCKS if args.blocks
               else LIST_FILES if args.files else 0)
    progress = Progress()
    try:
        fsck = Fsck(args.data, args.path, listing=listing,
                    storage_policies=args.storagepolicies, progress=progress)
        if args.repair:
            result = fsck.repair()
            text, code = result.render(), result.exit_code
        else:
            report = fsck.check()
            text, code = report.render(), 0 if report.healthy else 1
    finally:
        progress.close()
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # The reader (``| head``) left: the exit code still tells the verdict. Point
        # stdout at /dev/null so that the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code
