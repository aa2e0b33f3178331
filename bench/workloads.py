"""The benchmark workloads, each run the same way on any directory.

Every workload does its I/O with ``os.open``/``os.write``/``os.preadv`` and buffers made once,
builds its path and offset lists before starting the clock, and times only the operations it
reports. The Python overhead of the harness is then the same on the backing directory and on
the mount, and cancels out of the ratio between them. MB are 10**6 bytes.

Workloads run in a fixed order and build on each other (the reads use the file ``seq_write``
wrote; ``stat_warm``, ``readdir``, ``rename`` and ``unlink`` use the files ``create`` made).
Each one first makes sure its inputs exist, untimed, so that ``--only`` can run any subset.
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from time import perf_counter

from progress import Progress

from tierfs.backends.volume import syncfs

MiB = 1 << 20
POLICY_XATTR = "user.tierfs.storage_policy"

#: Every figure a workload can report, with its unit, in report order.
UNITS = {
    "seq_write": "MB/s",
    "seq_read_cold": "MB/s",
    "seq_read_warm": "MB/s",
    "rand_read_4k": "IOPS",
    "rand_write_4k": "IOPS",
    "append_small": "writes/s",
    "create": "ops/s",
    "stat_warm": "ops/s",
    "readdir": "entries/s",
    "rename": "ops/s",
    "unlink": "ops/s",
    "mkdir": "ops/s",
    "small_files_write": "files/s",
    "small_files_read": "files/s",
    "setfattr_empty": "ms",
    "setfattr_subtree": "ms",
    "setfattr_ratio": "x",
    "peak_rss": "MB",  # of the tierfs daemon, measured by run.py rather than a workload
}


class SkipWorkload(Exception):
    """The workload does not apply to this directory (the message says why)."""


class BenchError(Exception):
    """The filesystem gave a wrong answer (a short read, a wrong size, a missing entry)."""


@dataclass(frozen=True)
class Sizes:
    """How much work each workload does; the defaults are the full benchmark."""

    file_bytes: int = 1024 * MiB
    chunk_bytes: int = MiB
    io_bytes: int = 4096
    rand_reads: int = 50_000
    rand_writes: int = 20_000
    appends: int = 20_000
    append_bytes: int = 100
    files: int = 10_000
    readdir_passes: int = 5
    dirs: int = 10_000
    small_files: int = 2_000
    small_file_bytes: int = 4096
    subtree_dirs: int = 100
    subtree_files_per_dir: int = 1_000
    setfattr_repeats: int = 5

    def __post_init__(self):
        if self.file_bytes % self.chunk_bytes:
            raise ValueError("the big file must be a whole number of chunks")

    def quick(self) -> Sizes:
        """About fifty times less work: a smoke run that still takes every code path."""
        return replace(
            self,
            file_bytes=max(self.file_bytes // 50 // MiB, 1) * MiB,
            rand_reads=self.rand_reads // 50,
            rand_writes=self.rand_writes // 50,
            appends=self.appends // 50,
            files=self.files // 50,
            dirs=self.dirs // 50,
            small_files=self.small_files // 50,
            subtree_dirs=10,
            subtree_files_per_dir=100,
        )


@dataclass(frozen=True)
class Figure:
    """One measured figure of one workload on one directory.

    ``value`` is in ``UNITS[name]``; ``count`` is what was counted over ``seconds`` to get it
    (operations, MB, or repetitions for the times in ms).
    """

    name: str
    value: float
    seconds: float
    count: float

    @property
    def unit(self) -> str:
        return UNITS[self.name]


def rate(name: str, count: float, seconds: float) -> Figure:
    """A figure that is ``count`` per second."""
    return Figure(name, count / seconds, seconds, count)


class PageCache:
    """How often this run has emptied the page cache.

    The cache is the machine's, shared by every directory under test: a cold read on the
    mount also makes the backing directory's big file cold again, so "read since the last
    drop" is the only reliable sign that a file is cached.
    """

    drops = 0


@dataclass
class Workspace:
    """One directory under test: its scratch area and what earlier workloads left there.

    ``flush_paths`` are the directories whose filesystems must be synced before the page
    cache can be emptied (for a tierfs mount, also the directory holding its volumes).
    """

    label: str
    root: str
    sizes: Sizes
    progress: Progress
    flush_paths: tuple[str, ...] = ()
    big_file: str | None = None
    big_file_read_at: int | None = None  # PageCache.drops when last read in full
    many: list[str] | None = None
    policy_tree: str | None = None  # built once: later rounds time setfattr on the same tree
    _serial: int = 0

    def fresh_dir(self, stem: str) -> str:
        """A new empty directory for one workload, so no workload sees another's leftovers."""
        self._serial += 1
        path = os.path.join(self.root, f"{stem}.{self._serial}")
        os.mkdir(path)
        return path


