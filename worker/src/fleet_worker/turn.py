"""A Turn's life, top to bottom: claim, prepare, execute, settle, commit, cleanup."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Executor
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import structlog
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session as OrmSession

from fleet_shared.blobs import BlobStore
from fleet_shared.config import Settings
from fleet_shared.db import queries, runs, workspace_versions
from fleet_shared.db.engine import run_whole
from fleet_shared.event_log import RunLog, lease_token
from fleet_shared.events import ChildProgress, RunWarning, StatusChanged
from fleet_shared.followups import start_promoted
from fleet_shared.jobs import JobQueue
from fleet_shared.manifests import Manifest, ManifestCache, WorkspaceState
from fleet_shared.run_state import RunCommand, RunStatus
from fleet_shared.shutdown import finish_even_if_cancelled
from fleet_shared.tenancy import DEFAULT_TENANT
from fleet_shared.transcript import fold_parts, tombstone_parts, usage_payload
from fleet_worker import metrics
from fleet_worker.approvals import ApprovalGate, ApprovalMode
from fleet_worker.artifacts import ARTIFACTS, stamp_limit
from fleet_worker.cancels import CancelListener
from fleet_worker.conversation import load_conversation
from fleet_worker.errors import LeaseLost, SandboxFailed, TurnCancelled
from fleet_worker.kept import keep_artifacts, keep_workspace
from fleet_worker.lease import RunLease
from fleet_worker.lm.script import Script
from fleet_worker.outcome import (
    SHUTDOWN_OUTCOME,
    Outcome,
    answer_event,
    failure_outcome,
    next_checkpoint,
    terminal_event,
    usage_event,
)
from fleet_worker.prices import NO_PRICES, PriceBook
from fleet_worker.program import ProgramRun, start_program, wait_for_program, with_observations
from fleet_worker.publisher import EventSink
from fleet_worker.sandbox.errors import SandboxError, SandboxUnavailable
from fleet_worker.sandbox.provider import FileStamp, SandboxLease, SandboxProvider
from fleet_worker.sandbox_release import release_when_acquired, timed
from fleet_worker.settlement import commit_failed, commit_with_retry
from fleet_worker.tenant_tokens import TenantTokens
from fleet_worker.turn_trace import TurnTrace, current, phase
from fleet_worker.workspace_io import stage_attachments, stage_skills

log = structlog.get_logger(__name__)
SETTLE_GRACE_SECONDS = 60.0  # the commit may retry this long past the Turn's deadline
PUBLISH_TERMINAL_SECONDS = 30.0
MANIFEST_CACHE_BYTES = 64 * 2**20  # manifests held at most, weighed as their encodings


@dataclass
class WorkerDeps:
    """Process-wide resources, built once in the job worker's startup hook."""

    settings: Settings
    db_sessions: async_sessionmaker[AsyncSession]
    redis: Redis
    runlog: RunLog
    sandboxes: SandboxProvider
    blobs: BlobStore  # attachment and artifact bytes
    scripts: dict[Path, Script]
    programs: Executor  # RLM programs, one thread per concurrent Turn
    sandbox_ops: Executor  # acquire, interrupt, release: never queued behind a program
    cancels: CancelListener
    jobs: JobQueue  # a follow-up's, once this worker ended the Run ahead of it
    prices: PriceBook = NO_PRICES  # each configured LM's, resolved at start
    worker_id: str = "worker"
    # Manifests this worker decoded or captured: a warm session's claim reads no entries.
    manifests: ManifestCache[Manifest] = field(default_factory=lambda: ManifestCache(MANIFEST_CACHE_BYTES))


