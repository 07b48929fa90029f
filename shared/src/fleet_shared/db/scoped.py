"""Lookups by an id a caller sent, scoped to the caller (fleet_shared.tenancy): a row of another
tenant, or of another user without `sessions:read:all`, is not found, exactly like an unknown id.

Runs, artifacts and the rest are reached through their session, so one rule scopes them all."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import ColumnElement, and_, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute

from fleet_shared.db.models import DELETED, Artifact, Attachment, Run, Session
from fleet_shared.db.queries import contains_pattern
from fleet_shared.tenancy import READ_ALL_SESSIONS, Principal


def visible_to(
    principal: Principal, tenant: InstrumentedAttribute[str], owner: InstrumentedAttribute[str], write: bool
) -> ColumnElement[bool]:
    """Rows this caller may read, or with `write` change: its tenant's, and of those its own
    unless it may read them all (reading only)."""
    clause = tenant == principal.tenant
    if write or not principal.may(READ_ALL_SESSIONS):
        clause = and_(clause, owner == principal.user)
    return clause


def sessions_of(principal: Principal, *, write: bool = False) -> ColumnElement[bool]:
    """A deleted session is found by no one (its rows are on their way out)."""
    return and_(visible_to(principal, Session.tenant_id, Session.owner_id, write), Session.status != DELETED)


async def get_session(
    db: AsyncSession, session_id: str, principal: Principal, *, write: bool = False
) -> Session | None:
    return await db.scalar(
        select(Session).where(Session.id == session_id, sessions_of(principal, write=write))
    )


async def list_sessions(
    db: AsyncSession, principal: Principal, *, status: str | None, search: str | None, limit: int, offset: int
) -> tuple[Sequence[Session], int]:
    query = select(Session).where(sessions_of(principal))
    if status:
        query = query.where(Session.status == status)
    if search:
        query = query.where(Session.title.ilike(contains_pattern(search), escape="\\"))
    total = await db.scalar(select(func.count()).select_from(query.subquery()))
    rows = await db.scalars(query.order_by(Session.created_at.desc(), Session.id).limit(limit).offset(offset))
    return rows.all(), int(total or 0)


async def get_run(db: AsyncSession, run_id: str, principal: Principal, *, write: bool = False) -> Run | None:
    query = (
        select(Run)
        .join(Session, Session.id == Run.session_id)
        .where(Run.id == run_id, sessions_of(principal, write=write))
        .execution_options(populate_existing=True)  # a stream re-reads a Run it read before
    )
    return await db.scalar(query)


async def get_artifact(db: AsyncSession, artifact_id: str, principal: Principal) -> Artifact | None:
    query = (
        select(Artifact)
        .join(Session, Session.id == Artifact.session_id)
        .where(Artifact.id == artifact_id, sessions_of(principal))
    )
    return await db.scalar(query)


def attachments_of(principal: Principal, *, write: bool = False) -> ColumnElement[bool]:
    """Attachments follow the sessions' rule: a Turn attaches only its own user's uploads."""
    return visible_to(principal, Attachment.tenant_id, Attachment.owner_id, write)


async def get_attachment(db: AsyncSession, attachment_id: str, principal: Principal) -> Attachment | None:
    return await db.scalar(
        select(Attachment).where(Attachment.id == attachment_id, attachments_of(principal))
    )


async def get_attachments(db: AsyncSession, ids: Sequence[str], principal: Principal) -> list[Attachment]:
    """The caller's own attachments with these ids, in the order asked (others are left out)."""
    if not ids:
        return []
    rows = await db.scalars(
        select(Attachment).where(Attachment.id.in_(list(ids)), attachments_of(principal, write=True))
    )
    found = {row.id: row for row in rows}
    return [found[i] for i in ids if i in found]
