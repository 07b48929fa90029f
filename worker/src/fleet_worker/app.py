"""The arq worker: settings as plain data, resources created in startup and closed in shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import structlog
from arq import Worker
from arq.connections import RedisSettings
from arq.worker import func
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared import redis_keys
from fleet_shared.blob_gc import collect_on_schedule
from fleet_shared.blobs import BlobStore, open_blob_store
from fleet_shared.config import Settings
from fleet_shared.db.engine import create_engine, dispose_engine, session_factory
from fleet_shared.event_log import RunLog
from fleet_shared.queue import RUN_TURN, deserialize_job, health_check_key, serialize_job, waiting_job_ids
from fleet_shared.recovery import Sweeper
from fleet_shared.redis_conn import RETRY_ON, connect, listener, retry_policy
from fleet_shared.shutdown import bounded, stop_loop
from fleet_shared.workspaces import relocated_root
from fleet_worker.control import ControlListener
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.jail import local_sandbox_config
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.provider import SandboxProvider
from fleet_worker.sandbox.sync import VersionedFolders
from fleet_worker.turn import WorkerDeps, run_turn
from fleet_worker.workspace_objects import WorkspaceObjects

log = structlog.get_logger(__name__)
HEALTH_CHECK_INTERVAL_SECONDS = 5
# arq's poll loop retries each Redis command this many times (about 4.5 s) before it gives up; the
# CLI then starts the same loop again on the same worker (fleet_cli.main.serve_through_outages).
QUEUE_RETRIES = 8
SWEEP_INTERVAL_SECONDS = 0.5
SANDBOX_CLOSE_SECONDS = 30.0
DAYTONA_SWEEP_SECONDS = 60.0
SCRATCH_SWEEP_SECONDS = 60.0


def workspace_objects(settings: Settings, blobs: BlobStore) -> WorkspaceObjects:
    """Workspace contents in the store, with this worker's cache of them."""
    cache = settings.data_dir.resolve() / "cache" / "workspaces"
    return WorkspaceObjects(blobs, cache, settings.profile.storage.workspace_cache_mb * 2**20)


def sandbox_provider(settings: Settings, blobs: BlobStore | None = None) -> SandboxProvider:
    """The configured provider, checked: any problem stops the worker with one clear line."""
    blobs = blobs or open_blob_store(settings)
    if settings.profile.sandbox.provider == "daytona":
        from fleet_worker.sandbox.daytona import daytona_provider  # the SDK only when it is used

        return daytona_provider(settings, objects=workspace_objects(settings, blobs))
    # Where sandboxed code writes on this host: the interpreter must never come from there.
    roots = (settings.data_dir, settings.workspaces_dir, relocated_root(settings.workspaces_dir))
    local = local_sandbox_config(settings.profile.sandbox.local)
    provider = LocalSandboxProvider(
        local,
        caps=Caps.from_rlm(settings.profile.rlm),
        sandbox_roots=(*roots, settings.blobs_dir),
        versions=VersionedFolders(workspace_objects(settings, blobs), local.workspace_files),
    )
    provider.check()
    provider.place_workspaces(settings.workspaces_dir, relocated_root(settings.workspaces_dir))
    return provider


def queue_settings(settings: Settings) -> RedisSettings:
    redis = RedisSettings.from_dsn(settings.redis_url)
    redis.retry = retry_policy(QUEUE_RETRIES)
    redis.retry_on_error = list(RETRY_ON)
    return redis


