"""Password sign-in on a private PostgreSQL (`servers.PostgresServer` trusts every loopback client),
for tests that rotate a role's password."""

from __future__ import annotations

import asyncio
import time

import asyncpg

from tests.support.servers import PostgresServer


def require_password(server: PostgresServer, role: str, timeout: float = 10) -> None:
    """From now on `role` signs in over TCP with its password (SCRAM, as a production database
    asks); every other role keeps trust. Returns once the server asks `role` for it."""
    hba = server.data_dir / "pg_hba.conf"
    hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n{hba.read_text()}")
    server.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + timeout
    while not asks_for_password(server, role):  # the reload lands asynchronously
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server never asked {role} for a password")
        time.sleep(0.05)


def asks_for_password(server: PostgresServer, role: str) -> bool:
    async def attempt() -> bool:
        try:
            conn = await asyncpg.connect(
                host="127.0.0.1",
                port=server.port,
                user=role,
                password="not-its-password",
                database="postgres",
            )
        except asyncpg.InvalidPasswordError:
            return True
        await conn.close()
        return False

    return asyncio.run(attempt())
