"""Runtime Events: the one tagged union the worker publishes and the gateway projects."""

from __future__ import annotations

from typing import Literal

import msgspec

Phase = Literal["queued", "preparation", "execution", "settling"]


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True):
    """Base of every Runtime Event. `seq` is assigned by the worker's Sequencer, from 1."""

    run_id: str
    seq: int = 0


class StatusChanged(Event, tag="run.status"):
    phase: Phase
    message: str | None = None


class IterationStarted(Event, tag="iteration.started"):
    iteration: int


class IterationFinished(Event, tag="iteration.finished"):
    iteration: int


class WholeText(Event):
    """A text part, whole. `streamed`: its delta events already carried the text to the stream
    but for `tail`, which this event adds before it closes the part; `restated`: what they
    carried is not the start of `text`, which follows as a part of its own. The committed Turn
    keeps `text`."""

    part_id: str
    text: str
    streamed: bool = False
    tail: str = ""
    restated: bool = False


class Reasoning(WholeText, tag="reasoning"):
    """A step's reasoning (its deltas: ReasoningDelta)."""


class ReasoningDelta(Event, tag="reasoning.delta"):
    """Reasoning text of a step while its LM call is still in flight: several tokens at a time
    (fleet_worker.streamed_parts, DELTA_SECONDS and DELTA_CHUNKS bound each event)."""

    part_id: str
    delta: str


class CodeDelta(Event, tag="cell.code.delta"):
    """A step's code while its LM call is still in flight, batched as ReasoningDelta (its
    markdown fence left out). The CodeCell that follows holds what the cell runs, whole."""

    call_id: str
    delta: str


class CodeCell(Event, tag="cell.code"):
    call_id: str
    code: str


class CellOutput(Event, tag="cell.output"):
    call_id: str
    stdout: str
    truncated: bool = False
    error: str | None = None


class LMQueryStarted(Event, tag="lm_query.started"):
    """An `llm_query` / `llm_query_batched` / `rlm_query` call from the REPL."""

    call_id: str
    tool: Literal["llm_query", "llm_query_batched", "rlm_query"]
    prompt: str | None = None
    prompt_count: int | None = None


class LMQueryFinished(Event, tag="lm_query.finished"):
    call_id: str
    text: str | None = None
    texts: list[str] | None = None
    error: str | None = None


class RunWarning(Event, tag="warning"):
    """Something a Run left undone or cut short, streamed as a `data-warning` part."""

    code: str
    message: str


class LMUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0  # LM calls that reported usage (an older worker's events say 0)
    cost_usd: float | None = None  # None: the model has no known price (fleet_worker.prices)


class Usage(Event, tag="usage"):
    iterations: int
    duration_ms: int
    observed_lm_usage: dict[str, LMUsage] = {}
    cost_usd: float | None = None  # the priced models' sum; None when none has a price


class AttachmentStaged(Event, tag="attachment.staged"):
    """An uploaded file was copied into the workspace's `attachments/` for this Turn."""

    attachment_id: str
    filename: str
    byte_size: int


class ArtifactCreated(Event, tag="artifact.created"):
    """A file the Run wrote under `artifacts/`, stored at settlement (before the terminal)."""

    artifact_id: str
    name: str
    media_type: str
    byte_size: int
    checksum_sha256: str


class SkillUsed(Event, tag="skill"):
    """A skill the Turn selected: `activated` when the Run takes it up, `loaded` once its card is
    in the workspace's `skills/` and given to the RLM."""

    skill_id: str
    name: str
    version: str
    phase: Literal["activated", "loaded"]


ChildState = Literal["started", "completed", "failed", "cancelled"]
CleanupState = Literal["pending", "released", "failed"]


class ChildProgress(Event, tag="child.progress"):
    """One `rlm_query` child RLM's life: each report replaces the last for the same `child_id`;
    the child's sandbox cleanup is always reported, even when the parent was stopped."""

    child_id: str
    task_label: str
    state: ChildState
    cleanup_state: CleanupState
    elapsed_ms: int | None = None


# `stopped`: the Turn ended (cancelled, timed out, its lease lost) while the cell waited.
ApprovalState = Literal["pending", "approved", "denied", "timed_out", "stopped"]


class Approval(Event, tag="approval"):
    """A cell that waits for a person's decision before it runs (`approval: always | on_risk`):
    `pending` with its code and why, then how it was decided; each report replaces the last for
    the same `approval_id`. A denied or timed-out cell does not run; the RLM is told why."""

    approval_id: str
    call_id: str
    code: str
    reason: str
    state: ApprovalState
    timeout_seconds: float
    note: str | None = None  # the decider's note (approve or deny)
    decided_by: str | None = None  # the user who decided


class AnswerDelta(Event, tag="answer.delta"):
    """Answer text while the LM writing it is still in flight (DSPy's extract fallback, the one
    place an RLM's LM writes its answer itself), batched as ReasoningDelta."""

    part_id: str
    delta: str


class Answer(WholeText, tag="answer"):
    """The Turn's answer, within rlm.max_answer_chars (its deltas, if any: AnswerDelta)."""


class RunCompleted(Event, tag="run.completed"):
    duration_ms: int
    checkpoint_version: int = 0


class RunFailed(Event, tag="run.failed"):
    code: str
    message: str


class RunCancelled(Event, tag="run.cancelled"):
    reason: str = "Turn cancelled"


RunEvent = (
    StatusChanged
    | IterationStarted
    | IterationFinished
    | Reasoning
    | ReasoningDelta
    | CodeDelta
    | CodeCell
    | CellOutput
    | LMQueryStarted
    | LMQueryFinished
    | RunWarning
    | Usage
    | AttachmentStaged
    | ArtifactCreated
    | SkillUsed
    | ChildProgress
    | Approval
    | AnswerDelta
    | Answer
    | RunCompleted
    | RunFailed
    | RunCancelled
)
TERMINAL_EVENT_TYPES = (RunCompleted, RunFailed, RunCancelled)

EVENT_ENCODER = msgspec.json.Encoder()
EVENT_DECODER: msgspec.json.Decoder[RunEvent] = msgspec.json.Decoder(RunEvent)


def encode_event(event: RunEvent) -> bytes:
    return EVENT_ENCODER.encode(event)


def decode_event(data: bytes | str) -> RunEvent:
    return EVENT_DECODER.decode(data)


def ends_run(event: RunEvent) -> bool:
    return isinstance(event, TERMINAL_EVENT_TYPES)


def event_type(event: RunEvent) -> str:
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


class Sequencer:
    """The only code that assigns `seq`: strictly increasing, and closed after a terminal event."""

    def __init__(self, run_id: str, start_after: int = 0) -> None:
        self.run_id = run_id
        self.last_seq = start_after
        self.closed = False

    def stamp(self, event: RunEvent) -> RunEvent:
        if self.closed:
            raise RuntimeError(f"run {self.run_id} already emitted its terminal event")
        self.last_seq += 1
        if ends_run(event):
            self.closed = True
        return msgspec.structs.replace(event, run_id=self.run_id, seq=self.last_seq)
