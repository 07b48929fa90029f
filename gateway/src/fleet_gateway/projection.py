"""Runtime Event → AI SDK UI message stream chunks. Live, resume and replay all use `project`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, assert_never

import msgspec

from fleet_shared.events import (
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
    Phase,
    Reasoning,
    ReasoningDelta,
    RunCancelled,
    RunCompleted,
    RunEvent,
    RunFailed,
    RunWarning,
    SkillUsed,
    StatusChanged,
    Usage,
    WholeText,
)
from fleet_shared.transcript import UNFINISHED_TOOL_TEXT, data_part, failed_cell_text, lm_query_input

Chunk = dict[str, Any]
UNFINISHED_CODE_TEXT = "the step ended before this cell's code was complete"
Delivery = Literal["live", "replay", "resume"]
SCHEMA_VERSION = 1


@dataclass
class StreamState:
    """What one stream has said so far; enough to close parts and fill `finish` metadata."""

    run_id: str
    session_id: str
    idempotent_replay: bool = False
    phase: Phase = "queued"
    step_open: bool = False
    projected_seq: int = 0  # the last event projected (sent, or skipped as before the cursor)
    finished: bool = False
    open_tools: set[str] = field(default_factory=set)
    open_reasoning: set[str] = field(default_factory=set)  # streamed reasoning parts not yet ended
    open_text: set[str] = field(default_factory=set)  # streamed text parts (the answer) not yet ended
    input_streaming: set[str] = field(default_factory=set)  # open tools whose input is not whole yet


def start_chunk(state: StreamState, *, created_at: str, delivery: Delivery, model: str) -> Chunk:
    return {
        "type": "start",
        "messageId": state.run_id,
        "messageMetadata": {
            "schemaVersion": SCHEMA_VERSION,
            "runId": state.run_id,
            "sessionId": state.session_id,
            "createdAt": created_at,
            "delivery": delivery,
            "model": model,
        },
    }


def status_chunk(phase: Phase, status: str, message: str | None = None) -> Chunk:
    data: dict[str, Any] = {"phase": phase, "status": status}
    if message:
        data["message"] = message
    return {"type": "data-status", "data": data, "transient": True}


def heartbeat_chunk(state: StreamState) -> Chunk:
    return status_chunk(state.phase, "heartbeat")


def project(event: RunEvent, state: StreamState) -> list[Chunk]:
    """The chunks for one event; updates `state`. Terminal events close the stream's parts."""
    state.projected_seq = max(state.projected_seq, event.seq)
    match event:
        case StatusChanged(phase=phase, message=message):
            state.phase = phase
            return [status_chunk(phase, "started", message)]
        case IterationStarted():
            state.step_open = True
            return [{"type": "start-step"}]
        case IterationFinished():
            return close_step(state)
        case ReasoningDelta(part_id=part_id, delta=delta):
            return delta_chunks("reasoning", state.open_reasoning, part_id, delta)
        case Reasoning():
            return whole_chunks("reasoning", state.open_reasoning, event)
        case CodeDelta(call_id=call_id, delta=delta):
            return code_input_delta(state, call_id, delta)
        case CodeCell(call_id=call_id, code=code):
            return [tool_input(state, call_id, "python", {"code": code})]
        case CellOutput(call_id=call_id, stdout=stdout, truncated=truncated, error=str() as error):
            return [tool_error(state, call_id, failed_cell_text(stdout, truncated, error))]
        case CellOutput(call_id=call_id, stdout=stdout, truncated=truncated):
            return [tool_output(state, call_id, {"stdout": stdout, "truncated": truncated})]
        case LMQueryStarted(call_id=call_id, tool=tool):
            return [tool_input(state, call_id, tool, lm_query_input(event))]
        case LMQueryFinished(call_id=call_id, error=str() as error):
            return [tool_error(state, call_id, error)]
        case LMQueryFinished(call_id=call_id, texts=list() as texts):
            return [tool_output(state, call_id, {"texts": texts})]
        case LMQueryFinished(call_id=call_id, text=text):
            return [tool_output(state, call_id, {"text": text or ""})]
        case (
            Usage()
            | RunWarning()
            | AttachmentStaged()
            | ArtifactCreated()
            | SkillUsed()
            | ChildProgress()
            | Approval()
        ):
            return [data_part(event)]
        case AnswerDelta(part_id=part_id, delta=delta):
            return delta_chunks("text", state.open_text, part_id, delta)
        case Answer():
            return whole_chunks("text", state.open_text, event)
        case RunCompleted(duration_ms=duration_ms, checkpoint_version=checkpoint_version):
            state.finished = True
            return [
                *close_tools(state, UNFINISHED_TOOL_TEXT),
                *close_streamed(state),
                *close_step(state),
                {
                    "type": "finish",
                    "finishReason": "stop",
                    "messageMetadata": {
                        "runId": state.run_id,
                        "sessionId": state.session_id,
                        "durationMs": duration_ms,
                        "checkpointVersion": checkpoint_version,
                        "idempotentReplay": state.idempotent_replay,
                    },
                },
            ]
        case RunFailed(code=code, message=message):
            state.finished = True
            return [
                *close_streamed(state),  # an LM call that failed mid-stream
                *close_inputs(state),
                {"type": "error", "errorText": f"{code}: {message}"},
                {"type": "finish", "finishReason": "error"},
            ]
        case RunCancelled(reason=reason):
            state.finished = True
            return [{"type": "abort", "reason": reason}]
        case _:
            assert_never(event)


