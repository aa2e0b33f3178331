"""What the daemon runs while it is mounted: pyfuse3's request loop and, beside it, the
one-second tick (metadata to disk), the settling of unsynced closed files, the signal
handler that unmounts cleanly, and the readahead tuned once FUSE_INIT is answered.

Each task is its own coroutine so that the tests can run one of them alone against the
objects ``mount.prepare`` makes.
"""

from __future__ import annotations

import logging
import signal
from typing import Callable

import pyfuse3
import trio

from tierfs.backends.volume import syncfs
from tierfs.fs import fuseloop
from tierfs.fs.blockio import UNSYNCED_FILES_MAX, BlockIO
from tierfs.fs.errors import FsError
from tierfs.fs.kernel_mount import abort_connection, mount_device, tune_readahead
from tierfs.fs.namespace import Namespace
from tierfs.fs.operations import Operations

log = logging.getLogger(__name__)

TICK_SECONDS = 1.0
SIGNAL_FLUSH_SECONDS = 30.0
WRITERS_POLL_SECONDS = 0.2
INVALIDATIONS_GRACE_SECONDS = 2.0


async def serve(ops: Operations, blockio: BlockIO, ns: Namespace, mountpoint: str, *,
                read_only: bool = False) -> None:
    """Serve requests until unmounted. On a read-only mount the replication monitor does
    not run: it would drop and copy replicas, and whoever mounts suspect storage ``ro``
    expects its volumes left as they are (reads still fail over to a good replica)."""
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        nursery.start_soon(tick, blockio, ns)
        nursery.start_soon(settle_unsynced, blockio)
        nursery.start_soon(_signals, mountpoint, ops.writers_open)
        nursery.start_soon(_tune_after_init, ops, mountpoint)
        if read_only:
            log.info("read-only mount: bad or missing replicas are not repaired")
        else:
            ops.on_replication_change = ops.replication.replication_may_change
            nursery.start_soon(ops.replication.run)
        fuseloop.install()
        await pyfuse3.main()
        await _end_invalidations(ops, mountpoint)
        nursery.cancel_scope.cancel()


async def _end_invalidations(ops: Operations, mountpoint: str) -> None:
    """The session has ended (a signal stopped it with files open for writing): a kernel
    cache invalidation still under way waits in its worker thread for writebacks that
    nothing will answer any more (a writer meeting a full volume), and the daemon could
    not exit, not even on SIGKILL, until its connection was aborted. Give them a moment,
    then abort the connection through fusectl, which fails those writebacks."""
    with trio.move_on_after(INVALIDATIONS_GRACE_SECONDS):
        while ops.invalidating:
            await trio.sleep(0.05)
    if not ops.invalidating:
        return
    log.warning("%d kernel cache invalidation(s) wait for writebacks nothing will answer: "
                "aborting the FUSE connection of %s", len(ops.invalidating), mountpoint)
    problem = abort_connection(mount_device(mountpoint))
    if problem:
        log.warning("could not abort the FUSE connection of %s: %s; abort it by hand "
                    "(README, fusectl)", mountpoint, problem)


async def _tune_after_init(ops: Operations, mountpoint: str) -> None:
    """The kernel recomputes readahead when FUSE_INIT is answered, so tune after that."""
    await ops.initialized.wait()
    await trio.to_thread.run_sync(tune_readahead, mountpoint)


class _RetriedStep:
    """One step of the tick, retried every second: a failure is logged once per distinct
    reason (with its traceback when it is a bug), and again when the step works."""

    def __init__(self, what: str):
        self.what = what
        self.failing: str | None = None

    def failed(self, exc: Exception) -> None:
        """Call from the except clause (the traceback is the current exception's)."""
        if str(exc) != self.failing:
            if isinstance(exc, FsError):
                log.error("%s (retried every second): %s", self.what, exc)
            else:
                log.exception("BUG: %s (retried every second)", self.what)
        self.failing = str(exc)

    def worked(self) -> None:
        if self.failing is not None:
            log.info("%s: done again", self.what)
        self.failing = None


