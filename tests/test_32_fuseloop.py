"""The read lock and the device wait tierfs gives pyfuse3's request loop (fs/fuseloop.py).

Every mount test runs the loop with them; these pin down their own contracts. The lock: a
free lock is taken without a trip through the scheduler, waiters are served first come
first served, and a waiter cancelled while it waits never ends up holding the lock. The
wait: it skips the scheduler only when nothing else could run, never for longer than its
streak, and still returns for a request that comes after its own short wait gave up; it
polls without sleeping for its spin, and sleeps once when nothing came.
"""

from __future__ import annotations

import os
import select
import threading
import time

import pyfuse3
import pytest
import trio
import trio.testing

from tierfs.fs import fuseloop
from tierfs.fs.fuseloop import FuseReadiness, ReadLock


def run_with_hand_over(main, lock: ReadLock, *instruments):
    """``trio.run(main)`` with the hand-over hook the mount installs for its read lock; a
    lock nobody hands over fails the test in 10 s instead of hanging it."""

    async def bounded():
        with trio.fail_after(10):
            return await main()

    return trio.run(bounded, instruments=[fuseloop.HandOverAfterEachStep(lock), *instruments])


def test_a_free_lock_is_taken_without_yielding():
    ran = []
    lock = ReadLock()

    async def other():
        ran.append("other")

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            for _ in range(10):  # trio.Lock lets "other" run at some acquire (trio picks
                async with lock:  # the order at random, so at each one with odds 1/2)
                    assert ran == [] and lock.locked
                assert not lock.locked
            await trio.testing.wait_all_tasks_blocked()
            assert ran == ["other"]

    run_with_hand_over(main, lock)


def test_a_holder_that_comes_back_without_yielding_keeps_the_lock():
    """The usual request: release, handle without yielding, acquire again. The parked
    worker is not woken, so it costs no task switch."""
    lock = ReadLock()
    woken = []

    async def spare():
        async with lock:
            woken.append("spare")

    async def main():
        async with trio.open_nursery() as nursery:
            await lock.__aenter__()
            nursery.start_soon(spare)
            await trio.testing.wait_all_tasks_blocked()  # the spare is parked
            for _ in range(10):
                await lock.__aexit__(None, None, None)
                await lock.__aenter__()  # no yield in between
                assert woken == []
            await lock.__aexit__(None, None, None)
        assert woken == ["spare"]  # given the lock once main yielded at the nursery's end

    run_with_hand_over(main, lock)


def test_a_holder_that_yields_hands_over_to_waiters_in_arrival_order_one_at_a_time():
    order = []
    lock = ReadLock()

    async def main():
        inside = 0

        async def user(name):
            nonlocal inside
            async with lock:
                inside += 1
                assert inside == 1
                order.append(name)
                await trio.sleep(0.01)  # "waits on the device" while the others queue
                inside -= 1
            await trio.sleep(0.01)  # "handles its request" and yields: a hand-over

        async with trio.open_nursery() as nursery:
            for name in "abcd":
                nursery.start_soon(user, name)
                await trio.sleep(0.001)  # a, then b, c, d queue behind it
        assert not lock.locked

    run_with_hand_over(main, lock)
    assert order == list("abcd")


def test_a_holder_that_ends_hands_over():
    lock = ReadLock()
    got = []

    async def first():
        async with lock:
            await trio.sleep(0.01)  # "waits on the device"; then ends without coming back

    async def second():
        async with lock:
            got.append("second")

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(second)
        assert got == ["second"] and not lock.locked

    run_with_hand_over(main, lock)


