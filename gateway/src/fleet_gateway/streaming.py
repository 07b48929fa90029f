"""The Turn stream: start, the Run's events (log first, then live), heartbeats, terminal, DONE.

One stream follows one Run from a position (the start, or a client's Last-Event-ID). It rides out
Redis faults: it keeps heartbeating, reads the log again once Redis is back, and asks the DB
whether the Run settled meanwhile. A stream lives at most `gateway.stream_max_seconds`, or until
the gateway stops; then it ends without `[DONE]` and the client resumes where it was.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_gateway.fanout import Closing, EventFanout, Notice
from fleet_gateway.frames import DONE_FRAME, START, Position, content_frame, control_frame
from fleet_gateway.metrics import ACTIVE_STREAMS
from fleet_gateway.projection import (
    Chunk,
    Delivery,
    StreamState,
    heartbeat_chunk,
    project,
    start_chunk,
    status_chunk,
)
from fleet_shared import event_log
from fleet_shared.db import queries
from fleet_shared.db.models import Run
from fleet_shared.events import Phase, RunCancelled, RunCompleted, RunEvent, RunFailed
from fleet_shared.run_state import RunStatus, is_terminal

log = structlog.get_logger(__name__)

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Vercel-AI-UI-Message-Stream": "v1",
    "X-Accel-Buffering": "no",
}
DB_CHECK_EVERY_BEATS = 3
RECONNECT_SECONDS = (0.1, 0.25, 0.5, 1.0, 2.0)  # after a Redis fault, re-read the log this often


@dataclass(frozen=True)
class StreamDeps:
    redis: Redis
    fanout: EventFanout
    db_sessions: async_sessionmaker[AsyncSession]
    heartbeat_seconds: float
    max_seconds: float = 900.0


@dataclass(frozen=True)
class RunView:
    """The Run fields a stream needs, detached from any DB session."""

    id: str
    session_id: str
    model: str
    created_at: datetime
    status: str

    @classmethod
    def of(cls, run: Run) -> RunView:
        return cls(run.id, run.session_id, run.model, run.created_at, run.status)


def iso(moment: datetime) -> str:
    if moment.tzinfo is None:  # SQLite hands back naive datetimes; we always store UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.isoformat().replace("+00:00", "Z")


@dataclass
class Cursor:
    """Where this connection is: the last content frame sent (or resumed from), control frames since."""

    position: Position = START
    controls: int = 0
    # The stream state as of the last shared frames it took (emit_live); None once anything
    # else changed the state. Saves building a snapshot per live event.
    known_state: Snapshot | None = field(default=None, compare=False)

    def control(self, chunk: Chunk) -> bytes:
        self.controls += 1
        return control_frame(self.position, self.controls, chunk)


async def stream_run(
    deps: StreamDeps,
    run: RunView,
    *,
    delivery: Delivery,
    idempotent_replay: bool = False,
    from_db: bool = False,
    fresh: bool = False,
    after: Position = START,
) -> AsyncIterator[bytes]:
    """The whole SSE body. `from_db` streams a settled Run from its committed events only;
    `fresh`: this request created the Run, so it cannot have ended before the stream opened."""
    state = StreamState(run.id, run.session_id, idempotent_replay=idempotent_replay)
    cursor = Cursor(after)
    ACTIVE_STREAMS.inc()
    try:  # a client that goes away closes the generator: the finally still runs
        yield cursor.control(
            start_chunk(state, created_at=iso(run.created_at), delivery=delivery, model=run.model)
        )
        source = (
            replay_from_db(deps, run, state, cursor)
            if from_db
            else follow_live(deps, run, state, cursor, fresh=fresh)
        )
        try:
            async for data in source:
                yield data
        except (SQLAlchemyError, RedisError, OSError) as exc:
            log.warning("stream.cut_short", run_id=run.id, error_type=type(exc).__name__)
        if state.finished:
            yield DONE_FRAME
        else:  # cut short (lifetime cap, gateway stopping): the client resumes from its last id
            yield cursor.control(status_chunk(state.phase, "reconnect", "resume with Last-Event-ID"))
    finally:
        ACTIVE_STREAMS.dec()


def emit(events: Iterable[RunEvent], state: StreamState, cursor: Cursor) -> list[bytes]:
    """Project events in seq order; send the chunks after the cursor, each as its own frame.

    An event's frames leave in one write, but each has its own id, so a client cut off inside
    an event resumes at the next chunk. Events before the cursor are projected (the stream's
    state needs them) but not sent."""
    out: list[bytes] = []
    cursor.known_state = None
    for event in events:
        if event.seq <= state.projected_seq or state.finished:
            continue  # already projected (log and live overlap), or after the terminal
        frames = []
        for index, chunk in enumerate(project(event, state)):
            position = Position(event.seq, index)
            if position > cursor.position:
                frames.append(content_frame(position, chunk))
                cursor.position, cursor.controls = position, 0
        if frames:
            out.append(b"".join(frames))
    return out


async def replay_from_db(
    deps: StreamDeps, run: RunView, state: StreamState, cursor: Cursor
) -> AsyncIterator[bytes]:
    async with deps.db_sessions() as db:
        events = await queries.load_run_events(db, run.id)
        row = await queries.get_run(db, run.id)
    for data in emit(events, state, cursor):
        yield data
    if not state.finished and row is not None:
        for data in emit([terminal_from_row(row, state.projected_seq + 1)], state, cursor):
            yield data


async def follow_live(
    deps: StreamDeps, run: RunView, state: StreamState, cursor: Cursor, *, fresh: bool = False
) -> AsyncIterator[bytes]:
    """Log first, then live notices; the log again after any gap, resync or Redis fault.
    The DB is asked at once whether the Run ended, unless `fresh`: a Run this request just
    created cannot have (one lookup less on every Turn's first write)."""
    loop = asyncio.get_running_loop()
    # Jitter: streams opened together (after a deploy) do not all reconnect at the same moment.
    deadline = loop.time() + deps.max_seconds * random.uniform(0.9, 1.0)
    last_sent = loop.time()
    faults = beats = 0
    read_log = True
    check_db = not fresh  # the DB: a Run may have ended without (more) log, e.g. Redis lost it
    # Subscribe before reading the log: an event published in between is then in one or both.
    async with deps.fanout.subscribe(run.id) as inbox:
        while not state.finished:
            out: list[bytes] = []
            if read_log:
                try:
                    out = emit(
                        await event_log.read_all_after(deps.redis, run.id, state.projected_seq), state, cursor
                    )
                    read_log, faults = False, 0
                except (RedisError, OSError) as exc:
                    if faults == 0:
                        log.warning("stream.redis_unavailable", run_id=run.id, error_type=type(exc).__name__)
                    faults += 1
                    check_db = check_db or faults == 1
            if check_db and not state.finished:
                out += await settled_in_db(deps, run, state, cursor)
                check_db = False
            for data in out:
                yield data
                last_sent = loop.time()
            if state.finished:
                return
            now = loop.time()
            if now >= deadline:
                return
            wait = deps.heartbeat_seconds - (now - last_sent)
            if faults:
                wait = min(wait, reconnect_delay(faults))
            notices = inbox.take()
            if not notices:
                wake_at = min(now + wait, deadline)
                await inbox.wait(wake_at)
                notices = inbox.take()
                if not notices:  # the stream's time ran out, not a notice
                    read_log = True  # cheap, and catches anything a lost notice hid
                    if loop.time() - last_sent >= deps.heartbeat_seconds:
                        beats += 1
                        # Every few beats, or every beat while Redis is away: did the Run end?
                        check_db = faults > 0 or beats % DB_CHECK_EVERY_BEATS == 0
                        yield cursor.control(heartbeat_chunk(state))
                        last_sent = loop.time()
                    continue
            # Everything queued meanwhile goes out as one write: a busy Run costs one send per
            # wake-up of this stream, not one per event.
            applied = apply_notices(notices, state, cursor)
            read_log = read_log or applied.gap
            check_db = check_db or applied.resync
            if applied.frames:
                yield b"".join(applied.frames)
                last_sent = loop.time()
            if applied.closing:
                return


@dataclass
class Applied:
    frames: list[bytes]
    closing: bool = False  # the gateway is stopping: end the stream (the client resumes)
    gap: bool = False  # a notice out of order: read the log
    resync: bool = False  # the fan-out reconnected: read the log and ask the DB


def apply_notices(notices: list[Notice], state: StreamState, cursor: Cursor) -> Applied:
    applied = Applied(frames=[])
    for notice in notices:
        if isinstance(notice, Closing):
            applied.closing = True
            break
        if notice is not None and notice.seq == state.projected_seq + 1:
            data = emit_live(notice, state, cursor)
            if data:
                applied.frames.append(data)
        else:
            applied.gap = True
            applied.resync = applied.resync or notice is None
    return applied


# --- frames shared by the streams of a Run ------------------------------------------------------

SHARED_FRAMES_KEPT = 512  # recent live events whose frames are remembered (each entry holds its event)


@dataclass(frozen=True)
class SharedFrames:
    """One live event's frames as a caught-up stream sends them. The fan-out hands every stream
    of a Run the same event object, and streams in the same state send the same bytes: the first
    stream to reach the event projects and encodes it, the others take the result."""

    event: RunEvent
    before: Snapshot  # the stream state it applies to
    after: Snapshot  # the stream state it leaves
    data: bytes
    position: Position | None  # the cursor after it (None: the event had no chunks)


SHARED_FRAMES: dict[int, SharedFrames] = {}  # by id(event); insertion order is age


class Snapshot(NamedTuple):
    """Everything of a stream's state that `project` reads or changes, but projected_seq."""

    phase: Phase
    step_open: bool
    open_tools: frozenset[str]
    finished: bool
    idempotent_replay: bool
    open_reasoning: frozenset[str]
    open_text: frozenset[str]
    input_streaming: frozenset[str]


def snapshot(state: StreamState) -> Snapshot:
    return Snapshot(
        state.phase,
        state.step_open,
        frozenset(state.open_tools),
        state.finished,
        state.idempotent_replay,
        frozenset(state.open_reasoning),
        frozenset(state.open_text),
        frozenset(state.input_streaming),
    )


def emit_live(event: RunEvent, state: StreamState, cursor: Cursor) -> bytes:
    """emit() for a stream's next live event, shared by the Run's streams that are caught up."""
    if cursor.position.seq >= event.seq:  # resumed inside this event: frames of its own
        return b"".join(emit([event], state, cursor))
    before = cursor.known_state or snapshot(state)
    shared = SHARED_FRAMES.get(id(event))
    if shared is not None and shared.event is event and shared.before == before:
        after = shared.after
        if after is not before:
            state.phase, state.step_open, state.finished = after.phase, after.step_open, after.finished
            if state.open_tools != after.open_tools:
                state.open_tools = set(after.open_tools)
            if state.open_reasoning != after.open_reasoning:
                state.open_reasoning = set(after.open_reasoning)
            if state.open_text != after.open_text:
                state.open_text = set(after.open_text)
            if state.input_streaming != after.input_streaming:
                state.input_streaming = set(after.input_streaming)
        state.projected_seq = max(state.projected_seq, event.seq)
        if shared.position is not None:
            cursor.position, cursor.controls = shared.position, 0
        cursor.known_state = after
        return shared.data
    frames = emit([event], state, cursor)
    data = b"".join(frames)
    position = cursor.position if frames else None
    after = snapshot(state)
    if after == before:
        after = before  # the same object: the next stream to take these frames skips the copy
    SHARED_FRAMES[id(event)] = SharedFrames(event, before, after, data, position)
    cursor.known_state = after
    if len(SHARED_FRAMES) > SHARED_FRAMES_KEPT:
        del SHARED_FRAMES[next(iter(SHARED_FRAMES))]
    return data


def reconnect_delay(faults: int) -> float:
    return RECONNECT_SECONDS[min(faults, len(RECONNECT_SECONDS)) - 1]


async def settled_in_db(deps: StreamDeps, run: RunView, state: StreamState, cursor: Cursor) -> list[bytes]:
    """A Run that ended without (more) logged events: its log was lost, or never written."""
    try:
        async with deps.db_sessions() as db:
            row = await queries.get_run(db, run.id)
            if row is None or not is_terminal(row.status):
                return []
            events = await queries.load_run_events(db, run.id, state.projected_seq)
    except (SQLAlchemyError, OSError) as exc:
        log.warning("stream.db_unavailable", run_id=run.id, error_type=type(exc).__name__)
        return []
    out = emit(events, state, cursor)
    if not state.finished:
        out.extend(emit([terminal_from_row(row, state.projected_seq + 1)], state, cursor))
    return out


def terminal_from_row(row: Run, seq: int) -> RunEvent:
    status = RunStatus(row.status)
    if status is RunStatus.COMPLETED:
        started = row.started_at or row.created_at
        finished = row.finished_at or started
        return RunCompleted(
            run_id=row.id, seq=seq, duration_ms=int((finished - started).total_seconds() * 1000)
        )
    if status is RunStatus.CANCELLED:
        return RunCancelled(run_id=row.id, seq=seq)
    return RunFailed(
        run_id=row.id,
        seq=seq,
        code=row.failure_code or status.value,
        message=row.failure_message or f"the Turn ended as {status.value}",
    )
