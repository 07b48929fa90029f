"""GET/PATCH /api/settings through the gateway in-process, on a copy of config/fleet.toml: loopback
clients only, revisions, refusals that leave the file untouched, comments kept, restart to apply."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_shared.config import Settings, load_settings
from tests.support.api import ApiClient
from tests.support.peer import peer_client
from tests.support.policy import LOCAL_LM_ENV

REPO = Path(__file__).resolve().parents[2]
SECRET = "sk-env-value-never-shown"


@pytest.fixture(autouse=True)
def gateway_environment(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """A PATCH is loaded as the next startup would load it, with the gateway's environment: this
    one can start the shipped `offline` and `local` profiles."""
    monkeypatch.setenv("FLEET_REDIS_URL", redis_url)
    for name, value in LOCAL_LM_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "config" / "scripts", tmp_path / "scripts")  # the offline profile's script
    copy = tmp_path / "fleet.toml"
    shutil.copyfile(REPO / "config" / "fleet.toml", copy)
    return copy


def settings_for(config: Path, sqlite_url: str, redis_url: str, **extra: str) -> Settings:
    return load_settings(
        {
            "FLEET_CONFIG": str(config),
            "FLEET_DATABASE_URL": sqlite_url,
            "FLEET_REDIS_URL": redis_url,
            "FLEET_SCRIPTED_LM": str(REPO / "config" / "scripts" / "demo.jsonl"),
            **extra,
        }
    )


@pytest.fixture
def client(config: Path, sqlite_url: str, redis_url: str) -> Iterator[ApiClient]:
    with peer_client(settings_for(config, sqlite_url, redis_url), "127.0.0.1") as client:
        yield client


def revision(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def comments(text: str) -> list[str]:
    return [line[line.index("#") :] for line in text.splitlines() if "#" in line]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "::ffff:127.0.0.1"])
def test_loopback_clients_read_the_policy_file(
    config: Path, sqlite_url: str, redis_url: str, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_LM_API_KEY", SECRET)  # in the environment, named by the file
    with peer_client(settings_for(config, sqlite_url, redis_url), host) as client:
        response = client.get("/api/settings")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["revision"] == revision(config)
    assert body["path"] == "fleet.toml"
    assert (body["active_profile"], body["default_profile"], body["applies"]) == (
        "offline",
        "offline",
        "on_restart",
    )
    assert body["profiles"]["local"]["llm"]["root"]["api_key_env"] == "FLEET_LM_API_KEY"
    assert body["profiles"]["offline"]["rlm"]["max_iters"] == 12
    assert "restart_required" not in body
    assert SECRET not in response.text and str(config.parent) not in response.text


@pytest.mark.parametrize("host", [None, "10.0.0.7", "192.168.1.2", "::ffff:10.0.0.7", "127.0.0.2x"])
def test_other_clients_are_forbidden(config: Path, sqlite_url: str, redis_url: str, host: str | None) -> None:
    settings = settings_for(config, sqlite_url, redis_url)
    before = config.read_bytes()
    # None: Litestar's own test client, whose peer is "testclient".
    with TestClient(create_app(settings)) if host is None else peer_client(settings, host) as client:
        read = client.get("/api/settings")
        write = client.patch(
            "/api/settings", json={"revision": revision(config), "set": {"config.default_profile": "local"}}
        )
    for response in (read, write):
        assert response.status_code == 403, response.text
        assert response.json()["code"] == "forbidden" and response.json()["message"]
    assert config.read_bytes() == before


def test_a_change_is_written_with_its_comments_and_shown_by_the_next_read(
    client: ApiClient,
    config: Path,
) -> None:
    before_text = config.read_text()
    read = client.get("/api/settings").json()
    response = client.patch(
        "/api/settings",
        json={
            "revision": read["revision"],
            "set": {"profiles.local.rlm.max_iters": 30, "profiles.offline.rlm.max_iters": 9},
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["restart_required"] is True and body["applies"] == "on_restart"
    assert body["revision"] == revision(config) != read["revision"]
    assert body["default_profile"] == "offline" == body["active_profile"]
    assert body["profiles"]["local"]["rlm"]["max_iters"] == 30
    assert body["profiles"]["offline"]["rlm"]["max_iters"] == 9
    after_text = config.read_text()
    assert comments(after_text) == comments(before_text)
    assert "max_iters = 30" in after_text and "max_iters = 9" in after_text
    again = client.get("/api/settings").json()
    assert {k: v for k, v in body.items() if k != "restart_required"} == again
    restarted = load_settings(
        {
            "FLEET_CONFIG": str(config),
            "FLEET_REDIS_URL": "redis://127.0.0.1:1/0",
            "FLEET_LM_MODEL": "openai/x",
            "FLEET_LM_API_KEY": "k",
            "FLEET_LM_BASE_URL": "http://127.0.0.1:9/v1",
            "FLEET_PROFILE": "local",
        }
    )
    assert restarted.profile_name == "local" and restarted.profile.rlm.max_iters == 30


def test_a_stale_revision_is_a_conflict_and_writes_nothing(
    client: ApiClient,
    config: Path,
) -> None:
    stale = client.get("/api/settings").json()["revision"]
    assert (
        client.patch(
            "/api/settings", json={"revision": stale, "set": {"profiles.local.rlm.max_iters": 31}}
        ).status_code
        == 200
    )
    before = config.read_bytes()
    response = client.patch(
        "/api/settings", json={"revision": stale, "set": {"profiles.local.rlm.max_iters": 32}}
    )
    assert response.status_code == 409, response.text
    assert response.json()["code"] == "settings_revision_conflict"
    assert "re-read" in response.json()["message"]
    assert config.read_bytes() == before


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"profiles.local.rlm.max_iters": 1000}, "profiles.local.rlm.max_iters"),
        ({"profiles.offline.sandbox.provider": "docker"}, "profiles.offline.sandbox.provider"),
        ({"profiles.offline.rlm.bogus": 1}, "profiles.offline.rlm.bogus"),
        ({"config.default_profile": "local"}, "config.default_profile: only the file on disk"),
        ({"profiles.elsewhere.rlm.max_iters": 3}, "profile 'elsewhere' is not in the file"),
        ({"profiles.offline": None}, "offline"),
        ({"profiles.local.llm.root.api_key_env": "sk-live-abc"}, "profiles.local.llm.root.api_key_env"),
        (
            {"profiles.offline.storage.redis_url": "redis://:hunter2@cache/0"},
            "profiles.offline.storage.redis_url",
        ),
        ({"elsewhere.key": 1}, "elsewhere.key"),
    ],
)
def test_an_invalid_change_is_refused_and_the_file_is_unchanged(
    client: ApiClient,
    config: Path,
    changes: dict[str, Any],
    named: str,
) -> None:
    before = config.read_bytes()
    response = client.patch("/api/settings", json={"revision": revision(config), "set": changes})
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "validation_error"
    assert named in response.json()["message"] and "hunter2" not in response.text
    assert config.read_bytes() == before
    kept = sorted(p.name for p in config.parent.iterdir() if not p.name.endswith(".lock"))
    assert kept == ["fleet.toml", "scripts"]  # no temp file


@pytest.mark.parametrize(
    "body",
    [
        {"set": {"config.default_profile": "local"}},
        {"revision": "abc", "set": {"config.default_profile": "local"}},
        {"revision": "0" * 64, "set": {}},
        {"revision": "0" * 64, "set": {f"profiles.offline.rlm.k{i}": i for i in range(51)}},
        {"revision": "0" * 64, "set": {"config.default_profile": {"nested": 1}}},
        {"revision": "0" * 64, "set": {"config.default_profile": "local"}, "extra": 1},
    ],
)
def test_malformed_bodies_are_422(
    client: ApiClient,
    config: Path,
    body: dict[str, Any],
) -> None:
    before = config.read_bytes()
    response = client.patch("/api/settings", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "validation_error"
    assert config.read_bytes() == before


def test_concurrent_patches_lose_no_update(
    client: ApiClient,
    config: Path,
) -> None:
    """Eight editors from one revision: one wins, seven are told to re-read. Editors that re-read
    and retry all land, each change kept."""
    start = client.get("/api/settings").json()["revision"]

    def change(value: int) -> int:
        body = {"revision": start, "set": {"profiles.local.rlm.max_iters": value}}
        return int(client.patch("/api/settings", json=body).status_code)

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(change, range(31, 39)))
    assert sorted(statuses) == [200] + [409] * 7

    def retrying(index: int) -> None:
        for _ in range(50):
            current = client.get("/api/settings").json()["revision"]
            body = {"revision": current, "set": {key_for(index): 100 + index}}
            if client.patch("/api/settings", json=body).status_code == 200:
                return
        raise AssertionError("never landed")

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(retrying, range(4)))
    profiles = client.get("/api/settings").json()["profiles"]
    assert [profiles[name]["rlm"]["max_events"] for name in EDITED_PROFILES] == [100, 101, 102, 103]


EDITED_PROFILES = ("local", "offline", "local-recursive", "daytona")


def key_for(index: int) -> str:
    return f"profiles.{EDITED_PROFILES[index]}.rlm.max_events"


def test_settings_need_the_bearer_token_too(config: Path, sqlite_url: str, redis_url: str) -> None:
    settings = settings_for(config, sqlite_url, redis_url, FLEET_API_TOKEN="tok-settings")
    with peer_client(settings, "127.0.0.1") as client:
        missing = client.get("/api/settings")
        given = client.get("/api/settings", headers={"Authorization": "Bearer tok-settings"})
    assert missing.status_code == 401 and missing.json()["code"] == "auth_required"
    assert given.status_code == 200
