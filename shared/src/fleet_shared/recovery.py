"""The sweep that keeps every Run moving toward an end. Workers and gateways both run it, so a
Run is recovered even when no worker is alive; one process sweeps per interval (a Redis lock).

- A running Run whose lease lapsed (its worker died or stalled) is taken over (attempt + 1,
  under the lease) and settled `worker_lost`; its old owner's late writes are then refused.
- A queued Run whose job vanished (the gateway died before enqueueing, or Redis lost the
  queue) is enqueued again; one that stays lost for `QUEUED_GIVE_UP` is failed `enqueue_lost`.
- When Redis lost its data (a restart) or stopped answering for a while (a stall, a partition
  from this process), every lease may be missing at once while its owner is fine: the sweep then
  settles nothing for twice `lease_seconds`, which lets live workers take their leases back.
- A lost Run whose client had asked to cancel it is settled `cancelled`, not `worker_lost`.
- Every ending here promotes the follow-up waiting behind the Run (fleet_shared.db.waiting), whose
  job it then enqueues; a session whose follow-ups wait behind no active Run gets its first one
  promoted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared import redis_keys
from fleet_shared.db import queries, runs, waiting
from fleet_shared.db.engine import run_whole
from fleet_shared.db.models import Run
from fleet_shared.event_log import Appended, RunLog, lease_token, read_all_after
from fleet_shared.events import RunCancelled, RunEvent, RunFailed, ends_run
from fleet_shared.followups import start_promoted
from fleet_shared.jobs import JobQueue
from fleet_shared.metrics import count_reaper_action
from fleet_shared.run_state import RunCommand, RunStatus
from fleet_shared.shutdown import pause
from fleet_shared.transcript import fold_parts, tombstone_parts

log = structlog.get_logger(__name__)
LOST_MESSAGE = "the worker running this Turn stopped responding; send it again"
ENQUEUE_LOST_MESSAGE = "the Turn's job was lost before any worker started it; send it again"
QUEUED_GRACE = timedelta(seconds=3)  # longer than a gateway's claim-commit → enqueue gap
QUEUED_GIVE_UP = timedelta(minutes=10)
REAP_BATCH = 50  # lost Runs settled per sweep; the next sweep takes the rest
LOG_EVERY = 60


async def append_from(runlog: RunLog, events: list[RunEvent], token: str) -> bool:
    """Append `events` (in seq order) after wherever the log ends; False when fenced out.

    A log that Redis lost (or cut short) is refilled from the first event it is missing."""
    by_seq = {e.seq: e for e in events}
    index = 0
    while index < len(events):
        result, sent = await runlog.append_batch(consecutive_from(events, index), token)
        if result.status is Appended.FENCED:
            return False
        if result.status is Appended.GAP:
            missing = by_seq.get(result.last_seq + 1)
            if missing is None:
                return True  # the log lost events nobody holds any more; keep what it has
            index = events.index(missing)
            continue
        index += sent
    return True


def consecutive_from(events: list[RunEvent], index: int) -> list[RunEvent]:
    """The events from `index` on whose seqs follow one another: one batch for append_batch."""
    end = index + 1
    while end < len(events) and events[end].seq == events[end - 1].seq + 1:
        end += 1
    return events[index:end]


@dataclass
class Sweeper:
    db_sessions: async_sessionmaker[AsyncSession]
    redis: Redis
    runlog: RunLog
    lease_seconds: float
    owner: str  # who sweeps: a gateway or worker process id, part of the lease token
    jobs: JobQueue  # where a lost Run's job goes again
    restart_grace: float | None = None  # default: twice lease_seconds
    quiet_until: float = 0.0  # loop time before which no lost lease is believed (after a Redis fault)
    failures: int = 0  # sweeps failed in a row (logged on the first, then every LOG_EVERY)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # see fleet_shared.shutdown

    @property
    def lease_ms(self) -> int:
        return int(self.lease_seconds * 1000)

    @property
    def grace(self) -> float:
        return 2 * self.lease_seconds if self.restart_grace is None else self.restart_grace

    async def run_forever(self, interval: float) -> None:
        """Sweep every `interval` until `stopping` is set; a sweep under way finishes first."""
        while not await pause(self.stopping, interval):
            try:
                async with self.timed_redis():
                    leader = await self.redis.set(
                        redis_keys.sweeper(), self.owner, px=int(interval * 1000), nx=True
                    )
                if leader:
                    await self.sweep()
            except (RedisError, OSError, SQLAlchemyError) as exc:
                self.failures += 1
                if self.failures % LOG_EVERY == 1:  # an outage is one line per half minute, not two a second
                    log.warning("sweep.failed", error_type=type(exc).__name__, failures=self.failures)
                continue
            if self.failures:
                log.info("sweep.recovered", failures=self.failures)
                self.failures = 0

    @contextlib.asynccontextmanager
    async def timed_redis(self) -> AsyncIterator[None]:
        """A Redis call that fails, or takes longer than a lease renewal, means the owners could
        not renew either: believe no missing lease for a grace period."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            yield
        except (RedisError, OSError):
            self.quiet_until = loop.time() + self.grace
            raise
        if loop.time() - started > self.lease_seconds / 3:
            self.quiet_until = loop.time() + self.grace

    async def sweep(self) -> int:
        """One sweep. Returns how many Runs it settled, re-enqueued or promoted."""
        return await self.settle_lost_runs() + await self.requeue_lost_jobs() + await self.promote_stranded()

    async def settle_lost_runs(self) -> int:
        # A Run just started may not have written its lease yet: only look one lease period back.
        cutoff = datetime.now(UTC) - timedelta(seconds=self.lease_seconds)
        async with self.db_sessions() as db:
            candidate_ids = await runs.stale_active_run_ids(db, started_before=cutoff)
        if not candidate_ids or self.quiet() or await self.redis_recently_restarted():
            return 0
        async with self.timed_redis(), self.redis.pipeline(transaction=False) as pipe:
            for run_id in candidate_ids:
                pipe.exists(redis_keys.run_lease(run_id))
            leased = await pipe.execute()
        if self.quiet():
            return 0
        lost_ids = [run_id for run_id, held in zip(candidate_ids, leased, strict=True) if not held]
        async with self.db_sessions() as db:
            lost = await runs.get_runs(db, lost_ids[:REAP_BATCH])
        settled = 0
        for run in lost:
            try:
                settled += await self.settle_lost_run(run)
            except (RedisError, OSError, SQLAlchemyError):
                raise
            except Exception as exc:  # one bad row must not stop recovery for every other Run
                log.error("sweep.run_failed", run_id=run.id, error_type=type(exc).__name__, exc_info=exc)
        return settled

    def quiet(self) -> bool:
        return asyncio.get_running_loop().time() < self.quiet_until

    async def redis_recently_restarted(self) -> bool:
        if self.grace <= 0:
            return False
        info = await self.redis.info("server")
        return int(info.get("uptime_in_seconds", 0)) < self.grace

    async def settle_lost_run(self, run: Run) -> int:
        """Take the lease, then the Run (attempt + 1), then settle it `worker_lost` (or
        `cancelled`, when its client had asked for that)."""
        token = lease_token(run.attempt + 1, self.owner)
        if not await self.runlog.take_lease(run.id, token, self.lease_ms):
            return 0  # its worker took the lease back, or another sweeper is on it
        try:
            async with self.db_sessions() as db:
                taken = await runs.take_over_run(db, run.id, run.attempt)
            if not taken:
                # Its worker committed meanwhile; its terminal append was refused by our lease.
                await self.publish_committed(run.id, token)
                return 0
            logged = [e for e in await read_all_after(self.redis, run.id, 0) if not ends_run(e)]
            cancelled = bool(await self.redis.exists(redis_keys.run_cancel(run.id)))
            settlement = lost_run_settlement(run, logged, cancelled=cancelled)
            async with self.db_sessions() as db:
                if not await runs.commit_settlement(db, settlement):
                    return 0
            await append_from(self.runlog, settlement.events, token)
            await start_promoted(self.db_sessions, self.jobs, run.session_id)
            log.warning("sweep.settled_lost_run", run_id=run.id, attempt=run.attempt + 1, cancelled=cancelled)
            count_reaper_action("settled_cancelled" if cancelled else "settled_lost")
            return 1
        finally:
            await self.runlog.release_lease(run.id, token)

    async def publish_committed(self, run_id: str, token: str) -> None:
        async with self.db_sessions() as db:
            events = await queries.load_run_events(db, run_id)
        if events:
            await append_from(self.runlog, events, token)

    async def requeue_lost_jobs(self) -> int:
        now = datetime.now(UTC)
        async with self.db_sessions() as db:
            candidates = await runs.stale_queued_runs(db, created_before=now - QUEUED_GRACE)
        moved = 0
        for run in candidates:
            moved += await self.requeue(run, now)
        return moved

    async def requeue(self, run: Run, now: datetime) -> int:
        if await self.jobs.pending(run.id):
            return 0  # waiting its turn in the queue, or being picked up right now
        queued = run.queued_at or run.created_at  # its promotion, for a follow-up
        queued = queued if queued.tzinfo else queued.replace(tzinfo=UTC)
        if now - queued > QUEUED_GIVE_UP:
            return await self.fail_queued(run)
        # A job that failed before claiming the Run (say, the DB was down) left a result that would
        # refuse the same job id: requeue clears it, as the Run itself says the work is to do.
        if not await self.jobs.requeue(run.id):
            return 0  # someone else enqueued it a moment ago
        log.warning("sweep.requeued_lost_job", run_id=run.id)
        count_reaper_action("requeued")
        return 1

    async def fail_queued(self, run: Run) -> int:
        async with self.db_sessions() as db:
            terminal = await runs.fail_queued_run(db, run.id, "enqueue_lost", ENQUEUE_LOST_MESSAGE)
        if terminal is None:
            return 0
        await publish_ending(self.runlog, terminal, self.owner, self.lease_ms)
        await start_promoted(self.db_sessions, self.jobs, run.session_id)
        log.warning("sweep.failed_lost_job", run_id=run.id)
        count_reaper_action("failed_enqueue_lost")
        return 1

    async def promote_stranded(self) -> int:
        """Follow-ups that wait behind no active Run (a Run ended by a release without them,
        mid-upgrade): the first of each such session is promoted and its job enqueued."""
        stranded = await run_whole(self.db_sessions, waiting.stranded_sessions_on)
        moved = 0
        for session_id in stranded:
            promote = functools.partial(waiting.promote_stranded_on, session_id=session_id)
            if await run_whole(self.db_sessions, promote) is not None:
                await start_promoted(self.db_sessions, self.jobs, session_id)
                log.warning("sweep.promoted_stranded", session_id=session_id)
                moved += 1
        return moved


