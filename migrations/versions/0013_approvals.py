"""Approvals: whether a session's (or a Turn's) cells wait for a person before they run.

NULL on a Run: its session's choice, read when the Run starts; NULL on a session: never.

Revision ID: 0013_approvals
Revises: 0012_webhooks
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_approvals"
down_revision: str | None = "0012_webhooks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("sessions", "runs"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("approval", sa.String(16), nullable=True))


def downgrade() -> None:
    for table in ("runs", "sessions"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("approval")
