"""The gateway app in-process (Litestar's test client) against real SQLite/PostgreSQL and Redis:
readiness, a dead Redis, auth, and the error envelope."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.handlers import HTTPRouteHandler
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_shared.config import Settings, load_settings
from tests.support.api import ApiClient

REPO = Path(__file__).resolve().parents[2]


def settings_for(database_url: str, redis_url: str, **extra: str) -> Settings:
    return load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": database_url,
            "FLEET_REDIS_URL": redis_url,
            **extra,
        }
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket closes


@pytest.fixture
def dead_redis_client(database_url: str) -> Iterator[ApiClient]:
    settings = settings_for(database_url, f"redis://127.0.0.1:{closed_port()}/0")
    with TestClient(create_app(settings)) as client:
        yield client


def test_ready_is_503_while_the_schema_is_behind(tmp_path: Path, redis_url: str) -> None:
    settings = settings_for(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}", redis_url)
    with TestClient(create_app(settings)) as client:
        response = client.get("/ready")
        alias = client.get("/health/ready")
        health = client.get("/health")
    assert response.status_code == 503 and alias.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert "fleet db upgrade" in body["checks"]["database"]
    assert body["checks"]["redis"] == "ok"
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_dead_redis_refuses_the_turn_with_503_and_commits_nothing(
    dead_redis_client: ApiClient,
) -> None:
    client = dead_redis_client
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["checks"]["redis"].startswith("unreachable")
    session_id = client.post("/api/sessions", json={}).json()["id"]
    response = client.post(
        f"/api/sessions/{session_id}/turns", json={"text": "hi"}, headers={"Idempotency-Key": "a"}
    )
    assert response.status_code == 503
    assert response.json()["code"] == "service_unavailable"
    assert client.get(f"/api/sessions/{session_id}/turns").json()["items"] == []  # nothing half-done
    again = client.post(
        f"/api/sessions/{session_id}/turns", json={"text": "hi"}, headers={"Idempotency-Key": "b"}
    )
    assert again.status_code == 503  # not 409: no Run was left holding the session


def test_no_guard_or_hook_runs_in_a_thread_pool(sqlite_url: str, redis_url: str) -> None:
    # Litestar runs a sync guard or before_request hook through a thread pool, once per request:
    # two thread hops on every Turn's POST before its first byte. Each must be a coroutine.
    app = create_app(settings_for(sqlite_url, redis_url, FLEET_API_TOKEN="t0ken-value"))
    checked = 0
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            hooks = [*handler.resolve_guards()]
            if isinstance(handler, HTTPRouteHandler):
                hooks += [handler.resolve_before_request(), handler.resolve_after_response()]
            for hook in filter(None, hooks):
                assert inspect.iscoroutinefunction(hook), f"{handler} has a sync hook {hook!r}"
                checked += 1
    assert checked > 20  # the auth guard and the JSON-body hook of every API route, at least


def test_bearer_auth_when_a_token_is_set(sqlite_url: str, redis_url: str) -> None:
    settings = settings_for(sqlite_url, redis_url, FLEET_API_TOKEN="t0ken-value")
    with TestClient(create_app(settings)) as client:
        missing = client.get("/api/sessions")
        wrong = client.get("/api/sessions", headers={"Authorization": "Bearer nope"})
        right = client.get("/api/sessions", headers={"Authorization": "Bearer t0ken-value"})
        health = client.get("/health")
    assert missing.status_code == 401 and missing.json()["code"] == "auth_required"
    assert wrong.status_code == 401
    assert right.status_code == 200
    assert health.status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/nowhere", 404, "not_found"),
        ("DELETE", "/api/sessions", 405, "method_not_allowed"),
        ("GET", "/api/sessions?limit=1000", 422, "validation_error"),
        ("GET", "/api/sessions?status=bogus", 422, "validation_error"),
        ("GET", "/api/sessions/00000000-0000-0000-0000-000000000000/turns", 404, "not_found"),
    ],
)
def test_error_envelope(
    sqlite_url: str, redis_url: str, method: str, path: str, status: int, code: str
) -> None:
    with TestClient(create_app(settings_for(sqlite_url, redis_url))) as client:
        response = client.request(method, path, headers={"x-request-id": "req-123"})
    assert response.status_code == status
    assert response.json()["code"] == code and response.json()["message"]
    assert response.headers["x-request-id"] == "req-123"


def test_sessions_list_search_and_paging(sqlite_url: str, redis_url: str) -> None:
    with TestClient(create_app(settings_for(sqlite_url, redis_url))) as client:
        marker = f"paging-{asyncio.get_event_loop_policy().__class__.__name__}"
        for i in range(3):
            assert client.post("/api/sessions", json={"title": f"{marker} {i}"}).status_code == 201
        page = client.get("/api/sessions", params={"search": marker, "limit": 2}).json()
        rest = client.get("/api/sessions", params={"search": marker, "limit": 2, "offset": 2}).json()
        one = client.get(f"/api/sessions/{page['items'][0]['id']}").json()
    assert page["total"] == 3 and len(page["items"]) == 2 and len(rest["items"]) == 1
    assert one["title"].startswith(marker) and one["status"] == "active"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/api/sessions?offset=99999999999999999999", None),
        ("GET", "/api/sessions?search=a%00b", None),
        ("POST", "/api/sessions", {"title": "a\u0000b"}),
        ("GET", "/api/sessions/00000000-0000-0000-0000-000000000000/turns?after_sequence=99999999999", None),
    ],
)
def test_unrepresentable_values_are_422_not_503(
    database_url: str, redis_url: str, method: str, path: str, body: object
) -> None:
    """PostgreSQL refuses NUL bytes and integers past int64; that is the client's error, not an outage."""
    with TestClient(create_app(settings_for(database_url, redis_url))) as client:
        response = client.request(method, path, json=body)
    assert response.status_code in (404, 422), response.text
    assert response.json()["code"] in ("validation_error", "not_found")
    if "turns" not in path:
        assert response.status_code == 422


