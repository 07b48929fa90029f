"""Private Redis and PostgreSQL servers for the test suite.

Tests must never flush or restart the shared Redis (127.0.0.1:6379) or PostgreSQL
(127.0.0.1:5432). These helpers start servers of our own instead, on free loopback ports, with
their data in temp dirs that are removed on `stop()` / `close()`:

- `RedisServer`: a private `redis-server` (from PATH), no persistence.
- `PostgresServer`: a private PostgreSQL cluster (Debian's `initdb`/`pg_ctl`), for tests that
  need to stop and start the database. When the suite runs as root it runs the binaries as the
  `postgres` OS user, since PostgreSQL refuses to run as root.

Both also stop and clean up at interpreter exit if a test forgot to (not after a SIGKILL).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_LOG_TAIL = 4000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, chars: int = _LOG_TAIL) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


_live: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):  # best effort at exit
            server.close()


# --- Redis --------------------------------------------------------------------------------------


class RedisServer:
    """A private `redis-server` on a free loopback port: no RDB/AOF, logs in its own temp dir.

    >>> server = RedisServer().start()
    >>> server.url(db=0)  # 'redis://127.0.0.1:<port>/0'
    >>> server.kill(); server.start()  # a crash and a restart on the same port
    >>> server.stop()  # kill, wait, remove the temp dir

    Also a context manager (`with RedisServer() as server:`).
    """

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        found = binary or shutil.which("redis-server")
        if not found:
            raise RuntimeError("redis-server is not on PATH; the tests need it for a private Redis")
        self.binary = found
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        assert self.dir is not None, "the server was never started"
        return self.dir / "redis.log"

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10) -> RedisServer:
        """Start (or restart, on the same port) and wait until it answers PING."""
        if self.running:
            return self
        if self.dir is None or not self.dir.is_dir():
            self.dir = Path(tempfile.mkdtemp(prefix="fleet-test-redis-"))
        attempts = 1 if self._fixed_port or self.proc is not None else 3
        for attempt in range(attempts):
            try:
                self._spawn_and_wait(timeout)
            except RuntimeError:
                if attempt + 1 == attempts:
                    raise
                self.port = free_port()  # lost a race for the port we picked: pick again
            else:
                _live.add(self)
                return self
        raise AssertionError("unreachable")

    def _spawn_and_wait(self, timeout: float) -> None:
        assert self.dir is not None
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with {self.proc.returncode}:\n"
                    f"{_tail(self.log_path)}"
                )
            if self._ping():
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer PING in {timeout}s:\n{_tail(self.log_path)}"
        )

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server and wait for it (an outage); the dir and logs stay for `start()`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> None:
        """Kill the server (SIGKILL + wait) and remove its temp dir. `start()` may still follow."""
        self.kill()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        _live.discard(self)

    close = stop

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


# --- PostgreSQL ---------------------------------------------------------------------------------


def postgres_bin_dir() -> Path:
    """Debian's `/usr/lib/postgresql/<version>/bin` with the highest version that has initdb."""
    found = []
    for initdb in Path("/usr/lib/postgresql").glob("*/bin/initdb"):
        version = initdb.parents[1].name
        if re.fullmatch(r"\d+(\.\d+)?", version):
            found.append((tuple(int(p) for p in version.split(".")), initdb.parent))
    if not found:
        raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
    return max(found)[1]


