"""The local sandbox provider: workspaces on this machine, leased to Runs, jailed by bubblewrap."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog

from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.errors import (
    SandboxError,
    SandboxUnavailable,
)
from fleet_worker.sandbox.jail import (
    DRIVER_SOURCE,
    SANDBOX_UID,
    WORKSPACE_MOUNT,
    LaunchSpec,
    LocalSandboxConfig,
    bwrap_command,
    resolve_python,
    sandbox_env,
    unisolated_command,
)
from fleet_worker.sandbox.session import ReplSession
from fleet_worker.sandbox.workspace import HOST_PATHS, prepare_layout, sanitize, unreachable_ancestor

log = structlog.get_logger(__name__)


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
        caps: Caps,
        isolated: bool,
        staged_driver: Path | None = None,
    ) -> None:
        self.workspace = workspace
        self.run_id = run_id
        # False when cells run as plain subprocesses (allow_unisolated with no working bwrap).
        self.isolated = isolated
        self._launch = launch
        self._cfg = cfg
        self._caps = caps
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
                sanitize(self.workspace, self._launch.run_as)  # files the host added since acquire()
            session = ReplSession(
                self._launch,
                cell_timeout_seconds=self._cfg.cell_timeout_seconds,
                startup_timeout_seconds=self._cfg.startup_timeout_seconds,
                caps=self._caps,
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
        try:  # what the Run left behind: no setuid bits, no devices, fifos or sockets
            sanitize(self.workspace, self._launch.run_as)
        except OSError as exc:
            log.warning("sandbox.sanitize_failed", run_id=self.run_id, error=str(exc))
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
        caps: Caps,
        search_path: str | None = None,
    ) -> None:
        """`search_path` is the PATH used to find bwrap (default: this process's PATH)."""
        self._cfg = cfg
        self._caps = caps
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

    def can_reach(self, root: Path) -> bool:
        """Whether sandboxed code (uid 65534 on a root worker) can pass through to `root`."""
        return self._run_as is None or unreachable_ancestor(root / "probe", self._run_as) is None

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
        HOST_PATHS.add(workspace.parent)
        prepare_layout(workspace)
        driver, staged = DRIVER_SOURCE, None
        if self._run_as is not None:
            driver = staged = stage_driver()
            HOST_PATHS.add(staged.parent)
            for path in (workspace, staged.parent):
                blocked = unreachable_ancestor(path, self._run_as)
                if blocked is not None:
                    shutil.rmtree(staged.parent, ignore_errors=True)
                    log.error(
                        "sandbox.unreachable_path", path=str(path), blocked=str(blocked), uid=self._run_as
                    )
                    raise SandboxError(
                        "the sandbox's uid cannot reach its workspace on this worker "
                        "(see sandbox.unreachable_path in the worker log); chmod o+x the folder, "
                        "move the data directory, or run the worker as a non-root user"
                    )
        sanitize(workspace, self._run_as)
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
            caps=self._caps,
            isolated=isolation.bwrap is not None,
            staged_driver=staged,
        )
