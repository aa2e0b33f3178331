"""An open replica: its data file and meta file, with verified reads and checksummed writes.

A replica is two files on one volume: ``blk_<id>`` holds the block's bytes and
``blk_<id>_<gs>.meta`` holds a 7-byte header and one CRC32C per chunk of
``bytes_per_checksum`` bytes (see ``backends/meta.py``). Every read checks the CRCs of the
chunks it touches; every write rewrites the CRCs of the chunks it touches, so the two files
agree after each call returns.

Speed. The daemon serves FUSE writes straight into these calls, so the common cases are kept
to a couple of system calls on descriptors held open:

* an append (above all a small one into a partial last chunk) continues that chunk's CRC from
  its stored value, ``crc32c(new, prev)``, without reading the chunk back;
* a chunk-aligned read is one ``pread`` of data and one of the CRCs; ``read(nowait=True)``
  reads only what is already in the page cache (``RWF_NOWAIT``), so the daemon can serve a
  cached read in its event loop and send only the others to a worker thread;
* a sequential reader has the data ahead of it read into the page cache early
  (``POSIX_FADV_WILLNEED``, HDFS's datanode readahead), so its reads find their pages there;
* whole chunks are checksummed from memoryview slices, so nothing is copied;
* a large page-aligned write (``DIRECT_WRITE_BYTES``) goes to the disk with ``O_DIRECT`` from
  one reused buffer, without a copy into fresh page-cache pages; smaller ones stay in the
  page cache, and the kernel keeps the two coherent (a direct write first writes out and
  then drops the cached pages it covers; writes to one block are serialized by its lock).

Only a write or truncate that cuts into the middle of an existing chunk reads that chunk back,
and it verifies the old chunk first, so a corrupt byte is never blessed with a fresh CRC.

Sharing. Several Replica objects may be open on one block of one volume (the writer and any
number of readers). They share one ``_BlockState``: the current length, a lock, and what the
writer caches about the meta file. A reader therefore sees a growing file grow, and a read in
one thread never sees data whose CRC another thread has not written yet. The lock is held only
around the system calls; CRCs of reads are verified outside it.

Crash states (the data file is written before the meta file, in every call):

============================================  ==============================================
crash between the two writes                  what ``verified_length`` later reports
============================================  ==============================================
append: data longer than its CRCs cover       the old length, even inside a partial chunk
overwrite: new data, old CRC                  the start of the first chunk that fails
truncate (meta cut and re-CRCed, data not)    the new length
============================================  ==============================================
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from typing import TYPE_CHECKING

from tierfs.backends.crc_combine import chunks_match
from tierfs.backends.meta import (
    CRC_SIZE,
    CRC_STRUCT,
    HEADER_SIZE,
    byte_view,
    chunk_crc_list,
    crc32c,
    crc_offset,
    first_bad_chunk,
    longest_matching_prefix,
    num_chunks,
    pack_crcs,
    unpack_crc,
    unpack_crcs,
    zero_chunk_crc,
)
from tierfs.fs.errors import OUT_OF_DESCRIPTORS, ChecksumError, FsError, VolumeError

if TYPE_CHECKING:
    from tierfs.backends.volume import Volume

log = logging.getLogger(__name__)

_RECOVERY_SPAN = 4 << 20
"""Bytes read at a time by ``verified_length``: big enough to be fast, small enough for RAM."""

SYNC_BEHIND_BYTES = 4 << 20
"""Sync-behind writes (HDFS ``dfs.datanode.sync.behind.writes``): once this many bytes of a
data file have been written since the last time, the disk is asked to start writing them
out. The page cache would otherwise sit on a whole sequentially written file until its fsync,
which then pays for all of it at once; measured in README, "Block size and checksum chunk"."""

READ_AHEAD_BYTES = 8 << 20
"""Datanode readahead (HDFS ``dfs.datanode.readahead.bytes``): a reader that goes on where its
last read ended has this many bytes ahead of it asked for in advance, so the disk works while
the daemon checksums and the kernel copies. HDFS asks for 4 MiB; 8 MiB measured faster here
(cold 1 GiB reads through the mount, README "Speed"), and it is what the kernel itself reads
ahead on a disk tuned for streaming."""

DIRECT_WRITE_BYTES = 256 << 10
"""Writes of at least this many page-aligned bytes go to the data file with ``O_DIRECT``,
from the disk's point of view straight out of one reused buffer. Through the page cache
every such write copies into pages the kernel has just allocated, and on this VM a page the
guest has not touched lately costs a fault in the host: that copy was 65% of the daemon's
CPU on 1 GiB of sequential writes + fsync, which went from 255-345 to 560-675 MB/s
without it (README, "Speed"). Reads that follow come from the disk, or from the mount's own page
cache, which keeps what was written. Smaller writes (random 4 KiB writes, appends) stay
in the page cache, where the kernel gathers them."""

NOWAIT_LOCK_WAIT = 0.001
"""Seconds a read in the event loop waits for a block's lock before it leaves the read to a
worker thread. The lock is mostly held around page-cache copies and free within
microseconds; the bound is for a worker thread reading the disk under it, or a write held
up by the kernel's dirty-page throttling."""

