"""Sessions, a Run read, and the committed history (a claim is fleet_shared.db.claims, a Run's
fenced writes fleet_shared.db.runs)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import and_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db.models import (
    DELETED,
    Run,
    RunEventRow,
    Session,
    Turn,
    Workspace,
    utcnow,
)
from fleet_shared.events import (
    RunEvent,
    decode_event,
)
from fleet_shared.ids import new_id
from fleet_shared.tenancy import Principal

# --- sessions ---------------------------------------------------------------------------------


async def create_session(db: AsyncSession, title: str, owner: Principal) -> Session:
    """A session of the caller's, and its own workspace: no other session ever sees its files."""
    stamp = utcnow()
    session_id = new_id()
    workspace = Workspace(id=new_id(), name=f"session-{session_id}", created_at=stamp)
    session = Session(
        id=session_id,
        tenant_id=owner.tenant,
        owner_id=owner.user,
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


async def update_session(
    db: AsyncSession,
    session_id: str,
    *,
    title: str | None = None,
    status: str | None = None,
    webhook: tuple[str | None] | None = None,
    approval: str | None = None,
) -> Session | None:
    """Change the title and/or status; None when the session does not exist, or was deleted
    (a conditional UPDATE: a PATCH racing a DELETE never brings the session back)."""
    # A claim reads the status in the statement that inserts its Run (claims.INSERT_RUN_IF_ACTIVE): an
    # archive committed first refuses the claim; one committed after orders after it.
    changes: dict[str, object] = {"updated_at": utcnow()}
    if title is not None:
        changes["title"] = title
    if status is not None:
        changes["status"] = status
    if webhook is not None:  # (url,) sets it; (None,) clears it
        changes["webhook_url"] = webhook[0]
    if approval is not None:
        changes["approval"] = approval
    live = and_(Session.id == session_id, Session.status != DELETED)
    statement = update(Session).where(live).values(**changes).execution_options(synchronize_session=False)
    changed = await db.execute(statement)
    await db.commit()
    if not getattr(changed, "rowcount", 0):
        return None
    return await db.get(Session, session_id, populate_existing=True)


def contains_pattern(text: str) -> str:
    """A LIKE pattern (escape character `\\`) that matches `text` anywhere, taken literally."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


# --- reading Runs ----------------------------------------------------------------------------


async def get_run(db: AsyncSession, run_id: str) -> Run | None:
    return await db.get(Run, run_id, populate_existing=True)


# --- history ----------------------------------------------------------------------------------


async def list_turns(db: AsyncSession, session_id: str, *, after_sequence: int, limit: int) -> Sequence[Turn]:
    return await db.run_sync(list_turns_on, session_id, after_sequence=after_sequence, limit=limit)


def list_turns_on(db: OrmSession, session_id: str, *, after_sequence: int, limit: int) -> Sequence[Turn]:
    """list_turns on a synchronous session (fleet_shared.db.engine.run_whole)."""
    rows = db.scalars(
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