def test_a_waiter_cancelled_while_waiting_never_holds_the_lock():
    lock = ReadLock()
    got = []

    async def waiter(name, scope_box):
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            async with lock:
                got.append(name)

    async def main():
        async with trio.open_nursery() as nursery:
            await lock.__aenter__()
            cancelled_scope: list = []
            nursery.start_soon(waiter, "cancelled", cancelled_scope)
            nursery.start_soon(waiter, "next", [])
            await trio.sleep(0.01)
            cancelled_scope[0].cancel()
            await trio.sleep(0.01)
            await lock.__aexit__(None, None, None)  # handed to "next", not to nobody
        assert got == ["next"] and not lock.locked

    run_with_hand_over(main, lock)


def test_install_gives_pyfuse3_trio_with_this_lock_and_wait():
    saved = pyfuse3.trio

    async def main():
        readiness, lock = fuseloop.install()
        assert pyfuse3.trio.Lock() is lock  # pyfuse3 makes its one read lock this way
        assert pyfuse3.trio.lowlevel.wait_readable == readiness.wait_readable
        assert pyfuse3.trio.lowlevel.current_task is trio.lowlevel.current_task
        assert pyfuse3.trio.ClosedResourceError is trio.ClosedResourceError
        await lock.__aenter__()
        woken = []

        async def spare():
            async with lock:
                woken.append("spare")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(spare)
            await trio.testing.wait_all_tasks_blocked()
            await lock.__aexit__(None, None, None)
            await trio.lowlevel.checkpoint()  # a step: the installed hook hands the lock over
            await trio.testing.wait_all_tasks_blocked()
            assert woken == ["spare"]

    async def bounded():
        with trio.fail_after(10):
            await main()

    try:
        trio.run(bounded)
    finally:
        pyfuse3.trio = saved


class StepCounter(trio.abc.Instrument):
    """Counts how often each task gave control back to trio's scheduler."""

    def __init__(self) -> None:
        self.steps: dict = {}

    def after_task_step(self, task) -> None:
        self.steps[task] = self.steps.get(task, 0) + 1


@pytest.fixture
def pipe():
    """A pipe with one byte waiting in it: a device with a request pending."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"r")
    yield read_fd, write_fd
    os.close(read_fd)
    os.close(write_fd)


def yields_of(coroutine_fn) -> int:
    """How many times the task running ``coroutine_fn`` passed through the scheduler
    (the task's own end counts as one)."""
    counter = StepCounter()
    box = {}

    async def main():
        box["task"] = trio.lowlevel.current_task()
        await coroutine_fn()

    trio.run(main, instruments=[counter])
    return counter.steps[box["task"]] - 1


def test_a_waiting_request_is_taken_without_a_scheduler_pass(pipe):
    readiness = FuseReadiness()

    async def wait_ten_times():
        for _ in range(10):
            await readiness.wait_readable(pipe[0])

    assert yields_of(wait_ten_times) == 0
    assert readiness.streak == 10


def test_after_a_streak_one_wait_goes_through_the_scheduler(pipe):
    readiness = FuseReadiness(max_streak=4)
    streaks = []

    async def wait_ten_times():
        for _ in range(10):
            await readiness.wait_readable(pipe[0])
            streaks.append(readiness.streak)

    assert yields_of(wait_ten_times) == 2
    assert streaks == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0]


def test_with_another_task_runnable_the_wait_goes_through_the_scheduler(pipe):
    readiness = FuseReadiness()
    counter = StepCounter()
    seen = []

    async def other():
        """A task that is runnable and does nothing else."""

    async def main():
        me = trio.lowlevel.current_task()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)  # runnable, not yet run
            seen.append(readiness.runnable_tasks())
            steps_before = counter.steps.get(me, 0)
            await readiness.wait_readable(pipe[0])
            seen.append(counter.steps.get(me, 0) - steps_before)
            seen.append(readiness.streak)

    trio.run(main, instruments=[counter])
    assert seen == [1, 1, 0]  # one runnable task; one pass through the scheduler; no streak


