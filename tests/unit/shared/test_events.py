"""Runtime Events: every union member round-trips, None is never on the wire, seq is monotonic."""

from __future__ import annotations

import json
import typing
from typing import Any

import msgspec
import pytest

from fleet_shared.events import (
    TERMINAL_EVENT_TYPES,
    Answer,
    AnswerDelta,
    Approval,
    ArtifactCreated,
    AttachmentStaged,
    CellOutput,
    ChildProgress,
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
    Sequencer,
    SkillUsed,
    StatusChanged,
    Usage,
    decode_event,
    encode_event,
    ends_run,
    event_type,
)

RUN = "run_01"

# Per-type samples: the minimal form (defaults only) and a form with every optional field set.
MINIMAL: dict[type, dict[str, Any]] = {
    StatusChanged: {"phase": "execution"},
    IterationStarted: {"iteration": 1},
    IterationFinished: {"iteration": 1},
    Reasoning: {"part_id": "reasoning-1", "text": "let me think"},
    ReasoningDelta: {"part_id": "reasoning-1", "delta": "let me"},
    CodeDelta: {"call_id": "cell-1", "delta": "print("},
    CodeCell: {"call_id": "cell-1", "code": "print(1)"},
    CellOutput: {"call_id": "cell-1", "stdout": "1\n"},
    LMQueryStarted: {"call_id": "llm_query-1-1", "tool": "llm_query"},
    LMQueryFinished: {"call_id": "llm_query-1-1"},
    RunWarning: {"code": "max_iters", "message": "ran out of iterations"},
    Usage: {"iterations": 2, "duration_ms": 1500},
    AttachmentStaged: {"attachment_id": "a-1", "filename": "notes.txt", "byte_size": 12},
    ArtifactCreated: {
        "artifact_id": "f-1",
        "name": "report.csv",
        "media_type": "text/csv",
        "byte_size": 3,
        "checksum_sha256": "ab" * 32,
    },
    SkillUsed: {"skill_id": "csv-analysis", "name": "CSV analysis", "version": "1", "phase": "activated"},
    ChildProgress: {"child_id": "child-1", "task_label": "t", "state": "started", "cleanup_state": "pending"},
    Approval: {
        "approval_id": "a1",
        "call_id": "cell-1",
        "code": "print(1)",
        "reason": "every cell of this Turn waits for approval",
        "state": "pending",
        "timeout_seconds": 300.0,
    },
    AnswerDelta: {"part_id": "text-answer", "delta": "hel"},
    Answer: {"part_id": "text-answer", "text": "hello"},
    RunCompleted: {"duration_ms": 1500},
    RunFailed: {"code": "lm_error", "message": "the LM said no"},
    RunCancelled: {},
}
FULL: dict[type, dict[str, Any]] = {
    StatusChanged: {"phase": "preparation", "message": "starting the sandbox"},
    IterationStarted: {"iteration": 3},
    IterationFinished: {"iteration": 3},
    Reasoning: {
        "part_id": "reasoning-3",
        "text": "ünïcödé ✓",
        "streamed": True,
        "tail": " ✓",
        "restated": True,
    },
    ReasoningDelta: {"part_id": "reasoning-3", "delta": "ünïcödé"},
    CodeDelta: {"call_id": "cell-3", "delta": "x = 'ü'\n"},
    CodeCell: {"call_id": "cell-3", "code": "x = 1\nprint(x)"},
    CellOutput: {"call_id": "cell-3", "stdout": "", "truncated": True, "error": "NameError: y"},
    LMQueryStarted: {"call_id": "b-1", "tool": "llm_query_batched", "prompt": "p", "prompt_count": 2},
    LMQueryFinished: {"call_id": "b-1", "text": "t", "texts": ["a", "b"], "error": "boom"},
    RunWarning: {"code": "w", "message": "m"},
    Usage: {
        "iterations": 2,
        "duration_ms": 1500,
        "observed_lm_usage": {"openai/gpt-4o-mini": LMUsage(prompt_tokens=10, completion_tokens=3)},
    },
    AttachmentStaged: {"attachment_id": "a-1", "filename": "ünï.txt", "byte_size": 12},
    ArtifactCreated: {
        "artifact_id": "f-1",
        "name": "deep/dir/r.csv",
        "media_type": "text/csv",
        "byte_size": 3,
        "checksum_sha256": "ab" * 32,
    },
    SkillUsed: {"skill_id": "csv-analysis", "name": "CSV analysis", "version": "2", "phase": "loaded"},
    ChildProgress: {
        "child_id": "child-2",
        "task_label": "count the words",
        "state": "completed",
        "cleanup_state": "released",
        "elapsed_ms": 812,
    },
    Approval: {
        "approval_id": "a1",
        "call_id": "cell-1",
        "code": "import subprocess",
        "reason": "it starts processes (subprocess)",
        "state": "denied",
        "timeout_seconds": 300.0,
        "note": "not that",
        "decided_by": "alice",
    },
    AnswerDelta: {"part_id": "text-answer", "delta": "dö"},
    Answer: {"part_id": "text-answer", "text": "dö it", "streamed": True, "tail": " it", "restated": True},
    RunCompleted: {"duration_ms": 1500, "checkpoint_version": 4},
    RunFailed: {"code": "turn_timeout", "message": "too slow"},
    RunCancelled: {"reason": "user pressed stop"},
}
TAGS: dict[type, str] = {
    SkillUsed: "skill",
    ChildProgress: "child.progress",
    Approval: "approval",
    StatusChanged: "run.status",
    IterationStarted: "iteration.started",
    IterationFinished: "iteration.finished",
    Reasoning: "reasoning",
    ReasoningDelta: "reasoning.delta",
    CodeDelta: "cell.code.delta",
    CodeCell: "cell.code",
    CellOutput: "cell.output",
    LMQueryStarted: "lm_query.started",
    LMQueryFinished: "lm_query.finished",
    RunWarning: "warning",
    Usage: "usage",
    AttachmentStaged: "attachment.staged",
    ArtifactCreated: "artifact.created",
    AnswerDelta: "answer.delta",
    Answer: "answer",
    RunCompleted: "run.completed",
    RunFailed: "run.failed",
    RunCancelled: "run.cancelled",
}
VARIANTS: tuple[type, ...] = typing.get_args(RunEvent)
TERMINAL = {RunCompleted, RunFailed, RunCancelled}


