"""`fleet doctor`'s sandbox checks: bwrap, user namespaces, cgroups, seccomp, then one real cell.

Each part is found the way the worker finds it (the same `LocalSandboxProvider` and `build_filter`),
so the doctor and the worker agree on what a sandbox gets. The last check starts a real REPL in a
throwaway workspace through the provider and runs one cell.

Cgroups are only read: the doctor may run beside a live worker (`kubectl exec` into its pod), and
the worker's setup moves processes, enables controllers and sweeps empty REPL groups. The cell gets
cgroup limits only under a sandboxes' group a worker already set up (its own REPL group there is
removed before the doctor returns); otherwise it runs without them, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from fleet_shared.config import SandboxPythonSection, Settings
from fleet_shared.doctor import Check
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.cgroups import (
    CONTROLLERS,
    Cgroup,
    Cgroups,
    CgroupView,
    Limits,
    cgroup_mounts,
    inspect,
)
from fleet_worker.sandbox.errors import INSTALL_HINT, SandboxError, SandboxUnavailable
from fleet_worker.sandbox.jail import LocalSandboxConfig, local_sandbox_config, resolve_python
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.python_env import (
    EnvironmentUnavailable,
    environment_key,
    environments_dir,
    find_environment,
    interpreter_version,
)
from fleet_worker.sandbox.removal import remove_tree
from fleet_worker.sandbox.syscalls import build_filter
from fleet_worker.sandbox.trust import sandbox_roots, untrusted_interpreter
from fleet_worker.sandbox.volumes import WorkspaceVolumes

# The doctor must answer within a bounded time, whatever the profile allows a real cell.
CELL_TIMEOUT_SECONDS = 20.0
STARTUP_TIMEOUT_SECONDS = 10.0
PROBE_TIMEOUT_SECONDS = 5.0
CELL = "print(1+1)"
# The distributions on the cell's path: only the packages' folder has any (-S: no site-packages).
PACKAGES_CELL = "import importlib.metadata as m\nprint(len(list(m.distributions())))"
CLONE_NEWUSER = 0x10000000
# Run in a child, so the doctor itself never enters a new namespace. Python 3.11 has no os.unshare.
UNSHARE_USERNS = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"sys.exit(0 if libc.unshare({CLONE_NEWUSER}) == 0 else os.strerror(ctypes.get_errno()))\n"
)
USERNS_SYSCTLS = (
    "/proc/sys/user/max_user_namespaces",
    "/proc/sys/kernel/unprivileged_userns_clone",
    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
)
USERNS_FIX = (
    "allow user namespaces: `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (or an "
    "AppArmor profile for bwrap), `sysctl -w user.max_user_namespaces=15000`; in a pod, the worker's "
    "securityContext from the chart (docs/deployment.md)"
)
CGROUPS_FIX = (
    "for whole-sandbox limits run the worker as root with writable memory, pids and cpu "
    "controllers (cgroup v2: delegated to the worker's cgroup); see docs/security.md"
)
SECCOMP_FIX = "apt-get install libseccomp2 (the worker's pyseccomp drives it)"
VOLUMES_FIX = (
    "for a kernel-enforced workspace budget run the worker as root with e2fsprogs (mkfs.ext4) and "
    "loop devices (the chart's privileged mode); see docs/security.md"
)


def check_sandbox(settings: Settings) -> list[Check]:
    """The sandbox checks for the profile's provider, in order."""
    if settings.profile.sandbox.provider == "daytona":
        detail = "sandbox.provider = daytona: `fleet doctor daytona` runs a cell in a disposable sandbox"
        return [Check(name="sandbox", status="skip", detail=detail)]
    cfg = doctor_config(local_sandbox_config(settings.profile.sandbox.local))
    packages, cfg, distributions = check_packages(
        cfg, settings.profile.sandbox.python, sandbox_roots(settings)
    )
    try:
        view = inspect()
    except OSError as exc:
        view = CgroupView(0, (), (), needs=f"cannot read this process's cgroups: {exc}")
    cell = run_cell(cfg, Caps.from_rlm(settings.profile.rlm), view, distributions)
    works = cell.status != "fail"
    return [
        check_bwrap(cfg),
        check_userns(sandbox_works=works),
        check_cgroups(cfg, view),
        check_seccomp(),
        check_workspace_budget(cfg),
        packages,
        cell,
    ]