@dataclass(frozen=True)
class Workload:
    """A named workload and the figures it reports (names in ``UNITS``)."""

    name: str
    run: Callable[[Workspace], list[Figure]]
    figures: tuple[str, ...]


def pattern(size: int) -> bytes:
    """Data that no layer can compress or treat as a hole, the same on every run."""
    return random.Random(size).randbytes(size)


# -- the big file: sequential and random I/O ----------------------------------------------


def seq_write(ws: Workspace) -> list[Figure]:
    """Writes the big file in 1 MiB writes; the time includes the final fsync."""
    path = os.path.join(ws.fresh_dir("seq"), "big")
    seconds = _write_big_file(ws, path)
    return [rate("seq_write", ws.sizes.file_bytes / 1e6, seconds)]


def seq_read_cold(ws: Workspace) -> list[Figure]:
    """Reads the big file after emptying the page cache, so the data comes from the disk."""
    _ensure_big_file(ws)
    drop_caches(ws.flush_paths)
    seconds = _read_big_file(ws)
    return [rate("seq_read_cold", ws.sizes.file_bytes / 1e6, seconds)]


def seq_read_warm(ws: Workspace) -> list[Figure]:
    """Reads the big file again without emptying any cache."""
    _ensure_big_file_cached(ws)
    seconds = _read_big_file(ws)
    return [rate("seq_read_warm", ws.sizes.file_bytes / 1e6, seconds)]


def rand_read_4k(ws: Workspace) -> list[Figure]:
    """Aligned 4 KiB reads at random offsets of the (cached) big file."""
    _ensure_big_file_cached(ws)
    offsets = _random_offsets(ws.sizes, ws.sizes.rand_reads, seed=1)
    buffers = [bytearray(ws.sizes.io_bytes)]
    fd = os.open(ws.big_file, os.O_RDONLY)
    try:
        start = perf_counter()
        for batch in ws.progress.track(offsets, 4096, "reads"):
            for offset in batch:
                os.preadv(fd, buffers, offset)
        seconds = perf_counter() - start
    finally:
        os.close(fd)
    return [rate("rand_read_4k", len(offsets), seconds)]


def rand_write_4k(ws: Workspace) -> list[Figure]:
    """Aligned 4 KiB writes at random offsets of the big file, then fsync (timed)."""
    _ensure_big_file(ws)
    offsets = _random_offsets(ws.sizes, ws.sizes.rand_writes, seed=2)
    data = pattern(ws.sizes.io_bytes)
    fd = os.open(ws.big_file, os.O_WRONLY)
    try:
        start = perf_counter()
        for batch in ws.progress.track(offsets, 4096, "writes"):
            for offset in batch:
                os.pwrite(fd, data, offset)
        os.fsync(fd)
        seconds = perf_counter() - start
    finally:
        os.close(fd)
    return [rate("rand_write_4k", len(offsets), seconds)]


