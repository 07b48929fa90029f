"""A deleted session's removal: its rows in one transaction, then its Runs' Redis keys and its
artifacts' objects (docs/workspaces.md, "Deleting a session"; ADR 0040).

A session is first marked `deleted` (every lookup then answers 404, and no Turn is claimed in it);
its rows go once no Run of it is in progress (a queued one goes with them). Forks complicate one
thing: a fork's copied Turns and workspace versions name the parent's Runs, so a Run some other
session still names is handed to that session (the oldest such fork; its events and artifacts go
with it) instead of being removed. What was copied stays with the fork, a session of its own;
everything else of the session goes: its Runs and their events, its Turns, feedback, artifacts,
workspace versions and workspace, and the attachments no other session of the tenant names. The
blob gc removes what no row or manifest names any more: those attachments' bytes, and the
content-addressed workspace objects only this session's versions held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import ColumnElement, Text, and_, cast, delete, func, literal, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session as OrmSession

from fleet_shared import redis_keys
from fleet_shared.blobs import BlobStore, artifact_key
from fleet_shared.db import webhooks
from fleet_shared.db.engine import run_whole
from fleet_shared.db.models import (
    DELETED,
    Artifact,
    Attachment,
    Feedback,
    Run,
    RunEventRow,
    Session,
    Turn,
    Workspace,
    WorkspaceVersion,
    utcnow,
)
from fleet_shared.run_state import ACTIVE_STATUSES, RunStatus

log = structlog.get_logger(__name__)
CHUNK = 500  # ids per IN list
TURN_PAGE = 200  # Turns read at once when looking for the session's attachments
SWEEP_PAGE = 500  # sessions the gc expires or purges per read
ACTIVE = sorted(status.value for status in ACTIVE_STATUSES)
IN_PROGRESS = sorted(status.value for status in ACTIVE_STATUSES - {RunStatus.QUEUED})
INHERITED_KEY = "inherited:"  # + the Run id: a handed-over Run's key, which no client ever sent


@dataclass
class Purged:
    """What one purge removed, and which Runs it handed to forks."""

    session_id: str
    runs: list[str] = field(default_factory=list)
    inherited: dict[str, list[str]] = field(default_factory=dict)  # heir session -> its new Runs
    artifacts: list[str] = field(default_factory=list)
    attachments: list[str] = field(default_factory=list)
    turns: int = 0


def chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(ids), CHUNK):
        yield ids[start : start + CHUNK]


async def purge_session(
    db_sessions: async_sessionmaker[AsyncSession], redis: Redis | None, blobs: BlobStore, session_id: str
) -> Purged | None:
    """Remove a `deleted` session with no Run in progress; None when it is not (yet) removable.
    The rows go in one transaction; Redis keys and the artifacts' objects after it, as far as
    Redis and the store answer (what is left is unreachable: the keys expire, and the blob gc
    takes objects with no row). The attachments' objects are the gc's, after its grace period:
    a Turn claimed elsewhere as this purge read may still name one, and needs its bytes."""
    purged = await run_whole(db_sessions, lambda db: purge_on(db, session_id))
    if purged is None:
        return None
    if redis is not None:  # without it the keys expire on their own
        with contextlib.suppress(RedisError, OSError):
            for ids in chunks(purged.runs):
                await redis.delete(*(key for run_id in ids for key in run_keys(run_id)))
    for key in map(artifact_key, purged.artifacts):
        try:
            await blobs.delete(key)
        except Exception as exc:  # the store is away (obstore's errors are no OSError): the gc's
            log.warning("session.object_not_deleted", key=key, error_type=type(exc).__name__)
    log.info(
        "session.purged",
        session_id=session_id,
        runs=len(purged.runs),
        runs_kept_by_forks=sum(len(ids) for ids in purged.inherited.values()),
        turns=purged.turns,
        artifacts=len(purged.artifacts),
        attachments=len(purged.attachments),
    )
    return purged


def run_keys(run_id: str) -> list[str]:
    return [
        redis_keys.run_events(run_id),
        redis_keys.run_lease(run_id),
        redis_keys.run_fence(run_id),
        redis_keys.run_cancel(run_id),
    ]


def purge_on(db: OrmSession, session_id: str) -> Purged | None:
    # The session row first (PostgreSQL): an ending that holds it FOR SHARE before it writes its
    # Run (fleet_shared.db.waiting) then waits for the purge, instead of a deadlock.
    session = db.get(Session, session_id, with_for_update=True)
    if session is None or session.status != DELETED:
        return None
    # A Run a worker holds ends first; a queued one goes with the rest (a worker that takes its
    # job finds no Run to start).
    running = select(Run.id).where(Run.session_id == session_id, Run.status.in_(IN_PROGRESS)).limit(1)
    if db.scalar(running) is not None:
        return None
    purged = Purged(session_id)
    purged.attachments = only_its_attachments(db, session)  # reads only: before the first write
    run_ids = list(db.scalars(select(Run.id).where(Run.session_id == session_id)))
    purged.inherited = hand_over(db, session, run_ids)
    kept = {run_id for ids in purged.inherited.values() for run_id in ids}
    purged.runs = [run_id for run_id in run_ids if run_id not in kept]
    purged.artifacts = list(db.scalars(select(Artifact.id).where(Artifact.session_id == session_id)))
    db.execute(delete(Feedback).where(Feedback.session_id == session_id))
    db.execute(delete(Artifact).where(Artifact.session_id == session_id))
    webhooks.delete_of_session_on(db, session_id)  # a Run handed over keeps none: they were the parent's
    for ids in chunks(purged.runs):
        db.execute(delete(RunEventRow).where(RunEventRow.run_id.in_(ids)))
    purged.turns = int(getattr(db.execute(delete(Turn).where(Turn.session_id == session_id)), "rowcount", 0))
    db.execute(delete(WorkspaceVersion).where(WorkspaceVersion.workspace_id == session.workspace_id))
    for ids in chunks(purged.runs):
        db.execute(delete(Run).where(Run.id.in_(ids)))
    workspace_id = session.workspace_id
    db.delete(session)
    db.flush()
    if db.scalar(select(Session.id).where(Session.workspace_id == workspace_id).limit(1)) is None:
        db.execute(delete(Workspace).where(Workspace.id == workspace_id))
    for ids in chunks(purged.attachments):
        db.execute(delete(Attachment).where(Attachment.id.in_(ids)))
    db.commit()
    return purged


def hand_over(db: OrmSession, session: Session, run_ids: list[str]) -> dict[str, list[str]]:
    """The session's Runs that another session's Turns or workspace versions name (a fork's
    copies), each moved to the oldest such session that is not being deleted itself (or, with
    none, the oldest); their artifacts go along. A moved Run's Idempotency-Key becomes one no
    client sent: the heir's own Runs may use the same key, and its clients never sent this one.
    Heir session -> the Runs it now holds."""
    naming: dict[str, list[Any]] = {}
    for ids in chunks(run_ids):
        by_turns = select(Turn.run_id, Session.id, Session.status, Session.created_at).join(
            Session, Session.id == Turn.session_id
        )
        by_versions = select(WorkspaceVersion.run_id, Session.id, Session.status, Session.created_at).join(
            Session, Session.workspace_id == WorkspaceVersion.workspace_id
        )
        for query in (by_turns, by_versions):
            rows = db.execute(
                query.where(query.selected_columns[0].in_(ids), Session.id != session.id).distinct()
            ).all()
            for run_id, *heir in rows:
                if run_id is not None:
                    naming.setdefault(run_id, []).append(tuple(heir))
    inherited: dict[str, list[str]] = {}
    for run_id, heirs in naming.items():
        heir_id = min(heirs, key=heir_order)[0]
        inherited.setdefault(heir_id, []).append(run_id)
    for heir_id, ids in inherited.items():
        for part in chunks(ids):
            key = literal(INHERITED_KEY) + Run.id
            # Its place in the parent's line of follow-ups means nothing in the heir's.
            moved = {"session_id": heir_id, "idempotency_key": key, "waiting_place": None}
            db.execute(update(Run).where(Run.id.in_(part)).values(**moved))
            db.execute(update(Artifact).where(Artifact.run_id.in_(part)).values(session_id=heir_id))
    return inherited


def heir_order(heir: tuple[str, str, datetime]) -> tuple[bool, datetime, str]:
    session_id, status, created_at = heir
    return (status == DELETED, created_at, session_id)


def only_its_attachments(db: OrmSession, session: Session) -> list[str]:
    """The attachments the session's Turns (or follow-ups still waiting) name and no other
    session's does (an attachment is its tenant's: only the tenant's sessions are searched)."""
    waiting_parts = select(Run.waiting_parts).where(
        Run.session_id == session.id, Run.waiting_parts.is_not(None)
    )
    named: set[str] = {found for (parts,) in db.execute(waiting_parts) for found in attachment_ids(parts)}
    after = -1
    while True:
        page = db.execute(
            select(Turn.sequence, Turn.parts)
            .where(Turn.session_id == session.id, Turn.sequence > after)
            .order_by(Turn.sequence)
            .limit(TURN_PAGE)
        ).all()
        if not page:
            break
        for _sequence, parts in page:
            named.update(attachment_ids(parts))
        after = page[-1][0]
    mine = sorted(named)
    if not mine:
        return []
    named_elsewhere: set[str] = set()
    for ids in chunks(mine):
        text = cast(Turn.parts, Text)
        clause = or_(*(text.contains(attachment_id, autoescape=True) for attachment_id in ids))
        elsewhere = (
            select(Turn.parts)
            .join(Session, Session.id == Turn.session_id)
            .where(Session.tenant_id == session.tenant_id, Turn.session_id != session.id, clause)
        )
        waiting_text = cast(Run.waiting_parts, Text)
        waiting_clause = or_(
            *(waiting_text.contains(attachment_id, autoescape=True) for attachment_id in ids)
        )
        waiting_elsewhere = (
            select(Run.waiting_parts)
            .join(Session, Session.id == Run.session_id)
            .where(Session.tenant_id == session.tenant_id, Run.session_id != session.id, waiting_clause)
        )
        for query in (elsewhere, waiting_elsewhere):
            for (parts,) in db.execute(query):
                named_elsewhere.update(attachment_ids(parts))
    return [attachment_id for attachment_id in mine if attachment_id not in named_elsewhere]


