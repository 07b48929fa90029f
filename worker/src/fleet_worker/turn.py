"""A Turn's life, top to bottom: claim, prepare, execute, settle, commit, cleanup."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fleet_shared.config import Settings
from fleet_shared.db import queries
from fleet_shared.db.models import Session
from fleet_shared.events import (
    Answer,
    LMUsage,
    RunCompleted,
    RunEvent,
    RunFailed,
    StatusChanged,
    Usage,
)
from fleet_shared.run_state import RunCommand, RunStatus
from fleet_shared.transcript import fold_parts, usage_payload
from fleet_worker import dspy_adapter
from fleet_worker.errors import SandboxFailed, TurnFailed, TurnStopped, TurnTimedOut
from fleet_worker.lease import Lease, hold_lease
from fleet_worker.lm.script import Script, load_script
from fleet_worker.publisher import EventSink
from fleet_worker.sandbox.errors import SandboxError, SandboxUnavailable
from fleet_worker.sandbox.local import LocalSandboxLease, LocalSandboxProvider
from fleet_worker.settlement import commit_with_retry

log = structlog.get_logger(__name__)
STOP_GRACE_SECONDS = 10.0
LEASE_LOST_MESSAGE = "this worker lost the Turn's lease; another worker may have settled it"


@dataclass
class WorkerDeps:
    """Process-wide resources, built once in the arq worker's startup hook."""

    settings: Settings
    sessions: async_sessionmaker[AsyncSession]
    redis: Redis
    sandboxes: LocalSandboxProvider
    workspaces: Path
    scripts: dict[Path, Script]
    worker_id: str = "worker"


@dataclass(frozen=True)
class Claim:
    run_id: str
    session_id: str
    workspace_id: str
    attempt: int
    user_sequence: int
    started: float


@dataclass(frozen=True)
class Prepared:
    request: str
    history: list[dict[str, str]]
    lease: LocalSandboxLease


@dataclass(frozen=True)
class Outcome:
    """How execution ended. `command` moves the Run out of settling: COMPLETE, FAIL or TIME_OUT."""

    command: RunCommand
    turn_status: str
    answer: str | None = None
    iterations: int = 0
    lm_usage: dict[str, dict[str, int]] | None = None
    failure_code: str | None = None
    failure_message: str | None = None


SHUTDOWN_OUTCOME = Outcome(
    RunCommand.FAIL,
    "failed",
    failure_code="worker_shutdown",
    failure_message="the worker shut down before the Turn finished; send it again",
)


async def run_turn(ctx: dict[str, Any], run_id: str) -> str:
    """The arq job. A duplicate (the Run is no longer queued) does nothing."""
    deps: WorkerDeps = ctx["deps"]
    with structlog.contextvars.bound_contextvars(run_id=run_id, job_try=ctx.get("job_try")):
        claim = await claim_run(deps, run_id)
        if claim is None:
            log.info("turn.duplicate_job")
            return "duplicate"
        log.info("turn.claimed", attempt=claim.attempt)
        cancelled = False
        async with AsyncExitStack() as cleanup:
            lease = await cleanup.enter_async_context(
                hold_lease(deps.redis, run_id, deps.worker_id, deps.settings.profile.worker.lease_seconds)
            )
            sink = EventSink(deps.redis, run_id)
            cleanup.push_async_callback(sink.close)
            try:
                outcome = await prepare_and_execute(deps, claim, sink, cleanup, lease)
            except asyncio.CancelledError:
                # The worker is stopping and its drain time ran out: end the Turn properly.
                outcome, cancelled = SHUTDOWN_OUTCOME, True
            status, cancelled_again = await finish_even_if_cancelled(
                settle_and_commit(deps, claim, sink, outcome)
            )
        log.info("turn.settled", status=status, failure_code=outcome.failure_code)
        if cancelled or cancelled_again:
            raise asyncio.CancelledError  # let arq see the cancellation, now that the Turn is settled
        return status


async def finish_even_if_cancelled(settling: Coroutine[Any, Any, str]) -> tuple[str, bool]:
    """Await settlement to the end however often we are cancelled meanwhile (arq's close waits for
    this task, so the DB and Redis stay open); report whether a cancellation arrived."""
    task = asyncio.ensure_future(settling)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    return task.result(), cancelled


async def claim_run(deps: WorkerDeps, run_id: str) -> Claim | None:
    async with deps.sessions() as db:
        run = await queries.start_run(db, run_id)
        if run is None:
            return None
        session = await db.get(Session, run.session_id)
        assert session is not None
        return Claim(
            run_id=run.id,
            session_id=run.session_id,
            workspace_id=session.workspace_id,
            attempt=run.attempt,
            user_sequence=run.user_sequence,
            started=time.monotonic(),
        )


