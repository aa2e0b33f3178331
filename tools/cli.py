"""``tierfs``: one command, with a subcommand per tool.

Every user mistake ends in one line on stderr and a documented exit code, never a
traceback. Exit codes (README, "Exit codes"):

==========  =====================================================================
subcommand  codes
==========  =====================================================================
mkfs        0 created, 1 failed (e.g. DATA already holds a filesystem), 2 usage
umount      0 unmounted, 1 failed (not a tierfs mount, busy), 2 usage
fsck        0 healthy, 1 corrupt (or repaired problems), 2 usage or cannot run; 130
            interrupted
policy      0 done, 1 usage (missing, extra or unknown arguments or action), 2 failed
            (no such path, not on a tierfs mount, unknown policy, refused by the mount)
report      0 reported, 2 usage or cannot run (not a tierfs data directory or mount point,
            namespace unreadable); 130 interrupted
==========  =====================================================================
"""

from __future__ import annotations

import os
import signal
import sys

# Ctrl-C while the modules below load would end in a traceback: until ``main`` takes
# over, it ends the tool quietly with the interrupted status.
signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))

import argparse  # noqa: E402 - after the handler on purpose
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

from tierfs.fs.errors import FsError, UsageError, VolumeError  # noqa: E402

# The exit code of a tool that could not run, where it is not 1 (README, "Exit codes"):
# fsck's 1 means "problems found", and policy and report use 2 for failures.
CANNOT_RUN = {"fsck": 2, "policy": 2, "report": 2}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so each tool keeps its own usage code."""

    usage_code = 2

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}", self.usage_code)


class _Command(_Parser):
    """A subcommand's parser. It refuses unknown arguments itself, so the message names the
    subcommand and the exit code is its usage code (argparse would hand them up to
    ``tierfs``, whose code is 2, e.g. instead of policy's 1)."""

    # (dest, default) of an optional positional that may also follow the options
    late_positional: tuple[str, str] | None = None

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        extras = self._adopt(parsed, extras)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def _adopt(self, parsed, extras: list[str]) -> list[str]:
        """``fsck DATA --repair /a``: argparse stops filling optional positionals at the first
        option, so a PATH given after options arrives as an extra argument: take it (its
        default is None so that a PATH given in place is told apart)."""
        if self.late_positional is None:
            return extras
        dest, default = self.late_positional
        if getattr(parsed, dest) is None:
            late = bool(extras) and not extras[0].startswith("-")
            setattr(parsed, dest, extras.pop(0) if late else default)
        return extras


def _not_empty(text: str) -> str:
    """An empty DATA would be the current directory (``Path("")`` is ``.``): surely a
    mistake, such as an unset shell variable."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _positive_seconds(text: str) -> float:
    """``umount --timeout``: 0 or less would stop waiting at once and report an unmount
    that is going well as a failure."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is None or not seconds > 0:   # "not >" refuses NaN too
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds, not '{text}'")
    return seconds


def _mkfs(args) -> int:
    from tierfs.tools import mkfs

    volumes = [mkfs.VolumeSpec.parse(v) for v in args.volume] or None
    try:
        config = mkfs.make_filesystem(
            Path(args.data), volumes, block_size=mkfs.parse_size(args.block_size),
            bytes_per_checksum=mkfs.parse_size(args.bytes_per_checksum),
            replication=args.replication, default_policy=args.default_policy,
            rename_mode=args.policy_on_rename)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"tierfs filesystem {config.fs_uuid} created in {Path(args.data).resolve()}")
    for v in config.volumes:
        cap = f", capacity {v.capacity}" if v.capacity else ""
        print(f"  volume {v.id}: {v.storage_type:<8} {v.path}{cap}")
    print(f"  block size {config.block_size}, bytes per checksum "
          f"{config.bytes_per_checksum}, replication {config.replication}, default policy "
          f"{config.default_policy}, policy on rename: {config.rename_mode}")
    warning = mkfs.default_policy_warning(config)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def _umount(args) -> int:
    from tierfs.tools.umount import unmount

    unmount(Path(args.mountpoint), timeout=args.timeout)
    return 0


def _fsck(args) -> int:
    from tierfs.tools.fsck import run_fsck

    return run_fsck(args)


