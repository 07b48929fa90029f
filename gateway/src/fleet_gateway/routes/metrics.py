"""GET /metrics: Prometheus exposition of the gateway's metrics (open, like /health), with the
queue's counts read from Redis at most every QUEUE_COUNTS_MAX_AGE_SECONDS per process."""

from __future__ import annotations

from litestar import Response, get
from litestar.datastructures import State
from litestar.di import NamedDependency
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from fleet_gateway.metrics import scrape_registry
from fleet_gateway.state import GatewayState
from fleet_shared.metrics import SharedQueueCounts, exposition_of, queue_families, read_queue_counts

# generate_latest writes the classic text format; this is its type, which every Prometheus reads.
TEXT_FORMAT = CONTENT_TYPE_PLAIN_0_0_4
QUEUE_COUNTS_KEY = "fleet_queue_counts"  # the app state's SharedQueueCounts


def shared_queue_counts(state: State, gw: GatewayState) -> SharedQueueCounts:
    """This app's one cache of the queue's counts, made at its first scrape."""
    counts = state.get(QUEUE_COUNTS_KEY)
    if not isinstance(counts, SharedQueueCounts):
        queue = gw.settings.profile.worker.queue_name
        counts = SharedQueueCounts(lambda: read_queue_counts(gw.probe, queue))
        state[QUEUE_COUNTS_KEY] = counts
    return counts


@get("/metrics", exclude_from_auth=True, media_type=TEXT_FORMAT)
async def metrics(gw: NamedDependency[GatewayState], state: State) -> Response[bytes]:
    """The gateway's metrics in the Prometheus text format, summed over its processes, and the
    queue's counts (left out when Redis does not answer within a second). See docs/metrics.md."""
    counts = await shared_queue_counts(state, gw).get()
    families = queue_families(gw.settings.profile.worker.queue_name, counts)
    body = generate_latest(scrape_registry()) + exposition_of(families)
    return Response(body, media_type=TEXT_FORMAT)
