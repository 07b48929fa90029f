"""How a Turn ended, and the events that say so: the mapping from what happened to what is recorded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy.exc import SQLAlchemyError

from fleet_shared.checkpoint import next_task
from fleet_shared.events import (
    Answer,
    LMUsage,
    RunCancelled,
    RunCompleted,
    RunEvent,
    RunFailed,
    RunWarning,
    Usage,
)
from fleet_shared.run_state import RunCommand
from fleet_worker import dspy_adapter
from fleet_worker.errors import TurnCancelled, TurnFailed, TurnStopped, TurnTimedOut
from fleet_worker.prices import DIGITS, NO_PRICES, PriceBook
from fleet_worker.sandbox.errors import SandboxError
from fleet_worker.sandbox.workspace import HOST_PATHS
from fleet_worker.streamed_parts import ANSWER_PART, closing

if TYPE_CHECKING:
    from fleet_worker.turn import Claim

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How execution ended. `command` ends the Run: COMPLETE, FAIL, CANCEL or TIME_OUT."""

    command: RunCommand
    turn_status: str
    answer: str | None = None
    iterations: int = 0
    lm_usage: dict[str, dict[str, int]] | None = None
    failure_code: str | None = None
    failure_message: str | None = None
    streamed_answer: str | None = None  # what the answer's deltas showed (the extract fallback)


SHUTDOWN_OUTCOME = Outcome(
    RunCommand.FAIL,
    "failed",
    failure_code="worker_shutdown",
    failure_message="the worker shut down before the Turn finished; send it again",
)


def failure_outcome(exc: BaseException) -> Outcome:
    """Map an exception (possibly wrapped by DSPy) to a failed, timed-out or cancelled Outcome.

    Messages are public (they reach the client): never a host path, SQL or a row's values."""
    cause = find_cause(exc)
    if isinstance(cause, TurnCancelled):
        return Outcome(RunCommand.CANCEL, "cancelled")
    if isinstance(cause, TurnTimedOut):
        return failed(RunCommand.TIME_OUT, "timed_out", cause.code, cause.message)
    if isinstance(cause, TurnFailed):
        return failed(RunCommand.FAIL, "failed", cause.code, cause.message)
    if isinstance(cause, SandboxError):
        return failed(RunCommand.FAIL, "failed", "sandbox_error", HOST_PATHS.scrub(str(cause)))
    if dspy_adapter.is_lm_error(exc):
        log.warning("turn.lm_error", error_type=type(exc).__name__, error=str(exc))
        return failed(RunCommand.FAIL, "failed", "lm_error", dspy_adapter.lm_error_message(exc))
    log.error("turn.unexpected_error", error_type=type(exc).__name__, exc_info=exc)
    if isinstance(cause, SQLAlchemyError):
        message = f"the database failed ({type(cause).__name__}); send the Turn again"
    else:
        message = HOST_PATHS.scrub(f"{type(exc).__name__}: {exc}")
    return failed(RunCommand.FAIL, "failed", "internal_error", message)


def failed(command: RunCommand, status: str, code: str, message: str) -> Outcome:
    # Text from a sandbox may carry NUL, which PostgreSQL's text columns refuse.
    return Outcome(command, status, failure_code=code, failure_message=message.replace("\x00", "\ufffd"))


def find_cause(exc: BaseException) -> BaseException:
    """The first of our own errors in the chain (DSPy may wrap what our engine raised)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, TurnFailed | TurnStopped | SandboxError | SQLAlchemyError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return exc


def usage_event(run_id: str, outcome: Outcome, duration_ms: int, prices: PriceBook = NO_PRICES) -> Usage:
    """The Turn's tokens and their cost per model; the total sums the models that have a price."""
    observed = {
        model: LMUsage(
            prompt_tokens=u["prompt_tokens"],
            completion_tokens=u["completion_tokens"],
            calls=u.get("calls", 0),
            cost_usd=prices.cost(model, u["prompt_tokens"], u["completion_tokens"]),
        )
        for model, u in (outcome.lm_usage or {}).items()
    }
    costs = [u.cost_usd for u in observed.values() if u.cost_usd is not None]
    return Usage(
        run_id=run_id,
        iterations=outcome.iterations,
        duration_ms=duration_ms,
        observed_lm_usage=observed,
        cost_usd=round(sum(costs), DIGITS) if costs else None,
    )


def terminal_event(run_id: str, outcome: Outcome, duration_ms: int, checkpoint_version: int = 0) -> RunEvent:
    if outcome.command is RunCommand.COMPLETE:
        return RunCompleted(run_id=run_id, duration_ms=duration_ms, checkpoint_version=checkpoint_version)
    if outcome.command is RunCommand.CANCEL:
        return RunCancelled(run_id=run_id)
    return RunFailed(
        run_id=run_id,
        code=outcome.failure_code or "internal_error",
        message=outcome.failure_message or "the Turn failed",
    )


def next_checkpoint(claim: Claim, request: str, outcome: Outcome) -> dict[str, Any]:
    """The session's task checkpoint once this Turn is recorded (fleet_shared.checkpoint)."""
    if outcome.answer is not None:
        said = outcome.answer
    else:
        said = outcome.failure_message or outcome.failure_code or outcome.turn_status
    return next_task(
        claim.task,
        sequence=claim.user_sequence,
        run_id=claim.run_id,
        request=request,
        status=outcome.turn_status,
        outcome=said,
        at=datetime.now(UTC).isoformat(),
    )


def answer_event(limit: int, emit: Callable[[RunEvent], object], run_id: str, outcome: Outcome) -> Answer:
    """The Turn's answer within `rlm.max_answer_chars` (SUBMIT's own check makes this a backstop
    for answers DSPy assembled itself), with a warning when it was cut; it closes the part its
    deltas opened, if the extract fallback streamed it."""
    answer = outcome.answer or ""
    if len(answer) > limit:
        message = f"the answer was {len(answer)} characters; it was cut to {limit} (rlm.max_answer_chars)"
        emit(RunWarning(run_id=run_id, code="answer_truncated", message=message))
        answer = answer[:limit]
    return Answer(run_id=run_id, part_id=ANSWER_PART, text=answer, **closing(answer, outcome.streamed_answer))
