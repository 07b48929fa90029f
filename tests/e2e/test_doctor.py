"""`fleet doctor` as an operator runs it: a process against a private Redis, a real SQLite file,
a real sandbox, and a loopback OpenAI-compatible provider (the real one is unreachable here)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command

from fleet_shared.db.engine import REVISIONS
from fleet_shared.db.migrate import alembic_config
from tests.conftest import migrate
from tests.e2e.conftest import REPO, fleet, work_dir
from tests.support.fake_provider import FakeProvider, serve_fake_provider
from tests.support.s3 import S3Server
from tests.support.servers import free_port

CONFIG = REPO / "config" / "fleet.toml"
KEY = "sk-doctor-e2e-must-not-print"
REDIS_PASSWORD = "pw-doctor-e2e-must-not-print"
FLEET_SCRIPT = Path(sys.executable).parent / "fleet"  # what `uv run fleet` runs


@pytest.fixture(scope="module")
def head_db() -> Iterator[str]:
    """A SQLite database migrated to head, as `fleet db upgrade` leaves it."""
    folder = work_dir("doctor")
    url = f"sqlite+aiosqlite:///{folder / 'fleet.db'}"
    migrate(url)
    yield url
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def folder() -> Iterator[Path]:
    path = work_dir("doctor-test")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with serve_fake_provider() as fake:
        fake.api_key = KEY
        yield fake


def doctor_env(redis_url: str, database_url: str, **extra: str) -> dict[str, str]:
    base = {name: value for name, value in os.environ.items() if not name.startswith("FLEET_")}
    return {
        **base,
        "FLEET_CONFIG": str(CONFIG),
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": redis_url,
        "FLEET_DATABASE_URL": database_url,
        **extra,
    }


def run_doctor(
    env: dict[str, str], *args: str, timeout: float = 90
) -> tuple[int, dict[str, Any], str, float]:
    """Exit code, the JSON document, everything printed, and how long it took."""
    started = time.monotonic()
    done = subprocess.run(
        fleet("doctor", "--json", *args),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    elapsed = time.monotonic() - started
    return done.returncode, json.loads(done.stdout), done.stdout + done.stderr, elapsed


def by_name(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in document["checks"]}


def provider_env(redis_url: str, database_url: str, fake: FakeProvider, key: str) -> dict[str, str]:
    return doctor_env(
        redis_url,
        database_url,
        FLEET_PROFILE="local",
        FLEET_LM_MODEL="openai/fake-model",
        FLEET_LM_BASE_URL=fake.url,
        FLEET_LM_API_KEY=key,
    )


def test_a_healthy_install_passes_every_check(redis_url: str, head_db: str) -> None:
    code, document, printed, _ = run_doctor(doctor_env(redis_url, head_db))
    assert code == 0, printed
    assert document["ok"] is True
    checks = by_name(document)
    assert list(checks) == [
        "config",
        "database",
        "redis",
        "store",
        "sandbox.bwrap",
        "sandbox.userns",
        "sandbox.cgroups",
        "sandbox.seccomp",
        "sandbox.workspace_budget",
        "sandbox.python",
        "sandbox.cell",
        "provider",
    ]
    # This machine's tests run as root with e2fsprogs: the kernel holds the budget.
    assert checks["sandbox.workspace_budget"]["status"] == ("ok" if os.geteuid() == 0 else "warn")
    assert checks["database"]["status"] == "ok" and "at head" in checks["database"]["detail"]
    assert checks["store"]["status"] == "ok" and "put, read back and deleted" in checks["store"]["detail"]
    assert checks["redis"]["status"] == "ok" and "answered PING" in checks["redis"]["detail"]
    assert checks["sandbox.cell"]["status"] == "ok", checks["sandbox.cell"]
    assert "print(1+1) printed 2 in a bwrap" in checks["sandbox.cell"]["detail"]
    # The install step built the shipped packages; the cell saw each of their distributions.
    assert checks["sandbox.python"]["status"] == "ok", checks["sandbox.python"]
    assert "it sees the 5 distributions of sandbox.python" in checks["sandbox.cell"]["detail"]
    assert checks["provider"] == {
        "name": "provider",
        "status": "skip",
        "detail": "scripted LM: nothing to authenticate",
        "fix": None,
    }
    for name in ("config", "sandbox.bwrap", "sandbox.userns", "sandbox.seccomp"):
        assert checks[name]["status"] == "ok", checks[name]


def test_packages_not_built_yet_warn_with_the_build_command(
    redis_url: str, head_db: str, tmp_path: Path
) -> None:
    """A host where no worker has started yet: the doctor says so and builds nothing itself."""
    env = doctor_env(redis_url, head_db, FLEET_SANDBOX_PYTHON_DIR=str(tmp_path))
    code, document, printed, _ = run_doctor(env)
    checks = by_name(document)
    assert code == 0, printed  # a warning: a worker would build them at its start
    assert checks["sandbox.python"]["status"] == "warn"
    assert "not built" in checks["sandbox.python"]["detail"]
    assert checks["sandbox.python"]["fix"] == "run `fleet sandbox build`"
    assert (
        checks["sandbox.cell"]["status"] == "ok" and "distributions" not in checks["sandbox.cell"]["detail"]
    )
    assert list(tmp_path.iterdir()) == []


def test_the_fleet_command_prints_a_table(redis_url: str, head_db: str) -> None:
    done = subprocess.run(
        [str(FLEET_SCRIPT), "doctor"],
        env=doctor_env(redis_url, head_db),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ok    config ")
    assert any(line.startswith("ok    sandbox.cell ") for line in lines)
    assert lines[-1].startswith("fleet doctor: no check failed")


def test_a_database_behind_head_fails_with_the_upgrade_fix(redis_url: str, folder: Path) -> None:
    url = f"sqlite+aiosqlite:///{folder / 'fleet.db'}"
    command.upgrade(alembic_config(url), REVISIONS[-2])
    code, document, printed, _ = run_doctor(doctor_env(redis_url, url))
    assert code == 1, printed
    database = by_name(document)["database"]
    assert database["status"] == "fail"
    assert f"schema at {REVISIONS[-2]}, this fleet expects {REVISIONS[-1]}" in database["detail"]
    assert "fleet db upgrade" in database["fix"]
    assert by_name(document)["redis"]["status"] == "ok"  # the other checks still ran


def test_a_dead_redis_fails_fast_without_its_password(head_db: str) -> None:
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{free_port()}/0"
    code, document, printed, elapsed = run_doctor(doctor_env(url, head_db))
    assert code == 1
    assert elapsed < 15  # a sandbox cell included; the Redis check itself answers at once
    redis = by_name(document)["redis"]
    assert redis["status"] == "fail" and "is unreachable" in redis["detail"]
    assert "redis://:***@127.0.0.1" in redis["detail"] and "FLEET_REDIS_URL" in redis["fix"]
    assert REDIS_PASSWORD not in printed


QUERY_PASSWORD = "qpw-doctor-e2e-must-not-print"


def test_passwords_given_as_query_parameters_are_never_printed() -> None:
    """libpq/asyncpg and redis-py both take `?password=`: neither the JSON nor the table shows it."""
    env = doctor_env(
        f"redis://127.0.0.1:{free_port()}/0?password={QUERY_PASSWORD}",
        f"postgresql+asyncpg://fleet@127.0.0.1:{free_port()}/fleet?password={QUERY_PASSWORD}",
    )
    code, document, printed, _ = run_doctor(env)
    table = subprocess.run(fleet("doctor"), env=env, capture_output=True, text=True, timeout=90, check=False)
    assert code == 1 and table.returncode == 1, printed
    checks = by_name(document)
    assert checks["database"]["status"] == "fail" and checks["redis"]["status"] == "fail"
    assert "/fleet?password=*** is unreachable" in checks["database"]["detail"], checks["database"]
    assert "/0?password=*** is unreachable" in checks["redis"]["detail"], checks["redis"]
    assert "?password=***" in table.stdout
    assert QUERY_PASSWORD not in printed + table.stdout + table.stderr


def test_a_redis_that_never_answers_fails_at_its_deadline(head_db: str) -> None:
    """A port that accepts connections and never replies: the PING is bounded."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        code, document, printed, elapsed = run_doctor(doctor_env(url, head_db))
    assert code == 1, printed
    assert elapsed < 20
    redis = by_name(document)["redis"]
    assert redis["status"] == "fail" and "PING" in redis["detail"], redis


