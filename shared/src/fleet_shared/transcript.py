"""Fold a Run's Runtime Events into the committed assistant UIMessage parts (docs/api.md)."""

from __future__ import annotations

from typing import Any, assert_never

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
)

Part = dict[str, Any]
UNFINISHED_TOOL_TEXT = "the Turn ended before this call returned"
CANCELLED_TEXT = "Turn cancelled"
OUTPUT_CUT_NOTE = "[the rest of the output was cut: rlm.max_output_chars]"


def failed_cell_text(stdout: str, truncated: bool, error: str) -> str:
    """What a failed cell (an exception, a timeout, an interrupt, a crash) tells: what it printed,
    then why it failed. `tool-output-error` has only `errorText`, so this is it, live and committed,
    and the RLM is told the same. The worker keeps the output within the cap (`fit_output`)."""
    if not stdout and not truncated:
        return error
    head = stdout if not stdout or stdout.endswith("\n") else f"{stdout}\n"
    return f"{head}{OUTPUT_CUT_NOTE}\n{error}" if truncated else f"{head}{error}"


def tombstone_parts(usage: Usage | None) -> list[Part]:
    """A cancelled Turn keeps only this: the text `Turn cancelled` and the usage observed."""
    parts: list[Part] = [{"type": "text", "text": CANCELLED_TEXT, "state": "done"}]
    if usage is not None:
        parts.append({"type": "data-usage", "data": {"usage": usage_payload(usage)}})
    return parts


def attachment_part(attachment_id: str, filename: str, byte_size: int) -> Part:
    """An attachment, on the user's Turn (what was sent) and the assistant's (what was staged)."""
    data = {"attachment_id": attachment_id, "filename": filename, "byte_size": byte_size}
    return {"type": "data-attachment", "data": data}


DataEvent = Usage | RunWarning | AttachmentStaged | ArtifactCreated | SkillUsed | ChildProgress | Approval


def data_part(event: DataEvent) -> Part:
    """The `data-*` part of an event: the same in the live stream and the committed Turn."""
    match event:
        case Usage():
            return {"type": "data-usage", "data": {"usage": usage_payload(event)}}
        case RunWarning(code=code, message=message):
            return {"type": "data-warning", "data": {"message": message, "code": code}}
        case AttachmentStaged():
            return attachment_part(event.attachment_id, event.filename, event.byte_size)
        case ArtifactCreated():
            return {
                "type": "data-artifact",
                "data": {
                    "artifact_id": event.artifact_id,
                    "name": event.name,
                    "media_type": event.media_type,
                    "byte_size": event.byte_size,
                    "checksum_sha256": event.checksum_sha256,
                },
            }
        case SkillUsed():
            skill = {"skill_id": event.skill_id, "name": event.name, "version": event.version}
            return {"type": "data-skill", "data": {**skill, "phase": event.phase}}
        case ChildProgress():
            progress: dict[str, Any] = {
                "child_id": event.child_id,
                "task_label": event.task_label,
                "state": event.state,
                "cleanup_state": event.cleanup_state,
            }
            if event.elapsed_ms is not None:
                progress["elapsed_ms"] = event.elapsed_ms
            # The id makes a later report replace the earlier one, in the AI SDK and the transcript.
            return {"type": "data-child-progress", "id": event.child_id, "data": progress}
        case Approval():
            approval: dict[str, Any] = {
                "approval_id": event.approval_id,
                "call_id": event.call_id,
                "code": event.code,
                "reason": event.reason,
                "state": event.state,
                "timeout_seconds": event.timeout_seconds,
            }
            if event.note is not None:
                approval["note"] = event.note
            if event.decided_by is not None:
                approval["decided_by"] = event.decided_by
            return {"type": "data-approval", "id": event.approval_id, "data": approval}


