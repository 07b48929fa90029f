"""A Turn's sandbox lease, asked for in the background and released whatever happens meanwhile."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

import structlog

from fleet_worker import metrics
from fleet_worker.sandbox.provider import SandboxLease

log = structlog.get_logger(__name__)
Granted = tuple[SandboxLease, float]  # the lease and when it was granted (time.monotonic())


def timed(acquire: Callable[[], SandboxLease]) -> Granted:
    """Runs on the sandbox executor: the grant's time is the lease's, not when the loop saw it."""
    lease = acquire()
    return lease, time.monotonic()


async def release_when_acquired(ops: Executor, provider: str, acquiring: asyncio.Future[Granted]) -> None:
    """Release the Turn's sandbox once its acquire ends (even if prepare() failed before then),
    and even if the job is being cancelled."""
    try:
        sandbox, granted = await asyncio.shield(acquiring)
    except asyncio.CancelledError:  # cancelled again while waiting: release it when it comes
        acquiring.add_done_callback(functools.partial(release_late, ops))
        raise
    except Exception:
        return  # nothing was leased (prepare() reported why, or failed first for its own reason)
    loop = asyncio.get_running_loop()
    await asyncio.shield(loop.run_in_executor(ops, sandbox.release))
    metrics.observe_lease_held(provider, granted)


def release_late(ops: Executor, acquiring: asyncio.Future[Granted]) -> None:
    if acquiring.cancelled() or acquiring.exception() is not None:
        return
    sandbox = acquiring.result()[0]
    log.info("sandbox.released_after_cancel")
    try:
        ops.submit(sandbox.release)
    except RuntimeError:  # the executor is shut down: the worker is stopping
        threading.Thread(target=sandbox.release, name="fleet-sandbox-release", daemon=True).start()