def test_a_refused_key_fails_and_is_never_printed(
    redis_url: str, head_db: str, provider: FakeProvider
) -> None:
    code, document, printed, _ = run_doctor(provider_env(redis_url, head_db, provider, "sk-wrong-" + KEY))
    assert code == 1
    check = by_name(document)["provider"]
    assert check["status"] == "fail" and "the key was refused (401)" in check["detail"]
    assert check["fix"] == "set FLEET_LM_API_KEY to a key this provider accepts"
    assert provider.headers[-1]["authorization"] == f"Bearer sk-wrong-{KEY}"  # it was sent
    assert KEY not in printed and "Incorrect API key" not in printed  # the refusal echoes it


def test_an_accepted_key_passes(redis_url: str, head_db: str, provider: FakeProvider) -> None:
    code, document, printed, _ = run_doctor(provider_env(redis_url, head_db, provider, KEY))
    assert code == 0, printed
    check = by_name(document)["provider"]
    assert check["status"] == "ok" and "accepted the key (200" in check["detail"]
    assert KEY not in printed


def test_a_broken_config_fails_and_skips_the_rest(redis_url: str, head_db: str) -> None:
    env = doctor_env(redis_url, head_db, FLEET_PROFILE="local")  # FLEET_LM_MODEL is not set
    code, document, printed, _ = run_doctor(env)
    assert code == 1, printed
    config, *rest = document["checks"]
    assert config["status"] == "fail"
    assert "FLEET_LM_MODEL is not set" in config["detail"]
    assert config["fix"].startswith("export FLEET_LM_MODEL")
    assert {check["status"] for check in rest} == {"skip"}