def _write_big_file(ws: Workspace, path: str) -> float:
    """Writes the big file at ``path`` and returns the seconds taken, fsync included."""
    sizes = ws.sizes
    data = pattern(sizes.chunk_bytes)
    chunks = range(sizes.file_bytes // sizes.chunk_bytes)
    ws.big_file, ws.big_file_read_at = None, None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = perf_counter()
        for batch in ws.progress.track(chunks, 16, "chunks"):
            for _ in batch:
                os.write(fd, data)
        os.fsync(fd)
        seconds = perf_counter() - start
    finally:
        os.close(fd)
    _expect_size(path, sizes.file_bytes)
    ws.big_file = path
    return seconds


def _read_big_file(ws: Workspace) -> float:
    """Reads the whole big file in chunks and returns the seconds taken."""
    sizes = ws.sizes
    buffers = [bytearray(sizes.chunk_bytes)]
    chunks = range(sizes.file_bytes // sizes.chunk_bytes)
    got = 0
    fd = os.open(ws.big_file, os.O_RDONLY)
    try:
        start = perf_counter()
        for batch in ws.progress.track(chunks, 16, "chunks"):
            for _ in batch:
                got += os.readv(fd, buffers)
        seconds = perf_counter() - start
    finally:
        os.close(fd)
    if got != sizes.file_bytes:
        raise BenchError(f"read {got} bytes of {ws.big_file}, expected {sizes.file_bytes}")
    ws.big_file_read_at = PageCache.drops
    return seconds


def _ensure_big_file(ws: Workspace) -> None:
    """Writes the big file (untimed) unless ``seq_write`` already did."""
    if ws.big_file is None:
        with ws.progress.stage("writing the big file, untimed"):
            _write_big_file(ws, os.path.join(ws.fresh_dir("seq"), "big"))


def _ensure_big_file_cached(ws: Workspace) -> None:
    """Reads the big file once (the warm-up) unless it was read since the caches were dropped."""
    _ensure_big_file(ws)
    if ws.big_file_read_at != PageCache.drops:
        with ws.progress.stage("warm-up read"):
            _read_big_file(ws)


def _random_offsets(sizes: Sizes, count: int, seed: int) -> list[int]:
    """``count`` aligned offsets into the big file, the same list on every directory."""
    rng = random.Random(seed)
    blocks = sizes.file_bytes // sizes.io_bytes
    return [rng.randrange(blocks) * sizes.io_bytes for _ in range(count)]


# -- small writes and metadata -------------------------------------------------------------


def append_small(ws: Workspace) -> list[Figure]:
    """Small writes to a file opened O_APPEND, timed from open to close (a kernel that caches
    writes hands them to the filesystem by the close)."""
    sizes = ws.sizes
    path = os.path.join(ws.fresh_dir("append"), "log")
    record = pattern(sizes.append_bytes - 1) + b"\n"
    appends = range(sizes.appends)
    start = perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for batch in ws.progress.track(appends, 1024, "writes"):
            for _ in batch:
                os.write(fd, record)
    finally:
        os.close(fd)
    seconds = perf_counter() - start
    _expect_size(path, len(appends) * len(record))
    return [rate("append_small", len(appends), seconds)]


def create(ws: Workspace) -> list[Figure]:
    """Creates empty files in one directory (open O_CREAT|O_EXCL, then close)."""
    directory = ws.fresh_dir("many")
    paths = [os.path.join(directory, f"f{i:06d}") for i in range(ws.sizes.files)]
    ws.many = None
    start = perf_counter()
    for batch in ws.progress.track(paths, 1024, "files"):
        for path in batch:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    seconds = perf_counter() - start
    ws.many = paths
    return [rate("create", len(paths), seconds)]


def stat_warm(ws: Workspace) -> list[Figure]:
    """Stats every file twice and times the second pass, when every cache is warm."""
    paths = _ensure_many(ws)
    with ws.progress.stage("warm-up pass"):
        for path in paths:
            os.stat(path)
    start = perf_counter()
    for batch in ws.progress.track(paths, 1024, "stats"):
        for path in batch:
            os.stat(path)
    seconds = perf_counter() - start
    return [rate("stat_warm", len(paths), seconds)]


def readdir(ws: Workspace) -> list[Figure]:
    """Lists the directory of files several times (after one untimed pass)."""
    paths = _ensure_many(ws)
    directory = os.path.dirname(paths[0])
    with ws.progress.stage("warm-up pass"):
        _list(directory, len(paths))
    passes = range(ws.sizes.readdir_passes)
    start = perf_counter()
    for batch in ws.progress.track(passes, 1, "passes"):
        for _ in batch:
            _list(directory, len(paths))
    seconds = perf_counter() - start
    return [rate("readdir", len(passes) * len(paths), seconds)]


def rename(ws: Workspace) -> list[Figure]:
    """Renames every file to a new name in the same directory."""
    paths = _ensure_many(ws)
    targets = [os.path.join(os.path.dirname(p), "r" + os.path.basename(p)) for p in paths]
    pairs = list(zip(paths, targets))
    ws.many = None
    start = perf_counter()
    for batch in ws.progress.track(pairs, 1024, "renames"):
        for old, new in batch:
            os.rename(old, new)
    seconds = perf_counter() - start
    ws.many = targets
    return [rate("rename", len(pairs), seconds)]


def unlink(ws: Workspace) -> list[Figure]:
    """Unlinks every file."""
    paths = _ensure_many(ws)
    ws.many = None
    start = perf_counter()
    for batch in ws.progress.track(paths, 1024, "unlinks"):
        for path in batch:
            os.unlink(path)
    seconds = perf_counter() - start
    return [rate("unlink", len(paths), seconds)]


def mkdir(ws: Workspace) -> list[Figure]:
    """Makes directories in one directory."""
    parent = ws.fresh_dir("dirs")
    paths = [os.path.join(parent, f"d{i:06d}") for i in range(ws.sizes.dirs)]
    start = perf_counter()
    for batch in ws.progress.track(paths, 1024, "dirs"):
        for path in batch:
            os.mkdir(path)
    seconds = perf_counter() - start
    return [rate("mkdir", len(paths), seconds)]


def small_files(ws: Workspace) -> list[Figure]:
    """Writes small files (open, write, close), then reads them back while cached."""
    sizes = ws.sizes
    directory = ws.fresh_dir("small")
    paths = [os.path.join(directory, f"s{i:06d}") for i in range(sizes.small_files)]
    data = pattern(sizes.small_file_bytes)
    start = perf_counter()
    for batch in ws.progress.track(paths, 256, "files written"):
        for path in batch:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)
    write_seconds = perf_counter() - start

    buffers = [bytearray(sizes.small_file_bytes)]
    got = 0
    start = perf_counter()
    for batch in ws.progress.track(paths, 256, "files read"):
        for path in batch:
            fd = os.open(path, os.O_RDONLY)
            got += os.readv(fd, buffers)
            os.close(fd)
    read_seconds = perf_counter() - start
    if got != len(paths) * sizes.small_file_bytes:
        raise BenchError(f"read {got} bytes from {len(paths)} small files, "
                         f"expected {len(paths) * sizes.small_file_bytes}")
    return [rate("small_files_write", len(paths), write_seconds),
            rate("small_files_read", len(paths), read_seconds)]


def _ensure_many(ws: Workspace) -> list[str]:
    """The files made by ``create``, made now (untimed) if it has not run."""
    if ws.many is None:
        with ws.progress.stage("creating the files, untimed"):
            create(ws)
    return ws.many


def _list(directory: str, expected: int) -> None:
    """Lists ``directory`` once, reading every name, and checks the count."""
    with os.scandir(directory) as entries:
        names = [entry.name for entry in entries]
    if len(names) != expected:
        raise BenchError(f"listed {len(names)} entries in {directory}, expected {expected}")


# -- storage policy on a subtree ------------------------------------------------------------


def setfattr_subtree(ws: Workspace) -> list[Figure]:
    """Times setting the storage policy on an empty directory and on a large subtree.

    The design makes this O(1) in the size of the subtree, so the two times should be close.
    Each time is the median of a few settings, each from WARM to COLD so that none is a
    no-op. The subtree is built once per run (untimed), not again for every round.
    """
    if not supports_policy_xattr(ws.root):
        raise SkipWorkload(f"no {POLICY_XATTR} here (not a tierfs mount)")
    empty = ws.fresh_dir("policy-empty")
    tree = ws.policy_tree
    if tree is None:
        tree = ws.fresh_dir("policy-tree")
        _build_tree(ws, tree)
        ws.policy_tree = tree  # only once it is complete
    empty_seconds = _median_policy_set(empty, ws.sizes.setfattr_repeats)
    tree_seconds = _median_policy_set(tree, ws.sizes.setfattr_repeats)
    repeats = ws.sizes.setfattr_repeats
    return [Figure("setfattr_empty", empty_seconds * 1e3, empty_seconds, repeats),
            Figure("setfattr_subtree", tree_seconds * 1e3, tree_seconds, repeats),
            Figure("setfattr_ratio", tree_seconds / empty_seconds, tree_seconds, repeats)]


def supports_policy_xattr(path: str) -> bool:
    """Whether ``path`` answers the tierfs storage-policy xattr (that is, is on tierfs)."""
    try:
        os.getxattr(path, POLICY_XATTR)
    except OSError:
        return False
    return True


def _build_tree(ws: Workspace, tree: str) -> None:
    """Fills ``tree`` with directories of empty files (untimed)."""
    sizes = ws.sizes
    descendants = sizes.subtree_dirs * (1 + sizes.subtree_files_per_dir)
    names = [f"f{j:05d}" for j in range(sizes.subtree_files_per_dir)]
    with ws.progress.stage(f"building {descendants:,} descendants, untimed"):
        for batch in ws.progress.track(range(sizes.subtree_dirs), 1, "dirs"):
            for i in batch:
                directory = os.path.join(tree, f"d{i:04d}")
                os.mkdir(directory)
                for name in names:
                    path = os.path.join(directory, name)
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))


