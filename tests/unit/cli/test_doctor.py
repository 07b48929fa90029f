"""`fleet doctor`'s parts without a stack: rendering, the JSON shape, exit codes, the fix lines,
redaction, the deadline on each check, and the provider check against a loopback provider."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from fleet_cli import doctor
from fleet_cli.doctor import (
    Planned,
    check_config,
    check_provider,
    collect_checks,
    config_fix,
    error_line,
    missing_sqlite_file,
    run_bounded,
    run_doctor,
    schema_check,
)
from fleet_cli.doctor_output import render_json, render_text, scrub, secrets_of
from fleet_shared.config import LMSection, ResolvedLM, Secret, Settings, load_settings
from fleet_shared.db.engine import HEAD_REVISION, REVISIONS
from fleet_shared.doctor import Check, all_passed
from tests.support.fake_provider import FakeProvider, serve_fake_provider
from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[3]
CONFIG = str(REPO / "config" / "fleet.toml")
SECRET = "pw-unit-must-not-print"
KEY = "sk-unit-must-not-print"


@pytest.fixture(autouse=True)
def logging_restored() -> Iterator[None]:
    """run_doctor configures logging onto this test's captured stderr, which pytest closes after
    it: a later test's log line would then fail on the closed file."""
    saved, root = structlog.get_config(), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)


def settings_with(**env: str) -> Settings:
    base = {"FLEET_CONFIG": CONFIG, "FLEET_PROFILE": "offline", "FLEET_REDIS_URL": "redis://127.0.0.1:1/0"}
    return load_settings({**base, **env})


CHECKS = [
    Check(name="config", status="ok", detail="profile offline"),
    Check(name="database", status="fail", detail="schema at nothing", fix="run `fleet db upgrade`"),
    Check(name="sandbox.cgroups", status="warn", detail="no cgroups", fix="run as root"),
    Check(name="provider", status="skip", detail="scripted LM: nothing to authenticate", fix="unused"),
]


def test_the_table_has_a_line_per_check_and_fixes_under_fails_and_warnings() -> None:
    lines = render_text(CHECKS).splitlines()
    assert lines[0].split() == ["ok", "config", "profile", "offline"]
    assert lines[1].startswith("FAIL  database ")
    assert lines[2].strip() == "fix: run `fleet db upgrade`"
    assert lines[2].index("fix:") == lines[1].index("schema")  # indented under the detail
    assert lines[3].startswith("WARN  sandbox.cgroups ")
    assert lines[4].strip() == "fix: run as root"
    assert lines[5].startswith("skip  provider ")
    assert "unused" not in render_text(CHECKS)  # a skip shows no fix
    assert lines[-1] == "fleet doctor: 1 check(s) failed, 1 warning(s)"


def test_the_json_document_has_ok_and_every_check_with_its_fields() -> None:
    document = json.loads(render_json(CHECKS))
    assert set(document) == {"ok", "checks"}
    assert document["ok"] is False
    assert [check["name"] for check in document["checks"]] == [check.name for check in CHECKS]
    assert document["checks"][1] == {
        "name": "database",
        "status": "fail",
        "detail": "schema at nothing",
        "fix": "run `fleet db upgrade`",
    }
    assert document["checks"][0]["fix"] is None
    assert json.loads(render_json([c for c in CHECKS if c.status != "fail"]))["ok"] is True


@pytest.mark.parametrize(
    ("statuses", "passed"),
    [(["ok"], True), (["ok", "warn", "skip"], True), (["ok", "fail"], False), (["fail"], False), ([], True)],
)
def test_only_a_fail_fails(statuses: list[str], passed: bool) -> None:
    checks = [Check(name=f"c{i}", status=status, detail="") for i, status in enumerate(statuses)]  # type: ignore[arg-type]
    assert all_passed(checks) is passed