def attachment_ids(parts: Any) -> set[str]:
    """The attachment ids a Turn's parts name (fleet_shared.transcript.attachment_part)."""
    found: set[str] = set()
    for part in parts if isinstance(parts, list) else []:
        data = part.get("data") if isinstance(part, dict) and part.get("type") == "data-attachment" else None
        if isinstance(data, dict) and isinstance(data.get("attachment_id"), str):
            found.add(data["attachment_id"])
    return found


async def mark_deleted(db: AsyncSession, session_id: str) -> Run | None:
    """Mark the session deleted (committed); its active Run, if it has one, to cancel."""
    await db.execute(
        update(Session).where(Session.id == session_id).values(status=DELETED, updated_at=utcnow())
    )
    active = await db.scalar(select(Run).where(Run.session_id == session_id, Run.status.in_(ACTIVE)))
    await db.commit()
    return active


def idle_since(cutoff: datetime) -> ColumnElement[bool]:
    """Sessions not deleted, not changed since `cutoff`, with no Run made since and none active."""
    recent = select(Run.id).where(
        Run.session_id == Session.id, or_(Run.created_at >= cutoff, Run.status.in_(ACTIVE))
    )
    return and_(Session.status != DELETED, Session.updated_at < cutoff, ~recent.exists())


async def idle_sessions(db: AsyncSession, cutoff: datetime, limit: int) -> list[str]:
    query = select(Session.id).where(idle_since(cutoff)).order_by(Session.updated_at)
    return list(await db.scalars(query.limit(limit)))


