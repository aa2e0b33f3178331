"""Status lines for long workloads, and a watchdog for a mount that stops answering.

A full run writes a GiB and creates a hundred thousand files through a filesystem under
development, so it can take minutes; a status line every few seconds shows that it is moving.
The workloads report progress once per batch of operations (see ``Progress.track``), never per
operation, so the hot loops pay the same negligible cost on the backing directory and on the
mount.

A wedged FUSE daemon blocks the harness inside a system call where Ctrl-C cannot reach it
(the kernel waits for the daemon's answer). The watchdog notices that a task has made no
progress for a long time and calls the task's ``on_stall`` callback, which kills the daemon;
the kernel then fails the blocked call with ENOTCONN and the run ends normally.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TextIO, TypeVar

T = TypeVar("T")

TICK = 0.5


class Progress:
    """Tracks the running task and prints its progress from a background thread.

    ``interval`` is the time between status lines (the first appears once a task has run that
    long, so quick tasks print nothing); ``stall_timeout`` is how long a task may go without
    progress before its ``on_stall`` callback runs (once).
    """

    def __init__(self, interval: float = 10.0, stall_timeout: float = 300.0,
                 stream: TextIO = sys.stderr):
        self.interval = interval
        self.stall_timeout = stall_timeout
        self.stream = stream
        self._lock = threading.Lock()
        self._title: str | None = None
        self._on_stall: Callable[[str], None] | None = None
        self._started = self._changed = self._printed = 0.0
        self._done = self._total = 0
        self._what = ""
        self._stage = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-progress", daemon=True)
        self._thread.start()

    @contextmanager
    def task(self, title: str, on_stall: Callable[[str], None] | None = None) -> Iterator[None]:
        """Marks ``title`` as running for the duration of the block."""
        now = time.monotonic()
        with self._lock:
            self._title, self._on_stall = title, on_stall
            self._started = self._changed = self._printed = now
            self._done = self._total = 0
            self._what = self._stage = ""
        try:
            yield
        finally:
            with self._lock:
                self._title = self._on_stall = None

    @contextmanager
    def stage(self, text: str) -> Iterator[None]:
        """Names an untimed step of the running task (such as preparing its input)."""
        with self._lock:
            outer, self._stage = self._stage, text
        try:
            yield
        finally:
            with self._lock:
                self._stage = outer

    def track(self, items: Sequence[T], batch: int, what: str = "ops") -> Iterator[Sequence[T]]:
        """Yields ``items`` in slices of ``batch`` and records progress after each slice.

        The caller loops over each slice itself, so progress costs one update per batch.
        """
        with self._lock:
            self._done, self._total, self._what = 0, len(items), what
            self._changed = time.monotonic()
        for start in range(0, len(items), batch):
            chunk = items[start:start + batch]
            yield chunk
            with self._lock:
                self._done += len(chunk)
                self._changed = time.monotonic()

    def close(self) -> None:
        """Stops the background thread."""
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        """Prints status lines and fires the stall callback; runs in the background thread."""
        while not self._stop.wait(TICK):
            now = time.monotonic()
            with self._lock:
                if self._title is None:
                    continue
                line = self._status_line(now) if now - self._printed >= self.interval else None
                if line:
                    self._printed = now
                stalled = (self._on_stall is not None
                           and now - self._changed >= self.stall_timeout)
                callback, title = (self._on_stall, self._title) if stalled else (None, None)
                if stalled:
                    self._on_stall = None
            if line:
                print(line, file=self.stream, flush=True)
            if callback is not None:
                print(f"  !! {title}: no progress for {self.stall_timeout:.0f} s",
                      file=self.stream, flush=True)
                callback(title)

    def _status_line(self, now: float) -> str:
        """One status line for the running task (the lock is held)."""
        title = f"{self._title} ({self._stage})" if self._stage else self._title
        elapsed = f"{now - self._started:.0f} s"
        if not self._total:
            return f"  .. {title}: {elapsed}"
        share = 100 * self._done / self._total
        return (f"  .. {title}: {self._done:,}/{self._total:,} {self._what}"
                f" ({share:.0f}%), {elapsed}")
