"""Reasoning deltas are batched: a step's first chunk goes at once, then at most DELTA_CHUNKS
chunks or (while chunks keep coming) DELTA_SECONDS per event; chunks belong to the step whose
begin came before them, and none is sent after its step's end."""

from __future__ import annotations

import time

import pytest

from fleet_worker.streamed_parts import DELTA_CHUNKS, DELTA_SECONDS, StreamedCode, StreamedParts


def test_a_fast_stream_is_cut_every_delta_chunks_and_its_first_chunk_goes_at_once() -> None:
    sent: list[tuple[str, str]] = []

    def send(part: str, delta: str) -> None:
        sent.append((part, delta))

    stream = StreamedParts()
    stream.begin("reasoning-1", send)
    for n in range(3 * DELTA_CHUNKS):
        stream.add(f"{n} ", send)
    assert sent[0] == ("reasoning-1", "0 ")  # the first token waits for nothing
    assert len(sent) == 3 and all(len(delta.split()) <= DELTA_CHUNKS for _, delta in sent)
    whole = stream.end("reasoning-1", send)
    assert whole == "".join(f"{n} " for n in range(3 * DELTA_CHUNKS)) == "".join(d for _, d in sent)


def test_a_slow_stream_sends_what_arrived_every_delta_seconds() -> None:
    sent: list[str] = []
    stream = StreamedParts()
    stream.begin("reasoning-1", lambda _part, delta: sent.append(delta))
    started = time.monotonic()
    while time.monotonic() - started < 6 * DELTA_SECONDS:
        stream.add("x", lambda _part, delta: sent.append(delta))
        time.sleep(DELTA_SECONDS / 10)
    assert 4 <= len(sent) <= 8  # about one event per DELTA_SECONDS, not one per chunk
    assert all(len(delta) < DELTA_CHUNKS for delta in sent)


def test_chunks_go_to_the_open_step_and_none_after_its_end() -> None:
    sent: list[tuple[str, str]] = []

    def send(part: str, delta: str) -> None:
        sent.append((part, delta))

    stream = StreamedParts()
    stream.add("before any step", send)  # no step open: not sent
    stream.begin("reasoning-1", send)
    stream.add("a", send)
    stream.add("b", send)  # held: within DELTA_SECONDS of the first
    assert stream.end("reasoning-1", send) == "ab"  # the end sends what was held
    stream.add("late", send)  # after its end, before the next begin: dropped
    stream.begin("reasoning-2", send)
    stream.add("c", send)
    assert sent == [("reasoning-1", "a"), ("reasoning-1", "b"), ("reasoning-2", "c")]
    assert stream.end("reasoning-3", send) is None  # a step that never streamed


def test_the_whole_reasoning_closes_the_part_with_what_the_deltas_did_not_carry() -> None:
    import threading
    from types import SimpleNamespace

    from fleet_shared.events import Reasoning, ReasoningDelta
    from fleet_worker.observer import TurnObserver

    events: list[object] = []
    observer = TurnObserver(emit=events.append, run_id="r", stop=threading.Event(), max_output_chars=1000)
    observer.action_started("call-1")
    observer.stream_began(observer.reasoning_part)
    observer.stream_delta("\nThink it ")  # the field's leading newline, as a stream carries it
    observer.action_finished("call-1", SimpleNamespace(reasoning="Think it through."))
    deltas = [e.delta for e in events if isinstance(e, ReasoningDelta)]
    whole = [e for e in events if isinstance(e, Reasoning)]
    assert deltas == ["\nThink it "]
    assert len(whole) == 1 and whole[0].streamed and whole[0].tail == "through."
    assert whole[0].text == "Think it through."  # what the history keeps


def test_a_reader_that_comes_to_a_step_after_its_end_sends_nothing_of_it() -> None:
    sent: list[tuple[str, str]] = []
    stream = StreamedParts()
    assert stream.end("reasoning-1", lambda p, d: sent.append((p, d))) is None  # its text came whole
    stream.begin("reasoning-1", lambda p, d: sent.append((p, d)))
    stream.add("late", lambda p, d: sent.append((p, d)))
    assert sent == []


def test_deltas_stop_at_the_turns_budget() -> None:
    sent: list[str] = []
    stream = StreamedParts(budget=2)
    for part in ("reasoning-1", "reasoning-2", "reasoning-3"):
        stream.begin(part, lambda _p, d: sent.append(d))
        stream.add(part, lambda _p, d: sent.append(d))
        stream.end(part, lambda _p, d: sent.append(d))
    assert sent == ["reasoning-1", "reasoning-2"]  # the third step's text comes whole at its end
    assert stream.end("reasoning-3", lambda _p, _d: None) is None


def test_a_reasoning_the_stream_did_not_show_is_restated() -> None:
    import threading
    from types import SimpleNamespace

    from fleet_shared.events import Reasoning
    from fleet_worker.observer import TurnObserver

    events: list[object] = []
    observer = TurnObserver(emit=events.append, run_id="r", stop=threading.Event(), max_output_chars=1000)
    observer.action_started("call-1")
    observer.stream_began(observer.reasoning_part)
    observer.stream_delta("a garbled first attempt")
    observer.action_finished("call-1", SimpleNamespace(reasoning="Think again."))
    whole = [e for e in events if isinstance(e, Reasoning)]
    assert len(whole) == 1 and whole[0].restated and whole[0].text == "Think again."


