"""A volume: one local directory standing in for one storage tier.

Layout (HDFS's finalized layout without the block-pool level)::

    <path>/VERSION                       identity, JSON (see IDENTITY_FILE)
    <path>/current/finalized/subdir<A>/subdir<B>/blk_<id>
    <path>/current/finalized/subdir<A>/subdir<B>/blk_<id>_<gs>.meta
    <path>/tmp/                          scratch for copy-then-rename moves

with A = (id >> 16) & 0x1F and B = (id >> 8) & 0x1F, so consecutive block ids share a
directory 256 at a time and no directory grows past what a scan handles comfortably.

The identity file is checked at mount, so that a swapped, foreign or mistyped directory is
refused with a one-line message rather than served. Space is accounted in process: one scan
when the volume is opened, then every create, write, truncate and delete adjusts the count,
so placement can ask ``has_room`` on every new block for the cost of one ``statvfs``.

Durability: everything the namespace will point at is made durable before the call that
creates it returns (identity file, new directories, new replica files, meta renames). Deletes
are not synced: a replica file that comes back after a crash is an orphan or a stale replica,
and startup cleanup removes both.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import threading
import uuid as uuidlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierfs.backends.meta import HEADER_SIZE, header_bytes, parse_header
from tierfs.backends.replica import Replica, _BlockState
from tierfs.backends.storage_types import StorageType
from tierfs.fs.errors import OUT_OF_DESCRIPTORS, ChecksumError, VolumeError

_libc = ctypes.CDLL(None, use_errno=True)

IDENTITY_FILE = "VERSION"
"""JSON: ``{"layout_version": 1, "fs_uuid", "volume_uuid", "volume_id", "storage_type"}``."""

#: What an "empty" directory may hold: mkfs.ext4 makes lost+found at the root of every
#: filesystem, and a volume (or DATA) at the root of a freshly made disk is the usual case.
#: Nothing of tierfs's looks inside it, and nothing of tierfs's deletes it.
FOREIGN_BUT_EMPTY = frozenset({"lost+found"})

LAYOUT_VERSION = 1

_DATA_NAME = re.compile(r"blk_(-?\d+)")
_META_NAME = re.compile(r"blk_(-?\d+)_(\d+)\.meta")
_OPEN_FLAGS = os.O_CLOEXEC
#: How often ``sync_replica`` follows a meta file renamed under it (a new generation stamp
#: per write session of the file: more than a few during one sync is not a race but a bug).
META_RENAMES_FOLLOWED = 4
_NEW_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica found by a scan; either file may be missing (an orphan).

    ``gs`` and ``meta_path`` are None for a data file without any meta file; ``data_path``
    is None for a meta file without data. ``length`` is the data file's size (0 if none),
    ``meta_length`` the meta file's (0 if none).
    """

    block_id: int
    gs: int | None
    data_path: Path | None
    meta_path: Path | None
    length: int
    meta_length: int = 0


