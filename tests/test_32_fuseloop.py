"""The read lock tierfs gives pyfuse3's request loop (fs/fuseloop.py).

Every mount test runs the loop with it; these pin down the lock's own contract: a free
lock is taken without a trip through the scheduler, waiters are served first come first
served, and a waiter cancelled while it waits never ends up holding the lock.
"""

from __future__ import annotations

import pyfuse3
import trio
import trio.testing

from tierfs.fs import fuseloop
from tierfs.fs.fuseloop import ReadLock


def test_a_free_lock_is_taken_without_yielding():
    ran = []

    async def other():
        ran.append("other")

    async def main():
        lock = ReadLock()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            for _ in range(10):  # trio.Lock lets "other" run at some acquire (trio picks
                async with lock:  # the order at random, so at each one with odds 1/2)
                    assert ran == [] and lock.locked
                assert not lock.locked
            await trio.testing.wait_all_tasks_blocked()
            assert ran == ["other"]

    trio.run(main)


def test_waiters_get_the_lock_in_arrival_order_and_one_at_a_time():
    order = []

    async def main():
        lock = ReadLock()
        inside = 0

        async def user(name):
            nonlocal inside
            async with lock:
                inside += 1
                assert inside == 1
                order.append(name)
                await trio.sleep(0.01)
                inside -= 1

        async with trio.open_nursery() as nursery:
            for name in "abcd":
                nursery.start_soon(user, name)
                await trio.sleep(0.001)  # a, then b, c, d queue behind it
        assert not lock.locked

    trio.run(main)
    assert order == list("abcd")


def test_a_waiter_cancelled_while_waiting_never_holds_the_lock():
    async def main():
        lock = ReadLock()
        got = []

        async def waiter(name, scope_box):
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                async with lock:
                    got.append(name)

        async with trio.open_nursery() as nursery:
            await lock.__aenter__()
            cancelled_scope: list = []
            nursery.start_soon(waiter, "cancelled", cancelled_scope)
            nursery.start_soon(waiter, "next", [])
            await trio.sleep(0.01)
            cancelled_scope[0].cancel()
            await trio.sleep(0.01)
            await lock.__aexit__(None, None, None)  # hands over to "next", not to nobody
        assert got == ["next"] and not lock.locked

    trio.run(main)


def test_install_gives_pyfuse3_trio_with_this_lock():
    saved = pyfuse3.trio
    try:
        fuseloop.install()
        assert pyfuse3.trio.Lock is ReadLock
        assert pyfuse3.trio.lowlevel.wait_readable is trio.lowlevel.wait_readable
        assert pyfuse3.trio.ClosedResourceError is trio.ClosedResourceError
    finally:
        pyfuse3.trio = saved
