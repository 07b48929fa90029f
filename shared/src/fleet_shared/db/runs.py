"""Fenced writes that move a Run: transitions, take-overs, and the one-transaction settlement.

Every write here is an UPDATE that only lands if the Run is still where the writer saw it (status,
and attempt where it matters): a late or stale writer changes nothing and learns it lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

import msgspec
import structlog
from sqlalchemy import ColumnElement, case, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db import waiting, webhooks, workspace_versions
from fleet_shared.db.models import DELETED, Artifact, ProgramVersion, Run, RunEventRow, Session, Turn, utcnow
from fleet_shared.db.programs import active_version_id
from fleet_shared.db.queries import get_run
from fleet_shared.db.workspace_versions import WorkspaceChange
from fleet_shared.events import ArtifactCreated, RunCancelled, RunEvent, RunFailed, encode_event, event_type
from fleet_shared.ids import new_id
from fleet_shared.run_state import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    Decision,
    RunCommand,
    RunStatus,
    decide,
    decide_ending,
)
from fleet_shared.transcript import tombstone_parts

TERMINAL_OR_QUEUED = frozenset(set(RunStatus) - {RunStatus.RUNNING})

log = structlog.get_logger(__name__)


async def apply_transition(
    db: AsyncSession,
    run_id: str,
    current: RunStatus,
    command: RunCommand,
    *,
    attempt: int | None = None,
    values: dict[str, Any] | None = None,
) -> bool:
    """A fenced UPDATE: it only lands if the Run is still `current` (and `attempt`, if given)."""
    decision = decide(current, command)
    return await db.run_sync(
        decision_update, run_id, decision=decision, command=command, attempt=attempt, values=values
    )


def decision_update(
    db: OrmSession,
    run_id: str,
    *,
    decision: Decision,
    command: RunCommand,
    attempt: int | None,
    values: dict[str, Any] | None = None,
    also: ColumnElement[bool] | None = None,
) -> bool:
    """The fenced UPDATE of a decided transition, on a synchronous session (the SQLite twin's, or
    inside `run_sync`); `also`, one more condition it needs."""
    changes: dict[str, Any] = {"status": decision.target.value, **(values or {})}
    if decision.bumps_attempt:
        changes["attempt"] = Run.attempt + 1
    if command is RunCommand.START:
        changes["started_at"] = utcnow()
    if decision.target in TERMINAL_STATUSES:
        changes.setdefault("finished_at", utcnow())
    query = update(Run).where(Run.id == run_id, Run.status.in_([s.value for s in decision.sources]))
    if attempt is not None:
        query = query.where(Run.attempt == attempt)
    if also is not None:
        query = query.where(also)
    result = db.execute(query.values(**changes).execution_options(synchronize_session=False))
    return bool(getattr(result, "rowcount", 0) == 1)


class StartedRun(NamedTuple):
    run: Run
    instructions: str | None  # its program version's text; None: no version (the shipped text)


def start_run_on(db: OrmSession, run_id: str) -> StartedRun | None:
    """queued → running, bumping `attempt`, on a synchronous session (the worker runs it through
    fleet_shared.db.engine.run_whole); None when the Run is not queued (a duplicate job), or its
    session was deleted (the purge removes it)."""
    start = RunCommand.START
    live = Run.session_id.in_(select(Session.id).where(Session.status != DELETED))
    decision = decide(RunStatus.QUEUED, start)
    # The program it runs: the Turn's own version, else the one active now (recorded for good,
    # by the worker that reads its text: a worker too old to know versions leaves it NULL).
    program = {"program_version_id": func.coalesce(Run.requested_program_version_id, active_version_id())}
    moved = decision_update(
        db, run_id, decision=decision, command=start, attempt=None, values=program, also=live
    )
    db.commit()
    if not moved:
        return None
    # The Run and its program's text (None: no version) in the read that reloads the Run anyway.
    found = db.execute(
        select(Run, ProgramVersion.text)
        .outerjoin(ProgramVersion, ProgramVersion.id == Run.program_version_id)
        .where(Run.id == run_id)
        .execution_options(populate_existing=True)
    ).one()
    return StartedRun(found[0], found[1])


async def take_over_run(db: AsyncSession, run_id: str, attempt: int) -> bool:
    """A sweeper claims a Run whose lease lapsed: attempt + 1, so its old owner's commit fails."""
    run = await get_run(db, run_id)
    if run is None or run.attempt != attempt or RunStatus(run.status) in TERMINAL_OR_QUEUED:
        return False
    moved = await apply_transition(db, run_id, RunStatus(run.status), RunCommand.TAKE_OVER, attempt=attempt)
    await db.commit()
    return moved


