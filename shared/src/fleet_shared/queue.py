"""The contract between the gateway's enqueue and the worker's arq functions."""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from fleet_shared.event_log import jobs_channel

RUN_TURN = "run_turn"  # arq function name; its single argument is the run id (also the job id)
HEALTH_CHECK_SUFFIX = ":health-check"  # arq writes <queue><suffix> while a worker is alive


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


# arq's own key prefixes (arq.constants), named here so the shared sweep can tell a queued job from
# a lost one without importing arq; tests/unit/shared/test_queue.py checks they still match.
ARQ_JOB_PREFIX = "arq:job:"
ARQ_IN_PROGRESS_PREFIX = "arq:in-progress:"
ARQ_RESULT_PREFIX = "arq:result:"


# arq's enqueue_job takes three round trips (WATCH the job's key, EXISTS, then MULTI/PSETEX/ZADD/
# EXEC). This script makes the same check and the same two writes in one, atomically, and
# publishes the notice with them unless told not to (an empty channel). KEYS: the job, its
# result, the queue; ARGV: expiry (ms), job, score (ms), job id, the notice's channel or "".
ENQUEUE_SCRIPT = """
if redis.call('EXISTS', KEYS[1], KEYS[2]) ~= 0 then return 0 end
redis.call('PSETEX', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4])
if ARGV[5] ~= '' then redis.call('PUBLISH', ARGV[5], '1') end
return 1
"""
# Hashed once per process, not per enqueue (redis-py's register_script would hash it each time,
# into a Script that holds its client); tests/integration/test_enqueue.py checks Redis agrees.
ENQUEUE_SHA = hashlib.sha1(ENQUEUE_SCRIPT.encode()).hexdigest()
ARQ_EXPIRES_EXTRA_MS = 86_400_000  # arq's default: a job not started within a day expires


def run_turn_job(run_id: str, enqueued_ms: int) -> bytes:
    """The job arq's enqueue_job would write for `run_turn(run_id)` (arq.jobs.serialize_job's
    fields, fleet's serializer); tests/unit/shared/test_queue.py checks the bytes are arq's."""
    return serialize_job({"t": None, "f": RUN_TURN, "a": [run_id], "k": {}, "et": enqueued_ms})


async def enqueue_run(redis: Redis, queue_name: str, run_id: str, *, announce: bool = True) -> bool:
    """Queue the Run's arq job (job id = run id) in one round trip and, with `announce`, tell
    idle workers in the same one. False when that job is already queued, running or done:
    nothing is written and no one is told. Redis errors propagate (the gateway answers 503 and
    withdraws its claim)."""
    now = int(time.time() * 1000)
    keys = [ARQ_JOB_PREFIX + run_id, ARQ_RESULT_PREFIX + run_id, queue_name]
    channel = jobs_channel(redis, queue_name) if announce else ""
    args: list[bytes | str | int] = [ARQ_EXPIRES_EXTRA_MS, run_turn_job(run_id, now), now, run_id, channel]
    # (redis-py types these commands for its sync client: str arguments, no awaitable)
    try:
        return bool(await redis.evalsha(ENQUEUE_SHA, len(keys), *keys, *args))  # type: ignore[arg-type,misc]
    except NoScriptError:  # this Redis has not seen the script (a restart, a flush): load it once
        await redis.script_load(ENQUEUE_SCRIPT)
        return bool(await redis.evalsha(ENQUEUE_SHA, len(keys), *keys, *args))  # type: ignore[arg-type,misc]


async def announce_queued(redis: Redis, queue_name: str) -> None:
    """Tell idle workers that a job waits on this queue, so they take it now rather than at their
    next poll. Best effort: without the notice the job waits at most one `worker.poll_delay_seconds`."""
    with contextlib.suppress(RedisError, OSError):
        await redis.publish(jobs_channel(redis, queue_name), b"1")


# Up to `limit` ids of due jobs (oldest first) that no worker is running. arq keeps a job in the
# queue until it ends, so a worker with busy slots would otherwise check each running job (WATCH,
# EXISTS, ZSCORE) before it reached the new one, four round trips apiece; and arq's own read of
# its first `limit` ids finds none waiting once that many are running across the fleet, so this
# reads on, a batch at a time, past the running ones. arq's start_jobs still makes its own check
# under its lock; this only skips the jobs it would skip. The in-progress keys are named from the
# ids, so the script reads keys it is not passed: fleet's queue lives on one Redis, not a Cluster.
# KEYS: the queue; ARGV: now (ms), limit, the in-progress prefix.
WAITING_SCRIPT = """
local limit = tonumber(ARGV[2])
local waiting, offset = {}, 0
while #waiting < limit do
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', offset, limit)
  for _, id in ipairs(ids) do
    if #waiting < limit and redis.call('EXISTS', ARGV[3] .. id) == 0 then
      waiting[#waiting + 1] = id
    end
  end
  if #ids < limit then break end
  offset = offset + limit
end
return waiting
"""
WAITING_SHA = hashlib.sha1(WAITING_SCRIPT.encode()).hexdigest()


async def waiting_job_ids(redis: Redis, queue_name: str, limit: int) -> list[bytes]:
    """The queue's due jobs that no worker has started, oldest first, in one round trip."""
    args = [int(time.time() * 1000), limit, ARQ_IN_PROGRESS_PREFIX]
    try:
        ids = await redis.evalsha(WAITING_SHA, 1, queue_name, *args)  # type: ignore[arg-type,misc]
    except NoScriptError:
        await redis.script_load(WAITING_SCRIPT)
        ids = await redis.evalsha(WAITING_SHA, 1, queue_name, *args)  # type: ignore[arg-type,misc]
    return list(ids)


def health_check_key(queue_name: str) -> str:
    return queue_name + HEALTH_CHECK_SUFFIX