def build_worker(settings: Settings, *, burst: bool = False) -> Worker:
    blobs = open_blob_store(settings)
    sandboxes = sandbox_provider(settings, blobs)  # fails fast: no bwrap, no worker
    queue = settings.profile.worker.queue_name
    concurrency = settings.profile.worker.concurrency
    worker_id = f"{socket.gethostname()}:{os.getpid()}"

    async def startup(ctx: dict[str, Any]) -> None:
        if "deps" in ctx:
            return  # arq's poll loop restarted after a Redis outage: keep everything as it is
        engine = create_engine(settings.database_url)
        redis = connect(settings.redis_url)
        waker.start()
        cancels = ControlListener(redis, listener(settings.redis_url), queue, waker.wanted.set)
        cancels.start()
        ctx["engine"] = engine
        ctx["deps"] = deps = WorkerDeps(
            settings=settings,
            sessions=session_factory(engine),
            redis=redis,
            runlog=RunLog(redis),
            sandboxes=sandboxes,
            blobs=blobs,
            scripts={},
            programs=ThreadPoolExecutor(concurrency, thread_name_prefix="fleet-rlm"),
            sandbox_ops=ThreadPoolExecutor(concurrency + 2, thread_name_prefix="fleet-sandbox-ops"),
            cancels=cancels,
            worker_id=worker_id,
        )
        ctx["announce"] = asyncio.create_task(announce_sandbox(redis, worker_id, sandboxes.mode))
        if not burst:  # a burst worker (tests) sweeps only when asked
            start_background_loops(ctx, deps)
        log.info("worker.started", queue=queue, concurrency=concurrency, sandbox=sandboxes.mode)

    async def shutdown(ctx: dict[str, Any]) -> None:
        if ctx.get("closed"):
            return
        await waker.stop()
        sweeper: Sweeper | None = ctx.get("sweeper")
        stops = {"sweep": sweeper.stopping if sweeper else None, "gc": ctx.get("gc_stopping")}
        for name in ("sweep", "announce", "daytona_sweep", "scratch_sweep", "gc"):
            task: asyncio.Task[None] | None = ctx.get(name)
            if task is not None:
                await stop_loop(name, task, stops.get(name))
        deps: WorkerDeps | None = ctx.get("deps")
        if deps is not None:
            await bounded("cancels.stop", deps.cancels.stop)
            await bounded("redis.cancels.close", deps.cancels.listener.aclose)
            await bounded("redis.close", deps.redis.aclose)
            deps.programs.shutdown(wait=False, cancel_futures=True)
            loop = asyncio.get_running_loop()
            await bounded(  # kills every live sandbox; Daytona deletes are HTTP calls
                "sandboxes.close",
                lambda: loop.run_in_executor(deps.sandbox_ops, deps.sandboxes.close),
                SANDBOX_CLOSE_SECONDS,
            )
            deps.sandbox_ops.shutdown(wait=False)
        if "engine" in ctx:
            await bounded("database.dispose", partial(dispose_engine, ctx["engine"]))
        ctx["closed"] = True

    async def slot_freed(ctx: dict[str, Any]) -> None:
        await waker.slot_freed()

    timeout = settings.profile.runtime.turn_timeout_seconds + 120  # our own deadline fires first
    worker = Worker(
        functions=[func(run_turn, name=RUN_TURN, timeout=timeout, max_tries=3)],
        redis_settings=queue_settings(settings),
        queue_name=queue,
        max_jobs=concurrency,
        poll_delay=settings.profile.worker.poll_delay_seconds,
        job_serializer=serialize_job,
        job_deserializer=deserialize_job,
        on_startup=startup,
        on_shutdown=shutdown,
        after_job_end=slot_freed,
        health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
        health_check_key=health_check_key(queue),
        keep_result=60,
        # A gateway that cancels a queued Run aborts its job (arq's abort set): it never starts.
        allow_abort_jobs=True,
        # SIGTERM: stop taking jobs, let running Turns finish for drain_seconds, then cancel them
        # (run_turn settles a cancelled Turn as failed with `worker_shutdown`).
        job_completion_wait=int(settings.profile.worker.drain_seconds),
        burst=burst,
        handle_signals=not burst,
    )
    waker = JobWaker(worker)
    return worker