def fold_parts(events: list[RunEvent]) -> list[Part]:
    """The parts of the assistant Turn, in stream order; tool parts carry their final state."""
    parts: list[Part] = []
    tools: dict[str, Part] = {}
    for event in events:
        match event:
            case IterationStarted():
                parts.append({"type": "step-start"})
            case Reasoning(text=text):
                parts.append({"type": "reasoning", "text": text, "state": "done"})
            case CodeCell(call_id=call_id, code=code):
                tools[call_id] = tool_part(call_id, "python", {"code": code})
                parts.append(tools[call_id])
            case CellOutput(call_id=call_id, stdout=stdout, truncated=truncated, error=str() as error):
                settle_tool(tools.get(call_id), error=failed_cell_text(stdout, truncated, error))
            case CellOutput(call_id=call_id, stdout=stdout, truncated=truncated):
                settle_tool(tools.get(call_id), output={"stdout": stdout, "truncated": truncated})
            case LMQueryStarted():
                tools[event.call_id] = tool_part(event.call_id, event.tool, lm_query_input(event))
                parts.append(tools[event.call_id])
            case LMQueryFinished():
                settle_tool(tools.get(event.call_id), **lm_query_result(event))
            case ChildProgress() | Approval():
                replace_data_part(parts, data_part(event))
            case Usage() | RunWarning() | AttachmentStaged() | ArtifactCreated() | SkillUsed():
                parts.append(data_part(event))
            case Answer(text=text):
                parts.append({"type": "text", "text": text, "state": "done"})
            case (
                StatusChanged()
                | ReasoningDelta()  # its step's Reasoning event holds the whole text
                | AnswerDelta()  # the Answer event holds the whole text
                | CodeDelta()  # its CodeCell holds the code the cell ran
                | IterationFinished()
                | RunCompleted()
                | RunFailed()
                | RunCancelled()
            ):
                pass
            case _:
                assert_never(event)
    return parts


def replace_data_part(parts: list[Part], part: Part) -> None:
    """A data part with an id replaces the earlier part of the same type and id, as in the AI SDK."""
    for index, existing in enumerate(parts):
        if existing.get("type") == part["type"] and existing.get("id") == part["id"]:
            parts[index] = part
            return
    parts.append(part)


def tool_part(call_id: str, tool_name: str, tool_input: dict[str, Any]) -> Part:
    return {
        "type": "dynamic-tool",
        "toolName": tool_name,
        "toolCallId": call_id,
        "state": "input-available",
        "input": tool_input,
    }


def settle_tool(part: Part | None, *, output: dict[str, Any] | None = None, error: str | None = None) -> None:
    if part is None:
        return
    if error is not None:
        part.update(state="output-error", errorText=error)
    else:
        part.update(state="output-available", output=output)


def lm_query_input(event: LMQueryStarted) -> dict[str, Any]:
    if event.prompt_count is not None:
        return {"prompt_count": event.prompt_count}
    return {"prompt": event.prompt or ""}


def lm_query_result(event: LMQueryFinished) -> dict[str, Any]:
    if event.error is not None:
        return {"error": event.error}
    if event.texts is not None:
        return {"output": {"texts": event.texts}}
    return {"output": {"text": event.text or ""}}


def usage_payload(event: Usage) -> dict[str, Any]:
    """The `data-usage` part's usage, and the Run's stored usage. A cost that is not known is
    left out, never null (the stream's rule for optional fields)."""
    payload: dict[str, Any] = {
        "iterations": event.iterations,
        "duration_ms": event.duration_ms,
        "observed_lm_usage": {
            model: priced(
                {
                    "prompt_tokens": u.prompt_tokens,
                    "completion_tokens": u.completion_tokens,
                    "calls": u.calls,
                },
                u.cost_usd,
            )
            for model, u in event.observed_lm_usage.items()
        },
    }
    return priced(payload, event.cost_usd)


def priced(entry: dict[str, Any], cost_usd: float | None) -> dict[str, Any]:
    return entry if cost_usd is None else {**entry, "cost_usd": cost_usd}
