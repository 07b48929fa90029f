"""What the gateway holds for its lifetime, created and disposed by the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from arq.connections import ArqRedis
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from fleet_gateway.fanout import EventFanout
from fleet_gateway.streaming import StreamDeps
from fleet_gateway.upload_gate import UploadGate
from fleet_gateway.workspace_index import IndexCache
from fleet_shared.blobs import BlobStore
from fleet_shared.config import Settings
from fleet_shared.event_log import RunLog
from fleet_shared.queue import announce_queued, enqueue_run


@dataclass
class GatewayState:
    settings: Settings
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    arq: ArqRedis  # also the plain Redis client: it is one
    fanout: EventFanout
    runlog: RunLog
    process_id: str
    probe: Redis  # no retries: readiness reports an outage at once instead of riding it out
    blobs: BlobStore  # attachment and artifact bytes
    uploads: UploadGate  # this process's uploads in progress: their idle limit and per-client cap
    manifests: IndexCache = field(default_factory=IndexCache)  # workspace versions the files API read
    # /ready's sandbox detail (monotonic expiry, text) and the one task refreshing it: finding it
    # SCANs the keyspace, so probes read the last answer and at most one SCAN runs at a time.
    sandbox_modes_cache: tuple[float, str] | None = None
    sandbox_modes_refresh: asyncio.Task[str] | None = None
    notices: set[asyncio.Task[None]] = field(default_factory=set)  # "a job is queued", in flight

    async def stop_background(self) -> None:
        task = self.sandbox_modes_refresh
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def stream_deps(self) -> StreamDeps:
        profile = self.settings.profile
        return StreamDeps(
            redis=self.arq,
            fanout=self.fanout,
            sessions=self.sessions,
            heartbeat_seconds=profile.runtime.heartbeat_seconds,
            max_seconds=profile.gateway.stream_max_seconds,
        )

    async def enqueue(self, run_id: str) -> bool:
        """Queue the Run's job (job id = run id) in one round trip; False when that job is already
        queued. Workers are told by a task of its own, started here and run at the handler's next
        await (before or while the first frame is written), not in the enqueue's round trip: a
        worker woken by the script itself starts the Turn on the same cores while the gateway is
        still answering, which delays the first byte (ADR 0026)."""
        queue = self.settings.profile.worker.queue_name
        queued = await enqueue_run(self.arq, queue, run_id, announce=False)
        # Even when the job was there already: a retried script whose first reply was lost says
        # False for the job it wrote itself, and a notice too many only makes a worker look.
        notice = asyncio.create_task(announce_queued(self.arq, queue))
        self.notices.add(notice)  # a reference until it is done: the loop keeps only weak ones
        notice.add_done_callback(self.notices.discard)
        return queued
