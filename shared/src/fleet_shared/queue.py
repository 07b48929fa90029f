"""The contract between the gateway's enqueue and the worker's arq functions."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

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


async def announce_queued(redis: Redis, queue_name: str) -> None:
    """Tell idle workers that a job waits on this queue, so they take it now rather than at their
    next poll. Best effort: without the notice the job waits at most one `worker.poll_delay_seconds`."""
    with contextlib.suppress(RedisError, OSError):
        await redis.publish(jobs_channel(redis, queue_name), b"1")


def health_check_key(queue_name: str) -> str:
    return queue_name + HEALTH_CHECK_SUFFIX


# arq's own key prefixes (arq.constants), named here so the shared sweep can tell a queued job from
# a lost one without importing arq; tests/unit/shared/test_queue.py checks they still match.
ARQ_JOB_PREFIX = "arq:job:"
ARQ_IN_PROGRESS_PREFIX = "arq:in-progress:"
ARQ_RESULT_PREFIX = "arq:result:"