@dataclass(frozen=True)
class Claim:
    run_id: str
    session_id: str
    workspace_id: str
    attempt: int
    user_sequence: int
    started: float
    tenant: str = DEFAULT_TENANT  # its session's (fleet_shared.tenancy): bound into every log line
    checkpoint_version: int = 0  # the session's task checkpoint as this Run found it
    task: dict[str, Any] | None = None
    workspace: WorkspaceState | None = None  # its latest version, which the Run starts from
    traceparent: str | None = None  # the POST's span: the worker's join its trace
    approval: ApprovalMode = "never"  # the Turn's, else its session's (fleet_worker.approvals)
    program_version_id: str | None = None  # the program version it runs (fleet_shared.db.programs)
    instructions: str | None = None  # that version's text; None: the shipped instructions

    @property
    def span_attributes(self) -> dict[str, Any]:
        ids = {"run_id": self.run_id, "session_id": self.session_id, "attempt": self.attempt}
        return {f"fleet.{key}": value for key, value in {**ids, "tenant": self.tenant}.items()}


@dataclass
class HeldTurn:
    """What one running Turn holds; the program is set once it has started."""

    claim: Claim
    lease: RunLease
    sink: EventSink
    program: ProgramRun | None = None
    sandbox: SandboxLease | None = None
    request: str = ""  # the user's text, once loaded
    artifacts_before: dict[str, FileStamp] = field(default_factory=dict)  # what was there before
    trace: TurnTrace | None = None  # its spans, when tracing is on


async def run_turn(ctx: dict[str, Any], run_id: str) -> str:
    """The Turn's job (fleet_shared.jobs). A duplicate (the Run is no longer queued) does nothing."""
    deps: WorkerDeps = ctx["deps"]
    with structlog.contextvars.bound_contextvars(run_id=run_id, job_try=ctx.get("job_try")):
        # A cancel cannot stop a claim already under way (on SQLite it runs whole in a thread):
        # let it land, then end the Turn it started rather than leave it running, lease-less.
        claim, cancelled = await finish_even_if_cancelled(claim_run(deps, run_id))
        if claim is None:
            log.info("turn.duplicate_job")
            if cancelled:
                raise asyncio.CancelledError
            return "duplicate"
        with structlog.contextvars.bound_contextvars(tenant=claim.tenant):
            return await run_claimed(deps, ctx, claim, cancelled=cancelled)


async def run_claimed(deps: WorkerDeps, ctx: dict[str, Any], claim: Claim, *, cancelled: bool) -> str:
    """The claimed Turn, from its lease to its settlement; `cancelled`: the worker stopped meanwhile."""
    capture = deps.settings.profile.observability.tracing.capture_content
    trace = TurnTrace.begin(claim.traceparent, claim.span_attributes, capture, deps.prices.cost)
    async with AsyncExitStack() as cleanup:
        cleanup.enter_context(current(trace))  # the Turn's log lines carry its trace id
        if trace is not None:  # ended below; this ends it if the Turn never got that far
            cleanup.callback(trace.end, "abandoned", None, {})
        log.info("turn.claimed", attempt=claim.attempt)
        metrics.observe_queue_wait(ctx.get("enqueue_time"))
        turn = await hold(deps, claim, cleanup)
        turn.trace = trace
        try:
            if cancelled:  # the worker stopped during the claim: straight to the ending
                raise asyncio.CancelledError
            outcome = await prepare_and_execute(deps, turn, cleanup)
        except asyncio.CancelledError:
            # The worker is stopping and its drain time ran out: end the Turn properly.
            outcome, cancelled = with_observations(SHUTDOWN_OUTCOME, turn.program), True
        with phase(trace, "turn.settle"):
            status, cancelled_again = await finish_even_if_cancelled(settle_and_commit(deps, turn, outcome))
        if trace is not None:
            trace.end(status, outcome.failure_code, {"fleet.iterations": outcome.iterations})
    log.info("turn.settled", status=status, failure_code=outcome.failure_code)
    labelled = deps.settings.profile.observability.metrics_tenant_label
    metrics.observe_turn(status, claim.started, claim.tenant if labelled else None)
    if cancelled or cancelled_again:
        raise asyncio.CancelledError  # let arq see the cancellation, now that the Turn is settled
    return status


