"""Publishing a Run's events: thread-safe intake, one ordered pump to Redis, a copy for the commit."""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared import event_log
from fleet_shared.events import RunEvent, Sequencer

log = structlog.get_logger(__name__)


class EventSink:
    """Stamps each event with the next seq, logs it to Redis, and keeps it for the DB commit.

    If Redis fails mid-Run the events are still committed with the Turn, so nothing is lost;
    live viewers fall back to the committed copy.
    """

    def __init__(self, redis: Redis, run_id: str) -> None:
        self.redis = redis
        self.sequencer = Sequencer(run_id)
        self.events: list[RunEvent] = []
        self.queue: asyncio.Queue[RunEvent | None] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.redis_ok = True
        self.pump_task = asyncio.create_task(self.pump(), name=f"fleet-events-{run_id}")

    def emit_threadsafe(self, event: RunEvent) -> None:
        """Called from the RLM's thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def emit(self, event: RunEvent) -> None:
        self.queue.put_nowait(event)

    async def pump(self) -> None:
        while (event := await self.queue.get()) is not None:
            await self.publish(self.sequencer.stamp(event))

    async def publish(self, stamped: RunEvent) -> None:
        self.events.append(stamped)
        if not self.redis_ok:
            return
        try:
            await event_log.append(self.redis, stamped)
        except (RedisError, OSError) as exc:
            self.redis_ok = False
            log.warning("events.redis_unavailable", error=str(exc))

    async def drain(self) -> None:
        """Wait until everything emitted so far is stamped and published."""
        if not self.pump_task.done():
            self.queue.put_nowait(None)
            await self.pump_task

    def stamp_terminal(self, event: RunEvent) -> RunEvent:
        """Stamp the terminal event (after `drain`) so it can be committed before it is published."""
        stamped = self.sequencer.stamp(event)
        self.events.append(stamped)
        return stamped

    async def publish_terminal(self, stamped: RunEvent) -> None:
        try:
            await event_log.append(self.redis, stamped)
        except (RedisError, OSError) as exc:
            log.warning("events.terminal_not_published", error=str(exc))

    async def close(self) -> None:
        if not self.pump_task.done():
            self.pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pump_task
