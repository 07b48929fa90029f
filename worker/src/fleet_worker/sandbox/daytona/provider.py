"""The `daytona` provider: one Daytona sandbox per session, reused by its sequential Turns, with a
fresh REPL for each Turn. The session's workspace lives in the blob store as versions; the
sandbox's own disk holds the latest, synced at each lease's start and end (`sync.py`).

A REPL is reached over a Daytona session command: `repl_bridge.py` runs `repl_main.py` inside
the sandbox and carries its frames as base64 lines on the command's stdin and stdout. On this
side a relay process (`relay.py`) joins that command to the same pipes a local REPL has, so the
host's REPL session (timeouts, interrupts, output caps, the frame protocol) is the very one the
local provider uses. No inbound port, no preview URL, no polling: input goes by the toolbox API,
output comes back on its log stream.

Labels `fleet.deployment`, `fleet.session` and `fleet.run` mark every sandbox; `sweep` deletes
those whose last Run is over and idle (the worker runs it, and `fleet daytona sweep`). A session
sandbox also carries `fleet.workspace = synced`: one made by an older fleet, with the workspace
on a Daytona Volume, is never reused (the sweep deletes it).
"""

from __future__ import annotations

import itertools
import os
import secrets
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from daytona import (
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaConfig,
    DaytonaError,
    ListSandboxesQuery,
)

from fleet_shared.config import DaytonaSection, SandboxPythonSection, Settings
from fleet_shared.manifests import WORKSPACE_DIRS, Manifest
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.daytona.errors import run_failure
from fleet_worker.sandbox.daytona.files import DaytonaWorkspaceFiles
from fleet_worker.sandbox.daytona.sync import DaytonaVersions, Record
from fleet_worker.sandbox.errors import SandboxError, SandboxUnavailable
from fleet_worker.sandbox.jail import DRIVER_SOURCE, OUTPUT_FD_PLACEHOLDER, SITE_MOUNT, LaunchSpec
from fleet_worker.sandbox.provider import Captured, Room, ScratchLease, no_quota
from fleet_worker.sandbox.session import ReplSession
from fleet_worker.workspace_objects import WorkspaceObjects

log = structlog.get_logger(__name__)
WORKSPACE_MOUNT = "/workspace"
DRIVER_DIR = "/tmp/fleet-repl"
BRIDGE_SOURCE = Path(__file__).resolve().parents[1] / "repl_bridge.py"
LABEL_DEPLOYMENT, LABEL_SESSION, LABEL_RUN = "fleet.deployment", "fleet.session", "fleet.run"
LABEL_CHILD = "fleet.child"  # a child RLM's throwaway sandbox
LABEL_WORKSPACE, SYNCED = "fleet.workspace", "synced"  # its workspace is synced with the store


