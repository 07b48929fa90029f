"""The Run state machine: one pure transition table, applied by the DB layer as a fenced UPDATE."""

from __future__ import annotations

from enum import StrEnum

import msgspec

from fleet_shared.errors import InvalidTransition


class RunStatus(StrEnum):
    WAITING = "waiting"  # a follow-up behind the session's active Run (`multitask: enqueue`)
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class RunCommand(StrEnum):
    START = "start"  # a worker claims the queued job
    COMPLETE = "complete"
    FAIL = "fail"
    CANCEL = "cancel"
    TIME_OUT = "time_out"
    TAKE_OVER = "take_over"  # a sweeper claims a Run whose worker lost its lease, to settle it
    PROMOTE = "promote"  # the Run ahead of a waiting one ended: it is queued (fleet_shared.db.waiting)


# A Run being settled stays `running` until its one commit writes its ending: the commit is a
# single transaction, so no reader could ever see a status in between.
# At most one active Run per session (a unique partial index); any number may wait behind it.
ACTIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING})
UNSETTLED_STATUSES = ACTIVE_STATUSES | {RunStatus.WAITING}
TERMINAL_STATUSES = frozenset(set(RunStatus) - UNSETTLED_STATUSES)
# Commands that claim the Run for a new owner: each bumps `attempt`, which fences the old owner.
CLAIMS = frozenset({RunCommand.START, RunCommand.TAKE_OVER})

S, C = RunStatus, RunCommand
TRANSITIONS: dict[tuple[RunStatus, RunCommand], RunStatus] = {
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
    """End a Run from `current`: a transition of the table whose target is terminal."""
    decision = decide(current, command)
    if decision.target in UNSETTLED_STATUSES:
        raise InvalidTransition(f"cannot end a run that is {current.value} with {command.value}")
    return decision


def is_terminal(status: RunStatus | str) -> bool:
    return RunStatus(status) in TERMINAL_STATUSES
