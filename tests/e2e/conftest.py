"""Start fleet the way a user does: `fleet db upgrade`, `fleet gateway`, `fleet worker` as processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]
SECRET_SENTINEL = "sk-e2e-must-not-leak"
NODE_DIR = REPO / "tests" / "node"


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    data_dir: Path
    processes: list[subprocess.Popen[bytes]]
    redis: RedisServer  # the stack's own private Redis

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)


def fleet(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleet_cli", *args]


def wait_ready(url: str, processes: list[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        for proc in processes:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            response = httpx.get(f"{url}/ready", timeout=2)
            if response.status_code == 200:
                return
            last = response.text
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"the stack never became ready: {last}")


def start_stack(data_dir: Path, extra_env: dict[str, str]) -> Stack:
    """Migrate, then start a gateway and a worker on a private, empty Redis of their own.

    End it with `stop_stack`, which also stops that Redis.
    """
    redis_server = RedisServer().start()
    env = {
        **os.environ,
        "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": redis_server.url(db=0),
        "FLEET_DATABASE_URL": f"sqlite+aiosqlite:///{data_dir / 'fleet.db'}",
        "FLEET_LM_API_KEY": SECRET_SENTINEL,  # present on the host; must never reach the sandbox
        **extra_env,
    }
    try:
        subprocess.run(fleet("db", "upgrade"), env=env, cwd=data_dir, check=True, capture_output=True)
    except BaseException:
        redis_server.stop()
        raise
    port = free_port()
    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)
    processes = [
        subprocess.Popen(
            fleet(*argv),
            env=env,
            cwd=data_dir,
            stdout=open(logs / f"{name}.log", "wb"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for name, argv in (("gateway", ["gateway", "--port", str(port)]), ("worker", ["worker"]))
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, processes)
    except BaseException:
        stop(processes)
        redis_server.stop()
        for log in logs.iterdir():
            sys.stderr.write(f"--- {log.name}\n{log.read_text()[-4000:]}\n")
        raise
    return Stack(url, env, data_dir, processes, redis_server)


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_stack(stack: Stack) -> None:
    """Stop the stack's processes, then its private Redis, and remove its work dir."""
    try:
        stop(stack.processes)
    finally:
        stack.redis.stop()
        shutil.rmtree(stack.data_dir, ignore_errors=True)


def work_dir(prefix: str) -> Path:
    """Where the processes run (their `.fleet/` lives here); searchable by the sandbox's uid."""
    path = Path(tempfile.mkdtemp(prefix=f"fleet-e2e-{prefix}-"))
    path.chmod(0o711)
    return path


@pytest.fixture(scope="module")
def demo_stack() -> Iterator[Stack]:
    """The offline profile exactly as shipped: the demo script."""
    stack = start_stack(work_dir("demo"), {})
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def probe_stack() -> Iterator[Stack]:
    """A script that probes the sandbox's reach, slowly enough to observe a Turn in progress."""
    script = REPO / "tests" / "e2e" / "scripts" / "probe.jsonl"
    stack = start_stack(work_dir("probe"), {"FLEET_SCRIPTED_LM": str(script)})
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def postgres_stack(postgres_url: str) -> Iterator[Stack]:
    """The production database path: the same processes on PostgreSQL (asyncpg)."""
    stack = start_stack(work_dir("pg"), {"FLEET_DATABASE_URL": postgres_url})
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="session")
def node_check() -> Path:
    """The AI SDK checker. Its pinned packages are installed before pytest (.ci/run), never by
    a test: the suite stays on this machine (tests/support/network_guard.py)."""
    if not (NODE_DIR / "node_modules" / "ai6").is_dir() or not (NODE_DIR / "node_modules" / "ai7").is_dir():
        pytest.fail("the AI SDK stream check needs its packages: run `(cd tests/node && npm ci)`")
    return NODE_DIR / "check_stream.mjs"


def ai_sdk_parse(node_check: Path, alias: str, raw: bytes) -> dict[str, Any]:
    node = shutil.which("node")
    assert node
    result = subprocess.run(
        [node, str(node_check), alias], input=raw, capture_output=True, timeout=60, check=False
    )
    report: dict[str, Any] = json.loads(result.stdout.decode().strip().splitlines()[-1])
    assert result.returncode == 0 and report["ok"], f"{alias} rejected the stream: {report} {result.stderr!r}"
    return report