async def claim_run(deps: WorkerDeps, run_id: str) -> Claim | None:
    """queued → running, attempt + 1: from here on this worker owns the Run."""
    return await run_whole(
        deps.db_sessions, functools.partial(start_and_load, run_id=run_id, manifests=deps.manifests)
    )


def start_and_load(
    db: OrmSession, run_id: str, manifests: ManifestCache[Manifest] | None = None
) -> Claim | None:
    """The Run started (fenced: a duplicate job finds it no longer queued), then what the Turn
    needs of its session: the checkpoint, the task and the latest workspace version."""
    started = runs.start_run_on(db, run_id)
    if started is None:
        return None
    run, instructions = started
    found = workspace_versions.session_state_on(db, run.session_id, manifests)
    assert found is not None
    session, workspace = found
    return Claim(
        run_id=run.id,
        session_id=run.session_id,
        workspace_id=session.workspace_id,
        attempt=run.attempt,
        user_sequence=run.user_sequence,
        started=time.monotonic(),
        tenant=session.tenant_id,
        checkpoint_version=session.checkpoint_version,
        task=session.task,
        workspace=workspace,
        traceparent=run.traceparent,
        approval=cast(ApprovalMode, run.approval or session.approval or "never"),
        program_version_id=run.program_version_id,
        instructions=instructions,
    )


async def hold(deps: WorkerDeps, claim: Claim, cleanup: AsyncExitStack) -> HeldTurn:
    """The lease (released last), the cancel watch and the event sink, for the Turn's lifetime."""

    async def still_ours() -> bool:
        # Only a claim bumps the attempt: the same attempt means nobody took the Run over (and a
        # terminal Run at our attempt is our own commit, whose ending we still have to publish).
        async with deps.db_sessions() as db:
            run = await queries.get_run(db, claim.run_id)
        return run is not None and run.attempt == claim.attempt

    token = lease_token(claim.attempt, deps.worker_id)
    seconds = deps.settings.profile.worker.lease_seconds
    lease = await cleanup.enter_async_context(RunLease(deps.runlog, claim.run_id, token, seconds, still_ours))
    cleanup.enter_context(deps.cancels.watch(claim.run_id, lease.request_cancel))
    await deps.cancels.check_flags([claim.run_id])  # a cancel that came before the watch
    sink = EventSink(deps.runlog, claim.run_id, lease, max_events=deps.settings.profile.rlm.max_events)
    cleanup.push_async_callback(sink.close)
    return HeldTurn(claim, lease, sink)


async def prepare_and_execute(deps: WorkerDeps, turn: HeldTurn, cleanup: AsyncExitStack) -> Outcome:
    try:
        if turn.lease.lost.is_set():
            raise LeaseLost("a sweep took the Run over before this worker could start it")
        with phase(turn.trace, "turn.prepare"):
            prepared = await prepare(deps, turn, cleanup)
        return await execute(deps, turn, prepared)
    except Exception as exc:
        return with_observations(failure_outcome(exc), turn.program)


@dataclass(frozen=True)
class Prepared:
    request: str
    history: list[dict[str, str]]
    attachments: list[str]  # how the RLM is told about the staged files
    skills: list[str]  # the selected skill cards, as given to the RLM
    sandbox: SandboxLease


