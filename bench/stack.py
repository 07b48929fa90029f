"""A real fleet stack for the lanes, started as a user starts it: a private redis-server on a free
loopback port, `fleet db upgrade` on a temp SQLite file, then `fleet gateway` and `fleet worker`
processes (each in its own process group), with FLEET_CONFIG / FLEET_REDIS_URL /
FLEET_DATABASE_URL / FLEET_SCRIPTED_LM. Also: /proc readings (CPU, RSS) and a plain HTTP client.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from fleet_shared.redis_keys import WORKER_SANDBOX_PATTERN

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- config and scripts -------------------------------------------------------------------------

CONFIG_TEMPLATE = """\
[config]
default_profile = "bench"

[profiles.bench.runtime]
heartbeat_seconds = {heartbeat_seconds}
turn_timeout_seconds = 600

[profiles.bench.llm.root]
model = "scripted/bench"
script = "{script}"

[profiles.bench.llm.sub]
model = "scripted/bench"
script = "{script}"

[profiles.bench.rlm]
max_iters = 12
max_llm_calls = 30
max_output_chars = 10000
recursion = false

[profiles.bench.sandbox]
provider = "local"

[profiles.bench.sandbox.local]
allow_unisolated = false
cell_timeout_seconds = 60
memory_mb = 1024

[profiles.bench.storage]
data_dir = ".fleet"

[profiles.bench.worker]
concurrency = {concurrency}
lease_seconds = 3
drain_seconds = 2

[profiles.bench.gateway.limits]
max_body_bytes = 1048576
max_text_chars = 100000

[profiles.bench.observability]
log_level = "warning"
"""


def script_lines(*lines: dict[str, Any]) -> str:
    return "".join(json.dumps(line) + "\n" for line in lines)


def three_step_script(delay_s: float = 0.0) -> str:
    """The lanes' Turn: a plain cell, a cell with one `llm_query`, then SUBMIT (3 iterations)."""
    extra = {"delay_s": delay_s} if delay_s else {}
    return script_lines(
        {"lm": "root", "reasoning": "Plain Python first.", "code": "x = 21 * 2\nprint(x)", **extra},
        {
            "lm": "root",
            "reasoning": "One semantic step.",
            "code": "s = llm_query('name it')\nprint(s)",
            **extra,
        },
        {"lm": "root", "reasoning": "Submit once.", "code": "SUBMIT(answer=f'{s} {x}')", **extra},
        {"lm": "sub", "text": "forty-two", **extra},
    )


# --- processes ----------------------------------------------------------------------------------


def fleet(*args: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "fleet_cli", *args]


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGTERM the process's group, then SIGKILL it if it has not ended in `timeout`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers in the group (sandboxes, Granian workers)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)