def unisolated_config(folder: Path, allow: bool) -> Path:
    """The shipped file with the offline profile's allow_unisolated set (the first one is offline's)."""
    text = CONFIG.read_text().replace(
        "allow_unisolated = false", f"allow_unisolated = {str(allow).lower()}", 1
    )
    path = folder / "fleet.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("allow_unisolated", [False, True])
def test_without_bwrap_the_sandbox_fails_unless_unisolated_is_allowed(
    redis_url: str, head_db: str, folder: Path, allow_unisolated: bool
) -> None:
    env = doctor_env(
        redis_url,
        head_db,
        FLEET_CONFIG=str(unisolated_config(folder, allow_unisolated)),
        FLEET_SCRIPTED_LM=str(REPO / "config" / "scripts" / "demo.jsonl"),
        PATH=str(folder),  # no bwrap on it
    )
    code, document, printed, _ = run_doctor(env)
    checks = by_name(document)
    if allow_unisolated:
        assert code == 0, printed
        assert checks["sandbox.bwrap"]["status"] == "warn"
        assert checks["sandbox.cell"]["status"] == "warn"
        assert "UNISOLATED" in checks["sandbox.cell"]["detail"]
        assert "allow_unisolated = false" in checks["sandbox.cell"]["fix"]
    else:
        assert code == 1, printed
        assert checks["sandbox.bwrap"]["status"] == "fail"
        assert checks["sandbox.cell"]["status"] == "fail"
        assert "bubblewrap (bwrap) was not found" in checks["sandbox.cell"]["detail"]
        assert "apt-get install bubblewrap" in checks["sandbox.cell"]["fix"]


# --- cgroups: the doctor reads them, never changes them

V1_CONTROLLERS = ("memory", "pids", "cpu")


def own_v1_cgroups() -> dict[str, Path]:
    """This process's cgroup directory per v1 controller (empty unless all three are v1)."""
    found = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            directory = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
            if controller in V1_CONTROLLERS and directory.is_dir():
                found[controller] = directory
    return found if len(found) == len(V1_CONTROLLERS) else {}