def build(cls: type, sample: dict[str, Any], seq: int = 0) -> RunEvent:
    event: RunEvent = cls(run_id=RUN, seq=seq, **sample)
    return event


def find_none(value: Any, path: str = "$") -> str | None:
    if value is None:
        return path
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, child in items:
        hit = find_none(child, f"{path}.{key}")
        if hit:
            return hit
    return None


def test_every_union_member_has_samples() -> None:
    assert len(VARIANTS) == len(set(VARIANTS)) >= 14
    for table in (MINIMAL, FULL, TAGS):
        assert set(table) == set(VARIANTS), "a RunEvent variant has no test sample"


@pytest.mark.parametrize("cls", VARIANTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("samples", [MINIMAL, FULL], ids=["minimal", "full"])
def test_round_trip(cls: type, samples: dict[type, dict[str, Any]]) -> None:
    event = build(cls, samples[cls], seq=7)
    data = encode_event(event)
    decoded = decode_event(data)
    assert type(decoded) is cls
    assert decoded == event
    assert decode_event(data.decode()) == event
    wire = json.loads(data)
    assert wire["type"] == TAGS[cls] == event_type(event)
    assert wire["run_id"] == RUN
    assert wire["seq"] == 7


@pytest.mark.parametrize("cls", VARIANTS, ids=lambda c: c.__name__)
def test_optional_fields_are_omitted_not_null(cls: type) -> None:
    event = build(cls, MINIMAL[cls])
    wire = json.loads(encode_event(event))
    assert find_none(wire) is None
    assert set(wire) == {"type", "run_id", *MINIMAL[cls]}, "defaults (incl. seq=0) must be omitted"


@pytest.mark.parametrize(
    ("event", "absent"),
    [
        (StatusChanged(run_id=RUN, phase="queued", message=None), "message"),
        (CellOutput(run_id=RUN, call_id="c", stdout="", error=None), "error"),
        (LMQueryStarted(run_id=RUN, call_id="c", tool="llm_query", prompt=None), "prompt"),
        (LMQueryFinished(run_id=RUN, call_id="c", text=None, texts=None), "texts"),
    ],
)
def test_explicit_none_is_omitted(event: RunEvent, absent: str) -> None:
    wire = json.loads(encode_event(event))
    assert absent not in wire
    assert "null" not in encode_event(event).decode()


@pytest.mark.parametrize(
    "data",
    [
        b'{"type":"nope","run_id":"r"}',
        b'{"run_id":"r","iteration":1}',
        b'{"type":"iteration.started","run_id":"r"}',
        b'{"type":"iteration.started","run_id":"r","iteration":"one"}',
        b'{"type":"lm_query.started","run_id":"r","call_id":"c","tool":"shell"}',
        b'{"type":"run.status","run_id":"r","phase":"dancing"}',
        b"not json",
    ],
    ids=["unknown-tag", "no-tag", "missing-field", "wrong-type", "bad-tool", "bad-phase", "garbage"],
)
def test_decode_rejects_malformed(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_event(data)


@pytest.mark.parametrize("cls", VARIANTS, ids=lambda c: c.__name__)
def test_is_terminal(cls: type) -> None:
    assert ends_run(build(cls, MINIMAL[cls])) is (cls in TERMINAL)
    assert (cls in TERMINAL_EVENT_TYPES) is (cls in TERMINAL)


def test_events_are_frozen() -> None:
    event = build(Answer, MINIMAL[Answer])
    with pytest.raises(AttributeError):
        event.text = "changed"  # type: ignore[misc]


# --- Sequencer ----------------------------------------------------------------------------------


def test_sequencer_assigns_1_2_3_and_its_run_id() -> None:
    sequencer = Sequencer("run_real")
    non_terminal = [cls for cls in VARIANTS if cls not in TERMINAL]
    stamped = [sequencer.stamp(build(cls, MINIMAL[cls])) for cls in non_terminal]
    assert [e.seq for e in stamped] == list(range(1, len(non_terminal) + 1))
    assert {e.run_id for e in stamped} == {"run_real"}
    assert sequencer.last_seq == len(non_terminal)
    assert sequencer.closed is False


def test_sequencer_does_not_mutate_the_input() -> None:
    event = build(Reasoning, MINIMAL[Reasoning])
    stamped = Sequencer("run_x").stamp(event)
    assert (event.seq, event.run_id) == (0, RUN)
    assert (stamped.seq, stamped.run_id) == (1, "run_x")


def test_sequencer_continues_after_start_after() -> None:
    sequencer = Sequencer(RUN, start_after=41)
    assert sequencer.stamp(build(Answer, MINIMAL[Answer])).seq == 42
    assert sequencer.stamp(build(Answer, MINIMAL[Answer])).seq == 43


@pytest.mark.parametrize("terminal", sorted(TERMINAL, key=lambda c: c.__name__), ids=lambda c: c.__name__)
@pytest.mark.parametrize("after", VARIANTS, ids=lambda c: c.__name__)
def test_sequencer_refuses_anything_after_a_terminal_event(terminal: type, after: type) -> None:
    sequencer = Sequencer(RUN)
    sequencer.stamp(build(IterationStarted, MINIMAL[IterationStarted]))
    assert sequencer.stamp(build(terminal, MINIMAL[terminal])).seq == 2
    assert sequencer.closed is True
    with pytest.raises(RuntimeError, match="already emitted its terminal event"):
        sequencer.stamp(build(after, MINIMAL[after]))
    assert sequencer.last_seq == 2