def _run_async(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from sync code, even inside a running event loop."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(_as_coroutine(factory)))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


async def _as_coroutine(factory: Callable[[], Awaitable[T]]) -> T:
    return await factory()


def quoted_name(name: str) -> str:
    """`name` as a PostgreSQL identifier."""
    return '"' + name.replace('"', '""') + '"'


class PostgresServer:
    """A private PostgreSQL cluster on a free loopback port, for tests that stop/start the DB.

    Trust auth, superuser `postgres`, fsync off, small shared_buffers; the data dir, the unix
    socket and the log live in one temp dir (owned by the `postgres` OS user when we are root).

    >>> server = PostgresServer().start()
    >>> url = server.create_database("t1")  # postgresql+asyncpg://postgres@127.0.0.1:<port>/t1
    >>> server.stop()  # immediate shutdown (a crash, as far as clients can tell)
    >>> server.start()  # same port, same data
    >>> server.close()  # stop and remove everything
    """

    def __init__(self, port: int | None = None, bin_dir: Path | None = None) -> None:
        self.bin_dir = bin_dir or postgres_bin_dir()
        self.port = port if port is not None else free_port()
        self.as_postgres_user = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="fleet-test-pg-"))
        self.data_dir = self.root / "data"
        self.log_path = self.root / "postgres.log"
        if self.as_postgres_user:
            import pwd

            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.root.chmod(0o700)
        self._initialized = False
        self.running = False
        _live.add(self)  # the temp dir exists from here on: `close()` removes it

    @property
    def admin_dsn(self) -> str:
        """asyncpg/libpq style DSN of the `postgres` database, as the superuser."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        """SQLAlchemy asyncpg URL of a database on this server."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def _cmd(self, binary: str, *args: str) -> list[str]:
        argv = [str(self.bin_dir / binary), *args]
        return ["runuser", "-u", "postgres", "--", *argv] if self.as_postgres_user else argv

    def _run(self, binary: str, *args: str, timeout: float = 60) -> None:
        """Run a server binary; its output goes to a file (pg_ctl's postmaster may inherit fds)."""
        out = self.root / f"{binary}.out"
        with open(out, "ab") as sink:
            result = subprocess.run(
                self._cmd(binary, *args),
                cwd=self.root,  # postgres may not be able to enter the caller's cwd (e.g. /root)
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        if result.returncode != 0:
            raise RuntimeError(
                f"{binary} {' '.join(args)} failed with {result.returncode}:\n{_tail(out)}\n"
                f"--- server log ({self.log_path}):\n{_tail(self.log_path)}"
            )

    def _initdb(self) -> None:
        self._run(
            "initdb",
            "-D", str(self.data_dir),
            "-U", "postgres",
            "-A", "trust",
            "-E", "UTF8",
            "--locale=C",
            "--no-sync",
        )  # fmt: skip
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            # fsync off is safe here: a stopped/killed server's writes still sit in the OS cache.
            # synchronous_commit stays on: off, an immediate stop loses just-committed data.
            "fsync": "off",
            "full_page_writes": "off",
            "shared_buffers": "16MB",
            "max_connections": "50",
            "logging_collector": "off",
        }
        conf = "".join(f"{key} = {value}\n" for key, value in settings.items())
        with open(self.data_dir / "postgresql.conf", "a") as f:  # runs as root: may write it
            f.write(f"\n# fleet test server\n{conf}")
        self._initialized = True

    def start(self, timeout: float = 30) -> PostgresServer:
        """Start (initdb on first use); on a restart, the same port and the same data."""
        if self.running:
            return self
        if not self._initialized:
            self._initdb()
        if _port_open(self.port):
            raise RuntimeError(f"port {self.port} is taken; cannot start the private PostgreSQL there")
        self._run(
            "pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-w", "-t", str(int(timeout)),
            "start",
        )  # fmt: skip
        self.running = True
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = subprocess.run(
                [str(self.bin_dir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
                check=False,
            )
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"PostgreSQL on port {self.port} not ready after {timeout}s:\n{_tail(self.log_path)}"
        )

    def stop(self, mode: str = "immediate", wait: bool = True) -> None:
        """Stop the server (`pg_ctl stop -m <mode>`: smart, fast or immediate); data is kept.
        Without `wait` a smart stop only begins: the server refuses new connections until its
        open sessions end, and a `stop()` that waits ends it."""
        if not self.running:
            return
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w" if wait else "-W", "stop")
        self.running = not wait

    def close(self) -> None:
        """Stop the server and remove its temp dir."""
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            _live.discard(self)

    def execute(self, *statements: str) -> None:
        """Run `statements` as the superuser on the `postgres` database, one by one (ALTER
        DATABASE, roles, pg_terminate_backend). Works in or out of a loop."""
        import asyncpg

        async def run() -> None:
            conn = await asyncpg.connect(self.admin_dsn)
            try:
                for statement in statements:
                    await conn.execute(statement)
            finally:
                await conn.close()

        _run_async(run)

    def create_database(self, name: str, owner: str | None = None) -> str:
        """CREATE DATABASE `name` (owned by the role `owner`, else the superuser); returns its
        SQLAlchemy asyncpg URL (as the superuser). Works in or out of a loop."""
        owned = "" if owner is None else f" OWNER {quoted_name(owner)}"
        self.execute(f"CREATE DATABASE {quoted_name(name)}{owned}")
        return self.url(name)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()