@dataclass
class Stack:
    """One private stack. `start_gateway()`, `start_workers(n)`; `close()` ends everything."""

    concurrency: int = 4
    heartbeat_seconds: float = 10
    script: str = field(default_factory=three_step_script)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fleet-bench-stack-")))
    redis: subprocess.Popen[bytes] | None = None
    gateway: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    config_text: str | None = None  # a whole fleet.toml instead of the scripted one (lane `live`)
    python: str = sys.executable  # whose fleet runs: another checkout's venv for `bench.ab`
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. FLEET_LM_* for a provider LM

    def __post_init__(self) -> None:
        self.root.chmod(0o711)  # the sandbox's uid must be able to reach the workspaces
        (self.root / "logs").mkdir()
        self.script_path = self.root / "script.jsonl"
        self.script_path.write_text(self.script)
        self.config_path = self.root / "fleet.toml"
        self.config_path.write_text(
            self.config_text
            or CONFIG_TEMPLATE.format(
                script=self.script_path,
                concurrency=self.concurrency,
                heartbeat_seconds=self.heartbeat_seconds,
            )
        )

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def start(self, workers: int = 1) -> Stack:
        self.start_redis()
        self.migrate()
        self.start_gateway()
        self.wait_ready(need_worker=False)
        self.start_workers(workers)
        self.wait_ready(need_worker=workers > 0)
        return self

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH: the bench stack needs a private Redis")
        port = free_port()
        self.redis = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root), "--logfile", str(self.root / "logs" / "redis.log"),
             "--maxclients", "20000"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"the private redis-server on port {port} never answered")
        self.env = {
            **os.environ,
            "FLEET_CONFIG": str(self.config_path),
            "FLEET_PROFILE": "bench",
            "FLEET_REDIS_URL": f"redis://127.0.0.1:{port}/0",
            "FLEET_DATABASE_URL": f"sqlite+aiosqlite:///{self.root / 'fleet.db'}",
            "FLEET_SCRIPTED_LM": str(self.script_path),
            **self.extra_env,
        }
        self.redis_url = self.env["FLEET_REDIS_URL"]

    def migrate(self) -> None:
        upgrade = fleet("db", "upgrade", python=self.python)
        subprocess.run(upgrade, env=self.env, cwd=self.root, check=True, capture_output=True)

    def spawn(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        log = open(self.root / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            return subprocess.Popen(
                fleet(*argv, python=self.python), env=self.env, cwd=self.root, stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        finally:
            log.close()

    def start_gateway(self) -> None:
        port = free_port()
        self.gateway = self.spawn("gateway", "gateway", "--port", str(port))
        self.url = f"http://127.0.0.1:{port}"
        self.port = port

    def start_workers(self, count: int, concurrency: int | None = None) -> None:
        """Start `count` workers, each up before the next (call it with no worker running: it
        forgets the sandbox announcements of stopped ones). A worker that fails to start is
        started again once."""
        import redis as redis_sync

        client = redis_sync.Redis.from_url(self.redis_url)
        try:
            for key in list(client.scan_iter(match=WORKER_SANDBOX_PATTERN, count=1000)):
                client.delete(key)
        finally:
            client.close()
        sized = ["--concurrency", str(concurrency)] if concurrency else []
        for _ in range(count):  # one at a time: workers started together race on the sandbox cgroup
            for attempt in range(2):
                self.workers.append(
                    self.spawn(f"worker-{len(self.workers)}", "worker", "--metrics-port", "0", *sized)
                )
                try:
                    self.wait_workers_ready(len(self.workers))
                    break
                except RuntimeError:
                    failed = self.workers.pop()
                    stop_group(failed)
                    if attempt == 1:
                        raise

    def stop_workers(self) -> None:
        for proc in self.workers:
            stop_group(proc)
        self.workers = []

    def wait_ready(self, *, need_worker: bool = True, timeout: float = 90) -> None:
        """Until /ready answers 200 (or, without workers, until /health does)."""
        path = "/ready" if need_worker else "/health"
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for proc in [self.gateway, *self.workers]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}: {self.logs()}")
            try:
                status, body = http(self.url, "GET", path, timeout=2)
                if status == 200:
                    return
                last = str(body)
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise RuntimeError(f"the bench stack never became ready ({last}): {self.logs()}")

    def wait_workers_ready(self, count: int, timeout: float = 90) -> None:
        """Until `count` workers announced their sandbox in Redis (each worker process does, once up)."""
        import redis as redis_sync

        client = redis_sync.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                for proc in self.workers:
                    if proc.poll() is not None:
                        raise RuntimeError(f"a worker exited with {proc.returncode}: {self.logs()}")
                beats = sum(1 for _ in client.scan_iter(match=WORKER_SANDBOX_PATTERN, count=1000))
                if beats >= count:
                    return
                time.sleep(0.1)
        finally:
            client.close()
        raise RuntimeError(f"only some of {count} workers came up: {self.logs()}")

    def logs(self, chars: int = 1500) -> str:
        out = []
        for path in sorted((self.root / "logs").glob("*.log")):
            with contextlib.suppress(OSError):
                out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    def close(self) -> None:
        procs = [
            *self.workers,
            *([self.gateway] if self.gateway else []),
            *([self.redis] if self.redis else []),
        ]
        for proc in procs:
            with contextlib.suppress(Exception):
                stop_group(proc)
        self.workers, self.gateway, self.redis = [], None, None
        shutil.rmtree(self.root, ignore_errors=True)


# --- /proc --------------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """The pid and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def machine_busy_seconds() -> float:
    """CPU time all cores spent not idle since boot (/proc/stat), in seconds."""
    fields = [int(word) for word in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields) - idle - iowait) / CLOCK_TICKS


class Sampler:
    """A thread that samples every `interval` seconds while the `with` block runs."""

    def __init__(self, interval: float) -> None:
        import threading

        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class MachineSampler(Sampler):
    """The machine's busy cores every `interval` seconds while in use: an average can hide that
    work arriving at once (Turns started in waves) saturates every core for a while."""

    def __init__(self, interval: float = 0.05) -> None:
        super().__init__(interval)
        self.samples: list[float] = []
        self.busy_seconds = self.elapsed = 0.0

    def _run(self) -> None:
        before, at = machine_busy_seconds(), time.monotonic()
        stopping = False
        while not stopping:
            stopping = self._stop.wait(self.interval)
            now_busy, now = machine_busy_seconds(), time.monotonic()
            self.samples.append((now_busy - before) / (now - at))
            self.busy_seconds += now_busy - before
            self.elapsed += now - at
            before, at = now_busy, now

    @property
    def mean_cores(self) -> float:
        """Busy cores on average over the whole time in use."""
        return self.busy_seconds / self.elapsed if self.elapsed else 0.0

    def saturated_fraction(self, cores: int, share: float = 0.9) -> float:
        """The fraction of intervals in which at least `share` of all cores were busy."""
        full = [busy for busy in self.samples if busy >= share * cores]
        return round(len(full) / len(self.samples), 3) if self.samples else 0.0


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (live ones) and of the children they reaped, in
    seconds: a worker's REPLs come and go within a measurement, and their time lands in their
    parent's cutime/cstime once reaped (the kernel adds each child's own reaped children too)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # utime, stime, cutime, cstime: fields 14-17 of stat (the split starts at field 3)
        total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return total / CLOCK_TICKS


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
        except OSError:
            continue
    return total


