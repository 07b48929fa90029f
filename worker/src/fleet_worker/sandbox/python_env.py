"""The sandbox's Python packages (`sandbox.python.packages`): one folder per package set and
interpreter, built by uv and mounted read-only into every jail (ADR 0043).

- The folder is named after the hash of what it holds (the pinned list, the interpreter's path
  and version, this layout's format), so a changed list or an upgraded interpreter gets a new
  one and a folder, once there, is never rebuilt or changed.
- uv installs wheels only (`--only-binary :all:`): no package's build code runs on the host.
  It compiles the bytecode too, since the jail mounts the folder read-only and a REPL could
  never cache a .pyc.
- A build goes into a temporary folder beside the others, renamed into place when complete,
  under a file lock: two workers on one host build it once, and a worker killed mid-build
  leaves only a temporary folder (the next build removes it), never a partial environment.
- Nothing of the worker's own venv is in it: uv installs into a bare target folder for the
  sandbox's interpreter, which runs with -I -S (no site-packages of the host).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from fleet_shared.config import SandboxPythonSection
from fleet_worker.sandbox.jail import LocalSandboxConfig, resolve_python
from fleet_worker.sandbox.trust import untrusted_interpreter, untrusted_path

log = structlog.get_logger(__name__)

DIR_ENV = "FLEET_SANDBOX_PYTHON_DIR"  # where this host keeps the environments
MANIFEST = "environment.json"
LAYOUT = 1  # this module's folder layout: part of the hash
BUILD_TIMEOUT_SECONDS = 1800.0  # `fleet sandbox build`
# A worker's start: within a pod's startup probe (the chart's allows 120 s), so a worker that
# cannot build in time starts on the standard library instead of being restarted in a loop.
START_BUILD_TIMEOUT_SECONDS = 90.0
STAGING_PREFIX = ".build-"
# What uv keeps of the worker's environment: where it may fetch from and how (a proxy, a mirror's
# certificate). Nothing of fleet's own settings, whose secrets uv has no use for.
UV_ENV_DROPPED_PREFIXES = ("FLEET_",)


class EnvironmentUnavailable(Exception):
    """The environment could not be built; the message says why and what to do."""


@dataclass(frozen=True)
class PythonEnvironment:
    """A built environment: `site` is its folder of packages on this host."""

    key: str
    site: Path
    packages: tuple[str, ...]  # the profile's list
    installed: tuple[str, ...]  # everything in it, `name==version`, dependencies included

    @property
    def root(self) -> Path:
        return self.site.parent


def environments_dir(environ: Mapping[str, str] | None = None, *, euid: int | None = None) -> Path:
    """Where this host keeps sandbox environments: FLEET_SANDBOX_PYTHON_DIR, else a cache folder
    every sandbox uid can pass through (a root worker's REPLs run as other uids, and /root is
    closed to them), else the user's cache."""
    env = os.environ if environ is None else environ
    if env.get(DIR_ENV):
        return Path(env[DIR_ENV])
    if (os.geteuid() if euid is None else euid) == 0:
        return Path("/var/cache/fleet/sandbox-python")
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(cache) / "fleet" / "sandbox-python"


def interpreter_version(python: str) -> str:
    """The interpreter's full version line (its build included), run with nothing of the host's."""
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", "import sys; print(sys.version, sys.platform)"],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin"},
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise EnvironmentUnavailable(f"the sandbox interpreter {python} did not run: {exc}") from exc
    return done.stdout.strip()


