"""A fleet cluster of real processes for fault tests: gateways and workers started as a user
starts them (`python -m fleet_cli ...`), on a private Redis and a private database.

Faults are real: SIGKILL/SIGSTOP of a process, a Redis server killed and restarted on the same
port (its data gone), a PostgreSQL server stopped and started. Nothing here touches the shared
Redis or PostgreSQL of the machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.servers import RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]

# The offline profile with the production lease timing, and fast heartbeats so that tests see
# progress quickly. `overrides` (dotted keys) change single values per cluster.
BASE_PROFILE: dict[str, Any] = {
    "runtime": {"heartbeat_seconds": 1, "turn_timeout_seconds": 120},
    "llm": {"root": {"model": "scripted/chaos", "script": "script.jsonl"}},
    "rlm": {"max_iters": 12, "max_llm_calls": 30, "max_output_chars": 10000},
    "sandbox": {"provider": "local", "local": {"cell_timeout_seconds": 60, "memory_mb": 512}},
    "storage": {"data_dir": ".fleet"},
    "worker": {"concurrency": 4, "lease_seconds": 3, "drain_seconds": 2},
    "gateway": {"stream_max_seconds": 900},
}


def script_text(*lines: dict[str, Any]) -> str:
    return "\n".join(json.dumps(line) for line in lines) + "\n"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)


def toml_tables(prefix: str, table: dict[str, Any]) -> list[str]:
    scalars = [f"{k} = {toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = [f"[{prefix}]", *scalars] if scalars else []
    for key, value in table.items():
        if isinstance(value, dict):
            out += toml_tables(f"{prefix}.{key}", value)
    return out


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    result = json.loads(json.dumps(base))
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        node = result
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return result


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout: float = 20) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def rss_kb(self) -> int:
        """Resident memory of the process itself (not its sandboxes)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")


@dataclass
class Gateway:
    process: Process
    url: str

    def client(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)


