"""The database goes away: every API call answers 503 (never 500), and a Turn that computed its
answer while the database was down commits it once the database is back."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from tests.chaos.cluster import new_session, post_turn, resume, run_of, script_text, wait_for_run
from tests.chaos.conftest import ClusterFactory
from tests.support.servers import PostgresServer

pytestmark = pytest.mark.chaos

SCRIPT = script_text(
    {"lm": "root", "reasoning": "look", "code": "print('x')"},
    {"lm": "root", "reasoning": "think while the database is away", "code": "y = 6 * 7", "delay_s": 1},
    {"lm": "root", "reasoning": "done", "code": "SUBMIT(answer=f'the answer is {y}')"},
)


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
    stream.finish(timeout=60)
    assert stream.types[-2:] == ["finish", "[DONE]"], stream.types
    run = wait_for_run(gateway, run_id, lambda r: r["status"] != "running")
    assert (run["status"], run["failure_code"], run["attempt"]) == ("completed", None, 1)
    with gateway.client() as client:
        history = client.get(f"/api/sessions/{session_id}/turns").json()["items"]
    assert [p["text"] for p in history[-1]["parts"] if p["type"] == "text"] == ["the answer is 42"]
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


def set_read_only(server: PostgresServer, database: str, read_only: bool) -> None:
    """A failover as clients see it: the database takes no more writes, existing sessions end."""
    import asyncio

    import asyncpg

    async def apply() -> None:
        conn = await asyncpg.connect(server.admin_dsn)
        try:
            flag = "on" if read_only else "off"
            await conn.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = {flag}')
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", database
            )
        finally:
            await conn.close()

    asyncio.run(apply())


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
    stream.finish(timeout=60)
    assert stream.types[-2:] == ["finish", "[DONE]"], stream.types
    run = run_of(gateway, run_id)
    assert (run["status"], run["attempt"]) == ("completed", 1)
