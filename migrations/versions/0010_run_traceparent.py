"""Runs carry the W3C `traceparent` of the request that made them (fleet_shared.tracing).

The worker's spans and the feedback's join that trace from it, in whichever process they run.
NULL while tracing is off, and for Runs made before.

Revision ID: 0010_run_traceparent
Revises: 0009_tenancy
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_run_traceparent"
down_revision: str | None = "0009_tenancy"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("traceparent", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("traceparent")
