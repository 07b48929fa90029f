"""`fleet_shared.config.load_settings`: the shipped file loads, and every problem is one named line."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_shared.config import Secret, config_summary, load_settings
from fleet_shared.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
SHIPPED_CONFIG = REPO_ROOT / "config" / "fleet.toml"
DEMO_SCRIPT = REPO_ROOT / "config" / "scripts" / "demo.jsonl"

# The smallest valid file in the shape of config/fleet.toml; negative cases add one bad line.
MINIMAL = """\
[config]
default_profile = "p"

[profiles.p.llm.root]
model = "openai/gpt-4o-mini"
"""
ROOT_ONLY = '[config]\ndefault_profile = "p"\n[profiles.p.llm.root]\n{}\n'


def shipped_env(**extra: str) -> dict[str, str]:
    return {"FLEET_CONFIG": str(SHIPPED_CONFIG), "FLEET_REDIS_URL": "redis://127.0.0.1:6379/0", **extra}


def write_config(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "fleet.toml"
    path.write_text(text, encoding="utf-8")
    return {"FLEET_CONFIG": str(path), "FLEET_REDIS_URL": "redis://127.0.0.1:6379/0"}


def config_error(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    message = str(info.value)
    assert "\n" not in message, f"ConfigError must be one line: {message!r}"
    assert message.strip() == message and message
    return message


# --- the shipped file ---------------------------------------------------------------------------


def test_shipped_offline_profile_loads() -> None:
    settings = load_settings(shipped_env())

    assert settings.profile_name == "offline"
    assert settings.config_path == SHIPPED_CONFIG
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    for lm in (settings.root_lm, settings.sub_lm):
        assert lm.name == "scripted/demo"
        assert lm.scripted is True
        assert lm.script_path == DEMO_SCRIPT.resolve()
        assert lm.api_key is None
    assert settings.profile.rlm.max_iters == 12
    assert settings.profile.sandbox.provider == "local"
    assert settings.profile.sandbox.local.allow_unisolated is False
    assert settings.database_url.startswith("sqlite+aiosqlite:///")
    assert settings.database_url.endswith("/.fleet/fleet.db")
    assert settings.workspaces_dir == Path(".fleet") / "workspaces"
    assert settings.api_token is None
    assert len(settings.config_revision) == 64


def test_shipped_local_profile_loads() -> None:
    settings = load_settings(
        shipped_env(
            FLEET_PROFILE="local",
            FLEET_LM_MODEL="openai/gpt-4o-mini",
            FLEET_LM_API_KEY="sk-local-secret",
            FLEET_LM_BASE_URL="http://127.0.0.1:11434/v1",
        )
    )

    assert settings.profile_name == "local"
    for lm in (settings.root_lm, settings.sub_lm):
        assert lm.name == "openai/gpt-4o-mini"
        assert lm.scripted is False
        assert lm.script_path is None
        assert lm.api_key is not None
        assert lm.api_key.reveal() == "sk-local-secret"
        assert lm.base_url == "http://127.0.0.1:11434/v1"
        assert lm.num_retries == 3
    assert settings.profile.runtime.turn_timeout_seconds == 900


def test_a_referenced_base_url_variable_that_is_unset_stops_startup() -> None:
    """Config strictness covers `base_url_env` too: it used to become None silently."""
    with pytest.raises(ConfigError, match=r"FLEET_LM_BASE_URL is not set .*llm\.root\.base_url_env"):
        load_settings(
            shipped_env(FLEET_PROFILE="local", FLEET_LM_MODEL="openai/gpt-4o-mini", FLEET_LM_API_KEY="k")
        )


def test_a_base_url_that_is_not_http_is_refused_without_echoing_it() -> None:
    env = shipped_env(
        FLEET_PROFILE="local",
        FLEET_LM_MODEL="openai/gpt-4o-mini",
        FLEET_LM_API_KEY="k",
        FLEET_LM_BASE_URL="ftp://user:hunter2@host/",
    )
    with pytest.raises(ConfigError, match="is not an http") as info:
        load_settings(env)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("missing", "extra", "key"),
    [
        ("FLEET_LM_API_KEY", {"FLEET_LM_MODEL": "openai/gpt-4o-mini"}, "api_key_env"),
        ("FLEET_LM_API_KEY", {"FLEET_LM_MODEL": "openai/gpt-4o-mini", "FLEET_LM_API_KEY": ""}, "api_key_env"),
        ("FLEET_LM_MODEL", {"FLEET_LM_API_KEY": "k"}, "model_env"),
    ],
    ids=["api-key-absent", "api-key-empty", "model-absent"],
)
def test_local_profile_names_the_missing_env_var(missing: str, extra: dict[str, str], key: str) -> None:
    message = config_error(shipped_env(FLEET_PROFILE="local", **extra))
    assert missing in message
    assert key in message
    assert "profiles.local.llm.root" in message


def test_redis_url_is_required() -> None:
    env = shipped_env()
    del env["FLEET_REDIS_URL"]
    assert "FLEET_REDIS_URL" in config_error(env)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "sqlite+aiosqlite:///"),
        ({"FLEET_DATABASE_URL": "postgresql+asyncpg://u@h/db"}, "postgresql+asyncpg://u@h/db"),
    ],
)
def test_database_url(env: dict[str, str], expected: str) -> None:
    assert load_settings(shipped_env(**env)).database_url.startswith(expected)


def test_api_token_is_a_secret() -> None:
    settings = load_settings(shipped_env(FLEET_API_TOKEN="tok-123456"))
    assert settings.api_token is not None
    assert settings.api_token.reveal() == "tok-123456"


# --- strictness: one line naming the key or variable -------------------------------------------


def test_unknown_top_level_key(tmp_path: Path) -> None:
    message = config_error(write_config(tmp_path, "bogus = 1\n" + MINIMAL))
    assert "bogus" in message


def test_unknown_key_in_config_header(tmp_path: Path) -> None:
    message = config_error(write_config(tmp_path, MINIMAL.replace('"p"\n', '"p"\nbogus = 1\n', 1)))
    assert "bogus" in message
    assert "config" in message


@pytest.mark.parametrize(
    ("section", "line", "name", "path"),
    [
        pytest.param(
            "[profiles.p.sandbox.local]",
            "bogus = 1",
            "bogus",
            "profiles.p.sandbox.local",
            id="nested",
        ),
        pytest.param(
            "[profiles.p.runtime]",
            "bogus = 1",
            "bogus",
            "profiles.p.runtime",
            id="section",
        ),
        pytest.param("[profiles.p]", "bogus = 1", "bogus", "profiles.p", id="profile"),
    ],
)
def test_unknown_key_in_profile_names_the_dotted_path(
    tmp_path: Path, section: str, line: str, name: str, path: str
) -> None:
    message = config_error(write_config(tmp_path, f"{MINIMAL}\n{section}\n{line}\n"))
    assert f"{path}.{name}: unknown key" in message


def test_bad_value_in_profile_names_the_full_dotted_path(tmp_path: Path) -> None:
    text = f"{MINIMAL}\n[profiles.p.runtime]\nheartbeat_seconds = 0\n"
    message = config_error(write_config(tmp_path, text))
    assert "profiles.p.runtime.heartbeat_seconds" in message


def test_unknown_nested_key_names_the_key_and_its_table(tmp_path: Path) -> None:
    text = f"{MINIMAL}\n[profiles.p.sandbox.local]\nbogus = 1\n"
    message = config_error(write_config(tmp_path, text))
    assert message.endswith("profiles.p.sandbox.local.bogus: unknown key")


@pytest.mark.parametrize(
    ("section", "line", "field"),
    [
        pytest.param("[profiles.p.runtime]", "heartbeat_seconds = 0", "runtime.heartbeat_seconds", id="hb=0"),
        pytest.param(
            "[profiles.p.runtime]", "heartbeat_seconds = 301", "runtime.heartbeat_seconds", id="hb=301"
        ),
        pytest.param(
            "[profiles.p.runtime]", 'heartbeat_seconds = "ten"', "runtime.heartbeat_seconds", id="hb=str"
        ),
        pytest.param(
            "[profiles.p.runtime]", "turn_timeout_seconds = 0", "runtime.turn_timeout_seconds", id="timeout=0"
        ),
        pytest.param("[profiles.p.rlm]", "max_iters = 0", "rlm.max_iters", id="max_iters=0"),
        pytest.param("[profiles.p.rlm]", 'recursion = "yes"', "rlm.recursion", id="recursion=str"),
        pytest.param("[profiles.p.sandbox]", 'provider = "docker"', "sandbox.provider", id="provider"),
        pytest.param("[profiles.p.sandbox.local]", "memory_mb = 1", "sandbox.local.memory_mb", id="memory"),
        pytest.param("[profiles.p.worker]", "concurrency = 0", "worker.concurrency", id="concurrency=0"),
        pytest.param("[profiles.p.worker]", "lease_seconds = 1", "worker.lease_seconds", id="lease=1"),
        pytest.param(
            "[profiles.p.gateway.limits]", "max_body_bytes = 1", "gateway.limits.max_body_bytes", id="body"
        ),
        pytest.param(
            "[profiles.p.gateway.limits]",
            "upload_idle_seconds = 0",
            "gateway.limits.upload_idle_seconds",
            id="upload_idle=0",
        ),
        pytest.param(
            "[profiles.p.gateway.limits]",
            "max_concurrent_uploads_per_client = 0",
            "gateway.limits.max_concurrent_uploads_per_client",
            id="uploads_per_client=0",
        ),
        pytest.param(
            "[profiles.p.observability]", 'log_level = "loud"', "observability.log_level", id="log_level"
        ),
        pytest.param("[profiles.p.llm.sub]", "num_retries = 11", "llm.sub.num_retries", id="retries"),
        pytest.param(
            "[profiles.p.llm.sub]", 'api_key_env = "lower_case"', "llm.sub.api_key_env", id="envname"
        ),
    ],
)
def test_bad_value_is_an_error_naming_the_field(tmp_path: Path, section: str, line: str, field: str) -> None:
    message = config_error(write_config(tmp_path, f"{MINIMAL}\n{section}\n{line}\n"))
    assert field in message


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[profiles.p.llm.root]\nmodel = "x/y"\n', "config"),
        ('[config]\n[profiles.p.llm.root]\nmodel = "x/y"\n', "default_profile"),
        ('[config]\ndefault_profile = "p"\n', "profiles"),
        ('[config]\ndefault_profile = "p"\n[profiles.p.runtime]\nheartbeat_seconds = 10\n', "llm"),
    ],
    ids=["no-config-table", "no-default-profile", "no-profiles", "no-llm"],
)
def test_missing_required_table_or_key(tmp_path: Path, text: str, named: str) -> None:
    assert named in config_error(write_config(tmp_path, text))


@pytest.mark.parametrize(
    ("env_profile", "default", "missing"),
    [("nope", "p", "nope"), (None, "gone", "gone")],
    ids=["from-env", "from-default_profile"],
)
def test_missing_profile_names_it_and_lists_known(
    tmp_path: Path, env_profile: str | None, default: str, missing: str
) -> None:
    text = MINIMAL.replace('default_profile = "p"', f'default_profile = "{default}"')
    text += '\n[profiles.other.llm.root]\nmodel = "x/y"\n'
    env = write_config(tmp_path, text)
    if env_profile is not None:
        env["FLEET_PROFILE"] = env_profile
    message = config_error(env)
    assert repr(missing) in message
    assert "known: other, p" in message


def test_shipped_file_missing_profile_lists_them_all(tmp_path: Path) -> None:
    message = config_error(shipped_env(FLEET_PROFILE="staging"))
    assert "'staging'" in message
    assert "known: daytona, daytona-recursive, local, local-recursive, offline" in message


@pytest.mark.parametrize(
    "text",
    [
        "[config\n",
        "[config]\ndefault_profile = \n",
        '[config]\ndefault_profile = "p"\ndefault_profile = "q"\n',
    ],
    ids=["unclosed-table", "missing-value", "duplicate-key"],
)
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    env = write_config(tmp_path, text)
    message = config_error(env)
    assert "invalid TOML" in message
    assert env["FLEET_CONFIG"] in message


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "fleet.toml"
    message = config_error({"FLEET_CONFIG": str(missing), "FLEET_REDIS_URL": "redis://x"})
    assert str(missing) in message
    assert "not found" in message


@pytest.mark.parametrize(
    ("llm", "named"),
    [
        ('model = "x/y"\nmodel_env = "FLEET_M"', "set exactly one of `model` or `model_env`"),
        ("num_retries = 1", "set exactly one of `model` or `model_env`"),
        ('model = "scripted/demo"', "profiles.p.llm.root.script"),
        ('model_env = "FLEET_NO_SUCH_MODEL_VAR"', "FLEET_NO_SUCH_MODEL_VAR"),
        ('model = "x/y"\napi_key_env = "FLEET_NO_SUCH_KEY_VAR"', "FLEET_NO_SUCH_KEY_VAR"),
    ],
    ids=["both", "neither", "scripted-without-script", "model-env-absent", "key-env-absent"],
)
def test_lm_section_problems(tmp_path: Path, llm: str, named: str) -> None:
    text = ROOT_ONLY.format(llm)
    message = config_error(write_config(tmp_path, text))
    assert named in message


def test_sub_lm_defaults_to_root(tmp_path: Path) -> None:
    settings = load_settings(write_config(tmp_path, MINIMAL))
    assert settings.sub_lm == settings.root_lm


def test_scripted_script_path_is_relative_to_config_folder(tmp_path: Path) -> None:
    (tmp_path / "s.jsonl").write_text('{"lm":"sub","text":"x"}\n', encoding="utf-8")
    text = ROOT_ONLY.format('model = "scripted/t"\nscript = "s.jsonl"')
    settings = load_settings(write_config(tmp_path, text))
    assert settings.root_lm.script_path == (tmp_path / "s.jsonl").resolve()


def test_scripted_script_file_must_exist(tmp_path: Path) -> None:
    text = ROOT_ONLY.format('model = "scripted/t"\nscript = "gone.jsonl"')
    message = config_error(write_config(tmp_path, text))
    assert "gone.jsonl" in message
    assert "does not exist" in message


def test_scripted_lm_override_points_at_an_existing_file(tmp_path: Path) -> None:
    script = tmp_path / "override.jsonl"
    script.write_text('{"lm":"sub","text":"x"}\n', encoding="utf-8")
    settings = load_settings(shipped_env(FLEET_SCRIPTED_LM=str(script)))
    assert settings.root_lm.script_path == script.resolve()
    assert settings.sub_lm.script_path == script.resolve()


def test_scripted_lm_override_must_exist(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    message = config_error(shipped_env(FLEET_SCRIPTED_LM=str(missing)))
    assert str(missing) in message
    assert "does not exist" in message


@pytest.mark.parametrize(
    "text",
    [
        MINIMAL + '"bad\\nkey" = 1\n',
        '[config]\ndefault_profile = "p"\n[profiles."two\\nlines".llm.root]\nmodel = "x/y"\n',
    ],
    ids=["unknown-key", "profile-name"],
)
def test_error_is_one_line_even_for_odd_keys(tmp_path: Path, text: str) -> None:
    config_error(write_config(tmp_path, text))


# --- secrets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("render", [repr, str, "{}".format, "{!r}".format, lambda s: f"{s!s:>40}"])
def test_secret_never_renders_its_value(render: object) -> None:
    secret = Secret("hunter2-value")
    assert callable(render)
    text = render(secret)
    assert "hunter2" not in text
    assert "***" in text
    assert secret.reveal() == "hunter2-value"


def test_settings_repr_and_summary_reveal_no_secret() -> None:
    settings = load_settings(
        shipped_env(
            FLEET_PROFILE="local",
            FLEET_LM_MODEL="openai/gpt-4o-mini",
            FLEET_LM_API_KEY="sk-very-secret-key",
            FLEET_LM_BASE_URL="https://lm-user:url-very-secret@lm.internal/v1",
            FLEET_API_TOKEN="tok-very-secret",
            FLEET_DATABASE_URL="postgresql+asyncpg://fleet:db-very-secret@db:5432/fleet",
            FLEET_REDIS_URL="redis://:redis-very-secret@cache:6379/0",
        )
    )
    summary = config_summary(settings)
    rendered = repr(summary) + repr(settings.root_lm) + repr(settings.sub_lm)
    for secret in (
        "sk-very-secret-key",
        "url-very-secret",
        "tok-very-secret",
        "db-very-secret",
        "redis-very-secret",
    ):
        assert secret not in rendered
    assert summary == {
        "profile": "local",
        "config": str(SHIPPED_CONFIG),
        "root_lm": "openai/gpt-4o-mini",
        "sub_lm": "openai/gpt-4o-mini",
        "sandbox": "local",
        "database": "postgresql+asyncpg",
        "auth": "token",
    }


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@cache:6379/0", "redis://:***@cache:6379/0"),
        ("https://user:p@ss@lm.internal/v1", "https://user:***@lm.internal/v1"),
        ("https://sk-bare-token@lm.internal/v1", "https://***@lm.internal/v1"),
        ("http://127.0.0.1:8/v1", "http://127.0.0.1:8/v1"),
    ],
)
def test_redact_url_hides_passwords_with_at_signs_and_bare_tokens(url: str, shown: str) -> None:
    from fleet_shared.config import redact_url

    assert redact_url(url) == shown
