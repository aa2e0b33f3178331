"""The LMDB schema of a tierfs namespace: every database, key, value and invariant.

This module is the single authority on the on-disk metadata format. Nothing else packs or
unpacks LMDB keys or values; ``fs/namespace.py`` is the only user of these codecs, so a
change of format happens here and nowhere else.

Environment: ``DATA/namespace/`` (``data.mdb`` + ``lock.mdb``), opened with ``sync=False``:
commits reach the OS page cache at once (a killed daemon loses nothing committed) and are
forced to disk by ``fsync``/``syncfs`` and by a one-second background sync.

All integers in keys are big-endian and fixed width, so ranges sort numerically.

Databases (name: key -> value):

``meta``
    ASCII name -> value. Configuration fixed at mkfs (``fs_uuid``, ``layout_version``,
    ``block_size``, ``bytes_per_checksum``, ``replication``, ``default_policy``,
    ``rename_mode``, ``volumes``), the ``state`` (``clean`` or ``mounted``: a mount that finds
    ``mounted`` knows the previous daemon died and runs recovery), and the counters
    ``txid``, ``next_ino``, ``next_block_id``, ``gs`` (u64 each). Counters only grow:
    inode numbers, block ids, generation stamps and TxIDs are never reused.
``inodes``
    ino u64 -> :class:`Inode` (struct ``INODE``).
    Invariants: a directory's nlink = 2 + number of subdirectories; a non-directory's
    nlink = number of dentries naming it; an inode with nlink 0 exists only while it is
    listed in ``orphans``; ``parent`` is the directory of one of the inode's dentries (the
    directory's only one for directories; used to resolve inherited xattrs); the root
    (ino 1) is its own parent.
``dentries``
    parent u64 + name -> child u64 + cookie u64. ``cookie`` is the entry's readdir offset,
    unique and increasing within its directory (taken from the directory's ``next_cookie``)
    so a listing resumed after an offset shows every entry that stayed exactly once.
``dircookies``
    parent u64 + cookie u64 -> child u64 + name. The readdir order; one row per dentry,
    carrying the child so a listing needs no second lookup per entry.
``backlinks``
    child u64 + parent u64 + name -> b"". One row per dentry; finds the remaining links of
    a hard-linked file when its ``parent`` link goes away, and gives fsck paths.
``symlinks``
    ino u64 -> target bytes.
``xattrs``
    ino u64 + name -> value. Ordinary stored extended attributes (``user.*``, ``trusted.*``,
    ``security.*``); the ``user.tierfs.*`` names are computed, never stored here.
``inherited``
    ino u64 + attr u8 -> op bytes (``tierfs.fs.inherited.Op``): the TxID-ordered operations
    that decide inherited xattrs (storage policy, replication). At most one per inode and
    attribute; setting a value on a directory writes one row whatever its size. Attribute
    ``POLICY_STAMP`` is different: a file's own copy-on-create policy (LAZY_PERSIST), kept
    like HDFS keeps it in the file header: outside the ordered ops, so neither a later set
    on an ancestor nor a rename changes it.
``satisfier``
    txid u64 + ino u64 -> reason u8. Subtree roots whose effective policy or replication
    changed, written in the transaction that changed it.
``blocks``
    ino u64 + index u64 -> :class:`BlockRecord` (block id, generation stamp, length,
    replica volume ids). ``index`` is the block's position (offset // block_size); a missing
    index is a hole. Invariant: every replica's meta file carries the record's GS.
``replicas``
    volume u32 + block id u64 -> ino u64 + index u64. One row per replica; the per-volume
    index used by fsck, report and the satisfier.
``leases``
    ino u64 -> holder (16-byte mount session id) + since (ns u64) [+ truncate_to u64]. A
    file being written; a lease whose holder is not the running mount is recovered at
    mount. ``truncate_to`` is set while a shrinking truncate is under way (written before
    any replica is cut, cleared with the transaction that records the new size), so that
    recovery completes it to exactly that size.
``orphans``
    ino u64 -> b"". Inodes with nlink 0 that are still open or known to the kernel; purged
    when the last handle is released and the kernel forgets them, or at the next mount.
``trash``
    block id u64 -> gs u64 + volume ids. Replica files whose block the namespace dropped in
    a committed transaction; deleted after the commit and at mount (so no file leaks).
``journal``
    txid u64 -> msgpack ``[opcode, args...]``. One record per write transaction.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack

LAYOUT_VERSION = 1
ROOT_INO = 1

DATABASES = (
    "meta", "inodes", "dentries", "dircookies", "backlinks", "symlinks", "xattrs",
    "inherited", "satisfier", "blocks", "replicas", "leases", "orphans", "trash", "journal",
)

# Counters in ``meta``; first values follow HDFS (reserved ranges below them).
COUNTERS = {"txid": 0, "next_ino": ROOT_INO + 1, "next_block_id": (1 << 30) + 1, "gs": 1000}

# The first readdir cookie handed to an entry; 1 and 2 are "." and "..".
FIRST_COOKIE = 3

U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
U64X2 = struct.Struct(">QQ")
U32U64 = struct.Struct(">IQ")


def u64(n: int) -> bytes:
    return U64.pack(n)


def read_u64(raw: bytes) -> int:
    return U64.unpack(raw)[0]


# --- inodes ----------------------------------------------------------------------------

INODE = struct.Struct(">IIIIQQqqqQQ")
# atime, mtime and ctime are signed 64-bit nanoseconds ("qqq" above): 1677-09-21 to
# 2262-04-11. Times from outside are refused (fs/times.py), never stored wrapped.
TIME_NS_MIN = -(1 << 63)
TIME_NS_MAX = (1 << 63) - 1


@dataclass(slots=True)
class Inode:
    """One inode's attributes; times in nanoseconds since the epoch."""

    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    rdev: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    parent: int
    next_cookie: int = FIRST_COOKIE

    def fields(self) -> tuple:
        """Everything but ``ino``, in ``INODE`` order: what ``INODE.unpack`` gives back."""
        return (self.mode, self.uid, self.gid, self.nlink, self.size, self.rdev,
                self.atime_ns, self.mtime_ns, self.ctime_ns, self.parent, self.next_cookie)

    def pack(self) -> bytes:
        return INODE.pack(*self.fields())

    @classmethod
    def unpack(cls, ino: int, raw: bytes) -> "Inode":
        return cls(ino, *INODE.unpack(raw))


