"""A Turn's program on DSPy's token stream (`dspy.streamify`, public API; ADR 0038): the root
action's reasoning, and the answer DSPy's extract fallback writes, reach the observer as their
tokens arrive; each part's begin and end ride the same stream as marks, so the reader attributes
every chunk to its own part."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import anyio
import dspy
import structlog

from fleet_worker.observer import TurnObserver

log = structlog.get_logger(__name__)
STREAMED_PROGRAMS = 4096  # DSPy's limiter on streamed programs: high enough never to wait


@dataclass(frozen=True)
class StepStream:
    """A mark on DSPy's stream, sent by the program's thread in order with the step's chunks: its
    begin, or (with `read`, set by the stream's reader when it gets there) its end."""

    part_id: str
    read: threading.Event | None = None


STEP_END_WAIT_SECONDS = 1.0  # a stream reader that lags more: the step's last chunks ride its end


def step_began(part_id: str) -> None:
    """On the program's thread, as a root action (or the extract) starts: its chunks follow."""
    mark_stream(StepStream(part_id))


def step_ended(part_id: str) -> None:
    """On the program's thread, as a root action (or the extract) ends: once the reader has come
    to this mark, it has read all of the part's chunks (waited for at most STEP_END_WAIT_SECONDS)."""
    end = StepStream(part_id, threading.Event())
    if mark_stream(end) and end.read is not None:
        end.read.wait(STEP_END_WAIT_SECONDS)


def mark_stream(mark: StepStream) -> bool:
    """Put a mark on the Turn's stream, if this thread has one (the root program's); whether it
    did."""
    stream = dspy.settings.send_stream
    if stream is None:
        return False
    try:
        anyio.from_thread.run(stream.send, mark)  # as DSPy sends its own chunks
    except Exception as exc:  # the reader is gone: the Turn is ending
        log.debug("stream.mark_lost", error_type=type(exc).__name__)
        return False
    return True


def run_streamed(program: dspy.RLM, observer: TurnObserver, **inputs: Any) -> dspy.Prediction:
    """The program on DSPy's token stream (dspy.streamify): each root action's reasoning, and an
    extracted answer, reach the observer as their tokens arrive. DSPy runs the program on a
    thread of its own and hands the stream to this one; whatever the program raises is raised
    here."""
    observer.unstreamed = unstreamed
    listeners = [
        dspy.streaming.StreamListener("reasoning", predict=program.generate_action, allow_reuse=True),
        dspy.streaming.StreamListener("code", predict=program.generate_action, allow_reuse=True),
        dspy.streaming.StreamListener("answer", predict=program.extract),  # max_iters reached
    ]
    streamed = dspy.streamify(OnStreamedAdapter(program), stream_listeners=listeners, async_streaming=False)
    prediction: dspy.Prediction | None = None
    # DSPy's threads for streamed programs are counted by one process-wide limiter: never the
    # bound on a worker's Turns, which its own program pool is.
    try:
        with dspy.context(async_max_workers=STREAMED_PROGRAMS):
            for item in streamed(**inputs):
                if isinstance(item, dspy.streaming.StreamResponse) and item.signature_field_name == "code":
                    observer.code_delta(item.chunk)
                elif isinstance(item, dspy.streaming.StreamResponse):
                    observer.stream_delta(item.chunk)
                elif isinstance(item, StepStream) and item.read is None:
                    observer.stream_began(item.part_id)
                elif isinstance(item, StepStream) and item.read is not None:
                    observer.stream_ended(item.part_id)
                    item.read.set()
                elif isinstance(item, dspy.Prediction):
                    prediction = item
    except BaseException as exc:
        failed = observer.program_failure
        if failed is not None and failed[0] is exc and exc.__cause__ is None:
            exc.__cause__ = failed[1]  # the stream re-raises the program's error `from None`
        raise
    if prediction is None:
        raise RuntimeError("the program's stream ended without its prediction")
    return prediction


class StreamedAdapter(dspy.ChatAdapter):  # type: ignore[misc]  # dspy has no type hints
    """The ChatAdapter, for calls on the token stream. Once a call's tokens reached the stream
    DSPy neither retries it nor falls back to its JSONAdapter (it cannot take back what was
    shown); this adapter makes such a call once more off the stream, where both apply as usual.
    The step's part then closes with the reasoning parsed from that call (restated)."""

    def __call__(
        self, lm: Any, lm_kwargs: dict[str, Any], signature: Any, demos: list[Any], inputs: dict[str, Any]
    ) -> list[dict[str, Any]]:
        try:
            streamed: list[dict[str, Any]] = super().__call__(lm, lm_kwargs, signature, demos, inputs)
            return streamed
        except AGAIN_OFF_THE_STREAM as exc:
            if dspy.settings.send_stream is None:
                raise
            log.info("stream.call_again_off_the_stream", error_type=type(exc).__name__)
        with unstreamed():
            result: list[dict[str, Any]] = dspy.ChatAdapter()(lm, lm_kwargs, signature, demos, inputs)
            return result


class OnStreamedAdapter(dspy.Module):  # type: ignore[misc]  # dspy has no type hints
    """The program, run with the StreamedAdapter. Only the program's thread uses it: the stream's
    reader must see a ChatAdapter, the only kind (by name) DSPy's StreamListener reads."""

    def __init__(self, program: dspy.RLM) -> None:
        super().__init__()
        self.program = program

    def forward(self, **inputs: Any) -> dspy.Prediction:
        with dspy.context(adapter=StreamedAdapter()):
            return self.program(**inputs)


# A reply DSPy could not parse, and a stream that broke: what DSPy would retry off the stream.
AGAIN_OFF_THE_STREAM = (
    dspy.AdapterParseError,
    dspy.LMTransportError,
    dspy.LMStreamAssemblyError,
    dspy.LMTimeoutError,
)


def unstreamed() -> AbstractContextManager[Any]:
    """A sub-LM call or a child RLM: off the root's token stream."""
    context: AbstractContextManager[Any] = dspy.context(send_stream=None, stream_listeners=[])
    return context
