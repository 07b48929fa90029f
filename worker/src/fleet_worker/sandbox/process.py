"""The host's handle on a REPL process: spawning it, its output pipe, its stderr, its end."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
import termios
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import structlog

from fleet_worker.sandbox.cgroups import Cgroup
from fleet_worker.sandbox.jail import (
    DRIVER_FD_PLACEHOLDER,
    OUTPUT_FD_PLACEHOLDER,
    SECCOMP_FD_PLACEHOLDER,
    LaunchSpec,
)
from fleet_worker.sandbox.syscalls import filter_fd

log = structlog.get_logger(__name__)
STDERR_TAIL_BYTES = 16 * 1024
REAP_TIMEOUT_SECONDS = 5.0
READ_CHUNK = 64 * 1024
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"

# bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that forked bwrap
# exits, not the process; a REPL forked from a short-lived worker thread would be killed with it.
# So every REPL is forked from this single thread, which lives as long as the interpreter.
SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-sandbox-spawn")


def has_exited(proc: subprocess.Popen[bytes]) -> bool:
    """True once the process exited, without reaping it: a zombie's pid cannot be reused."""
    if proc.returncode is not None:
        return True
    try:
        status = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return status is not None


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the REPL's whole process group (bwrap or, unisolated, the driver and children)."""
    if proc.returncode is not None:
        return  # already reaped: the pid may belong to another process by now
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Collect an exited (or killed) REPL and close our ends of its pipes."""
    try:
        proc.wait(timeout=REAP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        log.error("sandbox.reap_timeout", pid=proc.pid)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


# Run as root just long enough to join the REPL's cgroup(s), then drop to the sandbox's uid with
# util-linux's setpriv and exec bwrap: everything bwrap starts is born inside the cgroup. The
# shell is single-threaded and writes `0` (itself) to each join file (see Cgroup.join_files).
JOIN_CGROUP = 'IFS=:; for f in $FLEET_CGROUP_JOIN; do echo 0 > "$f" || exit 125; done; exec "$@"'


def popen(launch: LaunchSpec, output_fd: int, cgroup: Cgroup | None) -> subprocess.Popen[bytes]:
    """Fork one REPL (called on the spawner thread only); `output_fd` is handed to it as is."""
    seccomp_fd = filter_fd(launch.seccomp) if launch.seccomp is not None else None
    # Its own open file for each jail: bwrap reads it to the end.
    driver_fd = os.open(launch.driver, os.O_RDONLY | os.O_CLOEXEC) if launch.driver is not None else None
    fds = {
        OUTPUT_FD_PLACEHOLDER: str(output_fd),
        SECCOMP_FD_PLACEHOLDER: str(seccomp_fd),
        DRIVER_FD_PLACEHOLDER: str(driver_fd),
    }
    argv = [fds.get(arg, arg) for arg in launch.argv]
    env = dict(launch.env)
    run_as = launch.run_as
    if cgroup is not None:
        drop = (
            []
            if run_as is None
            else [SETPRIV, f"--reuid={run_as}", f"--regid={run_as}", "--clear-groups", "--"]
        )
        argv = ["/bin/sh", "-c", JOIN_CGROUP, "fleet-sandbox", *drop, *argv]
        env["FLEET_CGROUP_JOIN"] = ":".join(str(path) for path in cgroup.join_files)
        run_as = None  # setpriv drops, after the cgroup is joined
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            env=env,
            cwd=launch.cwd,
            close_fds=True,
            pass_fds=tuple(fd for fd in (output_fd, seccomp_fd, driver_fd) if fd is not None),
            # Its own process group, so a kill reaches everything the cell started.
            start_new_session=True,
            user=run_as,
            group=run_as,
            extra_groups=[] if run_as is not None else None,
        )
    finally:
        for fd in (seccomp_fd, driver_fd):
            if fd is not None:
                os.close(fd)


def host_pid(root: int, ns_pid: int) -> int | None:
    """The host pid of the process under `root` whose pid in its own namespace is `ns_pid`.
    Looked for in `root` and its children first (the supervisor is bwrap's only child, or `root`
    itself unisolated), which spares each REPL start a scan of every process on the host."""
    near = [root, *children(root)]
    found = with_ns_pid(near, ns_pid)
    return found if found is not None else with_ns_pid(sorted(descendants(root) - set(near)), ns_pid)


def with_ns_pid(pids: list[int], ns_pid: int) -> int | None:
    """The first of `pids` whose pid in its own (innermost) namespace is `ns_pid`."""
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and int(line.split()[-1]) == ns_pid:
                    return pid
    return None


def children(pid: int) -> list[int]:
    """The direct children of a process (none where the kernel does not list them)."""
    try:
        return [int(word) for word in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(entry.path, "stat").read_bytes().rsplit(b")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def process_state(pid: int) -> str:
    """The one-letter state of a host process (`T` stopped, `t` traced), `?` when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