def check_packages(
    cfg: LocalSandboxConfig, section: SandboxPythonSection, roots: tuple[Path, ...] = ()
) -> tuple[Check, LocalSandboxConfig, int | None]:
    """Whether this host has the profile's packages built (the doctor never builds them); the
    config the cell check runs with (theirs mounted, as a worker would), and how many
    distributions that cell must see (None: nothing mounted)."""
    name = "sandbox.python"
    if not section.packages:
        detail = "no packages: cells have the standard library only"
        return Check(name=name, status="ok", detail=detail), cfg, None
    root = environments_dir()
    python = resolve_python(cfg)
    distrust = untrusted_interpreter(python, roots)  # never run before it is found trusted
    if distrust is not None:
        return (
            Check(name=name, status="fail", detail=distrust, fix="set sandbox.local.python to auto"),
            cfg,
            None,
        )
    try:
        key = environment_key(section.packages, python, interpreter_version(python))
    except EnvironmentUnavailable as exc:
        fix = "install python3 or set sandbox.local.python"
        return Check(name=name, status="fail", detail=str(exc), fix=fix), cfg, None
    built = find_environment(root, key)
    if built is None:
        detail = f"{', '.join(section.packages)} not built in {root}: a worker builds them at its start"
        return Check(name=name, status="warn", detail=detail, fix="run `fleet sandbox build`"), cfg, None
    detail = f"{len(built.installed)} distributions in {built.site}"
    mounted = dataclasses.replace(cfg, python_site=str(built.site), preload=section.preload)
    return Check(name=name, status="ok", detail=detail), mounted, len(built.installed)


def doctor_config(cfg: LocalSandboxConfig) -> LocalSandboxConfig:
    """The profile's sandbox, with timeouts the doctor can wait for and no warm REPLs."""
    return dataclasses.replace(
        cfg,
        cell_timeout_seconds=min(cfg.cell_timeout_seconds, CELL_TIMEOUT_SECONDS),
        startup_timeout_seconds=min(cfg.startup_timeout_seconds, STARTUP_TIMEOUT_SECONDS),
        pool_size=0,
    )


def check_bwrap(cfg: LocalSandboxConfig) -> Check:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        if cfg.allow_unisolated:
            detail = "bubblewrap (bwrap) is not on PATH: cells run UNISOLATED (allow_unisolated = true)"
            return Check(name="sandbox.bwrap", status="warn", detail=detail, fix=INSTALL_HINT)
        return Check(
            name="sandbox.bwrap", status="fail", detail="bubblewrap (bwrap) is not on PATH", fix=INSTALL_HINT
        )
    setuid = " (setuid)" if os.stat(bwrap).st_mode & stat.S_ISUID else ""
    return Check(name="sandbox.bwrap", status="ok", detail=f"{bwrap}{setuid}: {bwrap_version(bwrap)}")