class JobWaker:
    """Picks jobs as soon as one is announced (fleet_shared.queue.enqueue_run), rather than at
    the worker's next `poll_delay`: arq's own `start_jobs`, on the ids its poll would read less
    those already running (fleet_shared.queue.waiting_job_ids). It starts each job under arq's
    per-job in-progress lock, so running it beside arq's loop (or on two workers at once) starts
    each job once. tests/integration/test_job_notices.py pins it."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.wanted = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def slot_freed(self) -> None:
        """A job just ended (arq's after_job_end): a Turn that was announced while every slot was
        busy is taken now, not at the next poll."""
        self.wanted.set()

    def full(self) -> bool:
        return self.worker.job_counter >= self.worker.max_jobs or not self.worker.allow_pick_jobs

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.run_forever(), name="fleet-job-waker")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def run_forever(self) -> None:
        while True:
            await self.wanted.wait()
            self.wanted.clear()  # notices that arrive while we poll ask for one more poll
            worker = self.worker
            if self.full():
                # The job whose end woke us gives its slot back in its task's done callback,
                # which runs right after that end: look once more after it.
                await asyncio.sleep(0)
                if self.full():
                    continue  # full or draining: the next slot_freed (or arq's poll) comes back
            try:  # only the job pick of arq's poll: its own loop keeps the rest (aborts, heartbeat)
                job_ids = await waiting_job_ids(worker.pool, worker.queue_name, worker.queue_read_limit)
                if job_ids:
                    await worker.start_jobs(job_ids)
            except Exception as exc:  # never die: arq's own poll still runs, and reports Redis faults
                log.warning("worker.wake_poll_failed", error_type=type(exc).__name__, error=str(exc))


def start_background_loops(ctx: dict[str, Any], deps: WorkerDeps) -> None:
    """The sweep for lost Runs, the sandbox sweeps and the scheduled gc, as tasks in `ctx` (the
    shutdown stops them by name)."""
    settings, sandboxes = deps.settings, deps.sandboxes
    ctx["sweeper"] = sweeper = make_sweeper(deps)
    ctx["sweep"] = asyncio.create_task(sweeper.run_forever(SWEEP_INTERVAL_SECONDS), name="fleet-sweep")
    if settings.profile.sandbox.provider == "daytona":
        ctx["daytona_sweep"] = asyncio.create_task(sweep_daytona(deps), name="fleet-daytona-sweep")
    if isinstance(sandboxes, LocalSandboxProvider):
        scratch = sweep_scratch_forever(deps, sandboxes)
        ctx["scratch_sweep"] = asyncio.create_task(scratch, name="fleet-scratch-sweep")
    storage = settings.profile.storage
    if storage.gc_interval_seconds > 0:
        ctx["gc_stopping"] = stopping = asyncio.Event()
        queue = settings.profile.worker.queue_name
        gc = collect_on_schedule(
            deps.redis, deps.sessions, deps.blobs, queue=queue, storage=storage, stopping=stopping
        )
        ctx["gc"] = asyncio.create_task(gc, name="fleet-gc")


async def sweep_daytona(deps: WorkerDeps) -> None:
    """Delete the deployment's Daytona sandboxes whose sessions went idle (every worker does it;
    deleting one twice is harmless)."""
    from fleet_worker.sandbox.daytona import DaytonaSandboxProvider
    from fleet_worker.sandbox.daytona.ops import sweep_forever

    assert isinstance(deps.sandboxes, DaytonaSandboxProvider)
    await sweep_forever(deps.sandboxes, deps.sessions, DAYTONA_SWEEP_SECONDS)


async def sweep_scratch_forever(deps: WorkerDeps, provider: LocalSandboxProvider) -> None:
    """Remove the child scratch folders whose removal failed or whose worker died (the start-up
    sweep took those left before this worker started)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(SCRATCH_SWEEP_SECONDS)
        try:
            await loop.run_in_executor(deps.sandbox_ops, provider.sweep_scratch)
        except Exception as exc:  # never die: the next round tries again
            log.warning("sandbox.scratch_sweep_failed", error_type=type(exc).__name__, error=str(exc))


async def announce_sandbox(redis: Redis, worker_id: str, mode: str) -> None:
    """Keep this worker's sandbox mode where /ready can show it, for as long as it lives."""
    key = redis_keys.worker_sandbox(worker_id)
    while True:
        with contextlib.suppress(RedisError, OSError):
            await redis.set(key, mode, ex=redis_keys.WORKER_SANDBOX_TTL_SECONDS)
        await asyncio.sleep(redis_keys.WORKER_SANDBOX_TTL_SECONDS / 3)


def make_sweeper(deps: WorkerDeps) -> Sweeper:
    return Sweeper(
        sessions=deps.sessions,
        redis=deps.redis,
        runlog=deps.runlog,
        lease_seconds=deps.settings.profile.worker.lease_seconds,
        owner=f"worker:{deps.worker_id}",
        queue_name=deps.settings.profile.worker.queue_name,
    )