def _median_policy_set(path: str, repeats: int) -> float:
    """The median time of setting COLD on ``path``, each time after setting WARM."""
    times = []
    for _ in range(repeats):
        os.setxattr(path, POLICY_XATTR, b"WARM")
        start = perf_counter()
        os.setxattr(path, POLICY_XATTR, b"COLD")
        times.append(perf_counter() - start)
    return statistics.median(times)


# -- helpers --------------------------------------------------------------------------------


def drop_caches(paths: tuple[str, ...]) -> None:
    """Empties the page cache so that the next read comes from the disk.

    Only clean pages can be dropped, so the filesystems of ``paths`` are synced first. syncfs
    on just those (rather than sync(2), which writes back every mount on the machine) keeps
    a wedged FUSE mount elsewhere from hanging the benchmark.
    """
    if os.geteuid() != 0:
        raise SkipWorkload("dropping the page cache needs root")
    for path in paths:
        syncfs(path)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
    except OSError as e:
        raise SkipWorkload(f"cannot drop the page cache: {e}") from e
    PageCache.drops += 1


def _expect_size(path: str, size: int) -> None:
    """Checks that a file just written has the size the writes add up to."""
    actual = os.stat(path).st_size
    if actual != size:
        raise BenchError(f"{path} is {actual} bytes after writing {size}")


WORKLOADS = (
    Workload("seq_write", seq_write, ("seq_write",)),
    Workload("seq_read_cold", seq_read_cold, ("seq_read_cold",)),
    Workload("seq_read_warm", seq_read_warm, ("seq_read_warm",)),
    Workload("rand_read_4k", rand_read_4k, ("rand_read_4k",)),
    Workload("rand_write_4k", rand_write_4k, ("rand_write_4k",)),
    Workload("append_small", append_small, ("append_small",)),
    Workload("create", create, ("create",)),
    Workload("stat_warm", stat_warm, ("stat_warm",)),
    Workload("readdir", readdir, ("readdir",)),
    Workload("rename", rename, ("rename",)),
    Workload("unlink", unlink, ("unlink",)),
    Workload("mkdir", mkdir, ("mkdir",)),
    Workload("small_files", small_files, ("small_files_write", "small_files_read")),
    Workload("setfattr_subtree", setfattr_subtree,
             ("setfattr_empty", "setfattr_subtree", "setfattr_ratio")),
)
