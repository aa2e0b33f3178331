"""What fsck finds on the volumes: the replica files of each volume by block
(:func:`scan_volume`) and the judged state of one recorded replica (:class:`ReplicaState`).
Reading a whole replica against its checksums is ``tierfs.backends.verify``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tierfs.backends.volume import Volume

SCAN_ATTEMPTS = 5
"""Beside a daemon a file can vanish between listing a directory and its stat: rescan."""


@dataclass
class Found:
    """The files of one block on one volume, at their layout paths."""

    data_path: Path | None = None
    data_len: int = 0
    metas: dict[int, Path] = field(default_factory=dict)

    def paths(self) -> list[str]:
        paths = [str(p) for p in self.metas.values()]
        return [str(self.data_path), *paths] if self.data_path else paths


def scan_volume(volume: Volume) -> tuple[dict[int, Found], list[Path]]:
    """Replica files by block id, and files that are not where the layout puts them."""
    for attempt in range(SCAN_ATTEMPTS):
        try:
            return _scan_volume_once(volume)
        except FileNotFoundError:
            if attempt == SCAN_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _scan_volume_once(volume: Volume) -> tuple[dict[int, Found], list[Path]]:
    found: dict[int, Found] = {}
    misplaced: list[Path] = []
    for info in volume.iter_replicas():
        entry = found.setdefault(info.block_id, Found())
        if info.data_path is not None:
            if info.data_path == volume.data_path(info.block_id):
                entry.data_path, entry.data_len = info.data_path, info.length
            elif info.data_path not in misplaced:
                misplaced.append(info.data_path)
        if info.meta_path is not None:
            if info.meta_path == volume.meta_path(info.block_id, info.gs):
                entry.metas[info.gs] = info.meta_path
            else:
                misplaced.append(info.meta_path)
    return {bid: f for bid, f in found.items() if f.data_path or f.metas}, misplaced


@dataclass
class ReplicaState:
    """One recorded replica of a block, judged."""

    volume_id: int
    status: str          # ok, long, unverified, missing, corrupt, stale, newer, short
    reason: str = ""
    unopenable: bool = False

    @property
    def good(self) -> bool:
        """Servable now: reads through this replica return the recorded bytes."""
        return self.status in ("ok", "long", "unverified")
