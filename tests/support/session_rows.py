"""How many rows of each kind still name a session, its workspace or its Runs: what a deleted
session must have none of (DELETE /api/sessions/{id}, fleet_shared.db.purge)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sqlalchemy import func, select

from fleet_shared.db import models
from fleet_shared.db.engine import create_engine, session_factory


def rows_naming(
    database_url: str, session_id: str, workspace_id: str, run_ids: Sequence[str]
) -> dict[str, int]:
    checks = {
        "sessions": (models.Session, models.Session.id == session_id),
        "turns": (models.Turn, models.Turn.session_id == session_id),
        "runs": (models.Run, models.Run.session_id == session_id),
        "runs by id": (models.Run, models.Run.id.in_(run_ids)),
        "run_events": (models.RunEventRow, models.RunEventRow.run_id.in_(run_ids)),
        "artifacts": (models.Artifact, models.Artifact.session_id == session_id),
        "feedback": (models.Feedback, models.Feedback.session_id == session_id),
        "workspace_versions": (models.WorkspaceVersion, models.WorkspaceVersion.workspace_id == workspace_id),
        "workspaces": (models.Workspace, models.Workspace.id == workspace_id),
    }

    async def count() -> dict[str, int]:
        engine = create_engine(database_url)
        try:
            async with session_factory(engine)() as db:
                return {
                    name: int(await db.scalar(select(func.count()).select_from(model).where(where)) or 0)
                    for name, (model, where) in checks.items()
                }
        finally:
            await engine.dispose()

    return asyncio.run(count())
