"""The HDFS block meta-file format and chunk checksums.

A replica's meta file (``blk_<id>_<gs>.meta``) is byte for byte the HDFS one, so HDFS's own
``hdfs debug verifyMeta`` could check it:

* a 7-byte big-endian header: ``short`` version (1), ``byte`` checksum type (CRC32C = 2),
  ``int`` bytes per checksum;
* then one big-endian 4-byte CRC32C per chunk of ``bytes_per_checksum`` data bytes, in chunk
  order; the last chunk may be partial.

The generation stamp is not in the file; it lives only in the file name.

Everything here is pure (no I/O) so the replica code and the tests can share it, and the tests
can still check the file independently with ``struct``.
"""

from __future__ import annotations

import functools
import struct

import crc32c as _crc32c

from tierfs.fs.errors import ChecksumError

VERSION = 1
CRC32C = 2
HEADER_SIZE = 7
CRC_SIZE = 4

_HEADER = struct.Struct(">hbi")
CRC_STRUCT = struct.Struct(">I")
"""One stored CRC; ``CRC_STRUCT.pack(c)`` is the cheapest way to make its 4 bytes."""
_CRC = CRC_STRUCT
_MAX_BPC = 2**31 - 1

crc32c = _crc32c.crc32c
"""``crc32c(data, value=0)``: CRC32C of ``data``, continuing from ``value``.

Continuing is what makes appends cheap: ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
"""


def header_bytes(bytes_per_checksum: int) -> bytes:
    """The 7-byte meta header for CRC32C chunks of ``bytes_per_checksum`` bytes."""
    if not 0 < bytes_per_checksum <= _MAX_BPC:
        raise ValueError(f"bytes per checksum must be in 1..{_MAX_BPC}, not {bytes_per_checksum}")
    return _HEADER.pack(VERSION, CRC32C, bytes_per_checksum)


def parse_header(raw: bytes) -> tuple[int, int, int]:
    """``(version, checksum type, bytes per checksum)`` from the start of a meta file.

    Only what tierfs writes is accepted (version 1, CRC32C, a positive chunk size): any other
    header means the file is damaged or not ours, and reading data through it would be
    guessing, so it raises ChecksumError (EIO).
    """
    if len(raw) < HEADER_SIZE:
        raise ChecksumError(f"meta header is {len(raw)} bytes, expected {HEADER_SIZE}")
    version, ctype, bpc = _HEADER.unpack_from(raw)
    if version != VERSION:
        raise ChecksumError(f"unexpected meta-file version {version} (expected {VERSION})")
    if ctype != CRC32C:
        raise ChecksumError(f"unsupported checksum type {ctype} (expected CRC32C={CRC32C})")
    if bpc <= 0:
        raise ChecksumError(f"invalid bytes per checksum {bpc} in meta header")
    return version, ctype, bpc


def num_chunks(length: int, bytes_per_checksum: int) -> int:
    """How many chunks (and so CRCs) ``length`` data bytes make: ceil(length / bpc)."""
    return -(-length // bytes_per_checksum)


def meta_size(length: int, bytes_per_checksum: int) -> int:
    """Size of the meta file of a replica of ``length`` bytes: 7 + 4 * ceil(length / bpc)."""
    return HEADER_SIZE + CRC_SIZE * num_chunks(length, bytes_per_checksum)


def crc_offset(chunk: int) -> int:
    """Offset in the meta file of the CRC of chunk number ``chunk``."""
    return HEADER_SIZE + CRC_SIZE * chunk


def byte_view(data) -> memoryview:
    """A flat byte view of any bytes-like object, so lengths and slices count bytes.

    Slicing a memoryview does not copy, which keeps per-chunk checksumming of a 1 MiB write
    free of allocations beyond the CRC list.
    """
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def chunk_crc_list(data, bytes_per_checksum: int, *, skip: int = 0, value: int = 0) -> list[int]:
    """CRC32C of each chunk-sized piece of ``data``; the last piece may be partial.

    ``skip`` says that ``data`` starts ``skip`` bytes into its first chunk, so the first piece
    is only ``bytes_per_checksum - skip`` bytes; ``value`` is the CRC of those skipped bytes
    (of an existing prefix of the chunk), and the first CRC continues from it. Together they
    let a write that starts inside a chunk, an append to a partial chunk above all, update
    that chunk's CRC without re-reading it.
    """
    mv = byte_view(data)
    n = len(mv)
    bpc = bytes_per_checksum
    head = bpc - skip
    if n <= head:
        return [crc32c(mv, value)] if n else []
    crcs = [crc32c(mv[:head], value)]
    crcs += [crc32c(mv[i : i + bpc]) for i in range(head, n, bpc)]
    return crcs


def pack_crcs(crcs: list[int]) -> bytes:
    """The meta-file bytes of a run of CRCs (big-endian, 4 bytes each)."""
    if len(crcs) == 1:
        return _CRC.pack(crcs[0])
    return struct.pack(f">{len(crcs)}I", *crcs)


def unpack_crcs(raw: bytes) -> tuple[int, ...]:
    """The CRCs stored in ``raw`` (a whole number of 4-byte entries)."""
    return struct.unpack(f">{len(raw) // CRC_SIZE}I", raw)


def unpack_crc(raw: bytes, offset: int = 0) -> int:
    """The single CRC stored at ``offset`` in ``raw``."""
    return _CRC.unpack_from(raw, offset)[0]


def chunk_crcs(data, bytes_per_checksum: int) -> bytes:
    """Concatenated big-endian CRC32C of each chunk of ``data``, as stored in a meta file."""
    return pack_crcs(chunk_crc_list(data, bytes_per_checksum))


def first_bad_chunk(data, stored: bytes, bytes_per_checksum: int) -> int | None:
    """Index (within ``data``) of the first chunk whose CRC differs from ``stored``, or None.

    ``data`` starts at a chunk boundary. A chunk with no stored CRC (``stored`` too short)
    counts as bad: missing checksums never let data through.
    """
    mv = byte_view(data)
    computed = chunk_crcs(mv, bytes_per_checksum)
    if computed == stored[: len(computed)] and len(stored) >= len(computed):
        return None
    for index in range(len(computed) // CRC_SIZE):
        at = index * CRC_SIZE
        if computed[at : at + CRC_SIZE] != stored[at : at + CRC_SIZE]:
            return index
    raise AssertionError("CRC runs differ but no chunk differs")


@functools.lru_cache(maxsize=64)
def zero_chunk_crc(nbytes: int) -> int:
    """CRC32C of ``nbytes`` zero bytes (cached: extending a replica with zeros is common)."""
    return crc32c(bytes(nbytes))


def longest_matching_prefix(chunk, stored_crc: int) -> int:
    """The largest ``p >= 1`` such that ``crc32c(chunk[:p]) == stored_crc``, or 0.

    Used only in crash recovery on the last chunk that has a CRC: when a crash comes
    between appending data and updating that chunk's CRC, the stored CRC still covers the
    chunk's old, acknowledged length, which this finds. It costs one CRC step per byte of one
    chunk, which is fine once per recovered replica.
    """
    mv = byte_view(chunk)
    best = 0
    crc = 0
    for end in range(1, len(mv) + 1):
        crc = crc32c(mv[end - 1 : end], crc)
        if crc == stored_crc:
            best = end
    return best
