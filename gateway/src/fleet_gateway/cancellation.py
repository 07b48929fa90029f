"""Cancelling a Run: at once while it is queued, by flag and notice while a worker runs it; and
deleting a session, which cancels its active Run first."""

from __future__ import annotations

import asyncio
import functools
from typing import Literal

import structlog
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.state import GatewayState
from fleet_shared import redis_keys
from fleet_shared.db import purge, queries, runs, waiting
from fleet_shared.db.engine import run_whole
from fleet_shared.db.models import Run
from fleet_shared.db.purge import Purged
from fleet_shared.event_log import control_channel
from fleet_shared.events import RunEvent
from fleet_shared.followups import start_promoted
from fleet_shared.metrics import count_cancel
from fleet_shared.recovery import publish_ending
from fleet_shared.run_state import RunStatus, is_terminal

log = structlog.get_logger(__name__)
CancelState = Literal["requested", "already_requested", "already_terminal"]
CANCEL_WAIT_SECONDS = 10.0  # a DELETE, or an interrupting Turn, waits this long for a cancelled Run


async def request_cancellation(gw: GatewayState, db: AsyncSession, run: Run) -> CancelState:
    run_id = run.id
    if is_terminal(run.status):
        return "already_terminal"
    if run.status == RunStatus.WAITING.value:
        if await cancel_waiting(gw, run_id):
            count_cancel("waiting")
            return "requested"
        found = await queries.get_run(db, run_id)  # promoted meanwhile, ended, or withdrawn
        if found is None or is_terminal(found.status):
            return "already_terminal"
        run = found
    if run.status == RunStatus.QUEUED.value:
        if await cancel_queued(gw, db, run):
            count_cancel("queued")
            return "requested"
        found = await queries.get_run(db, run_id)  # a worker started it meanwhile
        if found is None or is_terminal(found.status):
            return "already_terminal"
    # Redis is the only way to reach the worker: if it is down, this raises and the caller gets 503.
    first = await gw.redis.set(
        redis_keys.run_cancel(run_id), "1", nx=True, ex=redis_keys.CANCEL_FLAG_TTL_SECONDS
    )
    await gw.redis.publish(control_channel(gw.redis), run_id)
    log.info("run.cancel_requested", run_id=run_id, first=bool(first))
    if first:
        count_cancel("running")
    return "requested" if first else "already_requested"


async def cancel_queued(gw: GatewayState, db: AsyncSession, run: Run) -> bool:
    """Commit the cancellation (tombstone and all, and the follow-up behind it promoted), then
    abort the job, tell the stream and start the follow-up. False if a worker started the Run
    first."""
    run_id, session_id = run.id, run.session_id
    terminal = await runs.cancel_queued_run(db, run_id)
    if terminal is None:
        return False
    try:
        await gw.jobs.abort(run_id)  # the job never starts
        await announce(gw, terminal)
    except (RedisError, OSError) as exc:
        # Committed all the same: a worker that picks the job finds the Run cancelled, and a
        # stream finds the ending in the DB.
        log.warning("run.cancel_not_announced", run_id=run_id, error_type=type(exc).__name__)
    await start_promoted(gw.db_sessions, gw.jobs, session_id)
    return True


async def cancel_waiting(gw: GatewayState, run_id: str) -> bool:
    """Cancel a follow-up still waiting (it never reached the history), and tell its stream."""
    terminal = await run_whole(gw.db_sessions, functools.partial(waiting.cancel_waiting_on, run_id=run_id))
    if terminal is None:
        return False
    try:
        await announce(gw, terminal)
    except (RedisError, OSError) as exc:  # a stream finds the ending in the DB
        log.warning("run.cancel_not_announced", run_id=run_id, error_type=type(exc).__name__)
    return True


async def cancel_line(gw: GatewayState, session_id: str) -> int:
    """Cancel every follow-up waiting in the session (an interrupt, a delete): how many."""
    ids = await run_whole(gw.db_sessions, functools.partial(waiting.waiting_ids_on, session_id=session_id))
    return sum([await cancel_waiting(gw, run_id) for run_id in ids])


async def announce(gw: GatewayState, terminal: RunEvent) -> None:
    lease_ms = int(gw.settings.profile.worker.lease_seconds * 1000)
    await publish_ending(gw.runlog, terminal, f"gateway:{gw.process_id}", lease_ms)


async def delete_session(gw: GatewayState, db: AsyncSession, session_id: str) -> Purged | None:
    """Mark the session deleted (from then on every lookup of it is a 404 and no Turn is claimed
    in it), cancel its active Run, and remove its rows once that Run has ended: here within
    CANCEL_WAIT_SECONDS, or else at a later sweep. What was removed, or None when that is left to
    the sweep."""
    active = await purge.mark_deleted(db, session_id)
    await cancel_line(gw, session_id)
    if active is not None:
        try:
            await request_cancellation(gw, db, active)
        except (RedisError, OSError) as exc:  # the deletion stands; the Run ends on its own
            log.warning("session.delete_cancel_failed", run_id=active.id, error_type=type(exc).__name__)
        await db.commit()
        if not await ended_within(db, active.id, CANCEL_WAIT_SECONDS):
            log.info("session.delete_deferred", session_id=session_id, run_id=active.id)
            return None
    try:
        return await purge.purge_session(gw.db_sessions, gw.redis, gw.blobs, session_id)
    except SQLAlchemyError as exc:  # marked deleted all the same: the gc's next pass removes it
        log.warning("session.delete_deferred", session_id=session_id, error_type=type(exc).__name__)
        return None


async def ended_within(db: AsyncSession, run_id: str, seconds: float) -> bool:
    """Whether the Run is terminal within `seconds`, read again at a growing interval."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + seconds, 0.02
    while True:
        found = await queries.get_run(db, run_id)
        await db.commit()  # each read sees the latest commit
        if found is None or is_terminal(found.status):
            return True
        if loop.time() + pause > deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.5)


async def interrupt(gw: GatewayState, run_id: str) -> bool:
    """Cancel a session's running Turn for the one that interrupts it; whether it ended within
    CANCEL_WAIT_SECONDS (a Redis outage raises, as a cancel's does)."""
    async with gw.db_sessions() as db:
        run = await queries.get_run(db, run_id)
        if run is None:
            return True
        await cancel_line(gw, run.session_id)  # so that none of them is promoted in its place
        await request_cancellation(gw, db, run)
        await db.commit()
        return await ended_within(db, run_id, CANCEL_WAIT_SECONDS)
