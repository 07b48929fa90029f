"""The local sandbox provider: workspaces on this machine, leased to Runs, jailed by bubblewrap."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from fleet_shared.manifests import WORKSPACE_DIRS, Manifest
from fleet_shared.workspaces import create_dirs
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.cgroups import Cgroups, Limits
from fleet_worker.sandbox.driver import StagedDriver, stage_driver, sweep_staged
from fleet_worker.sandbox.errors import (
    SandboxError,
    SandboxUnavailable,
)
from fleet_worker.sandbox.jail import (
    WORKSPACE_MOUNT,
    LaunchSpec,
    LocalSandboxConfig,
    bwrap_command,
    jailed_python,
    resolve_python,
    sandbox_env,
    sandbox_threads,
    unisolated_command,
)
from fleet_worker.sandbox.lease import LocalSandboxLease
from fleet_worker.sandbox.pool import WarmPool
from fleet_worker.sandbox.provider import ScratchLease
from fleet_worker.sandbox.removal import remove_tree
from fleet_worker.sandbox.scratch import ScratchClaim, sweep_scratch
from fleet_worker.sandbox.sync import Baseline, VersionedFolders
from fleet_worker.sandbox.syscalls import build_filter
from fleet_worker.sandbox.trust import uid_range_clash, untrusted_interpreter
from fleet_worker.sandbox.volumes import WorkspaceVolumes
from fleet_worker.sandbox.workspace import (
    HOST_PATHS,
    prepare_layout,
    sanitize,
    unreachable_ancestor,
)

log = structlog.get_logger(__name__)
PROBE_RUN = "probe"
VOLUMES_KEPT = 24  # workspace volumes a worker keeps mounted for their next Runs


def prepare_workspace_root(root: Path) -> Path:
    """The folder of workspaces searchable, not listable, by sandbox uids. Folders it creates get
    that mode; one that exists keeps its own (place_workspaces moves on when sandboxes cannot
    pass through it)."""
    root = root.resolve()
    create_dirs(root, 0o711)
    return root


@dataclass(frozen=True)
class Isolation:
    """What check() settled on: the bwrap binary (None means unisolated), the interpreter, the
    seccomp program (None when libseccomp is missing) and the cgroups (mode `none` if none)."""

    bwrap: str | None
    python: str
    seccomp: bytes | None = None
    cgroups: Cgroups | None = None

    @property
    def mode(self) -> str:
        """One line for the startup log and /ready: what this worker's sandboxes get."""
        if self.bwrap is None:
            return "UNISOLATED (plain subprocesses: no jail)"
        parts = ["bwrap", "seccomp" if self.seccomp else "no seccomp"]
        cgroups = self.cgroups
        parts.append(cgroups.mode if cgroups and cgroups.bases else "rlimits only")
        return "+".join(parts)