async def prepare(deps: WorkerDeps, turn: HeldTurn, cleanup: AsyncExitStack) -> Prepared:
    claim = turn.claim
    turn.sink.emit(StatusChanged(run_id=claim.run_id, phase="preparation"))
    rlm = deps.settings.profile.rlm
    loop = asyncio.get_running_loop()
    asked = time.monotonic()
    # The lease first: a workspace with no warm REPL starts one now, while the history loads.
    manifest = claim.workspace.manifest if claim.workspace is not None else None
    acquire = functools.partial(
        deps.sandboxes.acquire, claim.workspace_id, claim.run_id, claim.session_id, manifest
    )
    acquiring = loop.run_in_executor(deps.sandbox_ops, timed, acquire)
    provider = deps.settings.profile.sandbox.provider
    cleanup.push_async_callback(release_when_acquired, deps.sandbox_ops, provider, acquiring)
    conversation = await load_conversation(
        deps.db_sessions,
        claim.session_id,
        claim.user_sequence,
        max_turns=rlm.max_history_turns,
        max_chars=rlm.max_history_chars,
    )
    turn.request = conversation.request
    if turn.trace is not None:
        turn.trace.content(turn.trace.root, "fleet.request", conversation.request)
    if conversation.truncated:
        message = (
            f"the RLM sees only the last {rlm.max_history_turns} Turns of this session, "
            f"{rlm.max_history_chars} characters at most"
        )
        turn.sink.emit(RunWarning(run_id=claim.run_id, code="history_truncated", message=message))
    try:
        sandbox, granted = await acquiring
    except SandboxUnavailable as exc:
        raise SandboxFailed(str(exc), code="sandbox_unavailable") from None
    except OSError as exc:  # e.g. a workspace a past Run left unusable; reported scrubbed
        raise SandboxError(f"the sandbox could not start: {exc}") from None
    metrics.observe_lease_wait(provider, asked, granted)
    turn.sandbox = sandbox
    described = await loop.run_in_executor(
        deps.sandbox_ops, stage_attachments, deps.blobs, sandbox, conversation.attachments, turn.sink
    )
    skills = await loop.run_in_executor(
        deps.sandbox_ops, stage_skills, sandbox, conversation.skills, turn.sink
    )
    limit = stamp_limit(deps.settings.profile.storage.max_artifacts_per_run)
    turn.artifacts_before = await loop.run_in_executor(
        deps.sandbox_ops, sandbox.files.stamps, ARTIFACTS, limit
    )
    return Prepared(conversation.request, conversation.history, described, skills, sandbox)


async def execute(deps: WorkerDeps, turn: HeldTurn, prepared: Prepared) -> Outcome:
    """Run the RLM on its thread until it answers, times out, loses its lease, or is cancelled."""
    if turn.lease.cancel_requested.is_set():
        raise TurnCancelled("the Turn was cancelled before it started")
    turn.sink.emit(StatusChanged(run_id=turn.claim.run_id, phase="execution"))
    settings = deps.settings
    tokens = TenantTokens(
        deps.redis,
        asyncio.get_running_loop(),
        turn.claim.tenant,
        settings.profile.quotas.of(turn.claim.tenant).lm_tokens_per_day,
        labelled=settings.profile.observability.metrics_tenant_label,
    )
    await tokens.refresh()
    turn.program = start_program(
        deps.programs,
        settings=settings,
        scripts=deps.scripts,
        request=prepared.request,
        history=prepared.history,
        attachments=prepared.attachments,
        skills=prepared.skills,
        sandbox=prepared.sandbox,
        provider=deps.sandboxes,
        sink=turn.sink,
        tokens=tokens,
        trace=turn.trace,
        approvals=ApprovalGate.of(
            turn.claim.approval,
            deps.redis,
            turn.claim.run_id,
            settings.profile.runtime,
            turn.sink.emit_threadsafe,
        ),
        instructions=turn.claim.instructions,
    )
    timeout = settings.profile.runtime.turn_timeout_seconds
    result = await wait_for_program(turn.program, turn.lease, timeout, turn.sink, deps.sandbox_ops)
    return Outcome(
        RunCommand.COMPLETE,
        "completed",
        answer=result.answer,
        iterations=result.iterations,
        lm_usage=result.lm_usage,
        streamed_answer=result.streamed_answer,
    )


