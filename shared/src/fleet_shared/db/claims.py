"""Claiming a Turn (the gateway): one transaction that honours the Idempotency-Key, keeps one
active Run per session (or lets a follow-up wait behind it, fleet_shared.db.waiting), and inserts
the Run with its user Turn; and withdrawing a claim whose job could not be queued."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, assert_never, cast

import msgspec
from sqlalchemy import Connection, Engine, Table, and_, bindparam, delete, func, insert, or_, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from fleet_shared.db import waiting
from fleet_shared.db.engine import sqlite_twin
from fleet_shared.db.models import (
    ACTIVE_SESSION,
    ACTIVE_SQL,
    DELETED,
    Attachment,
    Run,
    Session,
    Skill,
    Turn,
    utcnow,
)
from fleet_shared.ids import new_id
from fleet_shared.run_state import RunStatus
from fleet_shared.skills import selected_skill_part
from fleet_shared.tenancy import Principal
from fleet_shared.transcript import attachment_part


class Claimed(msgspec.Struct, frozen=True):
    run: Run
    created: bool  # False: the same key and body named an existing Run (replay or attach)
    ahead: int = 0  # a waiting Run's: how many Turns of its session run or wait ahead of it


class ClaimRefused(msgspec.Struct, frozen=True):
    reason: Literal[
        "idempotency_key_mismatch",
        "turn_in_progress",
        "session_archived",
        "unknown_session",
        "active_turns_quota",
        "queue_full",
    ]
    run_id: str | None = None


# In the partial index's own words, with literal values: SQLite uses uq_runs_one_active_per_session
# only for a condition it can see implies the index's. With bound parameters it reads every Run of
# the session instead, so a claim would slow as the session grows (ADR 0015).
RUN_IS_ACTIVE = text(f"runs.{ACTIVE_SQL}")
RUNS = cast(Table, Run.__table__)
TURNS = cast(Table, Turn.__table__)


@dataclass(frozen=True)
class ClaimContext:
    """What a claim needs to know before it writes, read in one statement."""

    session_status: str | None  # None: no such session, or not the caller's to change
    keyed: Run | None  # the Run holding this key
    active: Run | None  # the session's active Run, when it holds another key
    last_sequence: int


SESSIONS = cast(Table, Session.__table__)
# The claim's statements are built once: building and cache-keying a statement costs more than
# running it on SQLite, and the claim sits between a POST and its first byte. Core rows, not
# ORM entities, for the same reason.
LAST_SEQUENCE = (
    select(func.max(TURNS.c.sequence)).where(TURNS.c.session_id == bindparam("session_id")).scalar_subquery()
)
CLAIM_CONTEXT = (
    select(SESSIONS.c.status, SESSIONS.c.tenant_id, SESSIONS.c.owner_id, LAST_SEQUENCE, *RUNS.c)
    .select_from(SESSIONS)
    .outerjoin(
        RUNS,
        and_(
            RUNS.c.session_id == SESSIONS.c.id,
            or_(RUNS.c.idempotency_key == bindparam("key"), RUN_IS_ACTIVE),
        ),
    )
    .where(SESSIONS.c.id == bindparam("session_id"))
    # On PostgreSQL the session row is held FOR SHARE until the claim commits: a DELETE (or the
    # gc's expiry) that marks it waits for the claim, then sees its Run (SQLite's one writer
    # orders them anyway; it renders no locking clause).
    .with_for_update(read=True, of=SESSIONS)
)
# An enqueue claim holds it FOR UPDATE instead: enqueue claims, and the endings that promote a
# waiting Run, then take their turns (fleet_shared.db.waiting).
CLAIM_CONTEXT_EXCLUSIVE = CLAIM_CONTEXT.with_for_update(of=SESSIONS)
# What a claim sets; the other columns stay SQL NULL (a JSON column given None would store `null`).
CLAIMED_COLUMNS = (
    "id", "session_id", "status", "attempt", "idempotency_key", "request_fingerprint", "model",
    "user_sequence", "last_seq", "created_at", "traceparent", "webhook_url", "approval",
    "requested_program_version_id",
)  # fmt: skip
INSERT_RUN_IF_ACTIVE = insert(RUNS).from_select(
    list(CLAIMED_COLUMNS),
    select(*(bindparam(name, type_=RUNS.c[name].type) for name in CLAIMED_COLUMNS)).where(
        SESSIONS.c.id == bindparam("session_id"), SESSIONS.c.status == ACTIVE_SESSION
    ),
)
# The same, and only while the tenant has fewer than `limit` active Runs. On SQLite the INSERT
# takes the write lock before it counts, so the count is exact; on PostgreSQL the claim first
# takes the tenant's advisory lock (TENANT_LOCK), so concurrent claims count one at a time.
ACTIVE_IN_TENANT = (
    select(func.count())
    .select_from(RUNS.join(SESSIONS, SESSIONS.c.id == RUNS.c.session_id))
    .where(SESSIONS.c.tenant_id == bindparam("tenant"), RUN_IS_ACTIVE)
    .scalar_subquery()
)
INSERT_RUN_WITHIN_QUOTA = insert(RUNS).from_select(
    list(CLAIMED_COLUMNS),
    select(*(bindparam(name, type_=RUNS.c[name].type) for name in CLAIMED_COLUMNS)).where(
        SESSIONS.c.id == bindparam("session_id"),
        SESSIONS.c.status == ACTIVE_SESSION,
        bindparam("limit") > ACTIVE_IN_TENANT,
    ),
)
TENANT_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))")
INSERT_TURN = insert(TURNS)


@dataclass(frozen=True)
class ClaimRequest:
    session_id: str
    idempotency_key: str
    fingerprint: str
    model: str
    parts: list[dict[str, object]]  # the user Turn's UIMessage parts
    caller: Principal
    active_limit: int = 0  # the tenant's quota of active Turns; 0: none
    traceparent: str | None = None  # the POST's span (fleet_shared.tracing); None: not traced
    # `multitask: enqueue`: with a Run active, wait behind it while fewer than this many do;
    # 0: refuse (`turn_in_progress`).
    waiting_limit: int = 0
    webhook_url: str | None = None  # where the Run is posted when it ends (else its session's)
    approval: str | None = None  # whether its cells wait for approval (else its session's say)
    program_version_id: str | None = None  # the program it runs (else the active one at its start)


def read_claim_context(connection: Connection, request: ClaimRequest) -> ClaimContext:
    """An outer join from the session row, so the session's status and last sequence come back
    even when no Run matches (and no row at all means no session). A session the caller may not
    change reads as none: another tenant's is the same 404 as an unknown one."""
    key = request.idempotency_key
    statement = CLAIM_CONTEXT_EXCLUSIVE if request.waiting_limit else CLAIM_CONTEXT
    rows = connection.execute(statement, {"session_id": request.session_id, "key": key}).all()
    if not rows or rows[0][0] == DELETED or not request.caller.may_change(rows[0][1], rows[0][2]):
        return ClaimContext(None, None, None, 0)
    runs = [run_of(row[4:]) for row in rows if row[4] is not None]
    return ClaimContext(
        session_status=rows[0][0],
        keyed=next((run for run in runs if run.idempotency_key == key), None),
        active=next((run for run in runs if run.idempotency_key != key), None),
        last_sequence=int(rows[0][3] or 0),
    )


