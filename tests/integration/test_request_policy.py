"""A web page cannot talk to the gateway: a Host the gateway does not answer to (DNS rebinding) is a
421 before any handler runs, a change from a page of another origin is a 403, an upload needs a
header no plain form can send, and the settings routes serve no web page at all."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_shared.config import Settings, load_settings
from tests.support.api import ApiClient
from tests.support.peer import peer_client

REPO = Path(__file__).resolve().parents[2]
REBOUND = "rebind.attacker.example:8000"
ATTACKER = "http://attacker.example"
UPLOAD = {"attachment": ("a.txt", b"hello\n", "text/plain")}


def settings_for(sqlite_url: str, redis_url: str, **gateway: Any) -> Settings:
    settings = load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": sqlite_url,
            "FLEET_REDIS_URL": redis_url,
            "FLEET_ALLOWED_HOSTS": "fleet-gateway.fleet.svc, .internal.example",
        }
    )
    cors = msgspec.structs.replace(settings.profile.gateway.cors, **gateway.pop("cors", {}))
    section = msgspec.structs.replace(settings.profile.gateway, cors=cors, **gateway)
    profile = msgspec.structs.replace(settings.profile, gateway=section)
    return msgspec.structs.replace(settings, profile=profile)


@pytest.fixture
def client(sqlite_url: str, redis_url: str) -> Iterator[ApiClient]:
    settings = settings_for(sqlite_url, redis_url, cors={"allowed_origins": ("https://app.example.com",)})
    with peer_client(settings, "127.0.0.1") as client:
        yield client


def sessions_named(client: ApiClient, title: str) -> int:
    return int(client.get("/api/sessions", params={"search": title}).json()["total"])


@pytest.mark.parametrize("path", ["/api/settings", "/api/sessions", "/health", "/ready", "/metrics"])
def test_a_rebound_host_name_reaches_nothing(client: ApiClient, path: str) -> None:
    response = client.get(path, headers={"host": REBOUND})
    assert response.status_code == 421
    assert response.json()["code"] == "host_not_allowed" and response.headers["x-request-id"]


def test_nor_can_it_change_the_settings(client: ApiClient) -> None:
    change = {"revision": "0" * 64, "set": {"profiles.offline.rlm.max_iters": 3}}
    response = client.patch("/api/settings", json=change, headers={"host": REBOUND})
    assert response.status_code == 421


@pytest.mark.parametrize(
    "host",
    [
        "localhost:8000",
        "127.0.0.1:8000",
        "[::1]:8000",
        "LOCALHOST.",
        "testserver.local",  # the test client's bind address
        "fleet-gateway.fleet.svc:8000",  # FLEET_ALLOWED_HOSTS
        "api.internal.example",  # ".internal.example": every name under it
    ],
)
def test_the_names_it_answers_to(client: ApiClient, host: str) -> None:
    assert client.get("/api/sessions", headers={"host": host}).status_code == 200


@pytest.mark.parametrize(
    "host", ["internal.example.attacker.example", "localhost.attacker.example", "127.0.0.1.nip.example", ""]
)
def test_names_it_does_not(client: ApiClient, host: str) -> None:
    assert client.get("/api/sessions", headers={"host": host}).status_code == 421


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": ATTACKER},
        {"origin": "null"},
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
    ],
)
def test_a_change_from_another_web_origin_is_refused(client: ApiClient, headers: dict[str, str]) -> None:
    response = client.post("/api/sessions", json={"title": "csrf"}, headers=headers)
    assert response.status_code == 403 and response.json()["code"] == "origin_not_allowed"
    assert sessions_named(client, "csrf") == 0
    read = client.get("/api/sessions", headers=headers)  # a read goes through, unreadable to the page
    assert read.status_code == 200 and "access-control-allow-origin" not in read.headers


def test_the_same_origin_and_an_allowed_one_may_change_things(client: ApiClient) -> None:
    same = client.post("/api/sessions", json={"title": "ok"}, headers={"origin": "http://testserver.local"})
    assert same.status_code == 201
    allowed = client.post(
        "/api/sessions",
        json={"title": "ok"},
        headers={"origin": "https://app.example.com", "sec-fetch-site": "cross-site"},
    )
    assert allowed.status_code == 201
    assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"
    preflight = client.options(
        "/api/sessions",
        headers={
            "origin": "https://app.example.com",
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,idempotency-key",
        },
    )
    assert preflight.status_code in (200, 204)
    assert "idempotency-key" in preflight.headers["access-control-allow-headers"].lower()


def test_an_upload_needs_a_header_no_plain_form_can_send(client: ApiClient) -> None:
    bare = client.post("/api/attachments", files=UPLOAD)
    assert bare.status_code == 403 and bare.json()["code"] == "upload_header_required"
    marked = client.post("/api/attachments", files=UPLOAD, headers={"x-requested-with": "curl"})
    assert marked.status_code == 201, marked.text


def test_with_a_token_the_token_is_enough(sqlite_url: str, redis_url: str) -> None:
    settings = msgspec.structs.replace(settings_for(sqlite_url, redis_url), api_token=secret("tok"))
    with peer_client(settings, "127.0.0.1") as client:
        response = client.post("/api/attachments", files=UPLOAD, headers={"authorization": "Bearer tok"})
        assert response.status_code == 201, response.text
        # The settings routes want the token too.
        assert client.get("/api/settings").status_code == 401
        assert client.get("/api/settings", headers={"authorization": "Bearer tok"}).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "https://app.example.com"},  # allowed for the API, never for the settings
        {"origin": ATTACKER},
        {"sec-fetch-site": "cross-site"},
    ],
)
def test_the_settings_serve_no_web_page(client: ApiClient, headers: dict[str, str]) -> None:
    response = client.get("/api/settings", headers=headers)
    assert response.status_code == 403 and response.json()["code"] == "origin_not_allowed"
    assert client.get("/api/settings", headers={"origin": "http://testserver.local"}).status_code == 200


def secret(value: str) -> Any:
    from fleet_shared.config import Secret

    return Secret(value)


@pytest.mark.parametrize("name", ["bad name", "fleet.example:8000", "a..b", "[not-an-address]"])
def test_a_host_name_from_the_environment_must_be_one(redis_url: str, name: str) -> None:
    """A port is refused too: the Host check drops it, so "name:8000" would never match."""
    from fleet_shared.errors import ConfigError

    with pytest.raises(ConfigError, match="FLEET_ALLOWED_HOSTS"):
        load_settings(
            {
                "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
                "FLEET_REDIS_URL": redis_url,
                "FLEET_ALLOWED_HOSTS": f"ok.example, {name}",
            }
        )


def test_the_app_without_a_peer_wrapper_is_the_same_app(sqlite_url: str, redis_url: str) -> None:
    with TestClient(create_app(settings_for(sqlite_url, redis_url))) as client:
        assert client.get("/health", headers={"host": REBOUND}).status_code == 421


@pytest.mark.parametrize(
    "headers",
    [
        [("origin", "https://app.example.com"), ("origin", ATTACKER)],
        [("origin", ATTACKER), ("origin", "https://app.example.com")],
        [("sec-fetch-site", "cross-site"), ("sec-fetch-site", "same-origin")],
    ],
)
def test_a_header_the_policy_reads_may_come_only_once(
    client: ApiClient, headers: list[tuple[str, str]]
) -> None:
    """Two values would let the check read one and a proxy or handler another."""
    response = client.post("/api/sessions", json={"title": "twice"}, headers=headers)
    assert response.status_code == 400 and response.json()["code"] == "duplicate_header"
    assert sessions_named(client, "twice") == 0


@pytest.mark.parametrize("name", ["host", "origin", "sec-fetch-site"])
def test_repeated_on_the_wire_as_well(sqlite_url: str, redis_url: str, name: str) -> None:
    """The test client joins repeated headers; a server hands them over one by one."""
    from fleet_gateway.origins import RequestPolicy, refusal

    policy = RequestPolicy.of(settings_for(sqlite_url, redis_url))
    first = {"host": b"localhost:8000", "origin": b"http://localhost:8000", "sec-fetch-site": b"cross-site"}
    second = {"host": REBOUND.encode(), "origin": ATTACKER.encode(), "sec-fetch-site": b"same-origin"}
    headers = [(b"host", b"localhost:8000"), (name.encode(), first[name]), (name.encode(), second[name])]
    scope: Any = {
        "type": "http",
        "method": "POST",
        "path": "/api/sessions",
        "headers": headers[name == "host" :],
    }
    assert refusal(policy, scope) == (
        400,
        "duplicate_header",
        f"the header {name} may come only once, with one value",
    )
