"""A REPL session: one sandboxed REPL (supervisor + interpreter), driven cell by cell over frames."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from fleet_worker.sandbox.boundary import Caps, CellError, CellResult, call_host_tool, parse_result
from fleet_worker.sandbox.cgroups import Cgroup
from fleet_worker.sandbox.errors import (
    CellCrashed,
    CellInterrupted,
    CellTimeout,
    FrameTimeout,
    OverBudget,
    SandboxCrashed,
    SandboxError,
    SandboxStopped,
)
from fleet_worker.sandbox.jail import LaunchSpec
from fleet_worker.sandbox.process import (
    SPAWNER,
    OutputCapture,
    StderrTail,
    has_exited,
    host_pid,
    kill_group,
    popen,
    process_state,
    reap,
)
from fleet_worker.sandbox.protocol import encode_frame, read_frame, write_all
from fleet_worker.sandbox.workspace_budget import WorkspaceBudget

log = structlog.get_logger(__name__)

RESERVED_NAMES = frozenset({"SUBMIT", "__builtins__"})
SHUTDOWN_GRACE_SECONDS = 2.0


def tool_params(tool: Callable[..., Any]) -> list[str]:
    """Names that positional arguments of a tool call map onto, in order."""
    try:
        signature = inspect.signature(tool)
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.kind in positional]


@dataclass
class Repl:
    """One running REPL: its process (bwrap, or the driver when unisolated) and host-side ends."""

    proc: subprocess.Popen[bytes]
    stderr: StderrTail
    output: OutputCapture
    cgroup: Cgroup | None = None
    supervisor: int | None = None  # host pid of the supervisor, watched while a cell runs
    launch: LaunchSpec | None = None  # what started it (a remote REPL's session is named there)


class ReplSession:
    """A persistent REPL: state survives across cells until a timeout, a crash or an interrupt,
    after which a fresh REPL is started (and the cell that lost the state is told so)."""

    def __init__(
        self,
        launch: LaunchSpec,
        *,
        cell_timeout_seconds: float,
        startup_timeout_seconds: float,
        caps: Caps,
        budget: WorkspaceBudget | None = None,
        label: str = "repl",
        fresh_launch: Callable[[], LaunchSpec] | None = None,
        on_end: Callable[[LaunchSpec], None] | None = None,
    ) -> None:
        """`fresh_launch` (optional) gives each new REPL process its own launch (a remote REPL's
        session name, say); `on_end` is told when a REPL is gone (killed, crashed or shut down),
        so whatever it held outside this machine can be ended too."""
        self._launch = launch
        self._fresh_launch = fresh_launch
        self._on_end = on_end
        self._cell_timeout = cell_timeout_seconds
        self._startup_timeout = startup_timeout_seconds
        self._caps = caps
        self._budget = budget
        self._max_output_chars = caps.max_output_chars
        self._label = label
        # One cell (or start) at a time; interrupt() and a busy shutdown() skip this lock.
        self._exec_lock = threading.RLock()
        # Guards the fields below; held only briefly, never across blocking I/O.
        self._state_lock = threading.Lock()
        self._repl: Repl | None = None
        self._busy = False
        self._interrupted = False
        self._closed = False
        self._next_id = 0
        # inspect.signature once per tool, not per cell: a Turn passes the same tools (ADR 0023).
        self._tool_params: dict[str, tuple[Callable[..., Any], list[str]]] = {}

    @property
    def pid(self) -> int | None:
        """Host pid of the REPL process (bwrap's, when isolated), if one is running."""
        repl = self._repl
        return repl.proc.pid if repl is not None else None

    def start(self) -> None:
        """Spawn the REPL and wait for its ready frame; does nothing if it is already up."""
        with self._exec_lock:
            with self._state_lock:
                if self._closed:
                    raise SandboxError("the REPL session is shut down")
                repl = self._repl
            if repl is not None:
                if not has_exited(repl.proc):
                    return
                log.warning("sandbox.repl_exited_between_cells", label=self._label)
                self._discard(repl)
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
                    "tools": {name: self._params_of(name, tool) for name, tool in tools.items()},
                    "output_fields": list(output_fields) if output_fields is not None else None,
                }
            )
            self.start()
            repl = self._begin_cell()
            repl.output.begin(self._max_output_chars)
            oom_kills = repl.cgroup.oom_kills() if repl.cgroup is not None else 0
            message: dict[str, Any] | None = None
            failure: SandboxCrashed | FrameTimeout | None = None
            try:
                message = self._run_cell(repl, request, request_id, tools)
            except (FrameTimeout, SandboxCrashed) as exc:
                failure = exc
            except BaseException:
                # A host tool raised e.g. CancelledError: the REPL still waits for its reply.
                self._end_cell()
                self._discard(repl)
                raise
            stdout, truncated = repl.output.take(self._max_output_chars)
            if self._end_cell():
                self._discard(repl)
                raise CellInterrupted(
                    "the cell was interrupted; its REPL was killed, so all earlier state is lost",
                    stdout=stdout,
                    truncated=truncated,
                )
            if message is not None:
                oom_kills = repl.cgroup.oom_kills() - oom_kills if repl.cgroup is not None else 0
                return self._checked(parse_result(message, stdout, truncated, self._caps, oom_kills))
            if isinstance(failure, FrameTimeout):
                self._discard(repl)
                self._respawn_quietly()
                raise CellTimeout(self._cell_timeout, stdout=stdout, truncated=truncated)
            reason = self._crash_reason(repl, failure)
            raise CellCrashed(reason, stdout=stdout, truncated=truncated) from failure

    def _params_of(self, name: str, tool: Callable[..., Any]) -> list[str]:
        # A metered wrapper (functools.wraps) is made per cell; its signature is its tool's.
        inner = inspect.unwrap(tool)
        known = self._tool_params.get(name)
        if known is not None and known[0] is inner:
            return known[1]
        params = tool_params(tool)
        self._tool_params[name] = (inner, params)
        return params

    def _checked(self, result: CellResult) -> CellResult:
        """A cell that ended with the workspace over its budget: told so, and what it wrote past
        the budget removed. One that hit a full workspace (its volume refused a write): told why."""
        if self._budget is not None and result.error is not None and self._budget.full():
            error = result.error
            if "[Errno 28]" in f"{error.message}{error.traceback}":
                why = self._budget.describe_full()
                told = dataclasses.replace(
                    error,
                    message=f"{error.message}; {why}",
                    traceback=f"{error.traceback.rstrip()}\n({why})\n" if error.traceback else "",
                )
                return dataclasses.replace(result, error=told)
        if self._budget is None or result.final is not None or self._budget.unchanged():
            return result
        overrun = self._budget.overrun()
        if overrun is None or result.error is not None:
            return result
        note = f"{overrun}; {self._budget.pruned()}"
        return dataclasses.replace(result, error=CellError("WorkspaceOverBudget", note, ""))

    def interrupt(self) -> None:
        """Kill the running cell's REPL from any thread; execute() then raises CellInterrupted."""
        with self._state_lock:
            if self._busy and self._repl is not None:
                self._interrupted = True
                kill_group(self._repl.proc)

    def shutdown(self) -> None:
        """Stop the REPL: ask politely, then kill after a grace period. Safe to call twice."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            repl = self._repl
            if repl is None:
                return
            if self._busy:
                # The thread running the cell reaps it and raises CellInterrupted.
                self._interrupted = True
                kill_group(repl.proc)
                return
            self._repl = None
        proc = repl.proc
        if proc.stdin is not None and not has_exited(proc):
            deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
            with contextlib.suppress(SandboxError):
                write_all(proc.stdin.fileno(), encode_frame({"op": "shutdown"}), deadline)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=SHUTDOWN_GRACE_SECONDS)
        kill_group(proc)
        reap(proc)
        repl.output.close()
        if repl.cgroup is not None:
            repl.cgroup.remove()
        self._ended(repl)

    def _spawn(self) -> None:
        if self._fresh_launch is not None:
            self._launch = self._fresh_launch()
        cgroup = self._new_cgroup()
        read_fd, write_fd = os.pipe()
        try:
            proc = SPAWNER.submit(popen, self._launch, write_fd, cgroup).result()
        except OSError as exc:
            os.close(read_fd)
            if cgroup is not None:
                cgroup.remove()
            raise SandboxCrashed(f"cannot start the REPL ({self._launch.argv[0]}): {exc}") from exc
        finally:
            os.close(write_fd)  # the REPL holds it now; the pipe ends when the REPL does
        assert proc.stdout is not None and proc.stderr is not None
        repl = Repl(proc, StderrTail(proc.stderr), OutputCapture(read_fd), cgroup, launch=self._launch)
        with self._state_lock:
            closed = self._closed
            if not closed:
                self._repl, self._interrupted = repl, False
        if closed:
            self._discard(repl)
            raise SandboxError("the REPL session is shut down")
        try:
            ready = read_frame(proc.stdout.fileno(), time.monotonic() + self._startup_timeout)
            if ready.get("op") != "ready":
                raise SandboxCrashed(f"REPL sent {ready.get('op')!r} instead of ready")
        except FrameTimeout:
            self._discard(repl)
            raise SandboxCrashed(
                f"REPL did not start within {self._startup_timeout:g}s{self._stderr_note(repl)}"
            ) from None
        except SandboxCrashed as exc:
            self._discard(repl)
            raise SandboxCrashed(f"REPL failed to start: {exc}{self._stderr_note(repl)}") from None
        ns_pid = ready.get("pid")
        repl.supervisor = host_pid(proc.pid, ns_pid) if isinstance(ns_pid, int) else None
        log.debug("sandbox.repl_started", label=self._label, pid=proc.pid, supervisor=repl.supervisor)

    def _new_cgroup(self) -> Cgroup | None:
        launch = self._launch
        if launch.cgroups is None or launch.limits is None:
            return None
        try:
            return launch.cgroups.create(launch.limits)
        except OSError as exc:  # the REPL still starts, with its per-process rlimits only
            log.warning("sandbox.cgroup_failed", label=self._label, error=str(exc))
            return None

    def _respawn_quietly(self) -> None:
        """Replace a killed REPL right away; if that fails, the next execute() reports it."""
        try:
            self.start()
        except SandboxError as exc:
            log.warning("sandbox.respawn_failed", label=self._label, error=str(exc))

    def _run_cell(
        self,
        repl: Repl,
        request: bytes,
        request_id: int,
        tools: Mapping[str, Callable[..., Any]],
    ) -> dict[str, Any]:
        proc = repl.proc
        assert proc.stdin is not None and proc.stdout is not None
        to_repl, from_repl = proc.stdin.fileno(), proc.stdout.fileno()
        # The cell's own time: a host tool call (an LM call, a whole child RLM) moves the deadline
        # on by as long as it took, so a slow child cannot time its parent's cell out and lose its
        # REPL. The Turn's deadline bounds the tool calls (it stops the program).
        deadline = time.monotonic() + self._cell_timeout
        budget = self._budget
        if budget is not None:
            budget.begin_cell()

        def watch() -> None:  # about once a second while the cell runs, and after tool calls
            if repl.supervisor is not None and process_state(repl.supervisor) in ("T", "t", "Z", "?"):
                raise SandboxStopped("the REPL's supervisor was stopped or is gone")
            if budget is not None and budget.due_in_cell() and (overrun := budget.overrun()) is not None:
                raise OverBudget(overrun)  # what the cell wrote past it goes once it is killed

        write_all(to_repl, request, deadline)
        while True:
            message = read_frame(from_repl, deadline, watch=watch)
            op = message.get("op")
            if op == "tool_call":
                called = time.monotonic()
                reply = call_host_tool(tools, message, self._caps)
                deadline += time.monotonic() - called
                write_all(to_repl, reply, deadline)
                watch()  # a cell that keeps calling tools is never idle long enough otherwise
            elif op == "result":
                if message.get("id") != request_id:
                    raise SandboxCrashed(f"REPL answered cell {message.get('id')!r}")
                return message
            else:
                raise SandboxCrashed(f"REPL sent an unexpected {op!r} frame")

    def _begin_cell(self) -> Repl:
        with self._state_lock:
            if self._closed or self._repl is None:
                raise SandboxError("the REPL session is shut down")
            self._busy, self._interrupted = True, False
            return self._repl

    def _end_cell(self) -> bool:
        """Leave the busy state; True if the cell was interrupted (or shut down) meanwhile."""
        with self._state_lock:
            interrupted = self._interrupted
            self._busy = self._interrupted = False
            return interrupted

    def _discard(self, repl: Repl) -> None:
        """Kill and reap a REPL; the next start() spawns a fresh one."""
        with self._state_lock:
            kill_group(repl.proc)
            if self._repl is repl:
                self._repl = None
        reap(repl.proc)
        repl.output.close()
        if repl.cgroup is not None:
            repl.cgroup.remove()  # and whatever of the REPL escaped its process group
        self._ended(repl)

    def _ended(self, repl: Repl) -> None:
        if self._on_end is not None and repl.launch is not None:
            try:
                self._on_end(repl.launch)
            except Exception as exc:  # cleanup elsewhere must never break the session
                log.warning("sandbox.on_end_failed", label=self._label, error=str(exc))

    def _crash_reason(self, repl: Repl, failure: BaseException | None) -> str:
        """Why the REPL process is gone (exit status, stderr tail); it is replaced right away."""
        note = self._stderr_note(repl)
        self._discard(repl)
        if isinstance(failure, OverBudget) and self._budget is not None:
            failure = OverBudget(f"{failure}; {self._budget.pruned()}")  # nothing writes any more
        self._respawn_quietly()
        if isinstance(failure, SandboxStopped):
            reason = (
                f"{failure}; the REPL was killed and restarted, so every variable from earlier cells is lost"
            )
        else:
            reason = f"the sandbox crashed: {failure} (exit status {repl.proc.returncode}){note}; "
            reason += "it was restarted, so every variable from earlier cells is lost"
        log.warning("sandbox.repl_crashed", label=self._label, reason=reason)
        return reason

    @staticmethod
    def _stderr_note(repl: Repl) -> str:
        text = repl.stderr.text(wait_seconds=0.5)
        return f"; stderr: {text[-2000:]}" if text else ""
