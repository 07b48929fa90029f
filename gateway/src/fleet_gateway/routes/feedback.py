"""Feedback: a user's rating of one Run's answer, kept with its session."""

from __future__ import annotations

from litestar import Controller, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import not_found
from fleet_gateway.routes.sessions import load_session
from fleet_gateway.schemas import FeedbackIn, FeedbackOut
from fleet_gateway.state import GatewayState
from fleet_gateway.streaming import iso
from fleet_shared.db.feedback import record_feedback
from fleet_shared.db.models import Feedback, Run
from fleet_shared.redaction import redact_text
from fleet_shared.tenancy import Principal
from fleet_shared.tracing import context_of, start_span, tracing_on


class FeedbackController(Controller):
    path = "/api/sessions/{session_id:str}/traces"

    @post("/feedback", status_code=201)
    async def submit_feedback(
        self,
        db: NamedDependency[AsyncSession],
        gw: NamedDependency[GatewayState],
        caller: NamedDependency[Principal],
        session_id: FromPath[str],
        data: JSONBody[FeedbackIn],
    ) -> FeedbackOut:
        """Record an up or down rating (and an optional comment) of one of the session's Runs.

        It is stored in the database. With tracing on (the `OTEL_*` variables), it is also
        attached to the Run's trace as a `turn.feedback` span with a `feedback` event, and
        `forwarded` is true; the comment goes there only with
        `observability.tracing.capture_content`. A Run of another session answers the same 404
        as an unknown one."""
        session = await load_session(db, session_id, caller)  # a reader may rate what it reads
        try:
            row = await record_feedback(
                db, session_id=session.id, run_id=str(data.run_id), rating=data.rating, comment=data.comment
            )
        except IntegrityError:  # the Run was withdrawn (its enqueue failed) as this landed
            await db.rollback()
            row = None
        if row is None:
            raise not_found("run")
        forwarded = False
        if tracing_on():  # off, no query and no span
            traceparent = await db.scalar(select(Run.traceparent).where(Run.id == row.run_id))
            forwarded = forward(row, traceparent, gw.settings.profile.observability.tracing.capture_content)
        return FeedbackOut.of(row, iso, forwarded=forwarded)


def forward(row: Feedback, traceparent: str | None, capture_content: bool) -> bool:
    """The rating as a span in the Run's trace; False when the Run has none, or its trace is not
    recorded (a sampler left it out)."""
    parent = context_of(traceparent)
    if parent is None:
        return False
    attributes = {"fleet.run_id": row.run_id, "fleet.session_id": row.session_id, "fleet.feedback_id": row.id}
    span = start_span("turn.feedback", parent, attributes)
    recorded = span.is_recording()  # false under an unsampled parent: nothing reaches the exporter
    event: dict[str, str] = {"fleet.rating": row.rating}
    if capture_content and row.comment:
        event["fleet.comment"] = redact_text(row.comment)
    span.add_event("feedback", event)
    span.end()
    return recorded