def test_an_extracted_answer_streams_as_answer_deltas_no_longer_than_the_answer_kept() -> None:
    """The answer's deltas stop at rlm.max_answer_chars, so what a client saw is always the start
    of the answer the Turn keeps; the settled Answer closes the part with the rest."""
    import threading

    from fleet_shared.events import Answer, AnswerDelta, RunWarning
    from fleet_shared.run_state import RunCommand
    from fleet_worker.observer import TurnObserver
    from fleet_worker.outcome import Outcome, answer_event
    from fleet_worker.streamed_parts import ANSWER_PART

    events: list[object] = []
    observer = TurnObserver(
        emit=events.append,
        run_id="r",
        stop=threading.Event(),
        max_output_chars=1000,
        streaming=StreamedParts(max_chars={ANSWER_PART: 12}),
    )
    observer.stream_began(ANSWER_PART)
    for token in ("\n", "The answer ", "is forty-two, ", "as computed."):
        observer.stream_delta(token)
    observer.stream_ended(ANSWER_PART)
    deltas = [e.delta for e in events if isinstance(e, AnswerDelta)]
    assert "".join(deltas) == "\nThe answer " and observer.streamed_answer == "\nThe answer "
    full = "The answer is forty-two, as computed."
    outcome = Outcome(RunCommand.COMPLETE, "completed", answer=full, streamed_answer=observer.streamed_answer)
    answer = answer_event(12, events.append, "r", outcome)
    assert isinstance(answer, Answer) and answer.part_id == ANSWER_PART
    assert (answer.text, answer.streamed, answer.tail, answer.restated) == ("The answer i", True, "i", False)
    assert any(isinstance(e, RunWarning) and e.code == "answer_truncated" for e in events)


def test_an_answer_that_did_not_stream_comes_whole() -> None:
    from fleet_shared.run_state import RunCommand
    from fleet_worker.outcome import Outcome, answer_event

    answer = answer_event(100, lambda _e: None, "r", Outcome(RunCommand.COMPLETE, "completed", answer="hi"))
    assert (answer.text, answer.streamed, answer.tail) == ("hi", False, "")


FENCED = "```python\nn = len(request.split())\nprint(f'{n} words')\n```\n"


@pytest.mark.parametrize("raw", [FENCED, "\n" + FENCED, "n = len(request.split())\nprint(f'{n} words')\n"])
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_the_code_shown_grows_with_the_stream_and_never_shows_its_fence(raw: str, size: int) -> None:
    """Fed in chunks of any size, the field shows a growing prefix of the code, and the whole
    field shows the code: no fence line, no closing fence, no backtick that may become one, and
    nothing of what follows the fence."""
    code = "n = len(request.split())\nprint(f'{n} words')\n"
    streamed = StreamedCode("cell-1")
    shown = ""
    for start in range(0, len(raw), size):
        shown += streamed.feed(raw[start : start + size])
        assert code.startswith(shown) and "`" not in shown
    shown += streamed.feed("trailing words after the fence")
    assert shown == code if "```" in raw else shown.startswith(code)


def test_backticks_inside_the_code_are_shown_once_the_next_character_is_not_one() -> None:
    streamed = StreamedCode("cell-1")
    parts = [streamed.feed(chunk) for chunk in ("x = '``", "'\n", "```")]
    assert parts == ["x = '", "``'\n", ""] and streamed.closed


def test_a_steps_code_streams_as_its_cells_deltas_between_the_steps_marks() -> None:
    import threading

    from fleet_shared.events import CodeDelta
    from fleet_worker.observer import TurnObserver

    events: list[object] = []
    observer = TurnObserver(emit=events.append, run_id="r", stop=threading.Event(), max_output_chars=1000)
    observer.code_delta("print(0)")  # no step open: not shown
    observer.action_started("call-1")
    observer.stream_began(observer.reasoning_part)
    observer.stream_delta("Count.")
    for chunk in ("```py", "thon\nprint(", "1)\n``", "`\n"):
        observer.code_delta(chunk)
    observer.stream_ended(observer.reasoning_part)
    observer.code_delta("print(2)")  # after the step's end: dropped
    deltas = [(type(e).__name__, getattr(e, "call_id", None), e.delta) for e in events if hasattr(e, "delta")]
    assert deltas == [
        ("ReasoningDelta", None, "Count."),
        ("CodeDelta", "cell-1", "print("),  # the code's first chunk goes at once
        ("CodeDelta", "cell-1", "1)\n"),  # held, then sent at the step's end
    ]
    assert not any(isinstance(e, CodeDelta) and "`" in e.delta for e in events)


def test_a_cell_that_streamed_but_never_ran_ends_as_shown_with_an_error_at_its_steps_end() -> None:
    """DSPy could not take the step's code as a cell (no cell started): the next step's start
    ends it, as shown, so the stream's tool part and the history's agree."""
    import threading
    from types import SimpleNamespace

    from fleet_shared.events import CellOutput, CodeCell, IterationFinished
    from fleet_worker.observer import UNRUN_CELL_TEXT, TurnObserver

    events: list[object] = []
    observer = TurnObserver(emit=events.append, run_id="r", stop=threading.Event(), max_output_chars=1000)
    observer.action_started("call-1")
    observer.stream_began(observer.reasoning_part)
    observer.code_delta("```bash\nrm -rf x\n```")
    observer.stream_ended(observer.reasoning_part)
    observer.action_finished("call-1", SimpleNamespace(reasoning="Try bash."))
    observer.action_started("call-2")  # no cell ran for step 1
    cell = [e for e in events if isinstance(e, CodeCell | CellOutput)]
    assert [type(e).__name__ for e in cell] == ["CodeCell", "CellOutput"]
    assert cell[0].code == "rm -rf x\n" and cell[0].call_id == cell[1].call_id == "cell-1"
    assert cell[1].error == UNRUN_CELL_TEXT
    ended = next(i for i, e in enumerate(events) if isinstance(e, IterationFinished))
    assert events.index(cell[1]) < ended  # within its step
