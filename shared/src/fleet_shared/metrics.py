"""Prometheus metrics both sides export: the job queue's Turns waiting and in progress (read
from Redis, at most every QUEUE_COUNTS_MAX_AGE_SECONDS per process), the sweeper's actions and
cancellations. Side-only metrics live in fleet_gateway.metrics and fleet_worker.metrics;
docs/metrics.md lists them all.

Labels stay bounded: every label value here comes from a fixed set or from the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import RedisError

from fleet_shared.jobs import QueueCounts, counts_of, queue_counts_call

QUEUE_DEPTH = "fleet_queue_depth"
QUEUE_IN_PROGRESS = "fleet_queue_in_progress"
# A scrape never waits longer than this for Redis: a dead or hung Redis leaves the queue's
# gauges out of that scrape (they are not reported stale), and /metrics answers all the rest.
QUEUE_DEPTH_TIMEOUT_SECONDS = 1.0
# The counting script is O(jobs in the queue) and blocks Redis while it runs, and /metrics is
# open: each process evaluates it at most once per this many seconds, however many scrape.
QUEUE_COUNTS_MAX_AGE_SECONDS = 2.0

ReaperAction = Literal["settled_lost", "settled_cancelled", "requeued", "failed_enqueue_lost"]
CancelStage = Literal["waiting", "queued", "running"]

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


def queue_families(queue: str, counts: QueueCounts | None) -> list[GaugeMetricFamily]:
    """The two gauges, with one sample each for `queue` when the counts are known, none when not."""
    depth = GaugeMetricFamily(
        QUEUE_DEPTH, "Turns waiting in the job queue (not started, not cancelled)", labels=["queue"]
    )
    in_progress = GaugeMetricFamily(
        QUEUE_IN_PROGRESS, "Turns in the job queue that a worker is running now", labels=["queue"]
    )
    if counts is not None:
        depth.add_metric([queue], counts.waiting)
        in_progress.add_metric([queue], counts.in_progress)
    return [depth, in_progress]


async def read_queue_counts(redis: Redis, queue: str) -> QueueCounts | None:
    """The queue's counts, or None when Redis does not answer within the timeout."""
    try:
        async with asyncio.timeout(QUEUE_DEPTH_TIMEOUT_SECONDS):
            reply = await redis.eval(*queue_counts_call(queue))  # type: ignore[misc]
    except (RedisError, OSError, TimeoutError):
        return None
    return counts_of(reply)


def read_queue_counts_sync(redis: SyncRedis, queue: str) -> QueueCounts | None:
    """As read_queue_counts, for a thread (the worker's metrics server); `redis` carries the
    timeout as its socket timeouts."""
    try:
        reply = redis.eval(*queue_counts_call(queue))
    except (RedisError, OSError):
        return None
    return counts_of(reply)


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


class LastCounts:
    """The last read and when (time.monotonic()); a failed read (None) is kept as long, so a dead
    Redis is not asked again by every scrape either."""

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        self.value: QueueCounts | None = None
        self.read_at: float | None = None

    def fresh(self) -> bool:
        return self.read_at is not None and time.monotonic() - self.read_at < self.max_age

    def store(self, value: QueueCounts | None) -> QueueCounts | None:
        self.value, self.read_at = value, time.monotonic()
        return value


class SharedQueueCounts:
    """The gateway's counts: concurrent scrapes wait for one read (single flight) and share it."""

    def __init__(
        self,
        read: Callable[[], Awaitable[QueueCounts | None]],
        max_age: float = QUEUE_COUNTS_MAX_AGE_SECONDS,
    ) -> None:
        self.read = read
        self.last = LastCounts(max_age)
        self.lock = asyncio.Lock()

    async def get(self) -> QueueCounts | None:
        async with self.lock:
            return self.last.value if self.last.fresh() else self.last.store(await self.read())


class SharedQueueCountsSync:
    """As SharedQueueCounts, for the worker's metrics threads."""

    def __init__(
        self, read: Callable[[], QueueCounts | None], max_age: float = QUEUE_COUNTS_MAX_AGE_SECONDS
    ) -> None:
        self.read = read
        self.last = LastCounts(max_age)
        self.lock = threading.Lock()

    def get(self) -> QueueCounts | None:
        with self.lock:
            return self.last.value if self.last.fresh() else self.last.store(self.read())


class QueueCountsCollector(Collector):
    """fleet_queue_depth and fleet_queue_in_progress at each collection (a scrape)."""

    def __init__(self, queue: str, counts: SharedQueueCountsSync) -> None:
        self.queue = queue
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from queue_families(self.queue, self.counts.get())

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from queue_families(self.queue, None)  # registering must not call Redis


def exposition_of(families: Iterable[GaugeMetricFamily]) -> bytes:
    """Families in the text format, to append to a registry's own exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FixedCollector(list(families)))
    return generate_latest(registry)


class FixedCollector(Collector):
    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self.families = families

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self.families


@contextlib.contextmanager
def queue_counts_in(registry: CollectorRegistry, queue: str, redis_url: str) -> Iterator[None]:
    """The queue's two gauges in `registry` (read at most every QUEUE_COUNTS_MAX_AGE_SECONDS)
    while the block runs."""
    client = queue_depth_client(redis_url)
    counts = SharedQueueCountsSync(lambda: read_queue_counts_sync(client, queue))
    collector = QueueCountsCollector(queue, counts)
    registry.register(collector)
    try:
        yield
    finally:
        registry.unregister(collector)
        client.close()
