"""Frames shared by the streams of one Run: a caught-up stream takes the bytes the first stream
computed for the same event object, and gets exactly what it would have computed itself; a
stream in another state, or resumed inside the event, computes its own."""

from __future__ import annotations

from fleet_gateway.frames import Position
from fleet_gateway.projection import StreamState
from fleet_gateway.streaming import Cursor, emit, emit_live
from fleet_shared.events import (
    Answer,
    CellOutput,
    CodeCell,
    IterationFinished,
    IterationStarted,
    Reasoning,
    RunCompleted,
    RunEvent,
    StatusChanged,
)

RUN = "run-1"


def events() -> list[RunEvent]:
    return [
        StatusChanged(run_id=RUN, seq=1, phase="execution"),
        IterationStarted(run_id=RUN, seq=2, iteration=1),
        Reasoning(run_id=RUN, seq=3, part_id="r1", text="think"),
        CodeCell(run_id=RUN, seq=4, call_id="c1", code="print(1)"),
        CellOutput(run_id=RUN, seq=5, call_id="c1", stdout="1\n"),
        CodeCell(run_id=RUN, seq=6, call_id="c2", code="while True: pass"),
        Answer(run_id=RUN, seq=7, part_id="text-answer", text="one"),
        IterationFinished(run_id=RUN, seq=8, iteration=1),
        RunCompleted(run_id=RUN, seq=9, duration_ms=5),
    ]


def stream() -> tuple[StreamState, Cursor]:
    return StreamState(RUN, "session-1"), Cursor()


def test_caught_up_streams_share_the_bytes_and_match_their_own_projection() -> None:
    (a_state, a_cursor), (b_state, b_cursor), (own_state, own_cursor) = stream(), stream(), stream()
    for event in events():
        first = emit_live(event, a_state, a_cursor)
        second = emit_live(event, b_state, b_cursor)
        own = b"".join(emit([event], own_state, own_cursor))
        assert second is first  # taken, not computed again
        assert first == own
        assert b_state == a_state == own_state and b_cursor == a_cursor == own_cursor
    assert own_state.finished and b"c2" in own  # the terminal closed the cell left open


def test_a_stream_in_another_state_computes_its_own_frames() -> None:
    (a_state, a_cursor), (late_state, late_cursor) = stream(), stream()
    for event in events()[:8]:
        emit_live(event, a_state, a_cursor)
    late_state.projected_seq, late_cursor.position = 8, Position(8, 0)  # joined with no open cell
    terminal = events()[8]
    shared = emit_live(terminal, a_state, a_cursor)
    alone = emit_live(terminal, late_state, late_cursor)
    assert b"c2" in shared and b"c2" not in alone
    assert late_state.finished and late_cursor.position == Position(9, 0)


def test_a_stream_resumed_inside_an_event_gets_only_the_rest_and_leaves_the_share_intact() -> None:
    (a_state, a_cursor), (resumed_state, resumed_cursor), (b_state, b_cursor) = stream(), stream(), stream()
    reasoning = events()[2]
    for state, cursor in ((a_state, a_cursor), (resumed_state, resumed_cursor), (b_state, b_cursor)):
        for event in events()[:2]:
            emit_live(event, state, cursor)
    resumed_cursor.position = Position(3, 0)  # the client saw reasoning-start already
    rest = emit_live(reasoning, resumed_state, resumed_cursor)
    assert b"reasoning-start" not in rest and b"reasoning-delta" in rest
    full = emit_live(reasoning, a_state, a_cursor)
    assert b"reasoning-start" in full and emit_live(reasoning, b_state, b_cursor) is full


def test_streamed_reasoning_is_part_of_the_state_two_streams_share() -> None:
    """A stream that takes another's bytes for a reasoning delta takes its open part too: each
    stream starts the part once and ends it once, whichever of them projects an event first."""
    from fleet_shared.events import ReasoningDelta

    sent, states = both_streams(
        [
            IterationStarted(run_id=RUN, seq=1, iteration=1),
            ReasoningDelta(run_id=RUN, seq=2, part_id="r1", delta="th"),
            ReasoningDelta(run_id=RUN, seq=3, part_id="r1", delta="in"),
            ReasoningDelta(run_id=RUN, seq=4, part_id="r1", delta="k"),
            Reasoning(run_id=RUN, seq=5, part_id="r1", text="think", streamed=True),
            RunCompleted(run_id=RUN, seq=6, duration_ms=5),
        ]
    )
    for data in sent.values():
        assert data.count(b'"reasoning-start"') == 1 and data.count(b'"reasoning-end"') == 1
    assert all(state.open_reasoning == set() for state in states)


def both_streams(run: list[RunEvent]) -> tuple[dict[str, bytes], list[StreamState]]:
    """Two caught-up streams of one Run, taking turns at projecting each event first."""
    (a_state, a_cursor), (b_state, b_cursor) = stream(), stream()
    sent: dict[str, bytes] = {"a": b"", "b": b""}
    for n, event in enumerate(run):
        order = [("a", a_state, a_cursor), ("b", b_state, b_cursor)]
        for name, state, cursor in order if n % 2 else reversed(order):  # who projects first alternates
            sent[name] += emit_live(event, state, cursor)
    return sent, [a_state, b_state]


def test_a_streamed_answer_is_part_of_the_state_two_streams_share() -> None:
    from fleet_shared.events import Answer, AnswerDelta

    sent, states = both_streams(
        [
            AnswerDelta(run_id=RUN, seq=1, part_id="text-answer", delta="fo"),
            AnswerDelta(run_id=RUN, seq=2, part_id="text-answer", delta="r"),
            AnswerDelta(run_id=RUN, seq=3, part_id="text-answer", delta="ty"),
            Answer(run_id=RUN, seq=4, part_id="text-answer", text="forty-two", streamed=True, tail="-two"),
            RunCompleted(run_id=RUN, seq=5, duration_ms=5),
        ]
    )
    for data in sent.values():
        assert data.count(b'"text-start"') == 1 and data.count(b'"text-end"') == 1
        assert data.count(b'"-two"') == 1
    assert all(state.open_text == set() for state in states)


def test_a_cells_streamed_code_is_part_of_the_state_two_streams_share() -> None:
    from fleet_shared.events import CellOutput, CodeCell, CodeDelta

    sent, states = both_streams(
        [
            CodeDelta(run_id=RUN, seq=1, call_id="cell-1", delta="pri"),
            CodeDelta(run_id=RUN, seq=2, call_id="cell-1", delta="nt("),
            CodeDelta(run_id=RUN, seq=3, call_id="cell-2", delta="1)"),
            CodeCell(run_id=RUN, seq=4, call_id="cell-1", code="print(1)"),
            CellOutput(run_id=RUN, seq=5, call_id="cell-1", stdout="1\n"),
            RunCompleted(run_id=RUN, seq=6, duration_ms=5),
        ]
    )
    for data in sent.values():
        assert data.count(b'"tool-input-start"') == 2 and data.count(b'{\\"code\\":\\"') == 2
        assert data.count(b'"tool-input-error"') == 1  # cell-2's code never came whole
    assert all(state.open_tools == state.input_streaming == set() for state in states)
