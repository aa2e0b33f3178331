"""Who is asking: the calling process's groups and capabilities, and the set-id rules that
depend on them.

With ``default_permissions`` the kernel checks access before a request reaches the daemon,
but a few decisions a disk filesystem makes in the kernel are left to a FUSE daemon: which
``trusted.*`` names a listing shows, whether a new file in a setgid directory keeps its
S_ISGID bit on kernels before 6.0, and which set-id bits a truncate or a write clears
where the kernel does not (an ``open(O_TRUNC)``, whose OPEN itself truncates; S_ISGID
without group execute, which FUSE's own rule keeps; a write through an uncached handle,
which FUSE leaves to the daemon). Linux
decides these by capability, not by uid 0, so they are decided here from the caller's
effective capability set in ``/proc/PID/status``. When that cannot be read (the caller has
exited), uid 0 stands for "privileged".
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

import pyfuse3

CAP_FSETID = 4
CAP_SYS_ADMIN = 21


def groups(pid: int) -> set[int]:
    """The caller's supplementary groups (empty when they cannot be read)."""
    try:
        return pyfuse3.get_sup_groups(pid)
    except (OSError, ValueError):
        return set()


def capable(ctx, cap: int) -> bool:
    """Whether the caller's effective capabilities include ``cap`` (Linux numbering)."""
    try:
        with open(f"/proc/{ctx.pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except (OSError, ValueError, IndexError):
        pass
    return ctx.uid == 0


def in_group(ctx, gid: int) -> bool:
    """Whether ``gid`` is the caller's group or one of its supplementary groups."""
    return gid == ctx.gid or gid in groups(ctx.pid)


def in_group_or_capable(ctx, gid: int) -> bool:
    """The kernel's ``in_group_or_capable`` for CAP_FSETID: may the caller keep S_ISGID on
    a file of group ``gid``?"""
    return in_group(ctx, gid) or capable(ctx, CAP_FSETID)


@dataclass(frozen=True)
class Privileges:
    """What decides which set-id bits a caller's write or truncate clears."""

    fsetid: bool              # holds CAP_FSETID
    groups: frozenset[int]    # primary and supplementary groups


def privileges(ctx) -> Privileges:
    return Privileges(capable(ctx, CAP_FSETID), frozenset({ctx.gid} | groups(ctx.pid)))


def _setid_file(mode: int) -> bool:
    """A regular file with a set-id bit: the only kind a write or truncate changes."""
    return stat.S_ISREG(mode) and bool(mode & (stat.S_ISUID | stat.S_ISGID))


def mode_after_write(mode: int, gid: int, privs: Privileges) -> int:
    """The mode a write or truncate leaves on a regular file, as Linux decides it: a caller
    holding CAP_FSETID keeps both bits; for any other, S_ISUID goes, and S_ISGID goes with
    group execute set (a set-group-id program), or without it when the caller is not in the
    file's group."""
    if not _setid_file(mode) or privs.fsetid:
        return mode
    mode &= ~stat.S_ISUID
    if mode & stat.S_ISGID and (mode & stat.S_IXGRP or gid not in privs.groups):
        mode &= ~stat.S_ISGID
    return mode


def mode_after_truncate(mode: int, gid: int, ctx) -> int:
    """``mode_after_write`` for the caller of a request (its privileges read only when the
    file has a set-id bit)."""
    return mode_after_write(mode, gid, privileges(ctx)) if _setid_file(mode) else mode


def strip_new_sgid(mode: int, parent_mode: int, gid: int, ctx) -> int:
    """S_ISGID of a new non-directory in a setgid directory, as Linux's ``mode_strip_sgid``:
    dropped only for a set-group-id program (group execute set) made by a caller who is
    neither in the directory's group nor holds CAP_FSETID. Kernels from 6.0 do this before
    the request is sent; older ones leave it to the filesystem."""
    if (stat.S_ISDIR(mode) or not parent_mode & stat.S_ISGID
            or mode & (stat.S_ISGID | stat.S_IXGRP) != stat.S_ISGID | stat.S_IXGRP):
        return mode
    if in_group_or_capable(ctx, gid):
        return mode
    return mode & ~stat.S_ISGID
