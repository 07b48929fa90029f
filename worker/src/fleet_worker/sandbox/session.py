"""A REPL session: one sandboxed interpreter process, driven cell by cell over the frame protocol."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import structlog

from fleet_worker.sandbox.errors import (
    CellInterrupted,
    CellTimeout,
    FrameTimeout,
    FrameTooLarge,
    SandboxCrashed,
    SandboxError,
)
from fleet_worker.sandbox.jail import LaunchSpec
from fleet_worker.sandbox.protocol import encode_frame, read_frame, write_all

log = structlog.get_logger(__name__)

RESERVED_NAMES = frozenset({"SUBMIT", "__builtins__"})
STDERR_TAIL_BYTES = 16 * 1024
SHUTDOWN_GRACE_SECONDS = 2.0
REAP_TIMEOUT_SECONDS = 5.0

# bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that forked bwrap
# exits, not the process; a REPL forked from a short-lived worker thread would be killed with it.
# So every REPL is forked from this single thread, which lives as long as the interpreter.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-sandbox-spawn")


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
