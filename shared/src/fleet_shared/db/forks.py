"""A session's fork: a new session that starts from its parent's committed state, copying rows only.

What the parent has committed when the fork's transaction reads it is what the fork starts from:
the Turns of every Run that has ended (a Run still queued or running is left out, its user Turn
with it), the task checkpoint, and the workspace's versions. A version is a row naming a manifest,
and a manifest names content-addressed objects, so the fork copies no file: the two sessions share
the manifests and objects, and each Turn after the fork records versions of its own workspace only.
"""

from __future__ import annotations

from typing import cast

from sqlalchemy import Table, insert, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db import workspace_versions
from fleet_shared.db.engine import run_whole
from fleet_shared.db.models import DELETED, Run, Session, Turn, Workspace, utcnow
from fleet_shared.ids import new_id
from fleet_shared.run_state import ACTIVE_STATUSES
from fleet_shared.tenancy import Principal

TURNS = cast(Table, Turn.__table__)
RUNS = cast(Table, Run.__table__)
# Turns are copied a page at a time: a long history never sits whole in memory (a Turn's parts
# may be large), and every page is a bounded read and one multi-row INSERT.
TURN_PAGE = 200
ACTIVE = sorted(status.value for status in ACTIVE_STATUSES)


async def fork_session(
    db_sessions: async_sessionmaker[AsyncSession], parent_id: str, title: str | None, owner: Principal
) -> Session | None:
    """The new session (`title`, or the parent's), or None when there is no such parent."""
    return await run_whole(db_sessions, lambda db: fork_on(db, parent_id, title, owner))


def fork_on(db: OrmSession, parent_id: str, title: str | None, owner: Principal) -> Session | None:
    """The fork in one transaction that reads one state of the parent.

    On PostgreSQL the transaction is REPEATABLE READ: every read sees the snapshot of its first
    statement, so a settlement committing meanwhile is either wholly in the fork (its Turn, its
    version, its checkpoint) or wholly out. It writes only rows of its own and refers only to
    rows no one changes any more (ended Runs, manifests), so it has no conflict to fail on. On
    SQLite its first statement is a write, which takes the database's one write lock: nothing
    else commits until the fork does, so every read sees one state too."""
    if db.get_bind().dialect.name == "postgresql":
        db.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    stamp = utcnow()
    session_id = new_id()
    workspace = Workspace(id=new_id(), name=f"session-{session_id}", created_at=stamp, version=0)
    db.add(workspace)
    db.flush()  # the write that comes first (see above)
    parent = db.get(Session, parent_id)
    if parent is None or parent.status == DELETED:  # deleted after the caller's lookup
        db.rollback()
        return None
    source = db.get(Workspace, parent.workspace_id)
    latest = source.version if source is not None else 0
    if latest:
        # Manifests the fork will refer to are renewed first, as a commit's are: a gc running
        # meanwhile cannot remove one (retention may drop the parent's last reference).
        workspace_versions.renew_manifests_of_on(db, parent.workspace_id, latest)
        workspace_versions.copy_versions_on(db, parent.workspace_id, workspace.id, latest)
        workspace.version = latest
    fork = Session(
        id=session_id,
        tenant_id=parent.tenant_id,
        owner_id=owner.user,  # the caller's, who may have read a session of another user
        workspace_id=workspace.id,
        title=parent.title if title is None else title,
        status="active",
        created_at=stamp,
        updated_at=stamp,
        checkpoint_version=parent.checkpoint_version,
        task=parent.task,
        # Its approval mode goes along (a safety setting); its webhook does not (the fork may be
        # another user's, whose Runs must not go to the parent owner's receiver).
        approval=parent.approval,
    )
    db.add(fork)
    db.flush()
    copy_turns_on(db, parent_id, session_id)
    db.commit()
    return fork


def copy_turns_on(db: OrmSession, parent_id: str, fork_id: str) -> None:
    """The parent's Turns of ended Runs, with new ids and the same sequence, parts and Run."""
    ended = select(RUNS.c.id).where(RUNS.c.session_id == parent_id, RUNS.c.status.not_in(ACTIVE))
    after = 0
    while True:
        rows = db.execute(
            select(TURNS)
            .where(TURNS.c.session_id == parent_id, TURNS.c.sequence > after, TURNS.c.run_id.in_(ended))
            .order_by(TURNS.c.sequence)
            .limit(TURN_PAGE)
        ).all()
        if not rows:
            return
        db.execute(
            insert(TURNS),
            [{**row._asdict(), "id": new_id(), "session_id": fork_id} for row in rows],
        )
        after = rows[-1].sequence