class StderrTail:
    """Drains a REPL's stderr on a daemon thread, keeping the last few KiB for crash messages."""

    def __init__(self, stream: IO[bytes], limit: int = STDERR_TAIL_BYTES) -> None:
        self._limit = limit
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._drain, args=(stream,), name="fleet-sandbox-stderr", daemon=True
        )
        self._thread.start()

    def _drain(self, stream: IO[bytes]) -> None:
        try:
            while chunk := stream.read(4096):
                with self._lock:
                    self._chunks.append(chunk)
                    self._size += len(chunk)
                    while self._size - len(self._chunks[0]) >= self._limit:
                        self._size -= len(self._chunks.popleft())
        except (OSError, ValueError):
            pass
        finally:
            stream.close()

    def text(self, wait_seconds: float = 0.0) -> str:
        """The retained tail, after waiting up to `wait_seconds` for the stream to reach EOF."""
        if wait_seconds > 0:
            self._thread.join(wait_seconds)
        with self._lock:
            data = b"".join(self._chunks)[-self._limit :]
        return data.decode("utf-8", errors="replace").strip()


class OutputCapture:
    """The cells' stdout and stderr, read on the host from the REPL's output pipe.

    The cap is the host's: whatever the cell does to its own streams, at most `max_chars`
    characters of a cell's output are kept, the rest is only counted. What a cell printed before
    it was killed is still here. Bytes are decoded as UTF-8 with invalid sequences replaced."""

    def __init__(self, read_fd: int) -> None:
        self._fd = read_fd
        self._lock = threading.Lock()
        self._kept = bytearray()
        self._room = 0
        self._dropped = 0
        self._wake_r, self._wake_w = os.pipe()  # take() wakes the reader: "is the pipe empty?"
        self._synced = threading.Event()
        self._closed = threading.Event()
        self._busy = False  # between "the pipe is readable" and "what was read is kept"
        self._thread = threading.Thread(target=self._drain, name="fleet-sandbox-output", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        syncing = False
        try:
            while True:
                ready = {fd for fd, _event in poller.poll(0 if syncing else -1)}
                self._busy = self._fd in ready
                if self._wake_r in ready:
                    os.read(self._wake_r, 64)
                    syncing = True
                if self._fd not in ready:
                    if syncing:  # nothing left to read: everything written so far is here
                        syncing = False
                        self._synced.set()
                    continue
                chunk = os.read(self._fd, READ_CHUNK)
                if not chunk:
                    return
                with self._lock:
                    piece = chunk[: max(0, self._room - len(self._kept))]
                    self._kept += piece
                    self._dropped += len(chunk) - len(piece)
                self._busy = False
        except OSError:
            return
        finally:
            os.close(self._fd)
            self._closed.set()
            self._synced.set()

    def _pending(self) -> bool:
        """Bytes in the pipe that the reader has not taken yet (the common answer: none)."""
        buffer = bytearray(4)
        try:
            fcntl.ioctl(self._fd, termios.FIONREAD, buffer)
        except OSError:
            return True  # cannot tell: ask the reader
        return int.from_bytes(buffer, sys.byteorder) > 0

    def close(self) -> None:
        """After the REPL is gone (its pipe then ends, and the reader with it)."""
        self._thread.join(REAP_TIMEOUT_SECONDS)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def begin(self, max_chars: int) -> None:
        """A new cell: forget what came before (a leftover of the last one), cap this one."""
        with self._lock:
            self._kept.clear()
            self._dropped = 0
            self._room = max_chars * 4  # a UTF-8 character is at most four bytes

    def take(self, max_chars: int, wait_seconds: float = 1.0) -> tuple[str, bool]:
        """The cell's output and whether any was cut. What the cell wrote before its result was
        sent is in the pipe by now: wait (briefly) until the reader has drained it."""
        if not self._closed.is_set() and (self._busy or self._pending()):
            self._synced.clear()
            os.write(self._wake_w, b"?")  # open until close(), which only follows the reader's end
            self._synced.wait(wait_seconds)
        with self._lock:
            text = self._kept.decode("utf-8", errors="replace")
            truncated = self._dropped > 0 or len(text) > max_chars
            self._kept.clear()
            self._room = 0
        return text[:max_chars], truncated
