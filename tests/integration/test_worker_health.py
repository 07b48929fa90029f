"""The worker's /health on a real socket: 200 while its event loop beats, 503 once the loop is
stuck, and probes that neither idle clients nor a taken port can break."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from fleet_worker.metrics_http import MAX_CONNECTIONS, Heartbeat, MetricsServer

BEAT_SECONDS = 0.05
STALE_SECONDS = 0.5


class BeatingLoop:
    """An event loop on its own thread running a heartbeat, as the worker's loop does."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.beat = asyncio.run_coroutine_threadsafe(heartbeat.beat_forever(BEAT_SECONDS), self.loop)

    def block(self, release: threading.Event) -> None:
        """Hold the loop in a blocking call until `release` is set: a stuck loop."""
        self.loop.call_soon_threadsafe(release.wait)

    def close(self) -> None:
        async def stop_beating() -> None:
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop_beating(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@pytest.fixture
def served() -> Iterator[tuple[str, BeatingLoop]]:
    heartbeat = Heartbeat(stale_after=STALE_SECONDS)
    registry = CollectorRegistry()
    Counter("fleet_probe_test", "a metric of this test", registry=registry).inc()
    beating = BeatingLoop(heartbeat)
    server = MetricsServer.start("127.0.0.1", 0, registry, heartbeat)
    assert server is not None
    yield f"http://127.0.0.1:{server.port}", beating
    server.stop()
    beating.close()


def eventually(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


def status(url: str) -> int:
    return httpx.get(url, timeout=5).status_code


def test_health_follows_the_event_loop(served: tuple[str, BeatingLoop]) -> None:
    url, beating = served
    assert status(f"{url}/health") == 200
    release = threading.Event()
    beating.block(release)
    try:
        eventually(lambda: status(f"{url}/health") == 503)
        body = httpx.get(f"{url}/health", timeout=5).text
        assert "event loop stuck" in body
        assert status(f"{url}/metrics") == 200  # metrics still answer: they do not need the loop
    finally:
        release.set()
    eventually(lambda: status(f"{url}/health") == 200)


def test_metrics_and_unknown_paths(served: tuple[str, BeatingLoop]) -> None:
    url, _ = served
    response = httpx.get(f"{url}/metrics", timeout=5)
    assert response.status_code == 200 and "fleet_probe_test_total 1.0" in response.text
    assert status(f"{url}/") == 404
    assert status(f"{url}/metrics/extra") == 404
    assert httpx.post(f"{url}/health", timeout=5).status_code == 405


def test_idle_clients_do_not_hold_the_probes_up(served: tuple[str, BeatingLoop]) -> None:
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS - 1)]
    try:
        started = time.monotonic()
        assert status(f"{url}/health") == 200  # a free slot: answered at once
        assert time.monotonic() - started < 2
        idle.append(socket.create_connection(("127.0.0.1", port)))  # every slot taken now
        eventually(lambda: refused(url))  # one more is closed at once, never queued
    finally:
        for connection in idle:
            connection.close()
    eventually(lambda: status(f"{url}/health") == 200)


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.TransportError as exc:
        return not isinstance(exc, httpx.TimeoutException)
    return False


def test_a_port_in_use_is_reported_not_fatal() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert MetricsServer.start("127.0.0.1", port, CollectorRegistry(), Heartbeat()) is None
