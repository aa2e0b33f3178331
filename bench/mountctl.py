"""Making, mounting and unmounting the tierfs under test, and watching its daemon's memory.

The daemon runs in the foreground (``-f``) as a child of the harness, so its pid is the
Popen pid, its output goes to a log file the harness can show when something goes wrong, and
the harness decides when it stops. It runs in its own session so that a Ctrl-C in the
terminal reaches only the harness, which then unmounts in order instead of racing the
daemon's own shutdown.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass


class SetupError(Exception):
    """The benchmark cannot start or go on (the message says what to do)."""


def find_command(name: str) -> str:
    """The path of a console script, preferring the one installed beside this Python."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found is None:
        raise SetupError(f"{name} not found beside {sys.executable} or on PATH "
                         "(use --target-only DIR to benchmark a plain directory)")
    return found


def mount_table() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount this process can see."""
    table = []
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            table.append((point, fields[2]))
    return table


def fs_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (its innermost mount)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    for point, point_kind in mount_table():
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, point_kind
    return kind


def is_mounted(path: str) -> bool:
    """Whether ``path`` is a mount point, even one whose daemon has died.

    ``os.path.ismount`` answers False for a dead FUSE mount (its lstat fails with ENOTCONN),
    but the mount is still there and must still be unmounted.
    """
    path = os.path.realpath(path)
    return any(point == path for point, _ in mount_table())


def close_own_files_under(directory: str) -> None:
    """Closes this process's descriptors of files under ``directory``.

    A Ctrl-C can land between an ``os.open`` and its ``os.close`` in a workload and leak the
    descriptor, and one open file keeps the mount busy so that fusermount3 refuses to unmount.
    """
    prefix = os.path.realpath(directory).rstrip("/") + "/"
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(prefix):
            try:
                os.close(int(name))
            except OSError:
                pass


class TierfsMount:
    """A tierfs made fresh with ``tierfs mkfs`` and mounted by a foreground daemon.

    ``start`` makes and mounts it; ``unmount`` (safe to call at any point, and again) unmounts
    it and waits for the daemon to exit, and ``unmounted`` then says whether it worked.
    """

    program = "mount.tierfs"

    def __init__(self, data: str, mnt: str, log_path: str, mkfs_options: list[str],
                 timeout: float = 30.0):
        self.data = data
        self.mnt = mnt
        self.log_path = log_path
        self.mkfs_options = mkfs_options
        self.timeout = timeout
        self.process: subprocess.Popen | None = None
        self.unmounted = False
        self.mkfs_output = ""
        self._reported = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exit_status(self) -> int | None:
        """The daemon's exit status; None while it runs or if it never started."""
        return None if self.process is None else self.process.poll()

    def start(self) -> None:
        """Makes the filesystem, starts the daemon and waits until the mount answers.

        On failure nothing is left running; call ``unmount`` in any case afterwards.
        """
        self._make()
        os.makedirs(self.mnt, exist_ok=True)
        self._start()
        try:
            self._wait_for_mount()
        except BaseException:
            self.unmount()
            raise

    def check(self) -> None:
        """Raises SetupError, with the daemon's last words, if the mount has stopped working.

        A dying daemon closes its FUSE connection before it can be reaped, so a mount that no
        longer answers gets a few seconds for the exit status to appear.
        """
        code = self.process.poll()
        if code is None and not os.path.ismount(self.mnt):
            try:
                code = self.process.wait(5.0)
            except subprocess.TimeoutExpired:
                self._reported = True
                raise SetupError(f"{self.mnt} no longer answers although {self.program} "
                                 f"(pid {self.pid}) is running\n{self.log_tail()}") from None
        if code is not None:
            self._reported = True
            raise SetupError(f"{self.program} exited with status {code}\n{self.log_tail()}")

    def kill(self, why: str) -> None:
        """Kills a wedged daemon; the kernel then fails every call waiting on it."""
        _say(f"killing {self.program} (pid {self.pid}): {why}")
        self.process.kill()

    def log_tail(self, lines: int = 30) -> str:
        """The end of the daemon's output, indented, for error messages."""
        try:
            with open(self.log_path, errors="replace") as log:
                tail = log.readlines()[-lines:]
        except OSError as e:
            return f"    (no daemon log: {e})"
        if not tail:
            return "    (the daemon printed nothing)"
        return "".join("    | " + line for line in tail).rstrip("\n")

    def unmount(self) -> None:
        """Unmounts with fusermount3 and waits for the daemon; signals only as a last resort."""
        if self.unmounted:
            return
        if self.process is None:
            self.unmounted = not is_mounted(self.mnt)
            return
        close_own_files_under(self.mnt)
        if is_mounted(self.mnt):
            self._fusermount("-u")
        if is_mounted(self.mnt):
            _say(f"the mount is still there; asking {self.program} to unmount with SIGTERM")
        elif self._wait(30.0):
            self._finish()
            return
        else:
            _say(f"{self.program} still running 30 s after the unmount; sending SIGTERM")
        self.process.terminate()
        if not self._wait(10.0):
            _say(f"{self.program} ignored SIGTERM; sending SIGKILL")
            self.process.kill()
            self._wait(10.0)
        self._finish()

    def _finish(self) -> None:
        """Detaches a mount left behind by a dead daemon and records the outcome."""
        if is_mounted(self.mnt):
            self._fusermount("-u", "-z")
        self.unmounted = not is_mounted(self.mnt)
        if self.process.returncode not in (0, None) and not self._reported:
            _say(f"{self.program} exited with status {self.process.returncode}\n{self.log_tail()}")

    def _make(self) -> None:
        command = [find_command("tierfs"), "mkfs", self.data, *self.mkfs_options]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SetupError(f"{' '.join(command)} failed with status {done.returncode}:\n"
                             f"{done.stdout}{done.stderr}".rstrip())
        self.mkfs_output = done.stdout

    def _command(self) -> list[str]:
        return [find_command("mount.tierfs"), self.data, self.mnt, "-f"]

    def _start(self) -> None:
        command = self._command()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_for_mount(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not os.path.ismount(self.mnt):
            code = self.process.poll()
            if code is not None:
                self._reported = True
                raise SetupError(f"{self.program} exited with status {code} before mounting "
                                 f"{self.mnt}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self._reported = True
                raise SetupError(f"{self.mnt} not mounted {self.timeout:.0f} s after starting "
                                 f"{self.program} (pid {self.pid}):\n{self.log_tail()}")
            time.sleep(0.05)

    def _fusermount(self, *options: str) -> None:
        """Runs fusermount3, retrying a few times while the mount is still busy."""
        for attempt in range(5):
            done = subprocess.run(["fusermount3", *options, self.mnt], capture_output=True,
                                  text=True, timeout=60)
            if done.returncode == 0 or not is_mounted(self.mnt):
                return
            time.sleep(1.0)
        _say(f"fusermount3 {' '.join(options)} {self.mnt}: {done.stderr.strip()}")

    def _wait(self, seconds: float) -> bool:
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            return False
        return True


class FloorMount(TierfsMount):
    """``floorfs.py`` (the least a pyfuse3 filesystem does, served as tierfs is) mounted by
    a foreground daemon, its data files in ``data``: the ``--floor`` reference."""

    program = "floorfs.py"

    def __init__(self, data: str, mnt: str, log_path: str, timeout: float = 30.0):
        super().__init__(data, mnt, log_path, [], timeout)

    def _make(self) -> None:
        os.makedirs(self.data, exist_ok=True)

    def _command(self) -> list[str]:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "floorfs.py")
        return [sys.executable, script, self.data, self.mnt]


@dataclass
class Memory:
    """The daemon's memory over a run, in kB: peak of the samples, and VmHWM at the end."""

    peak_rss_kb: int = 0
    hwm_kb: int = 0
    samples: int = 0

    @property
    def peak_kb(self) -> int:
        return max(self.peak_rss_kb, self.hwm_kb)


class RssSampler:
    """Samples a process's VmRSS from a background thread, and reads its VmHWM when stopped.

    VmHWM alone is the true peak, but sampling also works when the kernel does not report
    it, and stops a short-lived spike from going unnoticed if the process exits early.
    """

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid = pid
        self.interval = interval
        self.memory = Memory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> Memory:
        """Stops sampling and returns the figures, VmHWM read last (before the daemon exits)."""
        self._stop.set()
        self._thread.join()
        self.memory.hwm_kb = self._read().get("VmHWM", 0)
        return self.memory

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self._read().get("VmRSS")
            if rss is not None:
                self.memory.peak_rss_kb = max(self.memory.peak_rss_kb, rss)
                self.memory.samples += 1

    def _read(self) -> dict[str, int]:
        """The kB figures of /proc/PID/status (empty once the process has gone)."""
        try:
            with open(f"/proc/{self.pid}/status") as status:
                lines = status.readlines()
        except OSError:
            return {}
        figures = {}
        for line in lines:
            key, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                figures[key] = int(rest.split()[0])
        return figures


def _say(message: str) -> None:
    print(f"  !! {message}", file=sys.stderr, flush=True)

