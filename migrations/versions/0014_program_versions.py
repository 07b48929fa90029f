"""Program versions: the RLM's instructions as rows, one active; each Run records the one it ran.

`fleet db upgrade` seeds the shipped text as the first, active version (fleet_shared.db.programs).

Revision ID: 0014_program_versions
Revises: 0013_approvals
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_program_versions"
down_revision: str | None = "0013_approvals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = "status = 'active'"


def upgrade() -> None:
    op.create_table(
        "program_versions",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("parent_id", sa.String(36), sa.ForeignKey("program_versions.id"), nullable=True),
        sa.Column("replaced_id", sa.String(36), sa.ForeignKey("program_versions.id"), nullable=True),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("text_sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_by", sa.String(255), nullable=False),
        sa.Column("notes", sa.Text(), nullable=True),
        sa.Column("validation", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("activated_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_program_versions_text_sha256", "program_versions", ["text_sha256"])
    op.create_index(
        "uq_program_versions_one_active",
        "program_versions",
        ["status"],
        unique=True,
        postgresql_where=sa.text(ACTIVE),
        sqlite_where=sa.text(ACTIVE),
    )
    with op.batch_alter_table("runs") as batch:
        for column in ("requested_program_version_id", "program_version_id"):
            batch.add_column(sa.Column(column, sa.String(36), nullable=True))
            batch.create_foreign_key(f"fk_runs_{column}", "program_versions", [column], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        for column in ("program_version_id", "requested_program_version_id"):
            batch.drop_constraint(f"fk_runs_{column}", type_="foreignkey")
            batch.drop_column(column)
    op.drop_index("uq_program_versions_one_active", table_name="program_versions")
    op.drop_index("ix_program_versions_text_sha256", table_name="program_versions")
    op.drop_table("program_versions")
