"""What fsck finds on the volumes: the replica files of each volume by block
(:func:`scan_volume`), the reading of a whole replica against its checksums
(:func:`verify_replica`) and the judged state of one recorded replica (:class:`ReplicaState`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tierfs.backends.meta import CRC_SIZE, HEADER_SIZE, num_chunks
from tierfs.backends.volume import Volume
from tierfs.fs.errors import ChecksumError, FsError
from tierfs.tools.fsck.snapshot import _ranges

VERIFY_SPAN = 4 << 20
"""Bytes verified per read: big enough to be fast, small enough for RAM."""

SCAN_ATTEMPTS = 5
"""Beside a daemon a file can vanish between listing a directory and its stat: rescan."""


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