async def prepare_and_execute(
    deps: WorkerDeps, claim: Claim, sink: EventSink, cleanup: AsyncExitStack, lease: Lease
) -> Outcome:
    try:
        prepared = await prepare(deps, claim, sink, cleanup)
        return await execute(deps, claim, prepared, sink, lease)
    except (Exception, TurnStopped) as exc:
        return failure_outcome(exc)


async def prepare(deps: WorkerDeps, claim: Claim, sink: EventSink, cleanup: AsyncExitStack) -> Prepared:
    sink.emit(StatusChanged(run_id=claim.run_id, phase="preparation"))
    request, history = await load_conversation(deps, claim)
    workspace = deps.workspaces / claim.workspace_id
    try:
        lease = await asyncio.to_thread(deps.sandboxes.acquire, workspace, claim.run_id)
    except SandboxUnavailable as exc:
        raise SandboxFailed(str(exc), code="sandbox_unavailable") from None
    cleanup.push_async_callback(release_shielded, lease)
    return Prepared(request, history, lease)


def prepare_workspace_root(root: Path) -> Path:
    """`.fleet/` and `.fleet/workspaces/` searchable (not listable) by the sandbox's own uid."""
    root = root.resolve()
    for directory in (root.parent, root):
        directory.mkdir(mode=0o711, parents=True, exist_ok=True)
        if directory.stat().st_uid == os.geteuid():
            directory.chmod(0o711)
    return root


async def load_conversation(deps: WorkerDeps, claim: Claim) -> tuple[str, list[dict[str, str]]]:
    """This Turn's request, and the earlier request/answer pairs as dspy.History messages."""
    async with deps.sessions() as db:
        turns = await queries.list_turns(db, claim.session_id, after_sequence=0, limit=claim.user_sequence)
    texts = {t.sequence: (t.role, text_of(t.parts)) for t in turns}
    request = texts[claim.user_sequence][1]
    history = [
        {"request": text, "answer": texts[seq + 1][1]}
        for seq, (role, text) in sorted(texts.items())
        if role == "user" and seq < claim.user_sequence and texts.get(seq + 1, ("", ""))[0] == "assistant"
    ]
    return request, history


def text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


