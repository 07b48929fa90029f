"""`gateway.auth` names the token's variable; connection URLs with passwords come only from env."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet_shared.config import has_credentials, load_settings
from fleet_shared.errors import ConfigError

HEADER = '[config]\ndefault_profile = "p"\n\n[profiles.p.llm.root]\nmodel = "openai/gpt-4o-mini"\n'


def env_for(tmp_path: Path, extra_toml: str = "", **env: str) -> dict[str, str]:
    path = tmp_path / "fleet.toml"
    path.write_text(HEADER + extra_toml, encoding="utf-8")
    return {"FLEET_CONFIG": str(path), "FLEET_REDIS_URL": "redis://127.0.0.1:6379/0", **env}


def one_line_error(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    message = str(info.value)
    assert "\n" not in message and message
    return message


def test_the_token_variable_defaults_to_fleet_api_token(tmp_path: Path) -> None:
    settings = load_settings(env_for(tmp_path, FLEET_API_TOKEN="tok-default"))
    assert settings.profile.gateway.auth.token_env == "FLEET_API_TOKEN"
    assert settings.api_token is not None and settings.api_token.reveal() == "tok-default"
    assert load_settings(env_for(tmp_path)).api_token is None  # unset: no auth


def test_gateway_auth_names_another_variable(tmp_path: Path) -> None:
    toml = '\n[profiles.p.gateway.auth]\ntoken_env = "MY_GATEWAY_TOKEN"\n'
    settings = load_settings(env_for(tmp_path, toml, MY_GATEWAY_TOKEN="tok-mine", FLEET_API_TOKEN="ignored"))
    assert settings.api_token is not None and settings.api_token.reveal() == "tok-mine"
    assert load_settings(env_for(tmp_path, toml, FLEET_API_TOKEN="ignored")).api_token is None


@pytest.mark.parametrize("value", ['"not an env name"', '"sk-abc"', "5"])
def test_a_token_env_that_is_not_a_variable_name_stops_startup(tmp_path: Path, value: str) -> None:
    message = one_line_error(env_for(tmp_path, f"\n[profiles.p.gateway.auth]\ntoken_env = {value}\n"))
    assert "profiles.p.gateway.auth.token_env" in message


@pytest.mark.parametrize(
    ("key", "url"),
    [
        ("database_url", "postgresql+asyncpg://fleet:hunter2@db:5432/fleet"),
        ("database_url", "postgresql+asyncpg://fleet:p@ss@hunter2@db/fleet"),
        ("redis_url", "redis://:hunter2@cache:6379/0"),
        ("redis_url", "rediss://default:hunter2@cache:6380/0"),
    ],
)
def test_a_url_with_credentials_in_the_file_stops_startup(tmp_path: Path, key: str, url: str) -> None:
    message = one_line_error(env_for(tmp_path, f'\n[profiles.p.storage]\n{key} = "{url}"\n'))
    assert f"profiles.p.storage.{key}" in message
    assert "environment variable" in message
    assert "hunter2" not in message


def test_the_rule_holds_for_a_profile_that_is_not_selected(tmp_path: Path) -> None:
    toml = (
        '\n[profiles.other.llm.root]\nmodel = "m"\n[profiles.other.storage]\nredis_url = "redis://:pw@h/0"\n'
    )
    assert "profiles.other.storage.redis_url" in one_line_error(env_for(tmp_path, toml))


def test_urls_without_a_password_in_the_file_and_with_one_in_env_are_fine(tmp_path: Path) -> None:
    toml = '\n[profiles.p.storage]\ndatabase_url = "postgresql+asyncpg://postgres@db/fleet"\n'
    assert load_settings(env_for(tmp_path, toml)).database_url == "postgresql+asyncpg://postgres@db/fleet"
    settings = load_settings(
        env_for(
            tmp_path,
            FLEET_DATABASE_URL="postgresql+asyncpg://fleet:hunter2@db/fleet",
            FLEET_REDIS_URL="redis://:hunter2@cache:6379/0",
        )
    )
    assert settings.redis_url == "redis://:hunter2@cache:6379/0"
    assert "hunter2" not in repr(settings)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("redis://:pw@h/0", True),
        ("postgresql://user:pw@h/db", True),
        ("postgresql://user:p@ss@h/db", True),
        ("postgresql://user@h/db", False),
        ("postgresql://h/db?password=pw", True),
        ("postgresql://h/db?sslmode=require", False),
        ("http://h:8080/a@b", False),
        ("https://h/x:y@z", False),
        ("scripted/demo", False),
    ],
)
def test_has_credentials(text: str, expected: bool) -> None:
    assert has_credentials(text) is expected


# --- the auth modes ------------------------------------------------------------------------------

JWT_TOML = (
    '\n[profiles.p.gateway.auth]\nmode = "jwt"\n\n[profiles.p.gateway.auth.jwt]\n'
    'jwks_url = "https://idp.example/keys"\nissuer = "https://idp.example/"\naudience = "fleet"\n'
)


def test_tokens_mode_needs_a_file_and_finds_it_beside_the_config(tmp_path: Path) -> None:
    toml = '\n[profiles.p.gateway.auth]\nmode = "tokens"\n'
    assert "tokens_file is empty and FLEET_AUTH_TOKENS_FILE is not set" in one_line_error(
        env_for(tmp_path, toml)
    )
    named = load_settings(env_for(tmp_path, toml + 'tokens_file = "tokens.toml"\n'))
    assert named.tokens_file == tmp_path / "tokens.toml" and named.auth_required
    from_env = load_settings(env_for(tmp_path, toml, FLEET_AUTH_TOKENS_FILE="/run/secrets/tokens.toml"))
    assert from_env.tokens_file == Path("/run/secrets/tokens.toml")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ('jwks_url = "https://idp.example/keys"', "jwt.issuer is required"),
        ('jwks_url = "http://idp.example/keys"\nissuer = "i"\naudience = "a"', "must be https"),
        ('jwks_url = "https://k"\nissuer = "i"\naudience = "a"\nalgorithms = ["HS256"]', "HS256"),
        ('jwks_url = "https://k"\nissuer = "i"\naudience = "a"\nalgorithms = ["none"]', "none"),
    ],
)
def test_jwt_mode_refuses_what_cannot_be_verified_safely(tmp_path: Path, change: str, problem: str) -> None:
    toml = f'\n[profiles.p.gateway.auth]\nmode = "jwt"\n\n[profiles.p.gateway.auth.jwt]\n{change}\n'
    assert problem in one_line_error(env_for(tmp_path, toml))


def test_jwt_mode_takes_a_loopback_http_jwks_and_the_deployments_variables(tmp_path: Path) -> None:
    loopback = JWT_TOML.replace("https://idp.example/keys", "http://127.0.0.1:8080/keys")
    assert load_settings(env_for(tmp_path, loopback)).profile.gateway.auth.jwt.jwks_url.startswith(
        "http://127"
    )
    settings = load_settings(
        env_for(
            tmp_path,
            FLEET_AUTH_MODE="jwt",
            FLEET_AUTH_JWKS_URL="https://login.example/keys",
            FLEET_AUTH_JWT_ISSUER="https://login.example/",
            FLEET_AUTH_JWT_AUDIENCE="api://fleet",
            FLEET_AUTH_JWT_TENANT_CLAIM="org",
        )
    )
    jwt = settings.profile.gateway.auth.jwt
    assert settings.profile.gateway.auth.mode == "jwt" and settings.auth_required
    assert (jwt.jwks_url, jwt.issuer, jwt.audience, jwt.tenant_claim) == (
        "https://login.example/keys",
        "https://login.example/",
        "api://fleet",
        "org",
    )
    assert "FLEET_AUTH_*" in one_line_error(env_for(tmp_path, FLEET_AUTH_MODE="ldap"))
    assert "jwt.jwks_url is required" in one_line_error(env_for(tmp_path, FLEET_AUTH_MODE="jwt"))