def test_a_broken_config_exits_1_and_skips_the_rest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEET_CONFIG", CONFIG)
    monkeypatch.setenv("FLEET_PROFILE", "no-such-profile")
    assert run_doctor(as_json=True) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False
    config, *rest = document["checks"]
    assert config["status"] == "fail" and "no-such-profile" in config["detail"]
    assert "FLEET_PROFILE" in config["fix"]
    assert [(check["name"], check["status"]) for check in rest] == [
        ("database", "skip"),
        ("redis", "skip"),
        ("store", "skip"),
        ("sandbox", "skip"),
        ("provider", "skip"),
    ]


@pytest.mark.parametrize(
    ("message", "fix"),
    [
        (
            "environment variable FLEET_LM_MODEL is not set (referenced by x.model_env)",
            "export FLEET_LM_MODEL",
        ),
        ("FLEET_REDIS_URL is not set and storage.redis_url is empty (...)", "export FLEET_REDIS_URL="),
        ("config file /etc/fleet/fleet.toml not found (set FLEET_CONFIG)", "set FLEET_CONFIG"),
        ("f.toml: profile 'x' is not defined (known: local, offline)", "set FLEET_PROFILE"),
        (
            "f.toml: profiles.a.storage.database_url: a URL with credentials is accepted only from an "
            "environment variable (FLEET_DATABASE_URL), never from the config file",
            "export it",
        ),
        ("f.toml: profiles.a.rlm.max_iters: Expected `int`", "fix the key named above in f.toml"),
    ],
)
def test_each_config_error_gets_a_concrete_fix(message: str, fix: str) -> None:
    assert fix in config_fix(message, "f.toml")


