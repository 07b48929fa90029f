"""Feedback as stored: a rating of one Run's answer, recorded in the Run's own session."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_shared.db.models import Feedback, Run, utcnow
from fleet_shared.ids import new_id


async def record_feedback(
    db: AsyncSession, *, session_id: str, run_id: str, rating: str, comment: str | None
) -> Feedback | None:
    """The stored feedback; None when the Run does not exist or belongs to another session."""
    owner = await db.scalar(select(Run.session_id).where(Run.id == run_id))
    if owner != session_id:
        return None
    row = Feedback(
        id=new_id(), session_id=session_id, run_id=run_id, rating=rating, comment=comment, created_at=utcnow()
    )
    db.add(row)
    await db.commit()
    return row