def bwrap_version(bwrap: str) -> str:
    try:
        done = subprocess.run(
            [bwrap, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"version unknown ({type(exc).__name__})"
    return done.stdout.strip() or "version unknown"


def check_userns(*, sandbox_works: bool) -> Check:
    """Whether this user can create a user namespace (bwrap's --unshare-user needs one, unless
    bwrap is setuid)."""
    refusal = userns_refusal()
    if refusal is None:
        who = "root" if os.geteuid() == 0 else "this (unprivileged) user"
        return Check(name="sandbox.userns", status="ok", detail=f"user namespaces are usable by {who}")
    detail = f"creating a user namespace was refused ({refusal}); {userns_sysctls()}"
    if sandbox_works:  # a setuid bwrap does without them
        return Check(name="sandbox.userns", status="warn", detail=f"{detail}; bwrap works regardless")
    return Check(name="sandbox.userns", status="fail", detail=detail, fix=USERNS_FIX)


def userns_refusal() -> str | None:
    """None when a child of this process could unshare a user namespace; why not otherwise."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", UNSHARE_USERNS],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the probe did not run: {type(exc).__name__}"
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["unknown"])[-1]


def userns_sysctls() -> str:
    """The kernel settings that decide it, as `name=value` (those this kernel has)."""
    found = []
    for path in USERNS_SYSCTLS:
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        found.append(f"{path.removeprefix('/proc/sys/').replace('/', '.')}={value}")
    return ", ".join(found) or "no user-namespace sysctls readable"


def check_cgroups(cfg: LocalSandboxConfig, view: CgroupView) -> Check:
    """The cgroup mode the worker would use, as read (nothing is created, moved or enabled)."""
    limits = f"memory {cfg.memory_mb} MB, {cfg.max_processes} processes, {cfg.cpus:g} CPU"
    root = os.geteuid() == 0
    if root and view.prepared:
        detail = (
            f"{view.summary}; the sandboxes' group a worker set up ({view.prepared[0]}) takes "
            f"whole-sandbox limits ({limits}): the cell below ran under them"
        )
        return Check(name="sandbox.cgroups", status="ok", detail=detail)
    if root and view.version and view.writable == view.available == tuple(CONTROLLERS):
        detail = (
            f"{view.summary}: a worker sets up whole-sandbox limits ({limits}) at startup "
            f"({view.needs}); the doctor changes nothing, so these limits were not exercised"
        )
        return Check(name="sandbox.cgroups", status="ok", detail=detail)
    reason = "the worker is not root" if not root else view.summary
    detail = (
        f"{host_cgroup_version()} host, not usable ({reason}): no whole-sandbox limits, each "
        f"process keeps its rlimits (memory {cfg.memory_mb} MB per process)"
    )
    return Check(name="sandbox.cgroups", status="warn", detail=detail, fix=CGROUPS_FIX)


def host_cgroup_version() -> str:
    try:
        mounts = cgroup_mounts()
    except OSError:
        return "unknown cgroup"
    v1 = any(controller for controller in mounts if controller)
    if v1:
        return "cgroup v1 (hybrid)" if "" in mounts else "cgroup v1"
    return "cgroup v2" if "" in mounts else "no cgroup"


def check_seccomp() -> Check:
    try:
        program = build_filter()
    except (OSError, AttributeError, ImportError) as exc:  # what the provider treats as "none"
        detail = f"libseccomp is not usable ({exc}): cells run without the syscall filter"
        return Check(name="sandbox.seccomp", status="warn", detail=detail, fix=SECCOMP_FIX)
    detail = f"libseccomp built the syscall filter ({len(program)} bytes)"
    return Check(name="sandbox.seccomp", status="ok", detail=detail)


def check_workspace_budget(cfg: LocalSandboxConfig) -> Check:
    """Whether the kernel holds each workspace to its budget, or only the worker's check does."""
    budget = f"{cfg.workspace_mb} MiB and {cfg.workspace_files} entries"
    if cfg.workspace_volumes and WorkspaceVolumes.available():
        detail = f"each workspace is a loop-mounted ext4 volume of {budget}: a write past it gets ENOSPC"
        return Check(name="sandbox.workspace_budget", status="ok", detail=detail)
    why = "sandbox.local.workspace_volumes = false" if not cfg.workspace_volumes else "cannot mount volumes"
    detail = (
        f"{budget}, checked while cells run ({why}): a fast writer passes it until it is stopped, "
        "then what it wrote past the budget is removed"
    )
    fix = None if not cfg.workspace_volumes else VOLUMES_FIX
    return Check(name="sandbox.workspace_budget", status="warn", detail=detail, fix=fix)


class DoctorCgroups(Cgroups):
    """The cgroups a worker prepared (none if it did not), remembering the REPL groups the
    doctor creates so each is removed before the doctor returns, not left to a background retry."""

    def __init__(self, view: CgroupView) -> None:
        found = Cgroups.prepared(view)
        super().__init__(found.bases, found.version, found.reason)
        self.created: list[Cgroup] = []

    def create(self, limits: Limits) -> Cgroup:
        cgroup = super().create(limits)
        self.created.append(cgroup)
        return cgroup

    def remove_created(self) -> None:
        for cgroup in self.created:
            cgroup.try_rmdir(attempts=100, pause=0.05)


def run_cell(
    cfg: LocalSandboxConfig, caps: Caps, view: CgroupView, distributions: int | None = None
) -> Check:
    """Start a REPL the way the worker does, in a throwaway workspace, and run one cell; with the
    packages mounted, the cell also counts the distributions it can import from."""
    cgroups = DoctorCgroups(view)
    provider = LocalSandboxProvider(cfg, caps=caps, cgroups=lambda _limits: cgroups)
    scratch = Path(tempfile.mkdtemp(prefix="fleet-doctor-"))
    scratch.chmod(0o711)  # ours: a sandbox uid passes through to its workspace, as in a data dir
    try:
        check = timed_cell(provider, scratch / "workspaces", distributions)
    finally:
        provider.close()
        cgroups.remove_created()
        with contextlib.suppress(OSError):
            remove_tree(scratch)
    if cgroups.bases or check.status == "fail":
        return check
    detail = f"{check.detail}; cgroup limits not exercised: {cgroups.reason}"
    return msgspec.structs.replace(check, detail=detail)


def timed_cell(provider: LocalSandboxProvider, workspaces: Path, distributions: int | None = None) -> Check:
    started = time.monotonic()
    try:
        isolation = provider.isolation  # settles it as the worker does, probe REPL included
    except SandboxUnavailable as exc:
        return Check(name="sandbox.cell", status="fail", detail=exc.reason, fix=exc.fix)
    provider.place_workspaces(workspaces, workspaces)
    try:
        lease = provider.acquire_scratch("doctor")
        try:
            session = lease.interpreter_factory()
            result = session.execute(CELL, {}, {}, None)
            seen = session.execute(PACKAGES_CELL, {}, {}, None) if distributions is not None else None
        finally:
            lease.release()
    except (SandboxError, OSError) as exc:
        detail = f"the sandbox started but the cell failed: {type(exc).__name__}: {exc}"
        return Check(name="sandbox.cell", status="fail", detail=detail, fix="see docs/security.md")
    elapsed = time.monotonic() - started
    printed = result.stdout.strip()
    if result.error is not None or printed != "2":
        problem = f"{result.error.type}: {result.error.message}" if result.error else f"printed {printed!r}"
        detail = f"{CELL} in a {isolation.mode} sandbox did not print 2 ({problem})"
        return Check(name="sandbox.cell", status="fail", detail=detail, fix="see docs/security.md")
    detail = f"{CELL} printed 2 in a {isolation.mode} sandbox ({elapsed:.2f}s, REPL start included)"
    if seen is not None:
        if seen.error is not None or seen.stdout.strip() != str(distributions):
            problem = f"{seen.error.type}: {seen.error.message}" if seen.error else seen.stdout.strip()
            detail = f"the cell cannot see the {distributions} distributions of sandbox.python ({problem})"
            return Check(name="sandbox.cell", status="fail", detail=detail, fix="run `fleet sandbox build`")
        detail += f"; it sees the {distributions} distributions of sandbox.python"
    if isolation.bwrap is None:
        fix = "install bubblewrap and set sandbox.local.allow_unisolated = false"
        return Check(name="sandbox.cell", status="warn", detail=detail, fix=fix)
    return Check(name="sandbox.cell", status="ok", detail=detail)
