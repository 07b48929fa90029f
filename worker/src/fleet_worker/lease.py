"""A Run's lease: a Redis key with a short TTL that the owning worker keeps renewing.

If the worker dies (even by SIGKILL) the key lapses within `worker.lease_seconds`, and the reaper
of any live worker settles the Run as `worker_lost`. If a live worker finds its lease gone (a
long stall, a Redis outage), it must assume it was reaped and stop: `Lease.lost` tells it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared import redis_keys

log = structlog.get_logger(__name__)


@dataclass
class Lease:
    key: str
    lost: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.asynccontextmanager
async def hold_lease(redis: Redis, run_id: str, owner: str, seconds: float) -> AsyncIterator[Lease]:
    lease = Lease(redis_keys.run_lease(run_id))
    ttl_ms = int(seconds * 1000)
    await redis.set(lease.key, owner, px=ttl_ms)
    renewer = asyncio.create_task(renew_until_lost(redis, lease, owner, ttl_ms), name=f"fleet-lease-{run_id}")
    try:
        yield lease
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        with contextlib.suppress(RedisError, OSError):
            await redis.delete(lease.key)


async def renew_until_lost(redis: Redis, lease: Lease, owner: str, ttl_ms: int) -> None:
    while True:
        await asyncio.sleep(ttl_ms / 3000)  # three renewals per TTL: one lost write is harmless
        try:
            # XX: only extend a lease that still exists; recreating a lapsed one would hide that
            # a reaper may already have settled this Run.
            renewed = await redis.set(lease.key, owner, px=ttl_ms, xx=True)
        except (RedisError, OSError) as exc:
            log.warning("lease.renew_failed", error=str(exc))
            continue
        if not renewed:
            log.warning("lease.lost")
            lease.lost.set()
            return
