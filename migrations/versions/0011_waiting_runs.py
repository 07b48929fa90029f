"""Follow-ups that wait behind a session's active Run (`multitask: enqueue`).

A waiting Run keeps its place in the session's line and its user Turn's parts until it is
promoted to `queued`; `queued_at` is when that happened. All NULL for every other Run.

Revision ID: 0011_waiting_runs
Revises: 0010_run_traceparent
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_waiting_runs"
down_revision: str | None = "0010_run_traceparent"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("waiting_place", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("waiting_parts", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_unique_constraint("uq_runs_session_waiting_place", ["session_id", "waiting_place"])


def downgrade() -> None:
    op.execute("DELETE FROM runs WHERE status = 'waiting'")
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint("uq_runs_session_waiting_place", type_="unique")
        batch.drop_column("queued_at")
        batch.drop_column("waiting_parts")
        batch.drop_column("waiting_place")
