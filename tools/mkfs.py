"""``tierfs mkfs``: create a filesystem (volumes + namespace) in a data directory.

The embedded default layout, used when no ``--volume`` is given and by ``mount.tierfs`` on
an empty data directory: ``DATA/ssd`` (SSD), ``DATA/disk`` (DISK), ``DATA/archive``
(ARCHIVE), namespace in ``DATA/namespace``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path

from tierfs.backends.storage_types import StorageType
from tierfs.backends.volume import (FOREIGN_BUT_EMPTY, IDENTITY_FILE, Volume, check_volume_dir,
                                     fsync_dir, identity_fs_uuid, write_durably)
from tierfs.fs.errors import FsError, UsageError
from tierfs.fs.inherited import RenameMode
from tierfs.fs.namespace import FsConfig, Namespace, VolumeConfig
from tierfs.fs.placement import replicas_placeable
from tierfs.fs.times import now_ns
from tierfs.satisfier.policies import PolicySuite

NAMESPACE_DIR = "namespace"
# mkfs writes the namespace here and renames it to NAMESPACE_DIR when it is whole, so that a
# mkfs cut short (a full disk, a crash) never leaves something that looks like a filesystem.
PARTIAL_NAMESPACE_DIR = NAMESPACE_DIR + ".partial"
# While mkfs runs, DATA holds this file naming the filesystem it is making. Volumes of that
# filesystem that hold no block are then known to be half-made, and the next mkfs of DATA
# (or mount.tierfs of it) may format them again instead of calling them someone's.
MKFS_MARK = "mkfs.partial"
# Chosen by measurement (README, "Block size and checksum chunk"): 64 MiB blocks keep a
# 1 GiB file at 16 namespace records while a block move stays well under a second; 4 KiB
# checksum chunks make a 4 KiB random read verify exactly one chunk.
DEFAULT_BLOCK_SIZE = 64 << 20
DEFAULT_BYTES_PER_CHECKSUM = 4096
DEFAULT_LAYOUT = (("ssd", StorageType.SSD), ("disk", StorageType.DISK),
                  ("archive", StorageType.ARCHIVE))
# In the background mount.tierfs logs here, from before it formats an empty DATA.
DAEMON_LOG = "tierfs.log"

# What Volume.format makes in a volume directory, and so what a failed mkfs removes there.
VOLUME_LAYOUT = frozenset({"current", "tmp", IDENTITY_FILE, IDENTITY_FILE + ".tmp"})

_SIZE = re.compile(r"^(\d+)([KMGTP]?)(I?B)?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str) -> int:
    """'10G', '512M', '4096', '1GiB' -> bytes (binary units)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise UsageError(f"invalid size '{text}' (expected e.g. 4096, 512K, 64M, 10G)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


@dataclass
class VolumeSpec:
    storage_type: StorageType
    path: Path
    capacity: int | None = None

    @classmethod
    def parse(cls, text: str) -> "VolumeSpec":
        """TYPE:PATH[:CAPACITY], e.g. SSD:/mnt/nvme0/tier:100G."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[1]:
            raise UsageError(f"invalid volume '{text}' (expected TYPE:PATH[:CAPACITY])")
        try:
            storage_type = StorageType.parse(parts[0])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        capacity = parse_size(parts[2]) if len(parts) == 3 else None
        return cls(storage_type, Path(parts[1]), capacity)


def default_volumes(data_dir: Path) -> list[VolumeSpec]:
    return [VolumeSpec(t, data_dir / name) for name, t in DEFAULT_LAYOUT]


def is_filesystem(data_dir: Path) -> bool:
    return (data_dir / NAMESPACE_DIR / "data.mdb").exists()


def check_empty(data_dir: Path, volumes: list[VolumeSpec]) -> None:
    """Refuse a DATA holding anything but the volume directories to be and the daemon's
    log: a filesystem mixed into someone's files would let a later ``rm -r DATA`` (or the
    user) take one for the other. The volume directories themselves must be missing or
    empty (``Volume.format``'s rule, checked here too so that mount.tierfs refuses before
    it writes its log). Same words as mount.tierfs."""
    unfinished = _unfinished_mkfs(data_dir)
    for spec in volumes:
        if not _made_by(unfinished, Path(spec.path)):
            check_volume_dir(Path(spec.path))
    if not data_dir.is_dir():
        return
    volume_paths = {os.path.realpath(v.path) for v in volumes}
    allowed = FOREIGN_BUT_EMPTY | {DAEMON_LOG, PARTIAL_NAMESPACE_DIR, MKFS_MARK,
                                   MKFS_MARK + ".tmp"}
    if any(name not in allowed and os.path.realpath(data_dir / name) not in volume_paths
           for name in os.listdir(data_dir)):
        raise FsError(errno.ENOTEMPTY, f"{data_dir} is neither empty nor a tierfs filesystem")


def make_filesystem(data_dir: Path, volumes: list[VolumeSpec] | None = None, *,
                    block_size: int = DEFAULT_BLOCK_SIZE,
                    bytes_per_checksum: int = DEFAULT_BYTES_PER_CHECKSUM,
                    replication: int = 1, default_policy: str = "HOT",
                    rename_mode: str = RenameMode.FOLLOW.value) -> FsConfig:
    """Format the volumes, then write the namespace (last, so a half-made filesystem is
    never mistaken for a whole one)."""
    data_dir = Path(os.path.abspath(data_dir))
    volumes = volumes or default_volumes(data_dir)
    _validate(data_dir, volumes, block_size, bytes_per_checksum, replication, rename_mode)
    policy = PolicySuite().get(default_policy)  # ValueError for an unknown name
    made_dirs = _make_dirs(data_dir)
    fs_uuid = str(uuidlib.uuid4())
    configs = []
    made: list[tuple[str, bool]] = []   # volume directories touched: (path, existed)
    try:
        unfinished = _unfinished_mkfs(data_dir)
        for spec in volumes:
            if _made_by(unfinished, Path(spec.path)):
                _clear_layout(os.path.abspath(spec.path))
        write_durably(data_dir / MKFS_MARK, fs_uuid.encode() + b"\n")
        for volume_id, spec in enumerate(volumes, start=1):
            made_dirs += _make_dirs(Path(os.path.abspath(spec.path)).parent)
            existed = os.path.exists(spec.path)
            try:
                vol = Volume.format(spec.path, fs_uuid=fs_uuid, volume_id=volume_id,
                                    storage_type=spec.storage_type, capacity=spec.capacity)
            except FsError as exc:
                if exc.errno != errno.ENOTEMPTY:   # cut short (a full disk): undo it too
                    made.append((os.path.abspath(spec.path), existed))
                raise
            made.append((str(vol.path), existed))
            configs.append(VolumeConfig(volume_id, vol.uuid, spec.storage_type.name,
                                        _recorded_path(data_dir, vol.path), spec.capacity))
        config = FsConfig(fs_uuid=fs_uuid, block_size=block_size,
                          bytes_per_checksum=bytes_per_checksum, replication=replication,
                          default_policy=policy.name, rename_mode=rename_mode, volumes=configs)
        _write_namespace(data_dir, config)
    except BaseException:
        _undo_volumes(made, fs_uuid)
        with contextlib.suppress(OSError):
            os.unlink(data_dir / MKFS_MARK)
        _remove_dirs(made_dirs)
        raise
    with contextlib.suppress(OSError):  # a mark left behind is ignored beside a namespace
        os.unlink(data_dir / MKFS_MARK)
    return config


def _make_dirs(path: Path) -> list[Path]:
    """Make ``path`` and its missing parents; the directories this call made, outermost
    first, so that a failed mkfs removes exactly those (``mkdir -p`` would leave them)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    made = []
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue  # made meanwhile by someone else: not ours to remove
        except OSError as exc:
            _remove_dirs(made)
            raise FsError(exc.errno or errno.EIO,
                          f"cannot create {directory}: {exc.strerror or exc}") from None
        made.append(directory)
    return made


