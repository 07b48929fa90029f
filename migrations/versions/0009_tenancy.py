"""Tenancy: each session and each attachment carries the tenant and the user who made it.

Runs, Turns, events, artifacts, feedback and workspace versions hang off a session and are
reached through it. Rows made before carry the `token` mode's one caller (`default`/`default`).

Revision ID: 0009_tenancy
Revises: 0008_no_settling_status
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_tenancy"
down_revision: str | None = "0008_no_settling_status"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("sessions", "attachments")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("tenant_id", sa.String(128), nullable=False, server_default="default"))
            batch.add_column(sa.Column("owner_id", sa.String(255), nullable=False, server_default="default"))
    op.create_index("ix_sessions_tenant_owner_created", "sessions", ["tenant_id", "owner_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_sessions_tenant_owner_created", table_name="sessions")
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("owner_id")
            batch.drop_column("tenant_id")