def run_of(values: Sequence[object]) -> Run:
    """A detached Run from a row of RUNS's columns, in table order."""
    return Run(**{column.key: value for column, value in zip(RUNS.columns, values, strict=True)})


def outcome_of(context: ClaimContext, fingerprint: str) -> Claimed | ClaimRefused | None:
    """What an earlier or concurrent claim, or the session, decides for this one; None when the
    way is clear. The key first: a Run that exists replays, even in an archived session."""
    if context.session_status is None:
        return ClaimRefused("unknown_session")
    if context.keyed is not None:
        return same_key_outcome(context.keyed, fingerprint)
    if context.active is not None:
        return ClaimRefused("turn_in_progress", context.active.id)
    if context.session_status == "archived":
        return ClaimRefused("session_archived")
    return None


async def claim_turn(
    bind: AsyncEngine | AsyncSession,
    *,
    session_id: str,
    idempotency_key: str,
    fingerprint: str,
    text: str,
    model: str,
    caller: Principal,
    active_limit: int = 0,
    attachments: Sequence[Attachment] = (),
    skills: Sequence[Skill] = (),
    traceparent: str | None = None,
    waiting_limit: int = 0,
    webhook_url: str | None = None,
    approval: str | None = None,
    program_version_id: str | None = None,
) -> Claimed | ClaimRefused:
    """In one transaction: honour the key, insert the queued Run and the user Turn (its text,
    then one `data-attachment` part per attachment and one `data-skill` part per selected skill:
    the worker stages and loads them from there).

    A claim sits between a POST and its first byte, so it is one read, two plain INSERTs and the
    commit, on a connection of its own and with no ORM session: on SQLite in one hop to a thread
    (the engine's pysqlite twin), on PostgreSQL a round trip per statement. The Run returned is
    built from the inserted values, outside the ORM. Given a session, it commits the session's
    own lookups first (which frees their connection) and claims on its engine."""
    if isinstance(bind, AsyncSession):
        if bind.in_transaction():
            await bind.commit()
        bind = bind.bind  # type: ignore[assignment]
    if not isinstance(bind, AsyncEngine):
        raise TypeError("claim_turn needs an AsyncEngine, or a session bound to one")
    engine = bind
    parts = [
        {"type": "text", "text": text},
        *(attachment_part(a.id, a.filename, a.byte_size) for a in attachments),
        *(selected_skill_part(skill) for skill in skills),
    ]
    request = ClaimRequest(
        session_id, idempotency_key, fingerprint, model, parts, caller, active_limit, traceparent,
        waiting_limit, webhook_url, approval, program_version_id,
    )  # fmt: skip
    twin = sqlite_twin(engine)
    if twin is not None:
        return await twin.run(functools.partial(claim_on_twin, request=request))
    async with engine.connect() as connection:
        return await connection.run_sync(claim_transaction, request)


