"""A Run's lease on a local workspace: its REPL sessions, its capture, its release."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import structlog

from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.errors import SandboxError
from fleet_worker.sandbox.jail import LaunchSpec, LocalSandboxConfig
from fleet_worker.sandbox.pool import WarmPool
from fleet_worker.sandbox.provider import Captured, Room, no_quota
from fleet_worker.sandbox.session import ReplSession
from fleet_worker.sandbox.sync import Baseline, VersionedFolders
from fleet_worker.sandbox.workspace import LocalWorkspaceFiles, sanitize
from fleet_worker.sandbox.workspace_budget import WorkspaceBudget

log = structlog.get_logger(__name__)
VOLUME_SLACK_BYTES = 4 << 20  # the budget's check above a volume's own limit (extent blocks)


class LocalSandboxLease:
    """One run's hold on its workspace: hands out REPL sessions, shuts them all down on release."""

    def __init__(
        self,
        *,
        workspace: Path,
        run_id: str,
        launch: LaunchSpec,
        cfg: LocalSandboxConfig,
        caps: Caps,
        isolated: bool,
        pool: WarmPool | None = None,
        versions: VersionedFolders | None = None,
        known: Baseline | None = None,
        volume: int | None = None,
    ) -> None:
        self.workspace = workspace
        self._volume = volume  # the lock on the workspace's volume, held until release
        self._versions = versions
        self.known: Baseline = known or {}  # what the host knows of the folder's files
        self.run_id = run_id
        # False when cells run as plain subprocesses (allow_unisolated with no working bwrap).
        self.isolated = isolated
        self._launch = launch
        self._cfg = cfg
        self._caps = caps
        self._pool = pool
        self._counted_by = pool  # told at release even when retire() forgoes the warm REPL
        self.files = LocalWorkspaceFiles(workspace, launch.run_as)
        self._sessions: list[ReplSession] = []
        self._released = False
        self._lock = threading.Lock()
        # The REPL the Run's program will use: warm from the pool, else starting from now on.
        self._warm = (
            (pool.take(workspace) or pool.start_early(self.make_session)) if pool is not None else None
        )
        if pool is not None:  # last: a lease that failed to be made is never counted
            pool.lease_out(workspace)

    def interpreter_factory(self) -> ReplSession:
        """A fresh REPL (started lazily by its first execute, or by start())."""
        with self._lock:
            if self._released:
                raise SandboxError(f"the sandbox lease of run {self.run_id} was released")
            if self._launch.run_as is not None:
                sanitize(self.workspace, self._launch.run_as)  # files the host added since acquire()
            session, self._warm = self._warm or self.make_session(), None
            self._sessions.append(session)
            return session

    def make_session(self) -> ReplSession:
        return ReplSession(
            self._launch,
            cell_timeout_seconds=self._cfg.cell_timeout_seconds,
            startup_timeout_seconds=self._cfg.startup_timeout_seconds,
            caps=self._caps,
            budget=WorkspaceBudget(
                self.workspace,
                self._cfg.workspace_mb * 2**20,
                self._cfg.workspace_files,
                slack_bytes=VOLUME_SLACK_BYTES if self._volume is not None else 0,
            ),
            label=f"{self.run_id}-next" if self._released else self.run_id,
        )

    def interrupt(self) -> None:
        """Kill whatever cell is running in any of this lease's sessions (a stop or a timeout)."""
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.interrupt()

    def capture(self, room: Room = no_quota, counted: frozenset[str] = frozenset()) -> Captured:
        """The workspace's files now, each one the Run changed put in the store (blocking)."""
        if self._versions is None:
            raise SandboxError("this worker keeps no workspace versions (no store)")
        captured = self._versions.capture(self.workspace, self.known, room, counted)
        self.known = captured.known
        return captured

    def retire(self) -> None:
        """As release, without a warm REPL for the workspace's next Run."""
        self._pool = None
        self.release()

    def release(self) -> None:
        """Shut down every session this lease created; idempotent and never raises."""
        with self._lock:
            if self._released:
                return
            self._released = True
            idle = self._counted_by.lease_back() if self._counted_by is not None else False
            sessions, self._sessions = self._sessions, []
            if self._warm is not None:  # taken from the pool, never used: it goes down too
                sessions.append(self._warm)
                self._warm = None
        try:
            self._wind_down(sessions, idle)
        finally:  # the folder is ours until here (a deleted session's is removed by the sweep)
            if self._counted_by is not None:
                self._counted_by.returned(self.workspace)

    def _wind_down(self, sessions: list[ReplSession], idle: bool) -> None:
        for session in sessions:
            try:
                session.shutdown()
            except Exception as exc:
                log.warning("sandbox.shutdown_failed", run_id=self.run_id, error=str(exc))
        if self._versions is not None:  # the folder's next Run here starts from what we know
            self._versions.remember(self.workspace, self.known)
        try:  # what the Run left behind: no setuid bits, no links, devices, fifos or sockets
            sanitize(self.workspace, self._launch.run_as, between_runs=True)
        except Exception as exc:  # a hostile tree must not turn a release into a crash
            log.warning("sandbox.sanitize_failed", run_id=self.run_id, error=str(exc))
            return
        finally:
            if self._volume is not None:
                os.close(self._volume)
        if self._pool is not None and idle:  # a fresh REPL for this workspace's next Run
            self._pool.prewarm(self.workspace, self.make_session)
