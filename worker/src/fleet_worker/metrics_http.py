"""The worker's metrics port: GET /metrics (Prometheus text) and GET /health (liveness from the
event loop's heartbeat), served from threads so a stuck event loop cannot silence them.

- `Heartbeat`: an asyncio task on the worker's loop touches it every HEARTBEAT_INTERVAL_SECONDS;
  /health is 503 once the last touch is older than STALE_AFTER_SECONDS (the loop is stuck).
- `MetricsServer`: wsgiref on a thread per connection, at most MAX_CONNECTIONS at once, each cut
  off CONNECTION_DEADLINE_SECONDS after it was accepted (a total, not per read: a client sending a
  byte now and then is cut off too). When those are all taken, HEALTH_LANE_SLOTS more connections
  are accepted that answer /health only, within HEALTH_LANE_DEADLINE_SECONDS: slow clients and
  slow scrapes cannot fail the liveness probe. Beyond that a connection is closed at once.
  A port in use is logged and the worker carries on without the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import msgspec
import structlog
from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

from fleet_shared.config import Settings
from fleet_shared.errors import ConfigError
from fleet_shared.metrics import queue_counts_in

log = structlog.get_logger(__name__)
HEARTBEAT_INTERVAL_SECONDS = 1.0
STALE_AFTER_SECONDS = 3 * HEARTBEAT_INTERVAL_SECONDS  # a few missed beats: the loop is stuck
MAX_CONNECTIONS = 8
CONNECTION_DEADLINE_SECONDS = 5.0  # a scrape waits at most ~2 s for Redis (connect + the script)
HEALTH_LANE_SLOTS = 2
HEALTH_LANE_DEADLINE_SECONDS = 1.0  # a prober sends its request at once; a slow client is cut off
HEALTH_ONLY = "fleet.health_only"  # environ key: this connection is in the /health lane
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
        if environ.get(HEALTH_ONLY) and path != "/health":
            return answer(start_response, "503 Service Unavailable", b"busy: only /health is served now\n")
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
    """No access log lines on stderr; the connection is shut down `deadline` seconds after it
    began, whatever the client is doing (the socket timeout alone bounds each read, not the sum)."""

    deadline = CONNECTION_DEADLINE_SECONDS
    timeout = CONNECTION_DEADLINE_SECONDS
    health_only = False

    def setup(self) -> None:
        super().setup()
        self.cutoff = threading.Timer(self.deadline, self.cut_off)
        self.cutoff.daemon = True
        self.cutoff.start()

    def cut_off(self) -> None:
        # Wakes the handler's blocked read (it sees the end of the stream) or write (it fails).
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self.cutoff.cancel()
        super().finish()

    def get_environ(self) -> dict[str, Any]:
        environ: dict[str, Any] = super().get_environ()
        environ[HEALTH_ONLY] = self.health_only
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        return None


class HealthLaneHandler(QuietHandler):
    """A connection accepted while every ordinary slot was taken: /health only, and quickly."""

    deadline = HEALTH_LANE_DEADLINE_SECONDS
    timeout = HEALTH_LANE_DEADLINE_SECONDS
    health_only = True


class BoundedThreadingServer(WSGIServer):
    """A thread per connection: at most `max_connections` ordinary ones, then `health_slots` in
    the /health lane; one more is closed unanswered."""

    allow_reuse_address = True  # a restarted worker gets its port back at once

    def __init__(
        self,
        *args: Any,
        max_connections: int = MAX_CONNECTIONS,
        health_slots: int = HEALTH_LANE_SLOTS,
        **kwargs: Any,
    ) -> None:
        self.slots = threading.BoundedSemaphore(max_connections)
        self.health_slots = threading.BoundedSemaphore(health_slots)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        handler: type[QuietHandler] = self.RequestHandlerClass  # type: ignore[assignment]
        if self.slots.acquire(blocking=False):
            release = self.slots.release
        elif self.health_slots.acquire(blocking=False):
            release, handler = self.health_slots.release, HealthLaneHandler
        else:
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self.serve_connection, args=(request, client_address, handler, release), daemon=True
        )
        try:
            thread.start()
        except BaseException:
            release()
            self.shutdown_request(request)
            raise

    def serve_connection(
        self, request: Any, client_address: Any, handler: type[QuietHandler], release: Callable[[], None]
    ) -> None:
        try:
            handler(request, client_address, self)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            release()

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
        self.thread.join(timeout=CONNECTION_DEADLINE_SECONDS)


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
    the queue's gauges read from Redis (at most every QUEUE_COUNTS_MAX_AGE_SECONDS), for as long
    as the block runs."""
    worker = settings.profile.worker
    if worker.metrics_port == 0:
        yield None
        return
    heartbeat = Heartbeat()
    beat = heartbeat.start(loop)
    try:
        with queue_counts_in(REGISTRY, worker.queue_name, settings.redis_url):
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