# --- HTTP ---------------------------------------------------------------------------------------


def http(
    url: str, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> tuple[int, Any]:  # fmt: skip
    """One request with the stdlib client; the JSON body decoded (or the raw bytes)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        sent = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**sent, **(headers or {})})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return response.status, raw


def new_session(url: str) -> str:
    status, body = http(url, "POST", "/api/sessions", {"title": "bench"})
    if status != 201:
        raise RuntimeError(f"POST /api/sessions answered {status}: {body!r}")
    return str(body["id"])


def sessions_by_kind(url: str) -> Callable[[str], str]:
    """The session a lane's Turn of each kind goes to: `new_session`, a new one each time (its
    first Turn); otherwise one running conversation, made now."""
    conversation = new_session(url)
    return lambda kind: new_session(url) if kind == "new_session" else conversation


@dataclass
class StreamResult:
    """One SSE response read to its end: when its first byte, first frame and `[DONE]` came."""

    status: int
    run_id: str | None
    started: float  # perf_counter when the request was sent
    first_byte_s: float
    first_frame_s: float | None
    end_s: float
    done: bool
    raw: bytes

    @property
    def aborted(self) -> bool:
        return b'"type":"abort"' in self.raw

    @property
    def finished(self) -> bool:
        """Read to `[DONE]` after a `finish` with reason `stop`: the Turn answered."""
        return self.done and b'"finishReason":"stop"' in self.raw


def raw_request(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{key}: {value}" for key, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_stream(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
    *, timeout: float = 120, on_data: Any = None,
) -> StreamResult:  # fmt: skip
    """Send one request on a raw socket and read until `data: [DONE]` or EOF.

    Times are from just before the request is sent (perf_counter). No HTTP client library sits
    in between, so the first-byte figure is the gateway's, plus one loopback round trip."""
    request = raw_request(port, method, path, body, headers)
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    chunks: list[bytes] = []
    first_byte = first_frame = None
    try:
        started = time.perf_counter()
        sock.sendall(request)
        seen = b""
        while True:
            data = sock.recv(65536)
            now = time.perf_counter()
            if not data:
                break
            if first_byte is None:
                first_byte = now - started
            chunks.append(data)
            seen = seen[-64:] + data
            if first_frame is None and b"data: " in seen:
                first_frame = now - started
            if on_data is not None:  # everything so far (for lanes that watch a Turn's progress)
                on_data(b"".join(chunks))
            if b"data: [DONE]" in seen:
                break
        end = time.perf_counter() - started
    finally:
        sock.close()
    raw = b"".join(chunks)
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    status = int(head.split(" ", 2)[1]) if head.startswith("HTTP/") else 0
    run_id = header(raw, "x-fleet-run-id")
    return StreamResult(
        status, run_id, started, first_byte or end, first_frame, end, b"data: [DONE]" in raw, raw
    )


