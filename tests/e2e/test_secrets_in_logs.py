"""Secrets never reach a log: the API token, the LM key and the Redis and database passwords.

A real stack (gateway + worker processes) on a private Redis that requires a password and a
private PostgreSQL reached through a URL with a password in it, the API token set and the log
level at debug. After authorized, unauthorized, failing and Turn requests, every log file the
stack wrote, and the output of the `fleet` commands, is searched for each secret value.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import fleet, start_stack, stop, stop_stack, work_dir
from tests.e2e.sse import post_turn
from tests.support.policy import SHIPPED, private_policy
from tests.support.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.e2e


def secret(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def redis_command(port: int, *args: str, password: str | None = None) -> bytes:
    """One command over RESP; the raw reply (e.g. b'+OK\\r\\n')."""

    def encode(*words: str) -> bytes:
        return f"*{len(words)}\r\n".encode() + b"".join(
            f"${len(w.encode())}\r\n".encode() + w.encode() + b"\r\n" for w in words
        )

    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        if password is not None:
            conn.sendall(encode("AUTH", password))
            assert conn.recv(64).startswith(b"+OK")
        conn.sendall(encode(*args))
        return conn.recv(4096)


@pytest.fixture(scope="module")
def locked_redis() -> Iterator[tuple[RedisServer, str]]:
    """A private Redis that refuses clients without the password."""
    server = RedisServer().start()
    password = secret("redis-pw")
    assert redis_command(server.port, "CONFIG", "SET", "requirepass", password).startswith(b"+OK")
    assert redis_command(server.port, "PING").startswith(b"-NOAUTH")
    yield server, password
    server.stop()


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.close()


def read_logs(data_dir: Path) -> dict[str, str]:
    return {
        str(path.relative_to(data_dir)): path.read_text(errors="replace")
        for path in sorted(data_dir.rglob("*.log"))
        if path.is_file()
    }


def test_tokens_keys_and_passwords_never_reach_the_logs(
    locked_redis: tuple[RedisServer, str], private_pg: PostgresServer
) -> None:
    redis_server, redis_password = locked_redis
    db_password = secret("db-pw")
    token, lm_key, wrong_token = secret("api-token"), secret("sk-lm-key"), secret("wrong-token")
    database = private_pg.create_database("fleet_secrets")
    db_url = database.replace("postgres@", f"postgres:{db_password}@", 1)
    assert db_password in db_url
    data_dir = work_dir("secrets")
    env = {
        **private_policy(data_dir, log_level="debug"),
        "FLEET_API_TOKEN": token,
        "FLEET_LM_API_KEY": lm_key,
        "FLEET_REDIS_URL": f"redis://:{redis_password}@127.0.0.1:{redis_server.port}/0",
        "FLEET_DATABASE_URL": db_url,
    }
    stack = start_stack(data_dir, env)
    outputs: dict[str, str] = {}
    try:
        bearer = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=stack.url, timeout=60, headers=bearer) as client:
            session = client.post("/api/sessions", json={"title": "secrets"})
            assert session.status_code == 201, session.text
            session_id = session.json()["id"]
            assert client.get("/api/sessions").status_code == 200
            stream = post_turn(client, session_id, "Please say hello to the fleet", "secrets-1")
            assert stream.chunks[-1]["finishReason"] == "stop", stream.chunks[-3:]
            assert client.get(f"/api/sessions/{session_id}/turns").status_code == 200
            unknown = client.get("/api/sessions/00000000-0000-4000-8000-000000000000")
            assert unknown.status_code == 404
            malformed = client.post(
                f"/api/sessions/{session_id}/turns",
                content=b'{"text": ',
                headers={"Idempotency-Key": "k", "content-type": "application/json"},
            )
            assert malformed.status_code == 422
        with httpx.Client(base_url=stack.url, timeout=60) as anonymous:
            assert anonymous.get("/api/sessions").status_code == 401
            wrong = anonymous.get("/api/sessions", headers={"Authorization": f"Bearer {wrong_token}"})
            assert wrong.status_code == 401
            assert anonymous.get("/health").status_code == 200
        # What an operator runs next to the stack prints no secret either.
        for argv in (("db", "check"), ("db", "upgrade")):
            done = subprocess.run(fleet(*argv), env=stack.env, cwd=data_dir, capture_output=True, check=False)
            outputs[" ".join(argv)] = (done.stdout + done.stderr).decode(errors="replace")
            assert done.returncode == 0, outputs[" ".join(argv)]
        stop(stack.processes)  # flush the shutdown lines too
        logs = {**read_logs(data_dir), **outputs}
    finally:
        stop_stack(stack)

    assert {"logs/gateway.log", "logs/worker.log"} <= set(logs), sorted(logs)
    assert '"turn.claimed"' in logs["logs/gateway.log"], "the gateway log was not captured"
    assert '"turn.settled"' in logs["logs/worker.log"], "the worker log was not captured"
    values = {
        "FLEET_API_TOKEN": token,
        "a rejected bearer token": wrong_token,
        "FLEET_LM_API_KEY": lm_key,
        "the Redis password": redis_password,
        "the database password": db_password,
    }
    leaks = [
        f"{what} in {name}" for name, text in logs.items() for what, value in values.items() if value in text
    ]
    assert not leaks, leaks


def test_a_wrong_redis_password_is_reported_without_the_password(
    locked_redis: tuple[RedisServer, str], tmp_path: Path
) -> None:
    """The failure path: a worker whose Redis refuses its password logs the refusal, not the URL."""
    redis_server, _right = locked_redis
    wrong = secret("wrong-redis-pw")
    env = {
        **os.environ,
        **private_policy(tmp_path),
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": f"redis://:{wrong}@127.0.0.1:{redis_server.port}/0",
        "FLEET_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'fleet.db'}",
    }
    log = tmp_path / "worker.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(fleet("worker"), env=env, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while '"worker.redis_unavailable"' not in log.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None or log.read_text(), "the worker exited without a word"
                time.sleep(0.2)
        finally:
            proc.kill()
            proc.wait()
    output = log.read_text(errors="replace")
    assert "AuthenticationError" in output, output[-2000:]
    assert wrong not in output, output[-2000:]


@pytest.mark.parametrize("key", ["database_url", "redis_url"])
def test_a_policy_file_with_a_password_is_refused_without_echoing_it(key: str, tmp_path: Path) -> None:
    """URLs with credentials come from env variables only; the refusal does not repeat the password."""
    password = secret("file-pw")
    env_overrides = private_policy(tmp_path)
    policy = Path(env_overrides["FLEET_CONFIG"])
    text = policy.read_text(encoding="utf-8")
    scheme = "postgresql+asyncpg" if key == "database_url" else "redis"
    anchor = '[profiles.offline.storage]\ndata_dir = ".fleet"\n'
    assert anchor in text, f"the offline storage section moved in {SHIPPED / 'fleet.toml'}"
    policy.write_text(
        text.replace(anchor, f'{anchor}{key} = "{scheme}://fleet:{password}@127.0.0.1:1/x"\n'),
        encoding="utf-8",
    )
    env = {"PATH": "/usr/bin:/bin", **env_overrides, "FLEET_PROFILE": "offline"}
    done = subprocess.run(fleet("db", "upgrade"), env=env, cwd=tmp_path, capture_output=True, check=False)
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 2, output
    assert "config error" in output and key in output, output
    assert password not in output, output