async def settle_and_commit(deps: WorkerDeps, turn: HeldTurn, outcome: Outcome) -> str:
    """Emit the last body events, commit Turn + events + status in one fenced transaction, and
    only then publish the terminal event: a client never sees an ending that was not committed."""
    claim, sink = turn.claim, turn.sink
    sink.emit(StatusChanged(run_id=claim.run_id, phase="settling"))
    duration_ms = int((time.monotonic() - claim.started) * 1000)
    if sink.broken and outcome.command is RunCommand.COMPLETE:
        message = f"the Turn's events could not be published ({sink.broken})"
        outcome = Outcome(RunCommand.FAIL, "failed", failure_code="sandbox_error", failure_message=message)
    await report_children(deps, turn)
    deadline = settle_deadline(deps, turn)
    if outcome.command is not RunCommand.CANCEL:
        outcome = await keep_artifacts(deps, turn, outcome, deadline)
    outcome, workspace = await keep_workspace(deps, turn, outcome, deadline)
    if outcome.answer is not None:
        sink.emit(answer_event(deps.settings.profile.rlm.max_answer_chars, sink.emit, claim.run_id, outcome))
    usage = usage_event(claim.run_id, outcome, duration_ms, deps.prices)
    sink.emit(usage)
    version = claim.checkpoint_version + 1
    terminal = sink.stamp_terminal(terminal_event(claim.run_id, outcome, duration_ms, version))
    cancelled = outcome.command is RunCommand.CANCEL
    settlement = runs.Settlement(
        run_id=claim.run_id,
        session_id=claim.session_id,
        attempt=claim.attempt,
        current=RunStatus.RUNNING,
        command=outcome.command,
        sequence=claim.user_sequence + 1,
        parts=tombstone_parts(usage) if cancelled else fold_parts(sink.events),
        turn_status=outcome.turn_status,
        events=sink.events,
        usage=usage_payload(usage),
        failure_code=outcome.failure_code,
        failure_message=outcome.failure_message,
        task=next_checkpoint(claim, turn.request, outcome),
        checkpoint_version=version,
        workspace=workspace,
    )
    try:
        committed = await commit_with_retry(deps.db_sessions, settlement, deadline=deadline)
    except Exception as exc:  # the database refused this ending for good, or stayed away too long
        log.error("turn.commit_failed", error_type=type(exc).__name__, exc_info=exc)
        settlement = commit_failed(settlement, terminal)
        sink.events[-1] = settlement.events[-1]  # the terminal that is published instead
        deadline = time.monotonic() + SETTLE_GRACE_SECONDS
        committed = await commit_with_retry(deps.db_sessions, settlement, deadline=deadline)
    if not committed:
        log.warning("turn.fenced_out")
        return "fenced"
    await sink.finish(within=PUBLISH_TERMINAL_SECONDS)
    await start_promoted(deps.db_sessions, deps.jobs, claim.session_id)  # a follow-up waited
    return settlement.turn_status


async def report_children(deps: WorkerDeps, turn: HeldTurn) -> None:
    """Every child RLM's end and cleanup is reported, also when its thread was abandoned."""
    children = turn.program.children if turn.program is not None else None
    if children is None:
        return
    loop = asyncio.get_running_loop()
    finals = await loop.run_in_executor(deps.sandbox_ops, children.settle)
    streamed = {(e.child_id, e.state) for e in turn.sink.events if isinstance(e, ChildProgress)}
    for event in finals:
        if (event.child_id, event.state) not in streamed:  # its thread's report was dropped
            turn.sink.emit(event)


def settle_deadline(deps: WorkerDeps, turn: HeldTurn) -> float:
    """The Turn's deadline (from its program's start), and at least a grace period from now."""
    start = turn.claim.started
    if turn.program is not None and turn.program.started.is_set():
        start = turn.program.started_at  # the loop's clock is time.monotonic()
    deadline = start + deps.settings.profile.runtime.turn_timeout_seconds
    return max(deadline, time.monotonic() + SETTLE_GRACE_SECONDS)
