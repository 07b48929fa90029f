"""The job queue (fleet_shared.jobs, fleet_shared.jobs_worker) on a real Redis with real arq
workers: a job is queued once per id, runs once however many workers poll, an aborted job never
starts, `pending` follows the job through its life, and `requeue` revives a job whose failed
attempt left a result."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from arq.jobs import Job, JobStatus

from fleet_shared.jobs import RUN_TURN, ArqJobQueue, deserialize_job
from fleet_shared.jobs_worker import Context, JobWorker

WITHIN_SECONDS = 10.0  # a hang guard, far above a poll


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WITHIN_SECONDS
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Recorder:
    """A job function that records each run, and can be held until released."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.release = asyncio.Event()
        self.release.set()

    async def run(self, ctx: Context, run_id: str) -> str:
        self.runs.append(run_id)
        await self.release.wait()
        return "done"


async def nothing(_ctx: Context) -> None:
    return None


def job_worker(redis_url: str, queue: str, job: Recorder, *, burst: bool = False) -> JobWorker:
    return JobWorker(
        job.run,
        redis_url=redis_url,
        queue_name=queue,
        concurrency=2,
        poll_delay_seconds=0.02,
        job_timeout_seconds=30,
        drain_seconds=1,
        on_startup=nothing,
        on_shutdown=nothing,
        burst=burst,
    )


@contextlib.asynccontextmanager
async def running(*workers: JobWorker) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            await worker.close()


async def test_a_job_is_queued_once_per_id_as_arq_reads_it(redis_client: aioredis.Redis) -> None:
    queue, run_id = f"q-{uuid.uuid4().hex}", str(uuid.uuid4())
    jobs = ArqJobQueue(redis_client, queue)
    assert await jobs.enqueue(run_id)
    assert not await jobs.enqueue(run_id)  # queued already: refused, nothing written
    assert await redis_client.zcard(queue) == 1
    info = await Job(run_id, redis_client, _queue_name=queue, _deserializer=deserialize_job).info()
    assert info is not None and (info.function, list(info.args)) == (RUN_TURN, [run_id])
    assert await jobs.pending(run_id)


async def test_a_job_runs_once_however_many_workers_poll(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    jobs, job = ArqJobQueue(redis_client, queue), Recorder()
    run_ids = [str(uuid.uuid4()) for _ in range(6)]
    async with running(*(job_worker(redis_url, queue, job) for _ in range(3))):
        for run_id in run_ids:
            assert await jobs.enqueue(run_id)

        async def all_finished() -> bool:
            return not any([await jobs.pending(r) for r in run_ids])

        await until(all_finished, "every job to finish")
    assert sorted(job.runs) == sorted(run_ids)  # each once, none twice


async def test_pending_follows_a_job_from_queued_to_running_to_finished(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    queue, run_id = f"q-{uuid.uuid4().hex}", str(uuid.uuid4())
    jobs, job = ArqJobQueue(redis_client, queue), Recorder()
    assert not await jobs.pending(run_id)  # never queued
    job.release.clear()
    assert await jobs.enqueue(run_id)
    async with running(job_worker(redis_url, queue, job)):
        await until(lambda: asyncio.sleep(0, run_id in job.runs), "the job to start")
        status = await Job(run_id, redis_client, _queue_name=queue).status()
        assert status is JobStatus.in_progress and await jobs.pending(run_id)
        assert not await jobs.enqueue(run_id)  # running: refused
        job.release.set()

        async def finished() -> bool:
            return not await jobs.pending(run_id)

        await until(finished, "the job to finish")
    assert not await jobs.enqueue(run_id)  # its result is kept: still refused


async def test_an_aborted_job_never_starts(redis_client: aioredis.Redis, redis_url: str) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    aborted, kept = str(uuid.uuid4()), str(uuid.uuid4())
    jobs, job = ArqJobQueue(redis_client, queue), Recorder()
    assert await jobs.enqueue(aborted) and await jobs.enqueue(kept)
    await jobs.abort(aborted)
    await job_worker(redis_url, queue, job, burst=True).run()  # until the queue is empty
    assert job.runs == [kept]
    assert not await jobs.pending(aborted)


async def test_requeue_revives_a_job_whose_failed_attempt_left_a_result(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    queue, run_id = f"q-{uuid.uuid4().hex}", str(uuid.uuid4())
    jobs, job = ArqJobQueue(redis_client, queue), Recorder()
    assert await jobs.enqueue(run_id)
    worker = job_worker(redis_url, queue, job, burst=True)
    await worker.run()
    await worker.close()
    assert job.runs == [run_id] and not await jobs.enqueue(run_id)  # the result refuses the id
    assert await jobs.requeue(run_id)
    again = job_worker(redis_url, queue, job, burst=True)
    await again.run()
    await again.close()
    assert job.runs == [run_id, run_id]


async def test_an_idle_worker_takes_a_queued_job_within_a_few_polls(
    redis_client: aioredis.Redis, redis_url: str
) -> None:
    """No notice, no waker: arq's own poll is how a job reaches a worker."""
    queue, run_id = f"q-{uuid.uuid4().hex}", str(uuid.uuid4())
    jobs, job = ArqJobQueue(redis_client, queue), Recorder()
    worker: Any = job_worker(redis_url, queue, job)
    async with running(worker):
        await until(lambda: asyncio.sleep(0, "redis" in worker.ctx), "the worker to start")
        assert await jobs.enqueue(run_id)
        await until(lambda: asyncio.sleep(0, run_id in job.runs), "the job to start")