class Volume:
    """A formatted volume directory, opened: identity, layout, replica files, space."""

    def __init__(
        self,
        path: Path,
        *,
        fs_uuid: str,
        volume_uuid: str,
        volume_id: int,
        storage_type: StorageType,
        capacity: int | None,
    ):
        """Use ``Volume.format`` or ``Volume.open``; this only wires the fields and scans."""
        self.path = path
        self.fs_uuid = fs_uuid
        self.uuid = volume_uuid
        self.id = volume_id
        self.storage_type = storage_type
        self.capacity = capacity
        self.tmp_dir = path / "tmp"
        self._finalized = os.path.join(path, "current", "finalized")
        self._lock = threading.Lock()
        self._dir_lock = threading.Lock()
        self._states: dict[int, _BlockState] = {}
        self._used = self._scan_used()

    # ------------------------------------------------------------------ identity

    @classmethod
    def format(
        cls,
        path,
        *,
        fs_uuid: str,
        volume_id: int,
        storage_type: StorageType,
        capacity: int | None = None,
    ) -> Volume:
        """Make ``path`` (created if missing, else empty) a new volume of this filesystem.

        The layout directories are made first and the identity file last (written to a
        temporary name, fsynced, renamed, directory fsynced), so a directory with an identity
        file is always a complete volume.
        """
        path = Path(os.path.abspath(path))
        try:
            created = _prepare_empty_dir(path)
            os.makedirs(path / "current" / "finalized")
            os.mkdir(path / "tmp")
            fsync_dir(path / "current")
            volume_uuid = str(uuidlib.uuid4())
            identity = {
                "layout_version": LAYOUT_VERSION,
                "fs_uuid": fs_uuid,
                "volume_uuid": volume_uuid,
                "volume_id": volume_id,
                "storage_type": storage_type.name,
            }
            write_durably(path / IDENTITY_FILE, json.dumps(identity, indent=2).encode() + b"\n")
            if created:
                fsync_dir(path.parent)
        except OSError as e:
            raise VolumeError(f"cannot format volume {path}: {e.strerror or e}", _errno(e)) from e
        return cls(
            path,
            fs_uuid=fs_uuid,
            volume_uuid=volume_uuid,
            volume_id=volume_id,
            storage_type=storage_type,
            capacity=capacity,
        )

    @classmethod
    def open(
        cls,
        path,
        *,
        fs_uuid: str,
        volume_uuid: str,
        volume_id: int,
        storage_type: StorageType,
        capacity: int | None,
    ) -> Volume:
        """Open an existing volume, refusing it unless its identity is exactly the expected one."""
        path = Path(os.path.abspath(path))
        if not path.is_dir():
            raise VolumeError(f"volume {path} ({storage_type.name}) is missing")
        identity = _read_identity(path)
        _check_identity(path, identity, fs_uuid, volume_uuid, volume_id, storage_type)
        if not os.path.isdir(os.path.join(path, "current", "finalized")):
            raise VolumeError(f"{path} is damaged: {path}/current/finalized is missing")
        try:
            os.makedirs(path / "tmp", exist_ok=True)
        except OSError as e:
            raise VolumeError(f"cannot create {path}/tmp: {e.strerror or e}", _errno(e)) from e
        return cls(
            path,
            fs_uuid=fs_uuid,
            volume_uuid=volume_uuid,
            volume_id=volume_id,
            storage_type=storage_type,
            capacity=capacity,
        )

    def __repr__(self) -> str:
        return f"<Volume {self.id} {self.storage_type.name} {self.path}>"

    # ------------------------------------------------------------------ layout

    def data_path(self, block_id: int) -> Path:
        """``<path>/current/finalized/subdir<A>/subdir<B>/blk_<id>``."""
        return Path(self._leaf_dir(block_id), f"blk_{block_id}")

    def meta_path(self, block_id: int, gs: int) -> Path:
        """``blk_<id>_<gs>.meta`` next to the data file."""
        return Path(self._leaf_dir(block_id), f"blk_{block_id}_{gs}.meta")

    def _leaf_dir(self, block_id: int) -> str:
        return os.path.join(
            self._finalized, f"subdir{(block_id >> 16) & 0x1F}", f"subdir{(block_id >> 8) & 0x1F}"
        )

    # ------------------------------------------------------------------ replicas

    def create_replica(self, block_id: int, gs: int, bytes_per_checksum: int) -> Replica:
        """Create an empty replica (data file, meta file with only the header), durably.

        The namespace refers to the replica right after this returns, so the two files must
        exist durably first: their directory (and any directory made for them) is fsynced,
        which makes the new entries and inodes durable. Their contents follow fsync
        semantics like all file data (``Replica.fsync`` syncs both files), so no fsync of
        the files themselves here: one journal commit per new block instead of three, which
        is most of the cost of writing a small file. An existing data or meta file is an
        error (EEXIST): block ids are never reused, so it means a leftover that cleanup
        should have removed, and overwriting it could destroy a live replica.
        """
        header = header_bytes(bytes_per_checksum)
        leaf = self._leaf_dir(block_id)
        data_path = os.path.join(leaf, f"blk_{block_id}")
        meta_path = os.path.join(leaf, f"blk_{block_id}_{gs}.meta")
        made: list[str] = []
        fds: list[int] = []
        try:
            self._ensure_leaf(leaf)
            for p in (data_path, meta_path):
                fds.append(os.open(p, _NEW_FILE_FLAGS, 0o644))
                made.append(p)
            data_fd, meta_fd = fds
            os.pwrite(meta_fd, header, 0)
            fsync_dir(leaf)
        except OSError as e:
            _abandon(fds, made)
            if isinstance(e, FileExistsError):
                raise VolumeError(
                    f"replica blk_{block_id} already exists on volume {self.path} ({e.filename})",
                    errno.EEXIST,
                ) from e
            raise VolumeError(
                f"cannot create replica blk_{block_id}_{gs} on volume {self.path}: {e.strerror or e}",
                _errno(e),
            ) from e
        self._charge(len(header))
        return Replica(self, block_id, gs, bytes_per_checksum, data_fd, meta_fd, writable=True)

    def open_replica(self, block_id: int, gs: int, *, writable: bool) -> Replica:
        """Open the replica with this generation stamp; its files must exist (else EIO)."""
        flags = (os.O_RDWR if writable else os.O_RDONLY) | _OPEN_FLAGS
        data_path = self.data_path(block_id)
        meta_path = self.meta_path(block_id, gs)
        fds: list[int] = []
        try:
            for p in (data_path, meta_path):
                fds.append(os.open(p, flags))
            header = os.pread(fds[1], HEADER_SIZE, 0)
            _, _, bpc = parse_header(header)
        except FileNotFoundError as e:
            which = ("data file", "meta file")[len(fds)]
            name = (data_path, meta_path)[len(fds)].name
            _abandon(fds, [])
            raise VolumeError(
                f"replica blk_{block_id}_{gs} is missing on volume {self.path} (no {which} {name})"
            ) from e
        except ChecksumError as e:
            _abandon(fds, [])
            raise ChecksumError(f"{meta_path}: {e}") from e
        except OSError as e:
            _abandon(fds, [])
            raise VolumeError(
                f"cannot open replica blk_{block_id}_{gs} on volume {self.path}: {e.strerror or e}",
                _errno(e),
            ) from e
        return Replica(self, block_id, gs, bpc, fds[0], fds[1], writable=writable)

    def sync_replica(self, block_id: int, gs: int) -> None:
        """``fdatasync`` the data and meta file of a replica nobody has open (a block an
        open file wrote to and no longer keeps open).

        The meta file may be renamed under the sync: a WRITE does not wait for fsync, and
        the first one to the block in a new write session gives it a new generation stamp,
        renaming its meta file. It is the same file, holding the checksums of what was
        written before: it is synced under its newest name (fsx found the fsync failing
        with EIO and a good replica reported bad)."""
        path = self.data_path(block_id)
        try:
            _fdatasync(path)
            for _ in range(META_RENAMES_FOLLOWED + 1):
                path = self.meta_path(block_id, gs)
                try:
                    _fdatasync(path)
                    return
                except FileNotFoundError:
                    newer = [g for g in self.meta_gss(block_id) if g > gs]
                    if not newer:
                        raise
                    gs = newer[-1]
        except OSError as e:
            raise VolumeError(f"cannot sync {path.name} on volume {self.path}: "
                              f"{e.strerror or e}", _errno(e)) from e
        raise VolumeError(f"cannot sync the meta file of block {block_id} on volume "
                          f"{self.path}: renamed more than {META_RENAMES_FOLLOWED} times "
                          f"meanwhile")

    def delete_replica(self, block_id: int, gs: int | None = None) -> None:
        """Delete the data file and the meta file of ``gs`` (every meta file if gs is None).

        Missing files are fine (idempotent). Replicas still open keep working on the unlinked
        files, but no longer count towards this volume's used bytes. A volume that is not
        there at all (moved away, unmounted) is an error, not "already deleted": the caller
        keeps the deletion pending until the volume is back, or its files would return as
        orphans.
        """
        if not os.path.isdir(self._finalized):
            raise VolumeError(f"volume {self.path} ({self.storage_type.name}) is not there; "
                              f"cannot delete blk_{block_id}")
        leaf = self._leaf_dir(block_id)
        gss = self.meta_gss(block_id) if gs is None else [gs]
        paths = [os.path.join(leaf, f"blk_{block_id}")]
        paths += [os.path.join(leaf, f"blk_{block_id}_{g}.meta") for g in gss]
        while True:
            with self._lock:
                state = self._states.get(block_id)
            if state is None:
                freed = _unlink_all(paths)
                break
            with state.lock, self._lock:
                if self._states.get(block_id) is not state:
                    continue  # closed and reopened meanwhile: look again
                self._retire(block_id, state)
                freed = _unlink_all(paths)
                break
        self._charge(-freed)

    def meta_gss(self, block_id: int) -> list[int]:
        """Generation stamps of the meta files present for this block, ascending."""
        prefix = f"blk_{block_id}_"
        try:
            names = os.listdir(self._leaf_dir(block_id))
        except FileNotFoundError:
            return []
        gss = []
        for name in names:
            if name.startswith(prefix):
                m = _META_NAME.fullmatch(name)
                if m and int(m.group(1)) == block_id:
                    gss.append(int(m.group(2)))
        return sorted(gss)

    def install_replica(self, block_id: int, gs: int, data_src, meta_src) -> None:
        """Move a finished copy (two files, normally in ``tmp_dir``) into place, durably.

        For copy-then-rename moves: the files are fsynced, renamed to their layout names
        (data first, so a crash in between leaves data without meta, which a scan reports as
        an orphan), and the directory is fsynced. A replica of this block already on the
        volume is an error (EEXIST). The sources must be on this volume's filesystem.
        """
        leaf = self._leaf_dir(block_id)
        data_path = os.path.join(leaf, f"blk_{block_id}")
        meta_path = os.path.join(leaf, f"blk_{block_id}_{gs}.meta")
        try:
            if os.path.lexists(data_path) or self.meta_gss(block_id):
                raise VolumeError(f"replica blk_{block_id} already exists on volume {self.path}", errno.EEXIST)
            size = 0
            for src in (data_src, meta_src):
                size += _fsync_file(src)
            self._ensure_leaf(leaf)
            os.rename(data_src, data_path)
            os.rename(meta_src, meta_path)
            fsync_dir(leaf)
        except OSError as e:
            raise VolumeError(
                f"cannot install replica blk_{block_id}_{gs} on volume {self.path}: {e.strerror or e}",
                _errno(e),
            ) from e
        self._charge(size)

    def iter_replicas(self) -> Iterator[ReplicaInfo]:
        """Every replica file on the volume, grouped by block: one entry per meta file, plus
        one for a data file without any meta file. Sorted by directory, then block id, then GS.
        """
        for leaf in self._leaf_dirs():
            yield from _replicas_in(leaf)

    def clear_tmp(self) -> int:
        """Remove everything left in ``tmp_dir`` (interrupted moves); return how many entries."""
        count = 0
        for entry in os.scandir(self.tmp_dir):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            count += 1
        return count

    # ------------------------------------------------------------------ space

    def used_bytes(self) -> int:
        """Bytes in replica data and meta files (apparent sizes), kept up to date in process.

        Open replicas keep their own running change (so a write needs no volume-wide lock);
        it is added here.
        """
        with self._lock:
            return self._used + sum(state.charged for state in self._states.values())

    def free_bytes(self, disk_free: int | None = None) -> int:
        """Bytes that may still be used: the capacity left, bounded by the disk's free space
        (``disk_free``: already read for a sibling volume on the same disk)."""
        free = self._disk_free() if disk_free is None else disk_free
        if self.capacity is not None:
            free = min(free, self.capacity - self.used_bytes())
        return max(0, free)

    def total_bytes(self) -> int:
        """The capacity if one is set, else what is used plus what the disk has free."""
        if self.capacity is not None:
            return self.capacity
        return self.used_bytes() + self._disk_free()

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more bytes fit (capacity and disk both)."""
        return nbytes <= self.free_bytes()

    def rescan_used(self) -> int:
        """Recount used bytes from the files (after changes made outside this process)."""
        used = self._scan_used()
        with self._lock:
            self._used = used - sum(state.charged for state in self._states.values())
        return used

    def _disk_free(self) -> int:
        try:
            return disk_free(self.path)
        except OSError as e:
            raise VolumeError(f"volume {self.path} ({self.storage_type.name}) is unreadable: {e.strerror or e}") from e

    def _scan_used(self) -> int:
        total = 0
        for leaf in self._leaf_dirs():
            for entry in _scandir(leaf):
                if entry.name.startswith("blk_") and entry.is_file(follow_symlinks=False):
                    total += _size_or_none(entry) or 0
        return total

    # ------------------------------------------------------------------ internals

    def _leaf_dirs(self) -> Iterator[str]:
        """The ``subdirA/subdirB`` directories that exist, in sorted order."""
        for a in sorted(_subdirs(self._finalized)):
            outer = os.path.join(self._finalized, a)
            for b in sorted(_subdirs(outer)):
                yield os.path.join(outer, b)

    def _ensure_leaf(self, leaf: str) -> None:
        """Make the leaf directory (and its parent) exist durably.

        Under a lock, so that a directory seen existing has had its parent fsynced by
        whoever made it, even when two threads create replicas in the same new directory.
        """
        with self._dir_lock:
            if os.path.isdir(leaf):
                return
            outer = os.path.dirname(leaf)
            for d in (outer, leaf):
                if not os.path.isdir(d):
                    os.mkdir(d)
                    fsync_dir(os.path.dirname(d))

    def _fsync_dir(self, path) -> None:
        fsync_dir(path)

    def _charge(self, delta: int) -> None:
        """Adjust used bytes for files changed outside an open Replica."""
        if delta:
            with self._lock:
                self._used += delta

    def _retire(self, block_id: int, state: _BlockState) -> None:
        """Forget an open block's shared state, keeping what it charged (caller holds _lock).

        A Replica still holding the state goes on working, but its later changes are no
        longer counted: they are to files that have been deleted or that nobody has open.
        """
        del self._states[block_id]
        self._used += state.charged
        state.charged = 0

    def _attach(self, block_id: int, data_fd: int) -> _BlockState:
        """The shared state of an opened block, created on its first opener."""
        with self._lock:
            state = self._states.get(block_id)
            if state is None:
                state = _BlockState(os.fstat(data_fd).st_size)
                self._states[block_id] = state
            state.users += 1
            return state

    def _detach(self, block_id: int, state: _BlockState) -> None:
        """Forget the shared state when its last Replica closes."""
        with self._lock:
            state.users -= 1
            if state.users == 0 and self._states.get(block_id) is state:
                self._retire(block_id, state)


# ---------------------------------------------------------------------- module helpers


def check_volume_dir(path: Path) -> bool:
    """Whether a new volume may be made at ``path``: it is missing (False), or an empty
    directory (True); else VolumeError."""
    if not (path.exists() or path.is_symlink()):
        return False
    if not path.is_dir():
        raise VolumeError(f"volume directory {path} is not a directory", errno.ENOTDIR)
    if any(p.name not in FOREIGN_BUT_EMPTY for p in path.iterdir()):
        raise VolumeError(f"volume directory {path} is not empty", errno.ENOTEMPTY)
    return True


def _prepare_empty_dir(path: Path) -> bool:
    """Make sure ``path`` is an empty directory; return True if it had to be created."""
    if check_volume_dir(path):
        return False
    path.mkdir(parents=True)
    return True


def disk_free(path) -> int:
    """Bytes an unprivileged writer may still use on the disk of ``path`` (OSError when it
    cannot be told)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def identity_fs_uuid(path: Path) -> str | None:
    """The filesystem a volume directory's identity file names; None without a readable,
    well-formed one (a format cut short before it, or not a volume)."""
    try:
        return _read_identity(path)["fs_uuid"]
    except VolumeError:
        return None