@dataclass
class Cluster:
    work: Path
    redis: RedisServer
    database_url: str
    script: str
    overrides: dict[str, Any] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        config_dir = self.work / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "script.jsonl").write_text(self.script)
        profile = merged(BASE_PROFILE, self.overrides)
        lines = ["[config]", 'default_profile = "chaos"', *toml_tables("profiles.chaos", profile)]
        (config_dir / "fleet.toml").write_text("\n".join(lines) + "\n")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        self.env.update(
            FLEET_CONFIG=str(config_dir / "fleet.toml"),
            FLEET_REDIS_URL=self.redis.url(0),
            FLEET_DATABASE_URL=self.database_url,
        )
        self.run_cli("db", "upgrade")

    def run_cli(self, *args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "fleet_cli", *args],
            env=self.env,
            cwd=self.work,
            check=True,
            capture_output=True,
        )

    def spawn(self, name: str, *args: str) -> Process:
        logs = self.work / "logs"
        logs.mkdir(exist_ok=True)
        log = logs / f"{name}-{len(self.processes)}.log"
        popen = subprocess.Popen(
            [sys.executable, "-m", "fleet_cli", *args],
            env=self.env,
            cwd=self.work,
            stdout=open(log, "wb"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def start_gateway(self) -> Gateway:
        port = free_port()
        gateway = Gateway(self.spawn("gateway", "gateway", "--port", str(port)), f"http://127.0.0.1:{port}")
        self.wait_until(lambda: self.answers(gateway), "the gateway never answered", gateway.process)
        return gateway

    def start_worker(self, concurrency: int | None = None) -> Process:
        args = ["worker"] if concurrency is None else ["worker", "--concurrency", str(concurrency)]
        before = self.redis_client().get("fleet:queue:health-check")
        worker = self.spawn("worker", *args)
        # Ready once arq has written a fresh health check (its first poll ran).
        self.wait_until(
            lambda: (now := self.redis_client().get("fleet:queue:health-check")) and now != before,
            "the worker never came up",
            worker,
        )
        return worker

    def redis_client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis.url(0), socket_connect_timeout=1)

    @staticmethod
    def answers(gateway: Gateway) -> bool:
        try:
            return httpx.get(f"{gateway.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_until(
        self, check: Callable[[], Any], message: str, process: Process | None = None, timeout: float = 60
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process is not None and process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited: {process.log.read_text()[-3000:]}")
            try:
                if check():
                    return
            except Exception:  # the thing checked is still coming up
                pass
            time.sleep(0.05)
        raise RuntimeError(message)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()

    def dump_logs(self) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.log.read_text()[-3000:]}" for p in self.processes)


# --- SSE, read live -----------------------------------------------------------------------------


@dataclass
class Frame:
    id: str | None
    data: str
    at: float  # time.monotonic() when it arrived

    @property
    def chunk(self) -> dict[str, Any] | None:
        return None if self.data == "[DONE]" else json.loads(self.data)

    @property
    def type(self) -> str:
        chunk = self.chunk
        return "[DONE]" if chunk is None else str(chunk["type"])


def frames_of(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    event_id, data = None, None
    for line in lines:
        if line == "":
            if data is not None:
                yield event_id, data
            event_id, data = None, None
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]


class LiveStream:
    """An SSE response read on a thread, frame by frame, as a client sees it."""

    def __init__(
        self,
        url: str,
        path: str,
        *,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
        stop_when: Callable[[Frame], bool] | None = None,
    ) -> None:
        self.frames: list[Frame] = []
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.error: BaseException | None = None
        self.stop_when = stop_when
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self.read, args=(url, method, path, headers or {}, body), daemon=True
        )
        self.thread.start()

    def read(self, url: str, method: str, path: str, headers: dict[str, str], body: Any) -> None:
        try:
            with (
                httpx.Client(base_url=url, timeout=httpx.Timeout(5, read=120)) as client,
                client.stream(method, path, headers=headers, json=body) as response,
            ):
                self.status, self.headers = response.status_code, response.headers
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    response.read()
                    return
                for event_id, data in frames_of(response.iter_lines()):
                    frame = Frame(event_id, data, time.monotonic())
                    self.frames.append(frame)
                    if self.stop_when is not None and self.stop_when(frame):
                        return  # the client is cut off here
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def wait_for(self, predicate: Callable[[Frame], bool], timeout: float = 60) -> Frame:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for frame in self.frames[seen:]:
                if predicate(frame):
                    return frame
            seen = len(self.frames)
            if self.done.is_set() and seen == len(self.frames):
                break
            time.sleep(0.01)
        raise AssertionError(f"no such frame; got {[f.type for f in self.frames]} (error: {self.error})")

    def finish(self, timeout: float = 60) -> LiveStream:
        assert self.done.wait(timeout), f"the stream did not end; got {[f.type for f in self.frames]}"
        return self

    @property
    def types(self) -> list[str]:
        return [f.type for f in self.frames]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [c for f in self.frames if (c := f.chunk) is not None]

    @property
    def content(self) -> list[tuple[str | None, str]]:
        """(id, data) of the Run's content frames: what a resume must reproduce exactly."""
        return [(f.id, f.data) for f in self.frames if f.id is not None and f.id.count(".") == 1]


def post_turn(
    gateway: Gateway, session_id: str, text: str, key: str, stop_when: Callable[[Frame], bool] | None = None
) -> LiveStream:
    return LiveStream(
        gateway.url,
        f"/api/sessions/{session_id}/turns",
        method="POST",
        headers={"Idempotency-Key": key},
        body={"text": text},
        stop_when=stop_when,
    )


def resume(gateway: Gateway, run_id: str, last_event_id: str | None = None) -> LiveStream:
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
    return LiveStream(gateway.url, f"/api/runs/{run_id}/stream", headers=headers)


def new_session(gateway: Gateway) -> str:
    with gateway.client() as client:
        return str(client.post("/api/sessions", json={"title": "chaos"}).json()["id"])


def run_of(gateway: Gateway, run_id: str) -> dict[str, Any]:
    with gateway.client() as client:
        response = client.get(f"/api/runs/{run_id}")
    assert response.status_code == 200, response.text
    return dict(response.json())


def wait_for_run(
    gateway: Gateway, run_id: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            run = run_of(gateway, run_id)
        except (AssertionError, httpx.HTTPError):
            run = {}
        if run and predicate(run):
            return run
        time.sleep(0.05)
    raise AssertionError(f"the Run never got there: {run}")
