"""Which database errors are an outage (retry, or 503), over the errors the real drivers raise.

The rule is structural: any failure to open a connection, or to check one out of the pool, is an
outage, whatever the driver says; only an error raised by a statement on an open connection can
be the query's fault. So the same SQLSTATE (55000) is an outage when the server raises it at
connect and the query's fault when a statement does.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from fleet_shared.db.engine import create_engine, dispose_engine, run_whole, session_factory
from fleet_shared.db.faults import is_unreachable
from tests.support.postgres_auth import require_password
from tests.support.servers import PostgresServer, free_port


@dataclass
class Lab:
    """A private PostgreSQL cluster of this module's own: its tests refuse connections, rotate a
    password and shut the server down."""

    server: PostgresServer
    database: str  # with a table `t (a int primary key)` holding the row a = 1
    role: str  # a role that signs in with a password (SCRAM over TCP)

    def url(self, database: str | None = None, role: str = "postgres", password: str | None = None) -> str:
        credentials = role if password is None else f"{role}:{password}"
        return f"postgresql+asyncpg://{credentials}@127.0.0.1:{self.server.port}/{database or self.database}"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    server = PostgresServer().start()
    role = "rotated"
    server.execute(
        f"CREATE ROLE {role} LOGIN PASSWORD '{uuid.uuid4().hex}'",
        "CREATE ROLE crowded LOGIN CONNECTION LIMIT 0",
    )
    require_password(server, role)
    server.create_database("lab")
    setup = Lab(server, "lab", role)
    asyncio.run(statements(setup.url(), "CREATE TABLE t (a int PRIMARY KEY)", "INSERT INTO t VALUES (1)"))
    yield setup
    server.close()


@contextlib.asynccontextmanager
async def engine_for(url: str, **kwargs: Any) -> AsyncIterator[AsyncEngine]:
    """An engine made as the gateway and workers make theirs, disposed of at the end."""
    engine = create_engine(url, **kwargs)
    try:
        yield engine
    finally:
        await dispose_engine(engine)


async def statements(url: str, *sql: str) -> None:
    async with engine_for(url) as engine, engine.begin() as conn:
        for statement in sql:
            await conn.execute(text(statement))


async def raised(work: Awaitable[object]) -> BaseException | None:
    try:
        await work
    except Exception as exc:
        return exc
    return None


async def select_one(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))


async def fresh_connect(url: str) -> BaseException | None:
    """What connecting to `url` raises, on a new engine."""
    async with engine_for(url) as engine:
        return await raised(select_one(engine))


# --- failures to open a connection or to check one out: an outage --------------------------------


async def connections_not_allowed(lab: Lab) -> BaseException | None:
    """ALTER DATABASE ... ALLOW_CONNECTIONS false and the open connections ended (SQLSTATE 55000),
    met by an engine whose pooled connection was open: its pre-ping fails, the reconnect is refused."""
    lab.server.execute("CREATE DATABASE closing")
    try:
        async with engine_for(lab.url("closing")) as engine:
            await select_one(engine)
            lab.server.execute(
                "ALTER DATABASE closing ALLOW_CONNECTIONS false",
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = 'closing'",
            )
            return await raised(select_one(engine))
    finally:
        lab.server.execute("DROP DATABASE closing WITH (FORCE)")


async def too_many_connections(lab: Lab) -> BaseException | None:
    """The role's connection limit is reached (53300, as when max_connections is)."""
    return await fresh_connect(lab.url(role="crowded"))


async def password_rotated(lab: Lab) -> BaseException | None:
    """The password changed before this pod was given the new one (28P01)."""
    return await fresh_connect(lab.url(role=lab.role, password="the-one-before"))


async def server_shutting_down(lab: Lab) -> BaseException | None:
    """A server that will not take connections now (57P03: shutting down here; starting up, or a
    standby not yet consistent, is refused with the same code)."""
    held = await asyncpg.connect(lab.server.admin_dsn)  # a session the smart stop waits for
    try:
        lab.server.stop("smart", wait=False)
        deadline = time.monotonic() + 10
        while (error := await fresh_connect(lab.url())) is None and time.monotonic() < deadline:
            pass  # the stop's signal has not landed yet
        return error
    finally:
        lab.server.stop("fast")
        held.terminate()
        lab.server.start()


async def database_missing(lab: Lab) -> BaseException | None:
    """The database is not there (3D000): dropped, or not created yet."""
    return await fresh_connect(lab.url("nowhere"))


async def host_unresolvable(lab: Lab) -> BaseException | None:
    """The host name does not resolve. A leading hyphen makes the resolver fail it as unknown
    without asking a server (EAI_NONAME), so nothing leaves this machine."""
    return await fresh_connect(f"postgresql+asyncpg://postgres@-unresolvable:{lab.server.port}/lab")