def lost_run_settlement(run: Run, logged: list[RunEvent], *, cancelled: bool) -> runs.Settlement:
    """How a Run whose worker is gone ends: with what its log holds, at the sweeper's attempt."""
    seq = (logged[-1].seq if logged else 0) + 1
    terminal: RunEvent
    if cancelled:
        terminal = RunCancelled(run_id=run.id, seq=seq)
    else:
        terminal = RunFailed(run_id=run.id, seq=seq, code="worker_lost", message=LOST_MESSAGE)
    events = [*logged, terminal]
    return runs.Settlement(
        run_id=run.id,
        session_id=run.session_id,
        attempt=run.attempt + 1,
        current=RunStatus(run.status),
        command=RunCommand.CANCEL if cancelled else RunCommand.FAIL,
        sequence=run.user_sequence + 1,
        parts=tombstone_parts(None) if cancelled else fold_parts(events),
        turn_status="cancelled" if cancelled else "failed",
        events=events,
        failure_code=None if cancelled else "worker_lost",
        failure_message=None if cancelled else LOST_MESSAGE,
    )


async def publish_ending(runlog: RunLog, terminal: RunEvent, owner: str, lease_ms: int) -> bool:
    """Log the terminal event of a Run that ended without an owner (it never started): take its
    lease for the moment it takes, so the append is fenced like every other."""
    token = lease_token(0, owner)
    if not await runlog.take_lease(terminal.run_id, token, lease_ms):
        return False
    try:
        return await append_from(runlog, [terminal], token)
    finally:
        await runlog.release_lease(terminal.run_id, token)
