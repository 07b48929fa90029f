"""Webhook delivery rows: one per ended Run whose Turn or session names a target, written in the
transaction that ends the Run; then taken, attempted and finished by any process
(fleet_shared.webhook_delivery), each step a fenced UPDATE, so two processes never both own an
attempt and a process that dies mid-attempt leaves the delivery to another after its lease."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import msgspec
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.db.models import Run, Session, WebhookAttempt, WebhookDelivery, utcnow
from fleet_shared.ids import new_id

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


class RunEnded(msgspec.Struct, frozen=True, omit_defaults=True):
    """The body posted: the settled Run, as its history and usage have it."""

    run_id: str
    session_id: str
    status: str
    usage: dict[str, Any] | None
    failure_code: str | None = None
    answer: str | None = None


def record_on(db: OrmSession, ended: RunEnded) -> str | None:
    """In the ending's transaction: a pending delivery of `ended` to its Run's target (or its
    session's). Its id, or None when neither names one."""
    url = db.scalar(
        select(func.coalesce(Run.webhook_url, Session.webhook_url))
        .join(Session, Session.id == Run.session_id)
        .where(Run.id == ended.run_id)
    )
    if not url:
        return None
    delivery_id, now = new_id(), utcnow()
    db.execute(
        insert(WebhookDelivery).values(
            id=delivery_id, run_id=ended.run_id, session_id=ended.session_id, url=url,
            body=msgspec.json.encode(ended).decode(), status=PENDING, attempts=0,
            next_attempt_at=now, created_at=now,
        )
    )  # fmt: skip
    return delivery_id


def answer_of(parts: Sequence[dict[str, Any]]) -> str | None:
    """A completed Turn's answer: the last text part of its history."""
    texts = [part.get("text") for part in parts if part.get("type") == "text"]
    return str(texts[-1]) if texts and texts[-1] is not None else None


@dataclass(frozen=True)
class Taken:
    id: str
    url: str
    body: str
    attempt: int  # this attempt's number (1 for the first)
    created_at: datetime
    lease_until: datetime  # the due time the taking set: only its holder may record the attempt


def due_on(db: OrmSession, now: datetime, limit: int) -> list[tuple[str, datetime]]:
    """Pending deliveries due at `now` (id and the due time the taking compares against)."""
    rows = db.execute(
        select(WebhookDelivery.id, WebhookDelivery.next_attempt_at)
        .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
    ).all()
    return [(row[0], row[1]) for row in rows]


def take_on(db: OrmSession, delivery_id: str, due: datetime, lease: timedelta) -> Taken | None:
    """Own the next attempt until `lease` from now (compare-and-set on the due time: one taker
    wins); None when another process took it first."""
    lease_until = utcnow() + lease
    moved = db.execute(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == delivery_id,
            WebhookDelivery.status == PENDING,
            WebhookDelivery.next_attempt_at == due,
        )
        .values(next_attempt_at=lease_until)
        .execution_options(synchronize_session=False)
    )
    if getattr(moved, "rowcount", 0) != 1:
        db.rollback()
        return None
    row = db.execute(
        select(
            WebhookDelivery.url, WebhookDelivery.body, WebhookDelivery.attempts, WebhookDelivery.created_at
        ).where(WebhookDelivery.id == delivery_id)
    ).one()
    db.commit()
    return Taken(delivery_id, row[0], row[1], int(row[2]) + 1, row[3], lease_until)


@dataclass(frozen=True)
class Attempted:
    started_at: datetime
    duration_ms: int
    status_code: int | None
    error: str | None
    # What comes next: `delivered`, `failed` (given up, or a target that can never be reached),
    # or `pending` again at `retry_at`.
    outcome: str
    retry_at: datetime | None = None


def finish_attempt_on(db: OrmSession, taken: Taken, attempted: Attempted) -> bool:
    """Record the attempt and move the delivery on, unless the lease ran out and another process
    took the delivery (it set another due time): false then, and nothing is written."""
    values: dict[str, Any] = {"attempts": taken.attempt, "status": attempted.outcome}
    if attempted.outcome == PENDING:
        values["next_attempt_at"] = attempted.retry_at
    else:
        values["finished_at"] = utcnow()
    moved = db.execute(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == taken.id,
            WebhookDelivery.status == PENDING,
            WebhookDelivery.attempts == taken.attempt - 1,
            WebhookDelivery.next_attempt_at == taken.lease_until,
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if getattr(moved, "rowcount", 0) != 1:
        db.rollback()
        return False
    db.add(
        WebhookAttempt(
            delivery_id=taken.id,
            number=taken.attempt,
            started_at=attempted.started_at,
            duration_ms=attempted.duration_ms,
            status_code=attempted.status_code,
            error=attempted.error,
        )
    )
    db.commit()
    return True


def deliveries_of_on(db: OrmSession, run_id: str) -> list[tuple[WebhookDelivery, list[WebhookAttempt]]]:
    """The Run's delivery (at most one) with its attempts, oldest first."""
    found = list(db.scalars(select(WebhookDelivery).where(WebhookDelivery.run_id == run_id)))
    out = []
    for delivery in found:
        attempts = db.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id == delivery.id)
            .order_by(WebhookAttempt.number)
        )
        out.append((delivery, list(attempts)))
    return out


def delete_of_session_on(db: OrmSession, session_id: str) -> None:
    """A purged session's deliveries and their attempts (fleet_shared.db.purge)."""
    ids = select(WebhookDelivery.id).where(WebhookDelivery.session_id == session_id)
    db.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(ids)))
    db.execute(delete(WebhookDelivery).where(WebhookDelivery.session_id == session_id))
