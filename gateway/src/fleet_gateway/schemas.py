"""Request and response bodies of the HTTP API (msgspec Structs; unknown request fields fail)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Self

import msgspec

from fleet_shared.db.models import Artifact, Attachment, Feedback, Run, Session, Skill, Turn
from fleet_shared.db.workspace_versions import VersionSummary
from fleet_shared.policy_file import MAX_CHANGES, PolicySnapshot

MAX_INT32 = 2**31 - 1
# Text fields refuse NUL: PostgreSQL cannot store it, and no client means to send it.
NO_NUL = r"^[^\x00]*$"


class Input(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of request bodies."""


class CreateSession(Input):
    title: Annotated[str, msgspec.Meta(max_length=200, pattern=NO_NUL)] = ""


class ForkSession(Input):
    """POST a fork: its title (default: the parent's)."""

    title: Annotated[str, msgspec.Meta(max_length=200, pattern=NO_NUL)] | msgspec.UnsetType = msgspec.UNSET


ApprovalMode = Annotated[
    Literal["never", "always", "on_risk"],
    msgspec.Meta(
        description="`always`: each cell waits for a person's decision before it runs; `on_risk`: "
        "those a conservative reading of the code finds risky do (docs/rlm.md; a convenience, not "
        "a security boundary); `never`: none"
    ),
]


class ApprovalDecisionIn(Input):
    """POST a decision on a cell waiting for approval; on `deny` the RLM reads the note."""

    decision: Literal["approve", "deny"]
    note: Annotated[str, msgspec.Meta(max_length=2000, pattern=NO_NUL)] | None = None


class ApprovalDecisionOut(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    approval_id: str
    decision: Literal["approve", "deny"]


class WebhookTarget(Input):
    """Where a settled Run is posted (docs/api.md, webhooks)."""

    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]


class UpdateSession(Input):
    """PATCH a session: at least one field (`null` is a value of `webhook` only: it clears it)."""

    title: Annotated[str, msgspec.Meta(max_length=200, pattern=NO_NUL)] | msgspec.UnsetType = msgspec.UNSET
    status: Literal["active", "archived"] | msgspec.UnsetType = msgspec.UNSET
    # The session's default webhook: every Run of it that names none is posted there.
    webhook: WebhookTarget | msgspec.UnsetType | None = msgspec.UNSET
    # Whether its Runs' cells wait for a person's approval, unless a Turn says.
    approval: ApprovalMode | msgspec.UnsetType = msgspec.UNSET


class SkillSelection(Input):
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    expected_version: Annotated[str, msgspec.Meta(min_length=1, max_length=100)] | None = None


class TurnRequest(Input):
    text: Annotated[str, msgspec.Meta(min_length=1, max_length=100_000, pattern=NO_NUL)]
    attachment_ids: Annotated[list[uuid.UUID], msgspec.Meta(max_length=20)] = []
    skill_selections: Annotated[list[SkillSelection], msgspec.Meta(max_length=4)] = []
    # What to do when a Turn is already running in the session: `reject` this one (409),
    # `enqueue` it behind (fleet_shared.db.waiting), or `interrupt` (cancel what runs and waits,
    # then run this one). Not part of the request's fingerprint.
    multitask: Annotated[
        Literal["reject", "enqueue", "interrupt"],
        msgspec.Meta(
            description="with a Turn already running in the session: `reject` this one (409); "
            "`enqueue` it (it waits, status `waiting`, and runs once every Turn ahead of it has "
            "settled, reading their answers); or `interrupt` (cancel the waiting Turns and the running "
            "one, wait up to 10 s for its end, then run this one)"
        ),
    ] = "reject"
    # Where the settled Run is posted (else the session's default, if any). Not part of the
    # request's fingerprint: the first request's target stands for its key.
    webhook: WebhookTarget | None = None
    # Whether this Turn's cells wait for a person's approval (else the session's; never by
    # default). Not part of the request's fingerprint, as `webhook`.
    approval: ApprovalMode | None = None
    # The program version to run instead of the active one (admin only): how a candidate is
    # evaluated on real Turns. Not part of the request's fingerprint, as `webhook`.
    program_version: uuid.UUID | None = None

    def fingerprint_bytes(self) -> bytes:
        """The canonical request: same text, attachments and skills → same bytes, whatever the
        client's key order or follow-up strategy (the bytes are those of the fields before
        `multitask` existed, so a key keeps its fingerprint)."""
        fields = {
            "text": self.text,
            "attachment_ids": self.attachment_ids,
            "skill_selections": self.skill_selections,
        }
        return msgspec.json.encode(fields, order="sorted")


