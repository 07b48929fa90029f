"""A worker outlives a Redis outage: it waits, reconnects, and goes on taking Turns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.e2e.conftest import REPO
from tests.support.servers import RedisServer

pytestmark = pytest.mark.e2e


def test_worker_survives_a_redis_restart(traversable_dir: Path, sqlite_url: str) -> None:
    server = RedisServer().start()
    port = server.port
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(
        FLEET_CONFIG=str(REPO / "config" / "fleet.toml"),
        FLEET_REDIS_URL=server.url(db=0),
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
        server.kill()  # SIGKILL and wait: an outage
        time.sleep(3)
        assert worker.poll() is None, "the worker died with Redis"
        server.start()  # the same port again
        deadline = time.monotonic() + 40
        while not client.exists("fleet:queue:health-check") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.exists("fleet:queue:health-check"), "the worker did not reconnect"
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        server.stop()
