"""The worker's metrics port: GET /metrics (Prometheus text) and GET /health (liveness from the
event loop's heartbeat), served from threads so a stuck event loop cannot silence them.

- `Heartbeat`: an asyncio task on the worker's loop touches it every HEARTBEAT_INTERVAL_SECONDS;
  /health is 503 once the last touch is older than STALE_AFTER_SECONDS (the loop is stuck).
- `MetricsServer`: wsgiref on a thread per connection, at most MAX_CONNECTIONS at once (more are
  closed at once), each given CONNECTION_TIMEOUT_SECONDS: an idle or slow client cannot hold the
  probes up. A port in use is logged and the worker carries on without the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import msgspec
import structlog
from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

from fleet_shared.config import Settings
from fleet_shared.errors import ConfigError
from fleet_shared.metrics import queue_depth_in

log = structlog.get_logger(__name__)
HEARTBEAT_INTERVAL_SECONDS = 1.0
STALE_AFTER_SECONDS = 3 * HEARTBEAT_INTERVAL_SECONDS  # a few missed beats: the loop is stuck
MAX_CONNECTIONS = 8
CONNECTION_TIMEOUT_SECONDS = 5.0
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class Heartbeat:
    """When the worker's event loop last ran a beat (time.monotonic(), safe to read from threads)."""

    def __init__(self, stale_after: float = STALE_AFTER_SECONDS) -> None:
        self.stale_after = stale_after
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()

    def age(self) -> float:
        return time.monotonic() - self.last

    def fresh(self) -> bool:
        return self.age() <= self.stale_after

    async def beat_forever(self, interval: float = HEARTBEAT_INTERVAL_SECONDS) -> None:
        """Touch every `interval` for as long as the loop runs it (cancel to stop)."""
        while True:
            self.touch()
            await asyncio.sleep(interval)

    def start(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[None]:
        self.touch()
        return loop.create_task(self.beat_forever(), name="fleet-heartbeat")


def metrics_app(registry: CollectorRegistry, heartbeat: Heartbeat) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: /metrics from `registry`, /health from `heartbeat`, 404 for anything else."""
    prometheus = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return answer(start_response, "405 Method Not Allowed", b"method not allowed\n")
        if path == "/metrics":
            result: Iterable[bytes] = prometheus(environ, start_response)
            return result
        if path == "/health":
            age = heartbeat.age()
            if heartbeat.fresh():
                return answer(start_response, "200 OK", b"ok\n")
            body = f"event loop stuck: last heartbeat {age:.1f}s ago\n".encode()
            return answer(start_response, "503 Service Unavailable", body)
        return answer(start_response, "404 Not Found", b"not found\n")

    return app


def answer(start_response: StartResponse, status: str, body: bytes) -> list[bytes]:
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
    )
    return [body]


class QuietHandler(WSGIRequestHandler):
    """No access log lines on stderr; a socket timeout for every read and write."""

    timeout = CONNECTION_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: Any) -> None:
        return None


class BoundedThreadingServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `max_connections` at once: one more is closed unanswered."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True  # a restarted worker gets its port back at once

    def __init__(self, *args: Any, max_connections: int = MAX_CONNECTIONS, **kwargs: Any) -> None:
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away or timed out; not worth a traceback on stderr.
        log.debug("metrics.connection_failed", client=str(client_address[0]))


class MetricsServer:
    """The server on its own daemon thread; `start` returns None when it could not bind."""

    def __init__(self, server: BoundedThreadingServer) -> None:
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, name="fleet-metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @classmethod
    def start(
        cls, host: str, port: int, registry: CollectorRegistry, heartbeat: Heartbeat
    ) -> MetricsServer | None:
        try:
            server = make_server(
                host,
                port,
                metrics_app(registry, heartbeat),
                server_class=server_class_for(host),
                handler_class=QuietHandler,
            )
        except OSError as exc:  # in use, or no such address: the worker itself still runs
            log.warning("metrics.unavailable", host=host, port=port, error=str(exc))
            return None
        running = cls(server)
        running.thread.start()
        log.info("metrics.serving", host=host, port=running.port)
        return running

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=CONNECTION_TIMEOUT_SECONDS)


def server_class_for(host: str) -> type[BoundedThreadingServer]:
    """An IPv6 host needs an IPv6 socket (wsgiref's server is IPv4 unless told)."""
    if ":" not in host:
        return BoundedThreadingServer

    class V6Server(BoundedThreadingServer):
        address_family = socket.AF_INET6

    return V6Server


def with_metrics_address(settings: Settings, host: str | None, port: int | None) -> Settings:
    """The settings with `fleet worker --metrics-host/--metrics-port` applied over the config."""
    worker = settings.profile.worker
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError("--metrics-port must be between 0 and 65535")
    worker = msgspec.structs.replace(
        worker,
        metrics_host=worker.metrics_host if host is None else host,
        metrics_port=worker.metrics_port if port is None else port,
    )
    profile = msgspec.structs.replace(settings.profile, worker=worker)
    return msgspec.structs.replace(settings, profile=profile)


@contextlib.contextmanager
def serving_metrics(settings: Settings, loop: asyncio.AbstractEventLoop) -> Iterator[MetricsServer | None]:
    """The heartbeat (on `loop`, which the caller then runs) and the metrics port, with
    fleet_queue_depth read from Redis on each scrape, for as long as the block runs."""
    worker = settings.profile.worker
    if worker.metrics_port == 0:
        yield None
        return
    heartbeat = Heartbeat()
    beat = heartbeat.start(loop)
    try:
        with queue_depth_in(REGISTRY, worker.queue_name, settings.redis_url):
            server = MetricsServer.start(worker.metrics_host, worker.metrics_port, REGISTRY, heartbeat)
            try:
                yield server
            finally:
                if server is not None:
                    server.stop()
    finally:
        beat.cancel()
        if not loop.is_running() and not loop.is_closed():
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(beat)
