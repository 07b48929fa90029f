"""The gateway's Prometheus metrics: requests by route template, and the streams open now."""

from __future__ import annotations

from litestar.types import Message, Scope
from prometheus_client import Counter, Gauge

# Labels stay bounded: the route is the template (never the path with its ids), an unknown
# method is "other", and the status is one of HTTP's few codes.
UNMATCHED = "unmatched"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

HTTP_REQUESTS = Counter(
    "fleet_gateway_http_requests",
    "HTTP responses started, by method, route template and status",
    ["method", "route", "status"],
)
ACTIVE_STREAMS = Gauge(
    "fleet_gateway_active_streams",
    "Turn and resume streams this process is sending now",
)


async def count_response(message: Message, scope: Scope) -> None:
    """A before_send hook: it also sees the responses of unmatched routes (404, 405)."""
    if message["type"] != "http.response.start":
        return
    method = str(scope.get("method", "")).upper()
    HTTP_REQUESTS.labels(
        method=method if method in KNOWN_METHODS else "other",
        # Set by the router only once a route matched; a 404 or 405 never gets that far.
        route=scope.get("path_template") or UNMATCHED,
        status=str(message["status"]),
    ).inc()
