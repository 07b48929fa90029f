"""Host side of the local sandbox: the bubblewrap jail, REPL processes and cell execution."""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog

from fleet_worker.sandbox.errors import (
    CellInterrupted,
    CellTimeout,
    FrameTimeout,
    FrameTooLarge,
    SandboxCrashed,
    SandboxError,
    SandboxUnavailable,
)
from fleet_worker.sandbox.protocol import encode_frame, read_frame, write_all

log = structlog.get_logger(__name__)

# The uid/gid code runs as inside the jail, and on root hosts the real host uid bwrap runs as.
SANDBOX_UID = 65534
SANDBOX_GID = 65534
WORKSPACE_MOUNT = "/workspace"
DRIVER_MOUNT = "/opt/fleet/repl_main.py"
WORKSPACE_DIRS = ("memory", "skills", "attachments", "artifacts")
DRIVER_SOURCE = Path(__file__).with_name("repl_main.py")
# Top-level host dirs that hold the OS (merged-usr hosts make all but /usr symlinks into it).
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
RESERVED_NAMES = frozenset({"SUBMIT", "__builtins__"})
STDERR_TAIL_BYTES = 16 * 1024
SHUTDOWN_GRACE_SECONDS = 2.0
REAP_TIMEOUT_SECONDS = 5.0

# bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that forked bwrap
# exits, not the process; a REPL forked from a short-lived worker thread would be killed with it.
# So every REPL is forked from this single thread, which lives as long as the interpreter.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-sandbox-spawn")


@dataclass(frozen=True)
class LocalSandboxConfig:
    """Settings of the local sandbox (`sandbox.local.*` in the app config)."""

    allow_unisolated: bool = False
    python: str = "auto"
    cell_timeout_seconds: float = 60.0
    memory_mb: int = 1024
    max_processes: int = 64
    max_file_mb: int = 64
    startup_timeout_seconds: float = 10.0


@dataclass(frozen=True)
class CellError:
    """An exception raised by a cell, as the REPL reported it."""

    type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class CellResult:
    """What one cell produced: captured output, plus SUBMIT's values or the cell's error."""

    stdout: str
    truncated: bool
    final: dict[str, Any] | None
    error: CellError | None


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one REPL process."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    # Host uid (and gid) to drop to before exec; None keeps the worker's own identity.
    run_as: int | None = None


def resolve_python(cfg: LocalSandboxConfig) -> str:
    """The interpreter that runs the REPL: the system python3, else this Python's base install."""
    if cfg.python != "auto":
        return cfg.python
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    # Not the venv's python: its site-packages must not ride along into the jail.
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        candidate = Path(sys.base_prefix) / "bin" / name
        if candidate.exists():
            return os.path.realpath(candidate)
    return os.path.realpath(sys.executable)


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment of a REPL; nothing of the worker's (API keys included) leaks in."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def driver_args(cfg: LocalSandboxConfig, driver: str) -> list[str]:
    """Interpreter flags, driver path and resource limits (-I ignores PYTHON* env, hence -B)."""
    return [
        "-I",
        "-S",
        "-B",
        driver,
        "--memory-mb",
        str(cfg.memory_mb),
        "--max-processes",
        str(cfg.max_processes),
        "--max-file-mb",
        str(cfg.max_file_mb),
    ]


def is_system_path(path: str) -> bool:
    """True for paths under /usr or the /bin, /lib... dirs that the jail always mounts."""
    parts = Path(path).parts
    return len(parts) > 1 and parts[0] == "/" and parts[1] in SYSTEM_DIRS


def python_mount(python: str) -> tuple[str, str | None]:
    """The interpreter path to exec in the jail, and its install prefix to ro-bind (if not /usr)."""
    real = os.path.realpath(python)
    if is_system_path(real):
        return (python if is_system_path(python) else real), None
    binary = Path(real)
    prefix = binary.parent.parent if binary.parent.name == "bin" else binary.parent
    if prefix == Path("/"):
        raise SandboxUnavailable(
            f"the sandbox python {real} has no install prefix of its own to mount",
            fix="set sandbox.local.python to an interpreter under /usr or in its own prefix",
        )
    return real, str(prefix)