def test_a_running_worker_thread_sends_the_wait_through_the_scheduler(pipe):
    readiness = FuseReadiness()
    release = threading.Event()
    seen = []

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, release.wait)
            try:
                await trio.testing.wait_all_tasks_blocked()  # the thread is running
                seen.append(readiness.nothing_else_to_run())
                before = readiness.streak
                await readiness.wait_readable(pipe[0])
                seen.append(readiness.streak - before)
            finally:
                release.set()

    trio.run(main)
    assert seen == [False, 0]


def test_a_request_after_the_short_wait_still_wakes_the_loop():
    readiness = FuseReadiness(block_ms=1)
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)  # a read before the write fails instead of waiting
    writer = threading.Timer(0.05, os.write, (write_fd, b"r"))  # long after the poll

    async def main():
        writer.start()
        with trio.fail_after(5):
            await readiness.wait_readable(read_fd)
        return os.read(read_fd, 1)

    try:
        assert trio.run(main) == b"r"
        assert readiness.streak == 0
    finally:
        writer.join()
        os.close(read_fd)
        os.close(write_fd)


class RecordingPoller:
    """A real ``select.poll`` that remembers the timeout of every ``poll``. Given a pipe's
    write end, it writes a request into it just before its third poll, so the request
    comes in the middle of a spin whatever the machine's speed."""

    def __init__(self, write_fd: int | None = None) -> None:
        self.poller = select.poll()
        self.timeouts: list[int] = []
        self.write_fd = write_fd

    def register(self, fd: int, events: int) -> None:
        self.poller.register(fd, events)

    def unregister(self, fd: int) -> None:
        self.poller.unregister(fd)

    def poll(self, timeout: int):
        self.timeouts.append(timeout)
        if len(self.timeouts) == 3 and self.write_fd is not None:
            os.write(self.write_fd, b"r")
        return self.poller.poll(timeout)


def test_a_request_that_comes_during_the_spin_is_taken_without_sleeping():
    readiness = FuseReadiness(block_ms=1000, spin_ns=10_000_000_000)
    read_fd, write_fd = os.pipe()
    readiness._poller = poller = RecordingPoller(write_fd)
    try:
        assert readiness._ready(read_fd)
        assert poller.timeouts == [0, 0, 0]
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_when_nothing_comes_during_the_spin_the_wait_sleeps_once():
    readiness = FuseReadiness(block_ms=1, spin_ns=2_000_000)
    readiness._poller = poller = RecordingPoller()
    read_fd, write_fd = os.pipe()
    try:
        start = time.monotonic_ns()
        assert not readiness._ready(read_fd)
        assert time.monotonic_ns() - start >= 3_000_000  # the whole spin, then the sleep
        assert set(poller.timeouts[:-1]) == {0} and poller.timeouts[-1] == 1
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_the_runnable_count_agrees_with_trio_statistics_between_batches():
    readiness = FuseReadiness()

    async def main():
        async with trio.open_nursery() as nursery:
            for expected in range(4):
                assert readiness.runnable_tasks() == expected
                assert trio.lowlevel.current_statistics().tasks_runnable == expected
                nursery.start_soon(trio.sleep, 0)
        assert readiness.runnable_tasks() == 0

    trio.run(main)


def test_a_task_waiting_later_in_the_same_batch_counts_as_runnable():
    """trio runs a batch from a local list, so its statistics (trio 0.35) call a task that
    waits later in the running batch not runnable. A worker that believed it would sit in
    ``poll`` while that task (the handler it had just yielded from) was ready."""
    readiness = FuseReadiness()
    seen = []

    async def look():
        seen.append(readiness.nothing_else_to_run())

    async def main():
        readiness.runnable_tasks()  # adds the counting instrument to this run; it is exact
        await trio.testing.wait_all_tasks_blocked()  # once trio's start-up tasks have run
        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)  # both runnable from this step on: one batch
            nursery.start_soon(look)

    for _ in range(20):  # trio orders each batch at random: both orders, surely
        seen.clear()
        trio.run(main)
        assert sorted(seen) == [False, True]  # the first one sees the other waiting