@pytest.fixture
def test_cgroups() -> Iterator[list[Path]]:
    """A fresh cgroup per v1 controller for one doctor to run in, so what it does (or would do)
    to its own cgroup shows there, whatever workers elsewhere on this machine do to theirs."""
    own = own_v1_cgroups()
    if os.geteuid() != 0 or not own:
        pytest.skip("needs root on cgroup v1 (memory, pids and cpu hierarchies)")
    name = f"fleet-doctor-test-{os.getpid()}-{time.monotonic_ns()}"
    dirs = [own[controller] / name for controller in V1_CONTROLLERS]
    for directory in dirs:
        directory.mkdir()
    yield dirs
    deadline = time.monotonic() + 10  # the kernel lets go of a cgroup a moment after its last process
    for directory in dirs:
        for path in [*sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True), directory]:
            while path.exists():
                try:
                    path.rmdir()
                except OSError:
                    assert time.monotonic() < deadline, f"{path} is still busy"
                    time.sleep(0.05)  # a poll interval, under the deadline above


def tree(dirs: list[Path]) -> set[str]:
    return {str(path) for directory in dirs for path in directory.rglob("*") if path.is_dir()}


def doctor_in(dirs: list[Path], env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """`fleet doctor --json` as a process of the cgroups `dirs` (joined before it execs)."""
    procs = [str(directory / "cgroup.procs") for directory in dirs]
    wrapper = ["sh", "-c", 'for f in $PROCS; do echo $$ > "$f" || exit 97; done; exec "$@"', "sh"]
    done = subprocess.run(
        [*wrapper, *fleet("doctor", "--json")],
        env={**env, "PROCS": " ".join(procs)},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return by_name(json.loads(done.stdout)), done.stdout + done.stderr


def test_the_doctor_sets_up_no_cgroups(redis_url: str, head_db: str, test_cgroups: list[Path]) -> None:
    """No worker prepared this cgroup: the doctor creates nothing there, and its cell runs without
    cgroup limits (saying so)."""
    before = tree(test_cgroups)
    checks, printed = doctor_in(test_cgroups, doctor_env(redis_url, head_db))
    assert tree(test_cgroups) == before == set(), printed
    assert checks["sandbox.cgroups"]["status"] == "ok", checks["sandbox.cgroups"]
    assert "limits were not exercised" in checks["sandbox.cgroups"]["detail"]
    assert checks["sandbox.cell"]["status"] == "ok", checks["sandbox.cell"]
    assert "cgroup limits not exercised" in checks["sandbox.cell"]["detail"]


def test_the_doctor_never_sweeps_a_live_workers_repl_groups(
    redis_url: str, head_db: str, test_cgroups: list[Path]
) -> None:
    """A worker set this cgroup up, and one of its REPLs' groups is still empty (its REPL is
    starting): the doctor's cell runs under the limits, and leaves the tree as it found it."""
    for directory in test_cgroups:
        (directory / "fleet-sandboxes" / "repl-starting").mkdir(parents=True)
    before = tree(test_cgroups)
    checks, printed = doctor_in(test_cgroups, doctor_env(redis_url, head_db))
    assert tree(test_cgroups) == before, printed
    assert checks["sandbox.cell"]["status"] == "ok", checks["sandbox.cell"]
    assert "cgroup-v1 sandbox" in checks["sandbox.cell"]["detail"]
    assert "the cell below ran under them" in checks["sandbox.cgroups"]["detail"]


def test_the_store_check_reaches_an_s3_store_and_says_what_to_fix(redis_url: str, head_db: str) -> None:
    store = S3Server("fleet-doctor").start()
    try:
        code, document, printed, _ = run_doctor(doctor_env(redis_url, head_db, **store.env()))
        check = by_name(document)["store"]
        assert check["status"] == "ok" and check["detail"].startswith("s3://fleet-doctor/fleet: put"), printed
        assert store.keys("fleet/doctor/") == []  # the probe object is gone again
        missing = {**store.env(), "FLEET_BLOB_URL": "s3://no-such-bucket/fleet"}
        code, document, printed, _ = run_doctor(doctor_env(redis_url, head_db, **missing))
        check = by_name(document)["store"]
        assert code == 1 and check["status"] == "fail" and "s3://no-such-bucket/fleet" in check["detail"]
        assert "FLEET_BLOB_URL" in check["fix"] and "test" not in check["detail"].split("refused")[0]
    finally:
        store.stop()