class LocalSandboxProvider:
    """Creates sandbox leases on this machine, jailed with bubblewrap unless told otherwise."""

    def __init__(
        self,
        cfg: LocalSandboxConfig,
        *,
        caps: Caps,
        search_path: str | None = None,
        workspaces: Path | None = None,
        cgroups: Callable[[Limits], Cgroups] = Cgroups.detect,
        sandbox_roots: tuple[Path, ...] = (),
        versions: VersionedFolders | None = None,
    ) -> None:
        """`search_path` is the PATH used to find bwrap (default: this process's PATH);
        `workspaces` the folder that holds one folder per workspace (see place_workspaces);
        `cgroups` finds the REPLs' cgroups (`fleet doctor` passes one that writes nothing shared);
        `sandbox_roots` the folders sandboxed code can write to (the data dirs), where the
        interpreter must never be; `versions` keeps workspace folders in step with the store."""
        self.workspaces = workspaces
        self.versions = versions
        self.volumes: WorkspaceVolumes | None = None  # a root worker's hard limit (place_workspaces)
        self._sandbox_roots = sandbox_roots
        self._find_cgroups = cgroups
        self._cfg = cfg
        self._caps = caps
        self._search_path = search_path
        # A root worker never runs cells as host root: each workspace's REPLs get a uid of their own.
        self._root = os.geteuid() == 0
        self._isolation: Isolation | None = None
        self._driver: StagedDriver | None = None
        self._pool = WarmPool(cfg.pool_size, cfg.pool_idle_seconds)
        self._lock = threading.RLock()

    def check(self) -> None:
        """Settle how cells will run; SandboxUnavailable if they cannot run isolated and must."""
        with self._lock:
            if self._isolation is None:
                self._isolation = self._settle()

    @property
    def isolation(self) -> Isolation:
        """What check() settled on (settled now if it was not yet)."""
        self.check()
        assert self._isolation is not None
        return self._isolation

    @property
    def mode(self) -> str:
        return self.isolation.mode

    def sandbox_uid(self, workspace: Path) -> int | None:
        """The host uid a workspace's REPLs run as on a root worker (None: the worker's own)."""
        if not self._root:
            return None
        digest = int(hashlib.sha256(workspace.name.encode()).hexdigest(), 16)
        return self._cfg.uid_base + digest % self._cfg.uid_count

    def can_reach(self, root: Path) -> bool:
        """Whether sandboxed code (its own uid on a root worker) can pass through to `root`."""
        uid = self.sandbox_uid(root / "probe")
        return uid is None or unreachable_ancestor(root / "probe", uid) is None

    def place_workspaces(self, preferred: Path, relocated: Path) -> Path:
        """Keep workspaces under `preferred`, unless a root worker's sandbox uid cannot get
        there (a checkout under /root, say): then under `relocated`, so Turns still work. The
        scratch folders a crashed worker left there are swept now."""
        root = prepare_workspace_root(preferred)
        if not self.can_reach(root):
            log.warning("sandbox.workspaces_relocated", unreachable=str(root), using=str(relocated))
            root = prepare_workspace_root(relocated)
        self.workspaces = root
        if self._cfg.workspace_volumes and WorkspaceVolumes.available():
            self.volumes = WorkspaceVolumes(
                root.parent / f"{root.name}-volumes",
                size_bytes=self._cfg.workspace_mb * 2**20,
                inodes=self._cfg.workspace_files + len(WORKSPACE_DIRS) + 1,
                keep=VOLUMES_KEPT,
            )
        self.sweep_scratch()
        return root

    def sweep_scratch(self) -> int:
        """Remove the scratch folders no live lease holds (see sandbox/scratch.py); how many."""
        if self.workspaces is None:
            return 0
        return sweep_scratch(self.workspaces, unmount=self.volumes.drop if self.volumes else None)

    @property
    def warm_pool(self) -> WarmPool:
        return self._pool

    def acquire(
        self, workspace_id: str, run_id: str, session_id: str = "", manifest: Manifest | None = None
    ) -> LocalSandboxLease:
        """Prepare the workspace (memory/ skills/ attachments/ artifacts/), holding exactly what
        `manifest` (a version) holds, and lease it to a run; with no manifest, as it is."""
        if self.workspaces is None or not workspace_id or "/" in workspace_id or workspace_id in (".", ".."):
            raise SandboxError("the workspace cannot be placed (no workspaces folder, or a bad id)")
        self.check()
        assert self._isolation is not None
        folder = (self.workspaces / workspace_id).resolve()
        volume = self._hold_volume(folder)
        try:
            known = None
            if manifest is not None:
                if self.versions is None:
                    raise SandboxError("this worker keeps no workspace versions (no store)")
                known = self.versions.materialise(folder, manifest, self.sandbox_uid(folder))
            return self._lease(folder, run_id, self._isolation, known=known, volume=volume)
        except BaseException:
            if volume is not None:
                os.close(volume)
            raise

    def _hold_volume(self, folder: Path) -> int | None:
        """The folder's volume, held for a lease (a root worker's hard limit; None without)."""
        if self.volumes is None:
            return None
        volume, made = self.volumes.hold(folder, self.sandbox_uid(folder))
        if made:  # a warm REPL bound to the folder holds the volume this one replaced
            self._pool.discard(folder)
        return volume

    def acquire_scratch(self, run_id: str) -> ScratchLease:
        """A child RLM's sandbox: a new empty folder beside the workspaces (so it gets a uid of
        its own), never pooled, removed at release (or, if that fails, by the sweep)."""
        if self.workspaces is None:
            raise SandboxError("the workspace cannot be placed (no workspaces folder)")
        self.check()
        assert self._isolation is not None
        claim = ScratchClaim(self.workspaces)
        volume: int | None = None

        def discard() -> None:
            if volume is not None:
                os.close(volume)
                if self.volumes is not None:
                    self.volumes.drop(claim.folder)
            claim.discard()

        try:
            volume = self._hold_volume(claim.folder)
            lease = self._lease(claim.folder, run_id, self._isolation, pooled=False)
        except BaseException:
            with contextlib.suppress(OSError, SandboxError):
                discard()
            raise
        return ScratchLease(lease, discard)

    def _settle(self) -> Isolation:
        python = resolve_python(self._cfg)
        if not os.access(python, os.X_OK):
            raise SandboxUnavailable(
                f"the sandbox interpreter {python} does not exist or is not executable",
                fix="install python3 or set sandbox.local.python",
            )
        roots = (*self._sandbox_roots, *([self.workspaces] if self.workspaces else []))
        distrust = untrusted_interpreter(python, roots)
        if distrust is not None:
            raise SandboxUnavailable(
                distrust, fix="set sandbox.local.python to an interpreter that root installed (or auto)"
            )
        clash = uid_range_clash(self._cfg.uid_base, self._cfg.uid_count) if self._root else None
        if clash is not None:
            raise SandboxUnavailable(clash, fix="move sandbox.local.uid_base to a range no account uses")
        site = self._cfg.python_site
        blocked = unreachable_ancestor(Path(site), self._cfg.uid_base) if site and self._root else None
        if blocked is not None:
            raise SandboxUnavailable(
                f"the sandbox's uids cannot reach its packages in {site} (blocked at {blocked})",
                fix="set FLEET_SANDBOX_PYTHON_DIR to a folder every user can pass through (chmod o+x)",
            )
        seccomp, cgroups = self._seccomp(), self._find_cgroups(self._limits())
        if not cgroups.bases:
            log.warning("sandbox.no_cgroups", reason=cgroups.reason, detail="limits are per process only")
        bwrap = shutil.which("bwrap", path=self._search_path)
        if bwrap is None:
            problem = "bubblewrap (bwrap) was not found on PATH"
        else:
            isolation = Isolation(bwrap=bwrap, python=python, seccomp=seccomp, cgroups=cgroups)
            failure = self._probe(isolation)
            if failure is None:
                return isolation
            problem = f"bwrap at {bwrap} cannot start a sandbox: {failure}"
        if not self._cfg.allow_unisolated:
            raise SandboxUnavailable(problem)
        log.warning(
            "sandbox.UNISOLATED",
            reason=problem,
            detail="cells run as plain subprocesses with the worker's filesystem and network "
            "in reach, because sandbox.local.allow_unisolated = true",
        )
        return Isolation(bwrap=None, python=python, cgroups=cgroups)

    def _limits(self) -> Limits:
        cfg = self._cfg
        return Limits(memory_bytes=cfg.memory_mb * 1024 * 1024, pids=cfg.max_processes, cpus=cfg.cpus)

    @staticmethod
    def _seccomp() -> bytes | None:
        try:
            return build_filter()
        except (OSError, AttributeError, ImportError) as exc:  # no usable libseccomp on this host
            log.warning("sandbox.no_seccomp", error=str(exc))
            return None

    def _probe(self, isolation: Isolation) -> str | None:
        """Start one real REPL in a throwaway workspace; why it failed, or None if it worked."""
        workspace = Path(tempfile.mkdtemp(prefix="fleet-probe-"))
        lease: LocalSandboxLease | None = None
        try:
            lease = self._lease(workspace, PROBE_RUN, isolation)
            lease.interpreter_factory().start()
        except SandboxError as exc:
            return str(exc)
        finally:
            if lease is not None:
                lease.release()
            with contextlib.suppress(OSError):
                remove_tree(workspace)
        return None

    def _lease(
        self,
        workspace: Path,
        run_id: str,
        isolation: Isolation,
        *,
        pooled: bool = True,
        known: Baseline | None = None,
        volume: int | None = None,
    ) -> LocalSandboxLease:
        workspace = workspace.resolve()
        HOST_PATHS.add(workspace.parent)
        prepare_layout(workspace)
        run_as = self.sandbox_uid(workspace)
        driver = self._staged_driver(isolation)
        if run_as is not None:
            for path in (workspace, driver.parent):
                blocked = unreachable_ancestor(path, run_as)
                if blocked is not None:
                    log.error("sandbox.unreachable_path", path=str(path), blocked=str(blocked), uid=run_as)
                    raise SandboxError(
                        "the sandbox's uid cannot reach its workspace on this worker "
                        "(see sandbox.unreachable_path in the worker log); chmod o+x the folder, "
                        "move the data directory, or run the worker as a non-root user"
                    )
        if known is None:  # a materialised folder is already as a sanitize pass leaves it
            sanitize(workspace, run_as, between_runs=True)
        cgroups = isolation.cgroups if isolation.cgroups and isolation.cgroups.bases else None
        if isolation.bwrap is not None:
            inside = os.geteuid() if run_as is None else run_as
            argv = bwrap_command(
                self._cfg,
                workspace,
                isolation.python,
                driver,
                uid=inside,
                bwrap=isolation.bwrap,
                seccomp=isolation.seccomp is not None,
            )
            env, cwd = sandbox_env(WORKSPACE_MOUNT, sandbox_threads(self._cfg)), "/"
        else:
            argv = unisolated_command(self._cfg, isolation.python, driver)
            env, cwd = sandbox_env(str(workspace), sandbox_threads(self._cfg)), str(workspace)
        launch = LaunchSpec(
            argv=tuple(argv),
            env=env,
            cwd=cwd,
            run_as=run_as,
            seccomp=isolation.seccomp,
            driver=driver if isolation.bwrap is not None else None,
            cgroups=cgroups,
            limits=self._limits(),
        )
        return LocalSandboxLease(
            workspace=workspace,
            run_id=run_id,
            launch=launch,
            cfg=self._cfg,
            caps=self._caps,
            isolated=isolation.bwrap is not None,
            pool=self._pool if pooled and run_id != PROBE_RUN else None,
            versions=self.versions if known is not None else None,
            known=known,
            volume=volume,
        )

    def _staged_driver(self, isolation: Isolation) -> Path:
        """One copy of the driver per provider, readable by every sandbox uid (a root worker's own
        install may not be): the same path for every REPL, so a warm one matches its next Run."""
        isolated = isolation.bwrap is not None
        with self._lock:
            staged = self._driver
            if staged is None or not staged.current(isolation.python, isolated):
                if staged is not None:  # the probe's for a jail that failed, or an older Python's
                    shutil.rmtree(staged.path.parent, ignore_errors=True)
                else:
                    sweep_staged()
                compile_as = self._cfg.uid_base if self._root else None
                jail = (
                    jailed_python(isolation.python, uid=compile_as or os.geteuid(), bwrap=isolation.bwrap)
                    if isolation.bwrap is not None
                    else ()
                )
                staged = self._driver = stage_driver(isolation.python, isolated, compile_as, jail)
                HOST_PATHS.add(staged.path.parent)
            return staged.path

    def close(self) -> None:
        """Shut down the warm REPLs, remove the staged driver and this worker's volumes (the
        worker is stopping)."""
        self._pool.close()
        if self.volumes is not None:
            self.volumes.close()
        with self._lock:
            driver, self._driver = self._driver, None
        if driver is not None:
            shutil.rmtree(driver.path.parent, ignore_errors=True)
