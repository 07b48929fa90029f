"""GET /metrics: Prometheus exposition of the gateway's metrics (open, like /health), with the
queue depth read from Redis for each scrape."""

from __future__ import annotations

from litestar import Response, get
from litestar.di import NamedDependency
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from fleet_gateway.metrics import scrape_registry
from fleet_gateway.state import GatewayState
from fleet_shared.metrics import exposition_of, queue_depth_family, read_queue_depth

# generate_latest writes the classic text format; this is its type, which every Prometheus reads.
TEXT_FORMAT = CONTENT_TYPE_PLAIN_0_0_4


@get("/metrics", exclude_from_auth=True, media_type=TEXT_FORMAT)
async def metrics(gw: NamedDependency[GatewayState]) -> Response[bytes]:
    """The gateway's metrics in the Prometheus text format, summed over its processes, and the
    queue's depth (left out when Redis does not answer within a second). See docs/metrics.md."""
    queue = gw.settings.profile.worker.queue_name
    depth = await read_queue_depth(gw.probe, queue)
    body = generate_latest(scrape_registry()) + exposition_of(queue_depth_family(queue, depth))
    return Response(body, media_type=TEXT_FORMAT)
