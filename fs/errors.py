"""Domain errors of tierfs.

Every error a user can cause or meet carries an errno. Only ``fs/operations.py`` turns them
into ``pyfuse3.FUSEError``; the tools turn them into a one-line message and an exit code.
Any other exception is a bug and must stay loud.
"""

from __future__ import annotations

import errno
import os


#: The daemon is out of descriptors: nothing is wrong with the file it was opening, and
#: the request fails with that errno rather than blaming a replica or a volume.
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


class FsError(Exception):
    """A failure with an errno, safe to report to a user.

    ``errno`` is the POSIX error number the mount answers with; ``message`` is one line
    for logs and tools.
    """

    def __init__(self, err: int, message: str | None = None):
        self.errno = err
        self.message = message or os.strerror(err)
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class LimitError(FsError):
    """A per-inode limit the caller reached (room for extended attributes): answered with
    its errno like any FsError, but not logged, since any user can reach it at will and
    nothing is wrong with the filesystem."""


def fs_error(err: int, message: str | None = None) -> FsError:
    """Shorthand used where a raise reads better with a function call."""
    return FsError(err, message)


class ChecksumError(FsError):
    """A replica's data does not match its stored CRC32C (answers EIO)."""

    def __init__(self, message: str):
        super().__init__(errno.EIO, message)


class VolumeError(FsError):
    """A volume is missing, foreign, unreadable or malformed."""

    def __init__(self, message: str, err: int = errno.EIO):
        super().__init__(err, message)


class UsageError(Exception):
    """A user's mistake on a command line: printed as one line, exit code 2 (or as documented)."""

    def __init__(self, message: str, exit_code: int = 2):
        self.exit_code = exit_code
        super().__init__(message)