def claim_on_twin(engine: Engine, request: ClaimRequest) -> Claimed | ClaimRefused:
    """The claim on a SQLite file's synchronous twin, run in the twin's thread."""
    with engine.connect() as connection:
        return claim_transaction(connection, request)


def claim_transaction(connection: Connection, request: ClaimRequest) -> Claimed | ClaimRefused:
    """The claim's transaction on a connection it has to itself: committed only for a new Run.
    An enqueue claim that lost a race to the Run ahead of it ending tries again."""
    for _ in range(ENQUEUE_TRIES if request.waiting_limit else 1):
        try:
            outcome = insert_claim(connection, request)
        except IntegrityError:
            # A concurrent claim won the race: answer as if it had committed before we looked.
            connection.rollback()
            context = read_claim_context(connection, request)
            outcome = outcome_of(context, request.fingerprint) or ClaimRefused("turn_in_progress")
        if outcome is not AHEAD_ENDED and not (request.waiting_limit and is_in_progress(outcome)):
            break
        connection.rollback()
    if outcome is AHEAD_ENDED:
        outcome = ClaimRefused("turn_in_progress")
    if isinstance(outcome, Claimed) and outcome.created:
        connection.commit()
    else:
        connection.rollback()
    return outcome


def insert_claim(connection: Connection, request: ClaimRequest) -> Claimed | ClaimRefused:
    """The Run (`queued`) and the user Turn inserted, unless the key's Run, an active Run or an
    archived session, or the tenant's quota of active Turns answers first. An enqueue claim
    behind an active Run inserts a `waiting` Run instead (AHEAD_ENDED: that Run just ended)."""
    if request.active_limit and connection.dialect.name == "postgresql":
        connection.execute(TENANT_LOCK, {"key": f"fleet:active-turns:{request.caller.tenant}"})
    context = read_claim_context(connection, request)
    outcome = outcome_of(context, request.fingerprint)
    if request.waiting_limit and is_in_progress(outcome):
        return wait_behind(connection, request)
    if isinstance(outcome, Claimed) and outcome.run.status == RunStatus.WAITING.value:
        return Claimed(outcome.run, False, waiting.ahead_of(connection, request.session_id, outcome.run.id))
    if outcome is not None:
        return outcome
    stamp = utcnow()
    values = {
        "id": new_id(), "session_id": request.session_id, "status": RunStatus.QUEUED.value,
        "attempt": 0, "idempotency_key": request.idempotency_key,
        "request_fingerprint": request.fingerprint, "model": request.model,
        "user_sequence": context.last_sequence + 1, "last_seq": 0, "created_at": stamp,
        "traceparent": request.traceparent, "webhook_url": request.webhook_url,
        "approval": request.approval, "requested_program_version_id": request.program_version_id,
    }  # fmt: skip
    # On SQLite the INSERT takes the write lock, so no archive lands before our commit; on
    # PostgreSQL an archive committed before this statement is seen here (READ COMMITTED reads
    # per statement), and one committed after it orders after the claim.
    if request.active_limit:
        limits = {"tenant": request.caller.tenant, "limit": request.active_limit}
        inserted = connection.execute(INSERT_RUN_WITHIN_QUOTA, {**values, **limits})
    else:
        inserted = connection.execute(INSERT_RUN_IF_ACTIVE, values)
    if not getattr(inserted, "rowcount", 0):  # archived or deleted meanwhile, or over the quota
        status = read_claim_context(connection, request).session_status
        if status is None:
            return ClaimRefused("unknown_session")
        return ClaimRefused("session_archived" if status == "archived" else "active_turns_quota")
    connection.execute(
        INSERT_TURN,
        {
            "id": new_id(), "session_id": request.session_id, "run_id": values["id"],
            "sequence": values["user_sequence"], "role": "user", "parts": request.parts,
            "status": "completed", "created_at": stamp,
        },
    )  # fmt: skip
    unset = dict.fromkeys(("failure_code", "failure_message", "usage", "started_at", "finished_at"))
    return Claimed(Run(**values, **unset), created=True)


