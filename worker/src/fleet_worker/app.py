"""The arq worker: settings as plain data, resources created in startup and closed in shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import structlog
from arq import Worker
from arq.connections import RedisSettings
from arq.worker import func
from redis.asyncio import Redis

from fleet_shared.config import Settings
from fleet_shared.db.engine import create_engine, session_factory
from fleet_shared.queue import RUN_TURN, deserialize_job, health_check_key, serialize_job
from fleet_worker.reaper import reaper_loop
from fleet_worker.sandbox.jail import LocalSandboxConfig
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.turn import WorkerDeps, prepare_workspace_root, run_turn

log = structlog.get_logger(__name__)
HEALTH_CHECK_INTERVAL_SECONDS = 5
RELOCATED_WORKSPACES = Path("/var/lib/fleet")


def sandbox_provider(settings: Settings) -> LocalSandboxProvider:
    local = settings.profile.sandbox.local
    if settings.profile.sandbox.provider != "local":
        raise NotImplementedError("only the local sandbox provider is available in this build")
    provider = LocalSandboxProvider(
        LocalSandboxConfig(
            allow_unisolated=local.allow_unisolated,
            python=local.python,
            cell_timeout_seconds=local.cell_timeout_seconds,
            memory_mb=local.memory_mb,
            max_processes=local.max_processes,
            max_file_mb=local.max_file_mb,
        ),
        max_output_chars=settings.profile.rlm.max_output_chars,
    )
    provider.check()
    return provider


def workspaces_root(settings: Settings, sandboxes: LocalSandboxProvider) -> Path:
    """`<data_dir>/workspaces`, unless a root worker's sandbox uid cannot get there (a checkout
    under /root, say): then a stable folder under /var/lib/fleet, so Turns still work."""
    preferred = prepare_workspace_root(settings.workspaces_dir)
    if sandboxes.can_reach(preferred):
        return preferred
    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:16]
    fallback = prepare_workspace_root(RELOCATED_WORKSPACES / digest / "workspaces")
    log.warning("sandbox.workspaces_relocated", unreachable=str(preferred), using=str(fallback))
    return fallback


def build_worker(settings: Settings, *, burst: bool = False) -> Worker:
    sandboxes = sandbox_provider(settings)  # fails fast: no bwrap, no worker
    workspaces = workspaces_root(settings, sandboxes)
    queue = settings.profile.worker.queue_name

    async def startup(ctx: dict[str, Any]) -> None:
        engine = create_engine(settings.database_url)
        ctx["engine"] = engine
        ctx["deps"] = WorkerDeps(
            settings=settings,
            sessions=session_factory(engine),
            redis=Redis.from_url(settings.redis_url),
            sandboxes=sandboxes,
            workspaces=workspaces,
            scripts={},
            worker_id=f"{socket.gethostname()}:{os.getpid()}",
        )
        if not burst:  # a burst worker (tests) reaps only when asked
            ctx["reaper"] = asyncio.create_task(reaper_loop(ctx["deps"], ctx["redis"]), name="fleet-reaper")
        log.info("worker.started", queue=queue, concurrency=settings.profile.worker.concurrency)

    async def shutdown(ctx: dict[str, Any]) -> None:
        reaper: asyncio.Task[None] | None = ctx.get("reaper")
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        deps: WorkerDeps | None = ctx.get("deps")
        if deps is not None:
            await deps.redis.aclose()
        if "engine" in ctx:
            await ctx["engine"].dispose()

    timeout = settings.profile.runtime.turn_timeout_seconds + 60  # our own deadline fires first
    return Worker(
        functions=[func(run_turn, name=RUN_TURN, timeout=timeout, max_tries=3)],
        redis_settings=RedisSettings.from_dsn(settings.redis_url),
        queue_name=queue,
        max_jobs=settings.profile.worker.concurrency,
        job_serializer=serialize_job,
        job_deserializer=deserialize_job,
        on_startup=startup,
        on_shutdown=shutdown,
        health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
        health_check_key=health_check_key(queue),
        keep_result=60,
        # SIGTERM: stop taking jobs, let running Turns finish for drain_seconds, then cancel them
        # (run_turn settles a cancelled Turn as failed with `worker_shutdown`).
        job_completion_wait=int(settings.profile.worker.drain_seconds),
        burst=burst,
        handle_signals=not burst,
    )
