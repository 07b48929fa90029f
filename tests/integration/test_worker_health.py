"""The worker's /health on a real socket: 200 while its event loop beats, 503 once the loop is
stuck, and probes that neither idle clients, slow clients (slowloris) nor a taken port can
break."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from fleet_worker.metrics_http import (
    HEALTH_LANE_DEADLINE_SECONDS,
    HEALTH_LANE_SLOTS,
    MAX_CONNECTIONS,
    Heartbeat,
    MetricsServer,
    QuietHandler,
)

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
        idle += [socket.create_connection(("127.0.0.1", port)) for _ in range(1 + HEALTH_LANE_SLOTS)]
        eventually(lambda: refused(url))  # every slot and the /health lane taken: closed at once
        # The /health lane cuts its idle clients off quickly: the probe answers again while the
        # ordinary slots are still held.
        eventually(lambda: answers(f"{url}/health"), timeout=HEALTH_LANE_DEADLINE_SECONDS + 3)
    finally:
        for connection in idle:
            connection.close()
    eventually(lambda: status(f"{url}/health") == 200)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class SlowClient:
    """A slowloris: a request line, then a header byte every `every` seconds, never finishing;
    `cut_off` is set once the server closed the connection."""

    def __init__(self, port: int, every: float = 0.2) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        self.every = every
        self.cut_off = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.trickle, daemon=True)
        self.thread.start()

    def trickle(self) -> None:
        while not self.stop.is_set():
            readable, _, _ = select.select([self.sock], [], [], self.every)
            try:
                if readable and not self.sock.recv(1024):
                    break  # the server closed it
                self.sock.send(b"x")
            except OSError:
                break
        self.cut_off.set()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def test_slow_clients_cannot_starve_health(served: tuple[str, BeatingLoop]) -> None:
    url, _ = served
    slow = [SlowClient(int(url.rsplit(":", 1)[1])) for _ in range(MAX_CONNECTIONS)]
    try:
        for _ in range(3):  # every ordinary slot is held by a slow client, and stays held
            started = time.monotonic()
            assert status(f"{url}/health") == 200  # the /health lane
            assert time.monotonic() - started < 2
        assert status(f"{url}/metrics") == 503  # the lane serves /health only
        assert not any(client.cut_off.is_set() for client in slow)
    finally:
        for client in slow:
            client.close()


def test_a_trickling_client_is_cut_off_at_the_deadline(
    served: tuple[str, BeatingLoop], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = served
    deadline = 1.5
    monkeypatch.setattr(QuietHandler, "deadline", deadline)  # read as each connection starts
    slow = [SlowClient(int(url.rsplit(":", 1)[1])) for _ in range(MAX_CONNECTIONS)]
    try:
        started = time.monotonic()
        for client in slow:  # each read is quick, but the total is bounded
            assert client.cut_off.wait(timeout=deadline + 5)
        assert time.monotonic() - started >= deadline - 0.5
        assert status(f"{url}/metrics") == 200  # the slots are free again
    finally:
        for client in slow:
            client.close()


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
