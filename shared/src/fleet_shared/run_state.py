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
    TAKE_OVER = "take_over"  # a sweeper claims a Run whose worker lost its lease, to settle it


ACTIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SETTLING})
TERMINAL_STATUSES = frozenset(set(RunStatus) - ACTIVE_STATUSES)
# Commands that claim the Run for a new owner: each bumps `attempt`, which fences the old owner.
CLAIMS = frozenset({RunCommand.START, RunCommand.TAKE_OVER})

S, C = RunStatus, RunCommand
TRANSITIONS: dict[tuple[RunStatus, RunCommand], RunStatus] = {
    (S.QUEUED, C.START): S.RUNNING,
    (S.QUEUED, C.FAIL): S.FAILED,
    (S.QUEUED, C.CANCEL): S.CANCELLED,
    (S.RUNNING, C.SETTLE): S.SETTLING,
    (S.RUNNING, C.FAIL): S.FAILED,
    (S.RUNNING, C.CANCEL): S.CANCELLED,
    (S.RUNNING, C.TIME_OUT): S.TIMED_OUT,
    (S.RUNNING, C.TAKE_OVER): S.RUNNING,
    (S.SETTLING, C.COMPLETE): S.COMPLETED,
    (S.SETTLING, C.FAIL): S.FAILED,
    (S.SETTLING, C.CANCEL): S.CANCELLED,
    (S.SETTLING, C.TIME_OUT): S.TIMED_OUT,
    (S.SETTLING, C.TAKE_OVER): S.SETTLING,
}
del S, C


class Decision(msgspec.Struct, frozen=True):
    """Move to `target` from any of `sources`; the UPDATE must match one or it lost a race."""

    sources: frozenset[RunStatus]
    target: RunStatus
    bumps_attempt: bool


def decide(current: RunStatus, command: RunCommand) -> Decision:
    target = TRANSITIONS.get((current, command))
    if target is None:
        raise InvalidTransition(f"cannot {command.value} a run that is {current.value}")
    return Decision(frozenset({current}), target, bumps_attempt=command in CLAIMS)


def decide_ending(current: RunStatus, command: RunCommand) -> Decision:
    """End a Run in one step from `current`, or from the status a `settle` would lead to.

    The worker commits its ending in one transaction straight from `running`: the table's
    running → settling → end path, taken in one UPDATE that accepts either status.
    """
    direct = TRANSITIONS.get((current, command))
    settling = TRANSITIONS.get((current, RunCommand.SETTLE))
    via = TRANSITIONS.get((settling, command)) if settling is not None else None
    target = direct or via
    if target is None or target in ACTIVE_STATUSES or (direct and via and direct != via):
        raise InvalidTransition(f"cannot end a run that is {current.value} with {command.value}")
    sources = {current} if direct else set()
    if via == target and settling is not None:
        sources.add(settling)
        if TRANSITIONS.get((current, RunCommand.SETTLE)) == settling:
            sources.add(current)
    return Decision(frozenset(sources), target, bumps_attempt=False)


def is_terminal(status: RunStatus | str) -> bool:
    return RunStatus(status) in TERMINAL_STATUSES
