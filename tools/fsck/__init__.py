"""``tierfs fsck DATA|MNT [PATH] [--repair] [--files [--blocks [--locations]]]
[--storagepolicies]``; a mount point stands for its data directory.

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
    files of older stamps; replica files of blocks the namespace does not know, files of a
    known block on a volume it does not record, and files outside their layout directory
    (orphan replicas), except a whole replica at the block's stamp that the block needs
    (``UNRECORDED_REPLICA``), which the next mount's volume scan (and ``--repair``) records
    (the rule is ``tierfs.fs.recovery.adopt_replica``'s); anything left in a volume's
    ``tmp/``.
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
    and the satisfier restore them while data stays readable; nor is the recovery a daemon
    that did not stop cleanly left, ``LEASE_PENDING``, ``ORPHAN_PENDING``, ``TRASH_PENDING``,
    ``UNCLEAN_STATE`` and, after such a stop, ``TMP_LEFTOVER``: the next mount does it
    before serving anything, and a note says so; nor ``UNRECORDED_REPLICA``; but a lease
    whose file has a replica failing its checksum is a problem, since lease recovery would
    take damage for a write cut short); 1 problems found, including with ``--repair`` when every one was repaired (like
    e2fsck's "errors corrected"; the last line then says HEALTHY, and a second fsck exits 0
    unless blocks were lost), but not when ``--repair`` only re-replicated, removed excess
    replicas or finished that recovery; 2 usage or cannot run (DATA
    is not a tierfs filesystem, the namespace is unreadable, a volume is missing or foreign,
    PATH does not exist, ``--repair`` on a mounted filesystem), one line on stderr; 130
    interrupted (Ctrl-C stops cleanly between two steps).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import lmdb

from tierfs.backends.volume import Volume
from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.errors import FsError, UsageError
from tierfs.fs.mountlock import MountLock
from tierfs.fs.namespace import Namespace
from tierfs.tools.mkfs import NAMESPACE_DIR, is_filesystem
from tierfs.tools.mountinfo import tierfs_mounted_on
from tierfs.tools import progress as _progress
from tierfs.tools.progress import Silent
from tierfs.tools.fsck.check import LIST_BLOCKS, LIST_FILES, LIST_LOCATIONS, _Checker
from tierfs.tools.fsck.repair import _Repairer
from tierfs.backends.verify import Verdict, verify_replica
from tierfs.tools.fsck.replicas import SCAN_ATTEMPTS, Found
from tierfs.tools.fsck.report import FsckReport, RepairReport

# The public names of fsck's parts, importable from here as when fsck was one module.
from tierfs.tools.fsck.check import ORPHAN_GRACE  # noqa: F401
from tierfs.tools.fsck.repair import LOST_FOUND  # noqa: F401
from tierfs.backends.verify import VERIFY_SPAN  # noqa: F401
from tierfs.tools.fsck.replicas import ReplicaState, scan_volume  # noqa: F401
from tierfs.tools.fsck.report import Problem, Stats  # noqa: F401
from tierfs.tools.fsck.snapshot import Snapshot  # noqa: F401

MAX_REPAIR_PASSES = 5


class Progress(_progress.Progress):
    """Status lines of this tool start with its name."""

    label = "tierfs fsck"


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
            where = f" (pid {holder[0]} on {holder[1]})" if holder and holder[0] else ""
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
    mounted = tierfs_mounted_on(args.data)  # a mount point given for DATA: its DATA
    data = mounted.data_dir if mounted is not None else args.data
    progress = Progress()
    try:
        fsck = Fsck(data, args.path, listing=listing,
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
