"""One workspace per session: sessions that shared the old default workspace get their own.

Files written to the shared workspace folder stay where they are (under the old workspace's id);
no session sees them any more.

Revision ID: 0003_workspace_per_session
Revises: 0002_run_status_indexes
Create Date: 2026-11-30
"""

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0003_workspace_per_session"
down_revision: str | None = "0002_run_status_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    workspaces = sa.table(
        "workspaces", sa.column("id", sa.String), sa.column("name", sa.String), sa.column("created_at")
    )
    sessions = sa.table("sessions", sa.column("id", sa.String), sa.column("workspace_id", sa.String))
    shared = bind.execute(
        sa.select(sessions.c.workspace_id).group_by(sessions.c.workspace_id).having(sa.func.count() > 1)
    ).scalars()
    for workspace_id in list(shared):
        session_ids = bind.execute(
            sa.select(sessions.c.id).where(sessions.c.workspace_id == workspace_id)
        ).scalars()
        for session_id in list(session_ids):
            own = str(uuid.uuid4())
            bind.execute(
                workspaces.insert().values(id=own, name=f"session-{session_id}", created_at=datetime.now(UTC))
            )
            bind.execute(sessions.update().where(sessions.c.id == session_id).values(workspace_id=own))


def downgrade() -> None:
    """Nothing to undo: a session with its own workspace is valid under 0002 as well."""