def _read_identity(path: Path) -> dict:
    ident = path / IDENTITY_FILE
    try:
        raw = ident.read_bytes()
    except FileNotFoundError:
        raise VolumeError(f"{path} is not a tierfs volume (no {IDENTITY_FILE} file)") from None
    except OSError as e:
        raise VolumeError(f"cannot read {ident}: {e.strerror or e}") from e
    try:
        identity = json.loads(raw)
    except ValueError as e:
        raise VolumeError(f"{path} has a malformed {IDENTITY_FILE} file ({e})") from None
    keys = ("layout_version", "fs_uuid", "volume_uuid", "volume_id", "storage_type")
    if not isinstance(identity, dict) or any(k not in identity for k in keys):
        raise VolumeError(f"{path} has a malformed {IDENTITY_FILE} file (expected keys {', '.join(keys)})")
    return identity


def _check_identity(
    path: Path, identity: dict, fs_uuid: str, volume_uuid: str, volume_id: int, storage_type: StorageType
) -> None:
    """Refuse a volume whose identity file does not match what the filesystem expects."""
    if identity["layout_version"] != LAYOUT_VERSION:
        raise VolumeError(
            f"{path} has layout version {identity['layout_version']}, this tierfs supports {LAYOUT_VERSION}"
        )
    if identity["fs_uuid"] != fs_uuid:
        raise VolumeError(
            f"{path} belongs to another tierfs filesystem (fs uuid {identity['fs_uuid']}, expected {fs_uuid})"
        )
    if identity["volume_uuid"] != volume_uuid:
        raise VolumeError(f"{path} is volume {identity['volume_uuid']}, expected {volume_uuid}")
    if identity["volume_id"] != volume_id:
        raise VolumeError(f"{path} is volume id {identity['volume_id']}, expected {volume_id}")
    if str(identity["storage_type"]).upper() != storage_type.name:
        raise VolumeError(f"{path} is a {identity['storage_type']} volume, expected {storage_type.name}")


