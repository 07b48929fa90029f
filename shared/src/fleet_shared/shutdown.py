"""Shutdown that always finishes. A gateway or worker that hangs while stopping holds its pod
in Terminating until the kubelet kills it, and holds a test run until its timeout.

Two rules:
- A background loop is asked to stop between units of work (an `asyncio.Event`) and is cancelled
  only if it overruns its grace. Cancelling a task in the middle of a database call can leave
  the driver's connection half-closed (seen with aiosqlite: the pool's later `dispose()` then
  waits forever for a worker thread that had already exited).
- Each teardown step gets a deadline. A step that overruns is abandoned (cancelled, not awaited:
  a step that swallows its cancellation would hang the wait too) and logged, and the next step
  still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)
STEP_SECONDS = 5.0  # one teardown step (close a pool, a client); each is normally milliseconds
LOOP_GRACE_SECONDS = 5.0  # a background loop finishing the unit of work it is in
T = TypeVar("T")


async def bounded(name: str, step: Callable[[], Awaitable[object]], seconds: float | None = None) -> bool:
    """Run one teardown step for at most `seconds` (default STEP_SECONDS). True when it finished
    cleanly; a failure is logged, never raised, so the steps after it still run."""
    seconds = STEP_SECONDS if seconds is None else seconds
    task = asyncio.ensure_future(step())
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        log.warning("shutdown.step_abandoned", step=name, seconds=seconds)
        return False
    if task.cancelled():
        log.warning("shutdown.step_cancelled", step=name)
        return False
    error = task.exception()
    if error is not None:
        log.warning("shutdown.step_failed", step=name, error_type=type(error).__name__)
        return False
    return True


async def stop_loop(
    name: str, task: asyncio.Task[None], stopping: asyncio.Event | None, grace: float | None = None
) -> None:
    """Ask a background loop to stop (set `stopping`), give it `grace` (default
    LOOP_GRACE_SECONDS) to finish what it is doing, then cancel it. A loop with no stop event is
    cancelled at once."""
    grace = LOOP_GRACE_SECONDS if grace is None else grace
    if stopping is not None:
        stopping.set()
        await asyncio.wait({task}, timeout=grace)
    if not task.done():
        task.cancel()
        await bounded(f"{name}.cancel", lambda: asyncio.wait({task}), seconds=grace)
    if task.done() and not task.cancelled() and (error := task.exception()) is not None:
        log.warning("shutdown.loop_failed", loop=name, error_type=type(error).__name__)


async def pause(stopping: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds` between units of work; True when asked to stop meanwhile."""
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def finish_even_if_cancelled(work: Coroutine[Any, Any, T]) -> tuple[T, bool]:
    """Await `work` (a worker's claim or settlement) to the end however often we are cancelled
    meanwhile (arq's close waits for this task, so the DB and Redis stay open); report whether a
    cancellation arrived."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    return task.result(), cancelled
