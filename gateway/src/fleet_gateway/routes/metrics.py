"""GET /metrics: Prometheus exposition of this process's registry (open, like /health)."""

from __future__ import annotations

from litestar import Response, get
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# generate_latest writes the classic text format; this is its type, which every Prometheus reads.
TEXT_FORMAT = CONTENT_TYPE_PLAIN_0_0_4


@get("/metrics", exclude_from_auth=True, media_type=TEXT_FORMAT)
async def metrics() -> Response[bytes]:
    """The default registry (process and Python collectors) plus the gateway's own metrics, in
    the Prometheus text format. Each gateway process reports its own counts."""
    return Response(generate_latest(REGISTRY), media_type=TEXT_FORMAT)
