"""Redis clients: commands that ride out a brief outage, and listeners that wait as long as needed."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

# What a retry helps with: the server restarting (refused, reset). A server that hangs is a
# timeout; retrying that only multiplies the wait, so request paths retry connection errors only.
RETRY_ON_CONNECTION = [ConnectionError, ConnectionResetError, ConnectionRefusedError]
RETRY_ON = [*RETRY_ON_CONNECTION, TimeoutError]
CONNECT_TIMEOUT_SECONDS = 2
COMMAND_TIMEOUT_SECONDS = 5.0


def retry_policy(retries: int) -> Retry:
    """Up to `retries` retries, waiting 50 ms, 100 ms, 200 ms ... then 1 s each."""
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), retries)


def connect(
    url: str,
    *,
    retries: int = 8,
    timeout: float = COMMAND_TIMEOUT_SECONDS,
    retry_timeouts: bool = True,
) -> Redis:
    """A client for commands: none waits on a hung server longer than `timeout`, and a restart of
    a few seconds goes unnoticed (8 retries: about 4.5 s)."""
    client: Redis = Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_timeout=timeout,
        retry=retry_policy(retries),
        retry_on_error=list(RETRY_ON if retry_timeouts else RETRY_ON_CONNECTION),
    )
    return client


def listener(url: str) -> Redis:
    """A client for pub/sub: reads wait for the next message however long that takes (a command
    timeout would end an idle subscription); keepalive finds a dead peer."""
    # TCP only: redis-py's unix-socket connection refuses keepalive with a TypeError (which once
    # killed the gateway's fan-out on `fleet up`, whose private Redis is a unix socket).
    keepalive = {} if url.startswith("unix:") else {"socket_keepalive": True}
    client: Redis = Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS, health_check_interval=30, **keepalive
    )
    return client