def _remove_dirs(made: list[Path]) -> None:
    """Undo ``_make_dirs``: innermost first, each only if still empty."""
    for directory in reversed(made):
        with contextlib.suppress(OSError):
            directory.rmdir()


def _unfinished_mkfs(data_dir: Path) -> str | None:
    """The filesystem uuid an interrupted mkfs of DATA was making (its mark), if any."""
    if is_filesystem(data_dir):
        return None
    try:
        return (data_dir / MKFS_MARK).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _made_by(fs_uuid: str | None, path: Path) -> bool:
    """Whether ``path`` is a volume directory that the interrupted mkfs making ``fs_uuid``
    formatted, or began to: only what Volume.format makes, no block file anywhere, and an
    identity file (if it got that far) naming that filesystem."""
    if fs_uuid is None or not path.is_dir():
        return False
    names = set(os.listdir(path)) - FOREIGN_BUT_EMPTY
    if not names or not names <= VOLUME_LAYOUT:
        return False
    if IDENTITY_FILE in names and identity_fs_uuid(path) != fs_uuid:
        return False
    return not any(files for name in ("current", "tmp") if name in names
                   for _, _, files in os.walk(path / name))


def _write_namespace(data_dir: Path, config: FsConfig) -> None:
    """Write the namespace beside its final place and rename it there once it is whole and
    durable. What a failed or crashed attempt leaves is removed, here or by the next mkfs."""
    partial = data_dir / PARTIAL_NAMESPACE_DIR
    shutil.rmtree(partial, ignore_errors=True)
    try:
        ns = Namespace.create(partial, config, uid=os.getuid(), gid=os.getgid(),
                              now_ns=now_ns())
        ns.close()
        fsync_dir(partial)   # its files' entries, before the rename publishes them
        os.rename(partial, data_dir / NAMESPACE_DIR)
        fsync_dir(data_dir)
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, OSError):
            raise FsError(exc.errno or errno.EIO, f"cannot write the namespace in {data_dir}: "
                          f"{exc.strerror or exc}") from None
        raise


