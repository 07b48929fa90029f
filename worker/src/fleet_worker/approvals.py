"""Approvals before a cell runs (`approval: always | on_risk`), on the program's thread.

The cell's code is sent as an `Approval` event (`pending`), and the Run's approval key in Redis
is set `pending`; a gateway writes the decision there (`POST /api/runs/{id}/approvals/{aid}`),
and this thread reads it every POLL_SECONDS. Past `runtime.approval_timeout_seconds` the key is
set `timed_out` (so a late decision is refused) and the cell is denied. While it waits the
sandbox is kept but idle (no cell runs), the Run's lease is renewed as always, and a cancel
stops the wait at once. A denied cell does not run: the RLM is told why, as the cell's error.

`on_risk` is a convenience, not a security boundary: risk_of is a conservative reading of the
code's syntax (docs/rlm.md), which code that hides what it does (`getattr`, `exec` of a built
string) gets past. The sandbox is the boundary.
"""

from __future__ import annotations

import ast
import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared import redis_keys
from fleet_shared.approvals import PENDING, TIME_OUT_SCRIPT, TIMED_OUT, ApprovalDecision
from fleet_shared.config_file import RuntimeSection
from fleet_shared.events import Approval, RunEvent
from fleet_worker.errors import TurnStopped

ApprovalMode = Literal["never", "always", "on_risk"]
POLL_SECONDS = 0.2
REDIS_SECONDS = 2.0
KEY_GRACE_SECONDS = 60  # the key outlives the wait by this, so a late decision is refused, not lost
# Called on `os` (or imported from it by name): processes started or signalled.
OS_PROCESS_CALLS = {
    "system", "popen", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
    "spawnvpe", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
    "fork", "forkpty", "kill", "killpg", "posix_spawn", "posix_spawnp",
}  # fmt: skip
PROCESS_CALLS = {"create_subprocess_exec", "create_subprocess_shell", "ProcessPoolExecutor"}  # on anything
PROCESS_MODULES = {"subprocess", "pty", "multiprocessing", "ctypes"}
OS_DELETE_CALLS = {"remove", "unlink", "rmdir", "removedirs"}  # on `os`, with the path first
PATH_DELETE_METHODS = {"unlink", "rmdir"}  # a pathlib.Path's, the path not in the call
NETWORK_MODULES = {
    "socket",
    "urllib",
    "urllib3",
    "http",
    "requests",
    "httpx",
    "aiohttp",
    "ftplib",
    "smtplib",
    "ssl",
}
LARGE_RANGE = 10_000_000


def risk_of(code: str) -> str | None:
    """Why `on_risk` asks about this code, or None: it starts or signals processes, deletes a path
    not written as under `artifacts/`, imports a network module, starts a child RLM (whose cells
    run without asking), or loops without an end or over ten million or more items. Code that
    does not parse is not asked about (it fails as it is); code too deep to read is."""
    try:
        tree = ast.parse(code)
        return first_risk(tree)
    except (SyntaxError, ValueError):
        return None
    except (RecursionError, MemoryError):
        return "it is nested too deeply to read"


def first_risk(tree: ast.AST) -> str | None:
    from_os = set()  # names imported from os, called bare
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            roots = {name.split(".", 1)[0] for name in names}
            if roots & PROCESS_MODULES:
                return "it starts processes (" + ", ".join(sorted(roots & PROCESS_MODULES)) + ")"
            if roots & NETWORK_MODULES:
                return "it uses the network (" + ", ".join(sorted(roots & NETWORK_MODULES)) + ")"
            if isinstance(node, ast.ImportFrom) and node.module == "os":
                from_os |= {alias.asname or alias.name for alias in node.names}
        if isinstance(node, ast.Call) and (risk := call_risk(node, from_os)) is not None:
            return risk
        if isinstance(node, ast.While) and isinstance(node.test, ast.Constant) and node.test.value:
            return "it loops without an end (while True)"
    return None


def call_risk(call: ast.Call, from_os: set[str]) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    on_os = (
        isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "os"
    ) or (isinstance(func, ast.Name) and name in from_os)
    if (on_os and name in OS_PROCESS_CALLS) or name in PROCESS_CALLS:
        return f"it starts or signals processes ({name})"
    deletes = (on_os and name in OS_DELETE_CALLS) or name == "rmtree"
    if deletes and not under_artifacts(call):
        return f"it deletes files outside artifacts/ ({name})"
    if isinstance(func, ast.Attribute) and name in PATH_DELETE_METHODS and not call.args and not on_os:
        return f"it deletes files ({name})"
    if name == "rlm_query":
        return "it starts a child RLM, whose cells run without asking"
    if name == "range" and range_count(call) >= LARGE_RANGE:
        return "it loops over ten million items or more"
    return None


def under_artifacts(call: ast.Call) -> bool:
    """A deletion whose target is written as a literal path under `artifacts/`."""
    if not call.args or not isinstance(call.args[0], ast.Constant) or not isinstance(call.args[0].value, str):
        return False
    path = call.args[0].value.removeprefix("./").removeprefix("/workspace/")
    return path.startswith("artifacts/") and ".." not in path.split("/")


