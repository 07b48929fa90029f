"""`fleet eval export-feedback`: users' ratings (`POST .../traces/feedback`) as an eval dataset.

Each rated Run becomes a row: its user's request, and a `judge` metric. An approved answer is
the row's `expected` (the judge checks a new answer says the same); a rejected one is named in
the rubric (a new answer must do better), with the user's comment. Attachments are not exported:
a row whose Turn had some says so in its rubric. The operator's command: it reads the database."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_shared.config import load_settings
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.db.models import Feedback, Run, Session, Turn

APPROVED_RUBRIC = "The answer says what the expected answer says (a user approved that answer)."


def text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def feedback_row(
    feedback: Feedback, request: list[dict[str, Any]], answer: list[dict[str, Any]]
) -> dict[str, Any]:
    attached = any(p.get("type") == "data-attachment" for p in request)
    note = " The user attached files, which are not part of this row." if attached else ""
    row: dict[str, Any] = {"id": f"feedback-{feedback.id}", "request": text_of(request)}
    if feedback.rating == "up":
        row["expected"] = text_of(answer)
        row["metric"] = {"name": "judge", "rubric": APPROVED_RUBRIC + note}
    else:
        comment = f" (their comment, quoted: {feedback.comment[:1000]!r})" if feedback.comment else ""
        rubric = (
            f"A user rejected this answer{comment}: {text_of(answer)[:4000]!r}. "
            f"A good answer does better than it.{note}"
        )
        row["metric"] = {"name": "judge", "rubric": rubric}
    return row


async def feedback_rows(db: AsyncSession, rating: str, tenant: str | None) -> list[dict[str, Any]]:
    user, assistant = Turn.__table__.alias("user_turn"), Turn.__table__.alias("assistant_turn")
    query = (
        select(Feedback, user.c.parts, assistant.c.parts)
        .join(Run, Run.id == Feedback.run_id)
        .join(Session, Session.id == Feedback.session_id)
        .join(user, and_(user.c.session_id == Run.session_id, user.c.sequence == Run.user_sequence))
        .join(assistant, and_(assistant.c.run_id == Run.id, assistant.c.role == "assistant"))
        .where(Run.status == "completed", Session.status != "deleted")
        .order_by(Feedback.created_at, Feedback.id)
    )
    if rating != "all":
        query = query.where(Feedback.rating == rating)
    if tenant is not None:
        query = query.where(Session.tenant_id == tenant)
    return [feedback_row(fb, request or [], answer or []) for fb, request, answer in await db.execute(query)]


def export_feedback(environ: Mapping[str, str], out: Path, rating: str, tenant: str | None) -> int:
    settings = load_settings(environ, lm_credentials=False)

    async def run() -> list[dict[str, Any]]:
        engine = create_engine(settings.database_url)
        try:
            async with session_factory(engine)() as db:
                return await feedback_rows(db, rating, tenant)
        finally:
            await engine.dispose()

    rows = asyncio.run(run())
    out.parent.mkdir(parents=True, exist_ok=True)
    # Users' words, perhaps several tenants': readable by its owner only.
    descriptor = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as written:
        written.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(
        f"wrote {len(rows)} rows to {out} (score them with `fleet eval run {out} --judge-profile <profile>`)"
    )
    return 0
