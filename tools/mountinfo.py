"""Reading /proc/self/mountinfo: which mount a path or device belongs to, and a tierfs
mount's data directory (its source, the fsname the daemon mounts with).

Never stat a mount point from inside its own daemon: the lookups here compare strings.
"""

from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes

FSTYPE = "fuse.tierfs"


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo, the parts the tools need."""

    device: str       # "major:minor", as st_dev of every file on it
    mount_point: str
    fstype: str
    source: str       # for tierfs: the data directory, as ``fsname`` wrote it

    @property
    def data_dir(self) -> str:
        """A tierfs mount's data directory (``fsname`` undone)."""
        return os.fsdecode(unquote_to_bytes(self.source))


#: What an fsname may hold as it is: printable ASCII but the comma (libfuse splits the
#: options at it), the backslash (libfuse's escape) and "%" (this encoding's).
_FSNAME_SAFE = "".join(c for c in string.printable
                       if c not in ",\\%" and (c == " " or not c.isspace()))


def fsname(data_dir) -> str:
    """The fsname tierfs mounts ``data_dir`` with: the path itself, with anything libfuse
    cannot take percent-encoded (pyfuse3 passes options as ASCII; a path in another
    script, or not valid UTF-8 at all, is still a path)."""
    return quote(os.fsencode(data_dir), safe=_FSNAME_SAFE)


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mounts() -> list[MountEntry]:
    entries = []
    try:
        # surrogateescape: any mount's path may be bytes that are not UTF-8
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            # Lines end at newlines and fields at spaces only: mountinfo escapes those
            # (and tabs and backslashes) but not \f, \x1c or U+2028, at which
            # splitlines() and split() would also cut.
            lines = f.read().split("\n")
    except OSError:
        return entries
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(" "), right.split(" ")
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        entries.append(MountEntry(fields[2], _unescape(fields[4]), _unescape(tail[0]),
                                  _unescape(tail[1])))
    return entries


def mount_of_device(dev: int) -> MountEntry | None:
    """The mount whose filesystem has this st_dev (the last one listed: the visible one)."""
    device = f"{os.major(dev)}:{os.minor(dev)}"
    found = [m for m in mounts() if m.device == device]
    return found[-1] if found else None


def mount_at(path: str) -> MountEntry | None:
    """The mount whose mount point is ``path``: compared as given (made absolute) first;
    only if that finds nothing is the path resolved, which stats it (tools only, never
    the daemon of that mount)."""
    target = os.path.abspath(path)
    found = [m for m in mounts() if m.mount_point == target]
    if not found:
        real = os.path.realpath(path)
        found = [m for m in mounts() if m.mount_point == real]
    return found[-1] if found else None


def stat_target(path: str, error: type[Exception], missing: str) -> os.stat_result:
    """``os.stat(path)`` for a tool's PATH argument: a failure becomes ``error`` with one
    line, ``missing`` when nothing is there."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise error(missing) from None
    except OSError as exc:
        raise error(f"cannot access {path}: {exc.strerror}") from None


def tierfs_mounted_on(path: str) -> MountEntry | None:
    """The tierfs whose mount point is ``path``, or None (nothing, or another type)."""
    entry = mount_at(path)
    return entry if entry is not None and entry.fstype == FSTYPE else None


def tierfs_mount_of(data_dir: str) -> MountEntry | None:
    """The mount of the tierfs whose data directory is ``data_dir`` (resolved, so a symlink
    or a relative path names it too), or None: ``tierfs umount DATA``, as ``umount``
    takes a device for its mount point."""
    real = os.path.realpath(data_dir)
    found = [m for m in mounts()
             if m.fstype == FSTYPE and os.path.realpath(m.data_dir) == real]
    return found[-1] if found else None
