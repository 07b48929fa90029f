"""A failed cell, as the worker reports it: the RLM and the client are told the same text, its
output first, and together with the error it stays within `rlm.max_output_chars`."""

from __future__ import annotations

import threading

import pytest
from dspy.primitives.code_interpreter import CodeExecutionError

from fleet_shared.events import CellOutput, CodeCell, RunEvent
from fleet_shared.transcript import OUTPUT_CUT_NOTE, failed_cell_text, fold_parts
from fleet_worker.dspy_adapter import SandboxInterpreter
from fleet_worker.errors import TurnStopped
from fleet_worker.observer import TurnObserver, fit_output
from fleet_worker.sandbox.boundary import CellResult
from fleet_worker.sandbox.errors import CellCrashed, CellFailed, CellInterrupted, CellTimeout


class FailingRepl:
    """A REPL whose every cell ends with `failure` (what a real session raises); `stop`, when
    given, is set while the cell runs, as a cancel does before it interrupts the cell."""

    def __init__(self, failure: CellFailed, stop: threading.Event | None = None) -> None:
        self.failure = failure
        self.stop = stop

    def start(self) -> None:
        return None

    def execute(self, *_cell: object) -> CellResult:
        if self.stop is not None:
            self.stop.set()
        raise self.failure

    def interrupt(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def run_failing_cell(failure: CellFailed, limit: int = 10_000, stop: bool = False) -> tuple[str, CellOutput]:
    """The text the RLM was told (or TurnStopped's), and the cell's event."""
    events: list[RunEvent] = []
    observer = TurnObserver(emit=events.append, run_id="r", stop=threading.Event(), max_output_chars=limit)
    observer.pending_cell = True  # the model asked for this cell
    interpreter = SandboxInterpreter(FailingRepl(failure, observer.stop if stop else None), observer)
    with pytest.raises((CodeExecutionError, TurnStopped)) as raised:
        interpreter.execute("print('BEFORE-LOOP')\nwhile True: pass")
    (cell,) = [e for e in events if isinstance(e, CellOutput)]
    return str(raised.value), cell


def committed_text(cell: CellOutput) -> object:
    """The cell's `errorText` in the committed Turn (the live stream's is the same text)."""
    (part,) = fold_parts([CodeCell(run_id="r", call_id=cell.call_id, code=""), cell])
    return part["errorText"]


@pytest.mark.parametrize(
    "failure",
    [
        CellTimeout(60, stdout="BEFORE-LOOP\n"),
        CellCrashed("the sandbox crashed: killed", stdout="BEFORE-LOOP\n"),
    ],
    ids=["timeout", "crashed"],
)
def test_the_rlm_is_told_what_the_client_sees(failure: CellFailed) -> None:
    told, cell = run_failing_cell(failure)
    assert cell.stdout == "BEFORE-LOOP\n" and cell.error == str(failure)
    assert told == f"BEFORE-LOOP\n{failure}"
    assert committed_text(cell) == told


def test_an_interrupted_cell_keeps_its_output_in_the_stream() -> None:
    failure = CellInterrupted("the cell was interrupted", stdout="BEFORE-LOOP\n")
    told, cell = run_failing_cell(failure, stop=True)
    assert told == "the cell was interrupted"  # the Turn stops; the RLM is not asked again
    assert committed_text(cell) == "BEFORE-LOOP\nthe cell was interrupted"


def test_output_and_error_together_stay_within_the_cap() -> None:
    limit = 300
    failure = CellTimeout(2, stdout="y" * limit)  # as much as the capture keeps
    told, cell = run_failing_cell(failure, limit=limit)
    assert len(told) <= limit
    assert told.startswith("y") and told.endswith(str(failure))  # the error is whole
    assert OUTPUT_CUT_NOTE in told and cell.truncated
    assert committed_text(cell) == told


def test_an_error_longer_than_the_cap_is_kept_whole_and_the_output_gives_way() -> None:
    error = "E" * 500
    stdout, truncated = fit_output("printed\n", False, error, limit=100)
    assert (stdout, truncated) == ("", True)
    assert failed_cell_text(stdout, truncated, error) == f"{OUTPUT_CUT_NOTE}\n{error}"


def test_output_that_fits_is_left_alone() -> None:
    assert fit_output("printed\n", False, "boom", limit=100) == ("printed\n", False)
