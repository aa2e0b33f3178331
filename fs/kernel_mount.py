"""The kernel's side of a mount: the options libfuse gets, the mount points that must be
refused, and what is tuned or cleaned up in the mount table around a session.

Kept apart from ``mount.py`` (which wires the daemon together) because each rule here is
about the kernel or libfuse, not about tierfs's own objects: a new refusal or option
belongs here and nowhere else.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pyfuse3

from tierfs.fs.mountlock import MountLock
from tierfs.tools import mountinfo

log = logging.getLogger(__name__)


class MountError(Exception):
    """A reason the mount cannot happen: printed as one line, exit code 1."""


#: Options the daemon sets itself: the tools find a mount's DATA by its fsname and its
#: type by the subtype, so a user's value would cut the mount off from them.
RESERVED_OPTIONS = ("fsname", "subtype")
#: The kernel copies a mount's source name (the fsname) with this limit, NUL included.
PATH_MAX = 4096


def user_options(groups: list[str]) -> set[str]:
    """The ``-o`` options, split; MountError for one the daemon must set itself."""
    options = {o for group in groups for o in group.split(",") if o}
    for option in options:
        if option.partition("=")[0] in RESERVED_OPTIONS:
            raise MountError(f"option {option.partition('=')[0]} is set by mount.tierfs "
                             f"(the tools find the filesystem by it)")
    return options


def fuse_options(data: Path, user: set[str]) -> set[str]:
    """What libfuse gets: its defaults, the fsname and subtype, the user's ``-o``."""
    options = set(pyfuse3.default_options) | {f"fsname={mountinfo.fsname(data)}",
                                              "subtype=tierfs"}
    options |= user
    options.discard("rw")
    options.discard("defaults")
    return options


class _Captured:
    text = ""


@contextmanager
def libfuse_messages():
    """Catch what libfuse writes to stderr while the mount is set up. It explains a failed
    mount there only ("fuse: unknown option(s): `-o x'", "option allow_other only allowed
    if 'user_allow_other' is set in /etc/fuse.conf") and raises a bare "fuse_session_new()
    failed"; the caller puts the explanation in its one line. Joined with "; "."""
    captured = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    # Our own log lines (pyfuse3 logs at DEBUG meanwhile) keep going where they went.
    to_stderr = [h for h in logging.getLogger().handlers
                 if isinstance(h, logging.StreamHandler) and _writes_to_fd(h.stream, 2)]
    with tempfile.TemporaryFile() as sink, open(saved, "w", closefd=False) as log_stream:
        moved = [(h, h.setStream(log_stream)) for h in to_stderr]
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            for handler, stream in moved:
                handler.setStream(stream)
            os.close(saved)
            sink.seek(0)
            lines = sink.read().decode(errors="replace").splitlines()
            captured.text = "; ".join(line.strip() for line in lines if line.strip())


def _writes_to_fd(stream, fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError):
        return False


def refuse_overlap(mnt: Path, path: Path, what: str, owner: str = "", *,
                   resolve: bool = True) -> None:
    """The mount point must not be, hold, or lie inside DATA or a volume: the daemon
    reaches them by path, and through its own mount it would wait for itself forever.
    Both as given and resolved: a DATA given as a symlink inside the mount point resolves
    elsewhere now, but the daemon opens it by the path given, through the mount.
    ``resolve=False``: ``path`` only as given (another filesystem's, see
    ``refuse_other_filesystems``)."""
    def forms(p: Path) -> set[Path]:
        return {Path(os.path.abspath(p)), Path(os.path.realpath(p))}

    for m in forms(mnt):
        for p in forms(path) if resolve else {Path(os.path.abspath(path))}:
            if m == p or p in m.parents or m in p.parents:
                raise MountError(f"mount point {mnt} overlaps {what} {path}{owner}: "
                                 f"mount it elsewhere")


