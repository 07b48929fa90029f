"""The reaper (an arq cron job in every worker) keeps every Run moving toward an end.

- A running Run whose lease lapsed (its worker died) is settled `worker_lost`.
- A queued Run whose arq job vanished (the gateway died before enqueueing, or Redis lost its
  data) is enqueued again; one that stays lost for `QUEUED_GIVE_UP` is failed `enqueue_lost`.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import structlog
from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from fleet_shared import event_log, redis_keys
from fleet_shared.db import queries
from fleet_shared.db.models import Run
from fleet_shared.events import RunFailed, is_terminal
from fleet_shared.queue import RUN_TURN
from fleet_shared.run_state import RunCommand, RunStatus
from fleet_shared.transcript import fold_parts
from fleet_worker.settlement import commit_with_retry
from fleet_worker.turn import WorkerDeps

log = structlog.get_logger(__name__)
LOST_MESSAGE = "the worker running this Turn stopped responding; send it again"
QUEUED_GRACE = timedelta(seconds=15)  # longer than any claim-commit → enqueue gap
QUEUED_GIVE_UP = timedelta(minutes=10)


REAPER_INTERVAL_SECONDS = 2.0
REAP_BATCH = 50  # lost Runs settled per tick; the next tick takes the rest


async def reaper_loop(deps: WorkerDeps, arq: ArqRedis) -> None:
    """Runs in every worker beside its jobs (not as an arq job: a worker whose job slots are all
    busy must still reap). Several reapers at once are safe: every write is fenced."""
    while True:
        await asyncio.sleep(REAPER_INTERVAL_SECONDS)
        try:
            await reap_lost_runs(deps, arq)
        except (RedisError, OSError, SQLAlchemyError) as exc:
            log.warning("reaper.tick_failed", error_type=type(exc).__name__, error=str(exc))


async def reap_lost_runs(deps: WorkerDeps, arq: ArqRedis) -> int:
    """One reaper tick. Returns how many Runs it settled or re-enqueued."""
    return await settle_lost_runs(deps) + await requeue_lost_jobs(deps, arq)


async def settle_lost_runs(deps: WorkerDeps) -> int:
    """Settle every Run that is active in the DB but has no live lease."""
    # Only Runs older than one lease period: a Run just started may not have written its lease yet.
    cutoff = datetime.now(UTC) - timedelta(seconds=deps.settings.profile.worker.lease_seconds)
    async with deps.sessions() as db:
        candidate_ids = await queries.stale_active_run_ids(db, started_before=cutoff)
    if not candidate_ids:
        return 0
    try:
        async with deps.redis.pipeline(transaction=False) as pipe:
            for run_id in candidate_ids:
                pipe.exists(redis_keys.run_lease(run_id))
            leased = await pipe.execute()
    except (RedisError, OSError) as exc:
        log.warning("reaper.redis_unavailable", error=str(exc))
        return 0
    lost_ids = [run_id for run_id, held in zip(candidate_ids, leased, strict=True) if not held]
    async with deps.sessions() as db:
        lost = await queries.get_runs(db, lost_ids[:REAP_BATCH])
    reaped = 0
    for run in lost:
        try:
            reaped += await reap(deps, run)
        except (RedisError, OSError) as exc:
            log.warning("reaper.redis_unavailable", error=str(exc))
            break
        except Exception as exc:  # one bad row must not stop the reaper for every other Run
            log.error("reaper.run_failed", run_id=run.id, error_type=type(exc).__name__, exc_info=exc)
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


async def requeue_lost_jobs(deps: WorkerDeps, arq: ArqRedis) -> int:
    now = datetime.now(UTC)
    async with deps.sessions() as db:
        candidates = await queries.stale_queued_runs(db, created_before=now - QUEUED_GRACE)
    moved = 0
    for run in candidates:
        try:
            moved += await requeue(deps, arq, run, now)
        except (RedisError, OSError) as exc:
            log.warning("reaper.redis_unavailable", error=str(exc))
            break
        except Exception as exc:
            log.error("reaper.run_failed", run_id=run.id, error_type=type(exc).__name__, exc_info=exc)
    return moved


async def requeue(deps: WorkerDeps, arq: ArqRedis, run: Run, now: datetime) -> int:
    if await arq.exists(job_key_prefix + run.id, in_progress_key_prefix + run.id):
        return 0  # waiting its turn in the queue, or being picked up right now
    created = run.created_at if run.created_at.tzinfo else run.created_at.replace(tzinfo=UTC)
    if now - created > QUEUED_GIVE_UP:
        await fail_queued(deps, run.id)
        return 1
    # A result left by a job that failed before claiming the Run (say, the DB was down) would make
    # arq refuse the same job id: clear it, the Run itself says the work is still to be done.
    await arq.delete(result_key_prefix + run.id)
    if await arq.enqueue_job(RUN_TURN, run.id, _job_id=run.id) is None:
        return 0  # someone else enqueued it a moment ago
    log.warning("reaper.requeued_lost_job", run_id=run.id)
    return 1


async def fail_queued(deps: WorkerDeps, run_id: str) -> None:
    message = "the Turn's job was lost before any worker started it; send it again"
    async with deps.sessions() as db:
        terminal = await queries.fail_queued_run(db, run_id, "enqueue_lost", message)
    if terminal is not None:
        await event_log.append(deps.redis, terminal)
        log.warning("reaper.failed_lost_job", run_id=run_id)