def post_turn(port: int, session_id: str, text: str = "bench", **kwargs: Any) -> StreamResult:
    body = json.dumps({"text": text}).encode()
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    return read_stream(port, "POST", f"/api/sessions/{session_id}/turns", body, headers, **kwargs)


@contextlib.contextmanager
def stack(**kwargs: Any) -> Iterator[Stack]:
    """A Stack that is closed (all process groups ended, temp dir removed) however the block ends."""
    created = Stack(**kwargs)
    try:
        yield created
    finally:
        created.close()


def header(raw: bytes, name: str) -> str | None:
    """A response header's value, from the raw bytes of a response."""
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def run_turns_for(st: Stack, parallel: int, seconds: float) -> list[StreamResult]:
    """A closed loop: `parallel` clients post Turns back to back and start none after `seconds`;
    every slot stays busy until then."""
    stop_at = time.perf_counter() + seconds
    return run_clients(st, parallel, lambda: time.perf_counter() < stop_at)


def turns_per_second(results: list[StreamResult], start: float, end: float) -> float:
    """Turns done per second inside [start, end] (perf_counter times), each Turn counted by the
    share of its duration that falls inside: no rounding to whole Turns, and no ramp-down, where
    fewer than all clients still have a Turn in flight."""
    done = 0.0
    for result in results:
        begin, finish = result.started, result.started + result.end_s
        overlap = min(finish, end) - max(begin, start)
        if overlap > 0:
            done += overlap / max(finish - begin, 1e-9)
    return done / (end - start)


def run_turns(
    st: Stack, total: int, parallel: int, on_done: Any = None, sessions: list[str] | None = None
) -> list[StreamResult]:
    """`total` Turns from `parallel` clients (in `sessions`, one each, when given). `on_done(count)`
    is called after each Turn, from the client threads."""
    import threading

    lock = threading.Lock()
    claimed = [0]

    def more() -> bool:
        with lock:
            if claimed[0] >= total:
                return False
            claimed[0] += 1
            return True

    return run_clients(st, parallel, more, on_done, sessions)


def run_clients(
    st: Stack,
    parallel: int,
    more: Callable[[], bool],
    on_done: Any = None,
    sessions: list[str] | None = None,
) -> list[StreamResult]:
    """`parallel` client threads, each with its own session (one Turn at a time in a session; a
    new one, or the client's of `sessions`), posting Turns back to back while `more()` says so."""
    import threading

    results: list[StreamResult] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            session = sessions[index] if sessions is not None else new_session(st.url)
            while more():
                result = post_turn(st.port, session)
                with lock:
                    results.append(result)
                    count = len(results)
                if on_done is not None:
                    on_done(count)
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(index,)) for index in range(parallel)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
