"""The worker process: the job queue's consumer (fleet_shared.jobs_worker), with resources created
in startup and closed in shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared import redis_keys
from fleet_shared.blob_gc import collect_on_schedule
from fleet_shared.blobs import BlobStore, open_blob_store
from fleet_shared.config import Settings
from fleet_shared.db import purge
from fleet_shared.db.engine import create_engine, dispose_engine, session_factory
from fleet_shared.event_log import RunLog
from fleet_shared.jobs import ArqJobQueue
from fleet_shared.jobs_worker import Context, JobWorker
from fleet_shared.recovery import Sweeper
from fleet_shared.redis_conn import connect, listener
from fleet_shared.shutdown import bounded, stop_loop
from fleet_shared.tracing import shutdown_tracing
from fleet_shared.webhook_delivery import Deliverer, deliverer_for
from fleet_shared.workspaces import relocated_root
from fleet_worker.cancels import CancelListener
from fleet_worker.prices import PriceBook
from fleet_worker.sandbox import leftovers
from fleet_worker.sandbox.boundary import Caps
from fleet_worker.sandbox.jail import local_sandbox_config
from fleet_worker.sandbox.local import LocalSandboxProvider
from fleet_worker.sandbox.provider import SandboxProvider
from fleet_worker.sandbox.python_env import with_packages
from fleet_worker.sandbox.sync import VersionedFolders
from fleet_worker.sandbox.trust import sandbox_roots
from fleet_worker.turn import WorkerDeps, run_turn
from fleet_worker.workspace_objects import WorkspaceObjects

log = structlog.get_logger(__name__)
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
    roots = sandbox_roots(settings)
    sandbox = settings.profile.sandbox
    local = with_packages(local_sandbox_config(sandbox.local), sandbox.python, sandbox_roots=roots)
    provider = LocalSandboxProvider(
        local,
        caps=Caps.from_rlm(settings.profile.rlm),
        sandbox_roots=roots,
        versions=VersionedFolders(workspace_objects(settings, blobs), local.workspace_files),
    )
    provider.check()
    provider.place_workspaces(settings.workspaces_dir, relocated_root(settings.workspaces_dir))
    return provider


def build_worker(settings: Settings, *, burst: bool = False) -> JobWorker:
    blobs = open_blob_store(settings)
    sandboxes = sandbox_provider(settings, blobs)  # fails fast: no bwrap, no worker
    queue = settings.profile.worker.queue_name
    concurrency = settings.profile.worker.concurrency
    worker_id = f"{socket.gethostname()}:{os.getpid()}"

    async def startup(ctx: Context) -> None:
        if "deps" in ctx:
            return  # arq's poll loop restarted after a Redis outage: keep everything as it is
        engine = create_engine(settings.database_url)
        redis = connect(settings.redis_url)
        cancels = CancelListener(redis, listener(settings.redis_url))
        cancels.start()
        ctx["engine"] = engine
        ctx["deps"] = deps = WorkerDeps(
            settings=settings,
            db_sessions=session_factory(engine),
            redis=redis,
            runlog=RunLog(redis),
            sandboxes=sandboxes,
            blobs=blobs,
            scripts={},
            programs=ThreadPoolExecutor(concurrency, thread_name_prefix="fleet-rlm"),
            sandbox_ops=ThreadPoolExecutor(concurrency + 2, thread_name_prefix="fleet-sandbox-ops"),
            cancels=cancels,
            jobs=ArqJobQueue(redis, queue),
            prices=await asyncio.to_thread(PriceBook.of, settings),
            worker_id=worker_id,
        )
        ctx["announce"] = asyncio.create_task(announce_sandbox(redis, worker_id, sandboxes.mode))
        if not burst:  # a burst worker (tests) sweeps only when asked
            start_background_loops(ctx, deps)
        log.info("worker.started", queue=queue, concurrency=concurrency, sandbox=sandboxes.mode)

    async def shutdown(ctx: Context) -> None:
        if ctx.get("closed"):
            return
        sweeper: Sweeper | None = ctx.get("sweeper")
        deliverer: Deliverer | None = ctx.get("deliverer")
        stops = {
            "sweep": sweeper.stopping if sweeper else None,
            "gc": ctx.get("gc_stopping"),
            "webhooks": deliverer.stopping if deliverer else None,
        }
        for name in ("sweep", "announce", "daytona_sweep", "scratch_sweep", "gc", "webhooks"):
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
        await bounded("tracing.shutdown", partial(asyncio.to_thread, shutdown_tracing))
        ctx["closed"] = True

    return JobWorker(
        run_turn,
        redis_url=settings.redis_url,
        queue_name=queue,
        concurrency=concurrency,
        poll_delay_seconds=settings.profile.worker.poll_delay_seconds,
        job_timeout_seconds=settings.profile.runtime.turn_timeout_seconds + 120,  # our deadline fires first
        drain_seconds=settings.profile.worker.drain_seconds,
        on_startup=startup,
        on_shutdown=shutdown,
        burst=burst,
    )


def start_background_loops(ctx: Context, deps: WorkerDeps) -> None:
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
            deps.redis, deps.db_sessions, deps.blobs, queue=queue, storage=storage, stopping=stopping
        )
        ctx["gc"] = asyncio.create_task(gc, name="fleet-gc")
    deliverer = deliverer_for(settings, deps.db_sessions, f"worker:{deps.worker_id}")
    if deliverer is not None:  # deliveries are rows: any worker or gateway sends the due ones
        ctx["deliverer"] = deliverer
        ctx["webhooks"] = asyncio.create_task(deliverer.run_forever(), name="fleet-webhooks")


async def sweep_daytona(deps: WorkerDeps) -> None:
    """Delete the deployment's Daytona sandboxes whose sessions went idle (every worker does it;
    deleting one twice is harmless)."""
    from fleet_worker.sandbox.daytona import DaytonaSandboxProvider
    from fleet_worker.sandbox.daytona.ops import sweep_forever

    assert isinstance(deps.sandboxes, DaytonaSandboxProvider)
    await sweep_forever(deps.sandboxes, deps.db_sessions, DAYTONA_SWEEP_SECONDS)


async def sweep_scratch_forever(deps: WorkerDeps, provider: LocalSandboxProvider) -> None:
    """Remove the child scratch folders whose removal failed or whose worker died (the start-up
    sweep took those left before this worker started), and the workspace folders of deleted
    sessions."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(SCRATCH_SWEEP_SECONDS)
        try:
            await loop.run_in_executor(deps.sandbox_ops, provider.sweep_scratch)
            await remove_deleted_workspaces(deps, provider)
        except Exception as exc:  # never die: the next round tries again
            log.warning("sandbox.scratch_sweep_failed", error_type=type(exc).__name__, error=str(exc))