async def tick(blockio: BlockIO, ns: Namespace) -> None:
    """Metadata reaches disk within about a second (DESIGN.md section 3). When it cannot
    (the namespace's disk is full), the open files keep it in memory and the next tick
    tries again: the mount goes on, and fsync reports the error to whoever asks for
    durability. The sync runs even when an open file could not be persisted: what
    everything else committed (creates, renames, other files' sizes) must still reach
    disk, and dropped blocks are deleted only after a sync."""
    persist = _RetriedStep("metadata of open files not persisted")
    sync = _RetriedStep("namespace not synced")
    while True:
        await trio.sleep(TICK_SECONDS)
        try:
            blockio.persist_all()
        except Exception as exc:  # noqa: BLE001 - ending the daemon loses what open files hold
            persist.failed(exc)
        else:
            persist.worked()
        try:
            await blockio.sync_namespace()
        except Exception as exc:  # noqa: BLE001 - as above
            sync.failed(exc)
        else:
            sync.worked()
        if ns.space_reserve is not None:  # after a removal used it, once there is room
            ns.space_reserve.refill()


async def settle_unsynced(blockio: BlockIO) -> None:
    """Beyond UNSYNCED_FILES_MAX closed files with unsynced blocks, sync the volumes and
    forget those blocks (``BlockIO.settle_unsynced``). A task of its own beside the tick:
    a syncfs after a large copy may take long, and metadata must not wait for it."""
    while True:
        await trio.sleep(TICK_SECONDS)
        if blockio.closed_unsynced_files() > UNSYNCED_FILES_MAX:
            await blockio.settle_unsynced()


async def _signals(mountpoint: str, writers_open: Callable[[], int]) -> None:
    """SIGINT/SIGTERM unmount cleanly, once no file is open for writing: a process in the
    middle of writing a file would otherwise go on with write() calls that succeed into a
    page cache nobody writes back, and lose them without a word (as ``umount`` refuses a
    busy mount; readers do not hold it up). The daemon serves on meanwhile. Then, with
    writeback caching, the kernel may still hold data that write() accepted: it is flushed
    (syncfs of our own mount, from a worker thread, while this loop keeps serving the
    writes it causes), and the daemon stops. Another signal stops the waiting at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            writers = writers_open()
            if writers:
                log.warning("signal %d: %d file(s) open for writing; unmounting when they "
                            "are closed (another signal: at once)", signum, writers)
                if not await _until_signal(signals, _writers_closed, writers_open):
                    log.warning("second signal: unmounting with files open for writing")
                    pyfuse3.terminate()
                    return
            log.info("signal %d: unmounting (cached writes flushed first)", signum)
            with trio.move_on_after(SIGNAL_FLUSH_SECONDS):
                await _until_signal(signals, _flush, mountpoint)
            pyfuse3.terminate()
            return


async def _until_signal(signals, fn, *args) -> bool:
    """Run ``fn(*args)`` until it returns (True) or another signal arrives (False)."""
    finished = False
    async with trio.open_nursery() as nursery:
        async def run_then_cancel() -> None:
            nonlocal finished
            await fn(*args)
            finished = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(run_then_cancel)
        async for _ in signals:
            break
        nursery.cancel_scope.cancel()
    return finished


async def _flush(mountpoint: str) -> None:
    await trio.to_thread.run_sync(_syncfs, mountpoint, abandon_on_cancel=True)


async def _writers_closed(writers_open: Callable[[], int]) -> None:
    while writers_open():
        await trio.sleep(WRITERS_POLL_SECONDS)


def _syncfs(mountpoint: str) -> None:
    try:
        syncfs(mountpoint)
    except OSError as exc:
        log.warning("syncfs of %s failed: %s", mountpoint, exc.strerror or exc)