def range_count(call: ast.Call) -> int:
    """How many items `range(...)` yields, when its bounds are constants (0 when not known)."""
    bounds = [constant_int(arg) for arg in call.args[:2]]
    if not bounds or any(b is None for b in bounds):
        return 0
    start, stop = (0, bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])
    assert start is not None and stop is not None
    return abs(stop - start)


SATURATED = 10**20  # past it, a constant is simply "huge": no arithmetic on giant numbers


def constant_int(node: ast.expr, depth: int = 0) -> int | None:
    """An integer the expression always is (literals and + - * ** of them), saturated at
    SATURATED in size; None when not a constant."""
    if depth > 20:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return max(-SATURATED, min(SATURATED, node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = constant_int(node.operand, depth + 1)
        return None if inner is None else -inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Pow):
        left, right = constant_int(node.left, depth + 1), constant_int(node.right, depth + 1)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Pow):
            if right < 0:
                return 0
            value = SATURATED if abs(left) > 1 and right > 70 else left**right
        else:
            operations = {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}
            value = operations[type(node.op)]
        return max(-SATURATED, min(SATURATED, value))
    return None


@dataclass
class ApprovalGate:
    """The root RLM's cells, each asked about before it runs (mode `always`, or `on_risk` when
    risk_of finds a reason)."""

    mode: ApprovalMode
    redis: Redis
    loop: asyncio.AbstractEventLoop
    run_id: str
    timeout_seconds: float
    emit: Callable[[RunEvent], None]
    stop: threading.Event

    @classmethod
    def of(
        cls,
        mode: ApprovalMode,
        redis: Redis,
        run_id: str,
        runtime: RuntimeSection,
        emit: Callable[[RunEvent], None],
    ) -> ApprovalGate | None:
        """The gate a Turn's root RLM's cells pass before they run; None for `never`. Its stop
        is the program's, once start_program has one."""
        if mode == "never":
            return None
        loop = asyncio.get_running_loop()
        return cls(mode, redis, loop, run_id, runtime.approval_timeout_seconds, emit, threading.Event())

    def reason(self, code: str) -> str | None:
        if self.mode == "always":
            return "every cell of this Turn waits for approval"
        return risk_of(code) if self.mode == "on_risk" else None

    def review(self, call_id: str, code: str) -> str | None:
        """None: run the cell. Otherwise it is not run, and this says why (for the RLM)."""
        reason = self.reason(code)
        if reason is None:
            return None
        approval_id = uuid.uuid4().hex[:16]
        key = redis_keys.run_approval(self.run_id, approval_id)
        ttl = int(self.timeout_seconds) + KEY_GRACE_SECONDS
        asked = Approval(
            run_id=self.run_id, approval_id=approval_id, call_id=call_id, code=code, reason=reason,
            state="pending", timeout_seconds=self.timeout_seconds,
        )  # fmt: skip
        self.emit(asked)
        try:
            decision = self.wait(key, ttl)
        except TurnStopped:  # the history keeps how it ended, never a cell that still waits
            self.emit(msgspec.structs.replace(asked, state="stopped"))
            raise
        if decision is None:
            self.emit(msgspec.structs.replace(asked, state="timed_out"))
            waited = f"{self.timeout_seconds:g} s"
            return f"This cell was not run: nobody approved it within {waited}. Try another way."
        state: Literal["approved", "denied"] = "approved" if decision.decision == "approve" else "denied"
        self.emit(msgspec.structs.replace(asked, state=state, note=decision.note, decided_by=decision.by))
        if state == "approved":
            return None
        why = f" The user's note: {decision.note}" if decision.note else ""
        return f"This cell was not run: the user denied it.{why} Try another way."

    def wait(self, key: str, ttl: int) -> ApprovalDecision | None:
        """The decision, or None once the wait timed out (the key then says so). The key is set
        `pending` first (and again whenever Redis lost it); a Redis outage is waited out."""
        deadline = time.monotonic() + self.timeout_seconds
        value: bytes | None = None
        while True:
            try:
                if value is None:  # not set yet, or Redis lost it (a restart): wait from a key set again
                    self.call(self.redis.set(key, PENDING, ex=ttl, nx=True))
                value = self.call(self.redis.get(key))
                if value is not None and value not in (PENDING.encode(), TIMED_OUT.encode()):
                    return msgspec.json.decode(value, type=ApprovalDecision)
                if time.monotonic() >= deadline:
                    # `timed_out` only over `pending`: a decision that landed first is taken.
                    found = self.call(self.redis.eval(TIME_OUT_SCRIPT, 1, key, PENDING, TIMED_OUT))
                    if found is None or found in (PENDING.encode(), TIMED_OUT.encode()):
                        return None
                    return msgspec.json.decode(found, type=ApprovalDecision)
            except (RedisError, OSError, TimeoutError, msgspec.DecodeError):
                if time.monotonic() >= deadline:
                    return None  # Redis stayed away: no decision can arrive
            if self.stop.wait(POLL_SECONDS):
                raise TurnStopped("the Turn was stopped while a cell waited for approval")

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(REDIS_SECONDS)
