"""Job notices: a worker whose poll of arq's queue is far away still takes an announced Turn at
once, two workers hearing the same notice run it once, and an unannounced job still waits for
the poll (the notice is a fast path, never the only one). Real arq workers, real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from arq import Worker
from litestar.testing import TestClient

from fleet_gateway.app import create_app
from fleet_shared.db import queries
from fleet_shared.event_log import jobs_channel
from fleet_shared.events import RunCompleted
from fleet_shared.queue import ARQ_IN_PROGRESS_PREFIX, RUN_TURN, enqueue_run
from fleet_worker.app import build_worker
from tests.conftest import migrate
from tests.integration.harness import Harness

SUBMIT = {"lm": "root", "reasoning": "Done.", "code": "SUBMIT(answer='noticed')"}
SLOW_POLL_SECONDS = 5.0  # the longest poll_delay_seconds allows: arq's own poll stays out of the way
TAKEN_WITHIN_SECONDS = 10.0  # a hang guard, far above the notice's real latency


@pytest.fixture
async def database_url(tmp_path: Path) -> str:
    """A database of each test's own (for the harness): the workers' sweepers requeue, and
    announce, the queued Runs they find, and the shared test databases hold other tests' Runs."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'fleet.db'}"
    await asyncio.to_thread(migrate, url)
    return url


def slow_polling(harness: Harness, concurrency: int | None = None) -> Harness:
    profile = harness.settings.profile
    worker = msgspec.structs.replace(
        profile.worker,
        poll_delay_seconds=SLOW_POLL_SECONDS,
        concurrency=concurrency or profile.worker.concurrency,
    )
    settings = msgspec.structs.replace(
        harness.settings, profile=msgspec.structs.replace(profile, worker=worker)
    )
    return Harness(settings, harness.sessions, harness.redis)


@contextlib.asynccontextmanager
async def running(harness: Harness, count: int = 1) -> AsyncIterator[list[Worker]]:
    """`count` long-running workers (not burst), up once their first poll is behind them."""
    workers = [build_worker(harness.settings) for _ in range(count)]
    tasks = [asyncio.create_task(worker.main()) for worker in workers]
    try:
        deadline = time.monotonic() + TAKEN_WITHIN_SECONDS
        while not all("deps" in worker.ctx for worker in workers):
            assert time.monotonic() < deadline, "the workers never started"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # their first poll (an empty queue) and subscriptions are done
        yield workers
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            await worker.close()


async def status_of(harness: Harness, run_id: str) -> str:
    async with harness.sessions() as db:
        run = await queries.get_run(db, run_id)
    assert run is not None
    return run.status


async def until(check: Callable[[], Any], within: float) -> float:
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < within, "timed out"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def enqueue(harness: Harness, run_id: str, *, announce: bool) -> None:
    """Announced: fleet's own enqueue (the job and its notice in one script). Not announced:
    arq's enqueue_job, which tells no one."""
    if announce:
        assert await enqueue_run(harness.redis, harness.settings.profile.worker.queue_name, run_id)
        return
    arq = harness.arq()
    try:
        assert await arq.enqueue_job(RUN_TURN, run_id, _job_id=run_id) is not None
    finally:
        await arq.aclose()


async def test_an_announced_turn_is_taken_before_the_next_poll(harness_factory: Any) -> None:
    harness = slow_polling(harness_factory(SUBMIT))
    async with running(harness):
        run_id = await harness.submit(enqueue=False)
        await enqueue(harness, run_id, announce=True)
        taken = await until(
            lambda: _not_queued(harness, run_id), within=min(TAKEN_WITHIN_SECONDS, SLOW_POLL_SECONDS / 2)
        )
        await until(lambda: _is(harness, run_id, "completed"), within=TAKEN_WITHIN_SECONDS * 3)
    assert taken < SLOW_POLL_SECONDS / 2


async def test_two_workers_hearing_one_notice_run_the_turn_once(harness_factory: Any) -> None:
    harness = slow_polling(harness_factory(SUBMIT))
    async with running(harness, count=2) as workers:
        run_id = await harness.submit(enqueue=False)
        await enqueue(harness, run_id, announce=True)
        await until(lambda: _is(harness, run_id, "completed"), within=TAKEN_WITHIN_SECONDS * 3)
        await asyncio.sleep(0.5)  # a second start, if any, would have begun by now
        started = sum(worker.jobs_complete + worker.jobs_failed + worker.jobs_retried for worker in workers)
    assert started == 1
    events = await harness.events(run_id)
    assert sum(1 for event in events if isinstance(event, RunCompleted)) == 1
    async with harness.sessions() as db:
        run = await queries.get_run(db, run_id)
    assert run is not None and run.attempt == 1  # claimed once


async def test_a_turn_announced_while_every_slot_is_busy_starts_when_one_frees(
    harness_factory: Any,
) -> None:
    """Its notice finds the worker full; the slot the running Turn gives back takes it."""
    harness = slow_polling(harness_factory(SUBMIT, SUBMIT), concurrency=1)
    async with running(harness):
        first = await harness.submit(enqueue=False)
        await enqueue(harness, first, announce=True)
        await until(lambda: _not_queued(harness, first), within=SLOW_POLL_SECONDS / 2)
        second = await harness.submit(enqueue=False)
        await enqueue(harness, second, announce=True)  # heard while the only slot is busy
        await until(lambda: _is(harness, first, "completed"), within=TAKEN_WITHIN_SECONDS * 3)
        waited = await until(lambda: _not_queued(harness, second), within=SLOW_POLL_SECONDS / 2)
        await until(lambda: _is(harness, second, "completed"), within=TAKEN_WITHIN_SECONDS * 3)
    assert waited < SLOW_POLL_SECONDS / 2


