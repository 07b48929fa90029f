"""The database goes away: every API call answers 503 (never 500), and a Turn that computed its
answer while the database was down commits it once the database is back."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest

from tests.chaos.cluster import (
    Gateway,
    LiveStream,
    new_session,
    post_turn,
    resume,
    run_of,
    script_text,
    wait_for_run,
)
from tests.chaos.conftest import ClusterFactory
from tests.support.postgres_auth import require_password
from tests.support.servers import PostgresServer

pytestmark = pytest.mark.chaos

SCRIPT = script_text(
    {"lm": "root", "reasoning": "look", "code": "print('x')"},
    {"lm": "root", "reasoning": "think while the database is away", "code": "y = 6 * 7", "delay_s": 1},
    {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer=f'the answer is {y}')"},
)


def assert_committed_at_attempt_1(gateway: Gateway, stream: LiveStream, run_id: str, session_id: str) -> None:
    """The Turn whose answer was computed during the outage: its stream ends whole, its Run is
    `completed` at attempt 1, and the session's history holds the answer."""
    stream.finish(timeout=60)
    assert stream.types[-2:] == ["finish", "[DONE]"], stream.types
    run = wait_for_run(gateway, run_id, lambda r: r["status"] != "running")
    assert (run["status"], run["failure_code"], run["attempt"]) == ("completed", None, 1)
    with gateway.client() as client:
        history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    assert [p["text"] for p in history[-1]["parts"] if p["type"] == "text"] == ["the answer is 42"]


def test_a_turn_computed_during_a_db_outage_commits_when_it_returns(
    cluster_factory: ClusterFactory, chaos_postgres: PostgresServer
) -> None:
    cluster = cluster_factory(SCRIPT)
    gateway = cluster.start_gateway()
    cluster.start_worker()
    session_id = new_session(gateway)
    stream = post_turn(gateway, session_id, "outage", "db-1")
    stream.wait_for(lambda f: f.type == "finish-step")  # running; the next LM call takes 1 s
    assert stream.headers is not None
    run_id = stream.headers["x-fleet-run-id"]
    chaos_postgres.stop()  # down before the program ends: the commit meets a dead database
    try:
        stream.wait_for(lambda f: f.type == "data-status" and '"settling"' in f.data, timeout=30)
        time.sleep(10)  # a 10 s outage, as the issue measured it
    finally:
        chaos_postgres.start()
    assert_committed_at_attempt_1(gateway, stream, run_id, session_id)
    assert resume(gateway, run_id).finish().content == stream.content