async def fail_queued_run(db: AsyncSession, run_id: str, code: str, message: str) -> RunFailed | None:
    """End a Run that never started, with its failed assistant Turn, as any other ending is.

    Returns the terminal event to publish, or None when the Run was no longer queued.
    """
    terminal = RunFailed(run_id=run_id, seq=1, code=code, message=message)
    ended = await end_queued_run(
        db, run_id, command=RunCommand.FAIL, terminal=terminal, parts=[], code=code, message=message
    )
    return terminal if ended else None


async def cancel_queued_run(db: AsyncSession, run_id: str) -> RunCancelled | None:
    """Cancel a Run no worker has started: its tombstone Turn and status, in one transaction."""
    terminal = RunCancelled(run_id=run_id, seq=1)
    ended = await end_queued_run(
        db,
        run_id,
        command=RunCommand.CANCEL,
        terminal=terminal,
        parts=tombstone_parts(None),
        code=None,
        message=None,
    )
    return terminal if ended else None


async def end_queued_run(
    db: AsyncSession,
    run_id: str,
    *,
    command: RunCommand,
    terminal: RunEvent,
    parts: list[dict[str, Any]],
    code: str | None,
    message: str | None,
) -> bool:
    run = await get_run(db, run_id)
    if run is None or run.status != RunStatus.QUEUED.value:
        return False
    settlement = Settlement(
        run_id=run_id,
        session_id=run.session_id,
        attempt=run.attempt,
        current=RunStatus.QUEUED,
        command=command,
        sequence=run.user_sequence + 1,
        parts=parts,
        turn_status="cancelled" if command is RunCommand.CANCEL else "failed",
        events=[terminal],
        failure_code=code,
        failure_message=message,
    )
    return await commit_settlement(db, settlement)


