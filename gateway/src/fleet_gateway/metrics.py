"""The gateway's Prometheus metrics: requests by route template, and the streams open now.

With several Granian processes (`fleet gateway --workers N`), the CLI sets
PROMETHEUS_MULTIPROC_DIR before they start: each process then writes its values to files there,
and /metrics sums them all (prometheus-client's multiprocess mode).
"""

from __future__ import annotations

import atexit
import os

from litestar.types import Message, Scope
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, multiprocess

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

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
    "Turn and resume streams the gateway is sending now",
    multiprocess_mode="livesum",  # the live processes' streams, summed
)


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROCESS_ENV) or None


def scrape_registry() -> CollectorRegistry:
    """What /metrics exposes: this process's registry, or every process's files when several
    share the multiprocess directory (no process/platform collectors then: they are per process)."""
    path = multiprocess_dir()
    if path is None:
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    return registry


def forget_this_process() -> None:
    """A gateway process that exits takes its live gauge (open streams) out of the sum."""
    path = multiprocess_dir()
    if path is not None:
        multiprocess.mark_process_dead(os.getpid(), path)  # type: ignore[no-untyped-call]


atexit.register(forget_this_process)


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
