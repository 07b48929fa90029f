"""Skill cards (seeded from `config/skills/` after each upgrade), and each session's task
checkpoint with its version.

Revision ID: 0005_skills_and_task
Revises: 0004_attachments_artifacts
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_skills_and_task"
down_revision: str | None = "0004_attachments_artifacts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "skills",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.String(100), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    # Existing sessions start with no checkpoint: version 0, no task.
    op.add_column(
        "sessions", sa.Column("checkpoint_version", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("sessions", sa.Column("task", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE … DROP COLUMN on both backends (SQLite has it since 3.35): a batch copy of
    # `sessions` would trip the foreign keys of `runs`, `turns` and `artifacts`.
    op.drop_column("sessions", "task")
    op.drop_column("sessions", "checkpoint_version")
    op.drop_table("skills")