class Settlement(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the worker commits at the end of a Run, in one transaction."""

    run_id: str
    session_id: str
    attempt: int
    current: RunStatus
    command: RunCommand
    sequence: int
    parts: list[dict[str, Any]]
    turn_status: str
    events: list[RunEvent]
    usage: dict[str, Any] | None = None
    failure_code: str | None = None
    failure_message: str | None = None
    # The session's next task checkpoint and its version (fleet_shared.checkpoint), if any.
    task: dict[str, Any] | None = None
    checkpoint_version: int | None = None
    # The workspace's next version (its files are in the blob store already), if any.
    workspace: WorkspaceChange | None = None


async def commit_settlement(db: AsyncSession, s: Settlement) -> bool:
    """The Run's ending, assistant Turn, events and artifacts, in one transaction fenced by attempt
    and status: a late writer (an older attempt) changes nothing."""
    return await db.run_sync(commit_settlement_on, s)


def commit_settlement_on(db: OrmSession, s: Settlement) -> bool:
    """commit_settlement on a synchronous session (fleet_shared.db.engine.run_whole). The first
    follow-up waiting behind the Run is promoted in the same transaction."""
    waiting.lock_session_on(db, s.session_id)
    ending = decide_ending(s.current, s.command)
    moved = decision_update(
        db,
        s.run_id,
        decision=ending,
        command=s.command,
        attempt=s.attempt,
        values={
            "usage": s.usage,
            "failure_code": s.failure_code,
            "failure_message": s.failure_message,
            "last_seq": s.events[-1].seq if s.events else 0,
        },
    )
    if not moved:
        db.rollback()
        return False
    db.add(
        Turn(
            id=new_id(),
            session_id=s.session_id,
            run_id=s.run_id,
            sequence=s.sequence,
            role="assistant",
            parts=s.parts,
            status=s.turn_status,
            created_at=utcnow(),
        )
    )
    artifacts = [e for e in s.events if isinstance(e, ArtifactCreated)]
    if artifacts:  # their bytes are already in the blob store; these rows make them visible
        db.execute(
            insert(Artifact),
            [
                {
                    "id": e.artifact_id,
                    "run_id": s.run_id,
                    "session_id": s.session_id,
                    "name": e.name,
                    "media_type": e.media_type,
                    "byte_size": e.byte_size,
                    "checksum_sha256": e.checksum_sha256,
                    "created_at": utcnow(),
                }
                for e in artifacts
            ],
        )
    if s.task is not None and s.checkpoint_version is not None:
        db.execute(
            update(Session)
            # Only over the version this Run read at its claim (one active Run per session and the
            # attempt fence make that so; this keeps it so if either ever changes).
            .where(Session.id == s.session_id, Session.checkpoint_version == s.checkpoint_version - 1)
            .values(task=s.task, checkpoint_version=s.checkpoint_version)
        )
    if s.workspace is not None and not workspace_versions.record_on(db, s.workspace, s.run_id):
        log.warning("workspace.version_stale", workspace_id=s.workspace.workspace_id)
    if s.events:
        db.execute(
            insert(RunEventRow),
            [
                {
                    "run_id": s.run_id,
                    "seq": e.seq,
                    "type": event_type(e),
                    "payload": encode_event(e).decode(),
                }
                for e in s.events
            ],
        )
    answer = webhooks.answer_of(s.parts) if ending.target is RunStatus.COMPLETED else None
    ended = webhooks.RunEnded(
        s.run_id, s.session_id, ending.target.value, s.usage, failure_code=s.failure_code, answer=answer
    )
    webhooks.record_on(db, ended)
    db.flush()
    waiting.promote_next_on(db, s.session_id)
    db.commit()
    return True


async def stale_active_run_ids(
    db: AsyncSession, *, started_before: datetime, limit: int = 10_000
) -> list[str]:
    """Ids of running Runs that started before the cutoff: the reaper's candidates.

    Ids only, so the reaper can check every lease at once and a crowd of healthy long Runs
    never hides a lost one behind a page limit.
    """
    rows = await db.scalars(
        select(Run.id)
        .where(
            Run.status == RunStatus.RUNNING.value,
            Run.started_at < started_before,
        )
        .order_by(Run.started_at)
        .limit(limit)
    )
    return list(rows.all())


async def get_runs(db: AsyncSession, run_ids: Sequence[str]) -> Sequence[Run]:
    rows = await db.scalars(select(Run).where(Run.id.in_(run_ids)).order_by(Run.started_at))
    return rows.all()


async def stale_queued_runs(db: AsyncSession, *, created_before: datetime, limit: int = 50) -> Sequence[Run]:
    """Queued Runs older than the cutoff: since their claim, or since their promotion."""
    rows = await db.scalars(
        select(Run)
        .where(
            Run.status == RunStatus.QUEUED.value,
            Run.created_at < created_before,
            func.coalesce(Run.queued_at, Run.created_at) < created_before,
        )
        .order_by(Run.created_at)
        .limit(limit)
    )
    return rows.all()


async def tenant_run_counts(db: AsyncSession, tenant: str, since: datetime) -> tuple[int, int]:
    """The tenant's Runs queued or running now, and those claimed since `since`."""
    is_active = Run.status.in_([s.value for s in ACTIVE_STATUSES])
    is_recent = Run.created_at >= since
    in_tenant = Run.session_id.in_(select(Session.id).where(Session.tenant_id == tenant))
    active, recent = case((is_active, 1), else_=0), case((is_recent, 1), else_=0)
    query = select(func.coalesce(func.sum(active), 0), func.coalesce(func.sum(recent), 0))
    # Only the rows that count: a tenant's years of settled Runs are never read.
    query = query.where(in_tenant, or_(is_active, is_recent))
    row = (await db.execute(query)).one()
    return int(row[0]), int(row[1])


async def session_cost_usd(db: AsyncSession, session_id: str) -> float | None:
    """What the session's Runs' LMs cost (their usage's `cost_usd`); None while none was priced."""
    total = await db.scalar(
        select(func.sum(Run.usage["cost_usd"].as_float())).where(Run.session_id == session_id)
    )
    return None if total is None else round(float(total), 10)
