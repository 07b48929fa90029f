"""A pub/sub subscription that stays up, for the gateway's event fan-out and the worker's control
listener: both must hear every notice while Redis is there, and catch up on what they missed
whenever it comes back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared.backoff import Backoff

log = structlog.get_logger(__name__)
FIRST_RETRY_SECONDS = 0.2
MAX_RETRY_SECONDS = 5.0
OnMessage = Callable[[bytes, bytes], None]  # (channel, data)


class ResilientSubscription:
    """Subscribes to `channels` and hands every message to `on_message`, until cancelled.

    After each (re)subscribe `on_connected` runs: what was published while the subscription was
    down is lost to it, so the owner re-reads the truth (the event logs, the cancel flags). Any
    failure, not only a Redis error, is logged as `<name>.disconnected` and the subscription is
    made again after a capped exponential delay, which starts over once a subscription held:
    a listener that died quietly would leave its owner on its slow fallback for good.
    """

    def __init__(
        self,
        redis: Redis,
        channels: Sequence[str | bytes],
        on_message: OnMessage,
        *,
        name: str,
        on_connected: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.redis = redis
        self.channels = channels
        self.on_message = on_message
        self.on_connected = on_connected
        self.name = name
        self.connected = asyncio.Event()

    async def run_forever(self) -> None:
        backoff = Backoff(FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS)
        while True:
            try:
                await self.listen_once()
            except Exception as exc:
                if self.connected.is_set():
                    backoff.reset()
                self.connected.clear()
                delay = backoff.next()
                log.warning(
                    f"{self.name}.disconnected", error_type=type(exc).__name__, error=str(exc), retry_in=delay
                )
                await asyncio.sleep(delay)

    async def listen_once(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(*self.channels)
            self.connected.set()
            if self.on_connected is not None:
                await self.on_connected()
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    self.on_message(message["channel"], message["data"])
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
