"""The metrics ports of real `fleet` processes: a worker waiting for a dead Redis is live on its
/health, and a gateway of two Granian processes sums their metrics, reports the queue's real
depth, survives a dead Redis on /metrics, and cleans its multiprocess directory away."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet_shared.metrics import QUEUE_COUNTS_MAX_AGE_SECONDS
from tests.e2e.conftest import REPO, fleet, stop
from tests.support.servers import RedisServer, free_port

pytestmark = pytest.mark.e2e
QUEUE = "fleet:queue"


def eventually(check: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.1)


def answers(url: str, status: int = 200) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == status
    except httpx.HTTPError:
        return False


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def fleet_env(redis_url: str, database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "PROMETHEUS_"))}
    return {
        **env,
        "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
        "FLEET_PROFILE": "offline",
        "FLEET_REDIS_URL": redis_url,
        "FLEET_DATABASE_URL": database_url,
        **extra,
    }


def start(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        fleet(*argv),
        env=env,
        cwd=cwd,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_a_worker_waiting_for_redis_is_live(traversable_dir: Path, sqlite_url: str) -> None:
    port = free_port()
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    log = traversable_dir / "worker.log"
    argv = ["worker", "--metrics-host", "127.0.0.1", "--metrics-port", str(port)]
    worker = start(argv, fleet_env(dead_redis, sqlite_url), traversable_dir, log)
    url = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: answers(f"{url}/health") or worker.poll() is not None)
        assert worker.poll() is None, log.read_text()[-3000:]
        eventually(lambda: "redis connection error" in log.read_text())  # arq retries: waiting, not stuck
        assert answers(f"{url}/health")
        found = samples(url)
        assert not any(name == "fleet_queue_depth" for name, _ in found)  # left out, not stale
        assert ("process_cpu_seconds_total", ()) in found
        assert answers(f"{url}/nowhere", 404)
    finally:
        stop([worker])
    assert worker.returncode == 0, log.read_text()[-3000:]


def test_a_gateway_of_two_processes(traversable_dir: Path, sqlite_url: str) -> None:
    redis = RedisServer().start()
    tmp = traversable_dir / "tmp"
    tmp.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = fleet_env(redis.url(db=0), sqlite_url, TMPDIR=str(tmp))
    log = traversable_dir / "gateway.log"
    gateway = start(["gateway", "--port", str(port), "--workers", "2"], env, traversable_dir, log)
    try:
        eventually(lambda: answers(f"{url}/health") or gateway.poll() is not None)
        assert gateway.poll() is None, log.read_text()[-3000:]
        check_the_processes_are_summed(url, tmp)
        check_the_queue_depth(url)
        redis.kill()  # Redis dies: /metrics still answers, without the depth (once its cache aged)
        started = time.monotonic()
        found = samples(url)
        assert time.monotonic() - started < 5
        queue_gauges = {"fleet_queue_depth", "fleet_queue_in_progress"}
        # Each of the two processes keeps its own answer until it is QUEUE_COUNTS_MAX_AGE_SECONDS
        # old, and a scrape reaches either: only past that age must every scrape drop both.
        eventually(lambda: time.monotonic() - started > QUEUE_COUNTS_MAX_AGE_SECONDS + 0.5, timeout=10)
        for _ in range(6):
            found = samples(url)
            assert not queue_gauges & {name for name, _ in found}
            assert ("fleet_gateway_active_streams", ()) in found
    finally:
        os.killpg(gateway.pid, signal.SIGTERM)
        stop([gateway])
        redis.stop()
    assert list(tmp.iterdir()) == [], "the multiprocess directory was left behind"


def check_the_processes_are_summed(url: str, tmp: Path) -> None:
    (directory,) = tmp.glob("fleet-prometheus-*")
    eventually(lambda: len({f.stem.rsplit("_", 1)[1] for f in directory.glob("gauge_livesum_*.db")}) == 2)
    # A route nothing else here asks for (a late /health of the start-up poll would also count).
    key = (
        "fleet_gateway_http_requests_total",
        (("method", "GET"), ("route", "/api/sessions"), ("status", "200")),
    )
    assert key not in samples(url)
    requests = 30
    for _ in range(requests):  # a connection each: the kernel spreads them over both processes
        assert httpx.get(f"{url}/api/sessions", timeout=30).status_code == 200
    for _ in range(6):  # whichever process answers the scrape, it reports both processes' counts
        assert samples(url).get(key) == requests


def check_the_queue_depth(url: str) -> None:
    depth = ("fleet_queue_depth", (("queue", QUEUE),))
    assert samples(url).get(depth) == 0
    with httpx.Client(base_url=url, timeout=10) as client:
        for n in range(3):  # real Turns, queued: no worker runs in this stack
            session_id = client.post("/api/sessions", json={"title": "m"}).json()["id"]
            turn = client.build_request(
                "POST",
                f"/api/sessions/{session_id}/turns",
                json={"text": "hello"},
                headers={"Idempotency-Key": f"k{n}"},
            )
            response = client.send(turn, stream=True)
            assert response.status_code == 200  # queued, streaming: we leave before it ends
            response.close()
    in_progress = ("fleet_queue_in_progress", (("queue", QUEUE),))

    def both_processes_see_them() -> bool:  # each process reads at most every 2 s
        found = [samples(url) for _ in range(4)]
        return all(f.get(depth) == 3 and f.get(in_progress) == 0 for f in found)  # no worker here

    eventually(both_processes_see_them, timeout=QUEUE_COUNTS_MAX_AGE_SECONDS + 10)