def test_the_config_check_names_the_profile_and_the_file() -> None:
    check, settings = check_config({"FLEET_CONFIG": CONFIG, "FLEET_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert settings is not None
    assert check.status == "ok"
    assert "profile offline" in check.detail and CONFIG in check.detail


@pytest.mark.parametrize(
    ("revision", "read_only", "status", "needle"),
    [
        (HEAD_REVISION, False, "ok", "at head"),
        (REVISIONS[0], False, "fail", "fleet db upgrade"),
        (None, False, "fail", "fleet db upgrade"),
        ("9999_from_the_future", False, "warn", "newer"),
        (HEAD_REVISION, True, "warn", "read-only"),
    ],
)
def test_the_schema_against_head(revision: str | None, read_only: bool, status: str, needle: str) -> None:
    check = schema_check("sqlite:///x", revision, read_only)
    assert check.status == status
    assert needle in f"{check.detail} {check.fix}"


def test_a_missing_sqlite_file_is_reported_not_created(tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    assert missing_sqlite_file(f"sqlite+aiosqlite:///{path}") == str(path)
    path.touch()
    assert missing_sqlite_file(f"sqlite+aiosqlite:///{path}") is None
    assert missing_sqlite_file("postgresql+asyncpg://u@h/db") is None
    assert missing_sqlite_file("sqlite+aiosqlite:///:memory:") is None


def test_every_secret_the_settings_hold_is_scrubbed() -> None:
    settings = settings_with(
        FLEET_DATABASE_URL=f"postgresql+asyncpg://fleet:{SECRET}@db:5432/fleet",
        FLEET_REDIS_URL=f"redis://:{SECRET}x@redis:6379/0",
        FLEET_API_TOKEN="tok-unit-must-not-print",
    )
    secrets = secrets_of(settings)
    assert {SECRET, f"{SECRET}x", "tok-unit-must-not-print"} <= set(secrets)
    leaky = Check(
        name="redis",
        status="fail",
        detail=f"driver said: password {SECRET}x rejected; token tok-unit-must-not-print",
        fix=f"check postgresql://fleet:{SECRET}@db/fleet",
    )
    (clean,) = scrub([leaky], secrets)
    assert SECRET not in clean.detail + (clean.fix or "")
    assert "tok-unit-must-not-print" not in clean.detail
    assert clean.fix == "check postgresql://fleet:***@db/fleet"


def test_passwords_given_as_query_parameters_are_scrubbed_everywhere() -> None:
    settings = settings_with(
        FLEET_DATABASE_URL="postgresql+asyncpg://fleet@db/fleet?sslmode=require&password=hunter2",
        FLEET_REDIS_URL="redis://redis:6379/0?password=x",
    )
    secrets = secrets_of(settings)
    assert {"hunter2", "x"} <= set(secrets)
    leaky = Check(
        name="database",
        status="fail",
        detail='FATAL: password authentication failed (password "hunter2"); redis said x is wrong',
        fix=f"now {settings.database_url} and {settings.redis_url}",
    )
    (clean,) = scrub([leaky], secrets)
    assert clean.detail == 'FATAL: password authentication failed (password "***"); redis said *** is wrong'
    assert clean.fix == (
        "now postgresql+asyncpg://***@db/fleet?sslmode=require&password=*** and redis://redis:6379/0?password=***"
    )


def test_a_hung_check_is_reported_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "MARGIN_SECONDS", 0.1)
    never = threading.Event()

    def hang() -> list[Check]:
        never.wait()
        return []

    def broken() -> list[Check]:
        raise RuntimeError("a bug")

    started = time.monotonic()
    checks = run_bounded(
        [
            Planned("redis", 0.2, hang),
            Planned("sandbox", 5, broken),
            Planned("provider", 5, lambda: [Check(name="provider", status="ok", detail="fine")]),
        ]
    )
    never.set()
    assert time.monotonic() - started < 3
    assert [(check.name, check.status) for check in checks] == [
        ("redis", "fail"),
        ("sandbox", "fail"),
        ("provider", "ok"),
    ]
    assert "no answer within 0.3s" in checks[0].detail
    assert checks[1].detail == "the check itself failed: RuntimeError: a bug"


def test_an_error_line_is_one_line_of_the_drivers_own_error() -> None:
    from sqlalchemy.exc import OperationalError

    wrapped = OperationalError("SELECT 1", {}, OSError("connection refused\nsecond line"))
    assert error_line(wrapped) == "OSError: connection refused"
    assert error_line(ValueError()) == "ValueError"


def test_a_gateway_only_install_skips_the_worker_checks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No sandbox to try, and no LM key needed: the gateway never calls the LM."""
    import fleet_cli.sides

    monkeypatch.setattr(fleet_cli.sides, "installed", lambda side: side != "worker")
    env = {
        "FLEET_CONFIG": CONFIG,
        "FLEET_PROFILE": "local",
        "FLEET_LM_MODEL": "openai/fake-model",  # no FLEET_LM_API_KEY, no FLEET_LM_BASE_URL
        "FLEET_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "FLEET_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'absent.db'}",
    }
    checks = {check.name: check for check in collect_checks(env)}
    assert list(checks) == ["config", "database", "redis", "store", "sandbox", "provider"]
    assert checks["config"].status == "ok"
    for name in ("sandbox", "provider"):
        assert checks[name].status == "skip" and "worker side is not installed" in checks[name].detail


def test_a_daytona_profile_points_at_the_live_daytona_check() -> None:
    from fleet_worker.sandbox.doctor import check_sandbox

    settings = settings_with(
        FLEET_PROFILE="daytona",
        FLEET_LM_MODEL="openai/x",
        FLEET_LM_API_KEY=KEY,
        FLEET_LM_BASE_URL="http://127.0.0.1:1/v1",
        FLEET_DAYTONA_API_KEY=KEY,
        FLEET_DATABASE_URL="postgresql+asyncpg://fleet@db/fleet",
    )
    (check,) = check_sandbox(settings)
    assert check.status == "skip" and "fleet doctor daytona" in check.detail


def lm(base_url: str | None, key: str | None = KEY, scripted: bool = False) -> ResolvedLM:
    return ResolvedLM(
        name="scripted/demo" if scripted else "openai/fake-model",
        scripted=scripted,
        script_path=None,
        api_key=Secret(key) if key else None,
        base_url=base_url,
        num_retries=0,
        temperature=None,
        max_tokens=None,
    )


SECTION = LMSection(
    model_env="FLEET_LM_MODEL", api_key_env="FLEET_LM_API_KEY", base_url_env="FLEET_LM_BASE_URL"
)


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with serve_fake_provider() as fake:
        yield fake


@pytest.mark.parametrize(
    ("server_status", "api_key", "status", "needle"),
    [
        (200, KEY, "ok", "accepted the key (200"),
        (200, "sk-the-right-one", "fail", "the key was refused (401)"),
        (403, None, "fail", "the key was refused (403)"),
        (404, None, "warn", "answered 404"),
        (500, None, "fail", "answered 500"),
    ],
)
def test_the_provider_check_reads_the_status_only(
    provider: FakeProvider, server_status: int, api_key: str | None, status: str, needle: str
) -> None:
    provider.status, provider.api_key = server_status, api_key
    check = check_provider("provider", lm(provider.url), SECTION, 5)
    assert check.status == status
    assert needle in check.detail
    assert provider.headers[-1]["authorization"] == f"Bearer {KEY}"
    shown = f"{check.detail} {check.fix}"
    assert KEY not in shown and "Incorrect API key" not in shown  # the refusal's body echoes the key
    if status == "fail" and "refused" in needle:
        assert check.fix == "set FLEET_LM_API_KEY to a key this provider accepts"


def test_an_unreachable_provider_fails_with_its_variable() -> None:
    check = check_provider("provider", lm(f"http://127.0.0.1:{free_port()}/v1"), SECTION, 5)
    assert check.status == "fail" and "is unreachable" in check.detail
    assert check.fix is not None and "FLEET_LM_BASE_URL" in check.fix


def test_scripted_and_named_providers_are_skipped() -> None:
    assert check_provider("provider", lm(None, scripted=True), SECTION, 5).detail == (
        "scripted LM: nothing to authenticate"
    )
    named = check_provider("provider", lm(None), SECTION, 5)
    assert named.status == "skip" and "base_url_env" in named.detail


def test_collect_checks_bounds_a_dead_redis(tmp_path: Path) -> None:
    """The config and sandbox-independent parts run; a closed Redis port fails at once."""
    env = {
        "FLEET_CONFIG": CONFIG,
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{free_port()}/0",
        "FLEET_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'absent.db'}",
    }
    started = time.monotonic()
    checks = {check.name: check for check in collect_checks(env)}
    assert time.monotonic() - started < 30
    assert checks["redis"].status == "fail" and ":***@" in checks["redis"].detail
    assert checks["database"].status == "fail" and "fleet db upgrade" in (checks["database"].fix or "")
    assert not (tmp_path / "absent.db").exists()
    assert all(SECRET not in f"{check.detail} {check.fix}" for check in checks.values())


def test_beside_a_running_fleet_up_the_doctor_checks_its_redis_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in first-run testing: `fleet doctor` beside `fleet up` failed with "FLEET_REDIS_URL
    is not set", though the stack's own Redis was listening on a socket in the data dir."""
    import shutil
    import subprocess

    import redis as sync_redis

    monkeypatch.chdir(tmp_path)  # the offline profile's data dir is .fleet, here
    monkeypatch.delenv("FLEET_REDIS_URL", raising=False)
    data_dir = tmp_path / ".fleet"
    data_dir.mkdir()
    sock = data_dir / "redis.sock"
    binary = shutil.which("redis-server")
    assert binary is not None
    argv = [binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", ""]
    server = subprocess.Popen([*argv, "--dir", str(data_dir)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline, "the private redis-server never made its socket"
            time.sleep(0.02)
        sync_redis.Redis(unix_socket_path=str(sock)).ping()
        checks = {c.name: c for c in collect_checks({"FLEET_CONFIG": CONFIG, "FLEET_PROFILE": "offline"})}
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert checks["config"].status == "ok", checks["config"]
    assert checks["redis"].status == "ok", checks["redis"]
    assert "the running `fleet up`'s Redis" in checks["config"].detail


def test_with_no_redis_url_and_no_fleet_up_the_fix_names_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLEET_REDIS_URL", raising=False)
    check, settings = check_config({"FLEET_CONFIG": CONFIG, "FLEET_PROFILE": "offline"})
    assert settings is None and check.status == "fail"
    assert "fleet up" in check.fix and "unix://" in check.fix
