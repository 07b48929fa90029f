"""The Turn stream: start, then the Run's events (log first, then live), heartbeats, terminal, DONE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_gateway.fanout import EventFanout
from fleet_gateway.projection import (
    Chunk,
    Delivery,
    StreamState,
    heartbeat_chunk,
    project,
    start_chunk,
)
from fleet_shared import event_log
from fleet_shared.db import queries
from fleet_shared.db.models import Run
from fleet_shared.events import RunCancelled, RunCompleted, RunEvent, RunFailed
from fleet_shared.run_state import RunStatus, is_terminal

log = structlog.get_logger(__name__)

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Vercel-AI-UI-Message-Stream": "v1",
    "X-Accel-Buffering": "no",
}
DONE_FRAME = b"data: [DONE]\n\n"
DB_CHECK_EVERY_BEATS = 3
CHUNK_ENCODER = msgspec.json.Encoder()


def frame(seq: int, chunk: Chunk) -> bytes:
    return b"id: %d\ndata: %s\n\n" % (seq, CHUNK_ENCODER.encode(chunk))


@dataclass(frozen=True)
class StreamDeps:
    redis: Redis
    fanout: EventFanout
    sessions: async_sessionmaker[AsyncSession]
    heartbeat_seconds: float


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


async def stream_run(
    deps: StreamDeps,
    run: RunView,
    *,
    delivery: Delivery,
    idempotent_replay: bool = False,
    from_db: bool = False,
) -> AsyncIterator[bytes]:
    """The whole SSE body. `from_db` streams a settled Run from its committed events only."""
    state = StreamState(run.id, run.session_id, idempotent_replay=idempotent_replay)
    start = start_chunk(state, created_at=iso(run.created_at), delivery=delivery, model=run.model)
    yield frame(0, start)
    try:
        if from_db:
            async for data in replay_from_db(deps, run, state):
                yield data
        else:
            async for data in follow_live(deps, run, state):
                yield data
    except (RedisError, OSError, SQLAlchemyError) as exc:
        log.warning("stream.interrupted", run_id=run.id, error=str(exc))
        yield frame(state.last_seq, {"type": "error", "errorText": interrupted_text()})
        yield frame(state.last_seq, {"type": "finish", "finishReason": "error"})
    yield DONE_FRAME


def interrupted_text() -> str:
    return (
        "service_unavailable: the event stream was interrupted; the Turn keeps running "
        "and its result will appear in the session history"
    )


def emit(events: Iterable[RunEvent], state: StreamState) -> list[bytes]:
    """One write per event: its chunks share its `id:` and leave the server together, so a
    client's Last-Event-ID never points into the middle of an event."""
    out: list[bytes] = []
    for event in events:
        if event.seq <= state.last_seq or state.finished:
            continue  # already sent (log and live overlap) or after the terminal
        out.append(b"".join(frame(event.seq, chunk) for chunk in project(event, state)))
    return out


async def replay_from_db(deps: StreamDeps, run: RunView, state: StreamState) -> AsyncIterator[bytes]:
    async with deps.sessions() as db:
        events = await queries.load_run_events(db, run.id)
        row = await queries.get_run(db, run.id)
    for data in emit(events, state):
        yield data
    if not state.finished and row is not None:
        for data in emit([terminal_from_row(row, state.last_seq + 1)], state):
            yield data


async def follow_live(deps: StreamDeps, run: RunView, state: StreamState) -> AsyncIterator[bytes]:
    # Subscribe before reading the log: an event published in between is then in one or both.
    async with deps.fanout.subscribe(run.id) as queue:
        for data in emit(await event_log.read_all_after(deps.redis, run.id, 0), state):
            yield data
        if not state.finished:
            for data in await settled_without_log(deps, run, state):
                yield data
        idle_beats = 0
        while not state.finished:
            try:
                notice = await asyncio.wait_for(queue.get(), timeout=deps.heartbeat_seconds)
            except TimeoutError:
                yield frame(state.last_seq, heartbeat_chunk(state))
                idle_beats += 1
                out = emit(await event_log.read_all_after(deps.redis, run.id, state.last_seq), state)
                # The DB check (a Run that ended without logging it) is rarer: every open stream
                # would otherwise query the DB on every heartbeat.
                if not out and idle_beats % DB_CHECK_EVERY_BEATS == 0:
                    out = await settled_without_log(deps, run, state)
                for data in out:
                    yield data
                continue
            idle_beats = 0
            if notice is not None and notice.seq == state.last_seq + 1:
                batch: list[RunEvent] = [notice]
            else:  # a resync, or a gap: the log has everything in order
                batch = await event_log.read_all_after(deps.redis, run.id, state.last_seq)
            for data in emit(batch, state):
                yield data


async def settled_without_log(deps: StreamDeps, run: RunView, state: StreamState) -> list[bytes]:
    """A Run that ended without (more) logged events: failed to enqueue, or its log expired."""
    async with deps.sessions() as db:
        row = await queries.get_run(db, run.id)
        if row is None or not is_terminal(row.status):
            return []
        events = await queries.load_run_events(db, run.id, state.last_seq)
    out = emit(events, state)
    if not state.finished:
        out.extend(emit([terminal_from_row(row, state.last_seq + 1)], state))
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
