"""`fold_parts`: Runtime Events → the committed assistant UIMessage parts."""

from __future__ import annotations

from typing import Any

import pytest

from fleet_shared.events import (
    Answer,
    CellOutput,
    CodeCell,
    IterationFinished,
    IterationStarted,
    LMQueryFinished,
    LMQueryStarted,
    LMUsage,
    Reasoning,
    RunCancelled,
    RunCompleted,
    RunEvent,
    RunFailed,
    RunWarning,
    StatusChanged,
    Usage,
)
from fleet_shared.transcript import fold_parts

R = "run_1"


def find_none(value: Any, path: str = "$") -> str | None:
    if value is None:
        return path
    children: Any = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        hit = find_none(child, f"{path}.{key}")
        if hit:
            return hit
    return None


def python_part(call_id: str, code: str, **final: Any) -> dict[str, Any]:
    return {
        "type": "dynamic-tool",
        "toolName": "python",
        "toolCallId": call_id,
        "input": {"code": code},
        **final,
    }


FULL_RUN: list[RunEvent] = [
    StatusChanged(run_id=R, phase="execution"),
    IterationStarted(run_id=R, iteration=1),
    Reasoning(run_id=R, part_id="reasoning-1", text="measure first"),
    CodeCell(run_id=R, call_id="cell-1", code="print(len(request))"),
    CellOutput(run_id=R, call_id="cell-1", stdout="5\n"),
    IterationFinished(run_id=R, iteration=1),
    IterationStarted(run_id=R, iteration=2),
    Reasoning(run_id=R, part_id="reasoning-2", text="ask a sub-LM"),
    CodeCell(run_id=R, call_id="cell-2", code="r = llm_query('hi')\nrs = llm_query_batched(['a','b'])"),
    LMQueryStarted(run_id=R, call_id="llm_query-2-1", tool="llm_query", prompt="hi"),
    LMQueryFinished(run_id=R, call_id="llm_query-2-1", text="hello"),
    LMQueryStarted(run_id=R, call_id="llm_query_batched-2-2", tool="llm_query_batched", prompt_count=2),
    LMQueryFinished(run_id=R, call_id="llm_query_batched-2-2", texts=["A", "B"]),
    CellOutput(run_id=R, call_id="cell-2", stdout="x" * 10, truncated=True),
    IterationFinished(run_id=R, iteration=2),
    IterationStarted(run_id=R, iteration=3),
    CodeCell(run_id=R, call_id="cell-3", code="1/0"),
    LMQueryStarted(run_id=R, call_id="llm_query-3-3", tool="llm_query", prompt="again"),
    LMQueryFinished(run_id=R, call_id="llm_query-3-3", error="rate limited"),
    CellOutput(run_id=R, call_id="cell-3", stdout="partial", error="ZeroDivisionError: division by zero"),
    IterationFinished(run_id=R, iteration=3),
    RunWarning(run_id=R, code="max_iters", message="out of iterations"),
    StatusChanged(run_id=R, phase="settling"),
    Answer(run_id=R, part_id="text-answer", text="hello (5 chars)"),
    Usage(
        run_id=R,
        iterations=3,
        duration_ms=1234,
        observed_lm_usage={"scripted/demo": LMUsage(prompt_tokens=100, completion_tokens=20, calls=3)},
    ),
    RunCompleted(run_id=R, duration_ms=1234, checkpoint_version=2),
]

EXPECTED_PARTS: list[dict[str, Any]] = [
    {"type": "step-start"},
    {"type": "reasoning", "text": "measure first", "state": "done"},
    python_part(
        "cell-1",
        "print(len(request))",
        state="output-available",
        output={"stdout": "5\n", "truncated": False},
    ),
    {"type": "step-start"},
    {"type": "reasoning", "text": "ask a sub-LM", "state": "done"},
    python_part(
        "cell-2",
        "r = llm_query('hi')\nrs = llm_query_batched(['a','b'])",
        state="output-available",
        output={"stdout": "x" * 10, "truncated": True},
    ),
    {
        "type": "dynamic-tool",
        "toolName": "llm_query",
        "toolCallId": "llm_query-2-1",
        "state": "output-available",
        "input": {"prompt": "hi"},
        "output": {"text": "hello"},
    },
    {
        "type": "dynamic-tool",
        "toolName": "llm_query_batched",
        "toolCallId": "llm_query_batched-2-2",
        "state": "output-available",
        "input": {"prompt_count": 2},
        "output": {"texts": ["A", "B"]},
    },
    {"type": "step-start"},
    python_part(
        "cell-3", "1/0", state="output-error", errorText="partial\nZeroDivisionError: division by zero"
    ),
    {
        "type": "dynamic-tool",
        "toolName": "llm_query",
        "toolCallId": "llm_query-3-3",
        "state": "output-error",
        "input": {"prompt": "again"},
        "errorText": "rate limited",
    },
    {"type": "data-warning", "data": {"message": "out of iterations", "code": "max_iters"}},
    {"type": "text", "text": "hello (5 chars)", "state": "done"},
    {
        "type": "data-usage",
        "data": {
            "usage": {
                "iterations": 3,
                "duration_ms": 1234,
                "observed_lm_usage": {
                    "scripted/demo": {"prompt_tokens": 100, "completion_tokens": 20, "calls": 3}
                },
            }
        },
    },
]