def refuse_other_filesystems(mnt: Path) -> None:
    """Nor may the mount point be, hold or lie inside the data directory of a tierfs that
    is mounted already: the new mount would hide that filesystem's namespace and volumes
    from its own daemon, which reaches them by path.

    Only the DATA the mount table names, compared as recorded: reading another
    filesystem's namespace for its volumes elsewhere, or resolving its paths, would make
    this mount wait forever on whatever hangs there (a volume on an unreachable NFS
    server, a stopped daemon) and write into its LMDB lock file."""
    for entry in mountinfo.mounts():
        if entry.fstype == mountinfo.FSTYPE:
            refuse_overlap(mnt, Path(entry.data_dir), "the data directory",
                           f" of the tierfs mounted on {entry.mount_point}", resolve=False)


def refuse_stacking(mnt: Path) -> None:
    """A tierfs mount already on ``mnt`` would be hidden under the new one, and
    ``tierfs umount`` would only ever reach the top one. Also a dead one (its daemon was
    killed; every access gives ENOTCONN): the message says so and how to clear it. The
    mount is never taken away here: whether a daemon still serves it is only known for
    sure to that daemon (a read-only DATA's daemon may hold no lock file at all)."""
    found = mountinfo.tierfs_mounted_on(str(mnt))
    if found is None:
        return
    lock = MountLock(Path(found.data_dir))
    dead = lock.path.exists() and lock.holder() is None
    raise MountError(f"{mnt} is already the mount point of tierfs {found.data_dir}"
                     f"{' (its daemon is gone)' if dead else ''}: unmount it first "
                     f"(tierfs umount {mnt})")


READ_AHEAD_KB = 1024


def mount_device(mountpoint: str) -> str | None:
    """The "major:minor" of the filesystem mounted on ``mountpoint`` (the topmost), or None.

    From mountinfo: a stat() of our own mount point here would wait for this very daemon,
    and one of a connection the kernel aborted fails.
    """
    target = os.path.abspath(mountpoint)  # no realpath: it would stat our own mount
    found = [m.device for m in mountinfo.mounts() if m.mount_point == target]
    return found[-1] if found else None


def tune_readahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> None:
    """Raise the readahead of this mount's backing device info from the kernel's 128 KiB.

    FUSE caps readahead at the bdi default, so every 128 KiB of a sequential read costs a
    request round trip; with 1 MiB the kernel sends 1 MiB reads (measured: cold sequential
    read 243 -> 412 MB/s). Needs root; without it the default stays, and that is logged.
    """
    dev = mount_device(mountpoint)
    if dev is None:
        log.info("readahead left at the kernel default: %s is not in the mount table",
                 mountpoint)
        return
    try:
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(kb))
    except OSError as exc:
        log.info("readahead left at the kernel default: %s", exc)


FUSECTL = "/sys/fs/fuse/connections"


def abort_connection(device: str | None) -> str | None:
    """Abort the FUSE connection of the mount on ``device`` ("major:minor") through the
    kernel's FUSE control filesystem, as an admin would (README); None when done, else
    why not (fusectl not mounted, not root)."""
    if device is None:
        return "the mount is not in the mount table"
    try:
        with open(f"{FUSECTL}/{device.split(':')[1]}/abort", "w") as f:
            f.write("1")
    except OSError as exc:
        return f"{exc.strerror or exc} ({FUSECTL} must be a mounted fusectl)"
    return None


def detach_if_aborted(mountpoint: str, device: str | None, aborted: bool) -> None:
    """After the session ended: a mount still in the table is one whose connection the
    kernel aborted (``/sys/fs/fuse/connections/N/abort``, or the kernel's own abort).

    libfuse then skips the unmount, leaving a dead mount that answers ENOTCONN until
    somebody unmounts it; detach it lazily, as ``fusermount3 -u -z`` does, so that the
    mount point is usable again and the next mount of it is not stacked on a dead one.
    """
    still_mounted = device is not None and mount_device(mountpoint) == device
    if not (aborted or still_mounted):
        return  # unmounted the ordinary way
    log.warning("the kernel aborted the FUSE connection of %s", mountpoint)
    if not still_mounted:
        return
    try:
        result = subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True,
                                text=True, check=False)
        problem = ((result.stderr.strip() or f"exit code {result.returncode}")
                   if result.returncode else None)
    except OSError as exc:
        problem = str(exc)
    if problem:
        log.warning("could not detach the dead mount on %s: %s", mountpoint, problem)