async def test_an_unannounced_job_waits_for_the_poll(harness_factory: Any) -> None:
    """The notice is what makes the difference: without it the job sits until arq polls."""
    harness = slow_polling(harness_factory(SUBMIT))
    async with running(harness):
        run_id = await harness.submit(enqueue=False)
        await enqueue(harness, run_id, announce=False)
        with pytest.raises(AssertionError, match="timed out"):
            await until(lambda: _not_queued(harness, run_id), within=2.0)


async def _not_queued(harness: Harness, run_id: str) -> bool:
    return await status_of(harness, run_id) != "queued"


async def _is(harness: Harness, run_id: str, status: str) -> bool:
    return await status_of(harness, run_id) == status


async def test_a_turn_posted_to_the_gateway_is_taken_at_once(harness_factory: Any) -> None:
    """The gateway announces each Turn it queues: through the real app, the Turn streams to its
    end long before the worker's own poll would have found it."""
    harness = slow_polling(harness_factory(SUBMIT))
    async with running(harness):
        client = TestClient(create_app(harness.settings))
        await asyncio.to_thread(client.__enter__)  # blocking calls leave this loop to the worker
        try:
            session = await asyncio.to_thread(client.post, "/api/sessions", json={})
            started = time.monotonic()
            response = await asyncio.to_thread(
                client.post,
                f"/api/sessions/{session.json()['id']}/turns",
                json={"text": "hi"},
                headers={"Idempotency-Key": "k"},
            )
            took = time.monotonic() - started
        finally:
            await asyncio.to_thread(client.__exit__, None, None, None)
    assert response.status_code == 200
    assert "noticed" in response.text and response.text.rstrip().endswith("data: [DONE]")
    assert took < SLOW_POLL_SECONDS / 2


async def test_the_gateway_announces_a_queued_turn_once_and_a_replay_not_at_all(
    harness_factory: Any,
) -> None:
    """The POST announces its queued Turn; the same POST again (same key) replays the Run and
    wakes no one. The Turn runs on a burst worker once the notice is heard."""
    harness = harness_factory(SUBMIT)
    heard: list[object] = []
    async with harness.redis.pubsub() as pubsub:
        await pubsub.subscribe(jobs_channel(harness.redis, harness.settings.profile.worker.queue_name))

        async def listen() -> None:
            async for message in pubsub.listen():
                if message["type"] == "message":
                    heard.append(message["data"])

        listener = asyncio.create_task(listen())
        client = TestClient(create_app(harness.settings))
        await asyncio.to_thread(client.__enter__)
        try:
            session = await asyncio.to_thread(client.post, "/api/sessions", json={})
            path = f"/api/sessions/{session.json()['id']}/turns"

            def post() -> str:
                return client.post(path, json={"text": "hi"}, headers={"Idempotency-Key": "k"}).text

            first = asyncio.create_task(asyncio.to_thread(post))
            await until(lambda: _heard(heard, 1), within=TAKEN_WITHIN_SECONDS)
            await harness.work()
            assert (await first).rstrip().endswith("data: [DONE]")
            assert (await asyncio.to_thread(post)).rstrip().endswith("data: [DONE]")  # the replay
            await asyncio.sleep(0.3)  # a second notice, if any, would be here by now
        finally:
            await asyncio.to_thread(client.__exit__, None, None, None)
            listener.cancel()
    assert heard == [b"1"]


async def _heard(heard: list[object], count: int) -> bool:
    return len(heard) >= count


async def test_a_wake_up_checks_only_the_jobs_no_worker_has_started(harness_factory: Any) -> None:
    """arq keeps a job in its queue until the job ends. A worker woken by a notice hands arq's
    start_jobs only the jobs nobody runs: it used to check every running one first (WATCH, EXISTS,
    ZSCORE, UNWATCH each), so at 8 slots a new Turn waited behind ~28 round trips. Counted by
    Redis itself (INFO commandstats); a sample that arq's own poll overlapped (its abort check
    runs ZREMRANGEBYSCORE, which nothing else here does) is taken again."""
    harness = slow_polling(harness_factory(SUBMIT, SUBMIT, SUBMIT))
    queue = harness.settings.profile.worker.queue_name
    async with running(harness):
        for _ in range(3):  # jobs another worker is running
            elsewhere = await harness.submit(enqueue=False)
            await enqueue_run(harness.redis, queue, elsewhere, announce=False)
            await harness.redis.set(ARQ_IN_PROGRESS_PREFIX + elsewhere, b"1", px=60_000)
        watches = None
        for _ in range(3):
            run_id = await harness.submit(enqueue=False)
            before = await command_counts(harness)
            await enqueue(harness, run_id, announce=True)
            await until(functools.partial(_not_queued, harness, run_id), within=SLOW_POLL_SECONDS / 2)
            after = await command_counts(harness)
            await until(functools.partial(_is, harness, run_id, "completed"), within=TAKEN_WITHIN_SECONDS * 3)
            if after["zremrangebyscore"] == before["zremrangebyscore"]:  # arq's poll stayed out of it
                watches = after["watch"] - before["watch"]
                break
    assert watches == 1  # the new job's own check under arq's lock, and no other


async def command_counts(harness: Harness) -> dict[str, int]:
    stats = await harness.redis.info("commandstats")
    names = ("watch", "zremrangebyscore")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names}