async def nothing_listening(lab: Lab) -> BaseException | None:
    """A port with nothing listening: the connect is refused."""
    return await fresh_connect(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/lab")


async def dropped_on_accept(lab: Lab) -> BaseException | None:
    """A proxy that accepts the connection and closes it at once (its backend is down)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def drop() -> None:
            conn, _ = listener.accept()
            conn.close()

        threading.Thread(target=drop, daemon=True).start()
        return await fresh_connect(f"postgresql+asyncpg://postgres@127.0.0.1:{listener.getsockname()[1]}/lab")


async def pool_exhausted(lab: Lab) -> BaseException | None:
    """Every pooled connection is checked out and none comes back in time."""
    async with (
        engine_for(lab.url(), pool_size=1, max_overflow=0, pool_timeout=0.2) as engine,
        engine.connect() as conn,
    ):
        await conn.execute(text("SELECT 1"))
        return await raised(select_one(engine))


def sqlite_in_a_missing_folder(tmp: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp / 'missing' / 'fleet.db'}"


async def sqlite_cannot_open(tmp: Path) -> BaseException | None:
    """A SQLite file that cannot be opened (its folder is gone), through aiosqlite."""
    return await fresh_connect(sqlite_in_a_missing_folder(tmp))


async def sqlite_cannot_open_whole(tmp: Path) -> BaseException | None:
    """The same, through the synchronous twin that runs a claim or a settlement whole."""
    async with engine_for(sqlite_in_a_missing_folder(tmp)) as engine:
        return await raised(run_whole(session_factory(engine), lambda db: db.execute(text("SELECT 1"))))


Provoke = Callable[[Lab], Awaitable[BaseException | None]]
OUTAGES: dict[str, Provoke] = {
    "connections not allowed (55000)": connections_not_allowed,
    "too many connections (53300)": too_many_connections,
    "password rotated (28P01)": password_rotated,
    "server shutting down (57P03)": server_shutting_down,
    "database missing (3D000)": database_missing,
    "host name unresolvable": host_unresolvable,
    "nothing listening": nothing_listening,
    "dropped on accept": dropped_on_accept,
    "pool exhausted": pool_exhausted,
}


def described(error: BaseException | None) -> str:
    """`error` and what it wraps, with their SQLSTATEs: the failure message of a case."""
    if error is None:
        return "nothing was raised"
    chain: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(
            f"{type(current).__module__}.{type(current).__name__}({getattr(current, 'sqlstate', '')})"
        )
        current = current.__cause__ or current.__context__
    return " <- ".join(chain)


def assert_an_outage_of_the_database(error: BaseException | None) -> None:
    """An outage, raised as a SQLAlchemy error whatever the driver raised: one shape for every
    failure to connect, which the gateway answers as "the database is unavailable"."""
    assert isinstance(error, SQLAlchemyError) and is_unreachable(error), described(error)


@pytest.mark.parametrize("provoke", OUTAGES.values(), ids=OUTAGES.keys())
async def test_a_failure_to_connect_or_check_out_is_an_outage(lab: Lab, provoke: Provoke) -> None:
    assert_an_outage_of_the_database(await provoke(lab))


@pytest.mark.parametrize("provoke", [sqlite_cannot_open, sqlite_cannot_open_whole])
async def test_a_sqlite_file_that_cannot_be_opened_is_an_outage(
    tmp_path: Path, provoke: Callable[[Path], Awaitable[BaseException | None]]
) -> None:
    assert_an_outage_of_the_database(await provoke(tmp_path))


# --- errors of statements on an open connection ----------------------------------------------------


async def on_open_connection(lab: Lab, *sql: str) -> BaseException | None:
    """What the last of `sql` raises, in one transaction on a connection that opened fine."""
    return await raised(statements(lab.url(), *sql))


async def connection_ended_by_the_server(lab: Lab) -> BaseException | None:
    """An administrator (or a failover) ends the session mid-transaction (57P01)."""
    async with engine_for(lab.url()) as engine, engine.connect() as conn:
        pid = await conn.scalar(text("SELECT pg_backend_pid()"))
        lab.server.execute(f"SELECT pg_terminate_backend({pid}, 5000)")
        return await raised(conn.execute(text("SELECT 1")))


async def serialization_failure(lab: Lab) -> BaseException | None:
    """A concurrent update under REPEATABLE READ (40001): the same write succeeds when retried."""
    async with engine_for(lab.url()) as engine, engine.connect() as first:
        await first.execution_options(isolation_level="REPEATABLE READ")
        await first.execute(text("SELECT a FROM t"))  # its snapshot
        await statements(lab.url(), "UPDATE t SET a = a WHERE a = 1")
        return await raised(first.execute(text("UPDATE t SET a = a WHERE a = 1")))


async def read_only_transaction(lab: Lab) -> BaseException | None:
    """A write in a read-only transaction (25006), as on a primary that failover turned read-only."""
    return await on_open_connection(lab, "SET TRANSACTION READ ONLY", "INSERT INTO t VALUES (2)")


OPEN_CONNECTION_OUTAGES: dict[str, Provoke] = {
    "connection ended by the server (57P01)": connection_ended_by_the_server,
    "serialization failure (40001)": serialization_failure,
    "read-only transaction (25006)": read_only_transaction,
}


@pytest.mark.parametrize("provoke", OPEN_CONNECTION_OUTAGES.values(), ids=OPEN_CONNECTION_OUTAGES.keys())
async def test_a_lost_connection_or_a_retryable_statement_is_an_outage(lab: Lab, provoke: Provoke) -> None:
    error = await provoke(lab)
    assert error is not None and is_unreachable(error), described(error)


QUERY_FAULTS = {
    "unique violation (23505)": ("INSERT INTO t VALUES (1)",),
    "undefined table (42P01)": ("SELECT * FROM nowhere",),
    "invalid text (22P02)": ("SELECT 'x'::int",),
    # The SQLSTATE a server refuses connections with, raised here by a statement: the query's fault.
    "object not in prerequisite state (55000)": (
        "CREATE TEMPORARY SEQUENCE s",
        "SELECT currval('s')",
    ),
}


@pytest.mark.parametrize("sql", QUERY_FAULTS.values(), ids=QUERY_FAULTS.keys())
async def test_a_statement_error_on_an_open_connection_is_the_querys_fault(
    lab: Lab, sql: tuple[str, ...]
) -> None:
    error = await on_open_connection(lab, *sql)
    assert error is not None and not is_unreachable(error), described(error)
