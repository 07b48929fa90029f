"""`project`: Runtime Events → AI SDK UI message stream (v1) chunks."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import pytest

from fleet_gateway.projection import (
    SCHEMA_VERSION,
    StreamState,
    heartbeat_chunk,
    project,
    start_chunk,
    status_chunk,
)
from fleet_shared.events import (
    Answer,
    AnswerDelta,
    CellOutput,
    CodeCell,
    CodeDelta,
    IterationFinished,
    IterationStarted,
    LMQueryFinished,
    LMQueryStarted,
    LMUsage,
    Reasoning,
    ReasoningDelta,
    RunCancelled,
    RunCompleted,
    RunEvent,
    RunFailed,
    RunWarning,
    StatusChanged,
    Usage,
)
from fleet_shared.transcript import OUTPUT_CUT_NOTE

R, SESSION = "run_abc", "sess_xyz"
FORBIDDEN_TYPES = {"reset-step", "custom", "steering-message", "reasoning-file", "tool-approval-response"}
Chunk = dict[str, Any]


def find_none(value: Any, path: str = "$") -> str | None:
    if value is None:
        return path
    children: Any = ()
    if isinstance(value, dict):
        children = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    for key, child in children:
        hit = find_none(child, f"{path}.{key}")
        if hit:
            return hit
    return None


def body(*, iteration: int = 1) -> list[RunEvent]:
    """One iteration: reasoning, a cell that calls llm_query, its output."""
    i = iteration
    return [
        IterationStarted(run_id=R, iteration=i),
        Reasoning(run_id=R, part_id=f"reasoning-{i}", text="I will ask a sub-LM"),
        CodeCell(run_id=R, call_id=f"cell-{i}", code="print(llm_query('hi'))"),
        LMQueryStarted(run_id=R, call_id=f"llm_query-{i}-1", tool="llm_query", prompt="hi"),
        LMQueryFinished(run_id=R, call_id=f"llm_query-{i}-1", text="hello"),
        CellOutput(run_id=R, call_id=f"cell-{i}", stdout="hello\n"),
        IterationFinished(run_id=R, iteration=i),
    ]


FULL_RUN: list[RunEvent] = [
    StatusChanged(run_id=R, phase="execution"),
    *body(),
    Usage(
        run_id=R,
        iterations=1,
        duration_ms=900,
        observed_lm_usage={"scripted/demo": LMUsage(prompt_tokens=40, completion_tokens=9, calls=2)},
    ),
    Answer(run_id=R, part_id="text-answer", text="hello"),
    RunCompleted(run_id=R, duration_ms=900, checkpoint_version=3),
]
FULL_RUN_TYPES = [
    "data-status",
    "start-step",
    "reasoning-start",
    "reasoning-delta",
    "reasoning-end",
    "tool-input-available",
    "tool-input-available",
    "tool-output-available",
    "tool-output-available",
    "finish-step",
    "data-usage",
    "text-start",
    "text-delta",
    "text-end",
    "finish",
]


def stamp(events: list[RunEvent]) -> list[RunEvent]:
    return [msgspec.structs.replace(e, seq=i) for i, e in enumerate(events, start=1)]


def run_stream(events: list[RunEvent], state: StreamState | None = None) -> list[Chunk]:
    state = state or StreamState(R, SESSION)
    start = start_chunk(state, created_at="2025-01-01T00:00:00Z", delivery="live", model="scripted/demo")
    chunks = [start]
    for event in events:
        chunks.extend(project(event, state))
    return chunks


def assert_stream_contract(chunks: list[Chunk]) -> None:
    """The invariants tests/node/check_stream.mjs checks, on the Python side."""
    assert chunks[0]["type"] == "start"
    assert [c["type"] for c in chunks].count("start") == 1
    assert chunks[-1]["type"] in {"finish", "abort"}
    assert sum(c["type"] in {"finish", "abort"} for c in chunks) == 1
    assert find_none(chunks) is None
    assert not {c["type"] for c in chunks} & FORBIDDEN_TYPES
    assert all(c.get("finishReason") != "interrupted" for c in chunks)
    errors = [i for i, c in enumerate(chunks) if c["type"] == "error"]
    assert errors in ([], [len(chunks) - 2])

    part_ids: set[str] = set()
    open_parts: set[str] = set()
    tool_inputs: Counter[str] = Counter()
    tool_outputs: Counter[str] = Counter()
    for c in chunks:
        match c["type"]:
            case "text-start" | "reasoning-start":
                assert c["id"] not in part_ids, f"part id reused: {c}"
                part_ids.add(c["id"])
                open_parts.add(c["id"])
            case "text-delta" | "reasoning-delta":
                assert c["id"] in open_parts, f"delta outside its part: {c}"
            case "text-end" | "reasoning-end":
                assert c["id"] in open_parts, f"end of a part that is not open: {c}"
                open_parts.remove(c["id"])
            case "tool-input-available":
                assert tool_inputs[c["toolCallId"]] == 0, f"toolCallId reused: {c}"
                tool_inputs[c["toolCallId"]] += 1
            case "tool-output-available" | "tool-output-error":
                assert tool_inputs[c["toolCallId"]] == 1, f"output before input: {c}"
                assert tool_outputs[c["toolCallId"]] == 0, f"second output: {c}"
                tool_outputs[c["toolCallId"]] += 1
    assert not open_parts
    assert not part_ids & set(tool_inputs), "a text/reasoning id doubles as a toolCallId"


# --- start ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("delivery", ["live", "replay", "resume"])
def test_start_chunk(delivery: Any) -> None:
    state = StreamState(R, SESSION)
    chunk = start_chunk(state, created_at="2025-01-01T00:00:00Z", delivery=delivery, model="openai/gpt-4o")
    assert chunk == {
        "type": "start",
        "messageId": R,
        "messageMetadata": {
            "schemaVersion": 1,
            "runId": R,
            "sessionId": SESSION,
            "createdAt": "2025-01-01T00:00:00Z",
            "delivery": delivery,
            "model": "openai/gpt-4o",
        },
    }
    assert SCHEMA_VERSION == 1


# --- a whole run ---------------------------------------------------------------------------------


def test_completed_run_chunk_order_and_finish() -> None:
    state = StreamState(R, SESSION, idempotent_replay=True)
    chunks = run_stream(stamp(FULL_RUN), state)

    assert [c["type"] for c in chunks] == ["start", *FULL_RUN_TYPES]
    assert chunks[-1] == {
        "type": "finish",
        "finishReason": "stop",
        "messageMetadata": {
            "runId": R,
            "sessionId": SESSION,
            "durationMs": 900,
            "checkpointVersion": 3,
            "idempotentReplay": True,
        },
    }
    assert state.finished is True
    assert state.projected_seq == len(FULL_RUN)
    assert state.open_tools == set()
    assert state.step_open is False
    assert_stream_contract(chunks)


def test_completed_run_chunk_contents() -> None:
    chunks = run_stream(FULL_RUN)
    by_type: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_type.setdefault(c["type"], []).append(c)

    assert by_type["data-status"] == [
        {"type": "data-status", "data": {"phase": "execution", "status": "started"}, "transient": True}
    ]
    assert [c.get("delta") for c in chunks if c["type"].startswith("reasoning")] == [
        None,
        "I will ask a sub-LM",
        None,
    ]
    assert by_type["tool-input-available"] == [
        {
            "type": "tool-input-available",
            "toolCallId": "cell-1",
            "toolName": "python",
            "input": {"code": "print(llm_query('hi'))"},
            "providerExecuted": True,
            "dynamic": True,
        },
        {
            "type": "tool-input-available",
            "toolCallId": "llm_query-1-1",
            "toolName": "llm_query",
            "input": {"prompt": "hi"},
            "providerExecuted": True,
            "dynamic": True,
        },
    ]
    assert by_type["tool-output-available"] == [
        {
            "type": "tool-output-available",
            "toolCallId": "llm_query-1-1",
            "output": {"text": "hello"},
            "providerExecuted": True,
            "dynamic": True,
        },
        {
            "type": "tool-output-available",
            "toolCallId": "cell-1",
            "output": {"stdout": "hello\n", "truncated": False},
            "providerExecuted": True,
            "dynamic": True,
        },
    ]
    assert by_type["data-usage"] == [
        {
            "type": "data-usage",
            "data": {
                "usage": {
                    "iterations": 1,
                    "duration_ms": 900,
                    "observed_lm_usage": {
                        "scripted/demo": {"prompt_tokens": 40, "completion_tokens": 9, "calls": 2}
                    },
                }
            },
        }
    ]
    assert [c for c in chunks if c["type"].startswith("text-")] == [
        {"type": "text-start", "id": "text-answer"},
        {"type": "text-delta", "id": "text-answer", "delta": "hello"},
        {"type": "text-end", "id": "text-answer"},
    ]


def test_multi_iteration_run_keeps_ids_unique() -> None:
    events = [
        StatusChanged(run_id=R, phase="execution"),
        *body(iteration=1),
        *body(iteration=2),
        *body(iteration=3),
        RunWarning(run_id=R, code="w", message="careful"),
        Answer(run_id=R, part_id="text-answer", text="ok"),
        RunCompleted(run_id=R, duration_ms=5),
    ]
    chunks = run_stream(events)
    assert [c["type"] for c in chunks].count("start-step") == 3
    assert [c["type"] for c in chunks].count("finish-step") == 3
    assert_stream_contract(chunks)


@pytest.mark.parametrize(
    ("terminal", "tail"),
    [
        (
            RunFailed(run_id=R, code="lm_error", message="provider said 500"),
            [
                {"type": "error", "errorText": "lm_error: provider said 500"},
                {"type": "finish", "finishReason": "error"},
            ],
        ),
        (RunCancelled(run_id=R), [{"type": "abort", "reason": "Turn cancelled"}]),
        (RunCancelled(run_id=R, reason="Session deleted"), [{"type": "abort", "reason": "Session deleted"}]),
    ],
    ids=["failed", "cancelled", "cancelled-with-reason"],
)
@pytest.mark.parametrize("prefix", ["empty", "after-body", "mid-step"])
def test_failed_and_cancelled_runs(terminal: RunEvent, tail: list[Chunk], prefix: str) -> None:
    events: list[RunEvent] = {
        "empty": [],
        "after-body": body(),
        "mid-step": body()[:3],  # step open, cell input sent, no output
    }[prefix]
    state = StreamState(R, SESSION)
    chunks = run_stream([*events, terminal], state)
    assert chunks[-len(tail) :] == tail
    assert state.finished is True
    assert_stream_contract(chunks)


# --- closing open work on completion -------------------------------------------------------------


def test_completed_with_open_tool_closes_it_before_finish_step() -> None:
    events: list[RunEvent] = [
        IterationStarted(run_id=R, iteration=1),
        CodeCell(run_id=R, call_id="cell-1", code="llm_query('x')"),
        LMQueryStarted(run_id=R, call_id="llm_query-1-1", tool="llm_query", prompt="x"),
        RunCompleted(run_id=R, duration_ms=1),
    ]
    state = StreamState(R, SESSION)
    chunks = run_stream(events, state)
    tail = chunks[-4:]
    assert [c["type"] for c in tail] == ["tool-output-error", "tool-output-error", "finish-step", "finish"]
    assert {c["toolCallId"] for c in tail[:2]} == {"cell-1", "llm_query-1-1"}
    for c in tail[:2]:
        assert c["errorText"] == "the Turn ended before this call returned"
        assert c["providerExecuted"] is True
        assert c["dynamic"] is True
    assert state.open_tools == set()
    assert_stream_contract(chunks)


def test_streamed_reasoning_opens_on_its_first_delta_and_closes_with_its_tail() -> None:
    events: list[RunEvent] = [
        IterationStarted(run_id=R, iteration=1),
        ReasoningDelta(run_id=R, part_id="reasoning-1", delta="Think "),
        ReasoningDelta(run_id=R, part_id="reasoning-1", delta="it "),
        Reasoning(run_id=R, part_id="reasoning-1", text="Think it through.", streamed=True, tail="through."),
        CodeCell(run_id=R, call_id="cell-1", code="print(1)"),
        CellOutput(run_id=R, call_id="cell-1", stdout="1\n"),
        IterationFinished(run_id=R, iteration=1),
        RunCompleted(run_id=R, duration_ms=1),
    ]
    chunks = run_stream(events)
    reasoning = [c for c in chunks if c["type"].startswith("reasoning-")]
    assert [(c["type"], c.get("delta")) for c in reasoning] == [
        ("reasoning-start", None),
        ("reasoning-delta", "Think "),
        ("reasoning-delta", "it "),
        ("reasoning-delta", "through."),
        ("reasoning-end", None),
    ]
    assert_stream_contract(chunks)


@pytest.mark.parametrize("ending", ["step", "completed"])
def test_a_streamed_reasoning_whose_text_never_came_is_ended(ending: str) -> None:
    """Its LM call failed mid-stream: the step's end (or the Run's) still ends the part."""
    events: list[RunEvent] = [
        IterationStarted(run_id=R, iteration=1),
        ReasoningDelta(run_id=R, part_id="reasoning-1", delta="Think"),
    ]
    events.append(
        IterationFinished(run_id=R, iteration=1)
        if ending == "step"
        else RunCompleted(run_id=R, duration_ms=1)
    )
    state = StreamState(R, SESSION)
    types = [c["type"] for c in run_stream(events, state)]
    assert types[types.index("reasoning-delta") + 1 :][:2] == ["reasoning-end", "finish-step"]
    assert state.open_reasoning == set()


def answer_chunks(chunks: list[Chunk]) -> list[tuple[str, str | None, str | None]]:
    return [(c["type"], c.get("id"), c.get("delta")) for c in chunks if c["type"].startswith("text-")]


def test_a_streamed_answer_opens_on_its_first_delta_and_closes_with_its_tail() -> None:
    """DSPy's extract fallback streams the answer; the settled Answer adds what the deltas did not
    carry and ends the part: one text part, whose deltas add up to the answer."""
    events: list[RunEvent] = [
        RunWarning(run_id=R, code="max_iters", message="extracted"),
        AnswerDelta(run_id=R, part_id="text-answer", delta="\nForty"),
        AnswerDelta(run_id=R, part_id="text-answer", delta="-two"),
        Answer(run_id=R, part_id="text-answer", text="Forty-two.", streamed=True, tail="."),
        RunCompleted(run_id=R, duration_ms=1),
    ]
    chunks = run_stream(events)
    assert answer_chunks(chunks) == [
        ("text-start", "text-answer", None),
        ("text-delta", "text-answer", "\nForty"),
        ("text-delta", "text-answer", "-two"),
        ("text-delta", "text-answer", "."),
        ("text-end", "text-answer", None),
    ]
    assert_stream_contract(chunks)


def test_a_streamed_answer_the_stream_showed_otherwise_is_restated_as_a_part_of_its_own() -> None:
    events: list[RunEvent] = [
        AnswerDelta(run_id=R, part_id="text-answer", delta="A garbled try"),
        Answer(run_id=R, part_id="text-answer", text="The answer.", streamed=True, restated=True),
        RunCompleted(run_id=R, duration_ms=1),
    ]
    chunks = run_stream(events)
    assert answer_chunks(chunks) == [
        ("text-start", "text-answer", None),
        ("text-delta", "text-answer", "A garbled try"),
        ("text-end", "text-answer", None),
        ("text-start", "text-answer-restated", None),
        ("text-delta", "text-answer-restated", "The answer."),
        ("text-end", "text-answer-restated", None),
    ]
    assert_stream_contract(chunks)


def test_a_streamed_answer_read_from_after_its_deltas_comes_whole() -> None:
    """A stream resumed past the deltas never opened the part: the Answer is the whole text."""
    state = StreamState(R, SESSION)
    chunks = project(Answer(run_id=R, part_id="text-answer", text="Whole.", streamed=True, tail="le."), state)
    assert answer_chunks(chunks) == [
        ("text-start", "text-answer", None),
        ("text-delta", "text-answer", "Whole."),
        ("text-end", "text-answer", None),
    ]


@pytest.mark.parametrize("ending", ["completed", "failed"])
def test_a_streamed_answer_whose_text_never_came_is_ended(ending: str) -> None:
    """The Run ended before its Answer (settling failed): its end still ends the part."""
    terminal: RunEvent = (
        RunCompleted(run_id=R, duration_ms=1)
        if ending == "completed"
        else RunFailed(run_id=R, code="x", message="y")
    )
    state = StreamState(R, SESSION)
    chunks = run_stream([AnswerDelta(run_id=R, part_id="text-answer", delta="Half"), terminal], state)
    types = [c["type"] for c in chunks]
    assert types[types.index("text-delta") + 1] == "text-end"
    assert state.open_text == set()
    assert_stream_contract(chunks)


def test_a_cells_code_streams_as_tool_input_deltas_of_partial_json_then_comes_whole() -> None:
    """The deltas of a cell's input are JSON text (the AI SDK's default input encoding), which
    parses, completed, to the code streamed so far; tool-input-available then holds it whole."""
    code_parts = ['print("a', '\\b")\n', "x = 'ü'"]
    events: list[RunEvent] = [
        IterationStarted(run_id=R, iteration=1),
        *(CodeDelta(run_id=R, call_id="cell-1", delta=part) for part in code_parts),
        CodeCell(run_id=R, call_id="cell-1", code="".join(code_parts)),
        CellOutput(run_id=R, call_id="cell-1", stdout="a\\b\n"),
        IterationFinished(run_id=R, iteration=1),
        RunCompleted(run_id=R, duration_ms=1),
    ]
    chunks = run_stream(events)
    tools = [c for c in chunks if c["type"].startswith("tool-")]
    assert [c["type"] for c in tools] == [
        "tool-input-start",
        "tool-input-delta",
        "tool-input-delta",
        "tool-input-delta",
        "tool-input-available",
        "tool-output-available",
    ]
    assert tools[0] == {
        "type": "tool-input-start",
        "toolCallId": "cell-1",
        "toolName": "python",
        "providerExecuted": True,
        "dynamic": True,
    }
    text = "".join(c["inputTextDelta"] for c in tools[1:4])
    assert msgspec.json.decode(text + '"}') == {"code": "".join(code_parts)}
    assert tools[4]["input"] == {"code": "".join(code_parts)}
    assert_stream_contract(chunks)


@pytest.mark.parametrize("ending", ["step", "completed", "failed"])
def test_a_cell_whose_code_never_came_whole_is_closed_in_its_step_or_at_the_runs_end(ending: str) -> None:
    """Its input is the error (no `input`: a client keeps the code it was shown), before the
    step's finish-step (the AI SDK finds the part in the current step only) or the Run's end."""
    endings: dict[str, RunEvent] = {
        "step": IterationFinished(run_id=R, iteration=1),
        "completed": RunCompleted(run_id=R, duration_ms=1),
        "failed": RunFailed(run_id=R, code="lm_error", message="the LM call failed"),
    }
    state = StreamState(R, SESSION)
    events = [
        IterationStarted(run_id=R, iteration=1),
        CodeDelta(run_id=R, call_id="cell-1", delta="print(1)"),
    ]
    chunks = run_stream([*events, endings[ending]], state)
    types = [c["type"] for c in chunks]
    closed = chunks[types.index("tool-input-error")]
    assert closed["toolCallId"] == "cell-1" and "input" not in closed
    assert types.index("tool-input-error") < types.index("finish-step" if ending != "failed" else "error")
    assert state.open_tools == state.input_streaming == set()
    if ending != "step":
        assert_stream_contract(chunks)


def test_a_code_delta_after_the_cells_whole_input_reopens_nothing() -> None:
    state = StreamState(R, SESSION)
    project(CodeDelta(run_id=R, call_id="cell-1", delta="pri"), state)
    project(CodeCell(run_id=R, call_id="cell-1", code="print(1)"), state)
    assert project(CodeDelta(run_id=R, call_id="cell-1", delta="nt(1)"), state) == []


def test_completed_without_open_step_has_no_finish_step() -> None:
    chunks = run_stream([*body(), RunCompleted(run_id=R, duration_ms=1)])
    assert [c["type"] for c in chunks[-2:]] == ["finish-step", "finish"]
    assert [c["type"] for c in chunks].count("finish-step") == 1


def test_iteration_finished_without_open_step_is_silent() -> None:
    state = StreamState(R, SESSION)
    assert project(IterationFinished(run_id=R, iteration=1), state) == []
    assert project(IterationStarted(run_id=R, iteration=1), state) == [{"type": "start-step"}]
    assert project(IterationFinished(run_id=R, iteration=1), state) == [{"type": "finish-step"}]
    assert project(IterationFinished(run_id=R, iteration=1), state) == []


# --- one event at a time -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        pytest.param(
            StatusChanged(run_id=R, phase="preparation", message="starting sandbox"),
            [
                {
                    "type": "data-status",
                    "data": {"phase": "preparation", "status": "started", "message": "starting sandbox"},
                    "transient": True,
                }
            ],
            id="status-with-message",
        ),
        pytest.param(
            StatusChanged(run_id=R, phase="settling", message=""),
            [{"type": "data-status", "data": {"phase": "settling", "status": "started"}, "transient": True}],
            id="status-empty-message-omitted",
        ),
        pytest.param(
            CellOutput(run_id=R, call_id="c", stdout="partial", truncated=True, error="Boom: x"),
            [
                {
                    "type": "tool-output-error",
                    "toolCallId": "c",
                    "errorText": f"partial\n{OUTPUT_CUT_NOTE}\nBoom: x",  # what it printed, first
                    "providerExecuted": True,
                    "dynamic": True,
                }
            ],
            id="cell-error",
        ),
        pytest.param(
            CellOutput(run_id=R, call_id="c", stdout="s" * 3, truncated=True),
            [
                {
                    "type": "tool-output-available",
                    "toolCallId": "c",
                    "output": {"stdout": "sss", "truncated": True},
                    "providerExecuted": True,
                    "dynamic": True,
                }
            ],
            id="cell-truncated",
        ),
        pytest.param(
            LMQueryStarted(run_id=R, call_id="b", tool="llm_query_batched", prompt_count=3),
            [
                {
                    "type": "tool-input-available",
                    "toolCallId": "b",
                    "toolName": "llm_query_batched",
                    "input": {"prompt_count": 3},
                    "providerExecuted": True,
                    "dynamic": True,
                }
            ],
            id="batched-start",
        ),
        pytest.param(
            LMQueryStarted(run_id=R, call_id="q", tool="llm_query"),
            [
                {
                    "type": "tool-input-available",
                    "toolCallId": "q",
                    "toolName": "llm_query",
                    "input": {"prompt": ""},
                    "providerExecuted": True,
                    "dynamic": True,
                }
            ],
            id="query-start-no-prompt",
        ),
        pytest.param(
            LMQueryFinished(run_id=R, call_id="b", texts=["x", "y"], text="ignored"),
            [
                {
                    "type": "tool-output-available",
                    "toolCallId": "b",
                    "output": {"texts": ["x", "y"]},
                    "providerExecuted": True,
                    "dynamic": True,
                }
            ],
            id="batched-finish",
        ),
        pytest.param(
            LMQueryFinished(run_id=R, call_id="q"),
            [
                {
                    "type": "tool-output-available",
                    "toolCallId": "q",
                    "output": {"text": ""},
                    "providerExecuted": True,
                    "dynamic": True,
                }
            ],
            id="query-finish-no-text",
        ),
        pytest.param(
            LMQueryFinished(run_id=R, call_id="q", error="timeout", text="ignored"),
            [
                {
                    "type": "tool-output-error",
                    "toolCallId": "q",
                    "errorText": "timeout",
                    "providerExecuted": True,
                    "dynamic": True,
                }
            ],
            id="query-error-wins",
        ),
        pytest.param(
            RunWarning(run_id=R, code="max_iters", message="ran out"),
            [{"type": "data-warning", "data": {"message": "ran out", "code": "max_iters"}}],
            id="warning",
        ),
    ],
)
def test_single_event(event: RunEvent, expected: list[Chunk]) -> None:
    chunks = project(event, StreamState(R, SESSION))
    assert chunks == expected
    assert find_none(chunks) is None


def test_state_tracks_phase_seq_and_tools() -> None:
    state = StreamState(R, SESSION)
    project(StatusChanged(run_id=R, phase="preparation", seq=4), state)
    assert (state.phase, state.projected_seq) == ("preparation", 4)
    project(CodeCell(run_id=R, call_id="c", code="x", seq=2), state)  # replayed, older seq
    assert state.projected_seq == 4
    assert state.open_tools == {"c"}
    project(CellOutput(run_id=R, call_id="c", stdout="", seq=5), state)
    assert state.open_tools == set()
    assert state.projected_seq == 5
    assert heartbeat_chunk(state) == status_chunk("preparation", "heartbeat")
    assert heartbeat_chunk(state) == {
        "type": "data-status",
        "data": {"phase": "preparation", "status": "heartbeat"},
        "transient": True,
    }
