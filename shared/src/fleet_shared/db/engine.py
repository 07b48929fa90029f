"""The async engine and session factory, tuned per backend (SQLite needs WAL and a busy timeout)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

# The revision the code expects. `tests/unit/shared/test_schema_head.py` fails if it drifts
# from Alembic's head, so readiness never needs the migration scripts on disk.
HEAD_REVISION = "0006_feedback"
CONNECT_TIMEOUT_SECONDS = 5


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def create_engine(url: str, **kwargs: Any) -> AsyncEngine:
    if is_sqlite(url):
        engine = create_async_engine(url, connect_args={"timeout": 30}, hide_parameters=True, **kwargs)
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
        return engine
    # hide_parameters: an error's text never carries row values (an answer, a user's text) into a
    # log line or a failure message. A short connect timeout: an unreachable DB is a quick 503.
    connect_args = {"timeout": CONNECT_TIMEOUT_SECONDS}
    return create_async_engine(
        url, pool_pre_ping=True, hide_parameters=True, connect_args=connect_args, **kwargs
    )


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


async def is_at_head(engine: AsyncEngine) -> bool:
    return await current_revision(engine) == HEAD_REVISION
