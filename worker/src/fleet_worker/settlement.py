"""Committing a Run's end in one fenced transaction, retried through a database outage."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import structlog
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.backoff import Backoff
from fleet_shared.db import runs
from fleet_shared.db.engine import run_whole
from fleet_shared.db.faults import is_unreachable
from fleet_shared.db.models import Run
from fleet_shared.events import RunEvent, RunFailed
from fleet_shared.run_state import ACTIVE_STATUSES, RunCommand, RunStatus, decide_ending

log = structlog.get_logger(__name__)
T = TypeVar("T")
FIRST_RETRY_SECONDS = 0.1
MAX_RETRY_SECONDS = 2.0


async def commit_with_retry(
    db_sessions: async_sessionmaker[AsyncSession], settlement: runs.Settlement, *, deadline: float
) -> bool:
    """Commit, retrying every connection-class error until `deadline` (time.monotonic()).

    The caller keeps the Run's lease meanwhile, so no sweeper can take the Run: an answer that was
    computed is committed once the database is back. False: another attempt owns the Run."""
    commit = functools.partial(commit_once_on, settlement=settlement)
    return await run_whole_with_retry(db_sessions, commit, deadline=deadline, what="commit")


async def run_whole_with_retry(
    db_sessions: async_sessionmaker[AsyncSession],
    work: Callable[[OrmSession], T],
    *,
    deadline: float,
    what: str,
) -> T:
    """`work` through run_whole, retried on every connection-class error until `deadline`
    (time.monotonic()); logged as `turn.<what>_retry` and `turn.<what>_recovered`."""
    backoff = Backoff(FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS)
    while True:
        try:
            done = await run_whole(db_sessions, work)
            if backoff.failures:
                log.info(f"turn.{what}_recovered", tries=backoff.failures + 1)
            return done
        except Exception as exc:
            if not is_unreachable(exc) or time.monotonic() + backoff.pending > deadline:
                raise
            if backoff.failures % 10 == 0:  # the first, then every tenth
                log.warning(f"turn.{what}_retry", error_type=type(exc).__name__, tries=backoff.failures + 1)
        await asyncio.sleep(backoff.next())


def commit_once_on(db: OrmSession, settlement: runs.Settlement) -> bool:
    """One try at the commit, on a synchronous session (fleet_shared.db.engine.run_whole)."""
    run = db.get(Run, settlement.run_id, populate_existing=True)
    if run is None or run.attempt != settlement.attempt:
        return False
    if RunStatus(run.status) in ACTIVE_STATUSES:
        return runs.commit_settlement_on(db, settlement)
    return is_our_commit(run, settlement)


def is_our_commit(run: Run, settlement: runs.Settlement) -> bool:
    """A terminal Run is ours only if it ended exactly as this settlement says (a retry after a
    lost acknowledgement): same attempt, status, failure code and last event."""
    target = decide_ending(settlement.current, settlement.command).target
    last_seq = settlement.events[-1].seq if settlement.events else 0
    return (
        run.status == target.value
        and run.failure_code == settlement.failure_code
        and run.last_seq == last_seq
    )


def commit_failed(settlement: runs.Settlement, terminal: RunEvent) -> runs.Settlement:
    """The least that can be committed when the Turn's ending could not be: its failure alone, so
    the Run ends honestly (not later as `worker_lost`) and the session is free."""
    message = "the Turn's result could not be saved; send it again"
    failed = RunFailed(run_id=terminal.run_id, seq=terminal.seq, code="commit_failed", message=message)
    return msgspec.structs.replace(
        settlement,
        command=RunCommand.FAIL,
        parts=[],
        turn_status="failed",
        events=[failed],
        failure_code="commit_failed",
        failure_message=message,
        task=None,
        checkpoint_version=None,
    )