ENQUEUE_TRIES = 3
# An enqueue claim found the Run ahead of it ended meanwhile: claim again (as queued).
AHEAD_ENDED = ClaimRefused("turn_in_progress")


def is_in_progress(outcome: Claimed | ClaimRefused | None) -> bool:
    return isinstance(outcome, ClaimRefused) and outcome.reason == "turn_in_progress"


def wait_behind(connection: Connection, request: ClaimRequest) -> Claimed | ClaimRefused:
    """The follow-up inserted `waiting` behind the session's active Run; its user Turn joins the
    history when it is promoted (fleet_shared.db.waiting)."""
    values = {
        "id": new_id(), "session_id": request.session_id, "attempt": 0,
        "idempotency_key": request.idempotency_key, "request_fingerprint": request.fingerprint,
        "model": request.model, "last_seq": 0, "created_at": utcnow(), "traceparent": request.traceparent,
        "webhook_url": request.webhook_url, "approval": request.approval,
        "requested_program_version_id": request.program_version_id,
    }  # fmt: skip
    result = waiting.insert_waiting(connection, values, request.parts, request.waiting_limit)
    match result:
        case "inserted":
            unset = dict.fromkeys(
                ("failure_code", "failure_message", "usage", "started_at", "finished_at", "queued_at")
            )
            status = RunStatus.WAITING.value
            run = Run(**values, **unset, status=status, user_sequence=0, waiting_parts=request.parts)
            return Claimed(run, True, waiting.ahead_of(connection, request.session_id, run.id))
        case "ahead_ended":
            return AHEAD_ENDED
        case "queue_full" | "session_archived" | "unknown_session":
            return ClaimRefused(result)
        case _:
            assert_never(result)


def same_key_outcome(run: Run, fingerprint: str) -> Claimed | ClaimRefused:
    if run.request_fingerprint != fingerprint:
        return ClaimRefused("idempotency_key_mismatch", run.id)
    return Claimed(run, created=False)


WITHDRAWABLE = (RunStatus.QUEUED.value, RunStatus.WAITING.value)


async def withdraw_claim(db: AsyncSession, run_id: str) -> bool:
    """Undo a claim whose job could not be queued, or that a quota refused: the Run and its user
    Turn vanish, so the same Idempotency-Key works again, and a follow-up waiting behind it is
    promoted (fleet_shared.followups starts it). False when a worker already started it (then it
    stays)."""
    session_id = await db.scalar(
        select(Run.session_id).where(Run.id == run_id, Run.status.in_(WITHDRAWABLE), Run.attempt == 0)
    )
    if session_id is None:
        await db.rollback()
        return False
    await db.run_sync(waiting.lock_session_on, session_id)
    await db.execute(delete(Turn).where(Turn.run_id == run_id))
    result = await db.execute(
        delete(Run).where(Run.id == run_id, Run.status.in_(WITHDRAWABLE), Run.attempt == 0)
    )
    if getattr(result, "rowcount", 0) != 1:
        await db.rollback()
        return False
    await db.run_sync(waiting.promote_next_on, session_id)
    await db.commit()
    return True
