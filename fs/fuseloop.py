"""A lighter lock for pyfuse3's request loop.

pyfuse3's worker tasks take turns waiting on the FUSE device: each request starts with
``async with read_lock: await wait_readable(fd)``, under a ``trio.Lock``. Trio's lock
yields to the scheduler on every acquire, even when nobody else holds it, so each request
paid for a scheduler pass (and its ``epoll_wait``) before the one ``wait_readable`` makes
anyway: a sixth of the daemon's CPU per request, measured on GETXATTR round trips.

The read lock here takes the lock without yielding when it is free and hands it over,
first come first served, when it is not. The loop still yields once per request, in
``wait_readable``, so no task is starved. pyfuse3 finds its async library through its
module attribute ``trio`` (``pyfuse3.asyncio`` swaps it the same way); ``install`` gives
it trio with this lock in place of ``trio.Lock``. The lock only guards that wait in
pyfuse3's loop; tierfs's own code uses trio's locks.
"""

from __future__ import annotations

import pyfuse3
import trio


class ReadLock:
    """FIFO lock whose uncontended acquire does not yield; release hands over to the
    longest waiter, which then holds the lock (a waiter cancelled while parked never
    held it, so no hand-over is lost)."""

    def __init__(self) -> None:
        self._held = False
        self._waiters = trio.lowlevel.ParkingLot()

    @property
    def locked(self) -> bool:
        return self._held

    async def __aenter__(self) -> None:
        if self._held:
            await self._waiters.park()  # woken by __aexit__ as the new holder
        else:
            self._held = True

    async def __aexit__(self, *exc_info) -> None:
        if self._waiters:
            self._waiters.unpark()
        else:
            self._held = False


class _TrioForPyfuse3:
    """trio as pyfuse3 sees it: everything from trio, but the loop's lock from here."""

    Lock = ReadLock

    def __getattr__(self, name: str):
        return getattr(trio, name)


def install() -> None:
    """Give pyfuse3's request loop the lighter lock (before ``pyfuse3.main``)."""
    pyfuse3.trio = _TrioForPyfuse3()