async def expire_idle(db: AsyncSession, cutoff: datetime, limit: int) -> list[str]:
    """Mark deleted the sessions idle since before `cutoff` (storage.session_ttl_days); their
    ids (at most `limit`). The mark checks again: a Turn claimed meanwhile keeps its session."""
    idle = await idle_sessions(db, cutoff, limit)
    if not idle:
        return []
    # Lock them first (a claim holds its session FOR SHARE until it commits, so this waits for
    # claims under way), then check again in a statement of its own, which sees their Runs.
    await db.execute(select(Session.id).where(Session.id.in_(idle)).with_for_update())
    marked = update(Session).where(Session.id.in_(idle), idle_since(cutoff)).values(status=DELETED)
    result = await db.execute(marked.returning(Session.id))
    expired = list(result.scalars())
    await db.commit()
    return expired


async def deleted_sessions(db: AsyncSession, after: str, limit: int) -> list[str]:
    """Sessions marked deleted, in id order after `after`: what a sweep purges."""
    query = select(Session.id).where(Session.status == DELETED, Session.id > after).order_by(Session.id)
    return list(await db.scalars(query.limit(limit)))


async def sweep_sessions(
    db_sessions: async_sessionmaker[AsyncSession],
    redis: Redis | None,
    blobs: BlobStore,
    *,
    ttl: timedelta | None,
    dry_run: bool,
    check_stop: Callable[[], None],
) -> tuple[int, int]:
    """The gc's first stage: sessions idle past `ttl` are marked deleted (each logged), then every
    deleted session without a Run in progress is purged. How many expired, and how many were
    purged; a dry run marks and purges nothing and counts what a pass would."""
    cutoff = datetime.now(UTC) - ttl if ttl is not None else None
    if dry_run:
        async with db_sessions() as db:
            idle = int(await db.scalar(select(func.count()).where(idle_since(cutoff))) or 0) if cutoff else 0
            return idle, idle + await count_deleted(db)
    expired = 0
    while cutoff is not None:
        check_stop()
        async with db_sessions() as db:
            page = await expire_idle(db, cutoff, SWEEP_PAGE)
        for session_id in page:
            log.info("session.expired", session_id=session_id, idle_before=cutoff.isoformat())
        expired += len(page)
        if len(page) < SWEEP_PAGE:
            break
    purged, after = 0, ""
    while True:
        check_stop()
        async with db_sessions() as db:
            page = await deleted_sessions(db, after, SWEEP_PAGE)
        if not page:
            return expired, purged
        after = page[-1]
        for session_id in page:
            try:
                if await purge_session(db_sessions, redis, blobs, session_id) is not None:
                    purged += 1
            except Exception as exc:  # one session's failure never stops the gc: the next pass retries
                log.warning("session.purge_failed", session_id=session_id, error_type=type(exc).__name__)


async def count_deleted(db: AsyncSession) -> int:
    """Deleted sessions a purge would remove now (none of their Runs in progress)."""
    running = select(Run.id).where(Run.session_id == Session.id, Run.status.in_(IN_PROGRESS))
    return int(await db.scalar(select(func.count()).where(Session.status == DELETED, ~running.exists())) or 0)


async def existing_workspaces(db: AsyncSession, ids: Sequence[str]) -> set[str]:
    """Which of these workspace ids the database still has."""
    found: set[str] = set()
    for part in chunks(ids):
        found.update(await db.scalars(select(Workspace.id).where(Workspace.id.in_(part))))
    return found
