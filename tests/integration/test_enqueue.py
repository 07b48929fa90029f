"""fleet's one-round-trip enqueue against a real Redis: it writes what arq's enqueue_job writes
(arq reads the job back), refuses a job id that is queued, running or done exactly as arq does,
and tells the workers' channel once per job queued."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from arq.connections import ArqRedis
from arq.jobs import Job, JobStatus

from fleet_shared.event_log import jobs_channel
from fleet_shared.queue import (
    ARQ_EXPIRES_EXTRA_MS,
    ARQ_IN_PROGRESS_PREFIX,
    ARQ_JOB_PREFIX,
    ARQ_RESULT_PREFIX,
    ENQUEUE_SCRIPT,
    ENQUEUE_SHA,
    RUN_TURN,
    WAITING_SCRIPT,
    WAITING_SHA,
    deserialize_job,
    enqueue_run,
    serialize_job,
    waiting_job_ids,
)


def arq_client(redis: aioredis.Redis) -> ArqRedis:
    return ArqRedis(connection_pool=redis.connection_pool, job_serializer=serialize_job,
                    job_deserializer=deserialize_job)  # fmt: skip


@contextlib.asynccontextmanager
async def listening(redis: aioredis.Redis, queue: str) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """Subscribed to the queue's notices (Redis has confirmed it) for the block; the callable
    counts the notices that arrive within the next 0.3 s."""
    async with redis.pubsub() as pubsub:
        await pubsub.subscribe(jobs_channel(redis, queue))
        confirmed = await pubsub.get_message(timeout=5)
        assert confirmed is not None and confirmed["type"] == "subscribe"

        async def count() -> int:
            heard, deadline = 0, time.monotonic() + 0.3
            while (left := deadline - time.monotonic()) > 0:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
                heard += message is not None
            return heard

        yield count


async def test_the_job_is_arqs_own_and_waits_in_the_queue(redis_client: aioredis.Redis) -> None:
    queue, run_id = f"q-{uuid.uuid4().hex}", str(uuid.uuid4())
    before = int(time.time() * 1000)
    assert await enqueue_run(redis_client, queue, run_id) is True
    info = await Job(run_id, arq_client(redis_client), _queue_name=queue,
                     _deserializer=deserialize_job).info()  # fmt: skip
    assert info is not None
    assert (info.function, tuple(info.args), info.kwargs, info.job_try) == (RUN_TURN, (run_id,), {}, None)
    assert before <= info.score <= int(time.time() * 1000)
    assert await Job(run_id, arq_client(redis_client), _queue_name=queue).status() == JobStatus.queued
    ttl_ms = await redis_client.pttl(ARQ_JOB_PREFIX + run_id)
    assert ARQ_EXPIRES_EXTRA_MS - 60_000 < ttl_ms <= ARQ_EXPIRES_EXTRA_MS


async def test_a_job_id_that_is_queued_running_or_done_is_refused(redis_client: aioredis.Redis) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    queued, running, done = (str(uuid.uuid4()) for _ in range(3))
    assert await enqueue_run(redis_client, queue, queued)
    assert await enqueue_run(redis_client, queue, running)
    # A worker took `running` (arq keeps its job key while it runs) and finished `done` (the job
    # key is gone, its result stays).
    await redis_client.zrem(queue, running)
    await redis_client.set(ARQ_IN_PROGRESS_PREFIX + running, b"1")
    await redis_client.set(ARQ_RESULT_PREFIX + done, b"result")
    async with listening(redis_client, queue) as notices:
        for run_id in (queued, running, done):
            assert await enqueue_run(redis_client, queue, run_id) is False
        assert await notices() == 0  # a refused job tells no one
        assert await enqueue_run(redis_client, queue, str(uuid.uuid4()))
        assert await notices() == 1  # (and the listener does hear one that is queued)
    assert queued.encode() in await redis_client.zrange(queue, 0, -1)
    assert running.encode() not in await redis_client.zrange(queue, 0, -1)
    assert not await redis_client.exists(ARQ_JOB_PREFIX + done)


async def test_each_queued_job_is_announced_once(redis_client: aioredis.Redis) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    async with listening(redis_client, queue) as notices:
        for _ in range(3):
            assert await enqueue_run(redis_client, queue, str(uuid.uuid4()))
        assert await notices() == 3


async def test_the_script_is_loaded_again_after_redis_forgets_it(redis_client: aioredis.Redis) -> None:
    """A restarted Redis has no scripts: the first enqueue after it still works (SCRIPT LOAD once)."""
    queue = f"q-{uuid.uuid4().hex}"
    assert await enqueue_run(redis_client, queue, str(uuid.uuid4()))
    await redis_client.script_flush()
    assert await enqueue_run(redis_client, queue, str(uuid.uuid4()))
    assert await redis_client.zcard(queue) == 2


async def test_redis_names_the_script_as_fleet_hashed_it(redis_client: aioredis.Redis) -> None:
    """The script's SHA1 is computed once at import; EVALSHA only works if Redis agrees."""
    assert await redis_client.script_load(ENQUEUE_SCRIPT) == ENQUEUE_SHA


async def test_an_enqueue_without_its_notice_tells_no_one(redis_client: aioredis.Redis) -> None:
    """The gateway's: it announces the job itself, once its response has started."""
    queue = f"q-{uuid.uuid4().hex}"
    async with listening(redis_client, queue) as notices:
        assert await enqueue_run(redis_client, queue, str(uuid.uuid4()), announce=False)
        assert await notices() == 0
        assert await enqueue_run(redis_client, queue, str(uuid.uuid4()))
        assert await notices() == 1
    assert await redis_client.zcard(queue) == 2  # both queued


async def test_the_waiting_jobs_are_the_due_ones_no_worker_has_started(redis_client: aioredis.Redis) -> None:
    """What a worker's wake-up hands to arq's start_jobs: oldest first, without the jobs running
    (arq keeps those in the queue until they end) or not yet due, in one round trip."""
    queue = f"q-{uuid.uuid4().hex}"
    now = int(time.time() * 1000)
    first, running, later, last = (str(uuid.uuid4()) for _ in range(4))
    for age, run_id in enumerate((last, later, running, first), start=1):  # scores a second apart
        assert await enqueue_run(redis_client, queue, run_id, announce=False)
        await redis_client.zadd(queue, {run_id: now - 1000 * age})
    await redis_client.set(ARQ_IN_PROGRESS_PREFIX + running, b"1", px=60_000)  # a worker took it
    not_due = str(uuid.uuid4())
    await redis_client.zadd(queue, {not_due: now + 60_000})  # a deferred retry
    waiting = [first.encode(), later.encode(), last.encode()]
    assert await waiting_job_ids(redis_client, queue, 100) == waiting
    assert await waiting_job_ids(redis_client, queue, 2) == waiting[:2]  # arq's read limit
    await redis_client.set(ARQ_IN_PROGRESS_PREFIX + first, b"1", px=60_000)
    # Two running ahead of them fill a first batch of two: it reads on to the waiting ones.
    assert await waiting_job_ids(redis_client, queue, 2) == waiting[1:]
    assert await waiting_job_ids(redis_client, queue, 1) == waiting[1:2]
    await redis_client.script_flush()  # a restarted Redis: loaded again
    assert await waiting_job_ids(redis_client, queue, 100) == waiting[1:]
    assert await redis_client.script_load(WAITING_SCRIPT) == WAITING_SHA
