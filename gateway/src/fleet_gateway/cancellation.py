"""Cancelling a Run: at once while it is queued, by flag and notice while a worker runs it."""

from __future__ import annotations

from typing import Literal

import structlog
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession

from fleet_gateway.state import GatewayState
from fleet_shared import redis_keys
from fleet_shared.db import queries, runs
from fleet_shared.db.models import Run
from fleet_shared.event_log import control_channel
from fleet_shared.metrics import count_cancel
from fleet_shared.recovery import publish_ending
from fleet_shared.run_state import RunStatus, is_terminal

log = structlog.get_logger(__name__)
CancelState = Literal["requested", "already_requested", "already_terminal"]


async def request_cancellation(gw: GatewayState, db: AsyncSession, run: Run) -> CancelState:
    run_id = run.id
    if is_terminal(run.status):
        return "already_terminal"
    if run.status == RunStatus.QUEUED.value:
        if await cancel_queued(gw, db, run_id):
            count_cancel("queued")
            return "requested"
        found = await queries.get_run(db, run_id)  # a worker started it meanwhile
        if found is None or is_terminal(found.status):
            return "already_terminal"
    # Redis is the only way to reach the worker: if it is down, this raises and the caller gets 503.
    first = await gw.redis.set(
        redis_keys.run_cancel(run_id), "1", nx=True, ex=redis_keys.CANCEL_FLAG_TTL_SECONDS
    )
    await gw.redis.publish(control_channel(gw.redis), run_id)
    log.info("run.cancel_requested", run_id=run_id, first=bool(first))
    if first:
        count_cancel("running")
    return "requested" if first else "already_requested"


async def cancel_queued(gw: GatewayState, db: AsyncSession, run_id: str) -> bool:
    """Commit the cancellation (tombstone and all), then abort the job and tell the stream. False if a
    worker started the Run first."""
    terminal = await runs.cancel_queued_run(db, run_id)
    if terminal is None:
        return False
    try:
        await gw.jobs.abort(run_id)  # the job never starts
        lease_ms = int(gw.settings.profile.worker.lease_seconds * 1000)
        await publish_ending(gw.runlog, terminal, f"gateway:{gw.process_id}", lease_ms)
    except (RedisError, OSError) as exc:
        # Committed all the same: a worker that picks the job finds the Run cancelled, and a
        # stream finds the ending in the DB.
        log.warning("run.cancel_not_announced", run_id=run_id, error_type=type(exc).__name__)
    return True