# --- dentries ----------------------------------------------------------------------------

def dentry_key(parent: int, name: bytes) -> bytes:
    return U64.pack(parent) + name


def dentry_value(child: int, cookie: int) -> bytes:
    return U64X2.pack(child, cookie)


def parse_dentry_value(raw: bytes) -> tuple[int, int]:
    return U64X2.unpack(raw)


def split_dentry_key(raw: bytes) -> tuple[int, bytes]:
    return U64.unpack_from(raw)[0], bytes(raw[8:])


def cookie_key(parent: int, cookie: int) -> bytes:
    return U64X2.pack(parent, cookie)


def split_cookie_key(raw: bytes) -> tuple[int, int]:
    return U64X2.unpack(raw)


def cookie_value(child: int, name: bytes) -> bytes:
    return U64.pack(child) + name


def parse_cookie_value(raw) -> tuple[int, bytes]:
    return U64.unpack_from(raw)[0], bytes(raw[8:])


def cookie_value_child_key(raw: bytes) -> bytes:
    """The ``inodes`` key of the entry a ``dircookies`` value names."""
    return raw[:8]


DirRow = tuple[int, bytes, int, tuple]
"""One readdir row: (cookie, name, child ino, the child's stored fields in ``INODE``
order). A plain tuple, not a class, because a listing pays for every row."""


def dir_row(key: bytes, value: bytes, inode: bytes) -> DirRow:
    """A readdir row from one ``dircookies`` item (bytes, not buffers) and the ``inodes``
    value of the child it names."""
    return U64.unpack_from(key, 8)[0], value[8:], U64.unpack_from(value)[0], INODE.unpack(inode)


def backlink_key(child: int, parent: int, name: bytes) -> bytes:
    return U64X2.pack(child, parent) + name


def split_backlink_key(raw: bytes) -> tuple[int, int, bytes]:
    child, parent = U64X2.unpack_from(raw)
    return child, parent, bytes(raw[16:])


def xattr_key(ino: int, name: bytes) -> bytes:
    return U64.pack(ino) + name


