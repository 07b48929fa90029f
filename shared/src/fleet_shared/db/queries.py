"""Queries and fenced writes: the only place that knows how Runs, Turns and Sessions are stored."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Literal

import msgspec
from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_shared.db.models import Attachment, Run, RunEventRow, Session, Skill, Turn, Workspace
from fleet_shared.events import (
    RunEvent,
    decode_event,
)
from fleet_shared.ids import new_id
from fleet_shared.run_state import ACTIVE_STATUSES, RunStatus
from fleet_shared.skills import selected_skill_part
from fleet_shared.transcript import attachment_part


def now() -> datetime:
    return datetime.now(UTC)


# --- sessions ---------------------------------------------------------------------------------


async def create_session(db: AsyncSession, title: str) -> Session:
    """A session and its own workspace: no other session ever sees its files."""
    stamp = now()
    session_id = new_id()
    workspace = Workspace(id=new_id(), name=f"session-{session_id}", created_at=stamp)
    session = Session(
        id=session_id,
        workspace_id=workspace.id,
        title=title,
        status="active",
        created_at=stamp,
        updated_at=stamp,
    )
    db.add(workspace)
    await db.flush()  # the workspace row first: the session refers to it
    db.add(session)
    await db.commit()
    return session


async def get_session(db: AsyncSession, session_id: str) -> Session | None:
    return await db.get(Session, session_id)


async def list_sessions(
    db: AsyncSession, *, status: str | None, search: str | None, limit: int, offset: int
) -> tuple[Sequence[Session], int]:
    query = select(Session)
    if status:
        query = query.where(Session.status == status)
    if search:
        query = query.where(Session.title.ilike(contains_pattern(search), escape="\\"))
    total = await db.scalar(select(func.count()).select_from(query.subquery()))
    rows = await db.scalars(query.order_by(Session.created_at.desc(), Session.id).limit(limit).offset(offset))
    return rows.all(), int(total or 0)


async def update_session(
    db: AsyncSession, session_id: str, *, title: str | None = None, status: str | None = None
) -> Session | None:
    """Change the title and/or status; None when the session does not exist."""
    # The UPDATE's row lock orders it with claims, which share-lock the row (is_archived).
    session = await db.get(Session, session_id)
    if session is None:
        return None
    if title is not None:
        session.title = title
    if status is not None:
        session.status = status
    session.updated_at = now()
    await db.commit()
    return session


def contains_pattern(text: str) -> str:
    """A LIKE pattern (escape character `\\`) that matches `text` anywhere, taken literally."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


# --- claiming a Turn (gateway) ----------------------------------------------------------------


class Claimed(msgspec.Struct, frozen=True):
    run: Run
    created: bool  # False: the same key and body named an existing Run (replay or attach)


class ClaimRefused(msgspec.Struct, frozen=True):
    reason: Literal["idempotency_key_mismatch", "turn_in_progress", "session_archived"]
    run_id: str | None = None


async def find_run_by_key(db: AsyncSession, session_id: str, key: str) -> Run | None:
    return await db.scalar(select(Run).where(Run.session_id == session_id, Run.idempotency_key == key))


async def active_run(db: AsyncSession, session_id: str) -> Run | None:
    return await db.scalar(
        select(Run).where(Run.session_id == session_id, Run.status.in_([s.value for s in ACTIVE_STATUSES]))
    )


