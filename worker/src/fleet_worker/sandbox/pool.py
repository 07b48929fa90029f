"""Warm REPLs: when a Run releases its workspace, a fresh REPL is started for that workspace's
next Run, so that Run's lease is ready at once. A Run that finds none gets its REPL started the
moment its lease is made (`start_early`), so the spawn overlaps the Run's staging and its
program's setup (and, with a provider LM, its first LM call) instead of preceding them.

A REPL is never handed to another workspace, and never to a second Run: each warm REPL is new,
started after the last Run's REPLs were shut down and its workspace sanitized. The pool holds at
most `size` of them (least recently used go first), each for at most `max_idle_seconds`.

A warm REPL is started only when the released lease was the worker's last one out. Under load a
spawn for a Run that may never come (one-shot sessions) takes CPU the running Turns need, and a
busy worker's next Turn starts its REPL at its lease anyway, overlapping its first LM call.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from fleet_worker.sandbox.errors import SandboxError
from fleet_worker.sandbox.session import ReplSession

log = structlog.get_logger(__name__)
EARLY_STARTERS = 8  # REPLs starting at once for new leases; more wait, or start on first use


class WarmPool:
    def __init__(self, size: int, max_idle_seconds: float) -> None:
        self.size = size
        self.max_idle = max_idle_seconds
        self._entries: OrderedDict[Path, tuple[float, ReplSession]] = OrderedDict()
        self._lock = threading.Lock()
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-sandbox-warm")
        self._early = ThreadPoolExecutor(max_workers=EARLY_STARTERS, thread_name_prefix="fleet-sandbox-early")
        self._closed = False
        self._out = 0  # leases made and not yet released
        self._held: Counter[Path] = Counter()  # leases by workspace, until their release ends

    def lease_out(self, workspace: Path) -> None:
        with self._lock:
            self._out += 1
            self._held[workspace] += 1

    def lease_back(self) -> bool:
        """A lease is being released; True when it was the last one out (the worker is idle)."""
        with self._lock:
            self._out = max(0, self._out - 1)
            return self._out == 0

    def returned(self, workspace: Path) -> None:
        """A lease's release is over: nothing of it touches the workspace's folder any more."""
        with self._lock:
            self._held[workspace] -= 1
            if self._held[workspace] <= 0:
                del self._held[workspace]

    def leased(self, workspace: Path) -> bool:
        """Whether a lease of this worker holds the workspace (or is still releasing it)."""
        with self._lock:
            return workspace in self._held

    def holds(self, workspace: Path) -> bool:
        """Whether a warm REPL is waiting for the workspace."""
        with self._lock:
            return workspace in self._entries

    def wait_started(self) -> None:
        """Until every warm REPL asked for so far has started (or failed to)."""
        self._starter.submit(lambda: None).result()

    def take(self, workspace: Path) -> ReplSession | None:
        """The warm REPL of this workspace, if there is one; it leaves the pool."""
        with self._lock:
            entry = self._entries.pop(workspace, None)
        if entry is None:
            return None
        started, session = entry
        if time.monotonic() - started > self.max_idle or session.pid is None:
            self._retire(session)
            return None
        return session

    def discard(self, workspace: Path) -> None:
        """The workspace's warm REPL, if any, goes down (what it was bound to was replaced)."""
        with self._lock:
            entry = self._entries.pop(workspace, None)
        if entry is not None:
            self._retire(entry[1])

    def start_early(self, make: Callable[[], ReplSession]) -> ReplSession:
        """A new REPL for a Run that found none warm, starting now in the background. Its first
        start() or execute() waits for this start (ReplSession serializes them), or spawns anew
        if it failed: a failure here is only logged, the Run meets it where it always did."""
        session = make()
        with self._lock:  # close() marks the pool closed under this lock before its executors stop
            if not self._closed:
                self._early.submit(self._start_quietly, session)
        return session

    @staticmethod
    def _start_quietly(session: ReplSession) -> None:
        try:
            session.start()
        except SandboxError as exc:  # shut down before it started, or the spawn failed
            log.debug("sandbox.early_start_failed", error=str(exc))
        except Exception as exc:  # no one reads this future: say it here
            log.warning("sandbox.early_start_failed", error=str(exc), error_type=type(exc).__name__)

    def prewarm(self, workspace: Path, make: Callable[[], ReplSession]) -> None:
        """Start a REPL for the workspace's next Run, in the background."""
        with self._lock:
            if self.size > 0 and not self._closed:
                self._starter.submit(self._start, workspace, make)

    def _start(self, workspace: Path, make: Callable[[], ReplSession]) -> None:
        session = make()
        try:
            session.start()
        except SandboxError as exc:
            log.warning("sandbox.prewarm_failed", error=str(exc))
            return
        evicted: list[ReplSession] = []
        with self._lock:
            if self._closed:
                evicted.append(session)
            else:
                old = self._entries.pop(workspace, None)
                if old is not None:
                    evicted.append(old[1])
                self._entries[workspace] = (time.monotonic(), session)
                while len(self._entries) > self.size:
                    evicted.append(self._entries.popitem(last=False)[1][1])
                now = time.monotonic()
                for key in [k for k, (at, _s) in self._entries.items() if now - at > self.max_idle]:
                    evicted.append(self._entries.pop(key)[1])
        for old_session in evicted:
            self._retire(old_session)

    @staticmethod
    def _retire(session: ReplSession) -> None:
        try:
            session.shutdown()
        except Exception as exc:
            log.warning("sandbox.retire_failed", error=str(exc))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sessions = [session for _at, session in self._entries.values()]
            self._entries.clear()
        self._starter.shutdown(wait=True)
        self._early.shutdown(wait=True, cancel_futures=True)
        for session in sessions:
            self._retire(session)
