"""The job queue: what the gateway, the sweep and the metrics need from it, behind one Protocol.

A Turn's job is arq's: job id = run id, one argument (the run id), run by the worker's
`run_turn`. Only this module and `fleet_shared.jobs_worker` (the worker's side) import arq, and
only through its public API (ADR 0034): `ArqRedis.enqueue_job`, `Job.status`, arq's abort set
and its key constants. A test scans the product packages for any other import of arq.

arq gives the guarantees the rest of fleet builds on: a job id is queued at most once (a second
enqueue of a queued, running or finished id is refused), a job whose worker dies is run again
(at least once; the Run's fence makes the extra run a no-op), and a job aborted before it starts
never starts. The sweep (fleet_shared.recovery) requeues a queued Run whose job was lost.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol, cast

import msgspec
from arq.connections import ArqRedis
from arq.constants import abort_jobs_ss, health_check_key_suffix, in_progress_key_prefix, result_key_prefix
from arq.jobs import Job, JobStatus
from redis.asyncio import Redis

RUN_TURN = "run_turn"  # the worker's job function; its single argument is the run id (also the job id)


class JobQueue(Protocol):
    """The queue as its callers see it; `ArqJobQueue` is the one implementation."""

    async def enqueue(self, run_id: str) -> bool:
        """Queue the Run's job. False when that job is already queued, running or finished:
        nothing is written. Redis errors propagate (the gateway answers 503)."""
        ...

    async def requeue(self, run_id: str) -> bool:
        """Queue the job of a Run that is still queued in the database but whose job is gone:
        the result a failed attempt left (which would refuse the id) is cleared first."""
        ...

    async def abort(self, run_id: str) -> None:
        """The job will not start (the Run was cancelled while queued); a running one is left
        alone (a running Turn is cancelled by its flag, fleet_gateway.cancellation)."""
        ...

    async def pending(self, run_id: str) -> bool:
        """The job waits in the queue or a worker runs it."""
        ...


def describe_unencodable(value: Any) -> str:
    """arq stores a failed job's exception as its result; keep its text, not the object."""
    return f"{type(value).__name__}: {value}"


MSGPACK_ENCODER = msgspec.msgpack.Encoder(enc_hook=describe_unencodable)
MSGPACK_DECODER = msgspec.msgpack.Decoder()


def serialize_job(job: dict[str, Any]) -> bytes:
    """arq job payloads as msgpack rather than arq's default pickle."""
    return MSGPACK_ENCODER.encode(job)


def deserialize_job(data: bytes) -> dict[str, Any]:
    decoded = MSGPACK_DECODER.decode(data)
    assert isinstance(decoded, dict)
    return decoded


class ArqJobQueue:
    """The queue on arq, sharing `redis`'s connection pool (and so its timeouts and retries)."""

    def __init__(self, redis: Redis, queue_name: str) -> None:
        self.queue_name = queue_name
        self.arq = ArqRedis(
            redis.connection_pool,
            job_serializer=serialize_job,
            job_deserializer=deserialize_job,
            default_queue_name=queue_name,
        )

    async def enqueue(self, run_id: str) -> bool:
        return await self.arq.enqueue_job(RUN_TURN, run_id, _job_id=run_id) is not None

    async def requeue(self, run_id: str) -> bool:
        await self.arq.delete(result_key_prefix + run_id)
        return await self.enqueue(run_id)

    async def abort(self, run_id: str) -> None:
        # What arq's Job.abort writes, without its wait for the job's result: a queued Run's
        # cancel is already committed, and a worker that still picks the job finds it cancelled.
        await self.arq.zadd(abort_jobs_ss, {run_id: int(time.time() * 1000)})

    async def pending(self, run_id: str) -> bool:
        status = await Job(run_id, self.arq, _queue_name=self.queue_name).status()
        return status in (JobStatus.queued, JobStatus.deferred, JobStatus.in_progress)


def health_key(queue_name: str) -> str:
    """Written by every live worker of the queue (arq's health check), with a TTL."""
    return queue_name + health_check_key_suffix


class QueueCounts(NamedTuple):
    waiting: int  # fleet_queue_depth
    in_progress: int  # fleet_queue_in_progress


# arq keeps a job in its queue ZSET (score = when it may run) until the job finishes, and marks
# a started job with an in-progress key. In progress = in the ZSET with that key; waiting = in
# the ZSET, not started, not aborted. One script, so both counts come from the same instant.
# KEYS: the queue, arq's abort set; ARGV: the in-progress prefix.
QUEUE_COUNTS_SCRIPT = """
local waiting, in_progress = 0, 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('EXISTS', ARGV[1] .. id) == 1 then
    in_progress = in_progress + 1
  elseif not redis.call('ZSCORE', KEYS[2], id) then
    waiting = waiting + 1
  end
end
return {waiting, in_progress}
"""


def queue_counts_call(queue_name: str) -> tuple[str, int, str, str, str]:
    """The EVAL arguments that count `queue_name`'s jobs: `redis.eval(*queue_counts_call(q))`."""
    return QUEUE_COUNTS_SCRIPT, 2, queue_name, abort_jobs_ss, in_progress_key_prefix


def counts_of(reply: object) -> QueueCounts:
    """The counting script's reply, a list of two integers."""
    waiting, in_progress = cast(list[int], reply)
    return QueueCounts(int(waiting), int(in_progress))
