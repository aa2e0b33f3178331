"""A cheaper turn of pyfuse3's request loop.

pyfuse3's worker tasks take turns waiting on the FUSE device: each request starts with
``async with read_lock: await trio.lowlevel.wait_readable(fd)``. With trio's own parts,
every request costs trips through trio's scheduler: trio's ``Lock`` yields on every
acquire, even when nobody holds it; its release wakes the next worker, which takes over
the device while the releasing one handles the request and then parks; and
``wait_readable`` registers the fd with epoll, parks the task, runs the scheduler and
unregisters the fd again. For a request whose handler does little (GETATTR, LOOKUP,
RELEASE, the GETXATTR the kernel sends before every ``write()``), those trips were most of
the daemon's CPU: a trivial request cost 37 µs with them and 25 µs without (GETXATTR
round trips on a one-file pyfuse3 filesystem); creates on a tierfs mount went from
1,500-3,100 to 3,700-5,400 a second.

``install`` gives pyfuse3 trio with two replacements:

- ``ReadLock``: taken without yielding when it is free, released without waking anyone,
  and handed to a parked worker only when its last holder yields or ends.
- ``FuseReadiness.wait_readable``: when no other task is runnable and no worker thread is
  running, it asks the device directly and returns without a scheduler pass when a request
  is there. It first polls without sleeping for up to ``SPIN_NS``, then blocks up to a
  millisecond. Otherwise, and after every ``MAX_STREAK`` direct returns, it is trio's own
  ``wait_readable``.

Why that is safe: while the daemon spins or sits in ``poll`` nothing else in it could run
anyway (no runnable task, no thread whose result is due); what can wait a little is what
arrives by other file descriptors (signals, timers): by at most ``SPIN_NS`` plus
``BLOCK_MS`` per wait, and ``MAX_STREAK`` requests. pyfuse3 finds its async library
through its module attribute ``trio`` (``pyfuse3.asyncio`` swaps it the same way);
tierfs's own code uses trio unchanged.
"""

from __future__ import annotations

import logging
import os
import select
import time

import pyfuse3
import trio

log = logging.getLogger(__name__)

BLOCK_MS = 1
"""How long the direct wait blocks for the next request before handing over to trio.
A synchronous caller's next request comes 10-30 µs after the reply; when none comes, the
daemon has nothing else to run (that was checked), so the blocking part of the wait costs
no work."""

SPIN_NS = 50_000
"""How long the direct wait polls for the next request without sleeping before it blocks.
A synchronous caller's next request comes 10-30 µs after the reply. A daemon that sleeps
meanwhile must be woken for it, and so must its CPU if that went idle: on a VM whose idle
CPUs halt, each wake-up costs tens of microseconds, several times the work of a small
request. Measured on the 2-core VM of the README's figures (5,000-10,000 operations in a
loop, spinning against not): creates 2,700-2,900 → 4,200-5,200/s, renames 2,600-2,800 →
4,000-5,200/s, 4 KiB random writes 8,900 → 17,500 IOPS, 100-byte appends 16,700 →
48,500/s, with less daemon CPU per operation (the wake-ups cost more than the spin). 20 µs
gained less, 100 µs and 1 ms no more. The price is at most ``SPIN_NS`` of CPU after a
request that no other follows soon (measured: 2,000 lookups 0.6 ms apart took 70 ms of
daemon CPU without the spin and 160 ms with it); an idle mount does not spin at all. Each
turn of the spin offers the CPU to other runnable threads (``sched_yield``)."""

MAX_STREAK = 32
"""Direct returns in a row before one full scheduler pass, so that signals and timers,
which only trio's epoll sees, are served even under an endless stream of requests."""


class ReadLock:
    """The right to wait on the FUSE device, which pyfuse3's workers take in turn.

    Taking a free lock does not yield. Releasing it wakes nobody: the worker that releases
    it goes on to read its request, handle it and, for most requests, come straight back
    without ever yielding. A parked worker woken at every release (trio's lock, and this
    one until it changed) only cost a task switch per request and parked again: a third
    of the daemon's CPU on a stream of creates. If the releasing worker does yield before it
    is back (its handler waits for a thread or a lock, or it ends), ``hand_over``, which the
    loop calls after every task step, gives the lock to the longest waiter. So while any
    worker is blocked, another one waits on the device. A waiter cancelled while parked
    never holds the lock.
    """

    def __init__(self) -> None:
        self._held = False
        self._waiters = trio.lowlevel.ParkingLot()

    @property
    def locked(self) -> bool:
        return self._held

    async def __aenter__(self) -> None:
        if self._held:
            await self._waiters.park()  # woken by hand_over as the new holder
        else:
            self._held = True

    async def __aexit__(self, *exc_info) -> None:
        self._held = False

    def hand_over(self) -> None:
        """Give a free lock to the longest waiter: its last holder has yielded or ended."""
        if not self._held and self._waiters:
            self._held = True
            self._waiters.unpark()


