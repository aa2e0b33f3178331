"""Verified replica copies between volumes: the primitive of lazy persist and block moves.

A copy reads the source through ``Replica.read`` (every chunk verified against its CRC, so a
corrupt source is never propagated), writes a temporary data file and a copy of the meta
file in the target volume's ``tmp/``, and installs them with ``Volume.install_replica``
(fsync, rename, fsync of the directory). A crash at any step leaves at most files in
``tmp/``, which the next mount clears: never a half replica under a layout name. Runs in a
worker thread; it shares nothing with the trio thread but the replica files.
"""

from __future__ import annotations

import errno
import os
import uuid
from contextlib import contextmanager

from tierfs.backends.volume import Volume
from tierfs.fs.errors import OUT_OF_DESCRIPTORS, ChecksumError, FsError, VolumeError

COPY_CHUNK = 1 << 20


class SourceReplicaError(FsError):
    """The copy failed on its source (missing, unreadable, or ``corrupt``: a chunk failed
    its checksum), not on its target: the caller blames the source replica, not the
    target volume."""

    def __init__(self, source: Volume, block_id: int, gs: int, cause: BaseException):
        err = cause.errno if isinstance(cause, (FsError, OSError)) and cause.errno else errno.EIO
        detail = cause.strerror if isinstance(cause, OSError) and cause.strerror else cause
        super().__init__(err, f"copy of blk_{block_id}_{gs}: source {source.path}: {detail}")
        self.corrupt = isinstance(cause, ChecksumError)


@contextmanager
def _source_side(source: Volume, block_id: int, gs: int):
    """Errors reading the source become SourceReplicaError, except running out of
    descriptors, which says nothing about the replica (nor about the target)."""
    try:
        yield
    except (FsError, OSError) as exc:
        if exc.errno in OUT_OF_DESCRIPTORS:
            raise
        raise SourceReplicaError(source, block_id, gs, exc) from exc


def copy_replica(source: Volume, target: Volume, block_id: int, gs: int) -> int:
    """Copy replica ``blk_<id>_<gs>`` from ``source`` to ``target``; returns its length.
    A failure reading the source raises SourceReplicaError, one writing the target
    VolumeError."""
    tag = uuid.uuid4().hex
    tmp_data = target.tmp_dir / f"blk_{block_id}.{tag}"
    tmp_meta = target.tmp_dir / f"blk_{block_id}_{gs}.meta.{tag}"
    with _source_side(source, block_id, gs):
        replica = source.open_replica(block_id, gs, writable=False)
    try:
        length = replica.length
        with open(tmp_data, "wb") as out:
            offset = 0
            while offset < length:
                with _source_side(source, block_id, gs):
                    data = replica.read(offset, COPY_CHUNK)
                out.write(data)
                offset += len(data)
        with _source_side(source, block_id, gs), open(source.meta_path(block_id, gs),
                                                        "rb") as meta_in:
            meta = meta_in.read()
        with open(tmp_meta, "wb") as meta_out:
            meta_out.write(meta)
        target.install_replica(block_id, gs, tmp_data, tmp_meta)
    except BaseException as exc:
        for leftover in (tmp_data, tmp_meta):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError):
            # e.g. a writer re-stamped the block meanwhile (its meta file was renamed), or
            # the target is full: the caller retries; it is not a bug of the daemon
            raise VolumeError(f"copy of blk_{block_id}_{gs} from {source.path} to "
                              f"{target.path} failed: {exc.strerror or exc}",
                              exc.errno or errno.EIO) from exc
        raise
    finally:
        replica.close()
    return length


def copy_error(exc: BaseException) -> str:
    """A one-line reason for a failed copy, for logs and reports."""
    return str(exc) if isinstance(exc, FsError) else f"{type(exc).__name__}: {exc}"