async def claim_turn(
    db: AsyncSession,
    *,
    session_id: str,
    idempotency_key: str,
    fingerprint: str,
    text: str,
    model: str,
    attachments: Sequence[Attachment] = (),
    skills: Sequence[Skill] = (),
) -> Claimed | ClaimRefused:
    """In one transaction: honour the key, insert the queued Run and the user Turn (its text,
    then one `data-attachment` part per attachment and one `data-skill` part per selected skill:
    the worker stages and loads them from there)."""
    outcome = await existing_outcome(db, session_id, idempotency_key, fingerprint)
    if outcome is not None:
        return outcome  # the key first: a Run that exists replays, even in an archived session
    last = await db.scalar(select(func.max(Turn.sequence)).where(Turn.session_id == session_id))
    user_sequence = int(last or 0) + 1
    stamp = now()
    run = Run(
        id=new_id(),
        session_id=session_id,
        status=RunStatus.QUEUED.value,
        attempt=0,
        idempotency_key=idempotency_key,
        request_fingerprint=fingerprint,
        model=model,
        user_sequence=user_sequence,
        last_seq=0,
        created_at=stamp,
    )
    db.add(run)
    db.add(
        Turn(
            id=new_id(),
            session_id=session_id,
            run_id=run.id,
            sequence=user_sequence,
            role="user",
            parts=[
                {"type": "text", "text": text},
                *(attachment_part(a.id, a.filename, a.byte_size) for a in attachments),
                *(selected_skill_part(skill) for skill in skills),
            ],
            status="completed",
            created_at=stamp,
        )
    )
    try:
        await db.flush()
        if await is_archived(db, session_id):
            await db.rollback()
            return ClaimRefused("session_archived")
        await db.commit()
    except IntegrityError:
        # A concurrent claim won the race: answer as if it had committed before we looked.
        await db.rollback()
        outcome = await existing_outcome(db, session_id, idempotency_key, fingerprint)
        return outcome or ClaimRefused("turn_in_progress")
    return Claimed(run, created=True)


async def is_archived(db: AsyncSession, session_id: str) -> bool:
    """Asked after the claim's rows are written, inside its transaction, so it is atomic with the
    claim: PostgreSQL share-locks the session row (an archive in flight is waited for; a later one
    waits for our commit), and SQLite's write lock keeps any other writer out until we commit."""
    query = select(Session.status).where(Session.id == session_id).with_for_update(read=True)
    return await db.scalar(query) == "archived"


async def existing_outcome(
    db: AsyncSession, session_id: str, key: str, fingerprint: str
) -> Claimed | ClaimRefused | None:
    """What an earlier or concurrent claim decides for this one; None when the way is clear."""
    existing = await find_run_by_key(db, session_id, key)
    if existing is None:
        existing = await active_run(db, session_id)
        if existing is not None and existing.idempotency_key != key:
            return ClaimRefused("turn_in_progress", existing.id)
    return None if existing is None else same_key_outcome(existing, fingerprint)


def same_key_outcome(run: Run, fingerprint: str) -> Claimed | ClaimRefused:
    if run.request_fingerprint != fingerprint:
        return ClaimRefused("idempotency_key_mismatch", run.id)
    return Claimed(run, created=False)


async def withdraw_claim(db: AsyncSession, run_id: str) -> bool:
    """Undo a claim whose job could not be queued: the Run and its user Turn vanish, so the same
    Idempotency-Key works again. False when a worker already started it (then it stays)."""
    run = await db.scalar(
        select(Run.id).where(Run.id == run_id, Run.status == RunStatus.QUEUED.value, Run.attempt == 0)
    )
    if run is None:
        await db.rollback()
        return False
    await db.execute(delete(Turn).where(Turn.run_id == run_id))
    result = await db.execute(
        delete(Run).where(Run.id == run_id, Run.status == RunStatus.QUEUED.value, Run.attempt == 0)
    )
    if getattr(result, "rowcount", 0) != 1:
        await db.rollback()
        return False
    await db.commit()
    return True


# --- reading Runs ----------------------------------------------------------------------------


async def get_run(db: AsyncSession, run_id: str) -> Run | None:
    return await db.get(Run, run_id, populate_existing=True)


# --- history ----------------------------------------------------------------------------------


async def list_turns(db: AsyncSession, session_id: str, *, after_sequence: int, limit: int) -> Sequence[Turn]:
    rows = await db.scalars(
        select(Turn)
        .where(Turn.session_id == session_id, Turn.sequence > after_sequence)
        .order_by(Turn.sequence)
        .limit(limit)
    )
    return rows.all()


async def load_run_events(db: AsyncSession, run_id: str, after_seq: int = 0) -> list[RunEvent]:
    rows = await db.scalars(
        select(RunEventRow.payload)
        .where(RunEventRow.run_id == run_id, RunEventRow.seq > after_seq)
        .order_by(RunEventRow.seq)
    )
    return [decode_event(payload) for payload in rows]