def default_policy_warning(config: FsConfig) -> str | None:
    """Why no new block could be written under the default policy, or why none could have
    all its replicas; None when neither.

    A legal filesystem, so mkfs does not refuse it (the user may mean to set a policy these
    volumes satisfy on every directory they write into), but every write under a directory
    without one would fail with ENOSPC, or every block stay under-replicated, which nobody
    should discover only then."""
    policy = PolicySuite().get(config.default_policy)
    types = [StorageType.parse(v.storage_type) for v in config.volumes]
    missing = set(StorageType) - set(types)
    if not policy.choose_storage_types(config.replication, (), missing, is_new_block=True):
        wanted = ", ".join(sorted({t.name for t in policy.storage_types}))
        fallbacks = ", ".join(t.name for t in policy.creation_fallbacks) or "none"
        return (f"warning: default policy {policy.name} can place no block on these volumes "
                f"(it wants {wanted}; creation fallbacks: {fallbacks}): writes will fail "
                f"with ENOSPC wherever no other policy is set")
    most = replicas_placeable(policy, config.replication, types)
    if most < config.replication:
        return (f"warning: default policy {policy.name} can keep at most {most} of "
                f"{config.replication} replicas on these volumes (one per volume): blocks "
                f"will stay under-replicated wherever no other policy is set")
    return None


def _undo_volumes(made, fs_uuid: str) -> None:
    """A failed mkfs leaves no half-made volumes behind, so it can simply be run again. In a
    directory that was there before, only what ``Volume.format`` makes is removed, and
    nothing from a directory whose identity names another filesystem (another mkfs of the
    same directory may have finished first)."""
    for path, existed in made:
        if identity_fs_uuid(Path(path)) not in (None, fs_uuid):
            continue
        if not existed:
            shutil.rmtree(path, ignore_errors=True)
        else:
            _clear_layout(path)


def _clear_layout(path: str) -> None:
    for entry in VOLUME_LAYOUT & set(os.listdir(path)):
        target = os.path.join(path, entry)
        shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)


def _recorded_path(data_dir: Path, path: Path) -> str:
    """Inside DATA a volume is recorded relative to it, so DATA can be moved whole."""
    try:
        return str(Path(path).relative_to(data_dir))
    except ValueError:
        return str(path)


def _validate(data_dir: Path, volumes: list[VolumeSpec], block_size: int, bpc: int,
              replication: int, rename_mode: str) -> None:
    if is_filesystem(data_dir):
        raise FsError(errno.EEXIST, f"{data_dir} already holds a tierfs filesystem")
    if data_dir.exists() and not data_dir.is_dir():
        raise FsError(errno.ENOTDIR, f"{data_dir} exists and is not a directory")
    check_empty(data_dir, volumes)
    if not 512 <= bpc <= 1 << 20:
        raise UsageError("--bytes-per-checksum must be between 512 and 1M")
    if block_size <= 0:
        raise UsageError("--block-size must be positive")
    if block_size < bpc or block_size % bpc:
        raise UsageError("--block-size must be a multiple of --bytes-per-checksum")
    if block_size > 1 << 30:
        raise UsageError("--block-size must be at most 1G")
    if not 1 <= replication <= len(volumes):
        raise UsageError(f"--replication must be between 1 and the number of volumes "
                         f"({len(volumes)})")
    if rename_mode not in {m.value for m in RenameMode}:
        raise UsageError("--policy-on-rename must be 'follow' or 'keep'")
    paths = [os.path.abspath(v.path) for v in volumes]
    if len(set(paths)) != len(paths):
        raise UsageError("two volumes share a directory")
    for spec in volumes:
        if spec.capacity is not None and spec.capacity <= 0:
            raise UsageError(f"volume {spec.path}: capacity must be positive")
        if spec.capacity is not None and spec.capacity < block_size:
            raise UsageError(f"volume {spec.path}: capacity {spec.capacity} is smaller than "
                             f"one block (--block-size {block_size})")
