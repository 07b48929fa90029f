"""Spans recorded in memory for one test: fleet's tracer uses this provider while the block runs
(fleet_shared.tracing's own slot), and the process's global provider is never touched."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleet_shared import tracing


@contextmanager
def recorded_spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.state["provider"] = provider
    try:
        yield exporter
    finally:
        tracing.state["provider"] = None
