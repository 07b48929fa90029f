"""Feedback: a user's rating of one Run's answer, kept with its session."""

from __future__ import annotations

from litestar import Controller, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.errors import not_found
from fleet_gateway.routes.sessions import load_session
from fleet_gateway.schemas import FeedbackIn, FeedbackOut
from fleet_gateway.streaming import iso
from fleet_shared.db.feedback import record_feedback
from fleet_shared.tenancy import Principal


class FeedbackController(Controller):
    path = "/api/sessions/{session_id:str}/traces"

    @post("/feedback", status_code=201)
    async def submit_feedback(
        self,
        db: NamedDependency[AsyncSession],
        caller: NamedDependency[Principal],
        session_id: FromPath[str],
        data: JSONBody[FeedbackIn],
    ) -> FeedbackOut:
        """Record an up or down rating (and an optional comment) of one of the session's Runs.

        It is stored in the database only: tracing (MLflow) is not implemented, so nothing is
        forwarded and `forwarded` is always false. A Run of another session answers the same 404
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
        return FeedbackOut.of(row, iso)
