"""The Run state machine: one pure transition table, applied by the DB layer as a fenced UPDATE."""

from __future__ import annotations

from enum import StrEnum

import msgspec

from fleet_shared.errors import InvalidTransition


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SETTLING = "settling"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class RunCommand(StrEnum):
    START = "start"  # a worker claims the queued job
    SETTLE = "settle"  # the RLM returned; the worker is committing
    COMPLETE = "complete"
    FAIL = "fail"
    CANCEL = "cancel"
    TIME_OUT = "time_out"


ACTIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SETTLING})
TERMINAL_STATUSES = frozenset(set(RunStatus) - ACTIVE_STATUSES)

S, C = RunStatus, RunCommand
TRANSITIONS: dict[tuple[RunStatus, RunCommand], RunStatus] = {
    (S.QUEUED, C.START): S.RUNNING,
    (S.QUEUED, C.FAIL): S.FAILED,
    (S.QUEUED, C.CANCEL): S.CANCELLED,
    (S.RUNNING, C.SETTLE): S.SETTLING,
    (S.RUNNING, C.FAIL): S.FAILED,
    (S.RUNNING, C.CANCEL): S.CANCELLED,
    (S.RUNNING, C.TIME_OUT): S.TIMED_OUT,
    (S.SETTLING, C.COMPLETE): S.COMPLETED,
    (S.SETTLING, C.FAIL): S.FAILED,
    (S.SETTLING, C.CANCEL): S.CANCELLED,
    (S.SETTLING, C.TIME_OUT): S.TIMED_OUT,
}
del S, C


class Decision(msgspec.Struct, frozen=True):
    """Move from `expected` to `target`; the UPDATE must match `expected` or it lost a race."""

    expected: RunStatus
    target: RunStatus
    bumps_attempt: bool


def decide(current: RunStatus, command: RunCommand) -> Decision:
    target = TRANSITIONS.get((current, command))
    if target is None:
        raise InvalidTransition(f"cannot {command.value} a run that is {current.value}")
    return Decision(current, target, bumps_attempt=command is RunCommand.START)


def is_terminal(status: RunStatus | str) -> bool:
    return RunStatus(status) in TERMINAL_STATUSES
