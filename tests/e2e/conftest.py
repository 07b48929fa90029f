"""Start fleet the way a user does: `fleet db upgrade`, `fleet gateway`, `fleet worker` as processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

REPO = Path(__file__).resolve().parents[2]
E2E_REDIS = os.environ.get("FLEET_TEST_E2E_REDIS_URL", "redis://127.0.0.1:6379/10")
SECRET_SENTINEL = "sk-e2e-must-not-leak"


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    data_dir: Path
    processes: list[subprocess.Popen[bytes]]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def start_stack(data_dir: Path, redis_db: int, extra_env: dict[str, str]) -> Stack:
    redis_url = E2E_REDIS.rsplit("/", 1)[0] + f"/{redis_db}"
    redis.Redis.from_url(redis_url).flushdb()
    env = {
        **os.environ,
        "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": redis_url,
        "FLEET_DATABASE_URL": f"sqlite+aiosqlite:///{data_dir / 'fleet.db'}",
        "FLEET_LM_API_KEY": SECRET_SENTINEL,  # present on the host; must never reach the sandbox
        **extra_env,
    }
    subprocess.run(fleet("db", "upgrade"), env=env, cwd=data_dir, check=True, capture_output=True)
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
    except RuntimeError:
        stop(processes)
        for log in logs.iterdir():
            sys.stderr.write(f"--- {log.name}\n{log.read_text()[-4000:]}\n")
        raise
    return Stack(url, env, data_dir, processes)


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


def work_dir(prefix: str) -> Path:
    """Where the processes run (their `.fleet/` lives here); searchable by the sandbox's uid."""
    path = Path(tempfile.mkdtemp(prefix=f"fleet-e2e-{prefix}-"))
    path.chmod(0o711)
    return path


@pytest.fixture(scope="module")
def demo_stack() -> Iterator[Stack]:
    """The offline profile exactly as shipped: the demo script."""
    stack = start_stack(work_dir("demo"), 10, {})
    yield stack
    stop(stack.processes)
    shutil.rmtree(stack.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def probe_stack() -> Iterator[Stack]:
    """A script that probes the sandbox's reach, slowly enough to observe a Turn in progress."""
    script = REPO / "tests" / "e2e" / "scripts" / "probe.jsonl"
    stack = start_stack(work_dir("probe"), 11, {"FLEET_SCRIPTED_LM": str(script)})
    yield stack
    stop(stack.processes)
    shutil.rmtree(stack.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres_stack(postgres_url: str) -> Iterator[Stack]:
    """The production database path: the same processes on PostgreSQL (asyncpg)."""
    stack = start_stack(work_dir("pg"), 13, {"FLEET_DATABASE_URL": postgres_url})
    yield stack
    stop(stack.processes)
    shutil.rmtree(stack.data_dir, ignore_errors=True)
