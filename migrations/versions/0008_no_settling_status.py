"""`settling` is not a Run status: the one-active-Run-per-session index no longer names it.

No row ever held it (a Run stays `running` until its one commit writes its ending), so the
index is rebuilt over the same rows, in the migration's transaction.

Revision ID: 0008_no_settling_status
Revises: 0007_workspace_versions
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_no_settling_status"
down_revision: str | None = "0007_workspace_versions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = "uq_runs_one_active_per_session"


def rebuild(active: str) -> None:
    op.drop_index(INDEX, table_name="runs")
    where = sa.text(active)
    op.create_index(INDEX, "runs", ["session_id"], unique=True, postgresql_where=where, sqlite_where=where)


def upgrade() -> None:
    rebuild("status IN ('queued', 'running')")


def downgrade() -> None:
    rebuild("status IN ('queued', 'running', 'settling')")
