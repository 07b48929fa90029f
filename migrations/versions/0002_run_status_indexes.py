"""Indexes for the recovery sweep: active Runs by status and age.

Every gateway and worker sweeps twice a second for running Runs whose lease lapsed and queued
Runs whose job vanished; without these, each sweep scans the whole runs table.

Revision ID: 0002_run_status_indexes
Revises: 0001_baseline
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002_run_status_indexes"
down_revision: str | None = "0001_baseline"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_runs_status_started_at", "runs", ["status", "started_at"])
    op.create_index("ix_runs_status_created_at", "runs", ["status", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_runs_status_created_at", table_name="runs")
    op.drop_index("ix_runs_status_started_at", table_name="runs")