def _policy(args) -> int:
    from tierfs.tools import policy

    return policy.run(args)


def _report(args) -> int:
    from tierfs.tools import report

    return report.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tierfs", description="tierfs tools")
    parser.add_argument("--debug", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Command)

    p = sub.add_parser("mkfs", help="create a filesystem in a data directory")
    p.add_argument("data", metavar="DATA", type=_not_empty)
    p.add_argument("--volume", action="append", default=[], metavar="TYPE:PATH[:CAPACITY]",
                   help="a volume (repeatable); default: DATA/ssd, DATA/disk, DATA/archive")
    p.add_argument("--block-size", default="64M", metavar="SIZE",
                   help="bytes per block, e.g. 1M (default: 64M)")
    p.add_argument("--bytes-per-checksum", default="4096", metavar="SIZE",
                   help="bytes per CRC32C chunk, 512 to 1M (default: 4096)")
    p.add_argument("--replication", type=int, default=1, metavar="N",
                   help="replicas per block, at most the number of volumes (default: 1)")
    p.add_argument("--default-policy", default="HOT", metavar="POLICY",
                   help="the storage policy of directories that set none (default: HOT)")
    p.add_argument("--policy-on-rename", choices=["follow", "keep"], default="follow",
                   help="follow: a renamed subtree takes the destination's policy "
                        "(default); keep: it keeps its own")
    p.set_defaults(func=_mkfs)

    p = sub.add_parser("umount", help="unmount a tierfs mount and wait for the daemon")
    p.add_argument("mountpoint", metavar="MNT|DATA",
                   help="the mount point, or the data directory of the mounted filesystem")
    p.add_argument("--timeout", type=_positive_seconds, default=120.0,
                   help="seconds to wait for the daemon (default: 120)")
    p.set_defaults(func=_umount)

    p = sub.add_parser("fsck", help="check a filesystem against its volumes")
    p.add_argument("data", metavar="DATA|MNT",
                   help="the data directory, or the mount point of a mounted filesystem")
    p.add_argument("path", nargs="?", default=None, metavar="PATH",
                   help="the subtree to check (default: /)")
    p.late_positional = ("path", "/")
    p.add_argument("--repair", action="store_true", help="fix what can be fixed")
    p.add_argument("--files", action="store_true", help="list checked files")
    p.add_argument("--blocks", action="store_true", help="with --files: list blocks")
    p.add_argument("--locations", action="store_true", help="with --blocks: replicas")
    p.add_argument("--storagepolicies", action="store_true", help="add the storage policy tables")
    p.set_defaults(func=_fsck)

    from tierfs.tools import policy

    p = sub.add_parser("policy", help="list, get, set or unset storage policies (like "
                                      "hdfs storagepolicies) of paths on a tierfs mount")
    p.usage_code = policy.USAGE
    policy_actions = policy.add_subcommands(p)
    p.set_defaults(func=_policy)

    p = sub.add_parser("report", help="capacity, usage and placement per storage type, "
                                      "volume and storage policy")
    p.add_argument("target", metavar="DATA|MNT",
                   help="a data directory, or the mount point of a tierfs (not a "
                        "directory below it: the report is of the whole filesystem)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_report)
    parser.commands = list(sub.choices)
    # --debug also after the subcommand (tierfs fsck --debug DATA) and a policy action
    for command in [*sub.choices.values(), *policy_actions]:
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="log debug messages")
    return parser


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # while the parser was being built
        print("tierfs: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        # COMMAND is checked here, not by argparse (required=True), which would check it
        # first and so answer "tierfs --bogus" with "COMMAND is required".
        if args.command is None:
            parser.error(f"a COMMAND is required: one of {', '.join(parser.commands)} "
                         f"(tierfs --help, tierfs COMMAND --help)")
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="tierfs: %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"tierfs {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except (FsError, VolumeError) as exc:
        print(f"tierfs {args.command}: {exc}", file=sys.stderr)
        return CANNOT_RUN.get(args.command, 1)
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly with the status a tool killed
        # by SIGPIPE has, and keep Python from reporting the flush at exit as well.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"tierfs {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return CANNOT_RUN.get(args.command, 1)
    except KeyboardInterrupt:
        print(f"tierfs {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
