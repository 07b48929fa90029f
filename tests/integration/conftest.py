"""Fixtures of the integration tests: a worker harness per test (see harness.py), the gateway's
app on the harness's settings (`client`: a module defines `harness` with its script), and a fake
Daytona on loopback per module that asks for one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_shared.db.engine import create_engine, session_factory
from tests.integration.harness import Harness, make_settings, script
from tests.support.api import ApiClient
from tests.support.fake_daytona import FakeDaytona


@pytest.fixture
def client(harness: Harness) -> Iterator[ApiClient]:
    """The gateway's app on the module's `harness` settings, its lifespan run."""
    with TestClient(create_app(harness.settings)) as client:
        yield client


@pytest.fixture
def work_dir(traversable_dir: Path) -> Path:
    return traversable_dir


@pytest.fixture
async def harness_factory(database_url: str, redis_url: str, work_dir: Path) -> AsyncIterator[object]:
    engines = []
    client = aioredis.Redis.from_url(redis_url)

    def factory(
        *lines: dict[str, object],
        turn_timeout: float = 60,
        local: dict[str, Any] | None = None,
        rlm: dict[str, Any] | None = None,
        storage: dict[str, Any] | None = None,
        quotas: dict[str, Any] | None = None,
    ) -> Harness:
        path = script(work_dir, *lines)
        settings = make_settings(
            database_url, redis_url, work_dir, path, turn_timeout, local, rlm, storage, quotas
        )
        engine = create_engine(database_url)
        engines.append(engine)
        return Harness(settings, session_factory(engine), client)

    yield factory
    for engine in engines:
        await engine.dispose()
    await client.aclose()


@pytest.fixture(scope="module")
def fake_daytona() -> Iterator[FakeDaytona]:
    server = FakeDaytona().start()
    yield server
    server.stop()