_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


class _BlockState:
    """What every open Replica of one block on one volume must agree on.

    ``length`` is the data file's length. ``meta_ino`` names the meta file that ``meta_size``
    and ``tail_crc`` describe (the writer's; a stale meta file opened by a reader is never
    written). ``tail_crc`` caches the stored CRC of a partial last chunk, or is None when
    unknown or when the last chunk is full. ``charged`` is the change in bytes on disk made
    through this state; the volume adds it to its count when it reports used bytes, and
    folds it in when the last Replica closes or the files are deleted. Keeping it here lets
    a write account for space under the lock it already holds.
    """

    __slots__ = ("lock", "length", "users", "meta_ino", "meta_size", "tail_crc", "charged",
                 "written_behind", "read_end", "read_ahead_to")

    def __init__(self, length: int):
        self.lock = threading.Lock()
        self.length = length
        self.users = 0
        self.meta_ino: int | None = None
        self.meta_size = 0
        self.tail_crc: int | None = None
        self.charged = 0
        self.written_behind = 0  # data bytes before this offset are already being written out
        self.read_end = 0  # where the last read that returned data ended
        self.read_ahead_to = 0  # data bytes before this offset were asked for in advance


class Replica:
    """An open replica: synchronous I/O on its data and meta file. Callers decide about threads.

    Created by ``Volume.create_replica`` and ``Volume.open_replica``. ``gs`` is the generation
    stamp in the meta file's name; ``bytes_per_checksum`` comes from the meta header.
    """

    __slots__ = (
        "volume",
        "block_id",
        "gs",
        "bytes_per_checksum",
        "writable",
        "_data_fd",
        "_meta_fd",
        "_meta_ino",
        "_state",
        "_closed",
        "_can_write",
        "_direct_fd",
    )

    def __init__(
        self,
        volume: Volume,
        block_id: int,
        gs: int,
        bytes_per_checksum: int,
        data_fd: int,
        meta_fd: int,
        *,
        writable: bool,
    ):
        """Take ownership of two open descriptors (use the Volume methods, not this)."""
        self.volume = volume
        self.block_id = block_id
        self.gs = gs
        self.bytes_per_checksum = bytes_per_checksum
        self.writable = writable
        self._data_fd = data_fd
        self._meta_fd = meta_fd
        self._meta_ino = os.fstat(meta_fd).st_ino
        self._state = volume._attach(block_id, data_fd)
        self._closed = False
        self._can_write = writable
        self._direct_fd: int | None = None

    # ------------------------------------------------------------------ reading

    @property
    def length(self) -> int:
        """Current data length, shared by every Replica open on this block of this volume."""
        return self._state.length

    def read(self, offset: int, size: int, *, nowait: bool = False):
        """Up to ``size`` bytes at ``offset`` (``b""`` at or after the end), verified.

        The chunk-aligned range around the request is read with one ``pread`` and its CRCs
        with another; a mismatch raises ChecksumError naming the volume, block and chunk.
        With ``nowait`` (the daemon's event loop), None instead of waiting for the disk: when
        its pages are not all in the page cache, or when the block's lock stays taken for
        more than NOWAIT_LOCK_WAIT (a worker thread may be reading the disk under it). The
        data then comes as a bytes-like object rather than bytes.
        """
        if self._closed:
            self._refuse("read")
        if offset < 0 or size < 0:
            raise ValueError(f"negative offset or size ({offset}, {size})")
        bpc = self.bytes_per_checksum
        state = self._state
        if not state.lock.acquire(timeout=NOWAIT_LOCK_WAIT if nowait else -1):
            return None
        ahead = None
        try:
            length = state.length
            if offset >= length or size == 0:
                return b""
            end = offset + size
            if end > length:
                end = length
            first = offset // bpc
            last = (end - 1) // bpc
            start = first * bpc
            stop = last * bpc + bpc
            if stop > length:
                stop = length
            meta_offset = crc_offset(first)
            if nowait:
                buf = _pread_cached(self._data_fd, stop - start, start)
                if buf is None:
                    return None
                stored = _pread_cached(self._meta_fd, (last - first + 1) * CRC_SIZE, meta_offset)
                if stored is None:
                    return None
            else:
                buf = os.pread(self._data_fd, stop - start, start)
                stored = os.pread(self._meta_fd, (last - first + 1) * CRC_SIZE, meta_offset)
            ahead = _advance_read_ahead(state, start, stop)
        except OSError as e:
            raise self._os_error("read", e) from e
        finally:
            state.lock.release()
        if ahead is not None:
            _hint_will_need(self._data_fd, *ahead)
        if len(buf) != stop - start:
            raise self._damaged(f"data file is shorter than {stop} bytes")
        if not chunks_match(buf, stored, bpc):
            self._raise_mismatch(buf, stored, first)
        if start == offset and stop == end:
            return buf
        if nowait:
            return memoryview(buf)[offset - start : end - start]
        return buf[offset - start : end - start]

    def verified_length(self) -> int:
        """Length of the longest prefix of the data whose chunks verify (crash recovery).

        Only chunks that have both data and a stored CRC are considered, in order, up to the
        first that fails. If that failing chunk is the last one with a CRC, the data may
        simply have been appended past what its CRC covers when the process died, so the
        longest prefix of that chunk matching the stored CRC still counts: acknowledged bytes
        in a partial chunk are not lost. The files are not changed; ``truncate`` to the
        result makes them consistent.
        """
        if self._closed:
            self._refuse("verify")
        bpc = self.bytes_per_checksum
        with self._state.lock:
            try:
                data_len = os.fstat(self._data_fd).st_size
                crc_count = max(0, (os.fstat(self._meta_fd).st_size - HEADER_SIZE) // CRC_SIZE)
                chunks = min(num_chunks(data_len, bpc), crc_count)
                covered = min(data_len, chunks * bpc)
                step = max(1, _RECOVERY_SPAN // bpc) * bpc
                for pos in range(0, covered, step):
                    span = min(step, covered - pos)
                    buf = os.pread(self._data_fd, span, pos)
                    stored = os.pread(self._meta_fd, num_chunks(span, bpc) * CRC_SIZE, crc_offset(pos // bpc))
                    bad = first_bad_chunk(buf, stored, bpc)
                    if bad is not None:
                        return self._recovered_length(buf, stored, bad, pos // bpc, chunks)
            except OSError as e:
                raise self._os_error("verify", e) from e
        return covered

    def _recovered_length(self, buf: bytes, stored: bytes, bad: int, base: int, chunks: int) -> int:
        """Verified length when chunk ``base + bad`` (index ``bad`` in ``buf``) fails."""
        bpc = self.bytes_per_checksum
        index = base + bad
        if index != chunks - 1:
            return index * bpc
        chunk = memoryview(buf)[bad * bpc : bad * bpc + bpc]
        return index * bpc + longest_matching_prefix(chunk, unpack_crc(stored, bad * CRC_SIZE))

    # ------------------------------------------------------------------ writing

    def write(self, offset: int, data) -> None:
        """Write ``data`` (bytes-like) at ``offset``, updating the CRC of every touched chunk.

        Writing past the end first fills the gap with zeros, with their CRCs, so every chunk
        up to the end always has a CRC that matches. ENOSPC from the OS becomes
        FsError(ENOSPC); any other OSError FsError(EIO). The volume's used bytes follow.
        """
        if not self._can_write:
            self._refuse("write")
        if type(data) is not bytes:
            data = byte_view(data)
        if not data:
            return
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        state = self._state
        # acquire/release rather than ``with``: measured 3x cheaper, and this is the hot path
        state.lock.acquire()
        try:
            if offset == state.length and state.tail_crc is not None:
                if self._append_in_tail(state, data):
                    return
            self._write_locked(state, offset, data)
        except OSError as e:
            raise self._os_error("write", e) from e
        finally:
            state.lock.release()

    def _append_in_tail(self, state: _BlockState, data) -> bool:
        """The small-append fast path: extend the partial last chunk without leaving it.

        Applies when the writer's meta file is the one ``state`` describes and the new bytes
        end inside the chunk that is already partial (so the meta file does not grow). The
        chunk's CRC continues from the cached one. Returns False when it does not apply.
        """
        bpc = self.bytes_per_checksum
        length = state.length
        n = len(data)
        if state.meta_ino != self._meta_ino or length % bpc + n >= bpc:
            return False
        crc = crc32c(data, state.tail_crc)
        try:
            _pwrite_all(self._data_fd, data, length)
            _pwrite_all(self._meta_fd, CRC_STRUCT.pack(crc), crc_offset(length // bpc))
        except OSError:
            self._settle_failed_write(state, length, [])
            raise
        state.length = length + n
        state.tail_crc = crc
        state.charged += n
        return True

    def _write_locked(self, state: _BlockState, offset: int, data) -> None:
        """The general write (any offset and size); the caller holds the block lock.

        CRCs first (reading back and verifying only a chunk the write cuts into), then one
        ``pwrite`` of the data and one of the run of CRCs, data first (see the crash table).
        A write within one chunk skips the list of CRCs, since most FUSE writes are small.
        """
        bpc = self.bytes_per_checksum
        if state.meta_ino != self._meta_ino:
            self._adopt_meta(state)
        length = state.length
        grown = None
        if offset > length:
            grown = self._extend(state, offset)
            length = offset
        n = len(data)
        end = offset + n
        first, skip = divmod(offset, bpc)
        old_chunk = None
        if skip == 0:
            prefix_crc = 0
        elif offset == length:
            prefix_crc = state.tail_crc
            if prefix_crc is None:
                prefix_crc = self._tail_crc(state)
        else:
            old_chunk = self._verified_chunk(first, length)
            prefix_crc = crc32c(old_chunk[:skip])
        keeps_suffix = end < length and end % bpc
        if skip + n <= bpc:
            last = first
            crc = crc32c(data, prefix_crc)
            if keeps_suffix:
                if old_chunk is None:
                    old_chunk = self._verified_chunk(first, length)
                crc = crc32c(old_chunk[end - first * bpc :], crc)
            packed = CRC_STRUCT.pack(crc)
        else:
            last = (end - 1) // bpc
            crcs = chunk_crc_list(data, bpc, skip=skip, value=prefix_crc)
            if keeps_suffix:
                old_chunk = self._verified_chunk(last, length)
                crcs[-1] = crc32c(old_chunk[end - last * bpc :], crcs[-1])
            crc = crcs[-1]
            packed = pack_crcs(crcs)
        try:
            direct = self._write_data(data, offset)
            meta_end = _pwrite_all(self._meta_fd, packed, crc_offset(first))
        except OSError:
            if grown is None:
                self._settle_failed_write(state, offset, crcs if last > first else [crc],
                                          prefix_crc=prefix_crc)
            else:  # all the write touched lies past the old length
                self._undo_extend(state, grown)
            raise
        if end > length:
            state.length = end
            state.tail_crc = crc if end % bpc else None
            delta = end - length
        else:
            if length % bpc and last == (length - 1) // bpc:
                state.tail_crc = crc
            delta = 0
        if meta_end > state.meta_size:
            delta += meta_end - state.meta_size
            state.meta_size = meta_end
        state.charged += delta
        if direct:
            if state.written_behind == offset:
                state.written_behind = end
        elif end - state.written_behind >= SYNC_BEHIND_BYTES:
            _start_writeback(self._data_fd, state.written_behind, end - state.written_behind)
            state.written_behind = end

    def _write_data(self, data, offset: int) -> bool:
        """Write ``data`` at ``offset`` into the data file. A large page-aligned write goes
        past the page cache (``O_DIRECT``, see DIRECT_WRITE_BYTES) and True says so; a tail
        that is not a whole page follows through the page cache, as does everything on a
        filesystem that refuses direct I/O."""
        n = len(data)
        aligned = n - n % DIRECT_ALIGN
        if aligned >= DIRECT_WRITE_BYTES and offset % DIRECT_ALIGN == 0:
            if self._direct_fd is None:
                self._direct_fd = _open_direct(self._data_fd)
            if self._direct_fd is not None and self._direct_fd >= 0:
                buf = _direct_buffer(aligned)
                buf[:aligned] = byte_view(data)[:aligned]
                try:
                    _pwrite_all(self._direct_fd, memoryview(buf)[:aligned], offset)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    # opened, but its alignment rules are not ours: stay with the page cache
                    os.close(self._direct_fd)
                    self._direct_fd = -1
                else:
                    if aligned < n:
                        _pwrite_all(self._data_fd, byte_view(data)[aligned:], offset + aligned)
                    return True
        _pwrite_all(self._data_fd, data, offset)
        return False

    def truncate(self, length: int) -> None:
        """Cut the replica to ``length`` bytes, or extend it with zeros, keeping CRCs exact.

        Cutting inside a chunk recomputes that chunk's CRC from the bytes that remain, after
        checking the old chunk (a crash-recovery cut to ``verified_length`` is accepted when
        the stored CRC already matches the kept prefix). The meta file is cut and re-CRCed
        before the data file, so a crash in between still recovers to ``length``.
        """
        if not self._can_write:
            self._refuse("truncate")
        if length < 0:
            raise ValueError(f"negative length {length}")
        state = self._state
        with state.lock:
            try:
                if state.meta_ino != self._meta_ino:
                    self._adopt_meta(state)
                if length > state.length:
                    self._extend(state, length)
                elif length < state.length:
                    self._shrink(state, length)
            except OSError as e:
                raise self._os_error("truncate", e) from e

    def _extend(self, state: _BlockState, new_length: int) -> tuple:
        """Grow the replica with zeros to ``new_length`` and write their CRCs. Returns what
        ``_undo_extend`` needs to take the growth back when the write it made room for
        fails."""
        bpc = self.bytes_per_checksum
        old_length = state.length
        first, skip = divmod(old_length, bpc)
        crcs = []
        pos = old_length
        old_tail = []
        if skip:
            fill = min(bpc - skip, new_length - old_length)
            old_tail.append(self._tail_crc(state))
            crcs.append(crc32c(bytes(fill), old_tail[0]))
            pos += fill
        undo = (old_length, state.meta_size, state.charged, old_tail)
        full, rest = divmod(new_length - pos, bpc)
        packed = pack_crcs(crcs) if crcs else b""
        packed += pack_crcs([zero_chunk_crc(bpc)]) * full
        if rest:
            packed += pack_crcs([zero_chunk_crc(rest)])
        os.ftruncate(self._data_fd, new_length)
        try:
            meta_end = _pwrite_all(self._meta_fd, packed, crc_offset(first))
        except OSError:
            self._undo_extend(state, undo)
            raise
        if new_length % bpc == 0:
            state.tail_crc = None
        else:
            state.tail_crc = zero_chunk_crc(rest) if rest else crcs[-1]
        self._grow(state, new_length, meta_end)
        return undo

    def _undo_extend(self, state: _BlockState, undo: tuple) -> None:
        """Back to the length before ``_extend``: both files cut, and the old partial
        chunk's CRC, which the growth rewrote, put back."""
        state.length, state.meta_size, state.charged, old_tail = undo
        self._settle_failed_write(state, state.length, old_tail, rewrite=True)

    def _shrink(self, state: _BlockState, new_length: int) -> None:
        """Cut the replica to ``new_length`` bytes (meta file first, see ``truncate``)."""
        bpc = self.bytes_per_checksum
        index, keep = divmod(new_length, bpc)
        meta_length = crc_offset(num_chunks(new_length, bpc))
        if keep:
            new_crc = self._cut_chunk_crc(index, keep, state.length)
            os.ftruncate(self._meta_fd, meta_length)
            _pwrite_all(self._meta_fd, pack_crcs([new_crc]), crc_offset(index))
            state.tail_crc = new_crc
        else:
            os.ftruncate(self._meta_fd, meta_length)
            state.tail_crc = None
        os.ftruncate(self._data_fd, new_length)
        state.charged += (new_length - state.length) + (meta_length - state.meta_size)
        state.length = new_length
        state.meta_size = meta_length
        state.written_behind = min(state.written_behind, new_length)
        state.read_end = min(state.read_end, new_length)
        state.read_ahead_to = min(state.read_ahead_to, new_length)

    def _cut_chunk_crc(self, index: int, keep: int, length: int) -> int:
        """CRC of the first ``keep`` bytes of chunk ``index``, after checking the chunk.

        The chunk passes if its whole old content matches the stored CRC, or if the stored
        CRC already covers exactly the kept prefix (a torn append being rolled back).
        """
        bpc = self.bytes_per_checksum
        old = os.pread(self._data_fd, min(bpc, length - index * bpc), index * bpc)
        stored = self._stored_crc(index)
        new_crc = crc32c(memoryview(old)[:keep])
        if new_crc != stored and crc32c(old) != stored:
            raise self._mismatch(index, stored, crc32c(old))
        return new_crc

    def set_gs(self, new_gs: int) -> None:
        """Rename the meta file to the new generation stamp, durably.

        Called before any byte of a new version is written, so a crash leaves either the old
        name over old data or the new name; a replica with the old name is then stale.
        """
        if not self._can_write:
            self._refuse("set the generation stamp of")
        if new_gs == self.gs:
            return
        old_path = self.volume.meta_path(self.block_id, self.gs)
        new_path = self.volume.meta_path(self.block_id, new_gs)
        if new_path.exists():
            raise VolumeError(f"cannot rename {old_path.name}: {new_path} already exists", errno.EEXIST)
        try:
            os.rename(old_path, new_path)
        except OSError as e:
            raise self._os_error("rename the meta file of", e) from e
        try:
            self.volume._fsync_dir(new_path.parent)
        except OSError as e:
            try:  # back to the name the namespace still records (best effort)
                os.rename(new_path, old_path)
            except OSError:
                self.gs = new_gs  # the file stays at the new name: say so
            raise self._os_error("rename the meta file of", e) from e
        self.gs = new_gs

    def fsync(self) -> None:
        """Make the data and meta file durable (``fdatasync`` both). A file deleted behind
        the daemon's back syncs without an error and is gone at its close: that fails
        here, so that the replica is not taken for durable."""
        if self._closed:
            self._refuse("fsync")
        try:
            os.fdatasync(self._data_fd)
            os.fdatasync(self._meta_fd)
            deleted = 0 in (os.fstat(self._data_fd).st_nlink, os.fstat(self._meta_fd).st_nlink)
        except OSError as e:
            raise self._os_error("fsync", e) from e
        if deleted:
            raise FsError(errno.EIO, f"cannot fsync {self._where()}: its file was deleted")

    def close(self) -> None:
        """Close both files; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._can_write = False
        self.volume._detach(self.block_id, self._state)
        for fd in (self._data_fd, self._meta_fd):
            os.close(fd)
        if self._direct_fd is not None and self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "r"
        state = "closed" if self._closed else f"length={self.length}"
        return f"<Replica blk_{self.block_id}_{self.gs} on {self.volume.path} {mode} {state}>"

    # ------------------------------------------------------------------ helpers

    def _adopt_meta(self, state: _BlockState) -> None:
        """Make ``state`` describe this replica's meta file before writing through it."""
        state.meta_ino = self._meta_ino
        state.meta_size = os.fstat(self._meta_fd).st_size
        state.tail_crc = None

    def _settle_failed_write(self, state: _BlockState, offset: int, new_crcs: list[int], *,
                             prefix_crc: int = 0, rewrite: bool = False) -> None:
        """Make the two files agree again after a write from ``offset`` failed part-way.

        On a full disk ``pwrite`` stores part of the data and then fails, above all in a
        hole (a sparse replica, after a write past its end or a truncate up). What was
        stored past the length is cut off, as is a meta file grown past ``state``, and the
        chunks below the length that the write changed get CRCs of what they now hold, so
        that every chunk still verifies; the caller reports the error. ``new_crcs`` are the
        CRCs the write meant to give its chunks, from the one ``offset`` falls in, and
        ``prefix_crc`` the CRC of that chunk's bytes before ``offset``.

        The data is written in order, so from that chunk on: a chunk that holds its new
        bytes takes its new CRC; the first one that holds neither its new nor its old bytes
        is where the write stopped, and takes the CRC of what it holds (new bytes, then
        bytes of the failed write's range that it did not reach, or bytes this call
        verified, or bytes before ``offset`` that match ``prefix_crc``); the chunks after
        it were not reached and keep their CRCs, so old damage there is still reported,
        never blessed. ``rewrite``: ``new_crcs`` are to be written as they are (a CRC the
        failed meta write may have overwritten)."""
        bpc = self.bytes_per_checksum
        length = state.length
        state.tail_crc = None  # unknown: read again when needed (the length may be older)
        try:
            if os.fstat(self._data_fd).st_size > length:
                os.ftruncate(self._data_fd, length)
            if os.fstat(self._meta_fd).st_size > state.meta_size:
                os.ftruncate(self._meta_fd, state.meta_size)
            first = offset // bpc
            count = min(len(new_crcs), num_chunks(length, bpc) - first)
            if count <= 0:
                return
            settled = new_crcs[:count] if rewrite else self._crcs_after_failed_write(
                offset, count, new_crcs, prefix_crc, length)
            if settled:
                _pwrite_all(self._meta_fd, pack_crcs(settled), crc_offset(first))
        except (OSError, FsError) as exc:
            log.error("%s: chunks from %d may not verify after a failed write: %s",
                      self._where(), offset // bpc, getattr(exc, "strerror", None) or exc)

    def _crcs_after_failed_write(self, offset: int, count: int, new_crcs: list[int],
                                 prefix_crc: int, length: int) -> list[int]:
        """The CRCs to store from the chunk of ``offset`` on (``_settle_failed_write``)."""
        bpc = self.bytes_per_checksum
        first, skip = divmod(offset, bpc)
        start = first * bpc
        content = os.pread(self._data_fd, min(start + count * bpc, length) - start, start)
        stored = unpack_crcs(os.pread(self._meta_fd, CRC_SIZE * count, crc_offset(first)))
        if len(stored) != count:
            raise self._damaged(f"meta file has no checksum for chunk {first + len(stored)}")
        settled = []
        for i in range(count):
            actual = crc32c(content[i * bpc : (i + 1) * bpc])
            if actual == new_crcs[i]:
                settled.append(actual)
                continue
            if actual != stored[i] and (i or crc32c(content[:skip]) == prefix_crc):
                settled.append(actual)  # where the write stopped
            break  # else not reached, or its old bytes before ``offset`` are damaged
        return settled

    def _tail_crc(self, state: _BlockState) -> int:
        """Stored CRC of the partial last chunk, read once and then cached in ``state``."""
        if state.tail_crc is None:
            state.tail_crc = self._stored_crc(state.length // self.bytes_per_checksum)
        return state.tail_crc

    def _stored_crc(self, index: int) -> int:
        """The CRC the meta file holds for chunk ``index``."""
        raw = os.pread(self._meta_fd, CRC_SIZE, crc_offset(index))
        if len(raw) != CRC_SIZE:
            raise self._damaged(f"meta file has no checksum for chunk {index}")
        return unpack_crc(raw)

    def _verified_chunk(self, index: int, length: int) -> bytes:
        """The current bytes of chunk ``index``, checked against its stored CRC."""
        bpc = self.bytes_per_checksum
        start = index * bpc
        data = os.pread(self._data_fd, min(bpc, length - start), start)
        stored = self._stored_crc(index)
        actual = crc32c(data)
        if actual != stored:
            raise self._mismatch(index, stored, actual)
        return data

    def _grow(self, state: _BlockState, new_length: int, meta_end: int) -> None:
        """Record that the data file reached ``new_length`` and the meta file ``meta_end``."""
        if new_length > state.length:
            state.charged += new_length - state.length
            state.length = new_length
        if meta_end > state.meta_size:
            state.charged += meta_end - state.meta_size
            state.meta_size = meta_end

    def _where(self) -> str:
        return f"block {self.block_id} (blk_{self.block_id}_{self.gs}) on volume {self.volume.path}"

    def _mismatch(self, index: int, stored: int, actual: int) -> ChecksumError:
        return ChecksumError(
            f"checksum error in {self._where()}, chunk {index}: "
            f"stored crc32c {stored:#010x}, data has {actual:#010x}"
        )

    def _damaged(self, what: str) -> ChecksumError:
        return ChecksumError(f"{self._where()} is damaged: {what}")

    def _raise_mismatch(self, buf: bytes, stored: bytes, first: int) -> None:
        """Raise the ChecksumError for the first bad chunk of a read."""
        bpc = self.bytes_per_checksum
        bad = first_bad_chunk(buf, stored, bpc)
        index = first + bad
        at = bad * CRC_SIZE
        if len(stored) < at + CRC_SIZE:
            raise self._damaged(f"meta file has no checksum for chunk {index}")
        actual = crc32c(memoryview(buf)[bad * bpc : bad * bpc + bpc])
        raise self._mismatch(index, unpack_crc(stored, at), actual)

    def _os_error(self, action: str, e: OSError) -> FsError:
        """The FsError for an OSError: ENOSPC (and EDQUOT) stay ENOSPC, the rest is EIO."""
        reason = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return FsError(errno.ENOSPC, f"no space to {action} {self._where()}: {reason}")
        return FsError(errno.EIO, f"cannot {action} {self._where()}: {reason}")

    def _refuse(self, action: str) -> None:
        """A caller bug (I/O on a closed or read-only replica): loud, not an errno."""
        why = "closed" if self._closed else "opened read-only"
        raise ValueError(f"cannot {action} {self._where()}: replica is {why}")


def _advance_read_ahead(state: _BlockState, start: int, stop: int) -> tuple[int, int] | None:
    """Record a read of [start, stop) that returned data (under the lock); (offset, length)
    to ask for early when a readahead is due, else None.

    A read that starts within READ_AHEAD_BYTES of where the last one ended is sequential
    (the kernel's readahead requests may arrive slightly out of order, and a reader starting
    at the beginning of a block is one too); the next window is due once the reader is
    half-way through the last one. Random reads ask for nothing. Only reads that return
    data move the state, so a read tried from the page cache first and then from the disk
    counts once.
    """
    sequential = abs(start - state.read_end) <= READ_AHEAD_BYTES
    state.read_end = stop
    if not sequential or stop + READ_AHEAD_BYTES // 2 <= state.read_ahead_to:
        return None
    begin = max(stop, state.read_ahead_to)
    state.read_ahead_to = stop + READ_AHEAD_BYTES
    return begin, state.read_ahead_to - begin


def _hint_will_need(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start reading a range into the page cache (POSIX_FADV_WILLNEED),
    outside the block's lock. It only queues the reads (measured: cold 1 GiB reads are
    faster with it in the event loop than with a thread hop for it). Only a hint: a
    failure here is for the reads to report."""
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def _pread_cached(fd: int, nbytes: int, offset: int) -> bytearray | None:
    """``nbytes`` at ``offset`` if the page cache holds all of them, else None:
    ``preadv2(RWF_NOWAIT)`` does not wait for the disk. A filesystem that cannot do it
    (EOPNOTSUPP) answers None too, and so does a short read (a partly cached range, or a
    damaged, short file): the caller then reads the slow way, which tells them apart."""
    buf = bytearray(nbytes)
    try:
        got = os.preadv(fd, (buf,), offset, os.RWF_NOWAIT)
    except BlockingIOError:  # EAGAIN: nothing of it is cached
        return None
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            return None
        raise
    return buf if got == nbytes else None


DIRECT_ALIGN = 4096
"""Offset and length granularity of a direct write: the page size, which every Linux
filesystem that does direct I/O accepts (most need only their logical block size)."""

_direct_buffers = threading.local()


def _direct_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer of at least ``nbytes`` for direct writes, one per thread and
    reused, so that its pages stay mapped (a fresh buffer per write would fault them in)."""
    buf = getattr(_direct_buffers, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _direct_buffers.buf = mmap.mmap(-1, max(nbytes, 1 << 20))
    return buf


def _open_direct(fd: int) -> int | None:
    """A second, write-only ``O_DIRECT`` descriptor on the file open as ``fd``; -1 where
    the filesystem refuses direct I/O (this replica's writes then stay in the page cache);
    None when the process is out of descriptors for now (this write goes through the page
    cache, the next large one tries again)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        return None if e.errno in OUT_OF_DESCRIPTORS else -1


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range out, without waiting for it. Only a hint: a
    failure is left for fsync to report."""
    _libc.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _pwrite_all(fd: int, data, offset: int) -> int:
    """Write all of ``data`` at ``offset``; return the end offset."""
    written = os.pwrite(fd, data, offset)
    if written != len(data):
        _pwrite_rest(fd, data, offset, written)
    return offset + len(data)


def _pwrite_rest(fd: int, data, offset: int, written: int) -> None:
    """Finish a short ``pwrite`` (rare on regular files; a full disk raises ENOSPC instead)."""
    mv = byte_view(data)[written:]
    offset += written
    while mv:
        written = os.pwrite(fd, mv, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset}")
        mv = mv[written:]
        offset += written
