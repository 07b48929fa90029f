"""The worker's side of the job queue (fleet_shared.jobs): arq's `Worker`, through its public API.

arq polls the queue every `worker.poll_delay_seconds` for jobs (no push wake-ups: ADR 0034 says
why that is enough), runs up to `worker.concurrency` at once, retries a job whose worker died,
cancels a queued job the gateway aborted, and writes the health key `/ready` reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import structlog
from arq import Worker
from arq.connections import RedisSettings
from arq.worker import func
from redis.exceptions import RedisError

from fleet_shared.backoff import Backoff
from fleet_shared.jobs import RUN_TURN, deserialize_job, health_key, serialize_job
from fleet_shared.redis_conn import RETRY_ON, retry_policy

log = structlog.get_logger(__name__)
Context = dict[str, Any]  # arq's ctx: what on_startup leaves for the jobs, plus each job's own keys
HEALTH_CHECK_INTERVAL_SECONDS = 5
# arq's poll loop retries each Redis command this many times (about 4.5 s) before it gives up;
# `serve_through_outages` then starts the same loop again on the same worker.
QUEUE_RETRIES = 8
MAX_TRIES = 3  # a job's runs, counting those whose worker died; the Run's fence stops a repeat


class JobWorker:
    """One worker process's consumer of the queue. `run_turn(ctx, run_id)` is the job; `ctx`
    holds what `on_startup` put there, and arq's per-job keys (`job_try`, `enqueue_time`)."""

    def __init__(
        self,
        run_turn: Callable[[Context, str], Awaitable[str]],
        *,
        redis_url: str,
        queue_name: str,
        concurrency: int,
        poll_delay_seconds: float,
        job_timeout_seconds: float,
        drain_seconds: float,
        on_startup: Callable[[Context], Awaitable[None]],
        on_shutdown: Callable[[Context], Awaitable[None]],
        burst: bool = False,
    ) -> None:
        redis = RedisSettings.from_dsn(redis_url)
        redis.retry = retry_policy(QUEUE_RETRIES)
        redis.retry_on_error = list(RETRY_ON)
        self.stop_signals: list[object] = []
        self.worker = Worker(
            functions=[
                func(cast(Any, run_turn), name=RUN_TURN, timeout=job_timeout_seconds, max_tries=MAX_TRIES)
            ],
            redis_settings=redis,
            queue_name=queue_name,
            max_jobs=concurrency,
            poll_delay=poll_delay_seconds,
            job_serializer=serialize_job,
            job_deserializer=deserialize_job,
            # (arq's types ask for *args it never passes to these)
            on_startup=cast(Any, on_startup),
            on_shutdown=cast(Any, on_shutdown),
            health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
            health_check_key=health_key(queue_name),
            keep_result=60,
            # A gateway that cancels a queued Run aborts its job (ArqJobQueue.abort): it never starts.
            allow_abort_jobs=True,
            # SIGTERM: stop taking jobs, let running jobs finish for drain_seconds, then cancel
            # them (run_turn settles a cancelled Turn as failed with `worker_shutdown`).
            job_completion_wait=int(drain_seconds),
            burst=burst,
            handle_signals=not burst,
        )
        self.worker.on_stop = self.stop_signals.append

    @property
    def ctx(self) -> Context:
        return self.worker.ctx

    async def run(self) -> None:
        """arq's loop: start-up, then polling until a signal (or, in burst mode, an empty queue)."""
        await self.worker.main()

    async def serve_through_outages(self) -> None:
        """arq's loop, started again on the same worker whenever Redis fails it. Running jobs
        keep going meanwhile (Turns ride out Redis faults on their own), and new jobs are taken
        as soon as Redis is back: nothing waits for the longest Turn."""
        backoff = Backoff(1.0, 30.0)
        while not self.stop_signals:
            try:
                await self.worker.async_run()
                return
            except asyncio.CancelledError:
                return  # SIGTERM: arq cancelled its poll loop after the drain
            except (RedisError, OSError) as exc:
                if self.stop_signals:
                    return
                delay = backoff.next()
                log.warning("worker.redis_unavailable", error_type=type(exc).__name__, retry_in=delay)
                await asyncio.sleep(delay)

    async def close(self) -> None:
        """arq's close (it waits for running jobs); if Redis is down for its last write, the
        shutdown hook still closes fleet's own resources."""
        try:
            await self.worker.close()
        except (RedisError, OSError):
            if self.worker.on_shutdown is not None:
                await self.worker.on_shutdown(self.worker.ctx)
