"""Starting a follow-up once the Run ahead of it ended (fleet_shared.db.waiting promoted it in the
ending's transaction): whoever committed that ending enqueues its job. A job that never gets
enqueued (this process died, Redis was down) is the recovery sweep's, as any lost job is."""

from __future__ import annotations

import structlog
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared.db.models import Run
from fleet_shared.jobs import JobQueue
from fleet_shared.run_state import RunStatus

log = structlog.get_logger(__name__)


async def start_promoted(
    db_sessions: async_sessionmaker[AsyncSession], jobs: JobQueue, session_id: str
) -> str | None:
    """Enqueue the job of the session's promoted follow-up, if one is queued; its id."""
    try:
        async with db_sessions() as db:
            run_id = await db.scalar(
                select(Run.id).where(
                    Run.session_id == session_id,
                    Run.status == RunStatus.QUEUED.value,
                    Run.waiting_place.is_not(None),
                )
            )
        if run_id is None:
            return None
        await jobs.enqueue(run_id)  # the job id is the Run's: a second enqueue adds nothing
    except (RedisError, OSError, SQLAlchemyError) as exc:
        log.warning("followup.enqueue_failed", session_id=session_id, error_type=type(exc).__name__)
        return None
    log.info("followup.started", run_id=run_id)
    return str(run_id)
