"""The sandbox's packages (sandbox.python): built once per set by uv, mounted read-only into real
bwrap jails, and nothing more reachable through them.

The attacks run as real Turns on the shipped profile's packages (the `escape` marker), which the
install step builds before pytest (`fleet sandbox build`; uv runs offline in tests). The build's
own behaviour runs on a wheel this module writes, from a folder of its own: no index is asked."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import multiprocessing
import os
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from fleet_shared.config import SandboxPythonSection
from fleet_shared.config_file import DEFAULT_SANDBOX_PACKAGES
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.jail import (
    SITE_DIR_PATTERNS,
    SITE_MOUNT,
    LocalSandboxConfig,
    host_site_masks,
    resolve_python,
)
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.python_env import (
    MANIFEST,
    STAGING_PREFIX,
    EnvironmentUnavailable,
    PythonEnvironment,
    ensure_environment,
    environment_key,
    environments_dir,
    interpreter_version,
    with_packages,
)
from tests.integration.attacks import HarnessFactory, attack

PYTHON = resolve_python(LocalSandboxConfig())
SMALL = ("fleetprobe==1.0",)  # the wheel `local_wheels` writes: the build's behaviour, fast


def write_wheel(folder: Path, name: str, version: str, source: str) -> None:
    """A pure-Python wheel of one module, as a build backend would write it."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": source.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},sha256={digest(data)},{len(data)}" for path, data in files.items()]
    files[f"{info}/RECORD"] = "".join(f"{line}\n" for line in [*record, f"{info}/RECORD,,"]).encode()
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)


def digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture
def local_wheels(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """uv finds packages only in a folder of wheels (UV_NO_INDEX, UV_FIND_LINKS): the worker
    passes its environment on to uv, as an operator's mirror settings would be."""
    folder = tmp_path_factory.mktemp("wheels")
    write_wheel(folder, "fleetprobe", "1.0", "VALUE = 42\n")
    monkeypatch.setenv("UV_NO_INDEX", "1")
    monkeypatch.setenv("UV_FIND_LINKS", str(folder))
    return folder


@pytest.fixture(scope="module")
def shipped() -> PythonEnvironment:
    """The default packages, in the host's shared folder (where a worker of this host finds them)."""
    built = ensure_environment(DEFAULT_SANDBOX_PACKAGES, PYTHON)
    assert built is not None
    return built


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


@pytest.fixture
def provider(traversable_dir: Path, shipped: PythonEnvironment) -> Iterator[LocalSandboxProvider]:
    cfg = LocalSandboxConfig(pool_size=0, cell_timeout_seconds=30, python_site=str(shipped.site))
    made = LocalSandboxProvider(cfg, caps=Caps(), workspaces=traversable_dir)
    yield made
    made.close()


def run_cell(provider: LocalSandboxProvider, code: str, workspace: str = "ws") -> tuple[str, str | None]:
    lease = provider.acquire(workspace, "run-python")
    try:
        result = lease.interpreter_factory().execute(code, {}, {}, None)
    finally:
        lease.release()
    return result.stdout.strip(), (f"{result.error.type}: {result.error.message}" if result.error else None)


def test_pandas_imports_and_works_in_a_jailed_cell(provider: LocalSandboxProvider) -> None:
    code = (
        "import sys, pandas as pd, numpy as np, regex\n"
        "frame = pd.DataFrame({'city': ['a', 'b', 'a'], 'n': [1, 2, 3]})\n"
        "print(frame.groupby('city').n.sum().to_dict(), int(np.arange(5).sum()), pd.__file__.startswith('"
        + SITE_MOUNT
        + "'))"
    )
    printed, error = run_cell(provider, code)
    assert error is None
    assert printed == "{'a': 4, 'b': 2} 10 True"


def test_the_shipped_profile_builds_the_default_packages(shipped: PythonEnvironment) -> None:
    names = {line.split("==")[0].lower() for line in shipped.installed}
    assert {"numpy", "pandas", "regex"} <= names
    assert shipped.root.parent == environments_dir()
    assert oct(shipped.root.stat().st_mode & 0o777) == oct(0o555)  # read-only on the host too


def test_a_package_set_is_built_once_and_found_again(tmp_path: Path, local_wheels: Path) -> None:
    lines: list[str] = []
    first = ensure_environment(SMALL, PYTHON, tmp_path, on_output=lines.append)
    assert first is not None and any("fleetprobe" in line for line in lines)  # uv's progress, passed on
    manifest = json.loads((first.root / MANIFEST).read_text())
    assert first.installed == ("fleetprobe==1.0",) and manifest["packages"] == list(SMALL)
    assert (first.site / "fleetprobe" / "__init__.py").read_text() == "VALUE = 42\n"
    assert list((first.site / "fleetprobe" / "__pycache__").glob("*.pyc"))  # compiled once, here
    again: list[str] = []
    second = ensure_environment(SMALL, PYTHON, tmp_path, on_output=again.append)
    assert second == first and again == []  # found: uv did not run
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [first.key]


def test_the_key_names_the_set_and_the_interpreter() -> None:
    version = interpreter_version(PYTHON)
    key = environment_key(("a==1", "b==2"), PYTHON, version)
    assert key == environment_key(("b==2", "a==1"), PYTHON, version)  # the order does not matter
    assert key != environment_key(("a==1", "b==3"), PYTHON, version)
    assert key != environment_key(("a==1", "b==2"), PYTHON, version + " (another build)")


def build_in(root: str) -> str:
    built = ensure_environment(SMALL, PYTHON, Path(root))
    assert built is not None
    return json.loads((built.root / MANIFEST).read_text())["built_at"] + built.key


def test_two_workers_on_one_host_build_a_set_once(tmp_path: Path, local_wheels: Path) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        results = pool.map(build_in, [str(tmp_path)] * 2)
    assert results[0] == results[1]  # one build's manifest, read by both
    assert not list(tmp_path.glob(f"{STAGING_PREFIX}*"))


def test_a_build_killed_midway_leaves_nothing_a_worker_would_use(tmp_path: Path, local_wheels: Path) -> None:
    key = environment_key(SMALL, PYTHON, interpreter_version(PYTHON))
    stale = tmp_path / f"{STAGING_PREFIX}{key}-dead"
    (stale / "site").mkdir(parents=True)
    (stale / "site" / "half_written.py").write_text("x = ")
    (stale / "site").chmod(0o555)
    built = ensure_environment(SMALL, PYTHON, tmp_path)
    assert built is not None and not stale.exists()
    assert not (built.site / "half_written.py").exists()


def test_a_failed_build_says_why_and_leaves_no_folder(tmp_path: Path, local_wheels: Path) -> None:
    with pytest.raises(EnvironmentUnavailable, match="fleet-no-such-package-0"):
        ensure_environment(("fleet-no-such-package-0==1.0",), PYTHON, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []
    assert not list(tmp_path.glob(f"{STAGING_PREFIX}*"))


def test_a_worker_whose_build_fails_runs_on_the_standard_library_and_says_so(
    tmp_path: Path, local_wheels: Path
) -> None:
    section = SandboxPythonSection(packages=("fleet-no-such-package-0==1.0",), preload=("pandas",))
    with structlog.testing.capture_logs() as logs:
        cfg = with_packages(LocalSandboxConfig(), section, tmp_path)
    assert cfg.python_site is None and cfg.preload == ()
    warning = next(entry for entry in logs if entry["event"] == "sandbox.python_unavailable")
    assert "fleet sandbox build" in warning["fix"]


def test_an_empty_list_mounts_nothing(tmp_path: Path) -> None:
    assert (
        with_packages(LocalSandboxConfig(), SandboxPythonSection(packages=()), tmp_path).python_site is None
    )
    assert list(tmp_path.iterdir()) == []


def test_preloaded_modules_are_in_before_the_first_cell(
    traversable_dir: Path, shipped: PythonEnvironment
) -> None:
    cfg = LocalSandboxConfig(
        pool_size=0, python_site=str(shipped.site), preload=("fleet_no_such_module", "pandas")
    )
    provider = LocalSandboxProvider(cfg, caps=Caps(), workspaces=traversable_dir)
    try:
        # A module that fails to import is left for a cell to report; the REPL works on.
        printed, error = run_cell(
            provider, "import sys\nprint('pandas' in sys.modules, 'numpy' in sys.modules)"
        )
    finally:
        provider.close()
    assert error is None and printed == "True True"


# --- the escape suite: attacks on the packages, as real Turns on the shipped profile -----------------


HOST_SITE_FOLDERS = sorted(
    str(folder) for pattern in SITE_DIR_PATTERNS for folder in Path("/usr").glob(pattern) if folder.is_dir()
)


@pytest.mark.escape
async def test_cells_see_no_host_site_packages(harness_factory: HarnessFactory) -> None:
    """Neither on the cell's path, nor in the folders the host's Python keeps them in (a cell may
    add those to its path, or start a `python3` without -S, which would add them itself)."""
    code = (
        "import os, subprocess, sys, importlib.util\n"
        "wanted = ('msgspec', 'dspy', 'fleet_worker', 'pip', 'uv', 'yaml', 'cryptography')\n"
        "found = [m for m in wanted if importlib.util.find_spec(m)]\n"
        "paths = [p for p in sys.path if 'site-packages' in p or 'dist-packages' in p]\n"
        f"shown = {{f: os.listdir(f) for f in {HOST_SITE_FOLDERS!r} if os.path.isdir(f)}}\n"
        "probe = 'import sys; print([p for p in sys.path if os.path.isdir(p) and os.listdir(p)])'\n"
        "child = subprocess.run(['python3', '-c', 'import os; ' + probe], capture_output=True, text=True)\n"
        "result = (found, paths, sys.path[-1], shown, child.stdout.strip())"
    )
    outcome = await attack(harness_factory, code)
    found, paths, last, shown, child = eval(outcome.answer)
    assert (found, paths, last) == ([], [], SITE_MOUNT)
    assert shown == {folder: [] for folder in HOST_SITE_FOLDERS}  # there, and empty
    assert not any("packages" in folder for folder in eval(child))  # a plain `python3`: none either


@pytest.mark.escape
async def test_cells_cannot_write_into_the_packages(harness_factory: HarnessFactory) -> None:
    code = (
        "import errno, os, pandas\n"
        "tries = {}\n"
        "for name, act in (\n"
        f"    ('new file', lambda: open('{SITE_MOUNT}/planted.py', 'w')),\n"
        "    ('overwrite', lambda: open(pandas.__file__, 'a')),\n"
        "    ('rename', lambda: os.rename(pandas.__file__, pandas.__file__ + '.x')),\n"
        "    ('chmod', lambda: os.chmod(pandas.__file__, 0o777)),\n"
        f"    ('mkdir', lambda: os.mkdir('{SITE_MOUNT}/sitecustomize')),\n"
        "):\n"
        "    try:\n        act()\n        tries[name] = 'done'\n"
        "    except OSError as exc:\n        tries[name] = errno.errorcode[exc.errno]\n"
        "result = sorted(tries.items())"
    )
    outcome = await attack(harness_factory, code)
    refused = dict(eval(outcome.answer))  # the cell's own repr of a list of pairs
    assert sorted(refused) == ["chmod", "mkdir", "new file", "overwrite", "rename"]
    # A read-only mount (and, for a file the host made read-only, its mode before that).
    assert set(refused.values()) <= {"EROFS", "EACCES"}, refused


@pytest.fixture
def package_index() -> Iterator[int]:
    """A package index on the host's loopback: what a cell's `pip install` would have to reach."""
    hits: list[str] = []

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    assert hits == []  # nothing from the jail ever arrived


@pytest.mark.escape
async def test_no_package_can_be_installed_or_fetched_from_a_cell(
    harness_factory: HarnessFactory, package_index: int
) -> None:
    code = (
        "import subprocess, sys, urllib.request\n"
        "pip = subprocess.run([sys.executable, '-m', 'pip', 'install', 'six'], capture_output=True,\n"
        "                     text=True)\n"
        "ensure = subprocess.run([sys.executable, '-m', 'ensurepip'], capture_output=True, text=True)\n"
        "try:\n"
        f"    urllib.request.urlopen('http://127.0.0.1:{package_index}/simple/six/', timeout=3)\n"
        "    fetched = 'fetched'\n"
        "except OSError as exc:\n"
        "    fetched = type(exc).__name__\n"
        "result = (pip.returncode != 0, 'No module named pip' in pip.stderr, ensure.returncode != 0, fetched)"
    )
    outcome = await attack(harness_factory, code)
    assert outcome.answer == "(True, True, True, 'URLError')"


# --- what a build trusts, and how it fails -----------------------------------------------------


def test_a_folder_anyone_may_write_is_never_used(tmp_path: Path, local_wheels: Path) -> None:
    """Another user could have planted a set there, under the key every worker computes alike."""
    shared = tmp_path / "open"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(EnvironmentUnavailable, match="anyone may write"):
        ensure_environment(SMALL, PYTHON, shared)
    assert list(shared.iterdir()) == []
    with structlog.testing.capture_logs() as logs:
        cfg = with_packages(LocalSandboxConfig(), SandboxPythonSection(packages=SMALL), shared)
    assert cfg.python_site is None
    assert any(entry["event"] == "sandbox.python_unavailable" for entry in logs)


def test_a_stale_build_that_is_a_link_is_not_followed(tmp_path: Path, local_wheels: Path) -> None:
    key = environment_key(SMALL, PYTHON, interpreter_version(PYTHON))
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    root = tmp_path / "sets"
    root.mkdir()
    (root / f"{STAGING_PREFIX}{key}-link").symlink_to(victim)
    assert ensure_environment(SMALL, PYTHON, root) is not None
    assert oct(victim.stat().st_mode & 0o777) == oct(0o600) and victim.read_text() == "secret"


def test_a_half_deleted_set_is_reported_and_the_worker_goes_on(tmp_path: Path, local_wheels: Path) -> None:
    key = environment_key(SMALL, PYTHON, interpreter_version(PYTHON))
    (tmp_path / key / "site").mkdir(parents=True)  # its manifest gone, its folder not
    with structlog.testing.capture_logs() as logs:
        cfg = with_packages(LocalSandboxConfig(), SandboxPythonSection(packages=SMALL), tmp_path)
    assert cfg.python_site is None
    warning = next(entry for entry in logs if entry["event"] == "sandbox.python_unavailable")
    assert "remove it" in warning["reason"] and key in warning["reason"]


def test_folders_a_build_makes_are_passable_whatever_the_umask(tmp_path: Path, local_wheels: Path) -> None:
    root = tmp_path / "a" / "b" / "sets"
    previous = os.umask(0o077)
    try:
        assert ensure_environment(SMALL, PYTHON, root) is not None
    finally:
        os.umask(previous)
    assert [oct(p.stat().st_mode & 0o777) for p in (tmp_path / "a", tmp_path / "a" / "b", root)] == [
        oct(0o755)
    ] * 3


def test_a_build_past_its_time_says_so(tmp_path: Path, local_wheels: Path) -> None:
    with pytest.raises(EnvironmentUnavailable, match="within 0 s"):
        ensure_environment(SMALL, PYTHON, tmp_path, timeout=0.001)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


def test_a_preload_that_exits_or_prints_leaves_the_repl_as_it_was(
    traversable_dir: Path, shipped: PythonEnvironment
) -> None:
    """`unittest.__main__` parses the REPL's own argv, prints its usage and exits (SystemExit)."""
    cfg = LocalSandboxConfig(
        pool_size=0, python_site=str(shipped.site), preload=("unittest.__main__", "pandas")
    )
    provider = LocalSandboxProvider(cfg, caps=Caps(), workspaces=traversable_dir)
    try:
        printed, error = run_cell(provider, "import sys\nprint('pandas' in sys.modules)")
    finally:
        provider.close()
    assert (printed, error) == ("True", None)


def test_host_site_folders_under_lib64_are_masked_too(tmp_path: Path) -> None:
    for lib in ("lib", "lib64"):
        (tmp_path / lib / "python3.12" / "site-packages").mkdir(parents=True)
    masks = host_site_masks((str(tmp_path),))
    masked = [masks[i + 1] for i, arg in enumerate(masks) if arg == "--tmpfs"]
    assert masked == [str(tmp_path / lib / "python3.12" / "site-packages") for lib in ("lib", "lib64")]
