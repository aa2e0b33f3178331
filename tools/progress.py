"""Progress of long tool runs (fsck, report): a tqdm bar on a terminal; otherwise (logs, CI,
pipes) a status line every few seconds, so a long run visibly lives without flooding a log.
"""

from __future__ import annotations

import sys
import time

STATUS_INTERVAL = 5.0
"""Seconds between status lines when stderr is not a terminal."""


class Progress:
    label = "tierfs"  # the tool's name at the start of each status line
    """Progress of the long phases on stderr.

    On a terminal a tqdm bar; otherwise (logs, CI, pipes) a status line every
    ``interval`` seconds, so that a long fsck visibly lives without flooding a log.
    """

    def __init__(self, stream=None, *, tty: bool | None = None,
                 interval: float = STATUS_INTERVAL):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval
        self._bar = None
        self._name = ""
        self._total = 0
        self._done = 0
        self._last = time.monotonic()

    def phase(self, name: str, total: int, unit: str = "B") -> None:
        """Start a phase of ``total`` units (bytes are shown scaled)."""
        self.close()
        self._name, self._total, self._done = name, total, 0
        self._last = time.monotonic()
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=name, unit=unit, file=self.stream,
                             unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                             leave=False, dynamic_ncols=True)

    def advance(self, n: int) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            share = f" ({100 * self._done // self._total}%)" if self._total else ""
            print(f"{self.label}: {self._name}: {self._done} of {self._total}{share}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Silent(Progress):
    """The library default: no output."""

    def __init__(self):
        super().__init__(stream=sys.stderr, tty=False, interval=float("inf"))

    def phase(self, name: str, total: int, unit: str = "B") -> None:
        pass

    def advance(self, n: int) -> None:
        pass
