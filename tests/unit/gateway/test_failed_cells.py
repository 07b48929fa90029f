"""A failed cell's tool part: what it printed, then why it failed, in `errorText` (its only field).

The AI SDK's `tool-output-error` chunk has no `output`, so a cell killed by its timeout, an
interrupt or a crash would otherwise lose what it printed. The live stream (`project`) and the
committed Turn (`fold_parts`) carry the same text.
"""

from __future__ import annotations

import pytest

from fleet_gateway.projection import StreamState, project
from fleet_shared.events import CellOutput, CodeCell, RunEvent
from fleet_shared.transcript import OUTPUT_CUT_NOTE, fold_parts

R = "run_cells"
TIMEOUT = "the cell exceeded the 60s timeout; the REPL was killed and restarted"
INTERRUPTED = "the cell was interrupted; its REPL was killed, so all earlier state is lost"
CRASHED = "the sandbox crashed: killed (exit status -9); it was restarted"
SDK_ERROR_KEYS = {"type", "toolCallId", "errorText", "providerExecuted", "dynamic"}


def failed_cell(stdout: str, error: str, truncated: bool = False) -> list[RunEvent]:
    return [
        CodeCell(run_id=R, call_id="cell-1", code="print('BEFORE-LOOP')\nwhile True: pass"),
        CellOutput(run_id=R, call_id="cell-1", stdout=stdout, truncated=truncated, error=error),
    ]


def streamed_error(events: list[RunEvent]) -> dict[str, object]:
    state = StreamState(R, "sess")
    chunks = [chunk for event in events for chunk in project(event, state)]
    errors = [c for c in chunks if c["type"] == "tool-output-error"]
    assert len(errors) == 1 and not state.open_tools, chunks
    return errors[0]


def committed_error_text(events: list[RunEvent]) -> object:
    (part,) = fold_parts(events)
    assert part["state"] == "output-error" and "output" not in part, part
    return part["errorText"]


@pytest.mark.parametrize("error", [TIMEOUT, INTERRUPTED, CRASHED], ids=["timeout", "interrupted", "crashed"])
def test_the_output_comes_first_in_error_text_live_and_committed(error: str) -> None:
    events = failed_cell("BEFORE-LOOP\n", error)
    chunk = streamed_error(events)
    assert set(chunk) == SDK_ERROR_KEYS  # nothing the SDK's parser would refuse
    assert chunk["errorText"] == f"BEFORE-LOOP\n{error}"
    assert committed_error_text(events) == chunk["errorText"]


def test_output_without_a_final_line_break_still_ends_its_line() -> None:
    events = failed_cell("no newline", TIMEOUT)
    assert streamed_error(events)["errorText"] == f"no newline\n{TIMEOUT}"
    assert committed_error_text(events) == f"no newline\n{TIMEOUT}"


def test_cut_output_says_so_before_the_error() -> None:
    events = failed_cell("x" * 50, TIMEOUT, truncated=True)
    expected = f"{'x' * 50}\n{OUTPUT_CUT_NOTE}\n{TIMEOUT}"
    assert streamed_error(events)["errorText"] == expected
    assert committed_error_text(events) == expected


def test_a_cell_that_printed_nothing_shows_only_its_error() -> None:
    events = failed_cell("", TIMEOUT)
    assert streamed_error(events)["errorText"] == TIMEOUT
    assert committed_error_text(events) == TIMEOUT