def _replicas_in(leaf: str) -> Iterator[ReplicaInfo]:
    """The replicas in one leaf directory, grouped by block id."""
    data: dict[int, tuple[Path, int]] = {}
    metas: dict[int, list[tuple[int, Path, int]]] = {}
    for entry in _scandir(leaf):
        name = entry.name
        if not name.startswith("blk_") or not entry.is_file(follow_symlinks=False):
            continue
        size = _size_or_none(entry)
        if size is None:
            continue  # deleted since the listing (a daemon beside us deletes replicas)
        m = _DATA_NAME.fullmatch(name)
        if m:
            data[int(m.group(1))] = (Path(entry.path), size)
            continue
        m = _META_NAME.fullmatch(name)
        if m:
            metas.setdefault(int(m.group(1)), []).append((int(m.group(2)), Path(entry.path), size))
    for block_id in sorted(data.keys() | metas.keys()):
        data_path, length = data.get(block_id, (None, 0))
        found = sorted(metas.get(block_id, ()), key=lambda t: t[0])
        if not found:
            yield ReplicaInfo(block_id, None, data_path, None, length)
        for gs, meta_path, meta_length in found:
            yield ReplicaInfo(block_id, gs, data_path, meta_path, length, meta_length)


def _size_or_none(entry: os.DirEntry) -> int | None:
    """A listed file's size, or None if it was deleted between the listing and the stat."""
    try:
        return entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        return None