def environment_key(packages: Sequence[str], python: str, version: str) -> str:
    """The hash that names an environment: equal only for the same packages on the same Python."""
    identity = {
        "layout": LAYOUT,
        "packages": sorted(packages),
        "python": os.path.realpath(python),
        "version": version,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def find_environment(root: Path, key: str) -> PythonEnvironment | None:
    """The environment `key` if it was built under `root`, else None."""
    folder = root / key
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return PythonEnvironment(
        key=key,
        site=folder / "site",
        packages=tuple(manifest.get("packages", ())),
        installed=tuple(manifest.get("installed", ())),
    )


def ensure_environment(
    packages: Sequence[str],
    python: str,
    root: Path | None = None,
    *,
    on_output: Callable[[str], None] | None = None,
    timeout: float = BUILD_TIMEOUT_SECONDS,
    sandbox_roots: Sequence[Path] = (),
) -> PythonEnvironment | None:
    """The environment for `packages` on `python`, built now if this host has none (None for
    an empty list). `on_output` gets uv's progress lines; EnvironmentUnavailable says why there
    is none (a folder that cannot be trusted, a build that failed or took past `timeout`)."""
    if not packages:
        return None
    # Never run an interpreter on the host before it is found trusted: one a cell planted in a
    # folder sandboxes write (`sandbox_roots`) would run as the worker (the attack chain).
    distrust = untrusted_interpreter(python, sandbox_roots)
    if distrust is not None:
        raise EnvironmentUnavailable(distrust)
    root = root or environments_dir()
    key = environment_key(packages, python, interpreter_version(python))
    try:
        make_folders(root)
        trusted(root / key if (root / key).exists() else root)
        found = find_environment(root, key)
        if found is not None:
            return found
        with build_lock(root, key):
            found = find_environment(root, key)  # another worker on this host built it meanwhile
            if found is not None:
                return found
            remove_stale_builds(root, key)
            return build(packages, python, root, key, on_output=on_output, timeout=timeout)
    except OSError as exc:  # a full disk, a folder left half-deleted: said, never a crash
        raise EnvironmentUnavailable(
            f"the packages' folder {root / key} cannot be used: {exc} (remove it to have it built anew)"
        ) from exc


def trusted(path: Path) -> None:
    """Every jail imports what is here: only root or the worker's user may have put it there."""
    distrust = untrusted_path(path, f"the sandbox packages' folder {path}")
    if distrust is not None:
        raise EnvironmentUnavailable(f"{distrust}; set {DIR_ENV} to a folder only they can write")


def make_folders(root: Path) -> None:
    """`root` and any folder above it that is missing, each 0755 whatever the umask (a root
    worker's sandbox uids pass through them to the packages)."""
    missing = [folder for folder in (root, *root.parents) if not folder.exists()]
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        folder.chmod(0o755)


@contextmanager
def build_lock(root: Path, key: str) -> Iterator[None]:
    """One build of `key` at a time on this host; a second worker waits, saying so, for the
    first (which then built it, or failed and left it to this one)."""
    handle = os.open(root / f".{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("sandbox.python_waiting", key=key, detail="another process on this host is building it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def remove_stale_builds(root: Path, key: str) -> None:
    """Temporary folders of builds of `key` that were killed (the lock is ours: none runs); only
    real folders of this process's user, never what a link points at."""
    for folder in root.glob(f"{STAGING_PREFIX}{key}-*"):
        info = folder.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            make_writable(folder)
            shutil.rmtree(folder, ignore_errors=True)


def build(
    packages: Sequence[str],
    python: str,
    root: Path,
    key: str,
    *,
    on_output: Callable[[str], None] | None,
    timeout: float,
) -> PythonEnvironment:
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{key}-", dir=root))
    started = time.monotonic()
    log.info("sandbox.python_building", packages=list(packages), into=str(root / key))
    try:
        run_uv(
            ["pip", "install", "--python", python, "--target", str(staging / "site"),
             "--only-binary", ":all:", "--compile-bytecode", "--no-progress", "--", *packages],
            cwd=staging,
            on_output=on_output,
            timeout=timeout,
        )  # fmt: skip
        installed = installed_distributions(staging / "site")
        manifest: dict[str, Any] = {
            "packages": list(packages),
            "installed": installed,
            "python": os.path.realpath(python),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        make_read_only(staging)
        staging.rename(root / key)
    except BaseException:
        make_writable(staging)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    seconds = round(time.monotonic() - started, 1)
    log.info("sandbox.python_built", key=key, installed=len(installed), seconds=seconds)
    found = find_environment(root, key)
    assert found is not None
    return found


def run_uv(args: list[str], *, cwd: Path, on_output: Callable[[str], None] | None, timeout: float) -> None:
    """Run uv (the wheel's own binary) with the worker's environment less fleet's settings, and
    none of the config files it would find above `cwd` (they could name another index)."""
    from uv import find_uv_bin  # the uv wheel's public way to its binary

    env = {k: v for k, v in os.environ.items() if not k.startswith(UV_ENV_DROPPED_PREFIXES)}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    try:
        process = subprocess.Popen(
            [find_uv_bin(), "--no-config", *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    except OSError as exc:
        raise EnvironmentUnavailable(f"uv did not start: {exc}") from exc
    timed_out = threading.Event()

    def stop() -> None:  # a stalled download included
        timed_out.set()
        process.kill()

    timer = threading.Timer(timeout, stop)
    timer.start()
    tail: list[str] = []
    assert process.stdout is not None
    try:
        for raw in process.stdout:
            line = raw.rstrip()
            tail = [*tail[-19:], line]
            if on_output is not None:
                on_output(line)
        code = process.wait()
    finally:
        timer.cancel()
    if timed_out.is_set():
        raise EnvironmentUnavailable(f"uv did not finish installing the packages within {timeout:.0f} s")
    if code != 0:
        detail = "; ".join(line for line in tail if line.strip())[-1500:]
        raise EnvironmentUnavailable(f"uv could not install the packages (exit {code}): {detail}")


def installed_distributions(site: Path) -> list[str]:
    """`name==version` of each distribution in `site`, from its .dist-info folder's name."""
    found = []
    for info in sorted(site.glob("*.dist-info")):
        name, _, version = info.name.removesuffix(".dist-info").partition("-")
        found.append(f"{name}=={version}")
    return found


def make_read_only(root: Path) -> None:
    for folder, dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o444 | (os.stat(path).st_mode & 0o111))
        for name in dirs:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o555)
    os.chmod(root, 0o555)


def make_writable(root: Path) -> None:
    """Give the owner write access back (to remove a folder make_read_only left)."""
    if not root.exists():
        return
    os.chmod(root, 0o755)
    for folder, dirs, _files in os.walk(root):
        for name in dirs:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755)


def with_packages(
    cfg: LocalSandboxConfig,
    section: SandboxPythonSection,
    root: Path | None = None,
    *,
    sandbox_roots: Sequence[Path] = (),
) -> LocalSandboxConfig:
    """`cfg` with the profile's packages mounted, built now if this host has none. A build that
    fails leaves cells the standard library only, said in the log with the way to mend it."""
    if not section.packages:
        return cfg
    try:
        found = ensure_environment(
            section.packages,
            resolve_python(cfg),
            root,
            on_output=lambda line: log.info("sandbox.python_build", output=line),
            timeout=START_BUILD_TIMEOUT_SECONDS,
            sandbox_roots=sandbox_roots,
        )
    except EnvironmentUnavailable as exc:
        log.warning(
            "sandbox.python_unavailable",
            reason=str(exc),
            detail="cells have the standard library only",
            fix="`fleet sandbox build` on this host (or in the worker's image), then restart the worker",
        )
        return cfg
    assert found is not None
    return dataclasses.replace(cfg, python_site=str(found.site), preload=section.preload)
