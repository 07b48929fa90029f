"""Cancel notices on one pub/sub connection per worker process, routed to the Turns it runs.

A notice is the fast path; the Run's cancel flag is the truth, read again on every lease renewal
and whenever this listener (re)connects, so a missed notice delays a cancel by at most a third
of the lease TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared import redis_keys
from fleet_shared.event_log import control_channel
from fleet_shared.subscription import ResilientSubscription

log = structlog.get_logger(__name__)


class CancelListener:
    def __init__(self, redis: Redis, listener: Redis) -> None:
        self.redis = redis  # commands (with retries)
        self.listener = listener  # the subscription (reads wait as long as it takes)
        self.watchers: dict[str, Callable[[], None]] = {}
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        channels: list[str | bytes] = [control_channel(self.listener)]
        subscription = ResilientSubscription(
            self.listener, channels, self.on_message, name="cancel_listener", on_connected=self.catch_up
        )
        self.task = asyncio.create_task(subscription.run_forever(), name="fleet-cancel-listener")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    @contextlib.contextmanager
    def watch(self, run_id: str, on_cancel: Callable[[], None]) -> Iterator[None]:
        self.watchers[run_id] = on_cancel
        try:
            yield
        finally:
            self.watchers.pop(run_id, None)

    async def check_flags(self, run_ids: list[str]) -> None:
        """Notify the watchers of Runs whose cancel flag is set; quietly nothing if Redis is away
        (each lease renewal reads the flag again)."""
        try:
            await self.notify_flagged(run_ids)
        except (RedisError, OSError) as exc:
            log.warning("cancel_listener.check_failed", error_type=type(exc).__name__)

    async def notify_flagged(self, run_ids: list[str]) -> None:
        if not run_ids:
            return
        flags = await self.redis.exists(*(redis_keys.run_cancel(r) for r in run_ids))
        if flags:  # rare: look at each only when some flag is set
            for run_id in run_ids:
                if await self.redis.exists(redis_keys.run_cancel(run_id)):
                    self.notify(run_id)

    def notify(self, run_id: str) -> None:
        on_cancel = self.watchers.get(run_id)
        if on_cancel is not None:
            log.info("turn.cancel_requested", run_id=run_id)
            on_cancel()

    async def catch_up(self) -> None:
        await self.check_flags(list(self.watchers))  # the cancels we missed while away

    def on_message(self, channel: bytes, data: bytes) -> None:
        self.notify(data.decode(errors="replace"))