class HandOverAfterEachStep(trio.abc.Instrument):
    """Calls ``ReadLock.hand_over`` whenever a task gives control back to the scheduler.
    Between a worker's release and its next acquire no other task runs, so a step that
    ends with the lock free and waiters parked is exactly a holder that yielded or ended."""

    def __init__(self, lock: ReadLock) -> None:
        self.lock = lock

    def after_task_step(self, task) -> None:
        self.lock.hand_over()


class RunnableTasks(trio.abc.Instrument):
    """How many tasks are runnable but have not yet run: each scheduling counts one up,
    each task step one down.

    trio's own count (``current_statistics().tasks_runnable``, its run queue) misses the
    tasks of the batch it is running: it empties the queue into a local list before it
    runs them. A worker that asked it while the handler it had just yielded from waited
    later in the same batch saw "nothing else to run" and sat in ``poll`` for
    ``BLOCK_MS`` while that handler was ready (a handler's lock yields even when free,
    and trio orders each batch at random). An ``fdatasync`` with nothing to write took
    0.96-0.99 ms then, 0.40-0.46 ms with this count; a 4 KiB ``dd oflag=dsync`` write 1.6
    ms, then 1.1 (three alternating runs on two mounts).

    Tasks already runnable when the instrument is added are counted from the run queue;
    one of the running batch that is missed makes the count low until the next time no
    task is runnable (it never goes below 0), which can only cost such a wait again.
    """

    def __init__(self, already_runnable: int = 0) -> None:
        self.count = already_runnable

    def task_scheduled(self, task) -> None:
        self.count += 1

    def before_task_step(self, task) -> None:
        if self.count:
            self.count -= 1


class FuseReadiness:
    """``wait_readable`` for the FUSE device, without a scheduler pass when nothing else
    in the daemon could use one (see the module docstring)."""

    def __init__(self, block_ms: int = BLOCK_MS, max_streak: int = MAX_STREAK,
                 spin_ns: int = SPIN_NS) -> None:
        self.block_ms = block_ms
        self.spin_ns = spin_ns
        self.max_streak = max_streak
        self.streak = 0
        self._poller = select.poll()
        self._polled_fd: int | None = None
        self._runner = None
        self._runnable: RunnableTasks | None = None

    async def wait_readable(self, fd: int) -> None:
        if self.streak < self.max_streak and self.nothing_else_to_run() and self._ready(fd):
            self.streak += 1
            return
        self.streak = 0
        await trio.lowlevel.wait_readable(fd)

    def nothing_else_to_run(self) -> bool:
        """No task but the caller is runnable and no worker thread's result is due."""
        if trio.to_thread.current_default_thread_limiter().borrowed_tokens:
            return False
        return self.runnable_tasks() == 0

    def runnable_tasks(self) -> int:
        """Tasks other than the caller that are runnable, counted by a ``RunnableTasks``
        instrument that the first call adds to the running trio loop."""
        runner = _current_runner()
        if runner is not self._runner:
            self._runner = runner
            self._runnable = RunnableTasks(trio.lowlevel.current_statistics().tasks_runnable)
            trio.lowlevel.add_instrument(self._runnable)
        return self._runnable.count

    def _ready(self, fd: int) -> bool:
        """Whether a request is waiting: polled for without sleeping up to ``spin_ns``,
        then blocking up to ``block_ms``. Errors and hang-ups are left to trio's wait,
        which reports them as before."""
        if fd != self._polled_fd:
            if self._polled_fd is not None:
                self._poller.unregister(self._polled_fd)
            self._poller.register(fd, select.POLLIN)
            self._polled_fd = fd
        deadline = time.monotonic_ns() + self.spin_ns
        while not (events := self._poller.poll(0)):
            if time.monotonic_ns() >= deadline:
                events = self._poller.poll(self.block_ms)
                break
            os.sched_yield()
        return bool(events) and events[0][1] == select.POLLIN


def _current_runner():
    """The running trio loop's identity: a ``FuseReadiness`` used in a new ``trio.run``
    (tests run many) adds its instrument to that one."""
    return trio.lowlevel.current_root_task()


class _Lowlevel:
    """``trio.lowlevel`` as pyfuse3 sees it: all of it, but ``wait_readable``."""

    def __init__(self, readiness: FuseReadiness) -> None:
        self.wait_readable = readiness.wait_readable

    def __getattr__(self, name: str):
        return getattr(trio.lowlevel, name)


class _TrioForPyfuse3:
    """trio as pyfuse3 sees it: everything from trio, but the loop's lock and wait."""

    def __init__(self, readiness: FuseReadiness, lock: ReadLock) -> None:
        self.lowlevel = _Lowlevel(readiness)
        self._lock = lock

    def Lock(self) -> ReadLock:  # pyfuse3 makes its read lock with trio.Lock()
        return self._lock

    def __getattr__(self, name: str):
        return getattr(trio, name)


def install() -> tuple[FuseReadiness, ReadLock]:
    """Give pyfuse3's request loop the lighter lock and wait. Call it inside ``trio.run``,
    before ``pyfuse3.main``: the lock's hand-over hooks into the running scheduler."""
    readiness, lock = FuseReadiness(), ReadLock()
    trio.lowlevel.add_instrument(HandOverAfterEachStep(lock))
    pyfuse3.trio = _TrioForPyfuse3(readiness, lock)
    return readiness, lock
