"""The reaper (an arq cron job in every worker): Runs whose lease lapsed are settled `worker_lost`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from redis.exceptions import RedisError

from fleet_shared import event_log, redis_keys
from fleet_shared.db import queries
from fleet_shared.db.models import Run
from fleet_shared.events import RunFailed, is_terminal
from fleet_shared.run_state import RunCommand, RunStatus
from fleet_shared.transcript import fold_parts
from fleet_worker.settlement import commit_with_retry
from fleet_worker.turn import WorkerDeps

log = structlog.get_logger(__name__)
LOST_MESSAGE = "the worker running this Turn stopped responding; send it again"


async def reap_lost_runs(ctx: dict[str, Any]) -> int:
    """Settle every Run that is active in the DB but has no live lease. Returns how many."""
    deps: WorkerDeps = ctx["deps"]
    # Only Runs older than one lease period: a Run just started may not have written its lease yet.
    cutoff = datetime.now(UTC) - timedelta(seconds=deps.settings.profile.worker.lease_seconds)
    async with deps.sessions() as db:
        candidates = await queries.stale_active_runs(db, started_before=cutoff)
    reaped = 0
    for run in candidates:
        try:
            if await deps.redis.exists(redis_keys.run_lease(run.id)):
                continue
            reaped += await reap(deps, run)
        except (RedisError, OSError) as exc:
            log.warning("reaper.redis_unavailable", error=str(exc))
            break
    return reaped


async def reap(deps: WorkerDeps, run: Run) -> int:
    logged = [e for e in await event_log.read_all_after(deps.redis, run.id, 0) if not is_terminal(e)]
    terminal = RunFailed(
        run_id=run.id, seq=(logged[-1].seq if logged else 0) + 1, code="worker_lost", message=LOST_MESSAGE
    )
    events = [*logged, terminal]
    settlement = queries.Settlement(
        run_id=run.id,
        session_id=run.session_id,
        attempt=run.attempt,
        current=RunStatus.SETTLING,
        command=RunCommand.FAIL,
        sequence=run.user_sequence + 1,
        parts=fold_parts(events),
        turn_status="failed",
        events=events,
        failure_code="worker_lost",
        failure_message=LOST_MESSAGE,
    )
    if not await commit_with_retry(deps.sessions, settlement):
        return 0  # its worker finished after all, or another reaper was first
    await event_log.append(deps.redis, terminal)
    log.warning("reaper.settled_lost_run", run_id=run.id, attempt=run.attempt)
    return 1
