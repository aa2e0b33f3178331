"""RepeatedWarnings: a message repeated without end is logged once per interval, with a
count of the repeats in between (tierfs.fs.lograte)."""

from __future__ import annotations

import logging

from tierfs.fs import lograte
from tierfs.fs.lograte import RepeatedWarnings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_repeats_are_counted_and_logged_after_the_interval(caplog):
    caplog.set_level(logging.WARNING)
    clock = Clock()
    warnings = RepeatedWarnings(logging.getLogger("t"), interval=60, clock=clock)
    for _ in range(100):
        warnings.warning("write: volume /v is full")
        clock.now += 0.1
    warnings.warning("create: no volume allowed by policy HOT has room")
    assert messages(caplog) == ["write: volume /v is full",
                                "create: no volume allowed by policy HOT has room"]
    clock.now += 60
    warnings.warning("write: volume /v is full")
    assert messages(caplog)[-1] == "write: volume /v is full (and 99 more times in the 70 s before)"
    clock.now += 61
    warnings.warning("write: volume /v is full")
    assert messages(caplog)[-1] == "write: volume /v is full"


def test_distinct_messages_are_each_logged_and_memory_stays_bounded(caplog, monkeypatch):
    monkeypatch.setattr(lograte, "MAX_TRACKED", 8)
    caplog.set_level(logging.WARNING)
    clock = Clock()
    warnings = RepeatedWarnings(logging.getLogger("t"), interval=60, clock=clock)
    for block in range(20):
        warnings.warning(f"read: block {block} unreadable")
    assert len(messages(caplog)) == 20 and len(warnings._seen) == 8
    clock.now += 61
    warnings.warning("read: block 100 unreadable")
    assert len(warnings._seen) == 1
