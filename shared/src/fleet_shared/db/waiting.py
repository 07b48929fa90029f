"""Follow-ups that wait behind a session's active Run (`multitask: enqueue`).

- A claim with `enqueue` that finds an active Run inserts a `waiting` Run at the end of the
  session's line (INSERT_WAITING), keeping its user Turn's parts on the row.
- Whatever ends the active Run promotes the first waiting one in the same transaction
  (promote_next_on): it becomes `queued`, and its user Turn is added after the ended Run's
  answer, so the history only ever grows at its end and the follow-up reads the settled history.
  Whoever committed the ending then enqueues its job (fleet_shared.followups).
- The recovery sweep promotes the line of a session left with none active (a Run ended by a
  release without follow-ups, mid-upgrade), and requeues a promoted Run whose job was lost.

On PostgreSQL an enqueue claim holds the session row FOR UPDATE and an ending holds it FOR
SHARE, each before it writes a Run: a follow-up accepted while the Run ahead of it ends is
either seen by that ending, or sees the Run ended (and is queued at once). On SQLite, each
statement below decides and writes at once under the database's one write lock.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from sqlalchemy import Connection, Table, and_, bindparam, exists, func, insert, or_, select, text, update
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db import webhooks
from fleet_shared.db.models import ACTIVE_SESSION, ACTIVE_SQL, Run, RunEventRow, Session, Turn, utcnow
from fleet_shared.events import RunCancelled, encode_event, event_type
from fleet_shared.ids import new_id
from fleet_shared.run_state import ACTIVE_STATUSES, RunCommand, RunStatus, decide

RUNS = cast(Table, Run.__table__)
SESSIONS = cast(Table, Session.__table__)
WAITING = RunStatus.WAITING.value
ACTIVE_VALUES = sorted(status.value for status in ACTIVE_STATUSES)
# The partial index's own words (ADR 0015): SQLite then finds the session's active Run by it.
IS_ACTIVE = text(f"runs.{ACTIVE_SQL}")
WAITING_COLUMNS = (
    "id", "session_id", "status", "attempt", "idempotency_key", "request_fingerprint", "model",
    "user_sequence", "last_seq", "created_at", "traceparent", "webhook_url", "approval", "waiting_parts",
    "requested_program_version_id",
)  # fmt: skip
SESSION_RUNS = RUNS.c.session_id == bindparam("session_id")
NEXT_PLACE = (
    select(func.coalesce(func.max(RUNS.c.waiting_place), 0) + 1).where(SESSION_RUNS).scalar_subquery()
)
WAITING_NOW = (
    select(func.count()).select_from(RUNS).where(SESSION_RUNS, RUNS.c.status == WAITING).scalar_subquery()
)
# One statement: inserted only while the session is active, has a Run ahead of this one, and
# fewer than `limit` Runs already wait.
INSERT_WAITING = insert(RUNS).from_select(
    [*WAITING_COLUMNS, "waiting_place"],
    select(
        *(bindparam(name, type_=RUNS.c[name].type) for name in WAITING_COLUMNS),
        NEXT_PLACE,
    ).where(
        SESSIONS.c.id == bindparam("session_id"),
        SESSIONS.c.status == ACTIVE_SESSION,
        exists().where(SESSION_RUNS, IS_ACTIVE),
        bindparam("limit") > WAITING_NOW,
    ),
)
WHY_NOT_WAITING = select(exists().where(SESSION_RUNS, IS_ACTIVE), WAITING_NOW, SESSIONS.c.status).where(
    SESSIONS.c.id == bindparam("session_id")
)


WaitingInsert = Literal["inserted", "ahead_ended", "queue_full", "session_archived", "unknown_session"]


def insert_waiting(
    connection: Connection, values: dict[str, Any], parts: list[Any], limit: int
) -> WaitingInsert:
    """Insert the follow-up as `waiting` (`values`: the claim's columns). What stood in the way
    otherwise: `ahead_ended` (no Run is active now: claim it as queued), `queue_full`, or the
    session's status. `inserted` when it waits."""
    row = {**values, "status": WAITING, "user_sequence": 0, "waiting_parts": parts, "limit": limit}
    if getattr(connection.execute(INSERT_WAITING, row), "rowcount", 0):
        return "inserted"
    found = connection.execute(WHY_NOT_WAITING, {"session_id": values["session_id"]}).first()
    if found is None or found[2] != ACTIVE_SESSION:
        return "session_archived" if found is not None and found[2] == "archived" else "unknown_session"
    return "queue_full" if found[0] else "ahead_ended"


MY_PLACE = select(RUNS.c.waiting_place).where(RUNS.c.id == bindparam("run_id")).scalar_subquery()
AHEAD = (
    select(func.count())
    .select_from(RUNS)
    .where(SESSION_RUNS, or_(IS_ACTIVE, and_(RUNS.c.status == WAITING, RUNS.c.waiting_place < MY_PLACE)))
)


def ahead_of(connection: Connection, session_id: str, run_id: str) -> int:
    """How many Turns of the session run or wait ahead of this waiting one."""
    return int(connection.execute(AHEAD, {"session_id": session_id, "run_id": run_id}).scalar_one())


def lock_session_on(db: OrmSession, session_id: str) -> None:
    """Hold the session row FOR SHARE until the transaction ends (PostgreSQL): an ending takes it
    before it writes, so an enqueue claim (FOR UPDATE) is wholly before or after it."""
    if db.get_bind().dialect.name == "postgresql":
        db.execute(select(Session.id).where(Session.id == session_id).with_for_update(read=True))


def promote_next_on(db: OrmSession, session_id: str) -> str | None:
    """In the transaction that ended the session's active Run: the first waiting Run becomes
    `queued`, its user Turn added after the last Turn. Its id, or None when none waits (or a Run
    is active still). The first one cancelled meanwhile yields to the next. A session with none
    waiting (nearly every ending) costs one indexed read."""
    target = decide(RunStatus.WAITING, RunCommand.PROMOTE).target
    checked = False
    while True:
        first = db.execute(
            select(Run.id, Run.waiting_parts)
            .where(Run.session_id == session_id, Run.status == WAITING)
            .order_by(Run.waiting_place)
            .limit(1)
        ).first()
        if first is None:
            return None
        if not checked and db.scalar(select(exists().where(Run.session_id == session_id, IS_ACTIVE))):
            return None
        checked = True
        last = db.scalar(select(func.max(Turn.sequence)).where(Turn.session_id == session_id)) or 0
        moved = db.execute(
            update(Run)
            .where(Run.id == first.id, Run.status == WAITING)
            .values(status=target.value, user_sequence=last + 1, waiting_parts=None, queued_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        if getattr(moved, "rowcount", 0) == 1:
            break
    db.add(
        Turn(
            id=new_id(),
            session_id=session_id,
            run_id=first.id,
            sequence=last + 1,
            role="user",
            parts=first.waiting_parts or [],
            status="completed",
            created_at=utcnow(),
        )
    )
    db.flush()
    return str(first.id)


def cancel_waiting_on(db: OrmSession, run_id: str) -> RunCancelled | None:
    """End a waiting Run `cancelled`, with its terminal event, and commit; None when it was no
    longer waiting. It never reached the history: no Turn is written for it."""
    terminal = RunCancelled(run_id=run_id, seq=1)
    target = decide(RunStatus.WAITING, RunCommand.CANCEL).target
    moved = db.execute(
        update(Run)
        .where(Run.id == run_id, Run.status == WAITING)
        .values(status=target.value, finished_at=utcnow(), last_seq=1, waiting_parts=None)
        .execution_options(synchronize_session=False)
    )
    if getattr(moved, "rowcount", 0) != 1:
        db.rollback()
        return None
    db.execute(
        insert(RunEventRow),
        [
            {
                "run_id": run_id,
                "seq": 1,
                "type": event_type(terminal),
                "payload": encode_event(terminal).decode(),
            }
        ],
    )
    session_id = db.scalar(select(Run.session_id).where(Run.id == run_id))
    webhooks.record_on(db, webhooks.RunEnded(run_id, str(session_id), target.value, None))
    db.commit()
    return terminal


def waiting_ids_on(db: OrmSession, session_id: str) -> list[str]:
    """The session's waiting Runs, in their order."""
    rows = db.scalars(
        select(Run.id).where(Run.session_id == session_id, Run.status == WAITING).order_by(Run.waiting_place)
    )
    return list(rows.all())


def stranded_sessions_on(db: OrmSession, limit: int = 50) -> list[str]:
    """Sessions whose line waits behind no active Run (the sweep promotes their first)."""
    ahead = RUNS.alias("ahead")
    rows = db.scalars(
        select(RUNS.c.session_id)
        .where(
            RUNS.c.status == WAITING,
            ~exists().where(ahead.c.session_id == RUNS.c.session_id, ahead.c.status.in_(ACTIVE_VALUES)),
        )
        .distinct()
        .limit(limit)
    )
    return list(rows.all())


def promote_stranded_on(db: OrmSession, session_id: str) -> str | None:
    """The sweep's promotion, in a transaction of its own."""
    lock_session_on(db, session_id)
    promoted = promote_next_on(db, session_id)
    db.commit()
    return promoted
