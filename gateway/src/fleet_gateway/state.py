"""What the gateway holds for its lifetime, created and disposed by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

from arq.connections import ArqRedis
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from fleet_gateway.fanout import EventFanout
from fleet_gateway.streaming import StreamDeps
from fleet_shared.config import Settings


@dataclass
class GatewayState:
    settings: Settings
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    arq: ArqRedis  # also the plain Redis client: it is one
    fanout: EventFanout

    @property
    def stream_deps(self) -> StreamDeps:
        return StreamDeps(
            redis=self.arq,
            fanout=self.fanout,
            sessions=self.sessions,
            heartbeat_seconds=self.settings.profile.runtime.heartbeat_seconds,
        )
