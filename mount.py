"""``mount.tierfs DATA MNT [-f] [-o OPTS]``: mount a tierfs filesystem. Wiring only.

Order of start-up: (make the default layout if DATA is missing or empty) -> mount lock ->
namespace -> volumes (identity checked) -> recovery -> state "mounted" -> FUSE mount ->
serve. Shutdown, after unmount, SIGINT or SIGTERM: persist open files -> purge orphans ->
state "clean" -> sync -> release the lock.

Without ``-f`` the command forks; the child does all of the above and reports "ready" or a
one-line error through a pipe, so the parent's exit code tells whether the mount worked.

What is wired lives elsewhere: ``fs/kernel_mount.py`` (libfuse's options, the mount points
refused, readahead and the detaching of an aborted mount), ``fs/serving.py`` (the tasks
that run while mounted: the request loop, the one-second tick, signals).

Exit codes: 0 mounted (or unmounted cleanly with -f), 1 cannot mount, 2 usage.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import logging
import os
import resource
import sys
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import pyfuse3
import trio

from tierfs.backends.volume_set import VolumeSet
from tierfs.fs.blockio import BlockIO
from tierfs.fs.errors import FsError, UsageError
from tierfs.fs.kernel_mount import (PATH_MAX, MountError, detach_if_aborted, fuse_options,
                                    libfuse_messages, mount_device, refuse_other_filesystems,
                                    refuse_overlap, refuse_stacking, user_options)
from tierfs.fs.mountlock import MountLock
from tierfs.fs.namespace import Namespace, new_session_id
from tierfs.fs.operations import Operations, make_statfs
from tierfs.fs.placement import Placer
from tierfs.fs.recovery import delete_trash, recover
from tierfs.fs.replication import ReplicationMonitor
from tierfs.fs.resolver import Resolver
from tierfs.fs.serving import serve
from tierfs.fs.times import AtimeRule
from tierfs.tools import mkfs, mountinfo

log = logging.getLogger("tierfs.mount")

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mount.tierfs",
                                     description="Mount a tierfs filesystem.")
    parser.add_argument("data", metavar="DATA", help="data directory (created if missing)")
    parser.add_argument("mountpoint", metavar="MNT")
    parser.add_argument("-f", "--foreground", action="store_true",
                        help="stay in the foreground (default: background)")
    parser.add_argument("-o", dest="options", action="append", default=[],
                        metavar="OPTS", help="comma-separated mount options, e.g. allow_other")
    parser.add_argument("--debug", action="store_true", help="log debug messages")
    parser.add_argument("--log", metavar="FILE",
                        help="log file (default: stderr with -f, else DATA/tierfs.log)")
    return parser.parse_args(argv)


def raise_descriptor_limit() -> None:
    """Raise the soft limit of open descriptors to the hard one.

    The daemon keeps two or three descriptors per open replica, and a login's usual soft
    limit of 1,024 is soon used up by a few files of many blocks, whereas the hard limit
    (often 524,288 or more) is there to be taken, as servers that hold many files do.
    BlockIO sizes its cache of open replicas from the result.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # e.g. above fs.nr_open
        log.info("descriptor limit left at %d: %s", soft, exc)


def check_targets(data: Path, mnt: Path, option_groups: list[str]) -> set[str]:
    """What must hold before anything is written, the daemon's log in DATA included
    (MountError, or FsError from mkfs's rule for an empty DATA). Returns the user's
    ``-o`` options, split."""
    options = user_options(option_groups)
    refuse_stacking(mnt)  # first: is_dir() of a dead mount fails with ENOTCONN
    if not mnt.is_dir():
        raise MountError(f"mount point {mnt} does not exist or is not a directory")
    if data.exists() and not data.is_dir():
        raise MountError(f"{data} is not a directory")
    if len(os.fsencode(mountinfo.fsname(data))) >= PATH_MAX:
        raise MountError(f"the path of {data} is too long to name a mount: at most "
                         f"{PATH_MAX - 1} bytes once percent-encoded for libfuse")
    refuse_overlap(mnt, data, "the data directory")
    refuse_other_filesystems(mnt)
    if not mkfs.is_filesystem(data):
        mkfs.check_empty(data, mkfs.default_volumes(data))
    return options


