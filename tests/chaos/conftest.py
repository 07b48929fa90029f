"""Fixtures of the chaos suite: a private Redis and PostgreSQL per test session, a fresh database
and a fresh cluster of real processes per test. Run alone with `uv run pytest -m chaos`."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.cluster import Cluster
from tests.support.servers import PostgresServer, RedisServer

ClusterFactory = Callable[..., Cluster]


@pytest.fixture(scope="session")
def chaos_postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.close()


@pytest.fixture
def chaos_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own: tests kill and restart it."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def cluster_factory(
    chaos_postgres: PostgresServer, chaos_redis: RedisServer, request: pytest.FixtureRequest
) -> Iterator[ClusterFactory]:
    made: list[Cluster] = []
    work_dirs: list[Path] = []

    def make(
        script: str, *, sqlite: bool = False, database_url: str | None = None, **overrides: Any
    ) -> Cluster:
        """A cluster on a fresh database of `chaos_postgres` (or a SQLite file, or `database_url`);
        `overrides` are dotted profile keys with `__` for the dots."""
        work = Path(tempfile.mkdtemp(prefix="fleet-chaos-"))
        work.chmod(0o711)  # the sandbox's uid passes through to the workspaces
        work_dirs.append(work)
        if sqlite:
            database_url = f"sqlite+aiosqlite:///{work / 'fleet.db'}"
        elif database_url is None:
            database_url = chaos_postgres.create_database(f"chaos_{uuid.uuid4().hex[:12]}")
        dotted = {key.replace("__", "."): value for key, value in overrides.items()}
        cluster = Cluster(work, chaos_redis, database_url, script, dotted)
        made.append(cluster)
        return cluster

    yield make
    failed = getattr(getattr(request.node, "rep_call", None), "failed", False)
    for cluster in made:
        cluster.stop()
        if failed:
            print(cluster.dump_logs())
    for work in work_dirs:
        shutil.rmtree(work, ignore_errors=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
