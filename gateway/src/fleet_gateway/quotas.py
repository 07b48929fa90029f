"""A tenant's quotas at a Turn's POST (`quotas`, docs/security.md, tenancy). Active Turns are
counted in the claim's own transaction (fleet_shared.db.queries); Turns per minute in Redis,
after the claim, which is withdrawn when over: a refused Turn leaves nothing and burns no key."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from fleet_gateway.errors import ApiError
from fleet_shared import redis_keys
from fleet_shared.config_file import QuotaLimits

ACTIVE_TURNS_RETRY_SECONDS = 5  # a guess: when a Turn ends is not known in advance
WINDOW_SECONDS = 60


def over_active_turns(limits: QuotaLimits) -> ApiError:
    return ApiError(
        429,
        "quota_exceeded",
        f"this tenant may run {limits.active_turns} Turn(s) at once: retry when one ends",
        **{"Retry-After": str(ACTIVE_TURNS_RETRY_SECONDS)},
    )


def over_turns_per_minute(limits: QuotaLimits, retry_after: int) -> ApiError:
    return ApiError(
        429,
        "quota_exceeded",
        f"this tenant may start {limits.turns_per_minute} Turn(s) a minute: retry in {retry_after} s",
        **{"Retry-After": str(retry_after)},
    )


async def count_turn_in_minute(redis: Redis, tenant: str, now: float | None = None) -> tuple[int, int]:
    """This Turn counted in the tenant's current clock minute: the count so far, and the seconds
    until the minute ends. INCR and EXPIRE go together (MULTI), so no counter outlives its window."""
    now = time.time() if now is None else now
    key = redis_keys.tenant_turns_in_minute(tenant, int(now // WINDOW_SECONDS))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incr(key)
        pipe.expire(key, 2 * WINDOW_SECONDS)
        count, _ = await pipe.execute()
    return int(count), max(1, WINDOW_SECONDS - int(now % WINDOW_SECONDS))
