"""One Redis pub/sub connection per gateway process, fanned out in memory to every SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

import msgspec
import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared import event_log
from fleet_shared.events import RunEvent, decode_event

log = structlog.get_logger(__name__)

MIN_RETRY_SECONDS = 0.2
MAX_RETRY_SECONDS = 5.0
RESYNC = None  # queued to every subscriber after a reconnect: "re-read the log, you may have a gap"


class Closing:
    """Queued to every subscriber when the gateway stops: "end now, the client will resume"."""


CLOSING = Closing()
Notice = RunEvent | Closing | None


class EventFanout:
    """Subscribes once to the events channel and routes each event to the streams of its Run."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.subscribers: dict[str, set[asyncio.Queue[Notice]]] = defaultdict(set)
        self.task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    async def start(self) -> None:
        self.task = asyncio.create_task(self.listen_forever(), name="fleet-fanout")

    async def stop(self) -> None:
        for queues in self.subscribers.values():
            for queue in queues:
                queue.put_nowait(CLOSING)
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    @contextlib.asynccontextmanager
    async def subscribe(self, run_id: str) -> AsyncIterator[asyncio.Queue[Notice]]:
        queue: asyncio.Queue[Notice] = asyncio.Queue()
        self.subscribers[run_id].add(queue)
        try:
            yield queue
        finally:
            subscribers = self.subscribers.get(run_id)
            if subscribers is not None:
                subscribers.discard(queue)
                if not subscribers:
                    del self.subscribers[run_id]

    @property
    def active_streams(self) -> int:
        return sum(len(queues) for queues in self.subscribers.values())

    async def listen_forever(self) -> None:
        delay = MIN_RETRY_SECONDS
        while True:
            try:
                await self.listen_once()
            except Exception as exc:  # any failure: log it and listen again, never die
                # Not only Redis errors: a client that cannot even connect (a TypeError once)
                # must not end the fan-out silently and leave streams on the heartbeat poll.
                if self.connected.is_set():
                    delay = MIN_RETRY_SECONDS  # it was up: start the back-off again
                self.connected.clear()
                log.warning(
                    "fanout.disconnected", error_type=type(exc).__name__, error=str(exc), retry_in=delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_SECONDS)

    async def listen_once(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(event_log.events_channel(self.redis))
            self.connected.set()
            self.broadcast_resync()  # anything published while we were away is in the logs
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    self.dispatch(message["data"])
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    def dispatch(self, data: bytes) -> None:
        try:
            event = decode_event(data)
        except msgspec.DecodeError:  # a foreign publisher on our channel must not kill the fan-out
            log.warning("fanout.undecodable_event", size=len(data))
            return
        for queue in self.subscribers.get(event.run_id, ()):
            queue.put_nowait(event)

    def broadcast_resync(self) -> None:
        for queues in self.subscribers.values():
            for queue in queues:
                queue.put_nowait(RESYNC)
