"""Prometheus metrics both sides export: the arq queue's depth (read fresh on each scrape), the
sweeper's actions and cancellations. Side-only metrics live in fleet_gateway.metrics and
fleet_worker.metrics; docs/metrics.md lists them all.

Labels stay bounded: every label value here comes from a fixed set or from the config.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared.queue import ARQ_IN_PROGRESS_PREFIX

QUEUE_DEPTH = "fleet_queue_depth"
# A scrape never waits longer than this for Redis: a dead or hung Redis leaves the queue depth
# out of that scrape (it is not reported stale), and /metrics answers all the rest.
QUEUE_DEPTH_TIMEOUT_SECONDS = 1.0
ARQ_ABORT_SET = "arq:abort"  # arq.constants.abort_jobs_ss: jobs the gateway cancelled while queued

# arq keeps a job in its queue ZSET (score = when it may run) until the job finishes, and marks
# a started job with an in-progress key. Waiting = in the ZSET, not started, not aborted. One
# script, so the count is consistent; it is O(jobs in the queue), which is what a queue holds.
QUEUE_DEPTH_SCRIPT = """
local waiting = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 and not redis.call('ZSCORE', KEYS[2], id) then
    waiting = waiting + 1
  end
end
return waiting
"""

ReaperAction = Literal["settled_lost", "settled_cancelled", "requeued", "failed_enqueue_lost"]
CancelStage = Literal["queued", "running"]

REAPER_ACTIONS = Counter(
    "fleet_reaper_actions",
    "What the sweep did to Runs nobody was moving: settled lost ones (worker_lost or cancelled), "
    "re-enqueued lost jobs, failed jobs lost too long",
    ["action"],
)
CANCELS = Counter(
    "fleet_cancels",
    "Cancellations accepted, by the Run's stage: queued (ended at once) or running (the worker was told)",
    ["stage"],
)


def count_reaper_action(action: ReaperAction) -> None:
    REAPER_ACTIONS.labels(action=action).inc()


def count_cancel(stage: CancelStage) -> None:
    CANCELS.labels(stage=stage).inc()


def queue_depth_family(queue: str, depth: int | None) -> GaugeMetricFamily:
    """The gauge, with one sample for `queue` when its depth is known, none when it is not."""
    family = GaugeMetricFamily(
        QUEUE_DEPTH, "Turns waiting in arq's queue (not started, not cancelled)", labels=["queue"]
    )
    if depth is not None:
        family.add_metric([queue], depth)
    return family


async def read_queue_depth(redis: Redis, queue: str) -> int | None:
    """The queue's waiting jobs, or None when Redis does not answer within the timeout."""
    try:
        async with asyncio.timeout(QUEUE_DEPTH_TIMEOUT_SECONDS):
            depth = await redis.eval(QUEUE_DEPTH_SCRIPT, 2, queue, ARQ_ABORT_SET, ARQ_IN_PROGRESS_PREFIX)  # type: ignore[misc]
    except (RedisError, OSError, TimeoutError):
        return None
    return int(depth)


def read_queue_depth_sync(redis: SyncRedis, queue: str) -> int | None:
    """As read_queue_depth, for a thread (the worker's metrics server); `redis` carries the
    timeout as its socket timeouts."""
    try:
        depth = redis.eval(QUEUE_DEPTH_SCRIPT, 2, queue, ARQ_ABORT_SET, ARQ_IN_PROGRESS_PREFIX)
    except (RedisError, OSError):
        return None
    return int(depth)  # type: ignore[arg-type]


def queue_depth_client(url: str) -> SyncRedis:
    """A blocking client for scrapes: no retries, and no call waits past the scrape's timeout."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client: SyncRedis = SyncRedis.from_url(
        url,
        socket_connect_timeout=QUEUE_DEPTH_TIMEOUT_SECONDS,
        socket_timeout=QUEUE_DEPTH_TIMEOUT_SECONDS,
        retry=Retry(NoBackoff(), 0),
        retry_on_error=[],
    )
    return client


class QueueDepthCollector(Collector):
    """fleet_queue_depth read fresh at each collection (a scrape), by a blocking reader."""

    def __init__(self, queue: str, read: Callable[[], int | None]) -> None:
        self.queue = queue
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield queue_depth_family(self.queue, self.read())

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield queue_depth_family(self.queue, None)  # registering must not call Redis


def exposition_of(family: GaugeMetricFamily) -> bytes:
    """One family in the text format, to append to a registry's own exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FixedCollector(family))
    return generate_latest(registry)


class FixedCollector(Collector):
    def __init__(self, family: GaugeMetricFamily) -> None:
        self.family = family

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield self.family


@contextlib.contextmanager
def queue_depth_in(registry: CollectorRegistry, queue: str, redis_url: str) -> Iterator[None]:
    """fleet_queue_depth in `registry` (read on each scrape) while the block runs."""
    client = queue_depth_client(redis_url)
    collector = QueueDepthCollector(queue, lambda: read_queue_depth_sync(client, queue))
    registry.register(collector)
    try:
        yield
    finally:
        registry.unregister(collector)
        client.close()
