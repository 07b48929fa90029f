"""Redis clients that ride out a brief outage: commands retry with backoff across a restart."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

RETRY_ON = [ConnectionError, TimeoutError, ConnectionResetError, ConnectionRefusedError]
CONNECT_TIMEOUT_SECONDS = 2


def retry_policy(retries: int) -> Retry:
    """Up to `retries` retries, waiting 50 ms, 100 ms, 200 ms ... then 1 s each."""
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), retries)


def connect(url: str, *, retries: int = 8) -> Redis:
    """A client whose commands survive a Redis restart of a few seconds (8 retries ≈ 4.5 s)."""
    client: Redis = Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        retry=retry_policy(retries),
        retry_on_error=list(RETRY_ON),
    )
    return client
