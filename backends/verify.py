"""Reading a whole replica against its checksums: what fsck reports of each replica, and
what a mount checks before it records a replica the namespace did not know on a volume."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from tierfs.backends.meta import CRC_SIZE, HEADER_SIZE, num_chunks
from tierfs.backends.volume import Volume
from tierfs.fs.errors import ChecksumError, FsError

VERIFY_SPAN = 4 << 20
"""Bytes verified per read: big enough to be fast, small enough for RAM."""


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
            reasons.append(f"checksum mismatch in chunk(s) {chunk_ranges(mismatched)}")
        if self.crc_count < self.chunks:
            reasons.append(f"meta file has checksums for {self.crc_count} of "
                           f"{self.chunks} chunks")
        return "; ".join(reasons) or None

    def serves(self, length: int) -> bool:
        """Whether reads of a block of ``length`` bytes can be served from this replica:
        every chunk verifies, the meta file holds exactly one checksum per chunk, and the
        data is not shorter (bytes past ``length`` are never read)."""
        return (self.corruption() is None and self.crc_count == self.chunks
                and self.length >= length)

    def is_whole(self, length: int) -> bool:
        """Whether this is exactly a replica of a block of ``length`` bytes."""
        return self.serves(length) and self.length == length


def verify_replica(volume: Volume, block_id: int, gs: int,
                   advance: Callable[[int], None] = lambda count: None) -> Verdict:
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


def chunk_ranges(numbers: list[int]) -> str:
    """``0, 3-5, 9`` for [0, 3, 4, 5, 9]."""
    out: list[str] = []
    start = end = None
    for n in sorted(numbers):
        if end is not None and n == end + 1:
            end = n
            out[-1] = f"{start}-{end}"
            continue
        start = end = n
        out.append(str(n))
    return ", ".join(out)
