"""Alembic environment: async engines for PostgreSQL (asyncpg) and SQLite (aiosqlite)."""

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection

from fleet_shared.db.engine import create_engine, is_sqlite
from fleet_shared.db.models import Base

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    url = config.attributes.get("database_url") or os.environ.get("FLEET_DATABASE_URL")
    if not url:
        raise SystemExit("FLEET_DATABASE_URL is not set (or run `fleet db upgrade`)")
    return str(url)


def run_with(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=is_sqlite(database_url()),  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_online() -> None:
    engine = create_engine(database_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(run_with)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(run_online())