class SessionOut(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    title: str
    status: Literal["active", "archived"]
    workspace_id: str
    created_at: str
    updated_at: str
    webhook_url: str | None = None  # its Runs' default webhook
    approval: str = "never"  # whether its Runs' cells wait for approval, unless a Turn says

    @classmethod
    def of(cls, session: Session, iso: Any) -> SessionOut:
        return cls(
            id=session.id,
            title=session.title,
            status=session.status,  # type: ignore[arg-type]
            workspace_id=session.workspace_id,
            webhook_url=session.webhook_url,
            approval=session.approval or "never",
            created_at=iso(session.created_at),
            updated_at=iso(session.updated_at),
        )


class SessionDetail(SessionOut, frozen=True, kw_only=True):
    """One session (GET /api/sessions/{id}), with what its Runs' LMs cost."""

    cost_usd: float | None  # the sum of its Runs' `cost_usd`; null while none had a priced model

    @classmethod
    def of(cls, session: Session, iso: Any, *, cost_usd: float | None = None) -> SessionDetail:
        base = SessionOut.of(session, iso)
        return cls(**msgspec.structs.asdict(base), cost_usd=cost_usd)


class TaskProgress(msgspec.Struct, frozen=True, kw_only=True):
    sequence: int
    run_id: str
    status: str
    request: str
    outcome: str
    at: str


class TaskOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A session's task checkpoint; version 0 (and no goal) until its first Turn settles."""

    session_id: str
    checkpoint_version: int
    goal: str | None = None
    progress: list[TaskProgress] = []
    updated_at: str | None = None

    @classmethod
    def of(cls, session: Session) -> TaskOut:
        task = session.task or {}
        return cls(
            session_id=session.id,
            checkpoint_version=session.checkpoint_version,
            goal=task.get("goal"),
            progress=msgspec.convert(task.get("progress") or [], list[TaskProgress]),
            updated_at=task.get("updated_at"),
        )


class SessionPage(msgspec.Struct, frozen=True):
    items: list[SessionOut]
    total: int


class WorkspaceVersionOut(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    run_id: str | None  # the Run that left it (null: a version no Run made)
    created_at: str
    file_count: int
    byte_size: int

    @classmethod
    def of(cls, row: VersionSummary, iso: Any) -> WorkspaceVersionOut:
        return cls(
            version=row.version,
            run_id=row.run_id,
            created_at=iso(row.created_at),
            file_count=row.file_count,
            byte_size=row.byte_size,
        )


class WorkspaceVersionPage(msgspec.Struct, frozen=True):
    items: list[WorkspaceVersionOut]
    next_before_version: int | None


class UIMessage(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    role: Literal["user", "assistant"]
    parts: list[dict[str, Any]]
    metadata: dict[str, Any]

    @classmethod
    def of(cls, turn: Turn, iso: Any, failure: tuple[str | None, str | None] = (None, None)) -> UIMessage:
        """`failure`: the Run's failure code and message, for an assistant message that did not
        complete (what the live stream's `error` said)."""
        metadata: dict[str, Any] = {
            "runId": turn.run_id,
            "sequence": turn.sequence,
            "createdAt": iso(turn.created_at),
            "status": turn.status,
        }
        code, message = failure
        if code is not None:
            metadata["failureCode"] = code
        if message is not None:
            metadata["failureMessage"] = message
        # The assistant message's id is the Run id, as in the stream's `start.messageId`.
        message_id = turn.run_id if turn.role == "assistant" else turn.id
        return cls(id=message_id, role=turn.role, parts=turn.parts, metadata=metadata)  # type: ignore[arg-type]


class TurnAccepted(msgspec.Struct, frozen=True, kw_only=True):
    """A Turn accepted with `Prefer: respond-async`: its Run, to read or stream later."""

    run_id: str
    session_id: str
    # `waiting` (behind the session's running Turn), `queued`, or, for a replayed key, any later
    status: str
    # A waiting Run's: how many Turns of the session run or wait ahead of it (0 otherwise)
    ahead: int = 0
    replayed: bool  # the Idempotency-Key had made this Run before


class TurnPage(msgspec.Struct, frozen=True):
    items: list[UIMessage]
    next_after_sequence: int | None


class Health(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    status: str
    version: str
    checks: dict[str, str] = {}
    details: dict[str, str] = {}  # informative, never a reason to be unready (sandbox modes)


class Allowance(msgspec.Struct, frozen=True, kw_only=True):
    used: int
    limit: int | None  # the tenant's quota; null: none


class UsageOut(msgspec.Struct, frozen=True, kw_only=True):
    """The caller's tenant's use of its quotas (GET /api/usage); days are UTC days."""

    tenant: str
    day: str  # the UTC date the day's counts are for, e.g. "2026-12-05"
    lm_tokens_today: Allowance  # prompt and completion tokens of every model, children included
    turns_today: int  # Turns claimed today, whatever their ending
    turns_this_minute: Allowance
    active_turns: Allowance  # queued or running now
    storage_bytes: Allowance  # artifacts, workspace versions and attachments kept


class RunOut(msgspec.Struct, frozen=True, kw_only=True):
    """A Run's state (GET /api/runs/{run_id}); `failure_message` is safe to show to users."""

    id: str
    session_id: str
    status: Literal["waiting", "queued", "running", "completed", "failed", "cancelled", "timed_out"]
    attempt: int
    model: str
    created_at: str
    started_at: str | None
    finished_at: str | None
    failure_code: str | None
    failure_message: str | None
    usage: dict[str, Any] | None
    last_event_seq: int
    program_version_id: str | None = None  # the program version it ran; None until it starts

    @classmethod
    def of(cls, run: Run, iso: Any) -> RunOut:
        return cls(
            id=run.id,
            session_id=run.session_id,
            status=run.status,  # type: ignore[arg-type]
            attempt=run.attempt,
            model=run.model,
            created_at=iso(run.created_at),
            started_at=iso(run.started_at) if run.started_at else None,
            finished_at=iso(run.finished_at) if run.finished_at else None,
            failure_code=run.failure_code,
            failure_message=run.failure_message,
            usage=run.usage,
            last_event_seq=run.last_seq,
            program_version_id=run.program_version_id,
        )


class CancellationOut(msgspec.Struct, frozen=True):
    run_id: str
    state: Literal["requested", "already_requested", "already_terminal"]


class AttachmentOut(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    filename: str
    media_type: str
    byte_size: int
    checksum_sha256: str
    created_at: str

    @classmethod
    def of(cls, row: Attachment, iso: Any) -> AttachmentOut:
        return cls(
            id=row.id,
            filename=row.filename,
            media_type=row.media_type,
            byte_size=row.byte_size,
            checksum_sha256=row.checksum_sha256,
            created_at=iso(row.created_at),
        )


class ArtifactOut(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    run_id: str
    session_id: str
    name: str
    media_type: str
    byte_size: int
    checksum_sha256: str
    created_at: str

    @classmethod
    def of(cls, row: Artifact, iso: Any) -> ArtifactOut:
        return cls(
            id=row.id,
            run_id=row.run_id,
            session_id=row.session_id,
            name=row.name,
            media_type=row.media_type,
            byte_size=row.byte_size,
            checksum_sha256=row.checksum_sha256,
            created_at=iso(row.created_at),
        )


class SkillSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A skill in a listing: enough to choose it (select it with `{id, expected_version}`)."""

    id: str
    name: str
    version: str
    description: str

    @classmethod
    def of(cls, row: Skill) -> SkillSummary:
        return cls(id=row.id, name=row.name, version=row.version, description=row.description)


class SkillPage(msgspec.Struct, frozen=True):
    items: list[SkillSummary]


class SkillOut(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    version: str
    description: str
    body: str

    @classmethod
    def of(cls, row: Skill) -> SkillOut:
        return cls(id=row.id, name=row.name, version=row.version, description=row.description, body=row.body)


SettingScalar = Annotated[str, msgspec.Meta(max_length=4096)] | int | float | bool
SettingKey = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]


class SettingsChange(Input):
    """PATCH /api/settings: dotted keys of the policy file, e.g. `profiles.local.rlm.max_iters`;
    `null` removes a key (its default applies)."""

    revision: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    set: Annotated[
        dict[SettingKey, SettingScalar | Annotated[list[SettingScalar], msgspec.Meta(max_length=100)] | None],
        msgspec.Meta(min_length=1, max_length=MAX_CHANGES),
    ]


class SettingsOut(msgspec.Struct, frozen=True, kw_only=True):
    """The policy file: env var names, never their values; changes apply when processes restart."""

    revision: str  # sha256 of the file's bytes: send it back with a change
    path: str  # the file's name only
    active_profile: str
    default_profile: str
    profiles: dict[str, Any]
    applies: Literal["on_restart"] = "on_restart"

    @classmethod
    def of(cls, snapshot: PolicySnapshot, active_profile: str) -> Self:
        return cls(
            revision=snapshot.revision,
            path=snapshot.name,
            active_profile=active_profile,
            default_profile=snapshot.default_profile,
            profiles=snapshot.profiles,
        )


class SettingsUpdated(SettingsOut):
    restart_required: bool = True


class FeedbackIn(Input):
    run_id: uuid.UUID
    rating: Literal["up", "down"]
    comment: Annotated[str, msgspec.Meta(max_length=4000, pattern=NO_NUL)] | None = None


class FeedbackOut(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    session_id: str
    run_id: str
    rating: Literal["up", "down"]
    comment: str | msgspec.UnsetType = msgspec.UNSET  # omitted when none was given, never null
    created_at: str
    forwarded: bool  # attached to the Run's trace (tracing on, and the Run was traced)

    @classmethod
    def of(cls, row: Feedback, iso: Any, *, forwarded: bool = False) -> FeedbackOut:
        return cls(
            id=row.id,
            session_id=row.session_id,
            run_id=row.run_id,
            rating=row.rating,  # type: ignore[arg-type]
            comment=msgspec.UNSET if row.comment is None else row.comment,
            created_at=iso(row.created_at),
            forwarded=forwarded,
        )


class WebhookAttemptOut(msgspec.Struct, frozen=True, kw_only=True):
    number: int
    started_at: str
    duration_ms: int
    status_code: int | None  # the receiver's answer; None: there was none (see `error`)
    error: str | None


class WebhookDeliveryOut(msgspec.Struct, frozen=True, kw_only=True):
    """A settled Run's delivery to its webhook, and each attempt (GET /api/runs/{id}/webhooks)."""

    id: str  # the `webhook-id` header of every attempt: the same for each
    url: str
    status: Literal["pending", "delivered", "failed"]
    attempts: list[WebhookAttemptOut]
    created_at: str
    next_attempt_at: str | None  # pending: when it is tried next
    finished_at: str | None


class WebhookDeliveryPage(msgspec.Struct, frozen=True):
    items: list[WebhookDeliveryOut]
