"""What fsck reads from the namespace: :class:`Snapshot`, taken in one read transaction,
with the indexes the checks need and the path helpers used to name things in the output."""

from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Callable

import lmdb
import msgpack

from tierfs.fs import schema
from tierfs.fs.errors import FsError
from tierfs.fs.namespace import Namespace
from tierfs.fs.schema import BlockRecord, Inode, ROOT_INO


@dataclass
class Snapshot:
    """Everything fsck reads from the namespace, taken in one read transaction.

    One transaction gives a consistent view even beside a running daemon; copying it out
    releases the transaction before the long data pass (a long LMDB read transaction would
    stop page reuse and grow the file).
    """

    block_size: int
    counters: dict[str, int]
    state: str
    inodes: dict[int, Inode]
    dentries: dict[tuple[int, bytes], tuple[int, int]]
    cookies: dict[tuple[int, int], tuple[int, bytes]]
    backlinks: set[tuple[int, int, bytes]]
    symlinks: dict[int, bytes]
    blocks: dict[tuple[int, int], BlockRecord]
    replicas: dict[tuple[int, int], tuple[int, int]]
    leases: dict[int, tuple[bytes, int]]
    orphans: set[int]
    trash: dict[int, tuple[int, tuple[int, ...]]]
    keyed: dict[str, set[int]]
    last_journal: int
    links: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    children: dict[int, list[tuple[bytes, int]]] = field(default_factory=dict)
    blocks_of: dict[int, list[tuple[int, BlockRecord]]] = field(default_factory=dict)

    @classmethod
    def load(cls, ns: Namespace) -> "Snapshot":
        """Read the namespace; beside a daemon that grew the map meanwhile, adopt the new
        size (LMDB's documented answer to MDB_MAP_RESIZED) and read again."""
        try:
            return cls._load(ns)
        except lmdb.MapResizedError:
            ns.env.set_mapsize(0)
            return cls._load(ns)

    @classmethod
    def _load(cls, ns: Namespace) -> "Snapshot":
        with ns.env.begin() as txn:
            def rows(name: str) -> list[tuple[bytes, bytes]]:
                with txn.cursor(db=ns.db[name]) as cur:
                    return [(bytes(k), bytes(v)) for k, v in cur]

            def decode(name: str, fn: Callable[[list], object]):
                try:
                    return fn(rows(name))
                except (struct.error, ValueError, msgpack.UnpackException) as exc:
                    raise FsError(errno.EIO, f"namespace database '{name}' holds a "
                                             f"malformed row ({exc})") from None

            with txn.cursor(db=ns.db["journal"]) as cur:
                last_journal = schema.read_u64(cur.key()) if cur.last() else 0
            meta = dict(rows("meta"))
            snap = cls(
                block_size=ns.config.block_size,
                counters={k: schema.read_u64(meta[k.encode()]) if k.encode() in meta else 0
                          for k in schema.COUNTERS},
                state=schema.unpack_meta(meta[b"state"]) if b"state" in meta else "clean",
                inodes=decode("inodes", lambda r: {
                    schema.read_u64(k): Inode.unpack(schema.read_u64(k), v) for k, v in r}),
                dentries=decode("dentries", lambda r: {
                    schema.split_dentry_key(k): schema.parse_dentry_value(v) for k, v in r}),
                cookies=decode("dircookies", lambda r: {
                    schema.split_cookie_key(k): schema.parse_cookie_value(v) for k, v in r}),
                backlinks=decode("backlinks", lambda r: {
                    schema.split_backlink_key(k) for k, _ in r}),
                symlinks=decode("symlinks", lambda r: {schema.read_u64(k): v for k, v in r}),
                blocks=decode("blocks", lambda r: {
                    schema.split_block_key(k): BlockRecord.unpack(v) for k, v in r}),
                replicas=decode("replicas", lambda r: {
                    schema.split_replica_key(k): schema.split_block_key(v) for k, v in r}),
                leases=decode("leases", lambda r: {
                    schema.read_u64(k): schema.parse_lease_value(v) for k, v in r}),
                orphans=decode("orphans", lambda r: {schema.read_u64(k) for k, _ in r}),
                trash=decode("trash", lambda r: {
                    schema.read_u64(k): schema.parse_trash_value(v) for k, v in r}),
                keyed={name: decode(name, lambda r: {schema.read_u64(k[:8]) for k, _ in r})
                       for name in ("xattrs", "inherited")},
                last_journal=last_journal,
            )
        snap._derive()
        return snap

    def _derive(self) -> None:
        """Indexes the checks need: valid names of each inode, children, blocks per file.

        A name is valid in an existing directory, and in the root even when the root inode
        is missing: the root is recreated, so its entries are not reported one by one.
        """
        root_missing = ROOT_INO not in self.inodes
        for (parent, name), (child, _) in self.dentries.items():
            in_dir = self.is_dir(parent) or (parent == ROOT_INO and root_missing)
            if not in_dir or child not in self.inodes:
                continue
            self.links.setdefault(child, []).append((parent, name))
            self.children.setdefault(parent, []).append((name, child))
        for (ino, index), rec in sorted(self.blocks.items()):
            self.blocks_of.setdefault(ino, []).append((index, rec))

    def is_dir(self, ino: int) -> bool:
        inode = self.inodes.get(ino)
        return inode is not None and stat.S_ISDIR(inode.mode)

    def primary_link(self, ino: int) -> tuple[int, bytes] | None:
        """The name used for paths: the one in the inode's ``parent`` directory if any."""
        links = self.links.get(ino)
        if not links:
            return None
        parent = self.inodes[ino].parent
        return next((link for link in links if link[0] == parent), links[0])

    def path_of(self, ino: int) -> str:
        """``/a/b`` for an inode reachable through names, ``<inode N>`` otherwise."""
        parts: list[bytes] = []
        seen = set()
        cur = ino
        while cur != ROOT_INO:
            link = None if cur in seen else self.primary_link(cur)
            if link is None:
                return f"<inode {ino}>"
            seen.add(cur)
            parts.append(link[1])
            cur = link[0]
        return "/" + "/".join(_show(p) for p in reversed(parts))

    def entry_path(self, parent: int, name: bytes) -> str:
        base = self.path_of(parent) if parent in self.inodes else f"<inode {parent}>"
        return f"{base.rstrip('/')}/{_show(name)}"

    def resolve(self, path: str) -> int | None:
        """Inode of a path walked from the root through valid dentries, or None."""
        ino = ROOT_INO
        for part in path.strip("/").split("/") if path.strip("/") else []:
            if not self.is_dir(ino):
                return None
            found = self.dentries.get((ino, os.fsencode(part)))
            if found is None or found[0] not in self.inodes:
                return None
            ino = found[0]
        return ino if ino in self.inodes else None

    def subtree(self, top: int) -> list[int]:
        """``top`` and every inode below it (each once, loop-safe)."""
        seen = {top}
        order = [top]
        for ino in order:
            for _, child in self.children.get(ino, ()):
                if child not in seen:
                    seen.add(child)
                    order.append(child)
        return order


def _show(name: bytes) -> str:
    """A name for display: undecodable bytes shown escaped, never an encoding error."""
    return name.decode("utf-8", "backslashreplace")
