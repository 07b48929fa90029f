"""Workspace versions: a manifest per settled Run, its files' bytes in the object store.

Revision ID: 0007_workspace_versions
Revises: 0006_feedback
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_workspace_versions"
down_revision: str | None = "0006_feedback"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("workspaces", sa.Column("version", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "workspace_manifests",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("file_count", sa.Integer(), nullable=False),
        sa.Column("byte_size", sa.BigInteger(), nullable=False),
        sa.Column("entries", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "workspace_versions",
        sa.Column("workspace_id", sa.String(36), sa.ForeignKey("workspaces.id"), primary_key=True),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column(
            "manifest_sha256", sa.String(64), sa.ForeignKey("workspace_manifests.sha256"), nullable=False
        ),
        sa.Column("run_id", sa.String(36), sa.ForeignKey("runs.id"), nullable=True),
        sa.Column("added_bytes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_workspace_versions_manifest_sha256", "workspace_versions", ["manifest_sha256"])
    op.create_index("ix_workspace_versions_run_id", "workspace_versions", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_workspace_versions_run_id", table_name="workspace_versions")
    op.drop_index("ix_workspace_versions_manifest_sha256", table_name="workspace_versions")
    op.drop_table("workspace_versions")
    op.drop_table("workspace_manifests")
    # Plain ALTER TABLE … DROP COLUMN (SQLite has it since 3.35): a batch copy of `workspaces`
    # would trip the foreign key of `sessions`.
    op.drop_column("workspaces", "version")
