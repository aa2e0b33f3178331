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
    assert messages(caplog)[-1] == (
        "write: volume /v is full (and 99 more like it in the 70 s before)")
    clock.now += 61
    warnings.warning("write: volume /v is full")
    assert messages(caplog)[-1] == "write: volume /v is full"


def test_messages_that_differ_only_in_numbers_are_one_kind(caplog):
    """A full volume fails every new replica with its own block id and stamp."""
    caplog.set_level(logging.WARNING)
    clock = Clock()
    warnings = RepeatedWarnings(logging.getLogger("t"), interval=60, clock=clock)
    for n in range(500):
        warnings.warning(f"write: cannot create replica blk_{1073743603 + n}_{2779 + n} on "
                         "/v1: No space left on device")
    warnings.warning("write: cannot create replica blk_1_1 on /v2: Disk quota exceeded")
    clock.now += 61
    warnings.warning("write: cannot create replica blk_9_9 on /v1: No space left on device")
    assert messages(caplog) == [
        "write: cannot create replica blk_1073743603_2779 on /v1: No space left on device",
        "write: cannot create replica blk_1_1 on /v2: Disk quota exceeded",
        "write: cannot create replica blk_9_9 on /v1: No space left on device "
        "(and 499 more like it in the 61 s before)"]


def test_many_kinds_keep_memory_bounded_and_the_limit_working(caplog, monkeypatch):
    monkeypatch.setattr(lograte, "MAX_TRACKED", 8)
    caplog.set_level(logging.WARNING)
    clock = Clock()
    warnings = RepeatedWarnings(logging.getLogger("t"), interval=60, clock=clock)
    for n in range(20):
        warnings.warning(f"read: {'x' * n} unreadable")
    assert len(messages(caplog)) == 20 and len(warnings._seen) == 8
    for _ in range(1000):   # a full table still limits a repeated message
        warnings.warning("write: volume /v is full")
    assert len(messages(caplog)) == 21 and len(warnings._seen) == 8
