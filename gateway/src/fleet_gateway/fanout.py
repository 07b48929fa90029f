"""One Redis pub/sub connection per gateway process, fanned out in memory to every SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

import msgspec
import structlog
from redis.asyncio import Redis

from fleet_shared import event_log
from fleet_shared.events import RunEvent, decode_event
from fleet_shared.subscription import ResilientSubscription

log = structlog.get_logger(__name__)

ALARM_SLACK_SECONDS = 0.001
RESYNC = None  # queued to every subscriber after a reconnect: "re-read the log, you may have a gap"


class Closing:
    """Queued to every subscriber when the gateway stops: "end now, the client will resume"."""


CLOSING = Closing()
Notice = RunEvent | Closing | None


class Inbox:
    """One stream's notices, and the stream's wake-up.

    Per delivered event this costs a list append and, if the stream sleeps, one future. No
    asyncio.Queue (its get builds a future and looks up the running loop each time) and no
    timeout per wait: the stream's alarm is one timer kept across wake-ups, armed again only when
    it rings before it is due. A busy stream's heartbeat deadline keeps moving later, so the
    alarm rings about once per heartbeat period, not once per event."""

    __slots__ = ("alarm", "alarm_at", "items", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[Notice] = []
        self.waiter: asyncio.Future[None] | None = None
        self.alarm: asyncio.TimerHandle | None = None
        self.alarm_at = 0.0

    def put(self, notice: Notice) -> None:
        self.items.append(notice)
        self.wake()

    def take(self) -> list[Notice]:
        """What is queued now, without waiting (a list of the caller's own)."""
        items = self.items
        if not items:
            return []
        self.items = []
        return items

    async def wait(self, until: float) -> None:
        """Return once a notice is queued, or once the loop's clock reaches `until`."""
        loop = self.loop
        while not self.items and loop.time() < until:
            if self.alarm is None or self.alarm_at > until:
                if self.alarm is not None:
                    self.alarm.cancel()
                # A millisecond late on purpose: uvloop keeps time in whole milliseconds and may
                # ring a little before `until`; re-armed for the sub-millisecond rest, it would
                # spin (a call_soon per turn of the loop) until its clock ticks over.
                self.alarm, self.alarm_at = loop.call_at(until + ALARM_SLACK_SECONDS, self.ring), until
            self.waiter = loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def ring(self) -> None:
        self.alarm = None
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        if self.alarm is not None:
            self.alarm.cancel()
            self.alarm = None


class EventFanout:
    """Subscribes once to the events channel and routes each event to the streams of its Run."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.subscribers: dict[str, set[Inbox]] = defaultdict(set)
        self.task: asyncio.Task[None] | None = None
        self.subscription = ResilientSubscription(
            redis,
            [event_log.events_channel(redis)],
            lambda _channel, data: self.dispatch(data),
            name="fanout",
            on_connected=self.resync,
        )
        self.connected = self.subscription.connected

    async def start(self) -> None:
        self.task = asyncio.create_task(self.subscription.run_forever(), name="fleet-fanout")

    async def stop(self) -> None:
        for inboxes in self.subscribers.values():
            for inbox in inboxes:
                inbox.put(CLOSING)
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    @contextlib.asynccontextmanager
    async def subscribe(self, run_id: str) -> AsyncIterator[Inbox]:
        inbox = Inbox(asyncio.get_running_loop())
        self.subscribers[run_id].add(inbox)
        try:
            yield inbox
        finally:
            inbox.close()
            subscribers = self.subscribers.get(run_id)
            if subscribers is not None:
                subscribers.discard(inbox)
                if not subscribers:
                    del self.subscribers[run_id]

    @property
    def active_streams(self) -> int:
        return sum(len(inboxes) for inboxes in self.subscribers.values())

    async def resync(self) -> None:
        self.broadcast_resync()  # anything published while we were away is in the logs

    def dispatch(self, data: bytes) -> None:
        try:
            event = decode_event(data)
        except msgspec.DecodeError:  # a foreign publisher on our channel must not kill the fan-out
            log.warning("fanout.undecodable_event", size=len(data))
            return
        for inbox in self.subscribers.get(event.run_id, ()):
            inbox.put(event)

    def broadcast_resync(self) -> None:
        for inboxes in self.subscribers.values():
            for inbox in inboxes:
                inbox.put(RESYNC)
