"""Warnings that repeat, logged once a minute instead of once a request.

A user's own load can repeat one failure without end: every write() to a full volume is
answered ENOSPC, and a loop that keeps trying would write a log line per request, filling
the disk that holds the log (perhaps the one that is full). The first occurrence of a kind
of message is logged at once; repeats within ``interval`` seconds are counted, and the
next occurrence after it is logged with that count, so the log still says how often it
happened (a count is written only when the message comes again).

Messages of one kind differ in their numbers (a new block id and generation stamp for
every replica that could not be created), so they are told apart with every run of digits
taken as the same.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Callable

INTERVAL = 60.0
"""Seconds during which repeats of one kind of message are only counted."""

MAX_TRACKED = 1024
"""Kinds of message remembered at once; beyond it the one logged longest ago is forgotten
(and logged again when it comes back)."""

_DIGITS = re.compile(r"\d+")


class RepeatedWarnings:
    """``warning(message)``: log it, unless a message of the same kind was logged less than
    ``interval`` seconds ago, in which case only count it."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._seen: dict[str, list] = {}   # kind -> [when logged, repeats since]; oldest first

    def warning(self, message: str) -> None:
        now = self.clock()
        kind = _DIGITS.sub("#", message)
        seen = self._seen.get(kind)
        if seen is not None and now - seen[0] < self.interval:
            seen[1] += 1
            return
        if seen is not None and seen[1]:
            self.logger.warning("%s (and %d more like it in the %.0f s before)", message,
                                seen[1], now - seen[0])
        else:
            self.logger.warning("%s", message)
        self._seen.pop(kind, None)
        if len(self._seen) >= MAX_TRACKED:
            del self._seen[next(iter(self._seen))]   # logged longest ago
        self._seen[kind] = [now, 0]
