"""Webhooks: a session's default target, a Run's own, and each delivery with its attempts.

A delivery row is written in the transaction that ends its Run; any gateway or worker sends it,
so a delivery survives the process that made it.

Revision ID: 0012_webhooks
Revises: 0011_waiting_runs
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_webhooks"
down_revision: str | None = "0011_waiting_runs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("webhook_url", sa.String(2048), nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("webhook_url", sa.String(2048), nullable=True))
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("run_id", sa.String(36), sa.ForeignKey("runs.id"), nullable=False, unique=True),
        sa.Column("session_id", sa.String(36), nullable=False, index=True),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_webhook_deliveries_status_due", "webhook_deliveries", ["status", "next_attempt_at"])
    op.create_table(
        "webhook_attempts",
        sa.Column("delivery_id", sa.String(36), sa.ForeignKey("webhook_deliveries.id"), primary_key=True),
        sa.Column("number", sa.Integer(), primary_key=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    op.drop_index("ix_webhook_deliveries_status_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("webhook_url")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("webhook_url")
