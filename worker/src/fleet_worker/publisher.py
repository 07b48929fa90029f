"""Publishing a Run's events: stamped in order, kept for the commit, logged to Redis under the lease.

Stamping is synchronous (so everything emitted before the settle is in the commit); publishing is
one task that appends in seq order and rides out Redis faults: it retries with backoff, refills a
log that Redis lost, and, when its append is refused, asks the lease whether the Run is still
its own. The terminal event is held back until the commit has landed.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import structlog
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from fleet_shared.backoff import Backoff
from fleet_shared.event_log import APPEND_BATCH_EVENTS, Appended, RunLog
from fleet_shared.events import (
    CellOutput,
    CodeCell,
    CodeDelta,
    IterationFinished,
    IterationStarted,
    LMQueryFinished,
    LMQueryStarted,
    Reasoning,
    ReasoningDelta,
    RunEvent,
    RunWarning,
    Sequencer,
    encode_event,
)
from fleet_worker.lease import RunLease
from fleet_worker.sandbox.boundary import clean

log = structlog.get_logger(__name__)
FIRST_RETRY_SECONDS = 0.05
MAX_RETRY_SECONDS = 1.0


# What a Turn may drop once it has produced `max_events`: the steps, not its status or ending.
STEP_EVENTS = (
    IterationStarted,
    IterationFinished,
    Reasoning,
    ReasoningDelta,
    CodeDelta,
    CodeCell,
    CellOutput,
    LMQueryStarted,
    LMQueryFinished,
)


class EventSink:
    def __init__(self, runlog: RunLog, run_id: str, lease: RunLease, max_events: int = 1_000_000) -> None:
        self.runlog = runlog
        self.lease = lease
        self.max_events = max_events
        self.capped = False
        self.broken: str | None = None  # why publishing stopped for a reason other than the fence
        self.sequencer = Sequencer(run_id)
        self.events: list[RunEvent] = []
        self.published = 0  # events[:published] are in the log
        self.held_back: int | None = None  # the terminal's index, until its commit lands
        self.accepting_thread_events = True
        self.fenced = False
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()  # set when the terminal is published, or publishing stopped
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.create_task(self.publish_forever(), name=f"fleet-events-{run_id}")
        lease.on_regained = self.refill

    def refill(self) -> None:
        """The lease was taken back (Redis lost it, maybe with the log): send the last event again,
        which finds the log intact (a duplicate) or reports where it ends (a gap) and refills it."""
        self.published = max(0, self.published - 1)
        self.wakeup.set()

    def emit_threadsafe(self, event: RunEvent) -> None:
        """Called from the RLM's thread."""
        self.loop.call_soon_threadsafe(self.accept_from_thread, event)

    def accept_from_thread(self, event: RunEvent) -> None:
        if self.accepting_thread_events:  # a program we stopped waiting for may still talk
            self.emit(event)

    def emit(self, event: RunEvent) -> None:
        if self.sequencer.closed:
            return
        if len(self.events) >= self.max_events and isinstance(event, STEP_EVENTS):
            if not self.capped:  # one warning, then the steps go unrecorded
                self.capped = True
                message = f"the Turn produced over {self.max_events} events; later steps are not shown"
                self.emit(RunWarning(run_id=event.run_id, code="events_capped", message=message))
            return
        self.events.append(self.sequencer.stamp(encodable(event)))
        self.wakeup.set()

    def stamp_terminal(self, event: RunEvent) -> RunEvent:
        """Stamp the terminal event so it can be committed; it is published by `finish`."""
        self.accepting_thread_events = False
        stamped = self.sequencer.stamp(event)
        self.held_back = len(self.events)
        self.events.append(stamped)
        return stamped

    async def finish(self, *, within: float) -> bool:
        """Publish everything, the terminal included (after its commit); False if it could not."""
        self.held_back = None
        self.wakeup.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self.idle.wait()
        done = self.published == len(self.events)
        if not done:
            log.warning("events.terminal_not_published", fenced=self.fenced)
        return done

    def publishable(self) -> int:
        return len(self.events) if self.held_back is None else self.held_back

    async def publish_forever(self) -> None:
        try:
            await self.publish_until_fenced()
        finally:
            self.idle.set()

    async def publish_until_fenced(self) -> None:
        backoff = Backoff(FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS)
        while not self.fenced:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.published < self.publishable() and not self.fenced:
                try:
                    await self.publish_next()
                    backoff.reset()
                except (RedisError, OSError, SQLAlchemyError) as exc:
                    if not backoff.failures:
                        log.warning("events.redis_unavailable", error_type=type(exc).__name__)
                    await asyncio.sleep(backoff.next())
                except Exception as exc:  # a bug, or an event nothing could encode: the Turn fails
                    log.error("events.pump_failed", error_type=type(exc).__name__, exc_info=exc)
                    self.broken = f"{type(exc).__name__}: {exc}"[:500]
                    return
            if self.held_back is None and self.published == len(self.events) and self.sequencer.closed:
                return

    async def publish_next(self) -> None:
        """Append what is waiting, from the first unpublished event, in one round trip: the events
        a step emits together (or that piled up during the last append) travel as one batch."""
        end = min(self.publishable(), self.published + APPEND_BATCH_EVENTS)
        waiting = self.events[self.published : end]
        result, sent = await self.runlog.append_batch(waiting, self.lease.token)
        if result.status is Appended.GAP:
            self.published = min(result.last_seq, self.published)  # refill from the log's end
        elif result.status is Appended.FENCED:
            # Redis may only have lost the lease (a restart): the lease takes it back if it can.
            if not await self.lease.verify():
                self.fenced = True
                log.warning("events.fenced_out", seq=self.events[self.published].seq)
        else:
            self.published += sent

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


def encodable(event: RunEvent) -> RunEvent:
    """The event, or (rarely) a copy whose strings lost their lone surrogates: an LM's text, say.
    Nothing that cannot be encoded reaches the log or the commit."""
    try:
        encode_event(event)
    except UnicodeEncodeError:
        return msgspec.convert(clean(msgspec.to_builtins(event)), type(event))
    return event