def inherited_key(ino: int, attr: int) -> bytes:
    return U64.pack(ino) + bytes((attr,))


def satisfier_key(txid: int, ino: int) -> bytes:
    return U64X2.pack(txid, ino)


def split_satisfier_key(raw: bytes) -> tuple[int, int]:
    return U64X2.unpack(raw)


class Inherited:
    """Attribute numbers of the ``inherited`` database."""

    POLICY = 1
    REPLICATION = 2
    ALL = (1, 2)
    POLICY_STAMP = 3


class SatisfyReason:
    """Why a subtree was put in the satisfier index (value byte of ``satisfier``)."""

    SET = 1
    UNSET = 2
    RENAME = 3


# --- blocks ------------------------------------------------------------------------------

BLOCK_HEAD = struct.Struct(">QQQB")


@dataclass(slots=True)
class BlockRecord:
    """A block of a file: id, generation stamp, length and the volumes holding replicas."""

    block_id: int
    gs: int
    length: int
    volumes: tuple[int, ...] = field(default_factory=tuple)

    def pack(self) -> bytes:
        head = BLOCK_HEAD.pack(self.block_id, self.gs, self.length, len(self.volumes))
        return head + b"".join(U32.pack(v) for v in self.volumes)

    @classmethod
    def unpack(cls, raw: bytes) -> "BlockRecord":
        block_id, gs, length, count = BLOCK_HEAD.unpack_from(raw)
        off = BLOCK_HEAD.size
        vols = tuple(U32.unpack_from(raw, off + 4 * i)[0] for i in range(count))
        return cls(block_id, gs, length, vols)


def block_key(ino: int, index: int) -> bytes:
    return U64X2.pack(ino, index)


def split_block_key(raw: bytes) -> tuple[int, int]:
    return U64X2.unpack(raw)


def replica_key(volume_id: int, block_id: int) -> bytes:
    return U32U64.pack(volume_id, block_id)


def split_replica_key(raw: bytes) -> tuple[int, int]:
    return U32U64.unpack(raw)


def trash_value(gs: int, volumes: tuple[int, ...]) -> bytes:
    return U64.pack(gs) + b"".join(U32.pack(v) for v in volumes)


def parse_trash_value(raw: bytes) -> tuple[int, tuple[int, ...]]:
    gs = U64.unpack_from(raw)[0]
    count = (len(raw) - 8) // 4
    return gs, tuple(U32.unpack_from(raw, 8 + 4 * i)[0] for i in range(count))


# --- leases ------------------------------------------------------------------------------

def lease_value(holder: bytes, since_ns: int, truncate_to: int | None = None) -> bytes:
    tail = b"" if truncate_to is None else U64.pack(truncate_to)
    return holder + U64.pack(since_ns) + tail


def parse_lease_value(raw: bytes) -> tuple[bytes, int]:
    return bytes(raw[:16]), U64.unpack_from(raw, 16)[0]


def lease_truncate_to(raw: bytes) -> int | None:
    """The size a truncate in progress is cutting the file to, if the lease carries one."""
    return U64.unpack_from(raw, 24)[0] if len(raw) >= 32 else None


# --- journal -----------------------------------------------------------------------------

class Op:
    """Journal op codes. Numbers are part of the format: never renumber, only add."""

    MKFS = 1
    MKNOD = 2
    LINK = 3
    UNLINK = 4
    RENAME = 5
    SETATTR = 6
    SETXATTR = 7
    REMOVEXATTR = 8
    ADD_BLOCK = 9
    UPDATE_BLOCKS = 10
    TRUNCATE = 11
    PURGE = 12
    LEASE = 13
    TRASH_DONE = 14
    SET_GS = 15
    SET_INHERITED = 16
    MOUNT = 17
    RECOVER = 18
    REPAIR = 19
    SET_REPLICAS = 20


OP_NAMES = {v: k for k, v in vars(Op).items() if isinstance(v, int)}


def journal_record(op: int, args: tuple) -> bytes:
    return msgpack.packb([op, *args], use_bin_type=True)


def parse_journal_record(raw: bytes) -> list:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def pack_meta(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack_meta(raw: bytes):
    return msgpack.unpackb(raw, raw=False)
