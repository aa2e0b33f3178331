"""Micro-benchmark: Replica I/O cost as a function of bytes per checksum.

Chooses the default ``bytes_per_checksum`` written at mkfs. Smaller chunks make a small
random read verify less data; larger chunks mean fewer CRC calls (and a smaller meta file) on
big sequential I/O. This measures the Replica layer alone, in one thread, on a temporary
volume whose files stay in the page cache, so the figures are the CPU cost tierfs adds, not
disk speed:

* write 1 MiB sequential (MB/s), write 4 KiB at random aligned offsets (ops/s),
  append 100 bytes (ops/s);
* read 1 MiB sequential (MB/s), read 4 KiB at random aligned offsets (ops/s).

A "raw" row runs the same loops with plain ``pwrite``/``pread`` on one file and no
checksums: the floor on the machine at hand, to read the other rows against.

Run: ``python bench/bpc.py [--dir DIR] [--size-mib 64] [--bpc 512,4096,16384,65536]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tierfs.backends.replica import Replica
from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume import Volume

MiB = 1 << 20
KiB = 1 << 10
FIRST_BLOCK = 1 << 30


def best_of(runs: int, fn: Callable[[], float]) -> float:
    """Best rate of ``runs`` runs: the page-cache figure, least disturbed by other work."""
    return max(fn() for _ in range(runs))


class RawFile:
    """Baseline: the same calls as a Replica on one plain file, with no checksums at all."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, offset: int, data) -> None:
        os.pwrite(self.fd, data, offset)

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def fsync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink()


class Bench:
    """One kind of file (a Replica with one ``bytes_per_checksum``, or raw) and five figures.

    Every figure is taken on files in the page cache; a filled file is fsynced before it is
    measured, so writeback of earlier runs does not land inside the timed loop.
    """

    def __init__(self, new: Callable[[], object], drop: Callable[[object], None], size: int, ops: int, appends: int):
        self.new = new
        self.drop = drop
        self.size = size
        self.ops = ops
        self.appends = appends
        self.payload = os.urandom(MiB)
        self.rng = random.Random(42)

    def _filled(self):
        target = self.new()
        for off in range(0, self.size, MiB):
            target.write(off, self.payload)
        target.fsync()
        return target

    def _offsets(self, unit: int) -> list[int]:
        return [self.rng.randrange(self.size // unit) * unit for _ in range(self.ops)]

    def seq_write(self) -> float:
        target = self.new()
        mv = memoryview(self.payload)
        start = time.perf_counter()
        for off in range(0, self.size, MiB):
            target.write(off, mv)
        elapsed = time.perf_counter() - start
        self.drop(target)
        return self.size / elapsed / 1e6

    def random_write(self) -> float:
        target = self._filled()
        piece = self.payload[: 4 * KiB]
        offsets = self._offsets(4 * KiB)
        write = target.write
        start = time.perf_counter()
        for off in offsets:
            write(off, piece)
        elapsed = time.perf_counter() - start
        self.drop(target)
        return len(offsets) / elapsed

    def appends_100(self) -> float:
        target = self.new()
        piece = self.payload[:100]
        write = target.write
        start = time.perf_counter()
        for i in range(self.appends):
            write(i * 100, piece)
        elapsed = time.perf_counter() - start
        self.drop(target)
        return self.appends / elapsed

    def seq_read(self, target) -> float:
        start = time.perf_counter()
        for off in range(0, self.size, MiB):
            target.read(off, MiB)
        return self.size / (time.perf_counter() - start) / 1e6

    def random_read(self, target) -> float:
        offsets = self._offsets(4 * KiB)
        read = target.read
        start = time.perf_counter()
        for off in offsets:
            read(off, 4 * KiB)
        return len(offsets) / (time.perf_counter() - start)

    def run(self, runs: int) -> dict[str, float]:
        figures = {
            "write 1M seq MB/s": best_of(runs, self.seq_write),
            "write 4K rand op/s": best_of(runs, self.random_write),
            "append 100B op/s": best_of(runs, self.appends_100),
        }
        target = self._filled()
        figures["read 1M seq MB/s"] = best_of(runs, lambda: self.seq_read(target))
        figures["read 4K rand op/s"] = best_of(runs, lambda: self.random_read(target))
        figures["append us/op"] = 1e6 / figures["append 100B op/s"]
        self.drop(target)
        return figures


def replica_bench(root: Path, bpc: int, args) -> Bench:
    volume = Volume.format(root / f"bpc{bpc}", fs_uuid="bench", volume_id=bpc, storage_type=StorageType.SSD)
    block_ids = iter(range(FIRST_BLOCK, FIRST_BLOCK + 1_000_000))

    def new() -> Replica:
        return volume.create_replica(next(block_ids), 1001, bpc)

    def drop(replica: Replica) -> None:
        replica.close()
        volume.delete_replica(replica.block_id)

    return Bench(new, drop, args.size_mib * MiB, args.ops, args.appends)


def raw_bench(root: Path, args) -> Bench:
    names = (root / f"raw{i}" for i in range(1_000_000))
    return Bench(lambda: RawFile(next(names)), lambda f: f.close(), args.size_mib * MiB, args.ops, args.appends)


def print_table(rows: dict[str, dict[str, float]]) -> None:
    columns = list(next(iter(rows.values())))
    print(f"{'bpc':>6}  {'meta %':>6}  " + "  ".join(f"{c:>18}" for c in columns))
    for name, figures in rows.items():
        overhead = f"{400 / int(name):.2f}" if name.isdigit() else "-"
        cells = "  ".join(f"{figures[c]:>18,.1f}" for c in columns)
        print(f"{name:>6}  {overhead:>6}  {cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to make the temporary volume")
    parser.add_argument("--size-mib", type=int, default=64, help="replica size for sequential and random I/O")
    parser.add_argument("--bpc", default="512,4096,16384,65536", help="comma-separated chunk sizes")
    parser.add_argument("--ops", type=int, default=20_000, help="random 4 KiB operations per run")
    parser.add_argument("--appends", type=int, default=50_000, help="100-byte appends per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (best is kept)")
    args = parser.parse_args(argv)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tierfs-bpc-", dir=args.dir) as tmp:
        root = Path(tmp)
        rows["raw"] = raw_bench(root, args).run(args.runs)
        for bpc in (int(x) for x in args.bpc.split(",")):
            rows[str(bpc)] = replica_bench(root, bpc, args).run(args.runs)
    print(f"Replica I/O, one thread, page cache, {args.size_mib} MiB replicas, best of {args.runs}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    print_table(rows)
    print("raw = plain pwrite/pread on one file, no checksums (the floor on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
