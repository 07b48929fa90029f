"""The suite's private servers (tests/support/servers.py) survive the restarts fault tests need."""

from __future__ import annotations

import socket

import asyncpg
import pytest
import redis

from tests.support.servers import PostgresServer, RedisServer


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


async def test_private_postgres_stops_and_starts_with_its_data(private_postgres: PostgresServer) -> None:
    url = private_postgres.create_database("servers_selftest")
    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(dsn)
    await conn.execute("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('before the crash')")
    await conn.close()
    port = private_postgres.port

    private_postgres.stop()  # immediate: no checkpoint, recovery on the next start
    assert refused(port)
    with pytest.raises(OSError):
        await asyncpg.connect(dsn, timeout=2)

    private_postgres.start()
    assert private_postgres.port == port
    conn = await asyncpg.connect(dsn)
    assert await conn.fetchval("SELECT v FROM kept") == "before the crash"
    await conn.close()


def test_private_redis_restarts_on_the_same_port() -> None:
    with RedisServer() as server:
        port = server.port
        assert server.url(db=3) == f"redis://127.0.0.1:{port}/3"
        client = redis.Redis.from_url(server.url())
        assert client.set("k", "v")
        server.kill()
        assert refused(port)
        server.start()
        assert server.port == port
        assert client.ping() and client.get("k") is None  # no persistence: a fresh, empty Redis
        client.close()
        data_dir = server.dir
    assert data_dir is not None and not data_dir.exists()  # stop() cleaned up
    assert refused(port)
