"""The async engine and session factory, tuned per backend (SQLite needs WAL and a busy timeout)."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from sqlalchemy import Engine, event, text
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session

from fleet_shared.db.faults import count_connect_failures_as_outages

# Every revision this code knows, oldest first; the last is the one it expects.
# `tests/unit/shared/test_schema_head.py` fails if they drift from Alembic's chain, so readiness
# never needs the migration scripts on disk.
REVISIONS = (
    "0001_baseline",
    "0002_run_status_indexes",
    "0003_workspace_per_session",
    "0004_attachments_artifacts",
    "0005_skills_and_task",
    "0006_feedback",
    "0007_workspace_versions",
    "0008_no_settling_status",
    "0009_tenancy",
    "0010_run_traceparent",
    "0011_waiting_runs",
    "0012_webhooks",
    "0013_approvals",
    "0014_program_versions",
)
HEAD_REVISION = REVISIONS[-1]
CONNECT_TIMEOUT_SECONDS = 5
T = TypeVar("T")


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


TWIN_THREADS = 4  # SQLite writes one at a time anyway; reads beside them in WAL mode


@dataclass(frozen=True)
class SqliteTwin:
    """A file SQLite engine's synchronous twin (pysqlite, same file, same pragmas), for work that
    runs whole in one thread: through aiosqlite every statement is several hops to its thread
    and back, through the twin a whole claim is one (ADR 0020). Its own threads, so a
    claim waiting on SQLite's busy timeout never holds one of the loop's default executor's."""

    engine: Engine
    threads: ThreadPoolExecutor

    async def run(self, work: Callable[[Engine], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.threads, work, self.engine)

    def dispose(self) -> None:
        self.threads.shutdown(wait=False)
        self.engine.dispose()


SQLITE_TWINS: weakref.WeakKeyDictionary[AsyncEngine, SqliteTwin] = weakref.WeakKeyDictionary()


def create_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """The engine for `url`. Whatever stops it from connecting is an outage (faults.py)."""
    if is_sqlite(url):
        engine = create_async_engine(url, connect_args={"timeout": 30}, hide_parameters=True, **kwargs)
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        count_connect_failures_as_outages(engine.sync_engine)
        parsed = make_url(url)
        if parsed.database not in (None, "", ":memory:") and "memory" not in str(parsed.query):
            twin = create_sync_engine(
                parsed.set(drivername="sqlite+pysqlite"), connect_args={"timeout": 30}, hide_parameters=True
            )
            event.listen(twin, "connect", sqlite_pragmas)
            count_connect_failures_as_outages(twin)
            threads = ThreadPoolExecutor(TWIN_THREADS, thread_name_prefix="fleet-sqlite")
            SQLITE_TWINS[engine] = SqliteTwin(twin, threads)
        return engine
    # hide_parameters: an error's text never carries row values (an answer, a user's text) into a
    # log line or a failure message. A short connect timeout: an unreachable DB is a quick 503.
    connect_args = {"timeout": CONNECT_TIMEOUT_SECONDS}
    engine = create_async_engine(
        url, pool_pre_ping=True, hide_parameters=True, connect_args=connect_args, **kwargs
    )
    count_connect_failures_as_outages(engine.sync_engine)
    return engine


def sqlite_twin(engine: AsyncEngine) -> SqliteTwin | None:
    """The synchronous twin of a file SQLite engine made by create_engine; None otherwise."""
    return SQLITE_TWINS.get(engine)


async def run_whole(db_sessions: async_sessionmaker[AsyncSession], work: Callable[[Session], T]) -> T:
    """`work`, synchronous ORM code that ends its own transaction, on a session of its own.

    On a file SQLite engine it runs whole on the twin, in one hop to a thread: through aiosqlite
    every statement is several hops to its thread and back, and each hop waits its turn on the
    worker's event loop, longer the more Turns share it (ADR 0032). Elsewhere it runs through
    `run_sync` on an AsyncSession: the same code, a round trip per statement.

    A cancel does not stop work already in its thread: the caller learns of it only after the
    work has ended, committed or not (fleet_worker.turn awaits its claim to the end)."""
    engine = db_sessions.kw.get("bind")
    twin = sqlite_twin(engine) if isinstance(engine, AsyncEngine) else None
    if twin is not None:
        return await twin.run(functools.partial(on_own_session, work=work))
    async with db_sessions() as db:
        return await db.run_sync(work)


def on_own_session(engine: Engine, work: Callable[[Session], T]) -> T:
    with Session(engine, expire_on_commit=False) as session:
        return work(session)


async def dispose_engine(engine: AsyncEngine) -> None:
    """Close the engine's pooled connections, and its twin's."""
    await engine.dispose()
    twin = SQLITE_TWINS.pop(engine, None)
    if twin is not None:
        twin.dispose()


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the gateway read while the worker writes; busy_timeout waits instead of failing.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


async def current_revision(engine: AsyncEngine) -> str | None:
    """The DB's Alembic revision, or None when the schema was never migrated."""
    async with engine.connect() as conn:
        try:
            result = await conn.execute(text("SELECT version_num FROM alembic_version"))
        except (OperationalError, ProgrammingError):
            return None
        row = result.first()
        return None if row is None else str(row[0])


async def is_read_only(engine: AsyncEngine) -> bool:
    """True when the database takes no writes (a PostgreSQL standby, or a primary being failed
    over); SQLite never is."""
    if engine.dialect.name != "postgresql":
        return False
    async with engine.connect() as conn:
        value = await conn.scalar(text("SHOW transaction_read_only"))
    return str(value).lower() == "on"


SchemaState = Literal["head", "behind", "ahead", "missing"]


def schema_state(revision: str | None) -> SchemaState:
    """Where the DB's schema stands against this code.

    "ahead" is a revision this code does not know: a newer release migrated first (the Helm hook
    runs before new pods start). Migrations only add (docs/decisions/0008-deploy-shape.md), so the
    old pods keep serving through a rolling upgrade instead of all going unready at once.
    """
    if revision is None:
        return "missing"
    if revision == HEAD_REVISION:
        return "head"
    return "behind" if revision in REVISIONS else "ahead"
