"""A worker outlives a Redis outage: it waits, reconnects, and goes on taking Turns."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.e2e.conftest import REPO, free_port

pytestmark = pytest.mark.e2e


def start_redis(port: int, data_dir: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def test_worker_survives_a_redis_restart(traversable_dir: Path, sqlite_url: str) -> None:
    port = free_port()
    server = start_redis(port, traversable_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(
        FLEET_CONFIG=str(REPO / "config" / "fleet.toml"),
        FLEET_REDIS_URL=f"redis://127.0.0.1:{port}/0",
        FLEET_DATABASE_URL=sqlite_url,
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "fleet_cli", "worker"],
        cwd=traversable_dir,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 30
        while not client.exists("fleet:queue:health-check") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.exists("fleet:queue:health-check"), "the worker never came up"
        server.kill()
        server.wait()
        time.sleep(3)
        assert worker.poll() is None, "the worker died with Redis"
        server = start_redis(port, traversable_dir)
        deadline = time.monotonic() + 40
        while not client.exists("fleet:queue:health-check") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.exists("fleet:queue:health-check"), "the worker did not reconnect"
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        server.kill()
        server.wait()