async def remove_deleted_workspaces(deps: WorkerDeps, provider: LocalSandboxProvider) -> int:
    """The folders this worker keeps for workspaces the database no longer has, removed."""
    root = provider.workspaces
    if root is None:
        return 0
    loop = asyncio.get_running_loop()
    names = await loop.run_in_executor(deps.sandbox_ops, leftovers.workspace_folders, root)
    if not names:
        return 0
    async with deps.db_sessions() as db:
        gone = sorted(set(names) - await purge.existing_workspaces(db, names))
    if not gone:
        return 0
    remove = functools.partial(leftovers.remove_workspaces, root, gone, provider.warm_pool, provider.volumes)
    return await loop.run_in_executor(deps.sandbox_ops, remove)


async def announce_sandbox(redis: Redis, worker_id: str, mode: str) -> None:
    """Keep this worker's sandbox mode where /ready can show it, for as long as it lives."""
    key = redis_keys.worker_sandbox(worker_id)
    while True:
        with contextlib.suppress(RedisError, OSError):
            await redis.set(key, mode, ex=redis_keys.WORKER_SANDBOX_TTL_SECONDS)
        await asyncio.sleep(redis_keys.WORKER_SANDBOX_TTL_SECONDS / 3)


def make_sweeper(deps: WorkerDeps) -> Sweeper:
    return Sweeper(
        db_sessions=deps.db_sessions,
        redis=deps.redis,
        runlog=deps.runlog,
        lease_seconds=deps.settings.profile.worker.lease_seconds,
        owner=f"worker:{deps.worker_id}",
        jobs=deps.jobs,
    )
