"""Feedback is `forwarded` only when its span is recorded: under a trace a sampler left out,
nothing reaches the exporter, and the answer says so."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleet_gateway.routes.feedback import forward
from fleet_shared.db.models import Feedback
from tests.support.spans import recorded_spans

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


def rating(comment: str | None) -> Feedback:
    return Feedback(
        id="f1", session_id="s1", run_id="r1", rating="down", comment=comment, created_at=datetime.now(UTC)
    )


@pytest.mark.parametrize(("flags", "recorded"), [("01", True), ("00", False)])
def test_forwarded_only_when_the_runs_trace_is_recorded(
    exported: InMemorySpanExporter, flags: str, recorded: bool
) -> None:
    assert forward(rating(None), f"00-{TRACE}-00f067aa0ba902b7-{flags}", capture_content=False) is recorded
    assert len(exported.get_finished_spans()) == int(recorded)


def test_no_trace_on_the_run_is_not_forwarded(exported: InMemorySpanExporter) -> None:
    assert forward(rating(None), None, capture_content=False) is False


@pytest.mark.parametrize("capture", [False, True])
def test_the_comment_travels_only_with_content_capture(exported: InMemorySpanExporter, capture: bool) -> None:
    assert forward(
        rating("token: ghp_0123456789abcdefghijKLMN is wrong"), f"00-{TRACE}-00f067aa0ba902b7-01", capture
    )
    (span,) = exported.get_finished_spans()
    (event,) = span.events
    assert event.attributes is not None
    assert event.attributes.get("fleet.comment") == ("token: *** is wrong" if capture else None)
