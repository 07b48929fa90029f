"""GET /metrics: Prometheus text with requests labelled by route template (bounded cardinality),
the gauge of open Turn streams, the arq queue's Turns waiting and in progress (one evaluation
shared by concurrent scrapes, left out when Redis hangs), cancellations by stage and the
sweeper's actions."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis
from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix
from litestar.testing import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import ConnectionPool

from fleet_gateway.app import create_app
from fleet_gateway.streaming import RunView, StreamDeps, stream_run
from fleet_shared.config import Settings, load_settings
from fleet_shared.db import claims, queries
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.jobs import RUN_TURN, QueueCounts, deserialize_job, serialize_job
from fleet_shared.metrics import (
    QUEUE_COUNTS_MAX_AGE_SECONDS,
    QUEUE_DEPTH_TIMEOUT_SECONDS,
    queue_depth_client,
    read_queue_counts,
    read_queue_counts_sync,
)
from fleet_shared.tenancy import OPERATOR
from tests.conftest import migrate
from tests.integration.harness import Harness
from tests.support.api import ApiClient

REPO = Path(__file__).resolve().parents[2]
REQUESTS = "fleet_gateway_http_requests"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-")


def gateway_settings(sqlite_url: str, redis_url: str) -> Settings:
    """The shipped config on the test databases, with a queue of this test's own."""
    settings = load_settings(
        {
            "FLEET_CONFIG": str(REPO / "config" / "fleet.toml"),
            "FLEET_DATABASE_URL": sqlite_url,
            "FLEET_REDIS_URL": redis_url,
        }
    )
    worker = msgspec.structs.replace(settings.profile.worker, queue_name=f"fleet:test:{uuid.uuid4().hex}")
    return msgspec.structs.replace(settings, profile=msgspec.structs.replace(settings.profile, worker=worker))


@pytest.fixture
async def settings(tmp_path: Path, redis_url: str) -> Settings:
    """A database of this test's own: the gateway's sweeper requeues the queued Runs it finds
    (onto this test's queue), and the session's shared database holds other tests' Runs."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'fleet.db'}"
    await asyncio.to_thread(migrate, url)
    return gateway_settings(url, redis_url)


@pytest.fixture
def client(settings: Settings) -> Iterator[ApiClient]:
    with TestClient(create_app(settings)) as client:
        yield client


def samples(client: ApiClient, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def count(found: dict[tuple[tuple[str, str], ...], float], **labels: str) -> float:
    return found.get(tuple(sorted(labels.items())), 0.0)


def test_requests_are_labelled_by_route_template(client: ApiClient) -> None:
    first = client.post("/api/sessions", json={}).json()["id"]
    second = client.post("/api/sessions", json={}).json()["id"]
    before = samples(client, f"{REQUESTS}_total")
    template = "/api/sessions/{session_id}"
    assert client.get(f"/api/sessions/{first}").status_code == 200
    assert client.get(f"/api/sessions/{second}").status_code == 200
    assert client.get("/api/sessions/00000000-0000-0000-0000-000000000000").status_code == 404
    assert client.get(f"/nowhere/{first}").status_code == 404
    assert client.request("BREW", "/api/sessions").status_code in (400, 405)
    after = samples(client, f"{REQUESTS}_total")

    def delta(**labels: str) -> float:
        return count(after, **labels) - count(before, **labels)

    assert delta(method="GET", route=template, status="200") == 2  # two ids, one label value
    assert delta(method="GET", route=template, status="404") == 1
    assert delta(method="GET", route="unmatched", status="404") == 1
    assert sum(v for k, v in after.items() if ("method", "other") in k) >= 1
    routes = {dict(labels)["route"] for labels in after}
    assert all(route == "unmatched" or not UUID.search(route) for route in routes), routes
    assert "process_cpu_seconds_total" in client.get("/metrics").text  # the default registry too


async def test_the_active_streams_gauge_counts_a_stream_until_it_is_closed(harness_factory: Any) -> None:
    harness: Harness = harness_factory({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='ok')"})
    run_id = await harness.submit()
    await harness.work()
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
        view = RunView.of(run)

    def gauge() -> float:
        value = REGISTRY.get_sample_value("fleet_gateway_active_streams")
        assert value is not None
        return value

    base = gauge()
    deps = StreamDeps(redis=harness.redis, fanout=None, db_sessions=harness.db_sessions, heartbeat_seconds=10)  # type: ignore[arg-type]
    cut_off = cast(AsyncGenerator[bytes, None], stream_run(deps, view, delivery="resume", from_db=True))
    await anext(cut_off)  # the start frame: the stream is open
    assert gauge() == base + 1
    await cut_off.aclose()  # the client went away
    assert gauge() == base
    whole = [frame async for frame in stream_run(deps, view, delivery="resume", from_db=True)]
    assert whole[-1].startswith(b"data: [DONE]") and gauge() == base


def queue_of(settings: Settings) -> ArqRedis:
    return ArqRedis(
        ConnectionPool.from_url(settings.redis_url),
        job_serializer=serialize_job,
        job_deserializer=deserialize_job,
        default_queue_name=settings.profile.worker.queue_name,
    )


def queue_counts(client: ApiClient, queue: str) -> QueueCounts:
    waiting = count(samples(client, "fleet_queue_depth"), queue=queue)
    return QueueCounts(int(waiting), int(count(samples(client, "fleet_queue_in_progress"), queue=queue)))


def counts_become(client: ApiClient, queue: str, expected: QueueCounts) -> None:
    """Scrape until the counts are `expected`: a scrape may see a read up to the cache's age."""
    deadline = time.monotonic() + QUEUE_COUNTS_MAX_AGE_SECONDS + 5
    while (seen := queue_counts(client, queue)) != expected:
        assert time.monotonic() < deadline, f"{seen} never became {expected}"
        time.sleep(0.1)