def tool_input(state: StreamState, call_id: str, name: str, tool_input: dict[str, Any]) -> Chunk:
    state.open_tools.add(call_id)
    state.input_streaming.discard(call_id)
    return {
        "type": "tool-input-available",
        "toolCallId": call_id,
        "toolName": name,
        "input": tool_input,
        "providerExecuted": True,
        "dynamic": True,
    }


def code_input_delta(state: StreamState, call_id: str, delta: str) -> list[Chunk]:
    """A cell's code while the LM writes it: the tool's input as JSON text, `{"code":"` and the
    code escaped, which the AI SDK parses as partial JSON; the cell's tool-input-available then
    holds the input whole."""
    escaped = msgspec.json.encode(delta).decode()[1:-1]
    more = {"type": "tool-input-delta", "toolCallId": call_id, "inputTextDelta": escaped}
    if call_id in state.input_streaming:
        return [more]
    if call_id in state.open_tools:  # its input came whole already: nothing may reopen it
        return []
    state.open_tools.add(call_id)
    state.input_streaming.add(call_id)
    opening = {
        "type": "tool-input-start",
        "toolCallId": call_id,
        "toolName": "python",
        "providerExecuted": True,
        "dynamic": True,
    }
    return [opening, {**more, "inputTextDelta": '{"code":"' + escaped}]


def tool_output(state: StreamState, call_id: str, output: dict[str, Any]) -> Chunk:
    state.open_tools.discard(call_id)
    return {
        "type": "tool-output-available",
        "toolCallId": call_id,
        "output": output,
        "providerExecuted": True,
        "dynamic": True,
    }


def tool_error(state: StreamState, call_id: str, error_text: str) -> Chunk:
    state.open_tools.discard(call_id)
    return {
        "type": "tool-output-error",
        "toolCallId": call_id,
        "errorText": error_text,
        "providerExecuted": True,
        "dynamic": True,
    }


def close_tools(state: StreamState, reason: str) -> list[Chunk]:
    """End the open tools: a call that never returned, or a cell whose code never came whole."""
    closed = close_inputs(state)
    return [*closed, *(tool_error(state, call_id, reason) for call_id in sorted(state.open_tools))]


def close_inputs(state: StreamState) -> list[Chunk]:
    """End the cells whose code never came whole (the step or the Run ended first): their input
    is the error, as the AI SDK has it for an input that could not be completed. No `input`: a
    client keeps the code it was shown."""
    closed = [
        {
            "type": "tool-input-error",
            "toolCallId": call_id,
            "toolName": "python",
            "errorText": UNFINISHED_CODE_TEXT,
            "providerExecuted": True,
            "dynamic": True,
        }
        for call_id in sorted(state.input_streaming)
    ]
    state.open_tools.difference_update(state.input_streaming)
    state.input_streaming.clear()
    return closed


def delta_chunks(kind: str, open_parts: set[str], part_id: str, delta: str) -> list[Chunk]:
    """A streamed part's delta; its first opens the part."""
    opening = [] if part_id in open_parts else [{"type": f"{kind}-start", "id": part_id}]
    open_parts.add(part_id)
    return [*opening, {"type": f"{kind}-delta", "id": part_id, "delta": delta}]


def whole_chunks(kind: str, open_parts: set[str], whole: WholeText) -> list[Chunk]:
    """A part's whole text: it closes the part its deltas opened (with their tail, or ended as
    it was and restated), or, with no part open on this stream, comes as a part of its own."""
    part_id, text = whole.part_id, whole.text
    if not whole.streamed or part_id not in open_parts:
        return whole_part(kind, part_id, text)
    open_parts.discard(part_id)
    end = {"type": f"{kind}-end", "id": part_id}
    if whole.restated:
        return [end, *whole_part(kind, f"{part_id}-restated", text)]
    rest = [{"type": f"{kind}-delta", "id": part_id, "delta": whole.tail}] if whole.tail else []
    return [*rest, end]


def whole_part(kind: str, part_id: str, text: str) -> list[Chunk]:
    return [
        {"type": f"{kind}-start", "id": part_id},
        {"type": f"{kind}-delta", "id": part_id, "delta": text},
        {"type": f"{kind}-end", "id": part_id},
    ]


def close_reasoning(state: StreamState) -> list[Chunk]:
    """End the streamed reasoning parts whose whole text never came (their LM call failed)."""
    ended = [{"type": "reasoning-end", "id": part_id} for part_id in sorted(state.open_reasoning)]
    state.open_reasoning.clear()
    return ended


def close_streamed(state: StreamState) -> list[Chunk]:
    """End every streamed part whose whole text never came: the Run ended first."""
    ended = [{"type": "text-end", "id": part_id} for part_id in sorted(state.open_text)]
    state.open_text.clear()
    return [*close_reasoning(state), *ended]


def close_step(state: StreamState) -> list[Chunk]:
    if not state.step_open:
        return []
    state.step_open = False
    return [*close_reasoning(state), *close_inputs(state), {"type": "finish-step"}]
