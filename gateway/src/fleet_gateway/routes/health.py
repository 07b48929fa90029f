"""Liveness and readiness: /health always answers; /ready checks the DB head, Redis and a worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from importlib.metadata import version
from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from fleet_gateway.schemas import Health
from fleet_gateway.state import GatewayState
from fleet_shared import redis_keys
from fleet_shared.db.engine import HEAD_REVISION, current_revision, is_read_only, schema_state
from fleet_shared.jobs import health_key

VERSION = version("fleet-gateway")
CHECK_TIMEOUT_SECONDS = 2.0
# Workers announce their sandbox mode every 10 s (with a 30 s expiry); a detail this old is fine.
SANDBOX_MODES_CACHE_SECONDS = 10.0
NO_WORKER_REPORTED = "unknown: no worker has reported"


@get(["/health"], exclude_from_auth=True)
async def health() -> Health:
    return Health(status="ok", version=VERSION)


@get(["/ready", "/health/ready"], exclude_from_auth=True)
async def ready(gw: NamedDependency[GatewayState]) -> Response[Health]:
    names = ("database", "redis", "worker")
    results = await asyncio.gather(
        bounded(check_database(gw)), bounded(check_redis(gw)), bounded(check_worker(gw))
    )
    checks = dict(zip(names, results, strict=True))
    ok = all(result == "ok" for result in results)
    details = {"sandbox": await bounded(sandbox_modes(gw, worker_alive=checks["worker"] == "ok"))}
    body = Health(status="ok" if ok else "unavailable", version=VERSION, checks=checks, details=details)
    return Response(body, status_code=200 if ok else 503)


async def bounded(check: Awaitable[str]) -> str:
    try:
        return await asyncio.wait_for(check, CHECK_TIMEOUT_SECONDS)
    except TimeoutError:
        return "timed out"


async def check_database(gw: GatewayState) -> str:
    try:
        revision = await current_revision(gw.engine)
    except (SQLAlchemyError, OSError) as exc:
        return f"unreachable: {type(exc).__name__}"
    if schema_state(revision) in ("behind", "missing"):
        return f"schema at {revision or 'nothing'}, code expects {HEAD_REVISION}: run `fleet db upgrade`"
    try:
        if await is_read_only(gw.engine):
            return "read-only: it takes no writes (a standby, or a failover in progress)"
    except (SQLAlchemyError, OSError) as exc:
        return f"unreachable: {type(exc).__name__}"
    return "ok"


async def check_redis(gw: GatewayState) -> str:
    try:
        await gw.probe.ping()
    except (RedisError, OSError) as exc:
        return f"unreachable: {type(exc).__name__}"
    return "ok"


async def sandbox_modes(gw: GatewayState, *, worker_alive: bool) -> str:
    """What isolation the live workers' sandboxes get (each worker announces its own). Finding the
    announcements SCANs the whole keyspace, so probes read the last answer while one background
    task refreshes it; a SCAN slower than the probe's deadline still finishes and is kept. An
    answer of "no worker" is not kept once a worker is alive: it announced its sandbox first."""
    cached = gw.sandbox_modes_cache
    if cached is not None and worker_alive and cached[1] == NO_WORKER_REPORTED:
        cached = gw.sandbox_modes_cache = None
    if cached is not None and cached[0] > time.monotonic():
        return cached[1]
    refresh = gw.sandbox_modes_refresh
    if refresh is None or refresh.done():
        refresh = gw.sandbox_modes_refresh = asyncio.create_task(refresh_sandbox_modes(gw))
    if cached is not None:
        return cached[1]
    return await asyncio.shield(refresh)  # the first probe waits (bounded by its caller)


async def refresh_sandbox_modes(gw: GatewayState) -> str:
    answer = await scan_sandbox_modes(gw)
    gw.sandbox_modes_cache = (time.monotonic() + SANDBOX_MODES_CACHE_SECONDS, answer)
    return answer


async def scan_sandbox_modes(gw: GatewayState) -> str:
    try:
        keys = [key async for key in gw.probe.scan_iter(match=redis_keys.WORKER_SANDBOX_PATTERN, count=100)]
        modes = {value.decode() for value in await gw.probe.mget(keys) if value} if keys else set()
    except (RedisError, OSError):
        return "unknown: redis unreachable"
    return "; ".join(sorted(modes)) or NO_WORKER_REPORTED


async def check_worker(gw: GatewayState) -> str:
    key = health_key(gw.settings.profile.worker.queue_name)
    try:
        alive: Any = await gw.probe.exists(key)
    except (RedisError, OSError):
        return "unknown: redis unreachable"
    return "ok" if alive else "no worker heartbeat: start `fleet worker`"
