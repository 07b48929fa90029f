"""A Turn's worker spans, read off its events: what they nest under, what they carry with content
capture off and on, and that a Turn stopped mid-cell leaves no span open."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleet_shared.events import CellOutput, CodeCell, IterationFinished, IterationStarted, LMQueryStarted
from fleet_worker.turn_trace import TurnTrace
from tests.support.spans import recorded_spans

RUN = "r1"
SECRET_CODE = "print('Bearer sk-abcdefabcdefabcdef')"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


def begin(capture: bool) -> TurnTrace:
    trace = TurnTrace.begin(None, {"fleet.run_id": RUN}, capture_content=capture, price=lambda *_: 0.25)
    assert trace is not None
    return trace


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_off_there_is_no_trace() -> None:
    assert TurnTrace.begin(None, {}, capture_content=True, price=lambda *_: None) is None


@pytest.mark.parametrize("capture", [False, True])
def test_a_cell_nests_under_its_iteration_and_carries_code_only_when_captured(
    exported: InMemorySpanExporter, capture: bool
) -> None:
    trace = begin(capture)
    trace.observe(IterationStarted(run_id=RUN, iteration=1))
    trace.observe(CodeCell(run_id=RUN, call_id="cell-1", code=SECRET_CODE))
    trace.observe(CellOutput(run_id=RUN, call_id="cell-1", stdout="x", error="ValueError: no"))
    trace.observe(IterationFinished(run_id=RUN, iteration=1))
    trace.end("completed", None, {"fleet.iterations": 1})
    spans = by_name(exported)
    cell, iteration, run = spans["sandbox.cell"], spans["rlm.iteration"], spans["turn.run"]
    assert cell.parent is not None and iteration.parent is not None
    assert (cell.parent.span_id, iteration.parent.span_id) == (iteration.context.span_id, run.context.span_id)
    assert cell.status.status_code.name == "ERROR" and cell.attributes["fleet.failure_code"] == "cell_error"
    code = cell.attributes.get("fleet.code")
    if capture:
        assert code is not None and "sk-abcdef" not in str(code) and "print(" in str(code)  # redacted
    else:
        assert code is None
    assert run.attributes["fleet.status"] == "completed"


def test_a_sub_lm_call_nests_under_its_query_with_tokens_and_cost(exported: InMemorySpanExporter) -> None:
    trace = begin(False)
    trace.observe(IterationStarted(run_id=RUN, iteration=1))
    trace.observe(LMQueryStarted(run_id=RUN, call_id="q1", tool="llm_query", prompt="private"))
    call = trace.lm_started("openai/gpt-test", "sub")
    trace.lm_usage(call, "openai/gpt-test", {"prompt_tokens": 12, "completion_tokens": 3})
    call.end()
    root_call = trace.lm_started("openai/gpt-test", "root")
    root_call.end()
    trace.end("completed", None, {})
    spans = exported.get_finished_spans()
    query = next(s for s in spans if s.name == "rlm.lm_query")
    sub, root = (
        next(s for s in spans if s.name == "lm.call" and s.attributes["fleet.lm_role"] == r)
        for r in ("sub", "root")
    )
    iteration = next(s for s in spans if s.name == "rlm.iteration")
    assert sub.parent is not None and sub.parent.span_id == query.context.span_id
    assert root.parent is not None and root.parent.span_id == iteration.context.span_id
    assert sub.attributes["gen_ai.usage.input_tokens"] == 12 and sub.attributes["fleet.cost_usd"] == 0.25
    assert "fleet.prompt" not in query.attributes


def test_a_turn_stopped_mid_cell_ends_every_span(exported: InMemorySpanExporter) -> None:
    trace = begin(False)
    trace.observe(IterationStarted(run_id=RUN, iteration=1))
    trace.observe(CodeCell(run_id=RUN, call_id="cell-1", code="while True: pass"))
    trace.end("cancelled", "cancelled", {})
    trace.end("cancelled", "cancelled", {})  # a second end (the cleanup's) changes nothing
    names = sorted(span.name for span in exported.get_finished_spans())
    assert names == ["rlm.iteration", "sandbox.cell", "turn.run"]
    run = by_name(exported)["turn.run"]
    assert run.status.status_code.name == "ERROR" and run.attributes["fleet.failure_code"] == "cancelled"


def test_after_the_turn_ends_a_late_thread_opens_no_span(exported: InMemorySpanExporter) -> None:
    trace = begin(False)
    trace.end("cancelled", "cancelled", {})
    trace.observe(IterationStarted(run_id=RUN, iteration=1))  # a program thread that outlived it
    trace.observe(CodeCell(run_id=RUN, call_id="cell-1", code="x"))
    late = trace.lm_started("openai/gpt-test", "root")
    late.end()
    assert [span.name for span in exported.get_finished_spans()] == ["turn.run"]
    assert not late.get_span_context().is_valid


def test_a_retried_call_adds_each_attempts_usage(exported: InMemorySpanExporter) -> None:
    trace = begin(False)
    call = trace.lm_started("openai/gpt-test", "root")
    trace.lm_usage(call, "openai/gpt-test", {"prompt_tokens": 10, "completion_tokens": 2})
    trace.lm_usage(call, "openai/gpt-test", {"prompt_tokens": 10, "completion_tokens": 3})
    trace.lm_ended(call, None)
    trace.end("completed", None, {})
    span = by_name(exported)["lm.call"]
    assert (span.attributes["gen_ai.usage.input_tokens"], span.attributes["gen_ai.usage.output_tokens"]) == (
        20,
        5,
    )
    assert span.attributes["fleet.cost_usd"] == 0.5


def test_spans_the_turn_left_open_are_marked_unfinished(exported: InMemorySpanExporter) -> None:
    trace = begin(False)
    trace.observe(IterationStarted(run_id=RUN, iteration=1))
    trace.end("failed", "turn_timeout", {})
    assert by_name(exported)["rlm.iteration"].attributes["fleet.unfinished"] is True