def test_full_run_folds_to_the_expected_parts() -> None:
    assert fold_parts(FULL_RUN) == EXPECTED_PARTS


def test_no_part_contains_none() -> None:
    parts = fold_parts(FULL_RUN)
    assert find_none(parts) is None


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param(
            [CodeCell(run_id=R, call_id="c", code="x"), CellOutput(run_id=R, call_id="c", stdout="")],
            [python_part("c", "x", state="output-available", output={"stdout": "", "truncated": False})],
            id="cell-empty-stdout",
        ),
        pytest.param(
            [
                CodeCell(run_id=R, call_id="c", code="x"),
                CellOutput(run_id=R, call_id="c", stdout="", error=""),
            ],
            [python_part("c", "x", state="output-error", errorText="")],
            id="cell-empty-error-is-still-an-error",
        ),
        pytest.param(
            [CodeCell(run_id=R, call_id="c", code="x")],
            [python_part("c", "x", state="input-available")],
            id="cell-without-output",
        ),
        pytest.param(
            [CellOutput(run_id=R, call_id="ghost", stdout="boo")],
            [],
            id="output-for-unknown-call-is-ignored",
        ),
        pytest.param(
            [
                LMQueryStarted(run_id=R, call_id="q", tool="llm_query"),
                LMQueryFinished(run_id=R, call_id="q"),
            ],
            [
                {
                    "type": "dynamic-tool",
                    "toolName": "llm_query",
                    "toolCallId": "q",
                    "state": "output-available",
                    "input": {"prompt": ""},
                    "output": {"text": ""},
                }
            ],
            id="llm-query-without-prompt-or-text",
        ),
        pytest.param(
            [
                LMQueryStarted(run_id=R, call_id="q", tool="rlm_query", prompt="sub task"),
                LMQueryFinished(run_id=R, call_id="q", texts=[]),
            ],
            [
                {
                    "type": "dynamic-tool",
                    "toolName": "rlm_query",
                    "toolCallId": "q",
                    "state": "output-available",
                    "input": {"prompt": "sub task"},
                    "output": {"texts": []},
                }
            ],
            id="rlm-query-empty-batch",
        ),
        pytest.param(
            [Usage(run_id=R, iterations=0, duration_ms=0)],
            [
                {
                    "type": "data-usage",
                    "data": {"usage": {"iterations": 0, "duration_ms": 0, "observed_lm_usage": {}}},
                }
            ],
            id="usage-without-lm-usage",
        ),
        pytest.param(
            [
                StatusChanged(run_id=R, phase="execution", message="go"),
                IterationFinished(run_id=R, iteration=1),
                RunFailed(run_id=R, code="lm_error", message="x"),
                RunCancelled(run_id=R),
                RunCompleted(run_id=R, duration_ms=1),
            ],
            [],
            id="events-without-parts",
        ),
    ],
)
def test_fold_cases(events: list[RunEvent], expected: list[dict[str, Any]]) -> None:
    parts = fold_parts(events)
    assert parts == expected
    assert find_none(parts) is None


def test_tool_part_keeps_its_position_when_settled_later() -> None:
    events: list[RunEvent] = [
        CodeCell(run_id=R, call_id="c", code="x"),
        RunWarning(run_id=R, code="w", message="m"),
        CellOutput(run_id=R, call_id="c", stdout="done"),
    ]
    parts = fold_parts(events)
    assert [p["type"] for p in parts] == ["dynamic-tool", "data-warning"]
    assert parts[0]["state"] == "output-available"


def test_empty() -> None:
    assert fold_parts([]) == []