@pytest.mark.parametrize(
    ("revision", "ready"),
    [("9999_from_a_newer_release", True), ("0001_baseline", False)],
    ids=["newer-schema-keeps-old-pods-ready", "older-schema-is-unready"],
)
def test_ready_during_a_rolling_upgrade(
    database_url: str, redis_url: str, revision: str, ready: bool
) -> None:
    """The migration hook runs before new pods roll out: the old pods must stay ready on the newer
    schema, or every gateway would leave the load balancer at once."""
    from sqlalchemy import text

    from fleet_shared.db.engine import HEAD_REVISION, create_engine

    async def set_revision(value: str) -> None:
        engine = create_engine(database_url)
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": value})
        await engine.dispose()

    asyncio.run(set_revision(revision))
    try:
        with TestClient(create_app(settings_for(database_url, redis_url))) as client:
            database = client.get("/ready").json()["checks"]["database"]
    finally:
        asyncio.run(set_revision(HEAD_REVISION))
    assert (database == "ok") is ready, database


def test_readiness_probes_do_not_scan_the_keyspace_each_time(database_url: str, redis_url: str) -> None:
    """/ready's sandbox detail SCANs every key; a probe every few seconds from every gateway pod
    must not repeat that walk each time."""
    import redis as sync_redis

    def scans() -> int:
        client = sync_redis.Redis.from_url(redis_url)
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        return int(stats.get("cmdstat_scan", {}).get("calls", 0))

    with TestClient(create_app(settings_for(database_url, redis_url))) as client:
        client.get("/ready")
        before = scans()
        for _ in range(5):
            assert "sandbox" in client.get("/ready").json()["details"]
        assert scans() == before


def test_a_scan_slower_than_the_probe_deadline_still_serves_later_probes(
    database_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the cache was written only when the SCAN beat the probe's deadline, so on
    a keyspace too big for it every probe started the walk again."""
    import redis as sync_redis

    from fleet_gateway.routes import health

    def scans() -> int:
        client = sync_redis.Redis.from_url(redis_url)
        try:
            return int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))
        finally:
            client.close()

    # A deadline no SCAN can meet stands in for a keyspace of millions of keys. A database of its
    # own keeps the walk to one SCAN call, so calls count walks.
    monkeypatch.setattr(health, "CHECK_TIMEOUT_SECONDS", 0.000001)
    redis_url = redis_url.rsplit("/", 1)[0] + "/11"
    with TestClient(create_app(settings_for(database_url, redis_url))) as client:
        before = scans()
        first = client.get("/ready").json()["details"]["sandbox"]
        assert first == "timed out"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and scans() == before:
            time.sleep(0.05)
        later = [client.get("/ready").json()["details"]["sandbox"] for _ in range(5)]
        assert scans() - before == 1
    assert all(detail.startswith("unknown: no worker") for detail in later), later


def test_ready_shows_a_worker_s_sandbox_as_soon_as_the_worker_is_alive(
    database_url: str, redis_url: str
) -> None:
    """Found in first-run testing: for a while after start, /ready said the sandbox was "unknown: no
    worker has reported" while its own worker check said ok (the answer from before the worker
    came up was kept)."""
    import redis as sync_redis

    from fleet_shared import redis_keys
    from fleet_shared.jobs import health_key

    redis_url = redis_url.rsplit("/", 1)[0] + "/12"  # no other test's workers in this database
    settings = settings_for(database_url, redis_url)
    with TestClient(create_app(settings)) as client:
        before = client.get("/ready").json()
        assert before["checks"]["worker"] != "ok"
        assert before["details"]["sandbox"].startswith("unknown: no worker")
        announcer = sync_redis.Redis.from_url(redis_url)
        try:  # what a worker writes as it comes up: its sandbox mode, then arq's health key
            announcer.set(redis_keys.worker_sandbox("host:1"), "bwrap (test)", ex=30)
            announcer.set(health_key(settings.profile.worker.queue_name), "alive", ex=30)
            after = client.get("/ready").json()
        finally:
            announcer.delete(
                redis_keys.worker_sandbox("host:1"), health_key(settings.profile.worker.queue_name)
            )
            announcer.close()
    assert after["checks"]["worker"] == "ok"
    assert after["details"]["sandbox"] == "bwrap (test)"
