"""OpenTelemetry traces, set up by the standard `OTEL_*` environment variables alone.

Off unless an OTLP endpoint is named (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and tracing is not switched off (`OTEL_SDK_DISABLED=true`
or `OTEL_TRACES_EXPORTER=none`). Off, the SDK is never imported: the API's tracer makes no-op
spans and no exporter thread runs. On, spans go over OTLP/HTTP (protobuf) through the SDK's batch
processor; the SDK reads the rest itself (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_HEADERS`, timeouts).

A Turn is one trace: the gateway's `turn.submit` span is stored on the Run as a W3C
`traceparent`, and the worker's `turn.run` and the feedback's span are its children, whichever
process runs them and however often the job is requeued.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = structlog.get_logger(__name__)
TRACER_NAME = "fleet"
W3C = TraceContextTextMapPropagator()
ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
state: dict[str, Any] = {"provider": None}  # the SDK's provider, once configure_tracing set one


def tracing_requested(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:  # `none`, or an exporter fleet does not ship
        return False
    return any(env.get(name, "").strip() for name in ENDPOINTS)


def configure_tracing(process: str, env: Mapping[str, str] | None = None) -> bool:
    """The process's tracer provider, when the environment asks for one; True when tracing is
    on. Call it in the process that serves (after any fork), once."""
    env = os.environ if env is None else env
    if state["provider"] is not None or not tracing_requested(env):
        return state["provider"] is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        log.warning("tracing.protocol_unsupported", protocol=protocol, used="http/protobuf")
    # The service name from the environment wins; fleet-<process> only names an unnamed one.
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": f"fleet-{process}"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    state["provider"] = provider
    log.info("tracing.on", service=resource.attributes.get("service.name"))
    return True


def tracing_on() -> bool:
    return state["provider"] is not None


def shutdown_tracing() -> None:
    """Export what is queued, then stop the exporter (bounded by OTEL_BSP_EXPORT_TIMEOUT)."""
    provider = state["provider"]
    if provider is not None:
        provider.shutdown()


def tracer() -> trace.Tracer:
    provider = state["provider"]
    return trace.get_tracer(TRACER_NAME) if provider is None else provider.get_tracer(TRACER_NAME)


def traceparent_of(span: Span) -> str | None:
    """The span as a W3C `traceparent` (its sampled flag included, so the processes that continue
    it record it or not alike), or None for the invalid span that tracing off makes."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def context_of(traceparent: str | None) -> Context | None:
    """The parent a `traceparent` names; None (a new trace) when it is absent or malformed."""
    if not traceparent:
        return None
    context = W3C.extract({"traceparent": traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def inbound(traceparent: str | None, trusted: bool) -> tuple[Context | None, list[Link]]:
    """A caller's `traceparent` as (parent, links). Trusted, the Turn's trace continues the
    caller's (its trace id, its sampling decision). Not trusted (the default), the Turn starts a
    trace of its own, sampled by the operator's sampler, with a link to the caller's span: a
    client can neither switch tracing off for its Turn nor put spans into another trace."""
    caller = context_of(traceparent)
    if caller is None or trusted:
        return caller, []
    return None, [Link(trace.get_current_span(caller).get_span_context())]


def start_span(
    name: str,
    parent: Context | Span | None,
    attributes: Mapping[str, Any] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    links: list[Link] | None = None,
) -> Span:
    """A span under an explicit parent (a program's threads do not share the loop's context)."""
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    return tracer().start_span(
        name, context=context, kind=kind, attributes=dict(attributes or {}), links=links
    )


@contextmanager
def child_span(
    name: str, parent: Context | Span | None, links: list[Link] | None = None, **attributes: Any
) -> Iterator[Span]:
    """A span that ends with the block, current within it; an exception out of it marks it
    failed. With tracing off it is the invalid span, and nothing is made or set."""
    if not tracing_on():
        yield trace.INVALID_SPAN
        return
    span = start_span(name, parent, attributes, links=links)
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield span
    except BaseException as exc:
        code = getattr(exc, "code", None)  # an API error's documented code
        failed(span, code if isinstance(code, str) else type(exc).__name__)
        raise
    finally:
        span.end()


def failed(span: Span, code: str) -> None:
    """A failed span carries the failure's code, never its message (which may quote content)."""
    span.set_attribute("fleet.failure_code", code)
    span.set_status(Status(StatusCode.ERROR, code))


def add_trace_ids(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog: the current span's `trace_id` and `span_id`, in the W3C hex form (with tracing
    off, no span is ever current: nothing is looked up)."""
    if state["provider"] is None:
        return event
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event
