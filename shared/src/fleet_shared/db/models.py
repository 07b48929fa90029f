"""SQLAlchemy 2 models. Alembic owns the schema: add tables through new migrations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fleet_shared.run_state import ACTIVE_STATUSES
from fleet_shared.tenancy import DEFAULT_TENANT, OPERATOR


def utcnow() -> datetime:
    return datetime.now(UTC)


ACTIVE_PROGRAM_SQL = "status = 'active'"
ACTIVE_SQL = "status IN ({})".format(", ".join(f"'{s.value}'" for s in sorted(ACTIVE_STATUSES)))


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Workspace(Base):
    __tablename__ = "workspaces"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Its latest committed version (0: none yet); only a commit over the version a Run read at
    # its claim moves it on.
    version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class WorkspaceManifest(Base):
    """A manifest (fleet_shared.manifests), stored once by its sha256 whoever refers to it."""

    __tablename__ = "workspace_manifests"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    file_count: Mapped[int] = mapped_column(Integer)
    byte_size: Mapped[int] = mapped_column(BigInteger)
    entries: Mapped[str] = mapped_column(Text)  # the canonical encoding the sha256 names
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WorkspaceVersion(Base):
    """What a workspace held after one Run. A fork starts with copies of its parent's rows (the
    same numbers, manifests and Runs), so its history reads the same in both."""

    __tablename__ = "workspace_versions"

    workspace_id: Mapped[str] = mapped_column(ForeignKey("workspaces.id"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    manifest_sha256: Mapped[str] = mapped_column(ForeignKey("workspace_manifests.sha256"), index=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id"), index=True, default=None)
    # The bytes this version put in the store (files its Run changed): what the quotas count.
    added_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# Session.status: `active`, `archived` (no new Turns), or `deleted` (found by no lookup; its rows
# go once it has no active Run: fleet_shared.db.purge).
ACTIVE_SESSION = "active"
DELETED = "deleted"


class Session(Base):
    __tablename__ = "sessions"
    __table_args__ = (Index("ix_sessions_tenant_owner_created", "tenant_id", "owner_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    # Who made it (fleet_shared.tenancy): everything under a session is reached through it.
    tenant_id: Mapped[str] = mapped_column(String(128), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT)
    owner_id: Mapped[str] = mapped_column(String(255), default=OPERATOR.user, server_default=OPERATOR.user)
    workspace_id: Mapped[str] = mapped_column(ForeignKey("workspaces.id"), index=True)
    title: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(16), default="active", index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    # The task checkpoint: a bounded goal-and-progress record, replaced with each commit;
    # the version counts those replacements (0: none yet).
    checkpoint_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    task: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # Where each of its Runs is posted when it ends, unless the Turn names its own (migration 0012).
    webhook_url: Mapped[str | None] = mapped_column(String(2048), default=None)
    # Whether its Runs' cells wait for a person's approval (`never`, `always`, `on_risk`), unless
    # the Turn says (migration 0013). NULL: never.
    approval: Mapped[str | None] = mapped_column(String(16), default=None)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("session_id", "idempotency_key", name="uq_runs_session_idempotency_key"),
        # One non-terminal Run per session; a partial index both PostgreSQL and SQLite enforce.
        Index(
            "uq_runs_one_active_per_session",
            "session_id",
            unique=True,
            postgresql_where=ACTIVE_SQL,
            sqlite_where=ACTIVE_SQL,
        ),
        # A session's waiting Runs, in the order they were accepted (migration 0011).
        UniqueConstraint("session_id", "waiting_place", name="uq_runs_session_waiting_place"),
        # The recovery sweep's lookups (migration 0002).
        Index("ix_runs_status_started_at", "status", "started_at"),
        Index("ix_runs_status_created_at", "status", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    status: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str] = mapped_column(String(128))
    request_fingerprint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(200))
    user_sequence: Mapped[int] = mapped_column(Integer)
    failure_code: Mapped[str | None] = mapped_column(String(64), default=None)
    failure_message: Mapped[str | None] = mapped_column(Text, default=None)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    last_seq: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    # The W3C traceparent of its `turn.submit` span (fleet_shared.tracing); None: not traced.
    traceparent: Mapped[str | None] = mapped_column(String(64), default=None)
    # A follow-up accepted behind the active Run (`waiting`): its place in the session's line, and
    # the user Turn's parts, added to the history when it is promoted to `queued` (so the history
    # only ever grows at its end). `queued_at`: when it was promoted (NULL: queued at its claim).
    waiting_place: Mapped[int | None] = mapped_column(Integer, default=None)
    waiting_parts: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    queued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    # Where it is posted when it ends (the Turn's `webhook`); NULL: its session's, if any.
    webhook_url: Mapped[str | None] = mapped_column(String(2048), default=None)
    # The Turn's `approval`; NULL: its session's, as the worker finds it when the Run starts.
    approval: Mapped[str | None] = mapped_column(String(16), default=None)
    # The program version its Turn asked for (admin only); NULL: the active one when it starts.
    requested_program_version_id: Mapped[str | None] = mapped_column(
        ForeignKey("program_versions.id"), default=None
    )
    # The program version it ran (fleet_shared.db.programs), written by the UPDATE that starts it;
    # NULL for a Run that never started, or of a database with no version.
    program_version_id: Mapped[str | None] = mapped_column(ForeignKey("program_versions.id"), default=None)


class Turn(Base):
    """One UIMessage of a session's committed history (user or assistant)."""

    __tablename__ = "turns"
    __table_args__ = (UniqueConstraint("session_id", "sequence", name="uq_turns_session_sequence"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    sequence: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    parts: Mapped[list[Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="completed")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RunEventRow(Base):
    """A settled Run's Runtime Events, committed with its Turn so replay outlives Redis."""

    __tablename__ = "run_events"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[str] = mapped_column(Text)


class Attachment(Base):
    """A file a client uploaded to attach to Turns; its bytes are `attachments/<id>` in the blob
    store. `filename` is the client's, cleaned; it names the copy staged into a workspace."""

    __tablename__ = "attachments"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(128), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT)
    owner_id: Mapped[str] = mapped_column(String(255), default=OPERATOR.user, server_default=OPERATOR.user)
    filename: Mapped[str] = mapped_column(String(255))
    media_type: Mapped[str] = mapped_column(String(255))
    byte_size: Mapped[int] = mapped_column(BigInteger)
    checksum_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Artifact(Base):
    """A file a Run wrote under `/workspace/artifacts/`, collected at settlement and committed
    with its Turn; its bytes are `artifacts/<id>` in the blob store."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("run_id", "name", name="uq_artifacts_run_name"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    name: Mapped[str] = mapped_column(String(1024))
    media_type: Mapped[str] = mapped_column(String(255))
    byte_size: Mapped[int] = mapped_column(BigInteger)
    checksum_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Skill(Base):
    """A skill card: guidance a Turn may select, given to the RLM. Seeded from `config/skills/`;
    a card whose file was removed keeps its row, so Turns that name it still work."""

    __tablename__ = "skills"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the card file's stem
    name: Mapped[str] = mapped_column(String(200))
    version: Mapped[str] = mapped_column(String(100))
    description: Mapped[str] = mapped_column(Text)
    body: Mapped[str] = mapped_column(Text)
    digest: Mapped[str] = mapped_column(String(64))  # sha256 of the card file: changed → re-seeded
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Feedback(Base):
    """A user's rating of one Run's answer. Kept here only: no tracing backend receives it yet."""

    __tablename__ = "feedback"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    rating: Mapped[str] = mapped_column(String(8))  # "up" or "down"
    comment: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookDelivery(Base):
    """One settled Run posted to its webhook: the body is fixed when the Run ends, and every attempt
    sends it with the same `webhook-id` (this id), so a receiver can drop a repeat."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_status_due", "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), unique=True)
    session_id: Mapped[str] = mapped_column(String(36), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # `pending`, `delivered` or `failed`
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # When it is due next; while an attempt is under way, when another process may take it over.
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class WebhookAttempt(Base):
    """One POST of a delivery: the answer's status code, or why there was none."""

    __tablename__ = "webhook_attempts"

    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id"), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    duration_ms: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)


class ProgramVersion(Base):
    """A version of the RLM's instructions. One is `active` (what Runs start with); `candidate`s
    wait for an operator's activation (`fleet optimize` writes only these); `retired` ones were
    active once. The text of a version never changes."""

    __tablename__ = "program_versions"
    __table_args__ = (
        # At most one active version; a partial index both PostgreSQL and SQLite enforce.
        Index(
            "uq_program_versions_one_active",
            "status",
            unique=True,
            postgresql_where=ACTIVE_PROGRAM_SQL,
            sqlite_where=ACTIVE_PROGRAM_SQL,
        ),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("program_versions.id"), default=None)
    # The version active before its first activation: what a rollback from it goes back to.
    replaced_id: Mapped[str | None] = mapped_column(ForeignKey("program_versions.id"), default=None)
    text: Mapped[str] = mapped_column(Text)
    text_sha256: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str] = mapped_column(String(255))
    notes: Mapped[str | None] = mapped_column(Text, default=None)
    # A candidate's scores on a validation set, beside the active version's on the same rows.
    validation: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    activated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
