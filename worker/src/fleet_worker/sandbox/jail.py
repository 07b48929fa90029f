"""The bubblewrap jail: which interpreter runs the REPL and the exact argv that isolates it."""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from fleet_shared.config import LocalSandboxSection
from fleet_worker.sandbox.cgroups import Cgroups, Limits
from fleet_worker.sandbox.errors import SandboxUnavailable

log = structlog.get_logger(__name__)


WORKSPACE_MOUNT = "/workspace"
SITE_MOUNT = "/opt/sandbox-python"  # the packages (sandbox.python), in a jail or a Daytona snapshot
# Replaced by fd numbers when a REPL is spawned (fleet_worker.sandbox.process).
OUTPUT_FD_PLACEHOLDER = "{output-fd}"
SECCOMP_FD_PLACEHOLDER = "{seccomp-fd}"
DRIVER_FD_PLACEHOLDER = "{driver-fd}"
DRIVER_DIR_MOUNT = "/opt/fleet"
DRIVER_MOUNT = f"{DRIVER_DIR_MOUNT}/repl_main.py"
DRIVER_SOURCE = Path(__file__).with_name("repl_main.py")
# Top-level host dirs that hold the OS (merged-usr hosts make all but /usr symlinks into it).
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# What the host installed itself: the jail sees it empty, but for the interpreter's own files.
USR_LOCAL = Path("/usr/local")
MASK_BYTES = str(1 << 20)  # a mask's tmpfs holds only the mount points of the binds inside it


@dataclass(frozen=True)
class LocalSandboxConfig:
    """Settings of the local sandbox (`sandbox.local.*` in the app config)."""

    allow_unisolated: bool = False
    python: str = "auto"
    cell_timeout_seconds: float = 60.0
    memory_mb: int = 1024  # the whole REPL (every process, /tmp included) with a cgroup; else each process
    max_processes: int = 64
    max_file_mb: int = 64
    tmp_mb: int = 256  # /tmp, a tmpfs in RAM
    workspace_mb: int = 1024  # what /workspace may grow to during a cell
    workspace_files: int = 100_000  # and how many entries it may hold
    workspace_volumes: bool = True  # on a root worker, each workspace a size-limited volume
    cpus: float = 1.0  # CPU time per wall second, with a cgroup
    uid_base: int = 200_000  # on a root worker, each workspace's sandbox runs as one uid of
    uid_count: int = 65_536  # [uid_base, uid_base + uid_count): never a real user, never nobody
    pool_size: int = 4  # warm REPLs kept for workspaces whose next Run is likely soon
    pool_idle_seconds: float = 300.0
    startup_timeout_seconds: float = 10.0
    # sandbox.python: the built packages' folder on this host (None: the standard library only),
    # and the modules each REPL imports before its first cell.
    python_site: str | None = None
    preload: tuple[str, ...] = ()


def local_sandbox_config(section: LocalSandboxSection) -> LocalSandboxConfig:
    """The provider's settings from the profile's `sandbox.local` table (the same names)."""
    return LocalSandboxConfig(**msgspec.structs.asdict(section))


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one REPL process."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    # Host uid (and gid) to drop to before exec; None keeps the worker's own identity.
    run_as: int | None = None
    seccomp: bytes | None = None  # the BPF program for bwrap's --seccomp
    # The staged REPL driver, copied into the jail through an fd: no host path of it shows there.
    driver: Path | None = None
    cgroups: Cgroups | None = None  # one cgroup per REPL, with `limits`
    limits: Limits | None = None


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


# Native libraries (numpy's OpenBLAS, OpenMP) start one thread per host core unless told: each
# counts against the REPL's processes and its address space, so a large host would fail imports.
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def sandbox_threads(cfg: LocalSandboxConfig) -> int:
    """Threads a cell's native libraries may start: the CPUs the sandbox gets, at least one."""
    return max(1, math.ceil(cfg.cpus))


def sandbox_env(home: str, threads: int = 1) -> dict[str, str]:
    """The whole environment of a REPL; nothing of the worker's (API keys included) leaks in."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        **dict.fromkeys(THREAD_VARIABLES, str(threads)),
    }


def driver_args(cfg: LocalSandboxConfig, driver: str, site: str | None = None) -> list[str]:
    """Interpreter flags, driver path and resource limits (-I ignores PYTHON* env, hence -B);
    `site` is the packages' folder as the REPL sees it (it runs with -S: nothing else is added)."""
    packages = ["--site", site] if site else []
    if site and cfg.preload:
        packages += ["--preload", ",".join(cfg.preload)]
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
        "--output-fd",
        OUTPUT_FD_PLACEHOLDER,
        *packages,
    ]


def is_system_path(path: str) -> bool:
    """True for paths under /usr or the /bin, /lib... dirs that the jail always mounts."""
    parts = Path(path).parts
    return len(parts) > 1 and parts[0] == "/" and parts[1] in SYSTEM_DIRS


def python_mount(python: str) -> tuple[str, str | None]:
    """The interpreter path to exec in the jail, and its install prefix to ro-bind (if not /usr)."""
    real = os.path.realpath(python)
    if is_system_path(real):
        shown = is_system_path(python) and not Path(python).is_relative_to(USR_LOCAL)
        return (python if shown else real), None
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


