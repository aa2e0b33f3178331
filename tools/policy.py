"""``tierfs policy list|get|set|unset``: storage policies of paths on a mounted tierfs.

The subcommands are HDFS's ``hdfs storagepolicies -listPolicies``, ``-getStoragePolicy``,
``-setStoragePolicy`` and ``-unsetStoragePolicy`` (reference, section 3.1), with the same
messages, working through the ``user.tierfs.*`` xattrs of the mount (DESIGN.md section 6),
so they need nothing but an ordinary path and the permissions a ``setfattr`` would need:

==========================  ===========================================================
command                     stdout on success
==========================  ===========================================================
``policy list``             ``Block Storage Policies:`` then one tab-indented
                            ``BlockStoragePolicy{NAME:id, ...}`` line per policy, by id
``policy get PATH``         ``The storage policy of PATH:`` and the policy's line, or
                            ``The storage policy of PATH is unspecified`` when neither
                            PATH nor any ancestor has one (the default policy applies)
``policy set PATH POLICY``  ``Set storage policy POLICY on PATH``
``policy unset PATH``       ``Unset storage policy from PATH``
==========================  ===========================================================

Exit codes (HDFS's): 0 done; 1 usage (missing or extra arguments, unknown subcommand);
2 failed: PATH does not exist (``File/Directory does not exist: PATH``), is not on a tierfs
mount, the policy name is unknown (``Cannot find a block policy with the name X``), or the
mount refused the change (EINVAL, EPERM, EACCES), each as one line on stderr.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys

from tierfs.fs.errors import UsageError
from tierfs.tools.mountinfo import FSTYPE, mount_of_device, stat_target
from tierfs.satisfier.policies import BlockStoragePolicy, PolicySuite

USAGE = 1
FAILED = 2

XATTR_POLICY = "user.tierfs.storage_policy"
XATTR_SOURCE = "user.tierfs.policy_source"

_LAZY_FILE = "Existing policy LAZY_PERSIST cannot be changed after file creation."


class PolicyError(Exception):
    """The operation failed: one line on stderr, exit code 2."""


class ArgParser(argparse.ArgumentParser):
    """argparse for the ``policy`` actions: every usage mistake raises exit code 1.

    Unknown or extra arguments are refused here rather than left to the top-level parser,
    which would answer them with its own exit code.
    """

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}", USAGE)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def add_subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The ``list``, ``get``, ``set`` and ``unset`` actions under ``tierfs policy``;
    returns their parsers."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=ArgParser)
    actions.required = True
    actions.add_parser("list", help="list the block storage policies")
    p = actions.add_parser("get", help="show the effective storage policy of a path")
    p.add_argument("path", metavar="PATH")
    p = actions.add_parser("set", help="set a storage policy on a path and its subtree")
    p.add_argument("path", metavar="PATH")
    p.add_argument("policy", metavar="POLICY")
    p = actions.add_parser("unset", help="make a path follow its parent's storage policy")
    p.add_argument("path", metavar="PATH")
    return list(actions.choices.values())


def run(args, out=None, err=None) -> int:
    """``tierfs policy ACTION``: print the result; exit codes in the module docstring."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        if args.action == "list":
            lines = list_policies()
        elif args.action == "get":
            lines = get_policy(args.path)
        elif args.action == "set":
            lines = set_policy(args.path, args.policy)
        else:
            lines = unset_policy(args.path)
    except PolicyError as exc:
        print(f"tierfs policy {args.action}: {exc}", file=err)
        return FAILED
    for line in lines:
        print(line, file=out)
    return 0


# --- the actions -----------------------------------------------------------------------------


def list_policies() -> list[str]:
    return ["Block Storage Policies:"] + [f"\t{p}" for p in PolicySuite().all_policies()]


def get_policy(path: str) -> list[str]:
    _check_path(path)
    name = _read(path, XATTR_POLICY)
    source = _read(path, XATTR_SOURCE)
    if policy_source(source) == "default":
        return [f"The storage policy of {path} is unspecified"]
    policy = _suite_policy(name, path)
    return [f"The storage policy of {path}:", str(policy)]


def set_policy(path: str, name: str) -> list[str]:
    try:
        policy = PolicySuite().get(name)
    except ValueError as exc:
        raise PolicyError(str(exc)) from None
    st = _check_path(path)
    try:
        os.setxattr(path, XATTR_POLICY, policy.name.encode())
    except OSError as exc:
        raise PolicyError(_refused("set", path, policy, st, exc)) from None
    return [f"Set storage policy {name} on {path}"]


def unset_policy(path: str) -> list[str]:
    st = _check_path(path)
    try:
        os.removexattr(path, XATTR_POLICY)
    except OSError as exc:
        raise PolicyError(_refused("unset", path, None, st, exc)) from None
    return [f"Unset storage policy from {path}"]


# --- helpers ---------------------------------------------------------------------------------


def policy_source(text: str) -> str:
    """The ``storage_policy`` part of ``user.tierfs.policy_source``: a path + TxID or
    ``default`` (nothing set on the inode or any ancestor)."""
    for part in text.split(";"):
        label, _, where = part.strip().partition(":")
        if label.strip() == "storage_policy":
            return where.strip()
    raise PolicyError(f"unexpected {XATTR_SOURCE} value: {text!r}")


def _check_path(path: str) -> os.stat_result:
    """PATH exists and lies on a tierfs mount; its stat."""
    st = stat_target(path, PolicyError, f"File/Directory does not exist: {path}")
    entry = mount_of_device(st.st_dev)
    if entry is None or entry.fstype != FSTYPE:
        kind = f" ({entry.fstype} on {entry.mount_point})" if entry else ""
        raise PolicyError(f"{path} is not on a tierfs mount{kind}")
    return st


def _read(path: str, name: str) -> str:
    try:
        return os.getxattr(path, name).decode(errors="replace")
    except OSError as exc:
        raise PolicyError(f"cannot read {name} of {path}: {exc.strerror}") from None


def _suite_policy(name: str, path: str) -> BlockStoragePolicy:
    try:
        return PolicySuite().get(name)
    except ValueError:
        raise PolicyError(f"{path} has an unknown storage policy {name!r}") from None


def _refused(action: str, path: str, policy: BlockStoragePolicy | None,
             st: os.stat_result, exc: OSError) -> str:
    """One line for an xattr call the mount (or the kernel) refused."""
    what = (f"cannot set storage policy {policy.name} on {path}" if policy is not None
            else f"cannot unset the storage policy of {path}")
    is_file = stat.S_ISREG(st.st_mode)
    if exc.errno == errno.EINVAL and is_file:
        if policy is not None and policy.copy_on_create_file:
            return f"Policy {policy.name} cannot be set after file creation."
        try:
            current = os.getxattr(path, XATTR_POLICY).decode(errors="replace")
        except OSError:
            current = ""
        if current == "LAZY_PERSIST":
            return _LAZY_FILE
    if exc.errno in (errno.EPERM, errno.EACCES):
        if not (is_file or stat.S_ISDIR(st.st_mode)):
            return f"{what}: only regular files and directories have a storage policy"
        return (f"Permission denied: {what} (needs write access, as the owner or with "
                f"write permission): {exc.strerror}")
    return f"{what}: {exc.strerror}"


