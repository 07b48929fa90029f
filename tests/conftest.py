"""Shared fixtures: a private Redis, databases of our own on PostgreSQL, throwaway SQLite files.

Tests never flush or restart the shared Redis (127.0.0.1:6379) or PostgreSQL (127.0.0.1:5432):
Redis is a private `redis-server` per test session, PostgreSQL a fresh database per session (and
`private_postgres`, a whole private cluster, for tests that stop and start the server).

Tests never leave this machine: `tests.support.network_guard` (a session-wide autouse fixture and
its hooks) fails any test whose process opens a socket to anything but loopback or a Unix socket.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis

from tests.support.servers import PostgresServer, RedisServer

# The guard, for every test; pytester, to prove that the guard fails a test (test_network_guard).
pytest_plugins = ["pytester", "tests.support.network_guard"]
# litellm otherwise fetches its model cost map from GitHub the first time an LM is built, here and
# in every process the suite starts (they inherit this environment); the bundled copy does.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# uv, which a worker runs to build the cells' packages when a host lacks them, reads only its
# cache here and in every process the suite starts: the install step built them before pytest
# (`fleet sandbox build`), so no test asks a package index.
os.environ["UV_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
POSTGRES_ADMIN_DSN = os.environ.get(
    "FLEET_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture
def traversable_dir() -> Iterator[Path]:
    """A fresh directory the sandbox's uid can pass through.

    pytest's own tmp dirs sit under a 0700 base, which uid 65534 (the sandbox user on a root
    host) cannot search; this one is 0711 under /tmp.
    """
    path = Path(tempfile.mkdtemp(prefix="fleet-test-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for this test session, started empty, stopped at the end."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """db 0 of the session's private Redis."""
    return redis_server.url(db=0)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def migrate(url: str) -> None:
    """Migrate to head and seed the built-in skill cards, as `fleet db upgrade` does."""
    from fleet_shared.db.migrate import upgrade
    from fleet_shared.skills import seed_skills

    upgrade(url)
    seed_skills(url, REPO / "config" / "skills")


@pytest.fixture(scope="session")
async def postgres_url() -> AsyncIterator[str]:
    """A fresh PostgreSQL database for this test session, migrated to head, dropped at the end."""
    name = f"fleet_test_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(POSTGRES_ADMIN_DSN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    base = POSTGRES_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    url = f"{base}/{name}"
    await asyncio.to_thread(migrate, url)
    yield url
    admin = await asyncpg.connect(POSTGRES_ADMIN_DSN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


@pytest.fixture(scope="session")
def private_postgres() -> Iterator[PostgresServer]:
    """A private PostgreSQL cluster, started on first request (only its users pay for it).

    For fault tests that stop and start the server; leave it running when done
    (`stop()` then `start()`), as other tests of the session may share it.
    """
    server = PostgresServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
async def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("sqlite") / "fleet.db"
    url = f"sqlite+aiosqlite:///{path}"
    await asyncio.to_thread(migrate, url)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, sqlite_url: str, postgres_url: str) -> str:
    """Each DB-touching integration test runs on both backends."""
    return sqlite_url if request.param == "sqlite" else postgres_url
