"""What the gateway holds for its lifetime, created and disposed by the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from fleet_gateway.fanout import EventFanout
from fleet_gateway.streaming import StreamDeps
from fleet_gateway.upload_gate import UploadGate
from fleet_gateway.workspace_index import IndexCache
from fleet_shared.blobs import BlobStore
from fleet_shared.config import Settings
from fleet_shared.event_log import RunLog
from fleet_shared.jobs import JobQueue


@dataclass
class GatewayState:
    settings: Settings
    engine: AsyncEngine
    db_sessions: async_sessionmaker[AsyncSession]
    redis: Redis  # commands for requests: retries a blip, gives up on an outage (a 503)
    jobs: JobQueue
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
            redis=self.redis,
            fanout=self.fanout,
            db_sessions=self.db_sessions,
            heartbeat_seconds=profile.runtime.heartbeat_seconds,
            max_seconds=profile.gateway.stream_max_seconds,
        )
