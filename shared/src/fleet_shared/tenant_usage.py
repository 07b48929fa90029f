"""A tenant's LM tokens per UTC day (`quotas.lm_tokens_per_day`, docs/security.md, tenancy).

Workers add each LM call's tokens as the call reports them (INCRBY: concurrent Turns of a tenant
add to one count, atomically); the gateway reads the count at a Turn's POST and for
`GET /api/usage`. The count lives in Redis only: it is as durable as Redis is (a Redis that
restarts without persistence starts the day at 0), and each day's key expires the day after."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from fleet_shared import redis_keys

DAY_SECONDS = 86_400
KEPT_SECONDS = 2 * DAY_SECONDS  # yesterday's count outlives midnight by a day, then goes


def utc_day(now: float | None = None) -> int:
    """Days since the epoch, in UTC: the count's key."""
    return int((time.time() if now is None else now) // DAY_SECONDS)


def seconds_left_today(now: float | None = None) -> int:
    """Until the next UTC midnight (at least 1): a refusal's Retry-After."""
    now = time.time() if now is None else now
    return max(1, DAY_SECONDS - int(now % DAY_SECONDS))


async def lm_tokens_today(redis: Redis, tenant: str, day: int | None = None) -> int:
    value = await redis.get(redis_keys.tenant_lm_tokens_on_day(tenant, utc_day() if day is None else day))
    return int(value or 0)


async def add_lm_tokens(redis: Redis, tenant: str, tokens: int, day: int) -> int:
    """Add one LM call's tokens to the tenant's count of `day`; the count after it. INCRBY and
    EXPIRE go together (MULTI), so no count outlives its expiry."""
    key = redis_keys.tenant_lm_tokens_on_day(tenant, day)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incrby(key, tokens)
        pipe.expire(key, KEPT_SECONDS)
        total, _ = await pipe.execute()
    return int(total)