@dataclass(frozen=True)
class DaytonaAccess:
    """How to reach Daytona; the key stays out of every repr and log."""

    api_key: str
    api_url: str | None
    target: str | None

    def __repr__(self) -> str:
        return f"DaytonaAccess(api_url={self.api_url!r}, target={self.target!r})"

    def relay_env(self) -> dict[str, str]:
        """The relay's whole environment (the SDK reads these names itself). Where the config
        leaves the URL or target unset, the SDK's own env fallbacks are passed on, so the relay
        reaches the very Daytona this process does."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DAYTONA_API_KEY": self.api_key}
        for name, configured in (("DAYTONA_API_URL", self.api_url), ("DAYTONA_TARGET", self.target)):
            value = configured or os.environ.get(name)
            if value:
                env[name] = value
        return env

    def client(self) -> Daytona:
        return Daytona(DaytonaConfig(api_key=self.api_key, api_url=self.api_url, target=self.target))


def access_from(section: DaytonaSection, env: Mapping[str, str]) -> DaytonaAccess:
    """SandboxUnavailable (one line) when a referenced variable is not set."""
    key = env.get(section.api_key_env)
    if not key:
        raise SandboxUnavailable(
            f"sandbox.daytona.api_key_env names {section.api_key_env}, which is not set",
            fix=f"export {section.api_key_env}, or set sandbox.provider = 'local'",
        )
    url = None
    if section.api_url_env:
        url = env.get(section.api_url_env)
        if not url:
            raise SandboxUnavailable(
                f"sandbox.daytona.api_url_env names {section.api_url_env}, which is not set",
                fix=f"export {section.api_url_env}, or remove api_url_env to use Daytona's default",
            )
    return DaytonaAccess(api_key=key, api_url=url, target=section.target)


def daytona_provider(
    settings: Settings, environ: Mapping[str, str] | None = None, objects: WorkspaceObjects | None = None
) -> DaytonaSandboxProvider:
    """The provider for `sandbox.provider = "daytona"`; SandboxUnavailable (one line) when the
    profile does not configure it. `objects` (the store's workspace files) lets its leases keep
    workspace versions: a worker passes it, the operator commands need none."""
    section = settings.profile.sandbox.daytona
    if section is None:
        raise SandboxUnavailable(
            "sandbox.provider is 'daytona' but the profile has no [sandbox.daytona] table",
            fix="add one (see docs/daytona.md) or set sandbox.provider = 'local'",
        )
    if section.volume is not None:
        log.warning("daytona.volume_ignored", volume=section.volume, see="docs/daytona.md")
    return DaytonaSandboxProvider(
        section,
        access_from(section, os.environ if environ is None else environ),
        Caps.from_rlm(settings.profile.rlm),
        versions=DaytonaVersions(objects, section.workspace_files) if objects is not None else None,
        python=settings.profile.sandbox.python,
    )


class DaytonaLease:
    """One Run's hold on its session's sandbox: fresh REPLs over session commands."""

    def __init__(
        self, provider: DaytonaSandboxProvider, sandbox: Any, run_id: str, known: Record | None = None
    ) -> None:
        self.provider = provider
        self.sandbox = sandbox
        self.known = known  # what the worker knows of the workspace's files; None: not synced
        self._run_id = run_id
        self._files = DaytonaWorkspaceFiles(sandbox, WORKSPACE_MOUNT)
        self._sessions: list[ReplSession] = []
        self._remote: set[str] = set()  # remote session names not known to be ended
        self._counter = itertools.count(1)
        self._released = False
        self._lock = threading.Lock()

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def files(self) -> DaytonaWorkspaceFiles:
        return self._files

    def interpreter_factory(self) -> ReplSession:
        cfg = self.provider.cfg
        session = ReplSession(
            self.launch(),
            cell_timeout_seconds=cfg.cell_timeout_seconds,
            startup_timeout_seconds=cfg.startup_timeout_seconds,
            caps=self.provider.caps,
            label=f"{self._run_id}-daytona",
            fresh_launch=self.launch,  # every relay (a respawn too) opens a session of its own
            on_end=self.end_remote,  # a killed relay cannot end its command: the lease does
        )
        with self._lock:
            if self._released:
                raise SandboxUnavailable(f"the sandbox lease of run {self._run_id} was released", fix="")
            self._sessions.append(session)
        return session

    def launch(self) -> LaunchSpec:
        """A relay for a new remote session (Daytona session names cannot be reused)."""
        name = f"fleet-{self._run_id[:8]}-{next(self._counter)}-{secrets.token_hex(3)}"
        with self._lock:
            self._remote.add(name)
        env = {
            **self.provider.access.relay_env(),
            "FLEET_RELAY_SANDBOX": str(self.sandbox.id),
            "FLEET_RELAY_SESSION": name,
            "FLEET_RELAY_COMMAND": f"cd {WORKSPACE_MOUNT} && python3 -I -S -u {DRIVER_DIR}/repl_bridge.py"
            + self.provider.site_args(),
        }
        argv = (
            sys.executable,
            "-m",
            "fleet_worker.sandbox.daytona.relay",
            "--output-fd",
            OUTPUT_FD_PLACEHOLDER,
        )
        return LaunchSpec(argv=argv, env=env, cwd="/")

    def end_remote(self, launch: LaunchSpec) -> None:
        """End the remote session command of a REPL that is gone (its relay was killed by a
        timeout or an interrupt, so the REPL may still be running in the sandbox)."""
        name = launch.env.get("FLEET_RELAY_SESSION")
        if not name:
            return
        with self._lock:
            if name not in self._remote:
                return
            self._remote.discard(name)
        try:
            self.sandbox.process.delete_session(name)
        except Exception as exc:  # already gone (the relay ended it), or Daytona is away
            log.debug("daytona.session_gone", session=name, error_type=type(exc).__name__)

    def interrupt(self) -> None:
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.interrupt()

    def release(self) -> None:
        """Shut the REPLs down and end their remote session commands; the sandbox stays for the
        session's next Turn (Daytona stops it when idle, the sweep deletes it later)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            try:
                session.shutdown()
            except Exception as exc:
                log.warning("daytona.shutdown_failed", run_id=self._run_id, error=str(exc))
        with self._lock:
            leftover = sorted(self._remote)
        for name in leftover:  # sessions whose REPL never reported its end
            self.end_remote(LaunchSpec(argv=(), env={"FLEET_RELAY_SESSION": name}, cwd="/"))
        versions = self.provider.versions
        if versions is not None and self.known is not None:  # the sandbox's next Run here starts from it
            versions.remember(self.sandbox, self.known)

    def capture(self, room: Room = no_quota, counted: frozenset[str] = frozenset()) -> Captured:
        """The workspace's files now, each one the Run changed downloaded into the store."""
        versions = self.provider.versions
        if versions is None or self.known is None:
            raise SandboxError("this lease's workspace was not synced with the store")
        try:
            captured = versions.capture(self._files, self.known, room, counted)
        except DaytonaError as exc:
            snapshot = self.provider.cfg.snapshot
            raise run_failure(exc, snapshot=snapshot, doing="saving the workspace") from None
        self.known = captured.known
        return captured

    def retire(self) -> None:
        """As release, then delete the sandbox: the session's next Turn gets a new one."""
        self.release()
        if self.provider.versions is not None:
            self.provider.versions.forget(self.sandbox)
        try:
            self.sandbox.delete()
        except Exception as exc:
            log.warning("daytona.delete_failed", sandbox=str(self.sandbox.id), error_type=type(exc).__name__)


class DaytonaSandboxProvider:
    def __init__(
        self,
        cfg: DaytonaSection,
        access: DaytonaAccess,
        caps: Caps,
        *,
        versions: DaytonaVersions | None = None,
        python: SandboxPythonSection | None = None,
    ) -> None:
        self.cfg = cfg
        self.access = access
        self.caps = caps
        self.versions = versions
        self.python = python or SandboxPythonSection()
        self._client: Daytona | None = None
        self._lock = threading.Lock()

    @property
    def mode(self) -> str:
        return f"daytona (snapshot {self.cfg.snapshot})"

    def site_args(self) -> str:
        """The REPL's arguments for the snapshot's packages (`fleet daytona snapshot` installs
        sandbox.python.packages at SITE_MOUNT): none when the profile names no package."""
        if not self.python.packages:
            return ""
        preload = f" --preload {','.join(self.python.preload)}" if self.python.preload else ""
        return f" --site {SITE_MOUNT}{preload}"

    def check(self) -> None:
        """The configuration was checked when this provider was built; `fleet doctor daytona`
        is the live check (a worker must start even while Daytona is briefly away)."""

    def client(self) -> Daytona:
        with self._lock:
            if self._client is None:
                self._client = self.access.client()
            return self._client

    def acquire(
        self, workspace_id: str, run_id: str, session_id: str = "", manifest: Manifest | None = None
    ) -> DaytonaLease:
        """The session's sandbox, its workspace made to hold exactly `manifest` (with none, as
        it is), leased to the Run."""
        session_id = session_id or workspace_id
        if manifest is not None and self.versions is None:
            raise SandboxError("this worker keeps no workspace versions (no store)")
        doing = "preparing the session's sandbox"
        try:
            sandbox = self.sandbox_for(session_id, run_id)
            known = None
            if manifest is not None and self.versions is not None:
                doing = "copying the workspace into the sandbox"
                known = self.versions.materialise(DaytonaWorkspaceFiles(sandbox, WORKSPACE_MOUNT), manifest)
            doing = "copying the REPL into the sandbox"
            return self.lease_on(sandbox, run_id, known)
        except DaytonaError as exc:
            log.warning("daytona.acquire_failed", doing=doing, error_type=type(exc).__name__)
            raise run_failure(exc, snapshot=self.cfg.snapshot, doing=doing) from None

    def acquire_scratch(self, run_id: str) -> ScratchLease:
        """A child RLM's sandbox: a new one from the snapshot, its workspace empty, labelled with the
        parent Run (so the sweep finds it if a worker dies), deleted at release."""
        labels = {LABEL_DEPLOYMENT: self.cfg.deployment, LABEL_RUN: run_id, LABEL_CHILD: "1"}
        params = CreateSandboxFromSnapshotParams(
            snapshot=self.cfg.snapshot,
            labels=labels,
            network_block_all=True,
            auto_stop_interval=self.cfg.auto_stop_minutes,
            env_vars={},
        )
        doing = "creating the child RLM's sandbox"
        try:
            sandbox = self.client().create(params, timeout=self.cfg.create_timeout_seconds)
            doing = "copying the REPL into the child's sandbox"
            lease = self.lease_on(sandbox, run_id)
        except DaytonaError as exc:
            log.warning("daytona.acquire_failed", doing=doing, error_type=type(exc).__name__)
            raise run_failure(exc, snapshot=self.cfg.snapshot, doing=doing) from None
        # retire() deletes the sandbox: nothing more to throw away.
        return ScratchLease(lease, lambda: None)

    def lease_on(self, sandbox: Any, run_id: str, known: Record | None = None) -> DaytonaLease:
        """A lease on a started sandbox: the workspace layout made, the REPL copied in."""
        for folder in WORKSPACE_DIRS:
            sandbox.fs.create_folder(f"{WORKSPACE_MOUNT}/{folder}", "755")
        sandbox.fs.upload_file(DRIVER_SOURCE.read_bytes(), f"{DRIVER_DIR}/repl_main.py")
        sandbox.fs.upload_file(BRIDGE_SOURCE.read_bytes(), f"{DRIVER_DIR}/repl_bridge.py")
        return DaytonaLease(self, sandbox, run_id, known)

    def sandbox_for(self, session_id: str, run_id: str) -> Any:
        """The session's sandbox (started), or a new one; labelled with this Run either way."""
        client = self.client()
        labels = {LABEL_DEPLOYMENT: self.cfg.deployment, LABEL_SESSION: session_id, LABEL_WORKSPACE: SYNCED}
        found = list(client.list(ListSandboxesQuery(labels=labels)))
        for sandbox in found:
            if str(getattr(sandbox, "state", "")).lower().endswith(("error", "build_failed", "destroyed")):
                continue
            if not str(getattr(sandbox, "state", "started")).lower().endswith("started"):
                sandbox.start(timeout=self.cfg.create_timeout_seconds)
            sandbox.set_labels({**labels, LABEL_RUN: run_id})
            return sandbox
        params = CreateSandboxFromSnapshotParams(
            snapshot=self.cfg.snapshot,
            labels={**labels, LABEL_RUN: run_id},
            network_block_all=True,
            auto_stop_interval=self.cfg.auto_stop_minutes,
            env_vars={},
        )
        return client.create(params, timeout=self.cfg.create_timeout_seconds)

    def sweep(self, is_idle: Callable[[str | None], bool]) -> int:
        """Delete this deployment's sandboxes whose last Run (label `fleet.run`) `is_idle` says
        is over and idle; how many were deleted. Each is looked at again just before."""
        client = self.client()
        deleted = 0
        for listed in client.list(ListSandboxesQuery(labels={LABEL_DEPLOYMENT: self.cfg.deployment})):
            try:
                sandbox = client.get(listed.id)  # its labels now, not when the list was made
                if not is_idle((sandbox.labels or {}).get(LABEL_RUN)):
                    continue
                sandbox.delete()
                deleted += 1
                log.info(
                    "daytona.swept", sandbox=str(sandbox.id), run_id=(sandbox.labels or {}).get(LABEL_RUN)
                )
            except DaytonaError as exc:
                log.warning("daytona.sweep_failed", sandbox=str(listed.id), error_type=type(exc).__name__)
        return deleted

    def close(self) -> None:
        """Nothing is kept warm on this side: sandboxes belong to sessions and outlive workers."""