def usr_local(executable: str, local: Path = USR_LOCAL) -> list[str]:
    """/usr/local as the jail sees it: an empty read-only tmpfs over what the host installed
    there, holding only the interpreter's own files when it lives there (itself, its stdlib
    without site-packages, its libpython). Nothing to hide when the host has no such folder."""
    if local.is_symlink() or not local.is_dir():
        return []
    args = ["--size", MASK_BYTES, "--tmpfs", str(local)]
    binary = Path(executable)
    masked = [local]
    if binary.is_relative_to(local):
        version = binary.name.removeprefix("python")
        pattern = version if version[:1].isdigit() else "3*"  # a name without its version: any 3.x
        args += ["--ro-bind", str(binary), str(binary)]
        for path in sorted((local / "lib").glob(f"libpython{pattern}*")):
            args += ["--ro-bind", str(path), str(path)]
        for stdlib in sorted((local / "lib").glob(f"python{pattern}")):
            args += ["--ro-bind", str(stdlib), str(stdlib)]
            if (stdlib / "site-packages").is_dir():  # never on the path (-S): its listing hidden
                args += ["--size", MASK_BYTES, "--tmpfs", str(stdlib / "site-packages")]
                masked.append(stdlib / "site-packages")
    for path in masked:
        args += ["--remount-ro", str(path)]
    return args


def bwrap_command(
    cfg: LocalSandboxConfig,
    workspace: Path,
    python: str,
    driver: Path,
    *,
    uid: int,
    bwrap: str = "bwrap",
    seccomp: bool = True,
) -> list[str]:
    """The bwrap argv for one REPL; only /usr, the interpreter and the workspace are visible.
    The driver is a copy the jail reads from an fd (LaunchSpec.driver): its mount shows no host
    path, and the workspace is bound as it is (a volume's mount shows none either)."""
    argv = jail_args(python, uid=uid, bwrap=bwrap, tmp_mb=cfg.tmp_mb, threads=sandbox_threads(cfg))
    if seccomp:
        argv += ["--seccomp", SECCOMP_FD_PLACEHOLDER]
    if cfg.python_site is not None:
        argv += ["--ro-bind", cfg.python_site, SITE_MOUNT]
    argv += [
        "--bind",
        os.path.abspath(workspace),
        WORKSPACE_MOUNT,
        "--ro-bind-data",
        DRIVER_FD_PLACEHOLDER,
        driver_mount(driver),
        "--chdir",
        WORKSPACE_MOUNT,
        *READ_ONLY_ROOT,
        "--",
        python_mount(python)[0],
        *driver_args(cfg, driver_mount(driver), SITE_MOUNT if cfg.python_site else None),
    ]
    return argv


# Nothing writable but /workspace, /tmp and /dev/shm (the jail's root and /dev are tmpfs that
# would otherwise take writes without a size limit).
READ_ONLY_ROOT = ("--remount-ro", "/dev", "--remount-ro", "/")


# Where a distribution's Python keeps packages the host installed (Debian's python3-* among them):
# a cell's path never has them, and a `python3` a cell starts without -S would.
SITE_DIR_PATTERNS = tuple(
    f"{lib}/python3*/{kind}-packages" for lib in ("lib", "lib64") for kind in ("site", "dist")
)


@functools.cache  # read once per worker: every lease's jail would otherwise walk /usr/lib again
def host_site_masks(roots: tuple[str, ...]) -> tuple[str, ...]:
    """An empty read-only tmpfs over each host site-packages folder under `roots` (/usr, and an
    interpreter's own prefix), as they were when the worker started: what the host installed
    stays out of every jail."""
    args: list[str] = []
    for root in roots:
        for pattern in SITE_DIR_PATTERNS:
            for folder in sorted(Path(root).glob(pattern)):
                if folder.is_dir() and not folder.is_symlink():
                    args += ["--size", MASK_BYTES, "--tmpfs", str(folder), "--remount-ro", str(folder)]
    return tuple(args)


def jail_args(python: str, *, uid: int, bwrap: str, tmp_mb: int, threads: int = 1) -> list[str]:
    """What every jail shares, up to its mounts of its own: all namespaces, no environment but
    ours, the system and the interpreter read-only, private /proc, /dev, /tmp and /dev/shm."""
    executable, prefix = python_mount(python)
    argv = [
        bwrap,
        # Every namespace, network included: the jail has only its own, empty loopback.
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",  # and no user namespace of its own inside
        # The REPL's supervisor is pid 1 itself: no bwrap init holds the worker's pipes inside
        # the jail (a dumpable process the cell could take over), and pid 1 ignores the cell's
        # signals.
        "--as-pid-1",
        "--uid",
        str(uid),
        "--gid",
        str(uid),
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ]
    for key, value in sandbox_env(WORKSPACE_MOUNT, threads).items():
        argv += ["--setenv", key, value]
    # No /etc at all: python -I -S needs nothing from it.
    argv += ["--ro-bind", "/usr", "/usr", *usr_local(executable), *system_links()]
    tmp_bytes = str(tmp_mb * 1024 * 1024)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", tmp_bytes, "--tmpfs", "/tmp"]
    argv += ["--size", tmp_bytes, "--tmpfs", "/dev/shm"]
    if prefix is not None:
        argv += ["--ro-bind", prefix, prefix]
    argv += host_site_masks(("/usr",) if prefix is None else ("/usr", prefix))
    return argv


def jailed_python(python: str, *, uid: int, bwrap: str) -> list[str]:
    """The argv prefix that runs `python` in a jail of its own, as a cell's REPL would be run
    (with nothing of a workspace): followed by the interpreter's own arguments."""
    return [
        *jail_args(python, uid=uid, bwrap=bwrap, tmp_mb=16),
        *READ_ONLY_ROOT,
        "--",
        python_mount(python)[0],
    ]


def driver_mount(driver: Path) -> str:
    """Where the jail sees the driver: the source, or the staged copy compiled ahead (`.pyc`)."""
    return f"{DRIVER_DIR_MOUNT}/{driver.name}"


def unisolated_command(cfg: LocalSandboxConfig, python: str, driver: Path) -> list[str]:
    """The argv that runs the driver as a plain subprocess, with no jail around it."""
    return [python, *driver_args(cfg, str(driver), cfg.python_site)]