def system_links(root: Path = Path("/")) -> list[str]:
    """Recreate /bin, /lib, /lib64... as on the host: symlinks stay symlinks, real dirs are ro."""
    args: list[str] = []
    for name in SYSTEM_DIRS[1:]:
        path = root / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), f"/{name}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{name}"]
    return args


def bwrap_command(
    cfg: LocalSandboxConfig,
    workspace: Path,
    python: str,
    driver: Path,
    *,
    bwrap: str = "bwrap",
) -> list[str]:
    """The bwrap argv for one REPL; only /usr, the interpreter and the workspace are visible."""
    executable, prefix = python_mount(python)
    argv = [
        bwrap,
        # Every namespace, network included: the jail has only its own, empty loopback.
        "--unshare-all",
        "--unshare-user",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_GID),
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ]
    for key, value in sandbox_env(WORKSPACE_MOUNT).items():
        argv += ["--setenv", key, value]
    # No /etc at all: python -I -S needs nothing from it.
    argv += ["--ro-bind", "/usr", "/usr", *system_links()]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if prefix is not None:
        argv += ["--ro-bind", prefix, prefix]
    argv += [
        "--bind",
        os.path.abspath(workspace),
        WORKSPACE_MOUNT,
        "--ro-bind",
        os.path.abspath(driver),
        DRIVER_MOUNT,
        "--chdir",
        WORKSPACE_MOUNT,
        "--",
        executable,
        *driver_args(cfg, DRIVER_MOUNT),
    ]
    return argv


def unisolated_command(cfg: LocalSandboxConfig, python: str, driver: Path) -> list[str]:
    """The argv that runs the driver as a plain subprocess, with no jail around it."""
    return [python, *driver_args(cfg, str(driver))]


def tool_params(tool: Callable[..., Any]) -> list[str]:
    """Names that positional arguments of a tool call map onto, in order."""
    try:
        signature = inspect.signature(tool)
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.kind in positional]