def prepare(args) -> tuple[ExitStack, Operations, BlockIO, Namespace]:
    """Everything up to (not including) the FUSE mount; raises MountError."""
    data = Path(os.path.abspath(args.data))
    mnt = Path(os.path.abspath(args.mountpoint))
    options = check_targets(data, mnt, args.options)
    if not mkfs.is_filesystem(data):
        config = mkfs.make_filesystem(data)
        log.info("created filesystem %s in %s (default layout)", config.fs_uuid, data)
    frozen = not os.access(data / mkfs.NAMESPACE_DIR, os.W_OK)
    if frozen and "ro" not in options:
        raise MountError(f"{data} is read-only here: mount it with -o ro")
    stack = ExitStack()
    try:
        lock = MountLock(data)
        lock.acquire(mnt, frozen=frozen)
        stack.callback(lock.release)
        ns = Namespace.open(data / mkfs.NAMESPACE_DIR, frozen=frozen)
        stack.callback(ns.close)
        volumes = VolumeSet.open(data, ns.config.fs_uuid, ns.config.volumes)
        for volume in volumes:
            refuse_overlap(mnt, volume.path, "volume")
        if frozen:
            _check_frozen(data, ns)
        else:
            if not ns.space_reserve.refill():
                log.warning("less than %d MiB free beside the namespace: the removal reserve "
                            "is made once there is room; until then rm may fail on a full "
                            "disk", ns.space_reserve.size >> 20)
            unclean = ns.get_state() == "mounted"
            report = recover(ns, volumes)
            if unclean:
                log.warning("previous daemon did not stop cleanly; recovered: %s",
                            report.summary())
            ns.set_state("mounted")
        resolver = Resolver(ns)
        raise_descriptor_limit()
        blockio = BlockIO(ns, volumes, Placer(volumes, resolver.placement), new_session_id(),
                          atime_rule=AtimeRule.from_mount_options(options))
        ops = Operations(ns, blockio, make_statfs(volumes, ns), resolver)
        ops.replication = ReplicationMonitor(ns, volumes, blockio, resolver)
    except BaseException:
        stack.close()
        raise
    return stack, ops, blockio, ns


def _check_frozen(data: Path, ns: Namespace) -> None:
    """A DATA that cannot be written (read-only media, a read-only bind mount) is served
    as it is, with nothing recorded: only when its last daemon stopped cleanly, since the
    recovery an unclean stop needs must write (ext4 likewise refuses to mount a read-only
    device whose journal needs replaying)."""
    if ns.get_state() != "clean":
        raise MountError(f"{data} was not unmounted cleanly and is read-only here: its "
                         "recovery needs to write, so mount it once where it is writable")
    log.info("%s is read-only here: served as it is, nothing recorded", data)


def shutdown(ops: Operations, blockio: BlockIO, ns: Namespace) -> None:
    """After unmount the kernel has forgotten every inode and closed every handle: persist
    what is open and close its lease (nothing needs recovery after a clean stop), purge
    orphans, mark clean. When the namespace cannot take it (its disk is full), the
    namespace stays marked mounted: the next mount recovers the leases and orphans left.
    A read-only DATA was served as it is: there is nothing to record."""
    failed = False
    for of in list(blockio.files.values()):
        blockio.retire_replicas(of)
        if ns.readonly:
            continue
        try:
            blockio.persist(of, drop_lease=of.leased)
        except FsError as exc:
            log.error("inode %d: size and times not persisted at unmount: %s", of.ino, exc)
            failed = True
    blockio.files.clear()
    if ns.readonly:
        return
    try:
        for ino in ns.orphans():
            ns.purge(ino)
        blockio.deferred_trash.clear()
        delete_trash(ns, blockio.volumes)  # every trash row, after a sync
        if not failed:
            ns.set_state("clean")
            return
    except FsError as exc:
        log.error("orphans not purged at unmount: %s", exc)
    log.error("unmounted uncleanly: the next mount recovers what was left open")


