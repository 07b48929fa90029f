"""`multitask: interrupt` at the gateway (in-process, Litestar's test client, real SQLite or
PostgreSQL and Redis): a queued Turn is cancelled at once and the new one claimed; a Turn the
tenant's counted quotas would refuse leaves the running one alone. A real worker's running Turn
interrupted mid-cell is tests/e2e/test_turn_stream.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import redis
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_gateway.quotas import WINDOW_SECONDS
from fleet_shared import redis_keys
from fleet_shared.config import Settings
from fleet_shared.tenancy import DEFAULT_TENANT
from tests.integration.test_files_api import add_run, settings
from tests.support.api import ApiClient, session_row

__all__ = ["settings"]  # a fixture: pytest finds it by this name
ASYNC = {"Prefer": "respond-async"}


@pytest.fixture
def limited(settings: Settings) -> Settings:
    quotas = msgspec.structs.replace(settings.profile.quotas, turns_per_minute=5)
    return msgspec.structs.replace(settings, profile=msgspec.structs.replace(settings.profile, quotas=quotas))


@pytest.fixture
def client(limited: Settings) -> Iterator[ApiClient]:
    with TestClient(create_app(limited)) as client:
        yield client


def interrupting(client: ApiClient, session_id: str, key: str) -> object:
    return client.post(
        f"/api/sessions/{session_id}/turns",
        json={"text": "instead", "multitask": "interrupt"},
        headers={"Idempotency-Key": key, **ASYNC},
    )


def test_a_queued_turn_is_cancelled_at_once_and_the_interrupting_one_claimed(
    client: ApiClient, limited: Settings
) -> None:
    session = session_row(client)["id"]
    waiting = add_run(limited, session, "k1")
    plain = client.post(
        f"/api/sessions/{session}/turns", json={"text": "x"}, headers={"Idempotency-Key": "k2"}
    )
    assert plain.status_code == 409 and plain.json()["code"] == "turn_in_progress"
    response = interrupting(client, session, "k3")
    assert response.status_code == 202, response.text
    assert "interrupt;dur=" in response.headers["server-timing"]
    assert client.get(f"/api/runs/{waiting}").json()["status"] == "cancelled"
    assert client.get(f"/api/runs/{response.json()['run_id']}").json()["status"] == "queued"


def test_an_interrupt_the_tenants_turns_per_minute_would_refuse_leaves_the_running_turn_alone(
    client: ApiClient, limited: Settings
) -> None:
    session = session_row(client)["id"]
    waiting = add_run(limited, session, "k1")
    minute = int(time.time() // WINDOW_SECONDS)
    with redis.Redis.from_url(limited.redis_url) as r:
        for at in (minute, minute + 1):  # the minute may turn while the test runs
            r.set(redis_keys.tenant_turns_in_minute(DEFAULT_TENANT, at), 5, ex=2 * WINDOW_SECONDS)
    response = interrupting(client, session, "k2")
    assert response.status_code == 429 and response.json()["code"] == "quota_exceeded", response.text
    assert client.get(f"/api/runs/{waiting}").json()["status"] == "queued"  # not cancelled for nothing