async def execute(
    deps: WorkerDeps, claim: Claim, prepared: Prepared, sink: EventSink, lease: Lease
) -> Outcome:
    """Run the RLM in a thread until it answers, times out, loses its lease, or the worker stops."""
    sink.emit(StatusChanged(run_id=claim.run_id, phase="execution"))
    stop = threading.Event()
    program = asyncio.ensure_future(asyncio.to_thread(rlm_call(deps, claim, prepared, sink, stop)))
    lost = asyncio.ensure_future(lease.lost.wait())
    timeout = deps.settings.profile.runtime.turn_timeout_seconds
    try:
        await asyncio.wait({program, lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await asyncio.shield(stop_program(program, stop, prepared.lease))
        raise
    finally:
        lost.cancel()
    if not program.done():
        await stop_program(program, stop, prepared.lease)
        if lease.lost.is_set():
            raise TurnFailed(
                "this worker lost the Turn's lease; another worker may have settled it", code="lease_lost"
            )
        raise TurnTimedOut(f"the Turn exceeded runtime.turn_timeout_seconds ({timeout:g} s)")
    result = program.result()
    return Outcome(
        RunCommand.COMPLETE,
        "completed",
        answer=result.answer,
        iterations=result.iterations,
        lm_usage=result.lm_usage,
    )


def rlm_call(
    deps: WorkerDeps, claim: Claim, prepared: Prepared, sink: EventSink, stop: threading.Event
) -> Callable[[], dspy_adapter.ProgramResult]:
    """The whole RLM run as one blocking call, with fresh LMs (and script cursor) for this Turn."""
    settings = deps.settings
    cursor = None
    if settings.root_lm.scripted or settings.sub_lm.scripted:
        cursor = script_for(deps, settings).cursor()
    rlm = settings.profile.rlm
    observer = dspy_adapter.TurnObserver(
        emit=sink.emit_threadsafe, run_id=claim.run_id, stop=stop, max_output_chars=rlm.max_output_chars
    )
    return functools.partial(
        dspy_adapter.run_program,
        request=prepared.request,
        history=prepared.history,
        root_lm=dspy_adapter.build_lm(settings.root_lm, "root", cursor, stop),
        sub_lm=dspy_adapter.build_lm(settings.sub_lm, "sub", cursor, stop),
        limits=dspy_adapter.ProgramLimits(rlm.max_iters, rlm.max_llm_calls, rlm.max_output_chars),
        observer=observer,
        new_session=prepared.lease.new_session,
    )


async def stop_program(program: asyncio.Future[Any], stop: threading.Event, lease: LocalSandboxLease) -> None:
    """Ask the RLM thread to stop at its next boundary and kill the running cell, then wait a bit."""
    # However it ends, even after we stop waiting, its exception is expected: mark it retrieved.
    program.add_done_callback(lambda done: done.cancelled() or done.exception())
    stop.set()
    await asyncio.to_thread(lease.interrupt)
    await asyncio.wait({program}, timeout=STOP_GRACE_SECONDS)


def script_for(deps: WorkerDeps, settings: Settings) -> Script:
    lm = settings.root_lm if settings.root_lm.scripted else settings.sub_lm
    assert lm.script_path is not None
    script = deps.scripts.get(lm.script_path)
    if script is None:
        script = load_script(lm.script_path, lm.name.removeprefix("scripted/"))
        deps.scripts[lm.script_path] = script
    return script


def failure_outcome(exc: BaseException) -> Outcome:
    """Map an exception (possibly wrapped by DSPy) to a failed or timed-out Outcome."""
    cause = find_cause(exc)
    if isinstance(cause, TurnTimedOut):
        return Outcome(
            RunCommand.TIME_OUT, "timed_out", failure_code=cause.code, failure_message=cause.message
        )
    if isinstance(cause, TurnFailed):
        return Outcome(RunCommand.FAIL, "failed", failure_code=cause.code, failure_message=cause.message)
    if isinstance(cause, SandboxError):
        return Outcome(RunCommand.FAIL, "failed", failure_code="sandbox_error", failure_message=str(cause))
    if dspy_adapter.is_lm_error(exc):
        return Outcome(RunCommand.FAIL, "failed", failure_code="lm_error", failure_message=str(exc))
    log.error("turn.unexpected_error", error_type=type(exc).__name__, exc_info=exc)
    return Outcome(
        RunCommand.FAIL,
        "failed",
        failure_code="internal_error",
        failure_message=f"{type(exc).__name__}: {exc}",
    )


def find_cause(exc: BaseException) -> BaseException:
    """The first of our own errors in the chain (DSPy may wrap what our engine raised)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, TurnFailed | TurnStopped | SandboxError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return exc


async def settle_and_commit(deps: WorkerDeps, claim: Claim, sink: EventSink, outcome: Outcome) -> str:
    """Emit the last body events, commit Turn + events + status in one fenced transaction, and
    only then publish the terminal event: a client never sees an ending that was not committed."""
    sink.emit(StatusChanged(run_id=claim.run_id, phase="settling"))
    duration_ms = int((time.monotonic() - claim.started) * 1000)
    if outcome.answer is not None:
        sink.emit(Answer(run_id=claim.run_id, part_id="text-answer", text=outcome.answer))
    usage = usage_event(claim.run_id, outcome, duration_ms)
    sink.emit(usage)
    await sink.drain()
    terminal = sink.stamp_terminal(terminal_event(claim.run_id, outcome, duration_ms))
    settlement = queries.Settlement(
        run_id=claim.run_id,
        session_id=claim.session_id,
        attempt=claim.attempt,
        current=RunStatus.SETTLING,
        command=outcome.command,
        sequence=claim.user_sequence + 1,
        parts=fold_parts(sink.events),
        turn_status=outcome.turn_status,
        events=sink.events,
        usage=usage_payload(usage),
        failure_code=outcome.failure_code,
        failure_message=outcome.failure_message,
    )
    if not await commit_with_retry(deps.sessions, settlement):
        log.warning("turn.fenced_out")
        return "fenced"
    await sink.publish_terminal(terminal)
    return outcome.turn_status


def usage_event(run_id: str, outcome: Outcome, duration_ms: int) -> Usage:
    observed = {
        model: LMUsage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"])
        for model, u in (outcome.lm_usage or {}).items()
    }
    return Usage(
        run_id=run_id,
        iterations=outcome.iterations,
        duration_ms=duration_ms,
        observed_lm_usage=observed,
    )


def terminal_event(run_id: str, outcome: Outcome, duration_ms: int) -> RunEvent:
    if outcome.command is RunCommand.COMPLETE:
        return RunCompleted(run_id=run_id, duration_ms=duration_ms)
    return RunFailed(
        run_id=run_id,
        code=outcome.failure_code or "internal_error",
        message=outcome.failure_message or "the Turn failed",
    )


async def release_shielded(lease: LocalSandboxLease) -> None:
    """Release the sandbox even if the job is being cancelled."""
    await asyncio.shield(asyncio.to_thread(lease.release))