def run(args, ready_fd: int | None) -> int:
    """Mount and serve until unmounted. ``ready_fd`` receives 'ok' or an error line.

    A fatal signal (SIGBUS from a namespace file damaged on disk, which LMDB reads through
    a memory map) would end the daemon without a word: faulthandler writes the Python
    stacks to stderr, which is the log in the background."""
    faulthandler.enable(file=sys.stderr)
    def fail(message: str) -> int:
        if ready_fd is not None:
            os.write(ready_fd, f"error: {message}\n".encode(errors="surrogateescape"))
            os.close(ready_fd)
        else:
            print(f"mount.tierfs: {message}", file=sys.stderr)
        return 1

    try:
        stack, ops, blockio, ns = prepare(args)
    except (MountError, FsError, UsageError) as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{exc.filename or args.data}: {exc.strerror or exc}")
    options = user_options(args.options)  # checked by prepare()
    with stack:
        try:
            with libfuse_messages() as said:
                pyfuse3.init(ops, os.path.abspath(args.mountpoint),
                             fuse_options(Path(os.path.abspath(args.data)), options))
        except RuntimeError as exc:
            _not_mounted(ns)
            return fail(f"FUSE mount of {args.mountpoint} failed: {said.text or exc}")
        except BaseException:  # a bug: its traceback goes out, but nothing was mounted
            _not_mounted(ns)
            raise
        if said.text:
            log.warning("libfuse: %s", said.text)
        if ready_fd is not None:
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)
        log.info("mounted %s on %s", args.data, args.mountpoint)
        device = mount_device(args.mountpoint)
        aborted = False
        try:
            trio.run(partial(serve, read_only="ro" in options),
                     ops, blockio, ns, args.mountpoint)
        except* ConnectionAbortedError:
            # After an abort /dev/fuse answers ENODEV, which libfuse takes for the end of
            # the session, or ECONNABORTED when the session asked for that at FUSE_INIT
            # (FUSE_ABORT_ERROR; seen once at unmount, in CI), which pyfuse3 raises. Both
            # end in the usual clean shutdown, not a traceback and exit status 1.
            aborted = True
        finally:
            pyfuse3.close(unmount=True)
            shutdown(ops, blockio, ns)
            detach_if_aborted(args.mountpoint, device, aborted)
            log.info("unmounted %s", args.mountpoint)
    return 0


def _not_mounted(ns: Namespace) -> None:
    """The FUSE mount failed after prepare() recorded it: the namespace is clean again."""
    if not ns.readonly:
        ns.set_state("clean")


def daemonize(args) -> int:
    """Fork; the parent waits for the child's verdict and exits with it."""
    read_fd, write_fd = os.pipe()
    if os.fork() > 0:
        os.close(write_fd)
        with os.fdopen(read_fd, errors="surrogateescape") as pipe:
            verdict = pipe.read().strip()
        if verdict == "ok":
            return 0
        print(f"mount.tierfs: {verdict.removeprefix('error: ') or 'daemon died'}",
              file=sys.stderr)
        return 1
    os.close(read_fd)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    if devnull > 2:
        os.close(devnull)
    log_path = args.log or os.path.join(args.data, mkfs.DAEMON_LOG)
    if may_mount(args):  # else run() fails, through the pipe, without leaving a log behind
        try:
            open_log(log_path)
        except OSError as exc:
            hint = " (give --log FILE, or run with -f)" if exc.errno == errno.EROFS else ""
            os.write(write_fd, f"error: cannot open log {log_path}: {exc.strerror}{hint}\n"
                     .encode())
            os._exit(1)
    os.chdir("/")
    os._exit(run(args, write_fd))


def may_mount(args) -> bool:
    """Whether DATA is ours to write a log into: prepare()'s first checks pass. When they
    do not, run() fails with their message through the pipe, leaving nothing behind."""
    try:
        check_targets(Path(os.path.abspath(args.data)), Path(os.path.abspath(args.mountpoint)),
                      args.options)
    except (MountError, FsError, OSError):
        return False
    return True


def open_log(path: str) -> None:
    """Background mode: stderr (the logging stream) goes to the log file from now on."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


class DroppedReplyFilter(logging.Filter):
    """Demote pyfuse3's "fuse_reply_* failed with No such file or directory" to INFO.

    The kernel answers a reply with ENOENT when it no longer holds the request: the caller
    was interrupted, or the connection is being torn down at unmount while an asynchronous
    RELEASE is still in flight. The operation itself has been carried out; only its answer
    has nobody left to read it. libfuse stays silent for exactly this errno
    (fuse_send_msg); pyfuse3 logs it as an error, which would hide real ones.
    """

    DROPPED = "fuse_reply_* failed with " + os.strerror(errno.ENOENT)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and self.DROPPED in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = (record.getMessage()
                                       + " (the kernel had already dropped the request)"), ()
        return True


def open_standard_fds() -> None:
    """Give a closed stdin, stdout or stderr /dev/null (``mount.tierfs ... 2>&-``).

    Otherwise the daemon's first open() would take that number: the namespace or a
    replica would become "stderr", and libfuse's messages or a log line would be written
    into it. Python also sets ``sys.stderr`` to None for a closed fd 2, which faulthandler
    and the logging setup cannot use."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False,  # line-buffered
                                    errors="backslashreplace"))


def main(argv: list[str] | None = None) -> int:
    open_standard_fds()
    args = parse_args(argv)
    args.data = os.path.abspath(args.data)
    args.mountpoint = os.path.abspath(args.mountpoint)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format=LOG_FORMAT,
                        filename=args.log if args.foreground and args.log else None)
    logging.getLogger("pyfuse3").addFilter(DroppedReplyFilter())
    if args.foreground:
        return run(args, None)
    return daemonize(args)


if __name__ == "__main__":
    sys.exit(main())
