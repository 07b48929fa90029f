"""A Run's lease: a Redis key with a short TTL that the owning worker keeps renewing.

If the worker dies (even by SIGKILL) the key lapses within `worker.lease_seconds`, and the reaper
of any live worker settles the Run as `worker_lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared import redis_keys

log = structlog.get_logger(__name__)


@contextlib.asynccontextmanager
async def hold_lease(redis: Redis, run_id: str, owner: str, seconds: float) -> AsyncIterator[None]:
    key = redis_keys.run_lease(run_id)
    ttl_ms = int(seconds * 1000)
    await redis.set(key, owner, px=ttl_ms)
    renewer = asyncio.create_task(renew_forever(redis, key, owner, ttl_ms), name=f"fleet-lease-{run_id}")
    try:
        yield
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        with contextlib.suppress(RedisError, OSError):
            await redis.delete(key)


async def renew_forever(redis: Redis, key: str, owner: str, ttl_ms: int) -> None:
    while True:
        await asyncio.sleep(ttl_ms / 3000)  # three renewals per TTL: one lost write is harmless
        try:
            await redis.set(key, owner, px=ttl_ms)
        except (RedisError, OSError) as exc:
            log.warning("lease.renew_failed", error=str(exc))
