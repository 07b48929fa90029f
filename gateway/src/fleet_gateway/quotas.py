"""A tenant's quotas at a Turn's POST (`quotas`, docs/security.md, tenancy). Active Turns are
counted in the claim's own transaction (fleet_shared.db.claims); LM tokens per day and Turns per
minute in Redis, after the claim, which is withdrawn when over: a refused Turn leaves nothing and
burns no key."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from fleet_gateway.errors import ApiError
from fleet_shared import redis_keys
from fleet_shared.config_file import QuotaLimits
from fleet_shared.tenant_usage import lm_tokens_today, seconds_left_today, utc_day

ACTIVE_TURNS_RETRY_SECONDS = 5  # a guess: when a Turn ends is not known in advance
WINDOW_SECONDS = 60


def over_active_turns(limits: QuotaLimits) -> ApiError:
    return ApiError(
        429,
        "quota_exceeded",
        f"this tenant may run {limits.active_turns} Turn(s) at once: retry when one ends",
        **{"Retry-After": str(ACTIVE_TURNS_RETRY_SECONDS)},
    )


async def counted_refusal(
    redis: Redis, tenant: str, limits: QuotaLimits, *, count: bool = True
) -> ApiError | None:
    """The 429 for a new Turn over the tenant's LM tokens today or Turns this minute; None when
    within both. A Turn refused for tokens is not counted in the minute; without `count`, none
    is (a look before an interrupt, which must not cancel a Turn for one that would be refused)."""
    now = time.time()
    if limits.lm_tokens_per_day:
        used = await lm_tokens_today(redis, tenant, utc_day(now))
        if used >= limits.lm_tokens_per_day:
            retry_after = seconds_left_today(now)
            message = (
                f"this tenant used its {limits.lm_tokens_per_day} LM tokens for today: "
                f"retry after midnight UTC, in {retry_after} s"
            )
            return ApiError(429, "quota_exceeded", message, **{"Retry-After": str(retry_after)})
    if limits.turns_per_minute:
        if count:
            started, retry_after = await count_turn_in_minute(redis, tenant, now)
        else:
            started = await turns_this_minute(redis, tenant, now) + 1
            retry_after = max(1, WINDOW_SECONDS - int(now % WINDOW_SECONDS))
        if started > limits.turns_per_minute:
            message = (
                f"this tenant may start {limits.turns_per_minute} Turn(s) a minute: retry in {retry_after} s"
            )
            return ApiError(429, "quota_exceeded", message, **{"Retry-After": str(retry_after)})
    return None


async def count_turn_in_minute(redis: Redis, tenant: str, now: float) -> tuple[int, int]:
    """This Turn counted in the tenant's current clock minute: the count so far, and the seconds
    until the minute ends. INCR and EXPIRE go together (MULTI), so no counter outlives its window."""
    key = redis_keys.tenant_turns_in_minute(tenant, int(now // WINDOW_SECONDS))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incr(key)
        pipe.expire(key, 2 * WINDOW_SECONDS)
        count, _ = await pipe.execute()
    return int(count), max(1, WINDOW_SECONDS - int(now % WINDOW_SECONDS))


async def turns_this_minute(redis: Redis, tenant: str, now: float) -> int:
    return int(await redis.get(redis_keys.tenant_turns_in_minute(tenant, int(now // WINDOW_SECONDS))) or 0)