def _subdirs(path: str) -> list[str]:
    return [e.name for e in _scandir(path) if e.name.startswith("subdir") and e.is_dir(follow_symlinks=False)]


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def fsync_dir(path) -> None:
    """fsync a directory, making its entries (new, renamed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path) -> int:
    """fsync a file by name; return its size."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def write_durably(path: Path, content: bytes) -> None:
    """Replace ``path`` with ``content`` atomically and durably (temp, fsync, rename, fsync dir)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            if os.write(fd, content) != len(content):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def _unlink_all(paths: list[str]) -> int:
    """Unlink the files that exist; return the bytes they held."""
    freed = 0
    for p in paths:
        try:
            size = os.stat(p).st_size
            os.unlink(p)
        except FileNotFoundError:
            continue
        freed += size
    return freed


def _abandon(fds: list[int], made: list[str]) -> None:
    """Close descriptors and remove files of a failed create (best effort: already failing)."""
    for fd in fds:
        os.close(fd)
    for p in made:
        try:
            os.unlink(p)
        except OSError:
            pass


def syncfs(path) -> None:
    """syncfs(2) on the filesystem holding ``path``: every dirty page, inode and journal
    entry of that filesystem reaches its disk. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), os.fspath(path))
    finally:
        os.close(fd)


def _fdatasync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _errno(e: OSError) -> int:
    """ENOSPC stays ENOSPC (placement tries elsewhere); EMFILE and ENFILE stay too (the
    process is out of descriptors: nothing is wrong with the volume or the replica, so the
    caller must not count it against them); everything else is EIO."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return errno.ENOSPC
    if e.errno in OUT_OF_DESCRIPTORS:
        return e.errno
    return errno.EIO
