"""Bearer auth through the gateway in-process: the token's variable is named by `gateway.auth`,
and the probes, /metrics and the OpenAPI document stay open."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_shared.config import load_settings

REPO = Path(__file__).resolve().parents[2]
OPEN_PATHS = ["/health", "/ready", "/health/ready", "/metrics", "/schema/openapi.json"]


def config_naming(tmp_path: Path, token_env: str) -> Path:
    copy = tmp_path / "fleet.toml"
    shutil.copyfile(REPO / "config" / "fleet.toml", copy)
    with copy.open("a", encoding="utf-8") as handle:
        handle.write(f'\n[profiles.offline.gateway.auth]\ntoken_env = "{token_env}"\n')
    return copy


def test_the_token_comes_from_the_variable_gateway_auth_names(
    tmp_path: Path, sqlite_url: str, redis_url: str
) -> None:
    settings = load_settings(
        {
            "FLEET_CONFIG": str(config_naming(tmp_path, "MY_GATEWAY_TOKEN")),
            "FLEET_DATABASE_URL": sqlite_url,
            "FLEET_REDIS_URL": redis_url,
            "FLEET_SCRIPTED_LM": str(REPO / "config" / "scripts" / "demo.jsonl"),
            "MY_GATEWAY_TOKEN": "tok-named",
            "FLEET_API_TOKEN": "tok-default-ignored",
        }
    )
    with TestClient(create_app(settings)) as client:
        named = client.get("/api/sessions", headers={"Authorization": "Bearer tok-named"})
        lower_scheme = client.get("/api/sessions", headers={"Authorization": "bearer tok-named"})
        default = client.get("/api/sessions", headers={"Authorization": "Bearer tok-default-ignored"})
        prefix = client.get("/api/sessions", headers={"Authorization": "Bearer tok-name"})
        basic = client.get("/api/sessions", headers={"Authorization": "Basic tok-named"})
        opened = {path: client.get(path) for path in OPEN_PATHS}
    assert named.status_code == 200 and lower_scheme.status_code == 200
    for refused in (default, prefix, basic):
        assert refused.status_code == 401 and refused.json()["code"] == "auth_required"
        assert refused.headers["www-authenticate"] == "Bearer"
    for path, response in opened.items():
        assert response.status_code != 401, (path, response.text)
    assert opened["/health"].status_code == 200 and opened["/metrics"].status_code == 200
    assert opened["/schema/openapi.json"].status_code == 200


@pytest.mark.parametrize("path", OPEN_PATHS)
def test_open_paths_are_outside_the_guarded_router(path: str, sqlite_url: str, redis_url: str) -> None:
    settings = load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": sqlite_url,
            "FLEET_REDIS_URL": redis_url,
            "FLEET_API_TOKEN": "tok-open-paths",
        }
    )
    with TestClient(create_app(settings)) as client:
        assert client.get(path).status_code != 401
        assert client.get("/api/skills").status_code == 401