async def test_the_queue_depth_is_the_number_of_waiting_jobs(
    client: ApiClient,
    settings: Settings,
) -> None:
    queue = settings.profile.worker.queue_name
    assert queue_counts(client, queue) == QueueCounts(waiting=0, in_progress=0)
    arq = queue_of(settings)
    try:
        for n in range(3):
            assert await arq.enqueue_job(RUN_TURN, f"run-{n}", _job_id=f"{queue}-{n}") is not None
        counts_become(client, queue, QueueCounts(waiting=3, in_progress=0))
        # A job a worker has started (arq's in-progress key) is in progress, and one the gateway
        # cancelled while it was queued (arq's abort set) neither waits nor runs.
        await arq.set(in_progress_key_prefix + f"{queue}-0", b"1", ex=60)
        await arq.zadd("arq:abort", {f"{queue}-1": time.time() * 1000})
        counts_become(client, queue, QueueCounts(waiting=1, in_progress=1))
        await arq.delete(queue, in_progress_key_prefix + f"{queue}-0")
        await arq.zrem("arq:abort", f"{queue}-1")
        counts_become(client, queue, QueueCounts(waiting=0, in_progress=0))
    finally:
        await arq.aclose()


async def script_runs(redis_url: str) -> int:
    """EVAL and EVALSHA calls the test Redis has served so far (its INFO commandstats)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("eval", "evalsha"))


async def test_concurrent_scrapes_share_one_evaluation(settings: Settings, redis_url: str) -> None:
    scrapes, jobs = 8, 50_000  # a long queue: the script runs for tens of ms, the scrapes overlap
    queue = settings.profile.worker.queue_name
    redis = aioredis.Redis.from_url(redis_url)
    await redis.zadd(queue, {f"job-{n}": n for n in range(jobs)})
    try:
        app = create_app(settings)
        # The app on this test's own loop (TestClient's transports serve one request at a time).
        transport = httpx.ASGITransport(app=app)
        async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            before = await script_runs(redis_url)
            responses = await asyncio.gather(*(client.get("/metrics") for _ in range(scrapes)))
            assert all(f'fleet_queue_depth{{queue="{queue}"}} {jobs}.0' in r.text for r in responses)
            assert await script_runs(redis_url) - before == 1
            assert (await client.get("/metrics")).status_code == 200  # still fresh: no new evaluation
            assert await script_runs(redis_url) - before == 1
    finally:
        await redis.delete(queue)
        await redis.aclose()


@pytest.fixture
def hung_redis_url() -> Iterator[str]:
    """A Redis that accepts connections and never answers (the kernel completes the handshake)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"


async def test_a_hung_redis_leaves_the_depth_out_quickly(hung_redis_url: str) -> None:
    bound = QUEUE_DEPTH_TIMEOUT_SECONDS * 3  # connect + command, and some slack
    client = aioredis.Redis.from_url(hung_redis_url)
    try:
        started = time.monotonic()
        assert await read_queue_counts(client, "fleet:queue") is None
        assert time.monotonic() - started < bound
    finally:
        await client.aclose()
    blocking = queue_depth_client(hung_redis_url)
    started = time.monotonic()
    assert read_queue_counts_sync(blocking, "fleet:queue") is None
    assert time.monotonic() - started < bound
    blocking.close()


async def test_a_cancelled_queued_run_is_counted_by_stage(
    client: ApiClient,
    settings: Settings,
) -> None:
    engine = create_engine(settings.database_url)
    try:
        async with session_factory(engine)() as db:
            session = await queries.create_session(db, "t", OPERATOR)
            claimed = await claims.claim_turn(
                db,
                caller=OPERATOR,
                session_id=session.id,
                idempotency_key="k",
                fingerprint="f",
                text="hi",
                model=settings.root_lm.name,
            )
        assert isinstance(claimed, claims.Claimed)
    finally:
        await engine.dispose()
    before = samples(client, "fleet_cancels_total")
    response = client.put(f"/api/runs/{claimed.run.id}/cancellation")
    assert response.status_code == 200 and response.json()["state"] == "requested", response.text
    assert client.put(f"/api/runs/{claimed.run.id}/cancellation").json()["state"] == "already_terminal"
    after = samples(client, "fleet_cancels_total")
    assert count(after, stage="queued") - count(before, stage="queued") == 1
    assert count(after, stage="running") == count(before, stage="running")


async def test_the_sweeper_counts_what_it_does(harness_factory: Any) -> None:
    harness: Harness = harness_factory({"lm": "root", "reasoning": "r", "code": "SUBMIT(answer='ok')"})
    run_id = await harness.submit(enqueue=False)  # its job was lost before any worker saw it
    async with harness.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        assert run is not None
    before = REGISTRY.get_sample_value("fleet_reaper_actions_total", {"action": "requeued"}) or 0
    sweeper = harness.sweeper()
    assert await sweeper.requeue(run, datetime.now(UTC)) == 1  # as a sweep does once the grace passed
    after = REGISTRY.get_sample_value("fleet_reaper_actions_total", {"action": "requeued"})
    assert after == before + 1
