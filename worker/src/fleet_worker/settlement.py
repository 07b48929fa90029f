"""Committing a Run's end: running → settling → terminal, fenced by attempt, retried briefly."""

from __future__ import annotations

import asyncio

import structlog
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared.db import queries
from fleet_shared.db.models import Run
from fleet_shared.run_state import RunCommand, RunStatus, decide

log = structlog.get_logger(__name__)
COMMIT_RETRY_DELAYS = (0.0, 0.5, 2.0, 5.0)


async def commit_with_retry(
    sessions: async_sessionmaker[AsyncSession], settlement: queries.Settlement
) -> bool:
    """running → settling → terminal, surviving a brief DB outage. False: another attempt owns it."""
    for delay in COMMIT_RETRY_DELAYS:
        await asyncio.sleep(delay)
        try:
            async with sessions() as db:
                return await commit_once(db, settlement)
        except (OperationalError, InterfaceError, OSError) as exc:
            log.warning("turn.commit_retry", error_type=type(exc).__name__, retry_in=delay)
    async with sessions() as db:  # last try: let the error surface to arq's log
        return await commit_once(db, settlement)


async def commit_once(db: AsyncSession, settlement: queries.Settlement) -> bool:
    run = await queries.get_run(db, settlement.run_id)
    if run is None or run.attempt != settlement.attempt:
        return False
    status = RunStatus(run.status)
    if status is RunStatus.RUNNING:
        if not await queries.apply_transition(
            db, run.id, RunStatus.RUNNING, RunCommand.SETTLE, attempt=settlement.attempt
        ):
            return False
        await db.commit()
    elif status is not RunStatus.SETTLING:
        return is_our_commit(run, settlement)
    return await queries.commit_settlement(db, settlement)


def is_our_commit(run: Run, settlement: queries.Settlement) -> bool:
    """A terminal Run is ours only if it ended exactly as this settlement says: same status,
    same failure code and same last event. A reaper's `worker_lost` is never mistaken for it."""
    target = decide(RunStatus.SETTLING, settlement.command).target
    last_seq = settlement.events[-1].seq if settlement.events else 0
    return (
        run.status == target.value
        and run.failure_code == settlement.failure_code
        and run.last_seq == last_seq
    )
