"""Warnings that repeat, logged once a minute instead of once a request.

A user's own load can repeat one failure without end: every write() to a full volume is
answered ENOSPC, and a loop that keeps trying would write a log line per request, filling
the disk that holds the log (perhaps the one that is full). The first occurrence of a
message is logged at once; repeats within ``interval`` seconds are counted, and the next
occurrence after it is logged with that count, so the log still says how often it
happened (a count is written only when the message comes again).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

INTERVAL = 60.0
"""Seconds during which repeats of one message are only counted."""

MAX_TRACKED = 1024
"""Distinct messages remembered at once; beyond it, ones whose interval has passed are
forgotten (messages that name a block or an inode can be many)."""


class RepeatedWarnings:
    """``warning(message)``: log it, unless the same message was logged less than
    ``interval`` seconds ago, in which case only count it."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._seen: dict[str, list] = {}   # message -> [when logged, repeats since]

    def warning(self, message: str) -> None:
        now = self.clock()
        seen = self._seen.get(message)
        if seen is not None and now - seen[0] < self.interval:
            seen[1] += 1
            return
        if seen is not None and seen[1]:
            self.logger.warning("%s (and %d more times in the %.0f s before)", message,
                                seen[1], now - seen[0])
        else:
            self.logger.warning("%s", message)
        if seen is None and len(self._seen) >= MAX_TRACKED:
            self._forget_older_than(now - self.interval)
            if len(self._seen) >= MAX_TRACKED:
                return    # that many distinct messages in a minute: each is logged
        self._seen[message] = [now, 0]

    def _forget_older_than(self, cutoff: float) -> None:
        for message in [m for m, (when, _) in self._seen.items() if when < cutoff]:
            del self._seen[message]