def test_every_route_answers_503_while_the_db_is_down(
    cluster_factory: ClusterFactory, chaos_postgres: PostgresServer
) -> None:
    cluster = cluster_factory(script_text({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='ok')"}))
    gateway = cluster.start_gateway()
    session_id = new_session(gateway)
    run_id = str(uuid.uuid4())
    chaos_postgres.stop()
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            calls = {
                "create session": client.post("/api/sessions", json={}),
                "list sessions": client.get("/api/sessions"),
                "get session": client.get(f"/api/sessions/{session_id}"),
                "history": client.get(f"/api/sessions/{session_id}/turns"),
                "post turn": client.post(
                    f"/api/sessions/{session_id}/turns", json={"text": "hi"}, headers={"Idempotency-Key": "k"}
                ),
                "get run": client.get(f"/api/runs/{run_id}"),
                "cancel": client.put(f"/api/runs/{run_id}/cancellation"),
                "resume": client.get(f"/api/runs/{run_id}/stream"),
                "ready": client.get("/ready"),
            }
            health = client.get("/health")
    finally:
        chaos_postgres.start()
    for name, response in calls.items():
        assert response.status_code == 503, (name, response.status_code, response.text)
        if name != "ready":
            assert response.json()["code"] == "service_unavailable", name
        assert response.headers["x-request-id"]
    assert health.status_code == 200
    # Nothing was half-written: the session is as it was, and the key is not burned.
    with gateway.client() as client:
        assert client.get(f"/api/sessions/{session_id}/turns").json()["items"] == []
    cluster.start_worker()
    again = post_turn(gateway, session_id, "hi", "k").finish()
    assert again.types[-2:] == ["finish", "[DONE]"]
    assert (
        again.headers is not None
        and run_of(gateway, again.headers["x-fleet-run-id"])["status"] == "completed"
    )


def end_connections(database: str) -> str:
    """The statement that ends every open connection to `database` (and waits until they are gone):
    its clients must connect again."""
    return f"SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = '{database}'"


def set_read_only(server: PostgresServer, database: str, read_only: bool) -> None:
    """A failover as clients see it: the database takes no more writes, existing sessions end."""
    flag = "on" if read_only else "off"
    server.execute(
        f'ALTER DATABASE "{database}" SET default_transaction_read_only = {flag}', end_connections(database)
    )


def test_a_read_only_database_is_an_outage_not_a_failure(
    cluster_factory: ClusterFactory, chaos_postgres: PostgresServer
) -> None:
    cluster = cluster_factory(SCRIPT)
    database = cluster.database_url.rsplit("/", 1)[1]
    gateway = cluster.start_gateway()
    cluster.start_worker()
    session_id = new_session(gateway)
    stream = post_turn(gateway, session_id, "failover", "ro-1")
    stream.wait_for(lambda f: f.type == "finish-step")
    assert stream.headers is not None
    run_id = stream.headers["x-fleet-run-id"]
    set_read_only(chaos_postgres, database, True)
    try:
        stream.wait_for(lambda f: f.type == "data-status" and '"settling"' in f.data, timeout=30)
        with gateway.client() as client:
            create = client.post("/api/sessions", json={})
            ready = client.get("/ready")
        time.sleep(5)  # the worker keeps retrying its commit meanwhile
    finally:
        set_read_only(chaos_postgres, database, False)
    assert (create.status_code, create.json()["code"]) == (503, "service_unavailable")
    assert ready.status_code == 503 and ready.json()["checks"]["database"].startswith("read-only")
    assert_committed_at_attempt_1(gateway, stream, run_id, session_id)


@dataclass(frozen=True)
class Refusal:
    """A way a running database refuses new connections: the client's connect fails with a
    PostgreSQL error (not a refused socket). Each also ends the database's open connections, so
    every client must connect again while it lasts."""

    refuse: str  # SQL; {database}, {role} and {password} are filled in
    allow: str
    sqlstate: str  # what a client that connects meanwhile is told
    seconds: float  # how long it lasts


REFUSALS = {
    "connections-not-allowed": Refusal(
        "ALTER DATABASE {database} ALLOW_CONNECTIONS false",
        "ALTER DATABASE {database} ALLOW_CONNECTIONS true",
        sqlstate="55000",
        seconds=25,
    ),
    # The role's password changed before the pods were given the new one; the outage ends when
    # the two match again.
    "password-rotated": Refusal(
        "ALTER ROLE {role} PASSWORD 'rotated-{password}'",
        "ALTER ROLE {role} PASSWORD '{password}'",
        sqlstate="28P01",
        seconds=10,
    ),
}


@dataclass(frozen=True)
class OwnedDatabase:
    """A database owned by a role of its own that signs in with a password."""

    name: str
    role: str
    password: str
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://{self.role}:{self.password}@127.0.0.1:{self.port}/{self.name}"

    async def connect(self) -> Any:
        return await asyncpg.connect(
            host="127.0.0.1", port=self.port, user=self.role, password=self.password, database=self.name
        )


def owned_database(server: PostgresServer) -> OwnedDatabase:
    """A fresh database whose owner signs in with a password (SCRAM over TCP, as a production
    database asks), so that its credentials can be rotated; other roles keep trust."""
    suffix = uuid.uuid4().hex[:12]
    database = OwnedDatabase(f"chaos_{suffix}", f"fleet_{suffix}", uuid.uuid4().hex, server.port)
    server.execute(f"CREATE ROLE {database.role} LOGIN PASSWORD '{database.password}'")
    server.create_database(database.name, owner=database.role)
    require_password(server, database.role)
    return database


def refusal_of(database: OwnedDatabase) -> str | None:
    """The SQLSTATE a client connecting to `database` now is refused with; None if it gets in."""

    async def attempt() -> str | None:
        try:
            conn = await database.connect()
        except asyncpg.PostgresError as exc:
            return str(exc.sqlstate)
        await conn.close()
        return None

    return asyncio.run(attempt())


def unfinished_or_retried_runs(database: OwnedDatabase) -> int:
    async def count() -> int:
        conn = await database.connect()
        try:
            others = "status <> 'completed' OR attempt <> 1 OR failure_code IS NOT NULL"
            return int(await conn.fetchval(f"SELECT count(*) FROM runs WHERE {others}"))
        finally:
            await conn.close()

    return asyncio.run(count())


def calls_during_outage(gateway: Gateway, session_id: str) -> dict[str, httpx.Response]:
    with gateway.client(timeout=30) as client:
        return {
            "create session": client.post("/api/sessions", json={}),
            "history": client.get(f"/api/sessions/{session_id}/turns"),
            "post turn": client.post(
                f"/api/sessions/{session_id}/turns",
                json={"text": "hi"},
                headers={"Idempotency-Key": "refused"},
            ),
            "ready": client.get("/ready"),
        }


@pytest.mark.parametrize("refusal", REFUSALS.values(), ids=REFUSALS.keys())
def test_a_database_refusing_new_connections_is_an_outage(
    cluster_factory: ClusterFactory, chaos_postgres: PostgresServer, refusal: Refusal
) -> None:
    database = owned_database(chaos_postgres)
    cluster = cluster_factory(SCRIPT, database_url=database.url)
    gateway = cluster.start_gateway()
    worker = cluster.start_worker()
    session_id, idle_session_id = new_session(gateway), new_session(gateway)
    stream = post_turn(gateway, session_id, "refused", "refused-1")
    stream.wait_for(lambda f: f.type == "finish-step")  # running; the next LM call takes 1 s
    assert stream.headers is not None
    run_id = stream.headers["x-fleet-run-id"]
    names = {"database": database.name, "role": database.role, "password": database.password}
    chaos_postgres.execute(refusal.refuse.format(**names), end_connections(database.name))
    refused_at = time.monotonic()
    answers: list[tuple[str, int, str]] = []
    try:
        assert refusal_of(database) == refusal.sqlstate  # the refusal this case is about
        stream.wait_for(lambda f: f.type == "data-status" and '"settling"' in f.data, timeout=30)
        while time.monotonic() < refused_at + refusal.seconds:
            for name, response in calls_during_outage(gateway, idle_session_id).items():
                body = response.json()
                answers.append((name, response.status_code, body.get("code", body.get("status"))))
            time.sleep(1)  # the outage lasts its length whatever the clients do: ask once a second
    finally:
        chaos_postgres.execute(refusal.allow.format(**names))
    print(f"the database refused connections ({refusal.sqlstate}) for {time.monotonic() - refused_at:.1f} s")
    unavailable = ((503, "service_unavailable"), (503, "unavailable"))  # an API error; /ready's body
    wrong = [answer for answer in answers if answer[1:] not in unavailable]
    assert answers and not wrong, wrong
    assert "turn.commit_retry" in worker.log.read_text()  # the answer was ready during the outage
    assert_committed_at_attempt_1(gateway, stream, run_id, session_id)
    with gateway.client() as client:  # the Turn POSTed during the outage left nothing behind
        assert client.get(f"/api/sessions/{idle_session_id}/turns").json()["items"] == []
    assert unfinished_or_retried_runs(database) == 0
    for process in cluster.processes:
        log = process.log.read_text()
        assert "sweep.settled_lost_run" not in log and "turn.commit_failed" not in log, process.name