def call_host_tool(tools: Mapping[str, Callable[..., Any]], message: Mapping[str, Any]) -> bytes:
    """Run one tool_call on the host and encode its tool_result; tool errors go back to the cell."""
    name = message.get("name")
    kwargs = message.get("kwargs")
    tool = tools.get(name) if isinstance(name, str) else None
    reply: dict[str, Any]
    if tool is None:
        reply = {"op": "tool_result", "ok": False, "error": f"unknown tool {name!r}"}
    elif not isinstance(kwargs, dict):
        reply = {"op": "tool_result", "ok": False, "error": "tool arguments must be an object"}
    else:
        try:
            reply = {"op": "tool_result", "ok": True, "value": tool(**kwargs)}
        except Exception as exc:
            reply = {"op": "tool_result", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    try:
        return encode_frame(reply)
    except (FrameTooLarge, TypeError, ValueError) as exc:
        error = f"tool {name!r} returned a value that cannot be sent to the sandbox: {exc}"
        return encode_frame({"op": "tool_result", "ok": False, "error": error})


def parse_result(message: Mapping[str, Any]) -> CellResult:
    """Turn a result frame into a CellResult; a malformed frame means a broken REPL."""
    stdout, truncated = message.get("stdout"), message.get("truncated")
    final, error = message.get("final"), message.get("error")
    if not isinstance(stdout, str) or not isinstance(truncated, bool):
        raise SandboxCrashed("REPL sent a malformed result frame")
    if final is not None and not isinstance(final, dict):
        raise SandboxCrashed("REPL sent a non-object SUBMIT value")
    if error is not None and not isinstance(error, dict):
        raise SandboxCrashed("REPL sent a malformed cell error")
    cell_error = None
    if error is not None:
        cell_error = CellError(
            type=str(error.get("type", "Exception")),
            message=str(error.get("message", "")),
            traceback=str(error.get("traceback", "")),
        )
    return CellResult(stdout=stdout, truncated=truncated, final=final, error=cell_error)


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


def popen(launch: LaunchSpec) -> subprocess.Popen[bytes]:
    """Fork one REPL (called on the spawner thread only)."""
    return subprocess.Popen(
        list(launch.argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        env=dict(launch.env),
        cwd=launch.cwd,
        close_fds=True,
        # Its own process group, so a kill reaches everything the cell started.
        start_new_session=True,
        user=launch.run_as,
        group=launch.run_as,
        extra_groups=[] if launch.run_as is not None else None,
    )


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


class ReplSession:
    """One persistent REPL process: state survives across cells until a timeout or crash."""

    def __init__(
        self,
        launch: LaunchSpec,
        *,
        cell_timeout_seconds: float,
        startup_timeout_seconds: float,
        max_output_chars: int,
        label: str = "repl",
    ) -> None:
        self._launch = launch
        self._cell_timeout = cell_timeout_seconds
        self._startup_timeout = startup_timeout_seconds
        self._max_output_chars = max_output_chars
        self._label = label
        # One cell (or start) at a time; interrupt() and a busy shutdown() skip this lock.
        self._exec_lock = threading.RLock()
        # Guards the fields below; held only briefly, never across blocking I/O.
        self._state_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: StderrTail | None = None
        self._busy = False
        self._interrupted = False
        self._crashed: str | None = None
        self._closed = False
        self._next_id = 0

    @property
    def pid(self) -> int | None:
        """Host pid of the REPL process (bwrap's, when isolated), if one is running."""
        proc = self._proc
        return proc.pid if proc is not None else None

    def start(self) -> None:
        """Spawn the REPL and wait for its ready frame; does nothing if it is already up."""
        with self._exec_lock:
            with self._state_lock:
                self._raise_if_unusable()
                proc = self._proc
            if proc is not None:
                if not has_exited(proc):
                    return
                raise self._fail(proc, "REPL exited between cells")
            self._spawn()

    def execute(
        self,
        code: str,
        variables: Mapping[str, Any],
        tools: Mapping[str, Callable[..., Any]],
        output_fields: Sequence[str] | None,
    ) -> CellResult:
        """Run one cell; tool calls from the cell are served on this thread while it waits."""
        for name in tools:
            if not name.isidentifier() or name in RESERVED_NAMES:
                raise ValueError(f"tool name {name!r} is not a usable Python identifier")
        with self._exec_lock:
            self._next_id += 1
            request_id = self._next_id
            # Encoded up front: a too-large or unencodable request fails here, REPL untouched.
            request = encode_frame(
                {
                    "op": "execute",
                    "id": request_id,
                    "code": code,
                    "variables": dict(variables),
                    "tools": {name: tool_params(tool) for name, tool in tools.items()},
                    "output_fields": list(output_fields) if output_fields is not None else None,
                    "max_output_chars": self._max_output_chars,
                }
            )
            self.start()
            proc = self._begin_cell()
            result: CellResult | None = None
            timed_out = False
            crash: SandboxCrashed | None = None
            try:
                result = self._run_cell(proc, request, request_id, tools)
            except FrameTimeout:
                timed_out = True
            except SandboxCrashed as exc:
                crash = exc
            except BaseException:
                # A host tool raised e.g. CancelledError: the REPL still waits for its reply.
                self._end_cell()
                self._fail(proc, "a host tool call was aborted mid-cell")
                raise
            if self._end_cell():
                self._discard(proc)
                raise CellInterrupted(
                    "the cell was interrupted; its REPL was killed, so all earlier state is lost"
                )
            if result is not None:
                return result
            if timed_out:
                self._discard(proc)
                self._respawn_quietly()
                raise CellTimeout(self._cell_timeout)
            raise self._fail(proc, f"REPL crashed: {crash}") from crash

    def interrupt(self) -> None:
        """Kill the running cell's REPL from any thread; execute() then raises CellInterrupted."""
        with self._state_lock:
            if self._busy and self._proc is not None:
                self._interrupted = True
                kill_group(self._proc)

    def shutdown(self) -> None:
        """Stop the REPL: ask politely, then kill after a grace period. Safe to call twice."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            proc = self._proc
            if proc is None:
                return
            if self._busy:
                # The thread running the cell reaps it and raises CellInterrupted.
                self._interrupted = True
                kill_group(proc)
                return
            self._proc = None
        if proc.stdin is not None and not has_exited(proc):
            deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
            with contextlib.suppress(SandboxError):
                write_all(proc.stdin.fileno(), encode_frame({"op": "shutdown"}), deadline)
            while not has_exited(proc) and time.monotonic() < deadline:
                time.sleep(0.02)
        kill_group(proc)
        reap(proc)

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise SandboxError("the REPL session is shut down")
        if self._crashed is not None:
            raise SandboxCrashed(self._crashed)

    def _spawn(self) -> None:
        try:
            proc = _SPAWNER.submit(popen, self._launch).result()
        except OSError as exc:
            raise SandboxCrashed(f"cannot start the REPL ({self._launch.argv[0]}): {exc}") from exc
        assert proc.stdout is not None and proc.stderr is not None
        tail = StderrTail(proc.stderr)
        with self._state_lock:
            closed = self._closed
            if not closed:
                self._proc, self._stderr, self._interrupted = proc, tail, False
        if closed:
            kill_group(proc)
            reap(proc)
            raise SandboxError("the REPL session is shut down")
        try:
            ready = read_frame(proc.stdout.fileno(), time.monotonic() + self._startup_timeout)
            if ready.get("op") != "ready":
                raise SandboxCrashed(f"REPL sent {ready.get('op')!r} instead of ready")
        except FrameTimeout:
            self._discard(proc)
            raise SandboxCrashed(
                f"REPL did not start within {self._startup_timeout:g}s{self._stderr_note(tail)}"
            ) from None
        except SandboxCrashed as exc:
            self._discard(proc)
            raise SandboxCrashed(f"REPL failed to start: {exc}{self._stderr_note(tail)}") from None
        log.debug("sandbox.repl_started", label=self._label, pid=proc.pid)

    def _respawn_quietly(self) -> None:
        """Replace a killed REPL right away; if that fails, the next execute() reports it."""
        try:
            self.start()
        except SandboxError as exc:
            log.warning("sandbox.respawn_failed", label=self._label, error=str(exc))

    def _run_cell(
        self,
        proc: subprocess.Popen[bytes],
        request: bytes,
        request_id: int,
        tools: Mapping[str, Callable[..., Any]],
    ) -> CellResult:
        assert proc.stdin is not None and proc.stdout is not None
        to_repl, from_repl = proc.stdin.fileno(), proc.stdout.fileno()
        # One deadline for the whole cell, host tool calls included.
        deadline = time.monotonic() + self._cell_timeout
        write_all(to_repl, request, deadline)
        while True:
            message = read_frame(from_repl, deadline)
            op = message.get("op")
            if op == "tool_call":
                write_all(to_repl, call_host_tool(tools, message), deadline)
            elif op == "result":
                if message.get("id") != request_id:
                    raise SandboxCrashed(f"REPL answered cell {message.get('id')!r}")
                return parse_result(message)
            else:
                raise SandboxCrashed(f"REPL sent an unexpected {op!r} frame")

    def _begin_cell(self) -> subprocess.Popen[bytes]:
        with self._state_lock:
            self._raise_if_unusable()
            if self._proc is None:
                raise SandboxError("the REPL session is shut down")
            self._busy, self._interrupted = True, False
            return self._proc

    def _end_cell(self) -> bool:
        """Leave the busy state; True if the cell was interrupted (or shut down) meanwhile."""
        with self._state_lock:
            interrupted = self._interrupted
            self._busy = self._interrupted = False
            return interrupted

    def _discard(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill and reap a REPL; the next start() spawns a fresh one."""
        with self._state_lock:
            kill_group(proc)
            if self._proc is proc:
                self._proc = None
        reap(proc)

    def _fail(self, proc: subprocess.Popen[bytes], reason: str) -> SandboxCrashed:
        """Mark the session crashed for good; the error names the exit status and stderr tail."""
        tail = self._stderr
        self._discard(proc)
        note = self._stderr_note(tail) if tail is not None else ""
        message = f"{reason} (exit status {proc.returncode}){note}"
        with self._state_lock:
            self._crashed = message
        log.warning("sandbox.repl_crashed", label=self._label, reason=message)
        return SandboxCrashed(message)

    @staticmethod
    def _stderr_note(tail: StderrTail) -> str:
        text = tail.text(wait_seconds=0.5)
        return f"; stderr: {text}" if text else ""


def unreachable_ancestor(path: Path, uid: int) -> Path | None:
    """The first directory above `path` that `uid` (not owner, not in group) cannot search."""
    for ancestor in reversed(path.parents):
        info = ancestor.stat()
        bit = stat.S_IXUSR if info.st_uid == uid else stat.S_IXOTH
        if not info.st_mode & bit:
            return ancestor
    return None


def grant_workspace(workspace: Path) -> None:
    """Give the sandbox uid the workspace tree (root hosts only, where the jail is uid 65534).

    fwalk plus dir_fd and no symlink following, so links planted by sandboxed code cannot
    redirect the chown to host files; hard-linked files are skipped for the same reason.
    """
    os.chown(workspace, SANDBOX_UID, SANDBOX_GID, follow_symlinks=False)
    for _top, dirs, files, dir_fd in os.fwalk(workspace, follow_symlinks=False):
        for name in (*dirs, *files):
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if info.st_uid == SANDBOX_UID or (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
                    continue
                os.chown(name, SANDBOX_UID, SANDBOX_GID, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue


def stage_driver() -> Path:
    """Copy the driver where uid 65534 can read it, whatever the install's permissions."""
    directory = Path(tempfile.mkdtemp(prefix="fleet-repl-"))
    directory.chmod(0o755)
    target = directory / "repl_main.py"
    shutil.copyfile(DRIVER_SOURCE, target)
    target.chmod(0o444)
    return target


class LocalSandboxLease:
    """One run's hold on its workspace: hands out REPL sessions, shuts them all down on release."""

    def __init__(
        self,
        *,
        workspace: Path,
        run_id: str,
        launch: LaunchSpec,
        cfg: LocalSandboxConfig,
        max_output_chars: int,
        isolated: bool,
        staged_driver: Path | None = None,
    ) -> None:
        self.workspace = workspace
        self.run_id = run_id
        # False when cells run as plain subprocesses (allow_unisolated with no working bwrap).
        self.isolated = isolated
        self._launch = launch
        self._cfg = cfg
        self._max_output_chars = max_output_chars
        self._staged_driver = staged_driver
        self._sessions: list[ReplSession] = []
        self._released = False
        self._lock = threading.Lock()

    def new_session(self) -> ReplSession:
        """A fresh REPL (started lazily by its first execute, or by start())."""
        with self._lock:
            if self._released:
                raise SandboxError(f"the sandbox lease of run {self.run_id} was released")
            if self._launch.run_as is not None:
                grant_workspace(self.workspace)  # files the host added since acquire()
            session = ReplSession(
                self._launch,
                cell_timeout_seconds=self._cfg.cell_timeout_seconds,
                startup_timeout_seconds=self._cfg.startup_timeout_seconds,
                max_output_chars=self._max_output_chars,
                label=self.run_id,
            )
            self._sessions.append(session)
            return session

    def interrupt(self) -> None:
        """Kill whatever cell is running in any of this lease's sessions (a stop or a timeout)."""
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.interrupt()

    def release(self) -> None:
        """Shut down every session this lease created; idempotent and never raises."""
        with self._lock:
            if self._released:
                return
            self._released = True
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            try:
                session.shutdown()
            except Exception as exc:
                log.warning("sandbox.shutdown_failed", run_id=self.run_id, error=str(exc))
        if self._staged_driver is not None:
            shutil.rmtree(self._staged_driver.parent, ignore_errors=True)


@dataclass(frozen=True)
class Isolation:
    """What check() settled on: the bwrap binary (None means unisolated) and the interpreter."""

    bwrap: str | None
    python: str


class LocalSandboxProvider:
    """Creates sandbox leases on this machine, jailed with bubblewrap unless told otherwise."""

    def __init__(
        self,
        cfg: LocalSandboxConfig,
        *,
        max_output_chars: int,
        search_path: str | None = None,
    ) -> None:
        """`search_path` is the PATH used to find bwrap (default: this process's PATH)."""
        if max_output_chars <= 0:
            raise ValueError("max_output_chars must be positive")
        self._cfg = cfg
        self._max_output_chars = max_output_chars
        self._search_path = search_path
        # A root worker never runs cells as host root: bwrap itself drops to the sandbox uid.
        self._run_as = SANDBOX_UID if os.geteuid() == 0 else None
        self._isolation: Isolation | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        """Settle how cells will run; SandboxUnavailable if they cannot run isolated and must."""
        with self._lock:
            if self._isolation is None:
                self._isolation = self._settle()

    def acquire(self, workspace: Path, run_id: str) -> LocalSandboxLease:
        """Prepare `workspace` (memory/ skills/ attachments/ artifacts/) and lease it to a run."""
        self.check()
        assert self._isolation is not None
        return self._lease(Path(workspace), run_id, self._isolation)

    def _settle(self) -> Isolation:
        python = resolve_python(self._cfg)
        if not os.access(python, os.X_OK):
            raise SandboxUnavailable(
                f"the sandbox interpreter {python} does not exist or is not executable",
                fix="install python3 or set sandbox.local.python",
            )
        bwrap = shutil.which("bwrap", path=self._search_path)
        if bwrap is None:
            problem = "bubblewrap (bwrap) was not found on PATH"
        else:
            failure = self._probe(Isolation(bwrap=bwrap, python=python))
            if failure is None:
                return Isolation(bwrap=bwrap, python=python)
            problem = f"bwrap at {bwrap} cannot start a sandbox: {failure}"
        if not self._cfg.allow_unisolated:
            raise SandboxUnavailable(problem)
        log.warning(
            "sandbox.UNISOLATED",
            reason=problem,
            detail="cells run as plain subprocesses with the worker's filesystem and network "
            "in reach, because sandbox.local.allow_unisolated = true",
        )
        return Isolation(bwrap=None, python=python)

    def _probe(self, isolation: Isolation) -> str | None:
        """Start one real REPL in a throwaway workspace; why it failed, or None if it worked."""
        workspace = Path(tempfile.mkdtemp(prefix="fleet-probe-"))
        lease: LocalSandboxLease | None = None
        try:
            lease = self._lease(workspace, "probe", isolation)
            lease.new_session().start()
        except SandboxError as exc:
            return str(exc)
        finally:
            if lease is not None:
                lease.release()
            shutil.rmtree(workspace, ignore_errors=True)
        return None

    def _lease(self, workspace: Path, run_id: str, isolation: Isolation) -> LocalSandboxLease:
        workspace = workspace.resolve()
        for name in WORKSPACE_DIRS:
            (workspace / name).mkdir(parents=True, exist_ok=True)
        driver, staged = DRIVER_SOURCE, None
        if self._run_as is not None:
            driver = staged = stage_driver()
            for path in (workspace, staged.parent):
                blocked = unreachable_ancestor(path, self._run_as)
                if blocked is not None:
                    shutil.rmtree(staged.parent, ignore_errors=True)
                    raise SandboxError(
                        f"{blocked} is not searchable by uid {self._run_as}, which sandboxed code "
                        f"runs as on a root worker; chmod o+x it, move {path}, "
                        "or run the worker as a non-root user"
                    )
            grant_workspace(workspace)
        if isolation.bwrap is not None:
            argv = bwrap_command(self._cfg, workspace, isolation.python, driver, bwrap=isolation.bwrap)
            launch = LaunchSpec(
                argv=tuple(argv), env=sandbox_env(WORKSPACE_MOUNT), cwd="/", run_as=self._run_as
            )
        else:
            argv = unisolated_command(self._cfg, isolation.python, driver)
            launch = LaunchSpec(
                argv=tuple(argv),
                env=sandbox_env(str(workspace)),
                cwd=str(workspace),
                run_as=self._run_as,
            )
        return LocalSandboxLease(
            workspace=workspace,
            run_id=run_id,
            launch=launch,
            cfg=self._cfg,
            max_output_chars=self._max_output_chars,
            isolated=isolation.bwrap is not None,
            staged_driver=staged,
        )
