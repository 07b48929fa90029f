"""The Run transition table, checked exhaustively against an independent copy of the spec."""

from __future__ import annotations

import itertools

import pytest

from fleet_shared.errors import InvalidTransition
from fleet_shared.run_state import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    TRANSITIONS,
    UNSETTLED_STATUSES,
    Decision,
    RunCommand,
    RunStatus,
    decide,
    decide_ending,
    is_terminal,
)

S, C = RunStatus, RunCommand

# The spec, written out independently of the module's own table.
EXPECTED: dict[tuple[RunStatus, RunCommand], RunStatus] = {
    (S.WAITING, C.PROMOTE): S.QUEUED,
    (S.WAITING, C.CANCEL): S.CANCELLED,
    (S.QUEUED, C.START): S.RUNNING,
    (S.QUEUED, C.FAIL): S.FAILED,
    (S.QUEUED, C.CANCEL): S.CANCELLED,
    (S.RUNNING, C.COMPLETE): S.COMPLETED,
    (S.RUNNING, C.FAIL): S.FAILED,
    (S.RUNNING, C.CANCEL): S.CANCELLED,
    (S.RUNNING, C.TIME_OUT): S.TIMED_OUT,
    (S.RUNNING, C.TAKE_OVER): S.RUNNING,
}
CLAIMING = {C.START, C.TAKE_OVER}
TERMINAL = {S.COMPLETED, S.FAILED, S.CANCELLED, S.TIMED_OUT}
ALL_PAIRS = list(itertools.product(RunStatus, RunCommand))


def test_enums_are_the_documented_values() -> None:
    assert [s.value for s in RunStatus] == [
        "waiting",
        "queued",
        "running",
        "completed",
        "failed",
        "cancelled",
        "timed_out",
    ]
    assert [c.value for c in RunCommand] == [
        "start",
        "complete",
        "fail",
        "cancel",
        "time_out",
        "take_over",
        "promote",
    ]


def test_module_table_matches_spec() -> None:
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize(("status", "command"), ALL_PAIRS, ids=[f"{s}-{c}" for s, c in ALL_PAIRS])
def test_every_status_command_pair(status: RunStatus, command: RunCommand) -> None:
    target = EXPECTED.get((status, command))
    if target is None:
        with pytest.raises(InvalidTransition) as info:
            decide(status, command)
        assert str(info.value) == f"cannot {command.value} a run that is {status.value}"
        return
    decision = decide(status, command)
    assert decision == Decision(frozenset({status}), target, bumps_attempt=command in CLAIMING)
    assert decision.target is target


@pytest.mark.parametrize("status", sorted(TERMINAL))
@pytest.mark.parametrize("command", list(RunCommand))
def test_terminal_statuses_accept_no_command(status: RunStatus, command: RunCommand) -> None:
    with pytest.raises(InvalidTransition):
        decide(status, command)


@pytest.mark.parametrize(("status", "command"), sorted(EXPECTED))
def test_only_claims_bump_attempt(status: RunStatus, command: RunCommand) -> None:
    assert decide(status, command).bumps_attempt is (command in CLAIMING)


# Ending a Run in one UPDATE: from where it may stand, to where the table leads, never elsewhere.
ENDINGS = {
    (S.RUNNING, C.COMPLETE): ({S.RUNNING}, S.COMPLETED),
    (S.RUNNING, C.FAIL): ({S.RUNNING}, S.FAILED),
    (S.RUNNING, C.CANCEL): ({S.RUNNING}, S.CANCELLED),
    (S.RUNNING, C.TIME_OUT): ({S.RUNNING}, S.TIMED_OUT),
    (S.QUEUED, C.FAIL): ({S.QUEUED}, S.FAILED),
    (S.QUEUED, C.CANCEL): ({S.QUEUED}, S.CANCELLED),
    (S.WAITING, C.CANCEL): ({S.WAITING}, S.CANCELLED),
}


@pytest.mark.parametrize(("status", "command"), ALL_PAIRS, ids=[f"{s}-{c}" for s, c in ALL_PAIRS])
def test_every_ending(status: RunStatus, command: RunCommand) -> None:
    expected = ENDINGS.get((status, command))
    if expected is None:
        with pytest.raises(InvalidTransition):
            decide_ending(status, command)
        return
    sources, target = expected
    assert decide_ending(status, command) == Decision(frozenset(sources), target, bumps_attempt=False)


def test_every_active_status_can_fail_and_cancel_and_a_waiting_one_can_be_cancelled() -> None:
    for status in ACTIVE_STATUSES:
        assert decide(status, RunCommand.FAIL).target is RunStatus.FAILED
        assert decide(status, RunCommand.CANCEL).target is RunStatus.CANCELLED
    assert decide(RunStatus.WAITING, RunCommand.CANCEL).target is RunStatus.CANCELLED


def test_every_target_is_reachable_and_every_terminal_status_is_a_sink() -> None:
    targets = set(EXPECTED.values())
    assert targets == set(RunStatus) - {RunStatus.WAITING}
    moves = {C.PROMOTE} | CLAIMING
    assert all(target in TERMINAL or command in moves for (_status, command), target in EXPECTED.items())
    assert {status for status, _ in EXPECTED} == set(UNSETTLED_STATUSES)


@pytest.mark.parametrize("status", list(RunStatus))
def test_is_terminal(status: RunStatus) -> None:
    expected = status in TERMINAL
    assert is_terminal(status) is expected
    assert is_terminal(status.value) is expected
    assert (status in TERMINAL_STATUSES) is expected
    assert (status in UNSETTLED_STATUSES) is not expected
    assert (status in ACTIVE_STATUSES) is (status in {S.QUEUED, S.RUNNING})


def test_is_terminal_rejects_unknown_status() -> None:
    with pytest.raises(ValueError):
        is_terminal("exploded")


def test_decision_is_frozen() -> None:
    decision = decide(RunStatus.QUEUED, RunCommand.START)
    with pytest.raises(AttributeError):
        decision.target = RunStatus.FAILED  # type: ignore[misc]
